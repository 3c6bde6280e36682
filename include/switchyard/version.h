#pragma once

namespace switchyard {
// "0.1.0"
const char* version();
// Whether this build carries the CUDA backend.
bool built_with_cuda();
}  // namespace switchyard
