// The differential side of the fuzz targets: after a call succeeds on the CPU, the same call on
// the CUDA backend (inputs copied to the device, outputs poisoned there) must give the same bytes.
// Enabled by fuzz_switchyard --cuda in builds with the CUDA backend.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "switchyard/ep.h"
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

// One rank of an expert-parallel call on the CPU group, as host views: its dispatch inputs, the
// CPU group's outputs (dispatch, and combine of identity experts: y = expert_x) and what those
// output buffers held before the calls.
struct EpRankViews {
  switchyard::ep::DispatchInputs in;
  switchyard::ep::DispatchOutputs out, initial;
  switchyard::TensorView combined, combined_initial;
};

// The same dispatch and combine of every rank on a loopback GpuGroup (R ranks on GPU 0, a stream
// each): "" when every output has the CPU group's bytes, else the first difference (or why the
// loopback group could not be built).
std::string ep_loopback_differs(const switchyard::ep::GroupConfig& config, const std::vector<EpRankViews>& ranks);

}  // namespace sy_fuzz
