// Helpers for GPU tests: a skip with the reason when no GPU is usable, RAII device buffers,
// copies with checked return codes.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <string>
#include <vector>

namespace sy_test {

// Empty when a CUDA device is usable; otherwise why not.
inline std::string cuda_unavailable_reason() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) return std::string("no usable CUDA device: ") + cudaGetErrorString(err);
  if (n == 0) return "no CUDA device present";
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "cannot read CUDA device properties";
  if (prop.major < 9) return "the CUDA backend is built for sm_90a; device 0 is sm_" + std::to_string(prop.major * 10 + prop.minor);
  return "";
}

#define SY_SKIP_WITHOUT_GPU()                                                   \
  do {                                                                          \
    const std::string sy_reason_ = ::sy_test::cuda_unavailable_reason();        \
    if (!sy_reason_.empty()) GTEST_SKIP() << "GPU test skipped: " << sy_reason_; \
  } while (0)

#define SY_CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << cudaGetErrorString(expr)

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

}  // namespace sy_test
