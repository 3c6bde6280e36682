// CPU layout (DESIGN.md section 3). TODO(issue 2): implementation pending.
#include "cpu/backend.h"

namespace switchyard::cpu {

Status layout(const detail::LayoutArgs&) { return Status::Unsupported("layout: CPU backend not implemented yet"); }

}  // namespace switchyard::cpu
