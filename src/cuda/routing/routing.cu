// CUDA routing (docs/design.md section 2): one launch, rows spread over warps. The arithmetic and
// the per-row algorithm live in route_warp.cuh (shared with fused kernels); the whole-warp and
// narrow-segment kernels in route_shape_launch.cuh, compiled per unit of row shapes in
// routing_shapes_<unit>.cu (route_shapes.h); this file holds the streamed-segment, one-row-a-thread
// and staged kernels, plan_route (route_plan.h), which picks the kernel and its launch shape, and
// route(), which launches the plan. Compiled with -fmad=false (see src/CMakeLists.txt).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>

#include "cuda/backend.h"
#include "cuda/common/launch.cuh"
#include "cuda/routing/route_rows.cuh"
#include "cuda/routing/route_shape_launch.cuh"
#include "cuda/routing/route_shapes.h"
#include "cuda/routing/route_staged.cuh"
#include "cuda/routing/route_warp.cuh"

namespace switchyard::cuda {

namespace {

using routing::RouteParams;

// Streamed narrow segments (route_warp.cuh's use_stream): route_warp_wide with 8 lanes a row, 4 rows a
// warp, streaming 2 stripes at a time into packed buffers of depth 4 (48 registers, 5 blocks per SM),
// for sigmoid + fp32 bias -> normalize without a group limit (GLM-4.5's rule), fp32 and bf16 logits.
// A whole warp holds such a row in 2 stripes of 128 (256 experts), so at E = 160 three of its eight
// values per lane are padding; 8 lanes hold E / 8 values each, in E / 32 stripes. Rows without that
// padding gain nothing from the form (docs/decisions/routing-wide-rows.md).
bool plan_route_stream(const RouteParams& p, const routing::RouteChoice& choice, const DeviceProps& props,
                         RoutePlan* plan, Status* status) {
  using Shape = routing::StreamShape<routing::kStreamLanes, 6, 4, 2, 5>;
  static_assert(routing::kStreamMaxExperts <= Shape::kMaxExperts, "the stream shape's experts");
  return plan_first_match<
      Shape, true, Spec<DType::kFloat32, PreFn::kSigmoid, true, kSpecGroupNone, PostFn::kNormalize>,
      Spec<DType::kBFloat16, PreFn::kSigmoid, true, kSpecGroupNone, PostFn::kNormalize>>(p, choice, props, plan,
                                                                                         status);
}

// One thread per row (route_rows.cuh): kE experts held, a buffer of kK picks; SpecT as for
// route_kernel (plan_route_rows_for's Specs, or SpecGeneric).
template <int kE, int kK, class SpecT>
__global__ void __launch_bounds__(256) route_rows_kernel(const RouteParams p0) {
  if (threadIdx.x == 0) {
    if (blockIdx.x < kWarmBlocks) keep_loaded(routing::route_params_xor(p0), p0.num_tokens < 0);
    if (gridDim.x <= kPrefetchMaxBlocks)
      routing::prefetch_route_inputs(p0, static_cast<std::int64_t>(blockIdx.x) * blockDim.x, blockDim.x);
  }
  pdl_wait();  // before any global access (launch.cuh PDL contract)
  pdl_launch_dependents();
  RouteParams p = p0;
  SpecTraits<SpecT>::apply(p);
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= p.num_tokens) return;  // no barrier follows
  routing::route_row_thread<kE, kK>(p, row);
}

template <int kE, int kK, class SpecT>
Status plan_route_rows(const RouteParams& p, const DeviceProps& props, RoutePlan* plan) {
  // Blocks of up to kRowsMaxWarpsPerBlock warps, fewer where that spreads the rows over more SMs (as
  // plan_route_kernel does with warps).
  const int sms = std::max(props.sm_count, 1);
  const std::int64_t warps = (p.num_tokens + 31) / 32;
  const std::int64_t spread = (warps + sms - 1) / sms;
  const int threads = 32 * static_cast<int>(std::clamp<std::int64_t>(spread, 1, routing::kRowsMaxWarpsPerBlock));
  const std::int64_t blocks = (p.num_tokens + threads - 1) / threads;
  return set_plan<route_rows_kernel<kE, kK, SpecT>>(blocks, threads, 0, plan);
}

// The route_rows kernel of the first of Specs... that matches p (the last one is SpecGeneric).
template <int kE, int kK, class... Specs>
Status plan_route_rows_spec(const RouteParams& p, const DeviceProps& props, RoutePlan* plan) {
  Status status = Status::Ok();
  first_spec_match<Specs...>(p, &status, [&](auto* spec) {
    return plan_route_rows<kE, kK, std::remove_pointer_t<decltype(spec)>>(p, props, plan);
  });
  return status;
}

// route_rows for p (routing::rows_kernel_fits): the smallest kE >= E and kK >= K, with specialised
// kernels for the rules of Mixtral (and Phi-3.5-MoE: none -> softmax) and DBRX (softmax ->
// normalize), fp32 and bf16 logits (docs/decisions/routing-specialised-kernels.md).
Status plan_route_rows_for(const RouteParams& p, const DeviceProps& props, RoutePlan* plan) {
  static_assert(routing::kRowsMaxExperts == 16 && routing::kRowsMaxTopK == 8, "the kernels below");
  const int e_cap = p.num_experts <= 8 ? 8 : 16;
  const int k_cap = p.top_k <= 2 ? 2 : p.top_k <= 4 ? 4 : 8;
  return dispatch_value<8, 16>("route rows: experts held", e_cap, [&](auto e) {
    return dispatch_value<2, 4, 8>("route rows: buffer depth", k_cap, [&](auto k) {
      return plan_route_rows_spec<decltype(e)::value, decltype(k)::value,
                                    NarrowNoneSoftmax<DType::kFloat32>, NarrowNoneSoftmax<DType::kBFloat16>,
                                    NarrowSoftmaxNormalize<DType::kFloat32>,
                                    NarrowSoftmaxNormalize<DType::kBFloat16>, SpecGeneric>(p, props, plan);
    });
  });
}

// Staged rows (route_staged.cuh): one thread a row through shared memory, for the staged rules (sigmoid
// + fp32 bias rows, any post function, without a group limit or with groups of 32 experts; rows of
// logits without a pre function or bias, any post function; softmax -> normalize without a bias),
// fp32 and bf16 logits; parameters of the rule fixed as in a Spec. 128-thread blocks, 4 per SM at most
// 128 registers. With a bias the block first copies it into shared memory.
template <DType kDtype, routing::StagedRule kRule, bool kGroups, bool kApprox>
__global__ void __launch_bounds__(routing::kStagedWarps * 32, 4) route_staged_kernel(const RouteParams p0) {
  using Layout = routing::StagedLayout<kDtype>;
  using routing::StagedRule;
  pdl_wait();  // before any global access (launch.cuh PDL contract)
  pdl_launch_dependents();
  RouteParams p = p0;
  p.logits_dtype = static_cast<int>(kDtype);
  p.logits_vec = 1;
  p.group_path = kGroups ? routing::kGroupChunks : routing::kGroupNone;
  extern __shared__ __align__(16) unsigned char staged_smem[];
  float* bias = reinterpret_cast<float*>(staged_smem);
  if constexpr (kRule == StagedRule::kSigmoidBias) {
    p.pre = PreFn::kSigmoid;
    p.bias_dtype = static_cast<int>(DType::kFloat32);
    p.bias_vec = 1;
    for (int i = static_cast<int>(threadIdx.x); i < p.num_experts / 4; i += static_cast<int>(blockDim.x)) {
      float4 b = __ldg(static_cast<const float4*>(p.bias) + i);
      if constexpr (kApprox) {
        // NaN -> -inf: q = p + b is then NaN only where p is, and canonical q (NaN -> -inf) is unchanged
        // (the approximate keys skip that step; route_staged.cuh).
        const auto no_nan = [](float x) { return x == x ? x : __uint_as_float(0xff800000u); };
        b = make_float4(no_nan(b.x), no_nan(b.y), no_nan(b.z), no_nan(b.w));
      }
      reinterpret_cast<float4*>(bias)[i] = b;
    }
    __syncthreads();
  } else {
    p.pre = kRule == StagedRule::kLogits ? PreFn::kNone : PreFn::kSoftmax;
    p.bias = nullptr;
    if constexpr (kRule == StagedRule::kSoftmaxPicks) p.post = PostFn::kNormalize;
  }
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const std::int64_t first_row = (static_cast<std::int64_t>(blockIdx.x) * routing::kStagedWarps + warp) * 32;
  if (first_row >= p.num_tokens) return;  // whole warp: no barrier follows
  routing::route_staged_warp<kDtype, kRule, kGroups, kApprox>(
      p, first_row, staged_smem + Layout::kBiasBytes + warp * Layout::kWarpBytes, bias);
}

// The staged kernel's opt-in to its shared memory, past the 48 KB default (RoutePlan::prepare).
template <auto kKernel, std::size_t kSmem>
Status grant_staged_smem() {
  const cudaError_t err = set_attribute_at_least<kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize>(kSmem);
  return cuda_status("route: staged kernel shared memory", err);
}

// One staged kernel over `blocks` blocks.
template <DType kDtype, routing::StagedRule kRule, bool kGroups, bool kApprox = false>
Status plan_staged_kernel(std::int64_t blocks, RoutePlan* plan) {
  constexpr auto kKernel = route_staged_kernel<kDtype, kRule, kGroups, kApprox>;
  constexpr std::size_t kSmem = routing::StagedLayout<kDtype>::kBlockBytes;
  return set_plan<kKernel>(blocks, 32 * routing::kStagedWarps, kSmem, plan, &grant_staged_smem<kKernel, kSmem>);
}

// The staged kernel for p (routing::staged_fits); approx: sigmoid + bias rows select on approximate
// sigmoids (RouteOptions::staged_approx).
Status plan_route_staged(const RouteParams& p, bool approx, RoutePlan* plan) {
  using routing::StagedRule;
  const std::int64_t rows_per_block = 32 * routing::kStagedWarps;
  const std::int64_t blocks = (p.num_tokens + rows_per_block - 1) / rows_per_block;
  StagedRule rule = StagedRule::kSigmoidBias;
  routing::staged_rule_of(p, &rule);
  const bool groups = p.group_path != routing::kGroupNone;
  const auto plan_for = [&](auto dtype) {
    constexpr DType kDtype = decltype(dtype)::value;
    if (rule == StagedRule::kLogits)
      return plan_staged_kernel<kDtype, StagedRule::kLogits, false>(blocks, plan);
    if (rule == StagedRule::kSoftmaxPicks)
      return plan_staged_kernel<kDtype, StagedRule::kSoftmaxPicks, false>(blocks, plan);
    if (approx) {
      return groups ? plan_staged_kernel<kDtype, StagedRule::kSigmoidBias, true, true>(blocks, plan)
                    : plan_staged_kernel<kDtype, StagedRule::kSigmoidBias, false, true>(blocks, plan);
    }
    return groups ? plan_staged_kernel<kDtype, StagedRule::kSigmoidBias, true>(blocks, plan)
                  : plan_staged_kernel<kDtype, StagedRule::kSigmoidBias, false>(blocks, plan);
  };
  if (p.logits_dtype == static_cast<int>(DType::kFloat32))
    return plan_for(std::integral_constant<DType, DType::kFloat32>{});
  return plan_for(std::integral_constant<DType, DType::kBFloat16>{});
}

}  // namespace

namespace routing {

Status plan_route(const detail::RouteArgs& args, const DeviceProps& props, RoutePlan* plan) {
  if (args.config.top_k > kMaxGpuTopK) {
    return Status::Unsupported("route: K = " + std::to_string(args.config.top_k) +
                               " exceeds the CUDA backend's maximum of " + std::to_string(kMaxGpuTopK));
  }
  plan->params = make_route_params(args);
  const RouteParams& p = plan->params;
  const RouteChoice choice = route_choice(args.options);
  if (use_rows_kernel(p, choice.form)) return plan_route_rows_for(p, props, plan);
  if (use_staged(p, choice, props)) return plan_route_staged(p, choice.staged_approx, plan);
  if (use_stream(p, choice)) {
    Status status;
    if (plan_route_stream(p, choice, props, plan, &status)) return status;
  }
  const int index = route_shape_index(args.config.num_experts, args.num_tokens, args.config.pre,
                                      narrow_spec_matches(p), args.config.top_k, choice);
  if (index < 0) {
    return Status::Unsupported("route: E = " + std::to_string(args.config.num_experts) +
                               " exceeds the CUDA backend's maximum of " +
                               std::to_string(kShapeTable[kNumShapes - 1].max_experts));
  }
  return shape_planner(index)(p, choice, props, plan);
}

}  // namespace routing

Status route(const detail::RouteArgs& args, Stream stream) {
  if (args.num_tokens == 0) return Status::Ok();
  DeviceProps props;
  SY_RETURN_IF_ERROR(current_device_props("route", &props));
  routing::RoutePlan plan;
  SY_RETURN_IF_ERROR(routing::plan_route(args, props, &plan));
  if (plan.prepare != nullptr) SY_RETURN_IF_ERROR(plan.prepare());
  return launch_kernel("route: kernel launch", plan.kernel, dim3(plan.grid), dim3(plan.block), plan.smem, stream,
                       /*pdl=*/true, plan.params);
}

}  // namespace switchyard::cuda
