// The whole-warp and narrow-segment routing kernels (route_warp.cuh) and the host code that picks
// one for a row shape: plan_route_shape<Shape>. Included by the routing_shapes_<unit>.cu
// translation units, each of which instantiates the shapes of one unit (route_shapes.h), and by
// routing.cu (the streamed segments, rows and staged kernels, and route()). Everything here has
// internal linkage: each unit's kernels are its own. Compiled with -fmad=false (src/CMakeLists.txt).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "cuda/backend.h"
#include "cuda/common/launch.cuh"
#include "cuda/routing/route_shapes.h"
#include "cuda/routing/route_warp.cuh"

namespace switchyard::cuda {

namespace {

using routing::RouteParams;
using routing::RoutePlan;

// The routing kernels' parameters into the constant cache before pdl_wait(), by thread 0 of the
// first kWarmBlocks blocks (launch.cuh), their fields by name (route_params_xor) rather than through
// warm_params' memcpy, which rescheduled many of the kernels' bodies. 4% faster at T <= 128; warming
// in every block cost up to 12% at T >= 16384 (docs/decisions/warm-params.md).
//
// Grids of at most kPrefetchMaxBlocks blocks also prefetch their rows' logits and the bias into L2
// before pdl_wait() (prefetch_route_inputs, launch.cuh's prefetch_l2): thread 0 of each block, its
// block's rows. 4 blocks of 256 threads on each of the H200's 132 SMs: every block can be resident
// at once and start while the previous kernel still runs. Larger grids do not: the first wave's
// prefetches would compete for HBM with the previous kernel's own loads, which are still the
// critical path (docs/decisions/l2-prefetch-before-pdl-wait.md).
constexpr unsigned kPrefetchMaxBlocks = 4 * kWarmBlocks;
using routing::kMaxSmemPerBlock;
using routing::kWarpsPerBlock;

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
// the critical path; past it the registers it holds cost rows in flight
// (docs/decisions/routing-specialised-kernels.md).
struct SpecGeneric {};
// A Spec's group limit: none, the lane path, or the chunk path without lanes (route_warp.cuh).
enum SpecGroup : int { kSpecGroupNone = 0, kSpecGroupLanes = 1, kSpecGroupChunks = 2 };
// kShift > 0 (lane path only): the group shift log2(G / 4) too (route_warp's kGroupShift).
template <DType kDtype, PreFn kPre, bool kBias, int kGroup, PostFn kPost, bool kEarlyBias = false,
          int kShift = 0>
struct Spec {};
using routing::kEarlyBiasMaxTokens;

template <class S>
struct SpecTraits;
template <DType kDtype, PreFn kPre, bool kBias, int kGroup, PostFn kPost, bool kEarly, int kShift>
struct SpecTraits<Spec<kDtype, kPre, kBias, kGroup, kPost, kEarly, kShift>> {
  static_assert(kShift == 0 || kGroup == kSpecGroupLanes, "a group shift belongs to the lane path");
  static constexpr bool kEarlyBias = kEarly;
  static constexpr int kGroupShift = kShift;
  // Keys with one per packed bucket (routing::bucket_exact_keys) on every row the Spec matches.
  static constexpr bool kBucketExact = kDtype != DType::kFloat32 && kPre == PreFn::kNone && !kBias;
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
  static constexpr bool kBucketExact = false;
  static bool matches(const RouteParams&) { return true; }
  __device__ __forceinline__ static void apply(RouteParams&) {}
};

// Wide rows (route_warp_wide): packed candidate buffers (up to E = 2048; plain ones past it) in the
// specialised kernels; the checks recompute the keys of the few experts they ask about (except for
// bf16 logits without pre function or bias, and only from route_warp_wide's kWidePackedMinTokens
// rows on for other keys; docs/decisions/routing-wide-rows.md). kSpecialised: SpecT is a Spec,
// not SpecGeneric.
template <class SpecT>
constexpr bool kSpecialised = !std::is_same_v<SpecT, SpecGeneric>;

// Blocks per SM the compiler must fit (__launch_bounds__): 8, i.e. at most 32 registers, for the
// specialised kernels of 2 or 3 stripes (128 < E <= 384) that do not load the bias early (the
// sigmoid + bias ones past kEarlyBiasMaxTokens, the others at every T); 3 (80 registers) for the
// wide-row kernels (kWide: Shape::kWideMinBlocks, 3 but for a StreamShape; unbounded, the compiler
// took 104-143 to keep more loads in flight); 1 elsewhere. The 32-register bound took deepseek-v3
// fp32 T = 4096 from 9.04 to 7.27 us (docs/decisions/routing-specialised-kernels.md).
template <class Shape, class SpecT, bool kWide>
constexpr int route_min_blocks() {
  if (kWide) return Shape::kWideMinBlocks;
  return (Shape::W == 32 && Shape::S >= 2 && Shape::S <= 3 && kSpecialised<SpecT> &&
          !SpecTraits<SpecT>::kEarlyBias)
             ? 8
             : 1;
}

// kWide: route_warp_wide (E > 512 without a group limit) instead of route_warp. kPackedTopK: the
// packed candidate buffers (route_warp: see plan_route_shape; route_warp_wide: plan_route_for).
template <class Shape, class SpecT, bool kWide, bool kPackedTopK>
__global__ void __launch_bounds__(kWarpsPerBlock * 32, route_min_blocks<Shape, SpecT, kWide>())
    route_kernel(const RouteParams p0) {
  if (threadIdx.x == 0) {
    if (blockIdx.x < kWarmBlocks) keep_loaded(routing::route_params_xor(p0), p0.num_tokens < 0);
    if (gridDim.x <= kPrefetchMaxBlocks) {
      const std::int64_t block_rows = static_cast<std::int64_t>(blockDim.x >> 5) * Shape::kRowsPerWarp;
      routing::prefetch_route_inputs(p0, blockIdx.x * block_rows, block_rows);
    }
  }
  pdl_wait();  // before any global access (launch.cuh PDL contract)
  // Every later kernel only reads our outputs after its own pdl_wait(), which waits for this
  // whole grid: letting it be scheduled now is safe and hides its launch latency.
  pdl_launch_dependents();
  RouteParams p = p0;
  SpecTraits<SpecT>::apply(p);
  extern __shared__ __align__(16) unsigned char route_smem[];
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const int warps = static_cast<int>(blockDim.x >> 5);
  const std::int64_t first_row = (static_cast<std::int64_t>(blockIdx.x) * warps + warp) * Shape::kRowsPerWarp;
  if (first_row >= p.num_tokens) return;  // whole warp: no block-level barrier follows
  if constexpr (kWide) {
    routing::route_warp_wide<Shape, kPackedTopK>(p, first_row, nullptr);
  } else {
    const std::size_t smem_per_warp = routing::route_smem_bytes_per_warp<Shape, kPackedTopK>(p);
    unsigned char* warp_smem = smem_per_warp == 0 ? nullptr : route_smem + warp * smem_per_warp;
    routing::route_warp<Shape, SpecTraits<SpecT>::kEarlyBias, kPackedTopK, SpecTraits<SpecT>::kGroupShift>(
        p, first_row, warp_smem, nullptr);
  }
}

// Fills *plan with kKernel over `blocks` blocks of `threads` threads and `smem` bytes of dynamic
// shared memory (`prepare`: the kernel's opt-in to more than 48 KB, run before each launch).
template <auto kKernel>
Status set_plan(std::int64_t blocks, int threads, std::size_t smem, RoutePlan* plan,
                Status (*prepare)() = nullptr) {
  if (blocks > 0x7fffffff) return Status::Unsupported("route: too many tokens for one launch");
  plan->kernel = kKernel;
  plan->name = kernel_name<kKernel>();
  plan->grid = static_cast<unsigned>(blocks);
  plan->block = static_cast<unsigned>(threads);
  plan->smem = smem;
  plan->prepare = prepare;
  return Status::Ok();
}

template <class Shape, class SpecT, bool kWide = false, bool kPackedTopK = true>
Status plan_route_kernel(const RouteParams& p, const DeviceProps& props, RoutePlan* plan) {
  std::size_t smem_per_warp = 0;  // route_warp_wide keeps no row in shared memory
  if constexpr (!kWide) smem_per_warp = routing::route_smem_bytes_per_warp<Shape, kPackedTopK>(p);
  int warps_per_block = kWarpsPerBlock;
  if (smem_per_warp > 0) {
    const std::size_t fit = kMaxSmemPerBlock / smem_per_warp;
    if (fit == 0) {
      return Status::Unsupported("route: the group limit needs " + std::to_string(smem_per_warp) +
                                 " bytes of shared memory per warp, more than the " +
                                 std::to_string(kMaxSmemPerBlock) + " available");
    }
    warps_per_block = static_cast<int>(std::min<std::size_t>(kWarpsPerBlock, fit));
  }
  // Blocks of ceil(warps / SMs) warps: when the rows would not give every SM a full block, smaller
  // blocks spread them over more SMs, so that fewer rows share an SM's issue slots (at small T a
  // row's latency is the call's). With 132 SMs and whole-warp rows the rule gives 8-warp blocks from
  // T = 925 on (docs/decisions/routing-specialised-kernels.md).
  const std::int64_t warps = (p.num_tokens + Shape::kRowsPerWarp - 1) / Shape::kRowsPerWarp;
  const int n_sm = std::max(props.sm_count, 1);
  const std::int64_t spread = (warps + n_sm - 1) / n_sm;
  warps_per_block = static_cast<int>(std::clamp<std::int64_t>(spread, 1, warps_per_block));
  const std::int64_t rows_per_block = static_cast<std::int64_t>(warps_per_block) * Shape::kRowsPerWarp;
  const std::int64_t blocks = (p.num_tokens + rows_per_block - 1) / rows_per_block;
  return set_plan<route_kernel<Shape, SpecT, kWide, kPackedTopK>>(blocks, warps_per_block * 32,
                                                                   smem_per_warp * warps_per_block, plan);
}

// The kernel of SpecT: for wide rows, the one with packed candidate buffers where SpecT is a
// specialisation and routing::wide_packed_buffers(p) asks for them, else the one with plain buffers
// (the streamed narrow segments, W < 32: always packed); otherwise route_warp's, with kPackedTopK =
// kPacked (narrow segments: the caller checked routing::narrow_packed_fits).
template <class Shape, class SpecT, bool kWide, bool kPacked = true>
Status plan_route_for(const RouteParams& p, const routing::RouteChoice& choice, const DeviceProps& props, RoutePlan* plan) {
  if constexpr (kWide && Shape::W < 32) {
    return plan_route_kernel<Shape, SpecT, true, true>(p, props, plan);
  } else if constexpr (kWide) {
    if constexpr (SpecTraits<SpecT>::kBucketExact) {
      return plan_route_kernel<Shape, SpecT, true, true>(p, props, plan);  // wide_packed_buffers: always
    } else {
      if constexpr (kSpecialised<SpecT>) {
        if (routing::wide_packed_buffers(p, choice)) return plan_route_kernel<Shape, SpecT, true, true>(p, props, plan);
      }
      return plan_route_kernel<Shape, SpecT, true, false>(p, props, plan);
    }
  } else {
    return plan_route_kernel<Shape, SpecT, false, kPacked>(p, props, plan);
  }
}

// Calls launch(static_cast<S*>(nullptr)) for the first S of Specs... that matches p, its Status into
// *status, and returns true; false (nothing called) when none matches.
// A Spec left out of a list at compile time (SpecIf): no row can reach its kernel there, so it is not
// instantiated (tools/kernel_resources.py reach checks that every routing kernel is reachable).
struct SpecNever {};
template <bool kKeep, class S>
using SpecIf = std::conditional_t<kKeep, S, SpecNever>;

template <class S, class Launch>
bool try_spec(const RouteParams& p, Status* status, const Launch& launch) {
  if constexpr (std::is_same_v<S, SpecNever>) {
    return false;
  } else {
    if (!SpecTraits<S>::matches(p)) return false;
    *status = launch(static_cast<S*>(nullptr));
    return true;
  }
}
template <class... Specs, class Launch>
bool first_spec_match(const RouteParams& p, Status* status, const Launch& launch) {
  return (try_spec<Specs>(p, status, launch) || ...);
}

// Launches the first of the kernels Specs... whose Spec matches p into *status and returns true;
// false (nothing launched) when none matches. kWide: the wide-row kernels; kPacked: as for
// plan_route_for.
template <class Shape, bool kWide, bool kPacked, class... Specs>
bool plan_first_match_packed(const RouteParams& p, const routing::RouteChoice& choice, const DeviceProps& props, RoutePlan* plan,
                               Status* status) {
  return first_spec_match<Specs...>(p, status, [&](auto* spec) {
    return plan_route_for<Shape, std::remove_pointer_t<decltype(spec)>, kWide, kPacked>(p, choice, props, plan);
  });
}
template <class Shape, bool kWide, class... Specs>
bool plan_first_match(const RouteParams& p, const routing::RouteChoice& choice, const DeviceProps& props, RoutePlan* plan,
                        Status* status) {
  return plan_first_match_packed<Shape, kWide, true, Specs...>(p, choice, props, plan, status);
}

// The first of the kernels Specs... whose Spec matches p; the last one is SpecGeneric, which always
// does.
template <class Shape, bool kWide, bool kPacked, class... Specs>
Status plan_route_spec_packed(const RouteParams& p, const routing::RouteChoice& choice,
                                const DeviceProps& props, RoutePlan* plan) {
  static_assert(std::is_same_v<std::tuple_element_t<sizeof...(Specs) - 1, std::tuple<Specs...>>, SpecGeneric>,
                "the generic kernel comes last");
  Status status = Status::Ok();
  plan_first_match_packed<Shape, kWide, kPacked, Specs...>(p, choice, props, plan, &status);
  return status;
}
template <class Shape, bool kWide, class... Specs>
Status plan_route_spec(const RouteParams& p, const routing::RouteChoice& choice, const DeviceProps& props, RoutePlan* plan) {
  return plan_route_spec_packed<Shape, kWide, true, Specs...>(p, choice, props, plan);
}

// The specialised configurations (model families of docs/design.md section 2), for fp32 and bf16
// logits, on the whole-warp shapes with up to 4 stripes (64 < E <= 512): softmax -> normalize
// (the issue's E=256 K=8 configuration), none -> softmax (Qwen3, gpt-oss), sigmoid + bias ->
// normalize (Kimi-K2, GLM-4.5) and the same with the lane group limit (DeepSeek-V3). Everything
// else runs the generic kernel (docs/decisions/routing-specialised-kernels.md; with fp32 logits
// the T = 4096 wave is unexplainedly sensitive to the register count).
// Past 4 stripes (513-1024 experts) only rows with a group limit reach these kernels
// (plan_route_shape): sigmoid + bias -> normalize on either group path.
// The kernels up to 4 stripes (E <= 512), after First... (checked first).
// Which of the sigmoid + bias Specs a whole-warp shape's rows can reach: the deep-buffer shapes of
// 129-512 experts (D = 3) serve sigmoid rows only up to kDeepBufferMaxTokens, all of which load the
// bias early; 65-128 experts on 2 candidates (S = 1, D = 2) only past kDeepBufferMaxTokens128, none
// of which do.
template <class Shape>
inline constexpr bool kLateBiasSpecs = !(Shape::S >= 2 && Shape::D == 3);
template <class Shape>
inline constexpr bool kEarlyBiasSpecs = !(Shape::S == 1 && Shape::D == 2);
static_assert(routing::kDeepBufferMaxTokens <= kEarlyBiasMaxTokens &&
                  routing::kDeepBufferMaxTokens128 >= kEarlyBiasMaxTokens,
              "kLateBiasSpecs / kEarlyBiasSpecs follow from these thresholds");

template <class Shape, DType kDtype, class... First>
Status plan_route_up_to_512(const RouteParams& p, const routing::RouteChoice& choice, const DeviceProps& props, RoutePlan* plan) {
  constexpr bool kEarly = kEarlyBiasSpecs<Shape>, kLate = kLateBiasSpecs<Shape>;
  return plan_route_spec<
      Shape, false, First..., Spec<kDtype, PreFn::kSoftmax, false, kSpecGroupNone, PostFn::kNormalize>,
      Spec<kDtype, PreFn::kNone, false, kSpecGroupNone, PostFn::kSoftmax>,
      SpecIf<kEarly, Spec<kDtype, PreFn::kSigmoid, true, kSpecGroupNone, PostFn::kNormalize, true>>,
      SpecIf<kEarly, Spec<kDtype, PreFn::kSigmoid, true, kSpecGroupLanes, PostFn::kNormalize, true>>,
      SpecIf<kLate, Spec<kDtype, PreFn::kSigmoid, true, kSpecGroupNone, PostFn::kNormalize>>,
      SpecIf<kLate, Spec<kDtype, PreFn::kSigmoid, true, kSpecGroupLanes, PostFn::kNormalize>>, SpecGeneric>(
      p, choice, props, plan);
}

template <class Shape, DType kDtype>
Status plan_route_dtype(const RouteParams& p, const routing::RouteChoice& choice, const DeviceProps& props, RoutePlan* plan) {
  if constexpr (Shape::S > 4) {
    return plan_route_spec<
        Shape, false, Spec<kDtype, PreFn::kSigmoid, true, kSpecGroupChunks, PostFn::kNormalize>,
        Spec<kDtype, PreFn::kSigmoid, true, kSpecGroupLanes, PostFn::kNormalize>, SpecGeneric>(p, choice,
                                                                                               props, plan);
  } else if constexpr (Shape::S == 2) {
    // 129 <= E <= 256: DeepSeek-V3's group limit (groups of 32 experts, shift 3) with the shift fixed
    // (route_warp's kGroupShift: butterflies unrolled, pair ranks), early bias first; then
    // DeepSeek-V2's rule (softmax, the chunk group path without lanes: groups of 20 experts, no post
    // function), 20% faster than the generic kernel at T = 65536
    // (docs/decisions/routing-specialised-kernels.md).
    return plan_route_up_to_512<
        Shape, kDtype, Spec<kDtype, PreFn::kSigmoid, true, kSpecGroupLanes, PostFn::kNormalize, true, 3>,
        SpecIf<kLateBiasSpecs<Shape>, Spec<kDtype, PreFn::kSigmoid, true, kSpecGroupLanes, PostFn::kNormalize, false, 3>>,
        Spec<kDtype, PreFn::kSoftmax, false, kSpecGroupChunks, PostFn::kNone>>(p, choice, props, plan);
  } else {
    return plan_route_up_to_512<Shape, kDtype>(p, choice, props, plan);
  }
}

// Wide rows (route_warp_wide, E > 512 without a group limit): the generic kernel (80 registers,
// a few spilled), and specialised ones for none -> softmax, the wide-2048 preset's rule (56-59
// registers, 4 blocks per SM), and for sigmoid + bias -> normalize (74-80 registers), each with
// packed or plain candidate buffers (plan_route_for). Group limits past E = 512 keep route_warp
// (their paths rank from the whole row in registers): packed buffers and specialised sigmoid + bias
// kernels up to E = 1024, the generic kernel on plain buffers past it.
// Rows of 513-1024 experts without a group limit, K >= 2: route_warp (the row in registers, packed
// buffers) instead of route_warp_wide from kWarpForWideMinTokens rows on (route_plan.h), for bf16
// sigmoid + bias -> normalize and fp32 / bf16 none -> softmax; not below it (the wide kernels' rows
// are shorter) nor for fp32 sigmoid + bias (the fp32 row's registers).
using routing::kWarpForWideMinTokens;

// Narrow segments (W < 32) that serve many rows (9-64 experts past the whole-warp bounds): the
// rules of the small-expert models as Specs, fp32 and bf16 logits: softmax -> normalize (DBRX),
// softmax without post function (OLMoE, Qwen1.5/2-MoE, DeepSeek-V2-Lite) and none -> softmax
// (Mixtral-style, Phi-3.5-MoE); docs/decisions/routing-specialised-kernels.md.
template <class Shape>
inline constexpr bool kNarrowSpecs = Shape::W < 32 && Shape::kMaxExperts >= 16;
template <DType kDtype>
using NarrowSoftmaxNormalize = Spec<kDtype, PreFn::kSoftmax, false, kSpecGroupNone, PostFn::kNormalize>;
template <DType kDtype>
using NarrowSoftmax = Spec<kDtype, PreFn::kSoftmax, false, kSpecGroupNone, PostFn::kNone>;
template <DType kDtype>
using NarrowNoneSoftmax = Spec<kDtype, PreFn::kNone, false, kSpecGroupNone, PostFn::kSoftmax>;

// The narrow Specs of one logits dtype, as a type list.
template <DType kDtype>
using NarrowSpecs =
    std::tuple<NarrowSoftmaxNormalize<kDtype>, NarrowSoftmax<kDtype>, NarrowNoneSoftmax<kDtype>>;

template <class Shape, bool kPacked, class... Specs>
Status plan_route_spec_list(const RouteParams& p, const routing::RouteChoice& choice, const DeviceProps& props, RoutePlan* plan,
                              std::tuple<Specs...>*) {
  return plan_route_spec_packed<Shape, false, kPacked, Specs..., SpecGeneric>(p, choice, props, plan);
}
template <class... Specs>
bool any_spec_matches(const RouteParams& p, std::tuple<Specs...>*) {
  return (SpecTraits<Specs>::matches(p) || ...);
}

// Whether one of the narrow Specs serves p (route_shape_index's narrow_spec).
inline bool narrow_spec_matches(const RouteParams& p) {
  return any_spec_matches(p, static_cast<NarrowSpecs<DType::kFloat32>*>(nullptr)) ||
         any_spec_matches(p, static_cast<NarrowSpecs<DType::kBFloat16>*>(nullptr));
}

// Narrow segments on packed candidate buffers (route_warp.cuh's kNarrowPacked) where K fits them
// (2 <= K <= W) and the knob allows it: K rounds of one shuffle butterfly over packed keys instead of
// two (key, then expert), and five min / max per value for the buffer insert instead of compares and
// selects on a key and an expert (E = 64 K = 8 T = 65536: 15.5 us against 19.7;
// docs/decisions/routing-packed-keys.md).
template <class Shape>
bool use_narrow_packed(const RouteParams& p, const routing::RouteChoice& choice) {
  return choice.narrow_packed && routing::narrow_packed_fits<Shape>(p.top_k);
}

template <class Shape>
Status plan_route_shape(const RouteParams& p, const routing::RouteChoice& choice, const DeviceProps& props, RoutePlan* plan) {
  if constexpr (Shape::W == 32 && Shape::S > 4) {
    if (p.group_path == routing::kGroupNone) {
      // Up to E = 1024 (kPackedBuffers) and from kWarpForWideMinTokens rows on, the specialised
      // rules whose whole row route_warp holds in registers faster than route_warp_wide streams it
      // (see kWarpForWideMinTokens); everything else stays on the wide kernels.
      if constexpr (routing::kPackedBuffers<Shape>) {
        if (p.num_tokens >= kWarpForWideMinTokens && p.top_k >= routing::kPackedMinK) {
          using SigmoidBf16 =
              Spec<DType::kBFloat16, PreFn::kSigmoid, true, kSpecGroupNone, PostFn::kNormalize>;
          using SoftmaxF32 = Spec<DType::kFloat32, PreFn::kNone, false, kSpecGroupNone, PostFn::kSoftmax>;
          using SoftmaxBf16 = Spec<DType::kBFloat16, PreFn::kNone, false, kSpecGroupNone, PostFn::kSoftmax>;
          Status status;
          if (plan_first_match<Shape, false, SigmoidBf16, SoftmaxF32, SoftmaxBf16>(p, choice, props, plan,
                                                                                     &status))
            return status;
        }
      }
      return plan_route_spec<
          Shape, true, Spec<DType::kFloat32, PreFn::kNone, false, kSpecGroupNone, PostFn::kSoftmax>,
          Spec<DType::kBFloat16, PreFn::kNone, false, kSpecGroupNone, PostFn::kSoftmax>,
          Spec<DType::kFloat32, PreFn::kSigmoid, true, kSpecGroupNone, PostFn::kNormalize>,
          Spec<DType::kBFloat16, PreFn::kSigmoid, true, kSpecGroupNone, PostFn::kNormalize>, SpecGeneric>(
          p, choice, props, plan);
    }
  }
  if constexpr (routing::kPackedBuffers<Shape>) {
    // Whole-warp rows up to E = 1024 (past 512: with a group limit) on route_warp. Top-K: K >= 2
    // takes the packed candidate buffers (select_top_k_packed) in every kernel below; K = 1 keeps
    // the plain top-K pass (docs/decisions/routing-packed-keys.md).
    // Rows of one stripe (up to 128 experts) with Llama 4's rule (no pre function, post sigmoid)
    // take specialised kernels there (25-32 registers): the generic one (48 registers) spent about
    // a quarter of its instructions a row in run-time tests of the rule and the shared-memory
    // sizing (docs/decisions/routing-specialised-kernels.md).
    if (p.top_k < routing::kPackedMinK) {
      if constexpr (Shape::S == 1) {
        return plan_route_spec_packed<
            Shape, false, false, Spec<DType::kFloat32, PreFn::kNone, false, kSpecGroupNone, PostFn::kSigmoid>,
            Spec<DType::kBFloat16, PreFn::kNone, false, kSpecGroupNone, PostFn::kSigmoid>, SpecGeneric>(
            p, choice, props, plan);
      } else {
        return plan_route_kernel<Shape, SpecGeneric, false, false>(p, props, plan);
      }
    }
    if (p.logits_dtype == static_cast<int>(DType::kFloat32))
      return plan_route_dtype<Shape, DType::kFloat32>(p, choice, props, plan);
    if (p.logits_dtype == static_cast<int>(DType::kBFloat16))
      return plan_route_dtype<Shape, DType::kBFloat16>(p, choice, props, plan);
  }
  if constexpr (routing::kNarrowPacked<Shape>) {
    // Narrow segments: the narrow Specs of the logits dtype (kNarrowSpecs), else the generic kernel, on
    // packed or plain buffers.
    const auto launch_narrow = [&](auto packed) -> Status {
      constexpr bool kPacked = decltype(packed)::value;
      if constexpr (kNarrowSpecs<Shape>) {
        if (p.logits_dtype == static_cast<int>(DType::kFloat32))
          return plan_route_spec_list<Shape, kPacked>(p, choice, props, plan,
                                                        static_cast<NarrowSpecs<DType::kFloat32>*>(nullptr));
        if (p.logits_dtype == static_cast<int>(DType::kBFloat16))
          return plan_route_spec_list<Shape, kPacked>(p, choice, props, plan,
                                                        static_cast<NarrowSpecs<DType::kBFloat16>*>(nullptr));
      }
      return plan_route_kernel<Shape, SpecGeneric, false, kPacked>(p, props, plan);
    };
    return use_narrow_packed<Shape>(p, choice) ? launch_narrow(std::true_type{})
                                               : launch_narrow(std::false_type{});
  }
  return plan_route_kernel<Shape, SpecGeneric>(p, props, plan);
}

// The launchers of the shape indices [kFirst, kFirst + sizeof...(I)) (route_warp.cuh's kShapeTable).
template <int kFirst, int... I>
constexpr routing::ShapePlannerTable<sizeof...(I)> shape_planners(std::integer_sequence<int, I...>) {
  return {&plan_route_shape<routing::ShapeAt<kFirst + I>>...};
}

}  // namespace

}  // namespace switchyard::cuda
