// Checks shared by route() and route_and_layout(), and by layout() and route_and_layout().
#pragma once

#include "common/op_args.h"
#include "common/validate.h"
#include "switchyard/layout.h"
#include "switchyard/routing.h"

namespace switchyard::detail {

Status check_routing_config(const ArgChecker& check, const RoutingConfig& config);

// Validates route()'s arguments and flattens them into `args` (nothing is written elsewhere).
Status check_route_args(const ArgChecker& check, const RoutingConfig& config,
                        const TensorView& logits, const TensorView& bias,
                        const TensorView& topk_ids, const TensorView& topk_weights,
                        RouteArgs* args,
                        const char* weights_name = "topk_weights");

Status check_layout_config(const ArgChecker& check, const LayoutConfig& config);

// Validates layout()'s arguments for ids of shape [T,K] of `ids_dtype` on `device` and
// flattens them into `args`.
Status check_layout_args(const ArgChecker& check, const LayoutConfig& config,
                         const TensorView& topk_ids, const Layout& out, void* workspace,
                         std::size_t workspace_bytes, LayoutArgs* args);

}  // namespace switchyard::detail
