// Compile-time specialisations of the routing parameters, shared by the routing kernel
// (routing.cu) and the single-launch route + layout kernel (layout/route_layout.cu).
#pragma once

#include <cstdint>
#include <utility>

#include "cuda/routing/route_warp.cuh"
#include "switchyard/routing.h"
#include "switchyard/tensor.h"

namespace switchyard::cuda::routing {

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
template <DType kDtype, PreFn kPre, bool kBias, bool kGroupLanes, PostFn kPost, bool kEarlyBias = false>
struct Spec {};
constexpr std::int64_t kEarlyBiasMaxTokens = 256;

template <class S>
struct SpecTraits;
template <DType kDtype, PreFn kPre, bool kBias, bool kGroupLanes, PostFn kPost, bool kEarly>
struct SpecTraits<Spec<kDtype, kPre, kBias, kGroupLanes, kPost, kEarly>> {
  static constexpr bool kEarlyBias = kEarly;
  static bool matches(const RouteParams& p) {
    if (kEarly && p.num_tokens > kEarlyBiasMaxTokens) return false;
    if (p.logits_dtype != static_cast<int>(kDtype) || !p.logits_vec) return false;
    if (p.pre != kPre || p.post != kPost) return false;
    if (kBias != (p.bias != nullptr)) return false;
    if (kBias && (p.bias_dtype != static_cast<int>(DType::kFloat32) || !p.bias_vec)) return false;
    if (kGroupLanes) return p.group_path == kGroupChunks && p.group_lanes != 0;
    return p.group_path == kGroupNone;
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
    if (kGroupLanes) {
      p.group_path = kGroupChunks;
      p.group_lanes = 1;
    } else {
      p.group_path = kGroupNone;
    }
  }
};
template <>
struct SpecTraits<SpecGeneric> {
  static constexpr bool kEarlyBias = false;
  static bool matches(const RouteParams&) { return true; }
  __device__ __forceinline__ static void apply(RouteParams&) {}
};

// Calls f(SpecT{}) with the first of Specs... whose SpecTraits::matches(p) holds (the last one
// is the fallback and must match everything).
template <class SpecT, class... Rest, typename F>
auto dispatch_spec(const RouteParams& p, F&& f) {
  if constexpr (sizeof...(Rest) == 0) {
    return f(SpecT{});
  } else {
    if (SpecTraits<SpecT>::matches(p)) return f(SpecT{});
    return dispatch_spec<Rest...>(p, std::forward<F>(f));
  }
}

}  // namespace switchyard::cuda::routing
