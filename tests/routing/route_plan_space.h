// The configurations over which the routing plan is enumerated (route_plan_test.cpp,
// route_plan_reach.cpp): every preset, logits dtype, token-count class and kernel option, and a grid
// of rules (pre and post functions, bias forms, group-limit paths, E and K around the shape
// bounds, aligned and unaligned rows). Pointers are fake: the plan reads only their alignment.
#pragma once

#include <cstdint>
#include <vector>

#include "common/op_args.h"
#include "cuda/common/device_props.h"
#include "switchyard/routing.h"

namespace sy_test {

// H100 / H200 (132 SMs, 227 KB of opt-in shared memory a block) and a smaller part.
inline switchyard::cuda::DeviceProps plan_props(int sm_count) {
  switchyard::cuda::DeviceProps props;
  props.sm_count = sm_count;
  props.smem_per_block_optin = 232448;
  props.l2_bytes = 50u << 20;
  return props;
}

// Token counts on both sides of every threshold of route_plan.h, and the ends.
inline const std::vector<std::int64_t>& plan_token_counts() {
  static const std::vector<std::int64_t> t = {1,     2,     100,   128,   129,   256,   257,   924,   925,
                                              1023,  1024,  1025,  4096,  4097,  16383, 16384, 32767, 32768,
                                              65535, 65536, 300000};
  return t;
}

// The kernel options: the default (first), each form forced, each knob flipped.
inline std::vector<switchyard::RouteOptions> plan_option_sets() {
  using switchyard::RouteOptions;
  std::vector<RouteOptions> sets(1);
  for (auto f : {RouteOptions::SmallRowForm::kWarp, RouteOptions::SmallRowForm::kNarrow,
                 RouteOptions::SmallRowForm::kNarrow2, RouteOptions::SmallRowForm::kRows}) {
    sets.emplace_back().small_row_form = f;
  }
  sets.emplace_back().narrow_packed = false;
  for (auto c : {RouteOptions::Choice::kNever, RouteOptions::Choice::kAlways}) {
    sets.emplace_back().streamed = c;
    sets.emplace_back().staged = c;
  }
  sets.emplace_back().staged_approx = false;
  RouteOptions exact_always;
  exact_always.staged_approx = false;
  exact_always.staged = RouteOptions::Choice::kAlways;
  sets.push_back(exact_always);
  sets.emplace_back().wide_packed_always = true;
  return sets;
}

// Bias forms: none, fp32 aligned, fp32 unaligned (no vector loads), bf16.
enum class PlanBias { kNone, kF32, kF32Unaligned, kBf16 };

// Route arguments for a plan (fake pointers; T > 0).
inline switchyard::detail::RouteArgs plan_args(const switchyard::RoutingConfig& config, std::int64_t tokens,
                                               switchyard::DType logits, bool aligned, PlanBias bias,
                                               const switchyard::RouteOptions& options) {
  switchyard::detail::RouteArgs a;
  a.config = config;
  a.num_tokens = tokens;
  a.logits = reinterpret_cast<const void*>(std::uintptr_t{aligned ? 0x10000u : 0x10002u});
  a.logits_dtype = logits;
  a.logits_row_stride = aligned ? (config.num_experts + 7) / 8 * 8 : (config.num_experts | 1);
  a.bias = bias == PlanBias::kNone ? nullptr
                                   : reinterpret_cast<const void*>(
                                         std::uintptr_t{bias == PlanBias::kF32Unaligned ? 0x20004u : 0x20000u});
  a.bias_dtype = bias == PlanBias::kBf16 ? switchyard::DType::kBFloat16 : switchyard::DType::kFloat32;
  a.topk_ids = reinterpret_cast<void*>(std::uintptr_t{0x30000u});
  a.topk_weights = reinterpret_cast<void*>(std::uintptr_t{0x40000u});
  a.options = options;
  return a;
}

// Calls f(args) for every configuration of the space that validate() accepts and the CUDA backend
// serves (K <= kMaxGpuTopK, E <= kMaxGpuExperts).
template <class F>
void for_each_plan_config(const F& f) {
  using namespace switchyard;
  const DType dtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  const auto options = plan_option_sets();
  const auto serves = [](const RoutingConfig& c) {
    return validate(c).ok() && c.top_k <= kMaxGpuTopK && c.num_experts <= kMaxGpuExperts;
  };
  // Presets: their rule and bias at every dtype, T and option.
  for (const ModelPreset& preset : model_presets()) {
    for (DType dt : dtypes)
      for (std::int64_t t : plan_token_counts())
        for (const RouteOptions& o : options)
          f(plan_args(preset.routing, t, dt, true, preset.has_bias ? PlanBias::kF32 : PlanBias::kNone, o));
  }
  // A grid of rules at every T and option: E on both sides of the shape table's bounds, K around
  // the packed-buffer and narrow-segment bounds, the four group-limit paths.
  const int experts[] = {4,   8,   12,  16,  24,  32,  48,  64,   96,   128,  160,  192, 256,
                         320, 384, 448, 512, 576, 640, 768, 896, 960, 1024, 1536, 2048, 4096};
  const int ks[] = {1, 2, 4, 8, 16};
  const PreFn pres[] = {PreFn::kNone, PreFn::kSoftmax, PreFn::kSigmoid, PreFn::kSqrtSoftplus};
  const PostFn posts[] = {PostFn::kNone, PostFn::kSoftmax, PostFn::kSigmoid, PostFn::kNormalize};
  const PlanBias biases[] = {PlanBias::kNone, PlanBias::kF32, PlanBias::kF32Unaligned, PlanBias::kBf16};
  for (int e : experts) {
    for (int k : ks) {
      // No group limit; groups of 32, 16 and 8 experts (the lane path, up to 32 groups; past them the
      // chunk path); groups of a multiple of 4 that is not 4 times a power of two (the chunk path
      // without lanes); groups of 6 (the generic path).
      for (int group_size : {0, 32, 16, 8, 20, 12, 24, 28, 6}) {
        RoutingConfig c;
        c.num_experts = e;
        c.top_k = k;
        if (group_size > 0) {
          if (e % group_size != 0 || e / group_size < 2) continue;
          c.group_rule = group_size == 20 ? GroupRule::kMax : GroupRule::kTop2Sum;
          c.n_group = e / group_size;
          c.topk_group = c.n_group > 4 ? 4 : c.n_group - 1;
        }
        for (PreFn pre : pres) {
          for (PostFn post : posts) {
            c.pre = pre;
            c.post = post;
            if (!serves(c)) continue;
            for (PlanBias b : biases) {
              for (DType dt : dtypes) {
                for (bool aligned : {true, false}) {
                  // The options at aligned fp32 / bf16 rows with no or an aligned fp32 bias; the
                  // default alone at the other forms (where the Specs and staged kernels do not apply).
                  const bool plain = aligned && dt != DType::kFloat16 && (b == PlanBias::kNone || b == PlanBias::kF32);
                  for (std::int64_t t : plan_token_counts()) {
                    for (std::size_t i = 0; i < (plain ? options.size() : 1); ++i)
                      f(plan_args(c, t, dt, aligned, b, options[i]));
                  }
                }
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace sy_test
