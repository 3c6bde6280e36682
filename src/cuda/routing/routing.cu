// CUDA routing (docs/design.md section 2): one launch, rows spread over warps. The arithmetic and
// the per-row algorithm live in route_warp.cuh (shared with fused kernels); this file holds the
// kernel and its launcher. Compiled with -fmad=false (see src/CMakeLists.txt).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>

#include "cuda/backend.h"
#include "cuda/common/launch.cuh"
#include "cuda/routing/route_rows.cuh"
#include "cuda/routing/route_staged.cuh"
#include "cuda/routing/route_warp.cuh"

namespace switchyard::cuda {

namespace {

using routing::RouteParams;

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
constexpr int kWarpsPerBlock = 8;                    // 256 threads: many rows in flight per SM
constexpr std::size_t kMaxSmemPerBlock = 48 * 1024;  // no opt-in attribute needed

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
// packed candidate buffers (route_warp: see launch_route_shape; route_warp_wide: launch_route_for).
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

template <class Shape, class SpecT, bool kWide = false, bool kPackedTopK = true>
Status launch_route(const RouteParams& p, cudaStream_t stream) {
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
  int sms = 0;
  const Status sm_status = current_sm_count("route", &sms);
  if (!sm_status.ok()) return sm_status;
  const std::int64_t warps = (p.num_tokens + Shape::kRowsPerWarp - 1) / Shape::kRowsPerWarp;
  const int n_sm = std::max(sms, 1);
  const std::int64_t spread = (warps + n_sm - 1) / n_sm;
  warps_per_block = static_cast<int>(std::clamp<std::int64_t>(spread, 1, warps_per_block));
  const std::int64_t rows_per_block = static_cast<std::int64_t>(warps_per_block) * Shape::kRowsPerWarp;
  const std::int64_t blocks = (p.num_tokens + rows_per_block - 1) / rows_per_block;
  if (blocks > 0x7fffffff) return Status::Unsupported("route: too many tokens for one launch");
  return launch_kernel("route: kernel launch", route_kernel<Shape, SpecT, kWide, kPackedTopK>,
                       dim3(static_cast<unsigned>(blocks)), dim3(static_cast<unsigned>(warps_per_block * 32)),
                       smem_per_warp * warps_per_block, stream, /*pdl=*/true, p);
}

// The kernel of SpecT: for wide rows, the one with packed candidate buffers where SpecT is a
// specialisation and routing::wide_packed_buffers(p) asks for them, else the one with plain buffers
// (the streamed narrow segments, W < 32: always packed); otherwise route_warp's, with kPackedTopK =
// kPacked (narrow segments: the caller checked routing::narrow_packed_fits).
template <class Shape, class SpecT, bool kWide, bool kPacked = true>
Status launch_route_for(const RouteParams& p, const routing::RouteChoice& choice, cudaStream_t stream) {
  if constexpr (kWide && Shape::W < 32) {
    return launch_route<Shape, SpecT, true, true>(p, stream);
  } else if constexpr (kWide) {
    if constexpr (kSpecialised<SpecT>) {
      if (routing::wide_packed_buffers(p, choice)) return launch_route<Shape, SpecT, true, true>(p, stream);
    }
    return launch_route<Shape, SpecT, true, false>(p, stream);
  } else {
    return launch_route<Shape, SpecT, false, kPacked>(p, stream);
  }
}

// Calls launch(static_cast<S*>(nullptr)) for the first S of Specs... that matches p, its Status into
// *status, and returns true; false (nothing called) when none matches.
template <class... Specs, class Launch>
bool first_spec_match(const RouteParams& p, Status* status, const Launch& launch) {
  return ((SpecTraits<Specs>::matches(p) && (*status = launch(static_cast<Specs*>(nullptr)), true)) || ...);
}

// Launches the first of the kernels Specs... whose Spec matches p into *status and returns true;
// false (nothing launched) when none matches. kWide: the wide-row kernels; kPacked: as for
// launch_route_for.
template <class Shape, bool kWide, bool kPacked, class... Specs>
bool launch_first_match_packed(const RouteParams& p, const routing::RouteChoice& choice, cudaStream_t stream,
                               Status* status) {
  return first_spec_match<Specs...>(p, status, [&](auto* spec) {
    return launch_route_for<Shape, std::remove_pointer_t<decltype(spec)>, kWide, kPacked>(p, choice, stream);
  });
}
template <class Shape, bool kWide, class... Specs>
bool launch_first_match(const RouteParams& p, const routing::RouteChoice& choice, cudaStream_t stream,
                        Status* status) {
  return launch_first_match_packed<Shape, kWide, true, Specs...>(p, choice, stream, status);
}

// The first of the kernels Specs... whose Spec matches p; the last one is SpecGeneric, which always
// does.
template <class Shape, bool kWide, bool kPacked, class... Specs>
Status launch_route_spec_packed(const RouteParams& p, const routing::RouteChoice& choice,
                                cudaStream_t stream) {
  static_assert(std::is_same_v<std::tuple_element_t<sizeof...(Specs) - 1, std::tuple<Specs...>>, SpecGeneric>,
                "the generic kernel comes last");
  Status status = Status::Ok();
  launch_first_match_packed<Shape, kWide, kPacked, Specs...>(p, choice, stream, &status);
  return status;
}
template <class Shape, bool kWide, class... Specs>
Status launch_route_spec(const RouteParams& p, const routing::RouteChoice& choice, cudaStream_t stream) {
  return launch_route_spec_packed<Shape, kWide, true, Specs...>(p, choice, stream);
}

// The specialised configurations (model families of docs/design.md section 2), for fp32 and bf16
// logits, on the whole-warp shapes with up to 4 stripes (64 < E <= 512): softmax -> normalize
// (the issue's E=256 K=8 configuration), none -> softmax (Qwen3, gpt-oss), sigmoid + bias ->
// normalize (Kimi-K2, GLM-4.5) and the same with the lane group limit (DeepSeek-V3). Everything
// else runs the generic kernel (docs/decisions/routing-specialised-kernels.md; with fp32 logits
// the T = 4096 wave is unexplainedly sensitive to the register count).
// Past 4 stripes (513-1024 experts) only rows with a group limit reach these kernels
// (launch_route_shape): sigmoid + bias -> normalize on either group path.
// The kernels up to 4 stripes (E <= 512), after First... (checked first).
template <class Shape, DType kDtype, class... First>
Status launch_route_up_to_512(const RouteParams& p, const routing::RouteChoice& choice, cudaStream_t stream) {
  return launch_route_spec<
      Shape, false, First..., Spec<kDtype, PreFn::kSoftmax, false, kSpecGroupNone, PostFn::kNormalize>,
      Spec<kDtype, PreFn::kNone, false, kSpecGroupNone, PostFn::kSoftmax>,
      Spec<kDtype, PreFn::kSigmoid, true, kSpecGroupNone, PostFn::kNormalize, true>,
      Spec<kDtype, PreFn::kSigmoid, true, kSpecGroupLanes, PostFn::kNormalize, true>,
      Spec<kDtype, PreFn::kSigmoid, true, kSpecGroupNone, PostFn::kNormalize>,
      Spec<kDtype, PreFn::kSigmoid, true, kSpecGroupLanes, PostFn::kNormalize>, SpecGeneric>(p, choice,
                                                                                             stream);
}

template <class Shape, DType kDtype>
Status launch_route_dtype(const RouteParams& p, const routing::RouteChoice& choice, cudaStream_t stream) {
  if constexpr (Shape::S > 4) {
    return launch_route_spec<
        Shape, false, Spec<kDtype, PreFn::kSigmoid, true, kSpecGroupChunks, PostFn::kNormalize>,
        Spec<kDtype, PreFn::kSigmoid, true, kSpecGroupLanes, PostFn::kNormalize>, SpecGeneric>(p, choice,
                                                                                               stream);
  } else if constexpr (Shape::S == 2) {
    // 129 <= E <= 256: DeepSeek-V3's group limit (groups of 32 experts, shift 3) with the shift fixed
    // (route_warp's kGroupShift: butterflies unrolled, pair ranks), early bias first; then
    // DeepSeek-V2's rule (softmax, the chunk group path without lanes: groups of 20 experts, no post
    // function), 20% faster than the generic kernel at T = 65536
    // (docs/decisions/routing-specialised-kernels.md).
    return launch_route_up_to_512<
        Shape, kDtype, Spec<kDtype, PreFn::kSigmoid, true, kSpecGroupLanes, PostFn::kNormalize, true, 3>,
        Spec<kDtype, PreFn::kSigmoid, true, kSpecGroupLanes, PostFn::kNormalize, false, 3>,
        Spec<kDtype, PreFn::kSoftmax, false, kSpecGroupChunks, PostFn::kNone>>(p, choice, stream);
  } else {
    return launch_route_up_to_512<Shape, kDtype>(p, choice, stream);
  }
}

// Wide rows (route_warp_wide, E > 512 without a group limit): the generic kernel (80 registers,
// a few spilled), and specialised ones for none -> softmax, the wide-2048 preset's rule (56-59
// registers, 4 blocks per SM), and for sigmoid + bias -> normalize (74-80 registers), each with
// packed or plain candidate buffers (launch_route_for). Group limits past E = 512 keep route_warp
// (their paths rank from the whole row in registers): packed buffers and specialised sigmoid + bias
// kernels up to E = 1024, the generic kernel on plain buffers past it.
// Rows of 513-1024 experts without a group limit, K >= 2: route_warp (the row in registers, packed
// buffers) instead of route_warp_wide from this many rows on, for bf16 sigmoid + bias -> normalize
// and fp32 / bf16 none -> softmax; not below it (the wide kernels' rows are shorter) nor for fp32
// sigmoid + bias (the fp32 row's registers). docs/decisions/routing-wide-rows.md.
constexpr std::int64_t kWarpForWideMinTokens = 1024;

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
Status launch_route_spec_list(const RouteParams& p, const routing::RouteChoice& choice, cudaStream_t stream,
                              std::tuple<Specs...>*) {
  return launch_route_spec_packed<Shape, false, kPacked, Specs..., SpecGeneric>(p, choice, stream);
}
template <class... Specs>
bool any_spec_matches(const RouteParams& p, std::tuple<Specs...>*) {
  return (SpecTraits<Specs>::matches(p) || ...);
}

// Whether one of the narrow Specs serves p (route_shape_index's narrow_spec).
bool narrow_spec_matches(const RouteParams& p) {
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
Status launch_route_shape(const RouteParams& p, const routing::RouteChoice& choice, cudaStream_t stream) {
  if constexpr (Shape::W == 32 && Shape::S > 4) {
    if (p.group_path == routing::kGroupNone) {
      // Up to E = 1024 (kPackedBuffers) and from kWarpForWideMinTokens rows on, the specialised
      // rules whose whole row route_warp holds in registers faster than route_warp_wide streams it
      // (see kWarpForWideMinTokens); everything else stays on the wide kernels.
      if constexpr (routing::kPackedBuffers<Shape>) {
        if (p.num_tokens >= kWarpForWideMinTokens && p.top_k >= routing::dev::kPackedMinK) {
          using SigmoidBf16 =
              Spec<DType::kBFloat16, PreFn::kSigmoid, true, kSpecGroupNone, PostFn::kNormalize>;
          using SoftmaxF32 = Spec<DType::kFloat32, PreFn::kNone, false, kSpecGroupNone, PostFn::kSoftmax>;
          using SoftmaxBf16 = Spec<DType::kBFloat16, PreFn::kNone, false, kSpecGroupNone, PostFn::kSoftmax>;
          Status status;
          if (launch_first_match<Shape, false, SigmoidBf16, SoftmaxF32, SoftmaxBf16>(p, choice, stream,
                                                                                     &status))
            return status;
        }
      }
      return launch_route_spec<
          Shape, true, Spec<DType::kFloat32, PreFn::kNone, false, kSpecGroupNone, PostFn::kSoftmax>,
          Spec<DType::kBFloat16, PreFn::kNone, false, kSpecGroupNone, PostFn::kSoftmax>,
          Spec<DType::kFloat32, PreFn::kSigmoid, true, kSpecGroupNone, PostFn::kNormalize>,
          Spec<DType::kBFloat16, PreFn::kSigmoid, true, kSpecGroupNone, PostFn::kNormalize>, SpecGeneric>(
          p, choice, stream);
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
    if (p.top_k < routing::dev::kPackedMinK) {
      if constexpr (Shape::S == 1) {
        return launch_route_spec_packed<
            Shape, false, false, Spec<DType::kFloat32, PreFn::kNone, false, kSpecGroupNone, PostFn::kSigmoid>,
            Spec<DType::kBFloat16, PreFn::kNone, false, kSpecGroupNone, PostFn::kSigmoid>, SpecGeneric>(
            p, choice, stream);
      } else {
        return launch_route<Shape, SpecGeneric, false, false>(p, stream);
      }
    }
    if (p.logits_dtype == static_cast<int>(DType::kFloat32))
      return launch_route_dtype<Shape, DType::kFloat32>(p, choice, stream);
    if (p.logits_dtype == static_cast<int>(DType::kBFloat16))
      return launch_route_dtype<Shape, DType::kBFloat16>(p, choice, stream);
  }
  if constexpr (routing::kNarrowPacked<Shape>) {
    // Narrow segments: the narrow Specs of the logits dtype (kNarrowSpecs), else the generic kernel, on
    // packed or plain buffers.
    const auto launch_narrow = [&](auto packed) -> Status {
      constexpr bool kPacked = decltype(packed)::value;
      if constexpr (kNarrowSpecs<Shape>) {
        if (p.logits_dtype == static_cast<int>(DType::kFloat32))
          return launch_route_spec_list<Shape, kPacked>(p, choice, stream,
                                                        static_cast<NarrowSpecs<DType::kFloat32>*>(nullptr));
        if (p.logits_dtype == static_cast<int>(DType::kBFloat16))
          return launch_route_spec_list<Shape, kPacked>(p, choice, stream,
                                                        static_cast<NarrowSpecs<DType::kBFloat16>*>(nullptr));
      }
      return launch_route<Shape, SpecGeneric, false, kPacked>(p, stream);
    };
    return use_narrow_packed<Shape>(p, choice) ? launch_narrow(std::true_type{})
                                               : launch_narrow(std::false_type{});
  }
  return launch_route<Shape, SpecGeneric>(p, stream);
}

// Streamed narrow segments (route_warp.cuh's use_stream): route_warp_wide with 8 lanes a row, 4 rows a
// warp, streaming 2 stripes at a time into packed buffers of depth 4 (48 registers, 5 blocks per SM),
// for sigmoid + fp32 bias -> normalize without a group limit (GLM-4.5's rule), fp32 and bf16 logits.
// A whole warp holds such a row in 2 stripes of 128 (256 experts), so at E = 160 three of its eight
// values per lane are padding; 8 lanes hold E / 8 values each, in E / 32 stripes. Rows without that
// padding gain nothing from the form (docs/decisions/routing-wide-rows.md).
bool launch_route_stream(const RouteParams& p, const routing::RouteChoice& choice, cudaStream_t stream,
                         Status* status) {
  using Shape = routing::StreamShape<routing::kStreamLanes, 6, 4, 2, 5>;
  static_assert(routing::kStreamMaxExperts <= Shape::kMaxExperts, "the stream shape's experts");
  return launch_first_match<
      Shape, true, Spec<DType::kFloat32, PreFn::kSigmoid, true, kSpecGroupNone, PostFn::kNormalize>,
      Spec<DType::kBFloat16, PreFn::kSigmoid, true, kSpecGroupNone, PostFn::kNormalize>>(p, choice, stream,
                                                                                         status);
}

// One thread per row (route_rows.cuh): kE experts held, a buffer of kK picks; SpecT as for
// route_kernel (launch_route_rows_for's Specs, or SpecGeneric).
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
Status launch_route_rows(const RouteParams& p, cudaStream_t stream) {
  // Blocks of up to 256 threads, fewer where that spreads the rows over more SMs (as
  // launch_route does with warps).
  int sms = 0;
  const Status sm_status = current_sm_count("route", &sms);
  if (!sm_status.ok()) return sm_status;
  const std::int64_t warps = (p.num_tokens + 31) / 32;
  const std::int64_t spread = (warps + std::max(sms, 1) - 1) / std::max(sms, 1);
  const int threads = 32 * static_cast<int>(std::clamp<std::int64_t>(spread, 1, 8));
  const std::int64_t blocks = (p.num_tokens + threads - 1) / threads;
  if (blocks > 0x7fffffff) return Status::Unsupported("route: too many tokens for one launch");
  return launch_kernel("route: kernel launch", route_rows_kernel<kE, kK, SpecT>,
                       dim3(static_cast<unsigned>(blocks)), dim3(static_cast<unsigned>(threads)), 0, stream,
                       /*pdl=*/true, p);
}

// The route_rows kernel of the first of Specs... that matches p (the last one is SpecGeneric).
template <int kE, int kK, class... Specs>
Status launch_route_rows_spec(const RouteParams& p, cudaStream_t stream) {
  Status status = Status::Ok();
  first_spec_match<Specs...>(p, &status, [&](auto* spec) {
    return launch_route_rows<kE, kK, std::remove_pointer_t<decltype(spec)>>(p, stream);
  });
  return status;
}

// route_rows for p (routing::rows_kernel_fits): the smallest kE >= E and kK >= K, with specialised
// kernels for the rules of Mixtral (and Phi-3.5-MoE: none -> softmax) and DBRX (softmax ->
// normalize), fp32 and bf16 logits (docs/decisions/routing-specialised-kernels.md).
Status launch_route_rows_for(const RouteParams& p, cudaStream_t stream) {
  static_assert(routing::kRowsMaxExperts == 16 && routing::kRowsMaxTopK == 8, "the kernels below");
  const int e_cap = p.num_experts <= 8 ? 8 : 16;
  const int k_cap = p.top_k <= 2 ? 2 : p.top_k <= 4 ? 4 : 8;
  return dispatch_value<8, 16>("route rows: experts held", e_cap, [&](auto e) {
    return dispatch_value<2, 4, 8>("route rows: buffer depth", k_cap, [&](auto k) {
      return launch_route_rows_spec<decltype(e)::value, decltype(k)::value,
                                    NarrowNoneSoftmax<DType::kFloat32>, NarrowNoneSoftmax<DType::kBFloat16>,
                                    NarrowSoftmaxNormalize<DType::kFloat32>,
                                    NarrowSoftmaxNormalize<DType::kBFloat16>, SpecGeneric>(p, stream);
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

// One staged kernel over `blocks` blocks; its shared memory passes the 48 KB default (an opt-in).
template <DType kDtype, routing::StagedRule kRule, bool kGroups, bool kApprox = false>
Status launch_staged_kernel(const RouteParams& p, std::int64_t blocks, cudaStream_t stream) {
  constexpr auto kKernel = route_staged_kernel<kDtype, kRule, kGroups, kApprox>;
  constexpr std::size_t kSmem = routing::StagedLayout<kDtype>::kBlockBytes;
  const cudaError_t err = set_attribute_at_least<kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize>(kSmem);
  if (err != cudaSuccess) return cuda_status("route: staged kernel shared memory", err);
  return launch_kernel("route: staged kernel launch", kKernel, dim3(static_cast<unsigned>(blocks)),
                       dim3(32 * routing::kStagedWarps), kSmem, stream, /*pdl=*/true, p);
}

// The staged kernel for p (routing::staged_fits); approx: sigmoid + bias rows select on approximate
// sigmoids (routing::staged_approx_knob).
Status launch_route_staged(const RouteParams& p, bool approx, cudaStream_t stream) {
  using routing::StagedRule;
  const std::int64_t rows_per_block = 32 * routing::kStagedWarps;
  const std::int64_t blocks = (p.num_tokens + rows_per_block - 1) / rows_per_block;
  if (blocks > 0x7fffffff) return Status::Unsupported("route: too many tokens for one launch");
  StagedRule rule = StagedRule::kSigmoidBias;
  routing::staged_rule_of(p, &rule);
  const bool groups = p.group_path != routing::kGroupNone;
  const auto launch = [&](auto dtype) {
    constexpr DType kDtype = decltype(dtype)::value;
    if (rule == StagedRule::kLogits)
      return launch_staged_kernel<kDtype, StagedRule::kLogits, false>(p, blocks, stream);
    if (rule == StagedRule::kSoftmaxPicks)
      return launch_staged_kernel<kDtype, StagedRule::kSoftmaxPicks, false>(p, blocks, stream);
    if (approx) {
      return groups ? launch_staged_kernel<kDtype, StagedRule::kSigmoidBias, true, true>(p, blocks, stream)
                    : launch_staged_kernel<kDtype, StagedRule::kSigmoidBias, false, true>(p, blocks, stream);
    }
    return groups ? launch_staged_kernel<kDtype, StagedRule::kSigmoidBias, true>(p, blocks, stream)
                  : launch_staged_kernel<kDtype, StagedRule::kSigmoidBias, false>(p, blocks, stream);
  };
  if (p.logits_dtype == static_cast<int>(DType::kFloat32))
    return launch(std::integral_constant<DType, DType::kFloat32>{});
  return launch(std::integral_constant<DType, DType::kBFloat16>{});
}

}  // namespace

Status route(const detail::RouteArgs& args, Stream stream) {
  if (args.num_tokens == 0) return Status::Ok();
  if (args.config.top_k > kMaxGpuTopK) {
    return Status::Unsupported("route: K = " + std::to_string(args.config.top_k) +
                               " exceeds the CUDA backend's maximum of " + std::to_string(kMaxGpuTopK));
  }
  const RouteParams p = routing::make_route_params(args);
  const routing::RouteChoice choice = routing::route_choice(args.options);
  if (routing::use_rows_kernel(p, choice.form)) return launch_route_rows_for(p, stream);
  if (routing::use_staged(p, choice)) return launch_route_staged(p, choice.staged_approx, stream);
  if (routing::use_stream(p, choice)) {
    Status status;
    if (launch_route_stream(p, choice, stream, &status)) return status;
  }
  return routing::dispatch_route_shape(
      args.config.num_experts, args.num_tokens, args.config.top_k,
      [&](auto shape) { return launch_route_shape<decltype(shape)>(p, choice, stream); }, args.config.pre,
      narrow_spec_matches(p), choice);
}

}  // namespace switchyard::cuda
