// GPU timing as docs/benchmarking.md fixes it: capture `calls_per_graph` back-to-back
// calls in one CUDA graph, replay it `replays` times with events around each replay, and
// report the median (and spread) of replay time / calls_per_graph.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace sy_bench {

struct Timing {
  double median_us = 0;
  double p10_us = 0;
  double p90_us = 0;
  bool ok = false;
  std::string error;
};

inline bool cuda_ok(cudaError_t e, std::string* error) {
  if (e == cudaSuccess) return true;
  if (error && error->empty()) *error = cudaGetErrorString(e);
  return false;
}

// `enqueue(stream, i)` enqueues call i (i cycles over input sets, so inputs can rotate).
inline Timing time_in_graph(const std::function<bool(cudaStream_t, int)>& enqueue, int calls_per_graph = 20,
                            int replays = 200) {
  Timing t;
  cudaStream_t stream;
  if (!cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), &t.error)) return t;
  // Warm up eagerly once (module load, first-touch).
  for (int i = 0; i < 2; ++i) {
    if (!enqueue(stream, i)) {
      t.error = "enqueue failed during warm-up";
      cudaStreamDestroy(stream);
      return t;
    }
  }
  cudaStreamSynchronize(stream);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  bool enq_ok = true;
  cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), &t.error);
  for (int i = 0; i < calls_per_graph; ++i) enq_ok = enqueue(stream, i) && enq_ok;
  cuda_ok(cudaStreamEndCapture(stream, &graph), &t.error);
  if (!enq_ok || !graph || !cuda_ok(cudaGraphInstantiate(&exec, graph, 0), &t.error)) {
    if (t.error.empty()) t.error = "capture failed";
    if (graph) cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
    return t;
  }
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int i = 0; i < 3; ++i) cudaGraphLaunch(exec, stream);
  std::vector<double> us;
  us.reserve(replays);
  for (int r = 0; r < replays; ++r) {
    cudaEventRecord(start, stream);
    cudaGraphLaunch(exec, stream);
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    us.push_back(1000.0 * ms / calls_per_graph);
  }
  t.ok = cuda_ok(cudaGetLastError(), &t.error);
  std::sort(us.begin(), us.end());
  t.median_us = us[us.size() / 2];
  t.p10_us = us[us.size() / 10];
  t.p90_us = us[(us.size() * 9) / 10];
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  return t;
}

// Bytes/s (read + written) of `copy`, which moves `bytes` per call: ~200 calls to warm the clocks
// up, then the best median of three graph timings.
inline double timed_copy_bandwidth(const std::function<bool(cudaStream_t, int)>& copy, size_t bytes) {
  time_in_graph(copy, 10, 20);
  double best_us = 0;
  for (int i = 0; i < 3; ++i) {
    const Timing t = time_in_graph(copy, 4, 25);
    if (t.ok && (best_us == 0 || t.median_us < best_us)) best_us = t.median_us;
  }
  return best_us > 0 ? 2.0 * bytes / (best_us * 1e-6) : 0;
}

// Copy bandwidth (bytes read + written, bytes/s) of a vectorized copy kernel over 1 GiB
// (bench/common/copy_bandwidth.cu).
double measure_kernel_copy_bandwidth();

// Device-to-device copy bandwidth in bytes/s (bytes read + written): 1 GiB copies, after
// warming the clocks up; the best median of three graph timings, and the better of
// cudaMemcpyAsync and a copy kernel (docs/benchmarking.md measured 4.14 TB/s on an H200).
inline double measure_copy_bandwidth() {
  const size_t bytes = size_t(1) << 30;
  void *a = nullptr, *b = nullptr;
  if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess) {
    if (a) cudaFree(a);
    return 0;
  }
  cudaMemset(a, 1, bytes);
  auto copy = [&](cudaStream_t s, int) {
    return cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s) == cudaSuccess;
  };
  const double memcpy_bw = timed_copy_bandwidth(copy, bytes);
  cudaFree(a);
  cudaFree(b);
  const double kernel_bw = measure_kernel_copy_bandwidth();
  return memcpy_bw > kernel_bw ? memcpy_bw : kernel_bw;
}

// The non-empty comma-separated parts of s ("a,,b" -> {"a", "b"}).
inline std::vector<std::string> comma_parts(const std::string& s) {
  std::vector<std::string> out;
  std::size_t pos = 0;
  while (pos < s.size()) {
    const std::size_t end = std::min(s.find(',', pos), s.size());
    if (end > pos) out.push_back(s.substr(pos, end - pos));
    pos = end + 1;
  }
  return out;
}

// SY_BENCH_TOKENS="4096,65536" restricts a benchmark to those token counts, so that a profiler
// (ncu -c 1) sees the point of interest first; unset or empty: every point. bench_routing takes any
// counts from it (token_list); the other benches only select among their own (token_selected).
inline std::vector<std::int64_t> token_list(const std::vector<std::int64_t>& defaults) {
  const char* env = std::getenv("SY_BENCH_TOKENS");
  if (env == nullptr || *env == '\0') return defaults;
  std::vector<std::int64_t> out;
  for (const std::string& part : comma_parts(env)) {
    const long long v = std::atoll(part.c_str());
    if (v > 0) out.push_back(v);
  }
  return out;
}

inline bool token_selected(std::int64_t tokens) {
  const char* env = std::getenv("SY_BENCH_TOKENS");
  if (env == nullptr || *env == '\0') return true;
  const std::vector<std::string> parts = comma_parts(env);
  return std::find(parts.begin(), parts.end(), std::to_string(tokens)) != parts.end();
}

inline std::string device_name() {
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) return "unknown";
  return p.name;
}

}  // namespace sy_bench
