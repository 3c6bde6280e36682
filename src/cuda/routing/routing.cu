// CUDA routing kernels (DESIGN.md section 2). TODO(issue 3): implementation pending.
#include "cuda/backend.h"

namespace switchyard::cuda {

Status route(const detail::RouteArgs&, Stream) { return Status::Unsupported("route: CUDA backend not implemented yet"); }

}  // namespace switchyard::cuda
