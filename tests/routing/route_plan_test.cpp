// The routing plan (src/cuda/routing/route_plan.h) on the CPU: plan_route makes no CUDA call, so
// these run wherever the CUDA backend is built, GPU or not. The kernels it picks are checked on
// the GPU by routing_cuda_test.cpp; here: every configuration of route_plan_space.h gets a plan
// whose launch shape fits the device, the shape follows the device's SM count and shared memory,
// the model presets reach their specialised kernels, and refusals name the argument.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "cuda/routing/route_plan.h"
#include "routing/route_plan_space.h"
#include "switchyard/routing.h"

namespace {

using switchyard::DType;
using switchyard::RouteOptions;
using switchyard::RoutingConfig;
using switchyard::Status;
using switchyard::cuda::DeviceProps;
using switchyard::cuda::routing::plan_route;
using switchyard::cuda::routing::RoutePlan;
using sy_test::PlanBias;

RoutePlan plan_of(const switchyard::detail::RouteArgs& args, const DeviceProps& props) {
  RoutePlan plan;
  const Status s = plan_route(args, props, &plan);
  EXPECT_TRUE(s.ok()) << s.message();
  return plan;
}

switchyard::ModelPreset preset(const char* name) {
  switchyard::ModelPreset p;
  EXPECT_TRUE(switchyard::find_preset(name, &p).ok()) << name;
  return p;
}

switchyard::detail::RouteArgs preset_args(const switchyard::ModelPreset& p, std::int64_t tokens, DType dtype,
                                          const RouteOptions& options = RouteOptions()) {
  return sy_test::plan_args(p.routing, tokens, dtype, true, p.has_bias ? PlanBias::kF32 : PlanBias::kNone,
                            options);
}

TEST(RoutePlan, EveryConfigurationGetsALaunchThatFitsTheDevice) {
  long plans = 0;
  for (int sms : {132, 78}) {
    const DeviceProps props = sy_test::plan_props(sms);
    sy_test::for_each_plan_config([&](const switchyard::detail::RouteArgs& args) {
      RoutePlan plan;
      const Status s = plan_route(args, props, &plan);
      // The one refusal inside the space: a generic group limit whose shared memory exceeds a block.
      if (!s.ok()) {
        ASSERT_NE(s.message().find("shared memory"), std::string::npos) << s.message();
        return;
      }
      ++plans;
      ASSERT_NE(plan.kernel, nullptr);
      ASSERT_NE(plan.name, nullptr);
      ASSERT_GE(plan.grid, 1u);
      ASSERT_TRUE(plan.block >= 32 && plan.block <= 1024 && plan.block % 32 == 0) << plan.block;
      // Past the 48 KB default only with the opt-in, and never past the device's.
      ASSERT_TRUE(plan.smem <= switchyard::cuda::routing::kMaxSmemPerBlock || plan.prepare != nullptr) << plan.name;
      ASSERT_LE(plan.smem, props.smem_per_block_optin);
      // At least one thread a row, and not a whole block of rows too many.
      const std::int64_t threads = static_cast<std::int64_t>(plan.grid) * plan.block;
      ASSERT_GE(threads, args.num_tokens) << plan.name;
      ASSERT_EQ(plan.params.num_tokens, args.num_tokens);
      ASSERT_EQ(plan.params.num_experts, args.config.num_experts);
    });
  }
  EXPECT_GT(plans, 1000000);
}

TEST(RoutePlan, BlocksFollowTheSmCount) {
  // At small T, rows spread over every SM: fewer SMs, larger blocks; at large T full blocks.
  const auto p = preset("deepseek-v3");
  for (std::int64_t t : {200, 500}) {
    const RoutePlan many = plan_of(preset_args(p, t, DType::kFloat32), sy_test::plan_props(132));
    const RoutePlan few = plan_of(preset_args(p, t, DType::kFloat32), sy_test::plan_props(16));
    EXPECT_EQ(many.name, few.name);
    EXPECT_LT(many.block, few.block) << "T = " << t;
    EXPECT_GT(many.grid, few.grid) << "T = " << t;
  }
  const RoutePlan many = plan_of(preset_args(p, 8192, DType::kFloat32), sy_test::plan_props(132));
  const RoutePlan few = plan_of(preset_args(p, 8192, DType::kFloat32), sy_test::plan_props(16));
  EXPECT_EQ(many.block, 256u);
  EXPECT_EQ(few.block, 256u);
}

TEST(RoutePlan, StagedKernelsNeedTheOptInSharedMemory) {
  const auto p = preset("deepseek-v3");
  const RoutePlan staged = plan_of(preset_args(p, 65536, DType::kFloat32), sy_test::plan_props(132));
  EXPECT_NE(std::string(staged.name).find("route_staged_kernel"), std::string::npos) << staged.name;
  EXPECT_NE(staged.prepare, nullptr);
  DeviceProps small = sy_test::plan_props(132);
  small.smem_per_block_optin = 48 * 1024;
  const RoutePlan warp = plan_of(preset_args(p, 65536, DType::kFloat32), small);
  EXPECT_EQ(std::string(warp.name).find("route_staged_kernel"), std::string::npos) << warp.name;
  EXPECT_LE(warp.smem, small.smem_per_block_optin);
}

TEST(RoutePlan, PresetsReachTheirSpecialisedKernels) {
  // The rules with specialised kernels (docs/decisions/routing-specialised-kernels.md) never fall
  // back to the generic kernel at the default options, fp32 or bf16 logits.
  for (const char* name : {"deepseek-v3", "kimi-k2", "glm-4.5", "qwen3-235b-a22b", "mixtral-8x7b", "dbrx"}) {
    const auto p = preset(name);
    for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
      for (std::int64_t t : sy_test::plan_token_counts()) {
        const RoutePlan plan = plan_of(preset_args(p, t, dt), sy_test::plan_props(132));
        EXPECT_EQ(std::string(plan.name).find("SpecGeneric"), std::string::npos)
            << name << " dtype " << static_cast<int>(dt) << " T = " << t << ": " << plan.name;
      }
    }
  }
}

TEST(RoutePlan, StagedThresholdsFollowTheSelection) {
  const auto staged = [](const char* name, std::int64_t t, bool approx) {
    RouteOptions o;
    o.staged_approx = approx;
    const std::string kernel = plan_of(preset_args(preset(name), t, DType::kFloat32, o), sy_test::plan_props(132)).name;
    return kernel.find("route_staged_kernel") != std::string::npos;
  };
  // Sigmoid + bias without a group limit: from 16384 rows on the approximate selection, 32768 on the exact.
  EXPECT_FALSE(staged("glm-4.5", 16383, true));
  EXPECT_TRUE(staged("glm-4.5", 16384, true));
  EXPECT_FALSE(staged("glm-4.5", 16384, false));
  EXPECT_TRUE(staged("glm-4.5", 32768, false));
  // With a group limit: from 32768 either way.
  EXPECT_FALSE(staged("deepseek-v3", 16384, true));
  EXPECT_TRUE(staged("deepseek-v3", 32768, true));
  // 384 experts: only on the approximate selection, from 32768.
  EXPECT_FALSE(staged("kimi-k2", 16384, true));
  EXPECT_TRUE(staged("kimi-k2", 32768, true));
  EXPECT_FALSE(staged("kimi-k2", 65536, false));
}

TEST(RoutePlan, OptionsChooseTheForm) {
  const auto p = preset("deepseek-v3");
  RouteOptions never;
  never.staged = RouteOptions::Choice::kNever;
  const std::string warp = plan_of(preset_args(p, 65536, DType::kFloat32, never), sy_test::plan_props(132)).name;
  EXPECT_NE(warp.find("route_kernel"), std::string::npos) << warp;
  RouteOptions always;
  always.staged = RouteOptions::Choice::kAlways;
  always.staged_approx = false;
  const std::string staged = plan_of(preset_args(p, 1, DType::kFloat32, always), sy_test::plan_props(132)).name;
  EXPECT_NE(staged.find("route_staged_kernel"), std::string::npos) << staged;
  RouteOptions approx = always;
  approx.staged_approx = true;
  const std::string approx_name = plan_of(preset_args(p, 1, DType::kFloat32, approx), sy_test::plan_props(132)).name;
  EXPECT_NE(approx_name, staged);
  RouteOptions rows;
  rows.small_row_form = RouteOptions::SmallRowForm::kRows;
  const std::string rows_name =
      plan_of(preset_args(preset("mixtral-8x7b"), 1, DType::kFloat32, rows), sy_test::plan_props(132)).name;
  EXPECT_NE(rows_name.find("route_rows_kernel"), std::string::npos) << rows_name;
}

TEST(RoutePlan, RefusalsNameTheArgument) {
  RoutingConfig c;
  c.num_experts = 64;
  c.top_k = switchyard::kMaxGpuTopK + 1;
  c.pre = switchyard::PreFn::kSoftmax;
  RoutePlan plan;
  Status s = plan_route(sy_test::plan_args(c, 16, DType::kFloat32, true, PlanBias::kNone, RouteOptions()),
                        sy_test::plan_props(132), &plan);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("K = 33"), std::string::npos) << s.message();
  c.top_k = 8;
  c.num_experts = switchyard::kMaxGpuExperts + 4;
  s = plan_route(sy_test::plan_args(c, 16, DType::kFloat32, true, PlanBias::kNone, RouteOptions()),
                 sy_test::plan_props(132), &plan);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("E = 4100"), std::string::npos) << s.message();
}

}  // namespace
