// RoutingCuda.ApproxSigmoidBound's device helper (sigmoid_approx_bound.cu).
#pragma once

#include <cuda_runtime.h>

namespace sy_test {

// The largest |sigmoid_approx(s) - sigmoid_fast(s)| over every float with |s| <= 86.5
// (src/cuda/routing/route_warp.cuh; sigmoid_fast gives the oracle's bits there).
cudaError_t max_sigmoid_approx_error(float* out);

}  // namespace sy_test
