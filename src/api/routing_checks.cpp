#include "api/routing_checks.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "switchyard/routing.h"

namespace switchyard::detail {

namespace {
std::string str(long long v) { return std::to_string(v); }
}  // namespace

Status check_routing_config(const ArgChecker& check, const RoutingConfig& c) {
  if (c.num_experts < 1) return check.fail_arg("config.num_experts", "must be >= 1, got " + str(c.num_experts));
  if (c.top_k < 1) return check.fail_arg("config.top_k", "must be >= 1, got " + str(c.top_k));
  if (c.top_k > c.num_experts) {
    return check.fail_arg("config.top_k", "K = " + str(c.top_k) + " exceeds the expert count E = " +
                                              str(c.num_experts));
  }
  if (static_cast<int>(c.pre) < 0 || static_cast<int>(c.pre) > 3) return check.fail_arg("config.pre", "unknown pre function");
  if (static_cast<int>(c.post) < 0 || static_cast<int>(c.post) > 3) return check.fail_arg("config.post", "unknown post function");
  if (static_cast<int>(c.group_rule) < 0 || static_cast<int>(c.group_rule) > 3) {
    return check.fail_arg("config.group_rule", "unknown group rule");
  }
  if (!std::isfinite(c.scale)) return check.fail_arg("config.scale", "must be finite");
  if (c.group_rule != GroupRule::kNone) {
    if (c.n_group < 1) return check.fail_arg("config.n_group", "must be >= 1, got " + str(c.n_group));
    if (c.num_experts % c.n_group != 0) {
      return check.fail_arg("config.n_group", "E = " + str(c.num_experts) + " is not divisible by n_group = " +
                                                  str(c.n_group));
    }
    if (c.topk_group < 1 || c.topk_group > c.n_group) {
      return check.fail_arg("config.topk_group", "must be in [1, n_group = " + str(c.n_group) + "], got " +
                                                     str(c.topk_group));
    }
    const int group_size = c.num_experts / c.n_group;
    if (static_cast<long long>(c.topk_group) * group_size < c.top_k) {
      return check.fail_arg("config.topk_group", "the kept groups hold " + str(static_cast<long long>(c.topk_group) * group_size) +
                                                     " experts, fewer than K = " + str(c.top_k));
    }
    if (c.group_rule == GroupRule::kTopKSum) {
      const int per_group = c.top_k / c.topk_group;
      if (per_group < 1 || per_group > group_size) {
        return check.fail_arg("config.topk_group", "topk_sum needs 1 <= K / topk_group <= E / n_group, got K / topk_group = " +
                                                       str(per_group));
      }
    }
  }
  return Status::Ok();
}

Status check_route_args(const ArgChecker& check, const RoutingConfig& config, const TensorView& logits,
                        const TensorView& bias, const TensorView& topk_ids,
                        const TensorView& topk_weights, RouteArgs* args, const char* weights_name) {
  SY_RETURN_IF_ERROR(check_routing_config(check, config));
  const std::int64_t E = config.num_experts;
  const std::int64_t K = config.top_k;
  SY_RETURN_IF_ERROR(check.tensor(logits, "logits", {DType::kFloat32, DType::kBFloat16, DType::kFloat16},
                                  {kAnySize, E}, logits.device, Contiguity::kRowStrided));
  const std::int64_t T = logits.shape[0];
  const Device device = logits.device;
  if (device.is_cuda()) {
    if (K > kMaxGpuTopK) {
      return check.fail_arg("config.top_k", "K = " + str(K) + " exceeds the CUDA backend's maximum of " +
                                                str(kMaxGpuTopK));
    }
    if (E > kMaxGpuExperts) {
      return check.fail_arg("config.num_experts", "E = " + str(E) + " exceeds the CUDA backend's maximum of " +
                                                      str(kMaxGpuExperts));
    }
  }
  if (!bias.absent()) {
    SY_RETURN_IF_ERROR(check.tensor(bias, "bias", {DType::kFloat32, DType::kBFloat16}, {E}, device));
  }
  SY_RETURN_IF_ERROR(check.tensor(topk_ids, "topk_ids", {DType::kInt32, DType::kInt64}, {T, K}, device));
  SY_RETURN_IF_ERROR(check.tensor(topk_weights, weights_name, {DType::kFloat32, DType::kBFloat16}, {T, K}, device));
  if (T * K > std::numeric_limits<std::int32_t>::max()) {
    return check.fail_arg("logits", "T * K = " + str(T * K) + " must be below 2^31");
  }
  args->config = config;
  args->num_tokens = T;
  args->logits = logits.data;
  args->logits_dtype = logits.dtype;
  args->logits_row_stride = T > 1 ? logits.strides[0] : E;
  args->bias = bias.absent() ? nullptr : bias.data;
  args->bias_dtype = bias.dtype;
  args->topk_ids = topk_ids.data;
  args->ids_dtype = topk_ids.dtype;
  args->topk_weights = topk_weights.data;
  args->weights_dtype = topk_weights.dtype;
  return Status::Ok();
}

Status check_layout_config(const ArgChecker& check, const LayoutConfig& c) {
  if (c.num_experts < 1) return check.fail_arg("config.num_experts", "must be >= 1, got " + str(c.num_experts));
  if (c.tile_size < 1) return check.fail_arg("config.tile_size", "must be >= 1, got " + str(c.tile_size));
  const LocalExperts& l = c.local;
  if (l.is_map()) {
    if (l.count < 0) return check.fail_arg("config.local.count", "the map form needs the local expert count L >= 0");
  } else if (l.count < 0) {
    if (l.start != 0 || l.stride != 1) {
      return check.fail_arg("config.local.count", "is -1 (all experts) but start/stride are not 0/1");
    }
  } else {
    if (l.stride < 1) return check.fail_arg("config.local.stride", "must be >= 1, got " + str(l.stride));
    if (l.start < 0 || l.start >= c.num_experts) {
      if (l.count > 0) {
        return check.fail_arg("config.local.start", "must be in [0, E = " + str(c.num_experts) + "), got " + str(l.start));
      }
    }
    if (l.count > 0 &&
        static_cast<long long>(l.start) + static_cast<long long>(l.count - 1) * l.stride >= c.num_experts) {
      return check.fail_arg("config.local.count", "the range start + (count-1)*stride reaches past E = " +
                                                      str(c.num_experts));
    }
  }
  return Status::Ok();
}

Status check_layout_args(const ArgChecker& check, const LayoutConfig& config, const TensorView& topk_ids,
                         const Layout& out, void* workspace, std::size_t workspace_bytes,
                         LayoutArgs* args) {
  SY_RETURN_IF_ERROR(check_layout_config(check, config));
  SY_RETURN_IF_ERROR(check.tensor(topk_ids, "topk_ids", {DType::kInt32, DType::kInt64}, {kAnySize, kAnySize},
                                  topk_ids.device));
  const Device device = topk_ids.device;
  const std::int64_t T = topk_ids.shape[0];
  const std::int64_t K = topk_ids.shape[1];
  if (K < 1) return check.fail_arg("topk_ids", "K (its second dimension) must be >= 1, got " + str(K));
  if (T * K >= std::numeric_limits<std::int32_t>::max()) {
    return check.fail_arg("topk_ids", "T * K = " + str(T * K) + " must be below 2^31 - 1");
  }
  const int L = config.num_local();
  const int M = config.tile_size;
  if (config.local.is_map()) {
    SY_RETURN_IF_ERROR(check.tensor(config.local.expert_map, "config.local.expert_map", {DType::kInt32},
                                    {config.num_experts}, device));
  }
  const std::int64_t rows = max_permuted_rows(T, static_cast<int>(K), L, M);
  const std::int64_t tiles = max_tiles(T, static_cast<int>(K), L, M);
  if (rows >= std::numeric_limits<std::int32_t>::max()) {
    return check.fail_arg("config.tile_size", "max_permuted_rows = " + str(rows) + " must be below 2^31 - 1");
  }
  SY_RETURN_IF_ERROR(check.int32_array(out.counts, "out.counts", L, device));
  SY_RETURN_IF_ERROR(check.int32_array(out.offsets, "out.offsets", static_cast<std::int64_t>(L) + 1, device));
  SY_RETURN_IF_ERROR(check.int32_array(out.permuted_to_expanded, "out.permuted_to_expanded", rows, device));
  SY_RETURN_IF_ERROR(check.int32_array(out.permuted_to_token, "out.permuted_to_token", rows, device));
  SY_RETURN_IF_ERROR(check.tensor(out.expanded_to_permuted, "out.expanded_to_permuted", {DType::kInt32}, {T, K}, device));
  SY_RETURN_IF_ERROR(check.int32_array(out.tile_expert, "out.tile_expert", tiles, device));
  SY_RETURN_IF_ERROR(check.int32_array(out.tile_row_end, "out.tile_row_end", tiles, device));
  SY_RETURN_IF_ERROR(check.int32_array(out.totals, "out.totals", kNumTotals, device));

  args->num_experts = config.num_experts;
  args->num_local = L;
  args->tile_size = M;
  args->independent_blocks = config.independent_blocks;
  args->local_start = config.local.count < 0 ? 0 : config.local.start;
  args->local_stride = config.local.count < 0 ? 1 : config.local.stride;
  args->expert_map = config.local.is_map() ? static_cast<const std::int32_t*>(config.local.expert_map.data) : nullptr;
  args->num_tokens = T;
  args->top_k = static_cast<int>(K);
  args->topk_ids = topk_ids.data;
  args->ids_dtype = topk_ids.dtype;
  args->capacity_rows = rows;
  args->capacity_tiles = tiles;
  args->counts = static_cast<std::int32_t*>(out.counts.data);
  args->offsets = static_cast<std::int32_t*>(out.offsets.data);
  args->permuted_to_expanded = static_cast<std::int32_t*>(out.permuted_to_expanded.data);
  args->permuted_to_token = static_cast<std::int32_t*>(out.permuted_to_token.data);
  args->expanded_to_permuted = static_cast<std::int32_t*>(out.expanded_to_permuted.data);
  args->tile_expert = static_cast<std::int32_t*>(out.tile_expert.data);
  args->tile_row_end = static_cast<std::int32_t*>(out.tile_row_end.data);
  args->totals = static_cast<std::int32_t*>(out.totals.data);
  args->workspace = workspace;
  args->workspace_bytes = workspace_bytes;
  return Status::Ok();
}

}  // namespace switchyard::detail
