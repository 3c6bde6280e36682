// Copy bandwidth by a plain vectorized copy kernel: cudaMemcpyAsync device-to-device reads
// only ~2.8 TB/s on our H200, below what kernels reach (BENCHMARKING.md: 4.14 TB/s), so the
// floors and "% of copy" figures use the better of the two.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/gpu_timing.h"

namespace sy_bench {

namespace {

__global__ void copy_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    dst[i] = a;
    dst[i + stride] = b;
    dst[i + 2 * stride] = c;
    dst[i + 3 * stride] = d;
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

}  // namespace

double measure_kernel_copy_bandwidth() {
  const std::size_t bytes = std::size_t(1) << 30;
  void *a = nullptr, *b = nullptr;
  if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess) {
    if (a) cudaFree(a);
    return 0;
  }
  cudaMemset(a, 1, bytes);
  int sms = 132;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const std::size_t n = bytes / sizeof(uint4);
  auto copy = [&](cudaStream_t s, int) {
    copy_kernel<<<sms * 8, 512, 0, s>>>(static_cast<const uint4*>(a), static_cast<uint4*>(b), n);
    return cudaGetLastError() == cudaSuccess;
  };
  time_in_graph(copy, 10, 20);  // warm-up
  double best_us = 0;
  for (int i = 0; i < 3; ++i) {
    const Timing t = time_in_graph(copy, 4, 25);
    if (t.ok && (best_us == 0 || t.median_us < best_us)) best_us = t.median_us;
  }
  cudaFree(a);
  cudaFree(b);
  return best_us > 0 ? 2.0 * bytes / (best_us * 1e-6) : 0;
}

}  // namespace sy_bench
