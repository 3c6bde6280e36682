// Device side of RoutingCuda.ApproxSigmoidBound: the largest |sigmoid_approx(s) - sigmoid_fast(s)| over
// every float s with |s| <= 86.5, both signs (route_warp.cuh; the approximate selection's margins,
// common/approx_certify.h, assume at most kSigmoidApproxErr).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "cuda/routing/route_warp.cuh"
#include "routing/sigmoid_approx_bound.h"

namespace sy_test {
namespace {

// Non-negative floats order as their bits: the maximum goes through atomicMax on the bits.
__global__ void sigmoid_approx_error_kernel(std::uint32_t count, unsigned* max_bits) {
  namespace r = switchyard::cuda::routing::dev;
  float worst = 0.0f;
  const std::uint32_t stride = gridDim.x * blockDim.x;
  for (std::uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
    const float m = __uint_as_float(i);  // |s|: every float from +0 to 86.5
#pragma unroll
    for (int sign = 0; sign < 2; ++sign) {
      const float s = sign ? -m : m;
      worst = fmaxf(worst, fabsf(__fsub_rn(r::sigmoid_approx(s), r::sigmoid_fast(s))));
    }
  }
  for (int off = 16; off >= 1; off /= 2) worst = fmaxf(worst, __shfl_xor_sync(0xffffffffu, worst, off));
  if ((threadIdx.x & 31u) == 0) atomicMax(max_bits, __float_as_uint(worst));
}

}  // namespace

cudaError_t max_sigmoid_approx_error(float* out) {
  const std::uint32_t last = 0x42ad0000u;  // 86.5f
  unsigned* d = nullptr;
  cudaError_t err = cudaMalloc(&d, sizeof(unsigned));
  if (err != cudaSuccess) return err;
  err = cudaMemset(d, 0, sizeof(unsigned));
  if (err == cudaSuccess) {
    sigmoid_approx_error_kernel<<<132 * 16, 256>>>(last + 1u, d);
    err = cudaGetLastError();
  }
  unsigned bits = 0;
  if (err == cudaSuccess) err = cudaMemcpy(&bits, d, sizeof(unsigned), cudaMemcpyDeviceToHost);
  cudaFree(d);
  std::memcpy(out, &bits, sizeof(float));
  return err;
}

}  // namespace sy_test
