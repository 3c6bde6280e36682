// CUDA layout kernels (DESIGN.md section 3). TODO(issue 4): implementation pending.
#include "cuda/backend.h"

namespace switchyard::cuda {

std::size_t layout_workspace_bytes(const detail::LayoutArgs&) { return 0; }
Status layout(const detail::LayoutArgs&, Stream) { return Status::Unsupported("layout: CUDA backend not implemented yet"); }
Status route_and_layout(const detail::RouteArgs&, const detail::LayoutArgs&, Stream) {
  return Status::Unsupported("route_and_layout: CUDA backend not implemented yet");
}

}  // namespace switchyard::cuda
