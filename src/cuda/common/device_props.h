// What the host-side plans of the CUDA backend read from the device (routing's plan_route, layout's
// and permute's launch shapes), read once per device by launch.cuh's current_device_props. Plain
// C++: the plans run, and are tested, on machines without a GPU.
#pragma once

#include <cstddef>

namespace switchyard::cuda {

struct DeviceProps {
  int sm_count = 0;                      // streaming multiprocessors
  std::size_t smem_per_block_optin = 0;  // dynamic shared memory a block may opt in to
  std::size_t l2_bytes = 0;              // L2 cache
};

}  // namespace switchyard::cuda
