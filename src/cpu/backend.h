// The CPU backend: the oracle of every GPU test and a real backend for machines without a GPU.
#pragma once

#include "common/op_args.h"
#include "switchyard/status.h"

namespace switchyard::cpu {

Status route(const detail::RouteArgs& args);
Status route_backward(const detail::RouteBackwardArgs& args);
Status layout(const detail::LayoutArgs& args);
Status gather(const detail::GatherArgs& args);
Status combine(const detail::CombineArgs& args);
Status combine_backward(const detail::CombineBackwardArgs& args);

}  // namespace switchyard::cpu
