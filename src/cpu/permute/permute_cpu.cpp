// CPU gather and combine (DESIGN.md section 4). TODO(issue 2): implementation pending.
#include "cpu/backend.h"

namespace switchyard::cpu {

Status gather(const detail::GatherArgs&) { return Status::Unsupported("gather: CPU backend not implemented yet"); }
Status combine(const detail::CombineArgs&) { return Status::Unsupported("combine: CPU backend not implemented yet"); }

}  // namespace switchyard::cpu
