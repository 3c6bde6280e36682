// Helpers for GPU tests: a skip with the reason when no GPU is usable, RAII device buffers,
// copies with checked return codes, RAII CUDA-graph capture and replay.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "cuda_unavailable.h"

#include <cstddef>
#include <string>
#include <vector>

namespace sy_test {

#define SY_SKIP_WITHOUT_GPU()                                                   \
  do {                                                                          \
    const std::string sy_reason_ = ::sy_test::cuda_unavailable_reason();        \
    if (!sy_reason_.empty()) GTEST_SKIP() << "GPU test skipped: " << sy_reason_; \
  } while (0)

// Evaluates expr once (the message must not re-run a launch or an end of capture).
#define SY_CUDA_OK(expr)                                                  \
  do {                                                                    \
    const cudaError_t sy_err_ = (expr);                                   \
    ASSERT_EQ(sy_err_, cudaSuccess) << cudaGetErrorString(sy_err_);       \
  } while (0)

// A device allocation freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
    if (bytes > 0 && cudaMalloc(&ptr_, bytes) != cudaSuccess) ptr_ = nullptr;
  }
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; o.bytes_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      if (ptr_) cudaFree(ptr_);
      ptr_ = o.ptr_;
      bytes_ = o.bytes_;
      o.ptr_ = nullptr;
      o.bytes_ = 0;
    }
    return *this;
  }
  void* get() const { return ptr_; }
  template <typename T> T* as() const { return static_cast<T*>(ptr_); }
  std::size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

template <typename T>
DeviceBuffer to_device(const std::vector<T>& host) {
  DeviceBuffer b(host.size() * sizeof(T) + 16);  // +16: never a zero-size allocation
  if (b.get() && !host.empty()) cudaMemcpy(b.get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  return b;
}

template <typename T>
std::vector<T> to_host(const DeviceBuffer& b, std::size_t count) {
  std::vector<T> host(count);
  if (count > 0) cudaMemcpy(host.data(), b.get(), count * sizeof(T), cudaMemcpyDeviceToHost);
  return host;
}

// Fills a device buffer with a poison byte pattern.
inline void poison(const DeviceBuffer& b, int byte = 0xA5) {
  if (b.get()) cudaMemset(b.get(), byte, b.bytes());
}

// Work captured in a CUDA graph on its own non-blocking stream, then replayed: owns the stream,
// the graph and its instance, freed on destruction (so an ASSERT that returns early leaks none).
// Each call returns the CUDA error for SY_CUDA_OK.
class CapturedGraph {
 public:
  CapturedGraph() : error_(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)) {
    if (error_ != cudaSuccess) stream_ = nullptr;
  }
  ~CapturedGraph() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
    if (stream_) {
      // Left capturing (an early return between begin and end): end it, dropping the graph.
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      if (cudaStreamIsCapturing(stream_, &status) == cudaSuccess && status != cudaStreamCaptureStatusNone) {
        cudaGraph_t partial = nullptr;
        cudaStreamEndCapture(stream_, &partial);
        if (partial) cudaGraphDestroy(partial);
      }
      cudaStreamDestroy(stream_);
    }
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;

  cudaStream_t stream() const { return stream_; }
  // Starts capturing the work issued on stream() (thread-local mode); the stream's creation error
  // if it failed.
  cudaError_t begin() {
    if (error_ != cudaSuccess) return error_;
    return cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal);
  }
  // Ends the capture and instantiates the graph.
  cudaError_t end() {
    const cudaError_t err = cudaStreamEndCapture(stream_, &graph_);
    if (err != cudaSuccess) return err;
    return cudaGraphInstantiate(&exec_, graph_, 0);
  }
  // Launches the graph on stream() without waiting.
  cudaError_t launch() { return cudaGraphLaunch(exec_, stream_); }
  // Launches the graph on stream() and waits for it.
  cudaError_t replay() {
    const cudaError_t err = cudaGraphLaunch(exec_, stream_);
    if (err != cudaSuccess) return err;
    return cudaStreamSynchronize(stream_);
  }

 private:
  cudaStream_t stream_ = nullptr;
  cudaError_t error_ = cudaSuccess;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace sy_test
