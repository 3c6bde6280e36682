// The single-launch route + layout of the CUDA backend (route_layout.cu), for layout.cu.
#pragma once

#include <cuda_runtime.h>

#include "common/op_args.h"
#include "cuda/layout/layout_kernels.cuh"
#include "switchyard/status.h"

namespace switchyard::cuda::layout_detail {

// Routes every row and lays the picks out in one kernel of `blocks` blocks when that kernel
// serves the call (T rows fit one block's warps, N = T*K picks one group of 32 per warp, its
// shared memory fits); then sets *launched. Otherwise launches nothing, leaves *launched false
// and returns Ok. `p` holds the one-block form's slices for `blocks` (layout.cu,
// with_block_slices) and `route_args` the validated routing arguments of the same call.
Status route_and_layout_one_launch(const detail::RouteArgs& route_args, const LayoutParams& p, long long blocks,
                                   cudaStream_t stream, bool* launched);

}  // namespace switchyard::cuda::layout_detail
