// Expert parallelism: configuration checks, size queries and the argument checks shared by the
// CPU and GPU groups.
#include <string>

#include "api/ep_checks.h"
#include "common/ep_memory.h"
#include "common/validate.h"
#include "switchyard/ep.h"
#include "switchyard/permute.h"

namespace switchyard::ep {

using switchyard::detail::ArgChecker;
using switchyard::detail::Contiguity;
using switchyard::detail::kAnySize;

Status validate(const GroupConfig& c) {
  auto bad = [&](const char* field, const std::string& what) {
    return Status::InvalidArgument(std::string("ep group: config.") + field + " " + what);
  };
  if (c.num_ranks < 1) return bad("num_ranks", "= " + std::to_string(c.num_ranks) + ", must be >= 1");
  if (c.num_experts < 1 || c.num_experts % c.num_ranks != 0) {
    return bad("num_experts", "= " + std::to_string(c.num_experts) + ", must be a positive multiple of num_ranks = " +
                                  std::to_string(c.num_ranks));
  }
  if (c.top_k < 1 || c.top_k > c.num_experts) {
    return bad("top_k", "= " + std::to_string(c.top_k) + ", must be in [1, num_experts = " +
                            std::to_string(c.num_experts) + "]");
  }
  if (c.max_tokens < 1 || c.max_tokens > (std::int64_t{1} << 31) / c.num_ranks / c.top_k) {
    return bad("max_tokens", "= " + std::to_string(c.max_tokens) + ", must be >= 1 with num_ranks * max_tokens * " +
                                 "top_k below 2^31");
  }
  if (c.hidden < 1) return bad("hidden", "= " + std::to_string(c.hidden) + ", must be >= 1");
  if (c.dtype != DType::kBFloat16 && c.dtype != DType::kFloat16 && c.dtype != DType::kFloat32 &&
      c.dtype != DType::kFloat8E4M3) {
    return bad("dtype", std::string("= ") + dtype_name(c.dtype) + ", must be bf16, fp16, fp32 or fp8_e4m3");
  }
  const std::int64_t groups = (c.hidden + kScaleGroupSize - 1) / kScaleGroupSize;
  if (c.scale_cols != 0 && (c.dtype != DType::kFloat8E4M3 || (c.scale_cols != 1 && c.scale_cols != groups))) {
    return bad("scale_cols", "= " + std::to_string(c.scale_cols) + ", must be 0, or 1 or " + std::to_string(groups) +
                                 " (per 128-column group) with fp8_e4m3 rows");
  }
  if (c.tile_size < 1) return bad("tile_size", "= " + std::to_string(c.tile_size) + ", must be >= 1");
  if (!(c.timeout_seconds > 0)) return bad("timeout_seconds", "must be > 0");
  if (c.partial_dtype != DType::kFloat32 && c.partial_dtype != DType::kBFloat16) {
    return bad("partial_dtype", std::string("= ") + dtype_name(c.partial_dtype) + ", must be fp32 or bf16");
  }
  return Status::Ok();
}

std::int64_t max_recv_rows(const GroupConfig& c) { return static_cast<std::int64_t>(c.num_ranks) * c.max_tokens; }

std::int64_t max_expert_rows(const GroupConfig& c) {
  return max_permuted_rows(max_recv_rows(c), c.top_k, c.experts_per_rank(), c.tile_size);
}

std::int64_t handle_bytes(const GroupConfig& c) { return detail::handle_offsets(c).total; }

namespace detail {

Status check_rank(const char* op, int rank, int num_ranks) {
  if (rank >= 0 && rank < num_ranks) return Status::Ok();
  return Status::InvalidArgument(std::string(op) + ": argument 'rank' = " + std::to_string(rank) +
                                 ", must be in [0, " + std::to_string(num_ranks) + ")");
}

// Checks one rank's dispatch arguments (message without the op prefix when `check` adds it).
Status check_dispatch(const GroupConfig& c, const ArgChecker& check, const DispatchInputs& in,
                      const DispatchOutputs& out, Device cpu) {
  const std::int64_t H = c.hidden;
  const int K = c.top_k;
  const int L = c.experts_per_rank();
  SY_RETURN_IF_ERROR(check.tensor(in.x, "in.x", {c.dtype}, {kAnySize, H}, cpu, Contiguity::kRowStrided));
  const std::int64_t T = in.x.shape[0];
  if (T > c.max_tokens) {
    return check.fail_arg("in.x", "has " + std::to_string(T) + " rows, more than max_tokens = " +
                                      std::to_string(c.max_tokens));
  }
  if (c.scale_cols > 0) {
    SY_RETURN_IF_ERROR(check.tensor(in.scales, "in.scales", {DType::kFloat32}, {T, c.scale_cols}, cpu));
  } else if (!in.scales.absent()) {
    return check.fail_arg("in.scales", "given, but the group moves no scales (config.scale_cols = 0)");
  }
  SY_RETURN_IF_ERROR(check.tensor(in.topk_ids, "in.topk_ids", {DType::kInt32, DType::kInt64}, {T, K}, cpu));
  SY_RETURN_IF_ERROR(check.tensor(in.topk_weights, "in.topk_weights", {DType::kFloat32}, {T, K}, cpu));

  const std::int64_t N = max_recv_rows(c);
  SY_RETURN_IF_ERROR(check.tensor(out.x, "out.x", {c.dtype}, {N, H}, cpu));
  if (c.scale_cols > 0) {
    SY_RETURN_IF_ERROR(check.tensor(out.scales, "out.scales", {DType::kFloat32}, {N, c.scale_cols}, cpu));
  }
  SY_RETURN_IF_ERROR(check.tensor(out.src_rank, "out.src_rank", {DType::kInt32}, {N}, cpu));
  SY_RETURN_IF_ERROR(check.tensor(out.src_token, "out.src_token", {DType::kInt32}, {N}, cpu));
  SY_RETURN_IF_ERROR(check.tensor(out.topk_ids, "out.topk_ids", {DType::kInt32}, {N, K}, cpu));
  SY_RETURN_IF_ERROR(check.tensor(out.topk_weights, "out.topk_weights", {DType::kFloat32}, {N, K}, cpu));
  SY_RETURN_IF_ERROR(check.tensor(out.stats, "out.stats", {DType::kInt64}, {kNumStats}, cpu));
  if (out.expert_x.absent()) return Status::Ok();

  const std::int64_t P = max_expert_rows(c);
  const std::int64_t tiles = max_tiles(N, K, L, c.tile_size);
  const Layout& l = out.layout;
  SY_RETURN_IF_ERROR(check.int32_array(l.counts, "out.layout.counts", L, cpu));
  SY_RETURN_IF_ERROR(check.int32_array(l.offsets, "out.layout.offsets", L + 1, cpu));
  SY_RETURN_IF_ERROR(check.int32_array(l.permuted_to_expanded, "out.layout.permuted_to_expanded", P, cpu));
  SY_RETURN_IF_ERROR(check.int32_array(l.permuted_to_token, "out.layout.permuted_to_token", P, cpu));
  SY_RETURN_IF_ERROR(check.tensor(l.expanded_to_permuted, "out.layout.expanded_to_permuted", {DType::kInt32},
                                  {N, K}, cpu));
  SY_RETURN_IF_ERROR(check.int32_array(l.tile_expert, "out.layout.tile_expert", tiles, cpu));
  SY_RETURN_IF_ERROR(check.int32_array(l.tile_row_end, "out.layout.tile_row_end", tiles, cpu));
  SY_RETURN_IF_ERROR(check.int32_array(l.totals, "out.layout.totals", kNumTotals, cpu));
  if (l.permuted_to_token.shape[0] != P) {
    return check.fail_arg("out.layout.permuted_to_token",
                          "has " + std::to_string(l.permuted_to_token.shape[0]) +
                              " rows; expected exactly max_expert_rows = " + std::to_string(P));
  }
  SY_RETURN_IF_ERROR(check.tensor(out.expert_x, "out.expert_x", {c.dtype}, {P, H}, cpu));
  if (c.scale_cols > 0) {
    SY_RETURN_IF_ERROR(
        check.tensor(out.expert_scales, "out.expert_scales", {DType::kFloat32}, {P, c.scale_cols}, cpu));
  }
  return Status::Ok();
}

}  // namespace detail
}  // namespace switchyard::ep

#if !defined(SWITCHYARD_WITH_CUDA)
// Builds without the CUDA backend: the GPU group exists, and says why it cannot be created.
namespace switchyard::ep {

struct GpuGroup::State {
  GroupConfig config;
  GpuOptions options;
};

namespace {
Status no_cuda(const char* op) {
  return Status::Unsupported(std::string(op) +
                             ": this build of Switchyard has no CUDA backend (configure with "
                             "SWITCHYARD_ENABLE_CUDA=ON and nvcc)");
}
}  // namespace

GpuGroup::GpuGroup(std::unique_ptr<State> state) : state_(std::move(state)) {}
GpuGroup::~GpuGroup() = default;
Status GpuGroup::create_loopback(const GroupConfig&, const GpuOptions&, int, std::unique_ptr<GpuGroup>*) {
  return no_cuda("ep loopback group");
}
Status GpuGroup::create_ipc(const GroupConfig&, const GpuOptions&, int, const AllGather&,
                            std::unique_ptr<GpuGroup>*) {
  return no_cuda("ep ipc group");
}
const GroupConfig& GpuGroup::config() const { return state_->config; }
const GpuOptions& GpuGroup::options() const { return state_->options; }
bool GpuGroup::is_local(int) const { return false; }
Status GpuGroup::dispatch(int, const DispatchInputs&, const DispatchOutputs&, Handle*, bool, Stream) {
  return no_cuda("ep dispatch");
}
Status GpuGroup::received_rows(int, std::int64_t*) { return no_cuda("ep received_rows"); }
Status GpuGroup::adopt_handle(int, const TensorView&, std::int64_t, bool, Handle*) const {
  return no_cuda("ep adopt_handle");
}
Status GpuGroup::combine(int, const Handle&, const CombineInputs&, const TensorView&, bool, Stream) {
  return no_cuda("ep combine");
}
Status GpuGroup::check(int) const { return no_cuda("ep check"); }
std::int64_t GpuGroup::region_bytes(const GroupConfig& config) { return detail::region_offsets(config).total; }

}  // namespace switchyard::ep
#endif
