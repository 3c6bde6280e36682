// The CUDA backend's launchers. Each enqueues its kernels on `stream` and returns at once:
// no allocation, no host synchronization, capturable in a CUDA graph.
#pragma once

#include <cstddef>

#include "common/op_args.h"
#include "switchyard/status.h"
#include "switchyard/tensor.h"

namespace switchyard::cuda {

Status route(const detail::RouteArgs& args, Stream stream);
Status route_backward(const detail::RouteBackwardArgs& args, Stream stream);

// Scratch bytes the CUDA layout needs for these shapes.
std::size_t layout_workspace_bytes(const detail::LayoutArgs& shape);
Status layout(const detail::LayoutArgs& args, Stream stream);
// Route, then layout: two kernels chained by programmatic dependent launch (layout.cu says why
// not one).
Status route_and_layout(const detail::RouteArgs& route_args, const detail::LayoutArgs& layout_args,
                        Stream stream);

Status gather(const detail::GatherArgs& args, Stream stream);
Status combine(const detail::CombineArgs& args, Stream stream);
Status combine_backward(const detail::CombineBackwardArgs& args, Stream stream);

}  // namespace switchyard::cuda
