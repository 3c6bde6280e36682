// The differential side of the fuzz targets: after a call succeeds on the CPU, the same call on
// the CUDA backend (inputs copied to the device, outputs poisoned there) must give the same bytes.
// Enabled by fuzz_switchyard --cuda in builds with the CUDA backend.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "switchyard/layout.h"
#include "switchyard/tensor.h"

namespace sy_fuzz {

// Whether targets also run their calls on the GPU (set by the driver).
bool& cuda_enabled();
// Empty when a GPU can run the CUDA backend, else why not.
std::string cuda_unavailable();

// Device copies of one call's views. in(): a device copy of a host input; out(): poisoned device
// memory for an output whose CPU result the host view holds. check() synchronizes, copies the
// outputs back and returns "" or the first output whose bytes differ from the CPU's.
class Mirror {
 public:
  Mirror();
  ~Mirror();
  Mirror(const Mirror&) = delete;
  Mirror& operator=(const Mirror&) = delete;
  switchyard::TensorView in(const switchyard::TensorView& host);
  switchyard::Layout in(const switchyard::Layout& host);
  // `initial` (same extent as host): the device output starts as a copy of it (accumulating
  // outputs) instead of poison.
  switchyard::TensorView out(const switchyard::TensorView& host, const char* name, const void* initial = nullptr);
  switchyard::Layout out(const switchyard::Layout& host);
  void* scratch(std::size_t bytes);
  std::string check();

  struct State;

 private:
  std::unique_ptr<State> state_;
};

}  // namespace sy_fuzz
