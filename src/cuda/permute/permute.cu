// CUDA gather and combine (DESIGN.md section 4). TODO(issue 5): implementation pending.
#include "cuda/backend.h"

namespace switchyard::cuda {

Status gather(const detail::GatherArgs&, Stream) { return Status::Unsupported("gather: CUDA backend not implemented yet"); }
Status combine(const detail::CombineArgs&, Stream) { return Status::Unsupported("combine: CUDA backend not implemented yet"); }

}  // namespace switchyard::cuda
