// CUDA permute entry points beyond backend.h, for the API layer once it passes them their
// arguments, and for the GPU tests and the benchmark, which call them directly.
#pragma once

#include <cstdint>

#include "common/op_args.h"
#include "switchyard/status.h"
#include "switchyard/tensor.h"

namespace switchyard::cuda {

// Token-major gather: writes exactly what gather(args) writes, for any input, but reads each
// token row once and writes it to all its rows, where gather() (which sees only
// permuted_to_token) reads one token row per permuted row, i.e. K times per token from HBM
// once x is larger than L2. Needs the layout's expanded_to_permuted [T, top_k] (contiguous).
Status gather_token_major(const detail::GatherArgs& args, const std::int32_t* expanded_to_permuted, int top_k,
                          Stream stream);

}  // namespace switchyard::cuda
