// Public layout API: size queries, validation and backend dispatch.
#include <algorithm>
#include <cstdint>
#include <string>

#include "api/backend_dispatch.h"
#include "api/routing_checks.h"
#include "common/op_args.h"
#include "common/validate.h"
#include "cpu/backend.h"
#include "switchyard/layout.h"
#if defined(SWITCHYARD_WITH_CUDA)
#include "cuda/backend.h"
#endif

namespace switchyard {

std::int64_t max_permuted_rows(std::int64_t num_tokens, int top_k, int num_local, int tile_size) {
  if (num_tokens <= 0 || top_k <= 0 || num_local <= 0 || tile_size <= 0) return 0;
  const std::int64_t picks = num_tokens * top_k;
  // Every non-empty expert pads at most M - 1 rows, and at most min(L, T*K) are non-empty.
  return picks + std::min<std::int64_t>(num_local, picks) * (tile_size - 1);
}

std::int64_t max_tiles(std::int64_t num_tokens, int top_k, int num_local, int tile_size) {
  if (tile_size <= 0) return 0;
  const std::int64_t rows = max_permuted_rows(num_tokens, top_k, num_local, tile_size);
  return (rows + tile_size - 1) / tile_size;
}

Status validate(const LayoutConfig& config) {
  return detail::check_layout_config(detail::ArgChecker("validate"), config);
}

namespace {

Status workspace_bytes_for(const detail::LayoutArgs& shape, Device device, std::size_t* bytes) {
  *bytes = 0;
#if defined(SWITCHYARD_WITH_CUDA)
  if (device.is_cuda()) *bytes = cuda::layout_workspace_bytes(shape);
#else
  (void)shape;
  (void)device;
#endif
  return Status::Ok();
}

Status check_workspace(const detail::ArgChecker& check, const detail::LayoutArgs& args, Device device) {
  std::size_t need = 0;
  SY_RETURN_IF_ERROR(workspace_bytes_for(args, device, &need));
  if (args.workspace_bytes < need) {
    return check.fail_arg("workspace", std::to_string(args.workspace_bytes) + " bytes given, " +
                                           std::to_string(need) + " needed (layout_workspace_size)");
  }
  if (need > 0 && args.workspace == nullptr) return check.fail_arg("workspace", "is null");
  if (reinterpret_cast<std::uintptr_t>(args.workspace) % 16 != 0) {
    return check.fail_arg("workspace", "must be 16-byte aligned");
  }
  return Status::Ok();
}

}  // namespace

Status layout_workspace_size(const LayoutConfig& config, std::int64_t num_tokens, int top_k, Device device,
                             std::size_t* bytes) {
  const detail::ArgChecker check("layout_workspace_size");
  if (bytes == nullptr) return check.fail_arg("bytes", "is null");
  SY_RETURN_IF_ERROR(detail::check_layout_config(check, config));
  if (num_tokens < 0) return check.fail_arg("num_tokens", "must be >= 0");
  if (top_k < 1) return check.fail_arg("top_k", "must be >= 1");
  // A size for a backend this build lacks would be a guess; say so like layout() would.
  SY_RETURN_IF_ERROR(detail::backend_available("layout_workspace_size", device));
  detail::LayoutArgs shape;
  shape.num_experts = config.num_experts;
  shape.num_local = config.num_local();
  shape.tile_size = config.tile_size;
  shape.num_tokens = num_tokens;
  shape.top_k = top_k;
  shape.capacity_rows = max_permuted_rows(num_tokens, top_k, shape.num_local, config.tile_size);
  shape.capacity_tiles = max_tiles(num_tokens, top_k, shape.num_local, config.tile_size);
  return workspace_bytes_for(shape, device, bytes);
}

Status layout(const LayoutConfig& config, const TensorView& topk_ids, const Layout& out, void* workspace,
              std::size_t workspace_bytes, Stream stream, const LayoutOptions& options) {
  const detail::ArgChecker check("layout");
  detail::LayoutArgs args;
  SY_RETURN_IF_ERROR(detail::check_layout_args(check, config, topk_ids, out, workspace, workspace_bytes, &args));
  args.options = options;
  SY_RETURN_IF_ERROR(check_workspace(check, args, topk_ids.device));
  SY_RETURN_IF_ERROR(detail::backend_available("layout", topk_ids.device));
#if defined(SWITCHYARD_WITH_CUDA)
  if (topk_ids.device.is_cuda()) return cuda::layout(args, stream);
#endif
  (void)stream;
  return cpu::layout(args);
}

Status route_and_layout(const RoutingConfig& routing, const TensorView& logits, const TensorView& bias,
                        const TensorView& topk_ids, const TensorView& topk_weights,
                        const LayoutConfig& layout_config, const Layout& out, void* workspace,
                        std::size_t workspace_bytes, Stream stream, const RouteOptions& route_options,
                        const LayoutOptions& layout_options) {
  const detail::ArgChecker check("route_and_layout");
  detail::RouteArgs route_args;
  SY_RETURN_IF_ERROR(detail::check_route_args(check, routing, logits, bias, topk_ids, topk_weights, &route_args));
  route_args.options = route_options;
  if (layout_config.num_experts != routing.num_experts) {
    return check.fail_arg("layout_config.num_experts", "must equal routing.num_experts = " +
                                                           std::to_string(routing.num_experts));
  }
  detail::LayoutArgs layout_args;
  SY_RETURN_IF_ERROR(detail::check_layout_args(check, layout_config, topk_ids, out, workspace, workspace_bytes,
                                               &layout_args));
  layout_args.options = layout_options;
  SY_RETURN_IF_ERROR(check_workspace(check, layout_args, logits.device));
  SY_RETURN_IF_ERROR(detail::backend_available("route_and_layout", logits.device));
#if defined(SWITCHYARD_WITH_CUDA)
  if (logits.device.is_cuda()) return cuda::route_and_layout(route_args, layout_args, stream);
#endif
  (void)stream;
  if (route_args.num_tokens > 0) SY_RETURN_IF_ERROR(cpu::route(route_args));
  return cpu::layout(layout_args);
}

}  // namespace switchyard
