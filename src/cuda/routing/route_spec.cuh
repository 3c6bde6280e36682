// The routing kernels' specialisations (Spec, SpecTraits), shared by the routing kernel
// (routing.cu) and the fused route + layout kernel (cuda/layout/route_layout_kernel.cuh).
#pragma once

#include <cstdint>

#include "cuda/routing/route_warp.cuh"

namespace switchyard::cuda::route_spec {

using routing::RouteParams;

// Specialised kernels. route_warp branches on the parameters at run time (warp-uniform
// branches, but they cost issue slots on the hot path and registers: ~100 instructions per row
// and 48 instead of ~32 registers at E = 256). A Spec fixes the common configurations at compile
// time: the kernel overwrites those fields of its copy of the parameters with constants equal to
// the values the host checked (SpecTraits::matches), and the compiler folds the branches away. The
// semantics are those of the generic kernel, which serves every other configuration.
// Spec fields: logits dtype (vector loads aligned), pre, bias (none / fp32 with aligned vector
// loads), group path (none / lanes), post. ids and weights dtypes, E, K, scale and the group
// counts stay run-time.
// kEarlyBias (route_warp) only up to kEarlyBiasMaxTokens rows: there the bias's L2 latency is on
// the critical path; past it the registers it holds cost rows in flight. Measured on the H200
// (us, early / late, same run): deepseek-v3 fp32 T = 1 2.69 / 2.89-2.96, T = 128 3.75 / 4.03;
// kimi-k2 T = 1 2.57-2.63 / 2.74; glm-4.5 2.87 / 3.02-3.07; but with the early load for every T,
// T = 4096 glm-4.5 fp32 7.71 / 6.50 and deepseek-v3 bf16 8.62 / 6.88 (37 registers instead of
// 29-34 at E = 256).
struct SpecGeneric {};
// A Spec's group limit: none, the lane path, or the chunk path without lanes (route_warp.cuh).
enum SpecGroup : int { kSpecGroupNone = 0, kSpecGroupLanes = 1, kSpecGroupChunks = 2 };
// kShift > 0 (lane path only): the group shift log2(G / 4) too (route_warp's kGroupShift).
template <DType kDtype, PreFn kPre, bool kBias, int kGroup, PostFn kPost, bool kEarlyBias = false,
          int kShift = 0>
struct Spec {};
constexpr std::int64_t kEarlyBiasMaxTokens = 256;

template <class S>
struct SpecTraits;
template <DType kDtype, PreFn kPre, bool kBias, int kGroup, PostFn kPost, bool kEarly, int kShift>
struct SpecTraits<Spec<kDtype, kPre, kBias, kGroup, kPost, kEarly, kShift>> {
  static_assert(kShift == 0 || kGroup == kSpecGroupLanes, "a group shift belongs to the lane path");
  static constexpr bool kEarlyBias = kEarly;
  static constexpr int kGroupShift = kShift;
  static bool matches(const RouteParams& p) {
    if (kEarly && p.num_tokens > kEarlyBiasMaxTokens) return false;
    if (p.logits_dtype != static_cast<int>(kDtype) || !p.logits_vec) return false;
    if (p.pre != kPre || p.post != kPost) return false;
    if (kBias != (p.bias != nullptr)) return false;
    if (kBias && (p.bias_dtype != static_cast<int>(DType::kFloat32) || !p.bias_vec)) return false;
    if (kGroup == kSpecGroupLanes) {
      return p.group_path == routing::kGroupChunks && p.group_lanes != 0 &&
             (kShift == 0 || p.group_shift == kShift);
    }
    if (kGroup == kSpecGroupChunks) return p.group_path == routing::kGroupChunks && p.group_lanes == 0;
    return p.group_path == routing::kGroupNone;
  }
  __device__ __forceinline__ static void apply(RouteParams& p) {
    p.logits_dtype = static_cast<int>(kDtype);
    p.logits_vec = 1;
    p.pre = kPre;
    p.post = kPost;
    if (kBias) {
      p.bias_dtype = static_cast<int>(DType::kFloat32);
      p.bias_vec = 1;
    } else {
      p.bias = nullptr;
    }
    if (kGroup == kSpecGroupNone) {
      p.group_path = routing::kGroupNone;
    } else {
      p.group_path = routing::kGroupChunks;
      p.group_lanes = kGroup == kSpecGroupLanes ? 1 : 0;
      if (kShift > 0) p.group_shift = kShift;
    }
  }
};
template <>
struct SpecTraits<SpecGeneric> {
  static constexpr bool kEarlyBias = false;
  static constexpr int kGroupShift = 0;
  static bool matches(const RouteParams&) { return true; }
  __device__ __forceinline__ static void apply(RouteParams&) {}
};

}  // namespace switchyard::cuda::route_spec
