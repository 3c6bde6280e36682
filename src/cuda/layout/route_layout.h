// The one-launch route + layout of the CUDA backend (route_layout.cu), for small T.
#pragma once

#include "common/op_args.h"
#include "switchyard/status.h"
#include "switchyard/tensor.h"

namespace switchyard::cuda {

// Launches route + layout as one kernel when the shapes allow it (see route_layout.cu) and sets
// *launched; otherwise launches nothing, leaves *launched false and returns Ok (the caller runs
// route() then layout()). Arguments are validated by the API layer.
Status route_and_layout_one_launch(const detail::RouteArgs& route_args, const detail::LayoutArgs& layout_args,
                                   Stream stream, bool* launched);

}  // namespace switchyard::cuda
