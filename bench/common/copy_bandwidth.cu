// Copy bandwidth by a plain vectorized copy kernel: cudaMemcpyAsync device-to-device reads
// only ~2.8 TB/s on an H200, below what kernels reach (docs/benchmarking.md: 4.14 TB/s), so the
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
  const double bandwidth = timed_copy_bandwidth(copy, bytes);
  cudaFree(a);
  cudaFree(b);
  return bandwidth;
}

}  // namespace sy_bench
