// Picks the backend from the device of the validated arguments.
#pragma once

#include "switchyard/status.h"
#include "switchyard/tensor.h"

namespace switchyard::detail {

// Ok when `device` can run here: always for the CPU; for CUDA only in a CUDA build.
inline Status backend_available(const char* op, Device device) {
#if defined(SWITCHYARD_WITH_CUDA)
  (void)op;
  (void)device;
  return Status::Ok();
#else
  if (device.is_cuda()) {
    return Status::Unsupported(std::string(op) +
                               ": tensors are on a CUDA device but this build of Switchyard has no "
                               "CUDA backend (configure with SWITCHYARD_ENABLE_CUDA=ON and nvcc)");
  }
  return Status::Ok();
#endif
}

}  // namespace switchyard::detail
