// Routing kernels specialised at compile time (used by the routing kernel, routing.cu, and the
// fused route + layout kernel, cuda/layout/route_layout.cu).
//
//   dispatch_route_spec<Shape>(p, f): calls f(SpecT{}) with the first Spec whose configuration
//   matches p (SpecTraits<SpecT>::matches), else with SpecGeneric, and returns its Status. A kernel
//   templated on SpecT calls SpecTraits<SpecT>::apply(its copy of p) first.
#pragma once

#include <utility>

#include "cuda/routing/route_warp.cuh"
#include "switchyard/status.h"

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
struct SpecGeneric {};
template <DType kDtype, PreFn kPre, bool kBias, bool kGroupLanes, PostFn kPost>
struct Spec {};

template <class S>
struct SpecTraits;
template <DType kDtype, PreFn kPre, bool kBias, bool kGroupLanes, PostFn kPost>
struct SpecTraits<Spec<kDtype, kPre, kBias, kGroupLanes, kPost>> {
  static bool matches(const RouteParams& p) {
    if (p.logits_dtype != static_cast<int>(kDtype) || !p.logits_vec) return false;
    if (p.pre != kPre || p.post != kPost) return false;
    if (kBias != (p.bias != nullptr)) return false;
    if (kBias && (p.bias_dtype != static_cast<int>(DType::kFloat32) || !p.bias_vec)) return false;
    if (kGroupLanes) return p.group_path == routing::kGroupChunks && p.group_lanes != 0;
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
    if (kGroupLanes) {
      p.group_path = routing::kGroupChunks;
      p.group_lanes = 1;
    } else {
      p.group_path = routing::kGroupNone;
    }
  }
};
template <>
struct SpecTraits<SpecGeneric> {
  static bool matches(const RouteParams&) { return true; }
  __device__ __forceinline__ static void apply(RouteParams&) {}
};

// The specialised configurations (model families of DESIGN.md section 2), for fp32 and bf16
// logits, on the whole-warp shapes with up to 4 stripes (64 < E <= 512): softmax -> normalize
// (the issue's E=256 K=8 configuration), none -> softmax (Qwen3, gpt-oss), sigmoid + bias ->
// normalize (Kimi-K2, GLM-4.5) and the same with the lane group limit (DeepSeek-V3). Everything
// else runs the generic kernel. Measured on the H200 against the generic kernel (fp32, us):
// kimi-k2 2.76 / 62.5 at T = 1 / 65536 (was 3.16 / 72.2), qwen3-next 2.13 / 59.9 (2.44 / 69.7),
// deepseek-v3 3.11 / 67.8 (3.60 / 79.5); but at T = 4096 those three got slower with fp32 logits
// (8.97 / 8.91 / 9.19 against 7.72 / 8.08 / 8.57) while bf16 logits got faster; not understood.
template <class F, class SpecT, class... Rest>
Status dispatch_route_spec_in(const RouteParams& p, F&& f) {
  if constexpr (sizeof...(Rest) == 0) {
    return f(SpecT{});
  } else {
    if (SpecTraits<SpecT>::matches(p)) return f(SpecT{});
    return dispatch_route_spec_in<F, Rest...>(p, std::forward<F>(f));
  }
}

template <DType kDtype, class F>
Status dispatch_route_spec_dtype(const RouteParams& p, F&& f) {
  return dispatch_route_spec_in<F, Spec<kDtype, PreFn::kSoftmax, false, false, PostFn::kNormalize>,
                                Spec<kDtype, PreFn::kNone, false, false, PostFn::kSoftmax>,
                                Spec<kDtype, PreFn::kSigmoid, true, false, PostFn::kNormalize>,
                                Spec<kDtype, PreFn::kSigmoid, true, true, PostFn::kNormalize>, SpecGeneric>(
      p, std::forward<F>(f));
}

template <class Shape, class F>
Status dispatch_route_spec(const RouteParams& p, F&& f) {
  if constexpr (Shape::W == 32 && Shape::S <= 4) {
    if (p.logits_dtype == static_cast<int>(DType::kFloat32))
      return dispatch_route_spec_dtype<DType::kFloat32>(p, std::forward<F>(f));
    if (p.logits_dtype == static_cast<int>(DType::kBFloat16))
      return dispatch_route_spec_dtype<DType::kBFloat16>(p, std::forward<F>(f));
  }
  return f(SpecGeneric{});
}

}  // namespace switchyard::cuda::routing
