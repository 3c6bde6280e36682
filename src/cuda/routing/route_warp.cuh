// The per-row routing routine of the CUDA backend (docs/design.md section 2), as a __device__
// function that a fused kernel (route + layout) can call. It reproduces the CPU oracle
// (src/cpu/routing/routing_cpu.cpp) bit for bit: ids (tie order included) and weights.
//
// STABLE INTERFACE (other kernels call it; keep these signatures). The host side is route_plan.h:
//
//   RouteParams make_route_params(const detail::RouteArgs& args);            // host
//   int route_shape_index(int num_experts, std::int64_t num_tokens, PreFn pre, bool narrow_spec,
//                         int top_k, const RouteChoice& choice);                  // host
//       the kShapeTable entry (ShapeAt<index>: RouteShape<W, S, D>) for E, T, K and the pre
//       function, or -1 past kMaxGpuExperts; route_shapes.h maps it to its planner.
//   std::size_t route_smem_bytes_per_warp<Shape, bool kPackedTopK = true>(const RouteParams& p);
//       dynamic shared memory each warp of route_warp<Shape, ..., kPackedTopK> must own
//       (group limits; the row's keys for the packed candidate buffers).
// and here:
//   template <class Shape, bool kEarlyBias = false, bool kPackedTopK = true, int kGroupShift = 0>
//       __device__ void route_warp(const RouteParams& p, std::int64_t first_row,
//       unsigned char* warp_smem, RoutedPicks<Shape>* picks);
//       kGroupShift > 0: p.group_shift (lane group path) is known to equal it (see
//       group_limit_lanes); 0: any.
//       Called by all 32 lanes of a converged warp. Routes the Shape::kRowsPerWarp rows
//       first_row, first_row + 1, ... (rows >= p.num_tokens are computed on dummy data and not
//       written). Writes topk_ids / topk_weights when p.topk_ids / p.topk_weights are
//       non-null. `warp_smem` (route_smem_bytes_per_warp bytes, 16-byte aligned, private to
//       the warp) may be nullptr when that size is 0. When `picks` is non-null it receives,
//       per lane, the picks it holds: lane L of the warp serves row first_row + L / W and
//       holds picks k = s * W + L % W for s < Shape::kSlots and k < K (expert id and final
//       weight); see RoutedPicks. Lanes of rows >= p.num_tokens hold dummy picks: check the
//       row before using them.
//   The caller must call pdl_wait() (cuda/common/launch.cuh) before route_warp when launched
//   with programmatic dependent launch.
//   route_warp_wide<Shape, kPackedTopK = false>(p, first_row, picks): the same contract without a
//   group limit, holding one batch of stripes in registers instead of the whole row (see "Wide
//   rows" below): one row per warp (W = 32, any S; the caller skips warps whose row is past T), or
//   narrow segments (W < 32, packed buffers and a pre function other than softmax only, any E up
//   to 4 * W * S: the streamed narrow segments of kStreamLanes; a row past T reads row T - 1 and
//   writes nothing).
//   kPackedTopK: route_warp: the packed candidate buffers (whole-warp rows up to E = 1024, any K;
//       narrow segments with 2 <= W < 32 for kNarrowPackedMinK <= K <= W only, which the caller
//       must ensure: narrow_packed_fits; see Top-K below); route_warp_wide: the same buffers up to
//       E = 2048.
//
// DESIGN
//   Layout. A row is served by W lanes (a "segment"; W = 32 for E > 64 and for E <= 64 at small T,
//   fewer for E <= 64 otherwise so that one warp routes 32 / W rows; see kShapeTable; rows of
//   <= 16 experts at large T take route_rows.cuh instead). Lane l of a segment owns the experts
//   e = 4*W*i + 4*l + c (stripe i < S, c < 4): four consecutive experts per stripe, so fp32
//   loads are float4 (8-byte loads for bf16/fp16). With W = 32 this is exactly the canonical
//   softmax layout of routing.h (partial j = (e / 4) % 32 is lane j); with W < 32 a lane holds
//   the partials W*a + l in 32/W accumulators and does the butterfly steps >= W in registers,
//   the steps < W with shuffles, in the oracle's order (16, 8, 4, 2, 1).
//   Arithmetic. exp, sigmoid and the softmax divisions below give the oracle's bits: exp_fast
//   is exp_f32 with rintf done by the 1.5*2^23 trick and the final 2^n scaling done on the
//   exponent bits (exact whenever the result is normal, which |x| <= 86.5 guarantees; checked
//   on the host for all 2.2e9 floats in that range); x / sum with sum in [1, 4096] and
//   x >= 2^-64 uses y = RN(1/sum), q = RN(x*y), q += RN(x - sum*q)*y (Markstein's theorem:
//   correctly rounded; also checked on 1.6e9 samples). Everything else falls back to
//   detail::exp_f32 / IEEE division, so the result is exact for every input.
//   Ranking. A selection score q (canonical: NaN -> -inf) becomes an ordered 32-bit key
//   (larger q <=> larger key, -0 == +0); key 0 is below -inf and marks "not a candidate"
//   (padding past E, experts of dropped groups). ranks_before(q, e) is then (key desc, e asc).
//   Top-K. Each lane keeps its best D candidates, sorted, in registers, and the largest key it
//   holds outside them (`next`). Each round the segment
//   reduces the heads twice (max key, then min expert among equal keys): redux.sync for a whole
//   warp, xor-shuffle butterflies inside narrower segments (each shuffle serves 32/W rows; a
//   per-segment redux.sync would be serialized). The winning lane pops its head. A fast pass
//   runs the K rounds (unrolled) with nothing else: a lane whose buffer ran dry shows key 0.
//   Then one vote: if some dry lane's `next` is >= the key of pick K - 1 (equality counts, as
//   `next` has no expert index), a candidate hidden in that lane might have been due, and the
//   exact rounds take over from the first pick whose key is <= the largest such `next` (the
//   picks before it rank above every hidden candidate, so they are right; each lane refills its
//   buffer with its candidates after its last pick among them). In the exact rounds a lane
//   whose buffer runs dry shows `next` as a "ghost" head claiming the lowest expert index: only
//   if a ghost wins a round may the lane hold that round's pick, and only then does it rescan
//   its values for the next D after its last pop; the round is redone. Both are rare (a lane
//   must hold more than D of the K picks) and the buffers stay small. (Idea of
//   per-thread candidate queues merged by warp reductions: FAISS WarpSelect, TensorRT-LLM's MoE top-k
//   kernels; this code is our own.) Packed keys: a key with its low 7-11 bits replaced by the
//   inverted expert index orders (bits left, the "bucket", desc; expert asc), exact unless two
//   keys share a bucket and differ, which a check after the rounds detects; then the exact rounds
//   start from the first pick. Whole-warp rows up to E = 1024 (kPackedTopK) keep packed keys in
//   their buffers (insert = eight min / max per two values; one redux.sync per round; full keys in shared
//   memory; select_top_k_packed); so do the specialised kernels' wide rows up to E = 2048 (bf16 / fp16
//   logits without pre function or bias at every T, other keys from kWidePackedMinTokens rows on; full
//   keys recomputed from the logits and bias), where two picks of one bucket above the last pick's are
//   sorted instead of redone.
//   Groups. With group size G % 4 == 0 and at most 2 scores summed per group (top2_sum, max, topk_sum with
//   K/topk_group <= 2), each lane puts the top-2 keys of each of its 4-expert chunks in shared memory, lanes
//   merge the chunks of one group each, and topk_group rounds of segment reductions pick the groups. Any
//   other group configuration takes a generic path: the row's keys go to shared memory and each lane ranks
//   its groups by scanning. With W = 32, G / 4 a power of two and n_group <= 32 (DeepSeek-V3) a group's
//   chunks are consecutive lanes of one stripe: xor butterflies, and each group's rank among the groups from
//   n_group independent broadcasts, or, where a Spec fixes G (DeepSeek-V3's 8 groups of 32), from pairs
//   of lanes that each compare one group with the S groups they hold, kept where rank < topk_group
//   (group_limit_lanes). Weights. Pick k sits in
//   lane k % W of the segment (slot k / W). p of a pick equals its q (no bias) or is recomputed from the
//   logit (with bias, or q == 0 where p may be -0), with the same code as the main pass. Sums over the K
//   picks run in k order (shuffles), the rest is per lane.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "common/numeric.h"
#include "common/op_args.h"
#include "common/routing_math.h"
#include "cuda/common/launch.cuh"
#include "cuda/routing/route_plan.h"
#include "switchyard/routing.h"
#include "switchyard/status.h"

namespace switchyard::cuda::routing {

// ---------------------------------------------------------------------------------------------
// Parameters (host-built, passed by value to kernels: route_plan.h's RouteParams).

// One word of each 16 bytes of RouteParams, XORed, for the routing kernels' keep_loaded (launch.cuh)
// before pdl_wait(). By name: the kernels take RouteParams by value, and reading it through its
// address would make a local copy.
static_assert(offsetof(RouteParams, row_stride) / 16 == 0 && offsetof(RouteParams, num_tokens) / 16 == 1 &&
                  offsetof(RouteParams, bias_dtype) / 16 == 2 && offsetof(RouteParams, ids_int64) / 16 == 3 &&
                  offsetof(RouteParams, weights_bf16) / 16 == 4 && offsetof(RouteParams, top_k) / 16 == 5 &&
                  offsetof(RouteParams, n_group) / 16 == 6 && offsetof(RouteParams, group_take) / 16 == 7 &&
                  sizeof(RouteParams) == 128,
              "route_params_xor reads one field of each 16 bytes");
__device__ __forceinline__ unsigned route_params_xor(const RouteParams& p) {
  return static_cast<unsigned>(p.row_stride) ^ static_cast<unsigned>(p.num_tokens) ^
         static_cast<unsigned>(p.bias_dtype) ^ static_cast<unsigned>(p.ids_int64) ^
         static_cast<unsigned>(p.weights_bf16) ^ static_cast<unsigned>(p.top_k) ^
         static_cast<unsigned>(p.n_group) ^ static_cast<unsigned>(p.group_take);
}

// The logits of rows [first, first + rows) (those below num_tokens) and the bias into L2 before
// pdl_wait() (launch.cuh's prefetch_l2), by one thread of a block: one range where the rows are
// contiguous, else one a row.
__device__ __forceinline__ void prefetch_route_inputs(const RouteParams& p, std::int64_t first,
                                                      std::int64_t rows) {
  const std::int64_t n = rows < p.num_tokens - first ? rows : p.num_tokens - first;
  if (n <= 0) return;
  const std::int64_t elem = p.logits_dtype == static_cast<int>(DType::kFloat32) ? 4 : 2;
  const unsigned char* base = static_cast<const unsigned char*>(p.logits) + first * p.row_stride * elem;
  if (p.row_stride == p.num_experts) {
    prefetch_l2(base, static_cast<unsigned long long>(n * p.num_experts * elem));
  } else {
    for (std::int64_t r = 0; r < n; ++r)
      prefetch_l2(base + r * p.row_stride * elem, static_cast<unsigned long long>(p.num_experts * elem));
  }
  if (p.bias != nullptr) {
    const int bias_elem = p.bias_dtype == static_cast<int>(DType::kFloat32) ? 4 : 2;
    prefetch_l2(p.bias, static_cast<unsigned long long>(p.num_experts) * bias_elem);
  }
}

// x / d for the d of route_plan.h's div_magic(d) = magic.
__device__ __forceinline__ unsigned fast_div(unsigned x, unsigned magic) {
  return magic == 0 ? x : __umulhi(x, magic);
}

// The picks a lane holds after route_warp: pick k = s * W + (lane % W) of row first_row +
// lane / W, for s < kSlots with k < K.
template <class Shape>
struct RoutedPicks {
  int expert[Shape::kSlots];
  float weight[Shape::kSlots];
};

// ---------------------------------------------------------------------------------------------
// Device arithmetic.

namespace dev {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr std::uint32_t kNegInfKey = 0x007fffffu;  // score_key(-inf)
constexpr std::uint32_t kPosInfKey = 0xff800000u;  // score_key(+inf)
constexpr std::uint32_t kZeroKey = 0x80000000u;    // score_key(+0) == score_key(-0)

__device__ __forceinline__ float neg_inf() { return __uint_as_float(0xff800000u); }
// max(a, b) that returns NaN when either is NaN (fmaxf returns the other operand).
__device__ __forceinline__ float max_nan(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a != a || b != b) ? a + b : fmaxf(a, b);
#endif
}
// min(a, b) that returns NaN when either is NaN.
__device__ __forceinline__ float min_nan(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a != a || b != b) ? a + b : fminf(a, b);
#endif
}
using ::switchyard::detail::finite_abs;  // common/routing_math.h

// Ordered key of a non-NaN score, -0 ranking just below +0 (see the file comment).
__device__ __forceinline__ std::uint32_t score_key_signed(float q) {
  const std::uint32_t u = __float_as_uint(q);
  return u ^ (static_cast<std::uint32_t>(static_cast<std::int32_t>(u) >> 31) | 0x80000000u);
}
// The same with -0 == +0: q + 0 turns -0 into +0.
__device__ __forceinline__ std::uint32_t score_key(float q) { return score_key_signed(__fadd_rn(q, 0.0f)); }
// canonical_score (NaN -> -inf) and then the key. max.f32 returns the non-NaN operand.
__device__ __forceinline__ std::uint32_t canonical_key(float q) { return score_key(fmaxf(q, neg_inf())); }
__device__ __forceinline__ float key_score(std::uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k ^ 0x80000000u) : ~k);
}
__device__ __forceinline__ bool key_finite(std::uint32_t k) { return k > kNegInfKey && k < kPosInfKey; }

// Lane-relative expert offset of value j: e = base(j) + 4 * (lane % W).
template <class Shape>
__device__ __forceinline__ constexpr int value_base(int j) {
  return 4 * Shape::W * (j / 4) + (j % 4);
}

// detail::exp_f32 for |x| <= 86.5 (bit-identical there; see the file comment).
__device__ __forceinline__ float exp_fast(float x) {
  const float y = __fmul_rn(x, 1.44269502162933349609375f);
  const float t = __fadd_rn(y, 12582912.0f);  // 1.5 * 2^23: t = 1.5*2^23 + rint(y)
  const float n = __fadd_rn(t, -12582912.0f);
  float r = fmaf(n, -0.693145751953125f, x);
  r = fmaf(n, -1.428606765330187045e-06f, r);
  float p = 1.98412698412698e-04f;
  p = fmaf(p, r, 1.38888888888889e-03f);
  p = fmaf(p, r, 8.33333333333333e-03f);
  p = fmaf(p, r, 4.16666666666667e-02f);
  p = fmaf(p, r, 1.66666666666667e-01f);
  p = fmaf(p, r, 0.5f);
  p = fmaf(p, r, 1.0f);
  p = fmaf(p, r, 1.0f);
  // bits(t) = 0x4B400000 + n and 0x4B400000 << 23 == 0 (mod 2^32): adds n to p's exponent.
  return __uint_as_float(__float_as_uint(p) + (__float_as_uint(t) << 23));
}

__device__ inline __noinline__ float exp_slow(float x) { return detail::exp_f32(x); }
__device__ inline __noinline__ float pre_slow(PreFn pre, float s) { return detail::pre_elementwise(pre, s); }
__device__ inline __noinline__ float div_slow(float a, float b) { return __fdiv_rn(a, b); }

__device__ __forceinline__ float exp_any(float x) { return fabsf(x) <= 86.5f ? exp_fast(x) : exp_slow(x); }

// RN(1 / d) for d in [1, 2^125] without a branch: the fast path of the compiler's own rcp.rn
// lowering for normal inputs (sm_90 SASS: MUFU.RCP; FFMA d*y-1; FFMA y+y*e), which it takes
// whenever d's biased exponent is in [1, 252], so the bits are those of __frcp_rn(d).
__device__ __forceinline__ float rcp_normal(float d) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(d));
  return fmaf(y, fmaf(-d, y, 1.0f), y);
#else
  return __frcp_rn(d);  // host emulation of this file
#endif
}

// Sigmoid for |s| <= 86.5 (d = 1 + exp(-s) is then in [1, 2^125]).
__device__ __forceinline__ float sigmoid_fast(float s) { return rcp_normal(__fadd_rn(1.0f, exp_fast(-s))); }

// An approximate sigmoid for |s| <= 86.5 (MUFU ex2 and rcp: 2 ALU instructions and 2 MUFU against
// sigmoid_fast's ~17 and 1), within kSigmoidApproxErr of sigmoid_fast's bits there: the largest
// difference over every such float, measured on the H200, was 1.79e-7 = 2^-22.42, and the GPU test
// RoutingCuda.ApproxSigmoidBound checks the bound. Used only to select (route_staged.cuh's kApprox
// rows, which certify their picks on exact scores), never for a weight
// (docs/decisions/routing-approx-sigmoid.md).
constexpr float kSigmoidApproxErr = 0x1p-21f;
__device__ __forceinline__ float sigmoid_approx(float s) {
#if defined(__CUDA_ARCH__)
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(__fmul_rn(s, -1.44269502162933349609375f)));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(__fadd_rn(1.0f, e)));
  return r;
#else
  return sigmoid_fast(s);  // host emulation of this file
#endif
}

// detail::sigmoid_f32 / pre_elementwise(kSigmoid, s), bit for bit, for any s.
__device__ __forceinline__ float sigmoid_pre(float s) {
  if (fabsf(s) <= 86.5f) return sigmoid_fast(s);
  return pre_slow(PreFn::kSigmoid, s);
}

// a / b, correctly rounded, for a in [2^-64, 1] (or 0) and b in [1, 4096] given y = RN(1 / b).
__device__ __forceinline__ float div_fast(float a, float b, float y) {
  const float q = __fmul_rn(a, y);
  const float r = fmaf(-b, q, a);
  return fmaf(r, y, q);
}
// The same for any a in [0, 1].
__device__ __forceinline__ float div_by(float a, float b, float y) {
  if (a < 0x1p-64f && a != 0.0f) return div_slow(a, b);
  return div_fast(a, b, y);
}

// The softmax denominator of a row from each lane's NA partial sums (accumulator a holds
// partial W*a + l): the canonical butterfly's steps >= W inside the lane, then those < W
// across the segment, in the oracle's order.
template <int W, int NA>
__device__ __forceinline__ float softmax_row_sum(float (&acc)[NA]) {
#pragma unroll
  for (int h = NA / 2; h >= 1; h /= 2) {
    float next[NA];
#pragma unroll
    for (int a = 0; a < NA; ++a) next[a] = __fadd_rn(acc[a], acc[a ^ h]);
#pragma unroll
    for (int a = 0; a < NA; ++a) acc[a] = next[a];
  }
  float sum = acc[0];
#pragma unroll
  for (int off = W / 2; off >= 1; off /= 2) sum = __fadd_rn(sum, __shfl_xor_sync(kFullMask, sum, off));
  return sum;
}

// Softmax constants of one row: p = exp(s - m) / sum for finite s.
struct SoftmaxRow {
  float m, sum, rcp;
};
__device__ __forceinline__ float softmax_pre(float s, const SoftmaxRow& sm) {
  return finite_abs(s) ? div_by(exp_any(__fadd_rn(s, -sm.m)), sm.sum, sm.rcp) : s;
}

// Element-wise pre-score of one logit (not softmax).
__device__ __forceinline__ float elementwise_pre(PreFn pre, float s) {
  if (pre == PreFn::kSigmoid) return sigmoid_pre(s);
  if (pre == PreFn::kSqrtSoftplus) return pre_slow(pre, s);
  return s;
}

__device__ __forceinline__ float load_one(const void* base, int dtype, std::int64_t i) {
  if (dtype == static_cast<int>(DType::kFloat32)) return __ldg(static_cast<const float*>(base) + i);
  const unsigned short h = __ldg(static_cast<const unsigned short*>(base) + i);
  if (dtype == static_cast<int>(DType::kBFloat16)) return __uint_as_float(static_cast<unsigned>(h) << 16);
  return __half2float(__ushort_as_half(h));  // fp16 -> fp32 is exact
}

// The logit an absent expert (e >= E in a row's last stripe) reads as: -inf with a softmax pre
// function (outside every softmax sum), else 0. The keys of absent experts are set to 0 anyway, so
// any finite value serves, and 0 keeps the lane on the fast sigmoid path (a lane with an infinite
// logit takes the exact general one for every value, and its warp then runs both: GLM-4.5's E = 160
// puts 24 of the 32 lanes' second-stripe values past E).
__device__ __forceinline__ float absent_fill(PreFn pre) { return pre == PreFn::kSoftmax ? neg_inf() : 0.0f; }

// Loads experts e0 .. e0+3 of a row (absent ones, e >= E or !ok, give `fill`).
__device__ __forceinline__ void load_chunk(const void* base, int dtype, bool vec, int e0, int E, bool ok,
                                           float fill, float* out) {
  if (ok && vec && e0 + 4 <= E) {
    if (dtype == static_cast<int>(DType::kFloat32)) {
      const float4 x = __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(base) + e0));
      out[0] = x.x;
      out[1] = x.y;
      out[2] = x.z;
      out[3] = x.w;
    } else {
      const uint2 x = __ldg(reinterpret_cast<const uint2*>(static_cast<const unsigned short*>(base) + e0));
      const unsigned h[4] = {x.x & 0xffffu, x.x >> 16, x.y & 0xffffu, x.y >> 16};
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        out[c] = dtype == static_cast<int>(DType::kBFloat16)
                     ? __uint_as_float(h[c] << 16)
                     : __half2float(__ushort_as_half(static_cast<unsigned short>(h[c])));
      }
    }
    return;
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) out[c] = (ok && e0 + c < E) ? load_one(base, dtype, e0 + c) : fill;
}

// Sorted candidate buffer insert (best first; equal keys keep the earlier, lower expert).
// `next` tracks the (D+1)-th largest key inserted (keys only, with multiplicity): the largest
// key left outside the buffer.
template <int D>
__device__ __forceinline__ void buffer_insert(std::uint32_t (&bk)[D], int (&bb)[D], std::uint32_t& next,
                                              std::uint32_t x, int base) {
  next = max(next, min(x, bk[D - 1]));
  bool gt[D];
#pragma unroll
  for (int d = 0; d < D; ++d) gt[d] = x > bk[d];
#pragma unroll
  for (int d = D - 1; d >= 1; --d) {
    bk[d] = gt[d - 1] ? bk[d - 1] : (gt[d] ? x : bk[d]);
    bb[d] = gt[d - 1] ? bb[d - 1] : (gt[d] ? base : bb[d]);
  }
  bk[0] = gt[0] ? x : bk[0];
  bb[0] = gt[0] ? base : bb[0];
}

// Removes the buffer's head (the lane's pick of this round): the rest move up, the tail empties.
template <int D>
__device__ __forceinline__ void buffer_pop(std::uint32_t (&bk)[D], int (&bb)[D]) {
#pragma unroll
  for (int d = 0; d + 1 < D; ++d) {
    bk[d] = bk[d + 1];
    bb[d] = bb[d + 1];
  }
  bk[D - 1] = 0u;
}

// Refills a lane's buffer (and `next`) with its D best candidates that rank after (k, e) in
// (key desc, expert asc) order, the lane's value j being expert value_base(j) + lane_offset.
// visit_keys(f) calls f(i, keys) with the keys of the lane's values 4i .. 4i+3 (stripe i) for
// every stripe, in stripe order.
template <class Shape, class VisitKeys>
__device__ __forceinline__ void buffer_refill_after(const VisitKeys& visit_keys,
                                                    std::uint32_t (&bk)[Shape::D], int (&bb)[Shape::D],
                                                    std::uint32_t& next, std::uint32_t k, int e,
                                                    int lane_offset) {
#pragma unroll
  for (int d = 0; d < Shape::D; ++d) bk[d] = 0u;
  next = 0u;
  visit_keys([&](int i, const std::uint32_t(&key)[4]) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int base = value_base<Shape>(4 * i + c);
      const bool after = key[c] < k || (key[c] == k && base + lane_offset > e);
      buffer_insert<Shape::D>(bk, bb, next, after ? key[c] : 0u, base);
    }
  });
}

// Max / min over the W lanes of a segment. A whole warp uses redux.sync; segments use xor
// butterflies: redux.sync writes a warp-uniform register, so with one membermask per segment
// the compiler serializes it segment by segment (WARPSYNC.COLLECTIVE), which costs more than
// log2(W) shuffles.
template <int W>
__device__ __forceinline__ std::uint32_t segment_max(std::uint32_t v) {
  if constexpr (W == 32) {
    return __reduce_max_sync(kFullMask, v);
  } else {
#pragma unroll
    for (int off = W / 2; off >= 1; off /= 2) v = max(v, __shfl_xor_sync(kFullMask, v, off));
    return v;
  }
}
template <int W>
__device__ __forceinline__ std::uint32_t segment_min(std::uint32_t v) {
  if constexpr (W == 32) {
    return __reduce_min_sync(kFullMask, v);
  } else {
#pragma unroll
    for (int off = W / 2; off >= 1; off /= 2) v = min(v, __shfl_xor_sync(kFullMask, v, off));
    return v;
  }
}

// Step 2 of route_warp, the general code (any values; no fast softmax): pre-scores p of a lane's V
// values in place, softmax over the row's segment of W lanes whose NA accumulators hold the partials
// (j / 4) % NA (softmax_row_sum). Returns the softmax constants ({0, 1, 1} for other pre functions).
// The per-value math has a fast path (exp_fast, div_fast, rcp_normal) and a general one; softmax picks
// it per row, sigmoid per lane, so that the general loops (one branch per value) only run where
// extreme or non-finite logits occur.
template <int W, int NA, int V>
__device__ __forceinline__ SoftmaxRow pre_scores(PreFn pre, float (&v)[V]) {
  SoftmaxRow sm{0.0f, 1.0f, 1.0f};
  if (pre == PreFn::kSoftmax) {
    float mx = neg_inf(), mn = __uint_as_float(0x7f800000u);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const bool f = finite_abs(v[j]);
      mx = f ? fmaxf(mx, v[j]) : mx;
      mn = f ? fminf(mn, v[j]) : mn;
    }
    sm.m = key_score(segment_max<W>(score_key(mx)));
    float acc[NA];
#pragma unroll
    for (int a = 0; a < NA; ++a) acc[a] = 0.0f;
    // v becomes exp(v - m) for finite v and keeps non-finite v as is (exp results are finite,
    // so finite_abs(v) still tells the two apart afterwards). exp(x) >= 2^-64 for x >= -44, which
    // keeps the division below on its fast path too. Rounding is monotone, so the smallest
    // RN(v - m) of the lane is RN(mn - m); a lane without finite values has mn = +inf (and
    // m <= mn whenever mn is finite), which passes.
    const bool fast = __fadd_rn(mn, -sm.m) >= -44.0f;
    if (fast) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const bool f = finite_abs(v[j]);
        const float e = exp_fast(__fadd_rn(v[j], -sm.m));
        v[j] = f ? e : v[j];
        acc[(j / 4) % NA] = __fadd_rn(acc[(j / 4) % NA], f ? e : 0.0f);
      }
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const bool f = finite_abs(v[j]);
        v[j] = f ? exp_any(__fadd_rn(v[j], -sm.m)) : v[j];
        acc[(j / 4) % NA] = __fadd_rn(acc[(j / 4) % NA], f ? v[j] : 0.0f);
      }
    }
    sm.sum = softmax_row_sum<W>(acc);
    sm.rcp = __frcp_rn(sm.sum);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float q = fast ? div_fast(v[j], sm.sum, sm.rcp) : div_by(v[j], sm.sum, sm.rcp);
      v[j] = finite_abs(v[j]) ? q : v[j];
    }
  } else if (pre == PreFn::kSigmoid) {
    bool fast = true;  // a NaN logit fails the test
#pragma unroll
    for (int j = 0; j < V; ++j) fast = fast && fabsf(v[j]) <= 86.5f;
    if (fast) {
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = sigmoid_fast(v[j]);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = sigmoid_pre(v[j]);
    }
  } else if (pre == PreFn::kSqrtSoftplus) {
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = pre_slow(PreFn::kSqrtSoftplus, v[j]);
  }
  return sm;
}

// The last step of both fast softmax forms: v[j] = p = e / sum (e >= 2^-64, sum in [1, 4096]:
// div_fast is exact) and its key. p >= 2^-76 > 0, so canonical_key(p) is p's bits with the sign
// bit set; absent experts get key 0 from the caller.
template <int V>
__device__ __forceinline__ void softmax_fast_divide(float (&v)[V], std::uint32_t (&key)[V],
                                                    const SoftmaxRow& sm) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    v[j] = div_fast(v[j], sm.sum, sm.rcp);
    key[j] = __float_as_uint(v[j]) | 0x80000000u;
  }
}

// The fast softmax pre-score of route_warp (kFull: E == Shape::kMaxExperts, every value present).
// Taken (returns true, warp-uniform) when every present value of every row of the warp is finite
// and max - min <= 44; then v[j] = p and key[j] = its key (absent experts: p = 0, key fixed by
// the caller). Otherwise returns false with v untouched. Absent experts were loaded as -inf (a
// dummy row past T as zeros). The test: fmx = max of the present values ignoring NaN, fmn = their
// minimum propagating NaN (min.NaN), fm = the row's max of fmx; RN(fmn - fm) >= -44 fails for a
// NaN (fmn is NaN), a -inf (fmn = -inf) and a +inf (fm = +inf: -inf or NaN in every lane of the
// row), and for finite rows it is the range test. (exp(x) >= 2^-64 for x >= -44 keeps the
// division on its fast path; sum is in [1, E], so rcp_normal gives RN(1 / sum).)
template <class Shape, bool kFull>
__device__ __forceinline__ bool softmax_fast(float (&v)[Shape::kValues], std::uint32_t (&key)[Shape::kValues],
                                             int E, int lane4, SoftmaxRow& sm) {
  constexpr int V = Shape::kValues, NA = Shape::kAccs;
  bool pr[V];
  float fmx = neg_inf(), fmn = __uint_as_float(0x7f800000u);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    pr[j] = kFull || value_base<Shape>(j) + lane4 < E;
    fmx = fmaxf(fmx, v[j]);  // absent experts are -inf (or 0 in a dummy row): no effect
    fmn = pr[j] ? min_nan(fmn, v[j]) : fmn;
  }
  const float fm = key_score(segment_max<Shape::W>(score_key(fmx)));
  if (!__all_sync(kFullMask, __fadd_rn(fmn, -fm) >= -44.0f)) return false;
  sm.m = fm;
  float acc[NA];
#pragma unroll
  for (int a = 0; a < NA; ++a) acc[a] = 0.0f;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float e = exp_fast(__fadd_rn(v[j], -sm.m));  // garbage for an absent -inf, not used
    v[j] = pr[j] ? e : 0.0f;
    acc[(j / 4) % NA] = __fadd_rn(acc[(j / 4) % NA], v[j]);
  }
  sm.sum = softmax_row_sum<Shape::W>(acc);
  sm.rcp = rcp_normal(sm.sum);
  softmax_fast_divide<V>(v, key, sm);
  return true;
}

// softmax_fast with the previous test (per-lane finiteness from max.NaN of |v|) and one branch
// per present value; same results (both compute the same fm, sum and p when every present value
// of the warp is finite with max - min <= 44, and both fail otherwise).
template <class Shape>
__device__ __forceinline__ bool softmax_fast_branchy(float (&v)[Shape::kValues],
                                                     std::uint32_t (&key)[Shape::kValues], int E, int lane4,
                                                     SoftmaxRow& sm) {
  constexpr int W = Shape::W, S = Shape::S, V = Shape::kValues, NA = Shape::kAccs;
  float fmx = neg_inf(), fmn = __uint_as_float(0x7f800000u), amax = 0.0f;
#pragma unroll
  for (int i = 0; i < S; ++i) {
    const bool partial = 4 * W * (i + 1) > E;  // uniform
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int j = 4 * i + c;
      const bool present = !partial || 4 * W * i + lane4 + c < E;
      fmx = present ? fmaxf(fmx, v[j]) : fmx;
      fmn = present ? fminf(fmn, v[j]) : fmn;
      amax = present ? max_nan(amax, fabsf(v[j])) : amax;
    }
  }
  const bool lane_finite = amax < __uint_as_float(0x7f800000u);  // false for inf and NaN
  const float fm = key_score(segment_max<W>(score_key(lane_finite ? fmx : 0.0f)));
  if (!__all_sync(kFullMask, !lane_finite ? false : __fadd_rn(fmn, -fm) >= -44.0f)) return false;
  sm.m = fm;
  float acc[NA];
#pragma unroll
  for (int a = 0; a < NA; ++a) acc[a] = 0.0f;
#pragma unroll
  for (int i = 0; i < S; ++i) {
    const bool partial = 4 * W * (i + 1) > E;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int j = 4 * i + c;
      const bool present = !partial || 4 * W * i + lane4 + c < E;
      const float e = present ? exp_fast(__fadd_rn(v[j], -sm.m)) : 0.0f;
      v[j] = e;
      acc[(j / 4) % NA] = __fadd_rn(acc[(j / 4) % NA], e);
    }
  }
  sm.sum = softmax_row_sum<W>(acc);
  sm.rcp = __frcp_rn(sm.sum);
  softmax_fast_divide<V>(v, key, sm);
  return true;
}

// Picks the best p.topk_group groups of a row: rounds of (max score key, min group index)
// over the segment. Lane l of the segment owns groups g = l, l + W, ...; on return
// `selected[g]` is 1 for the kept groups (each lane wrote its own groups' flags).
template <class Shape>
__device__ __forceinline__ void select_groups(const RouteParams& p, const std::uint32_t* score,
                                              unsigned char* selected, int sl) {
  for (int g = sl; g < p.n_group; g += Shape::W) selected[g] = 0;
  for (int r = 0; r < p.topk_group; ++r) {
    std::uint32_t best = 0;
    int best_g = 0x7fffffff;
    for (int g = sl; g < p.n_group; g += Shape::W) {
      const std::uint32_t k = selected[g] ? 0u : score[g];
      if (k > best) {
        best = k;
        best_g = g;
      }
    }
    const std::uint32_t mk = segment_max<Shape::W>(best);
    const unsigned wg = segment_min<Shape::W>(best == mk ? static_cast<unsigned>(best_g) : 0xffffffffu);
    if (static_cast<int>(wg % Shape::W) == sl && wg < static_cast<unsigned>(p.n_group)) selected[wg] = 1;
  }
}

// Group limit, chunk path (G % 4 == 0, at most 2 scores per group): zeroes the keys of experts
// outside the kept groups. Scores: the group's largest q (+ its second largest), summed in
// rank order like the oracle (a + b == b + a, so only the two values matter).
template <class Shape>
__device__ __forceinline__ void group_limit_chunks(const RouteParams& p, std::uint32_t (&key)[Shape::kValues],
                                                   unsigned char* srow, int sl) {
  constexpr int W = Shape::W, S = Shape::S;
  uint2* chunk_top = reinterpret_cast<uint2*>(srow);
  std::uint32_t* score = reinterpret_cast<std::uint32_t*>(srow + 8 * W * S);
  unsigned char* selected = reinterpret_cast<unsigned char*>(score + p.n_group);
  const int chunks = p.num_experts / 4;
  const int per_group = p.group_size / 4;
#pragma unroll
  for (int i = 0; i < S; ++i) {
    const int ch = W * i + sl;
    const std::uint32_t a = key[4 * i], b = key[4 * i + 1], c = key[4 * i + 2], d = key[4 * i + 3];
    const std::uint32_t hi1 = max(a, b), lo1 = min(a, b), hi2 = max(c, d), lo2 = min(c, d);
    if (ch < chunks) chunk_top[ch] = make_uint2(max(hi1, hi2), max(min(hi1, hi2), max(lo1, lo2)));
  }
  __syncwarp();
  for (int g = sl; g < p.n_group; g += W) {
    std::uint32_t t1 = 0, t2 = 0;
    for (int ch = g * per_group; ch < (g + 1) * per_group; ++ch) {
      const uint2 x = chunk_top[ch];
      const std::uint32_t n1 = max(t1, x.x);
      t2 = max(min(t1, x.x), max(t2, x.y));
      t1 = n1;
    }
    const float s = p.group_take == 1 ? key_score(t1) : __fadd_rn(key_score(t1), key_score(t2));
    score[g] = canonical_key(s);
  }
  __syncwarp();
  select_groups<Shape>(p, score, selected, sl);
  __syncwarp();
#pragma unroll
  for (int i = 0; i < S; ++i) {
    const int ch = W * i + sl;
    const bool keep = ch < chunks && selected[fast_div(static_cast<unsigned>(ch), p.group_magic)];
#pragma unroll
    for (int c = 0; c < 4; ++c) key[4 * i + c] = keep ? key[4 * i + c] : 0u;
  }
  __syncwarp();
}

// Group limit, lane path (W == 32 and p.group_lanes): chunk ch = 32 * i + lane of stripe i
// belongs to group ch >> group_shift, so a group's chunks are 2^group_shift consecutive lanes of
// one stripe. Its top-2 keys come from xor butterflies inside those lanes (the top 2 of a union
// are the top 2 of the two halves' top 2s), and the kept groups end up in a warp-uniform bit
// mask (n_group <= 32). Same scores, same order (key desc, group asc) as group_limit_chunks;
// no shared memory. kShift > 0: group_shift known at compile time (a Spec's; p.group_shift ==
// kShift), which unrolls the butterflies and, where a stripe's groups are few enough
// (kPairRanks), ranks the groups by pairs (below); 0: p.group_shift at run time.
template <class Shape, int kShift>
inline constexpr bool kPairRanks = kShift > 0 && (32 >> kShift) * Shape::S <= (1 << kShift);

template <class Shape, int kShift = 0>
__device__ __forceinline__ void group_limit_lanes(const RouteParams& p, std::uint32_t (&key)[Shape::kValues],
                                                  int sl) {
  constexpr int S = Shape::S;
  static_assert(Shape::W == 32, "lane path needs whole-warp rows");
  const int shift = kShift > 0 ? kShift : p.group_shift;
  const int lanes = 1 << shift;
  const int chunks = p.num_experts / 4;
  std::uint32_t score[S];  // group score key; 0 for chunks past E (no group)
  int grp[S];
#pragma unroll
  for (int i = 0; i < S; ++i) {
    const std::uint32_t a = key[4 * i], b = key[4 * i + 1], c = key[4 * i + 2], d = key[4 * i + 3];
    const std::uint32_t hi1 = max(a, b), lo1 = min(a, b), hi2 = max(c, d), lo2 = min(c, d);
    std::uint32_t t1 = max(hi1, hi2);
    std::uint32_t t2 = max(min(hi1, hi2), max(lo1, lo2));
    for (int off = 1; off < lanes; off <<= 1) {  // uniform trip count (a constant where kShift is)
      const std::uint32_t u1 = __shfl_xor_sync(kFullMask, t1, off);
      const std::uint32_t u2 = __shfl_xor_sync(kFullMask, t2, off);
      t2 = max(min(t1, u1), max(t2, u2));
      t1 = max(t1, u1);
    }
    const int ch = 32 * i + sl;
    grp[i] = ch >> shift;
    const float sc = p.group_take == 1 ? key_score(t1) : __fadd_rn(key_score(t1), key_score(t2));
    score[i] = ch < chunks ? canonical_key(sc) : 0u;  // canonical keys are never 0
  }
  // The kept groups by rank (the number of groups ranking before a group: score desc, group asc)
  // instead of topk_group rounds of two warp reductions (a dependent chain of ~90 cycles per round
  // at T = 1); one ballot of "rank < topk_group" over the lanes g < n_group is the mask
  // (docs/decisions/routing-group-limit.md).
  int better = 0;
  if constexpr (kPairRanks<Shape, kShift>) {
    // By pairs: lane l ranks group s = l % 2^shift (meaningful for s < n_group) against the S groups
    // whose scores it holds, i * (32 >> shift) + (l >> shift); the lanes of one s hold every group
    // between them (2^shift >= S * (32 >> shift) groups: DeepSeek-V3's 8 groups of 32 at E = 256),
    // and xor shuffles add up their counts: S + 5 - shift shuffles instead of ~n_group + S.
    constexpr int kPerStripe = 32 >> kShift;
    const int s = sl & ((1 << kShift) - 1);
    const int src = (s % kPerStripe) << kShift;  // a lane of group s's chunks, stripe s / kPerStripe
    std::uint32_t mine = 0;
#pragma unroll
    for (int i = 0; i < S; ++i) {
      const std::uint32_t v = __shfl_sync(kFullMask, score[i], src);
      if (i == s / kPerStripe) mine = v;
    }
#pragma unroll
    for (int i = 0; i < S; ++i) {
      const int g = i * kPerStripe + (sl >> kShift);
      better += (score[i] > mine || (score[i] == mine && g < s)) ? 1 : 0;
    }
#pragma unroll
    for (int off = 1 << kShift; off < 32; off <<= 1) better += __shfl_xor_sync(kFullMask, better, off);
  } else {
    // By broadcasts: lane g < n_group fetches group g's score (from the first lane of its chunks,
    // stripe (g << shift) >> 5) and counts the groups ranking before it from n_group broadcasts
    // that do not depend on each other.
    std::uint32_t my_score = 0;
    {
      const int ch = sl << shift;  // group sl's first chunk (meaningful for sl < n_group)
#pragma unroll
      for (int i = 0; i < S; ++i) {
        const std::uint32_t v = __shfl_sync(kFullMask, score[i], ch & 31);
        if (i == (ch >> 5)) my_score = v;
      }
    }
    for (int g0 = 0; g0 < p.n_group; g0 += 8) {  // uniform; n_group <= 32
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int g = g0 + u;
        const std::uint32_t v = __shfl_sync(kFullMask, my_score, g & 31);
        better += (g < p.n_group && (v > my_score || (v == my_score && g < sl))) ? 1 : 0;
      }
    }
  }
  const std::uint32_t kept = __ballot_sync(kFullMask, sl < p.n_group && better < p.topk_group);
#pragma unroll
  for (int i = 0; i < S; ++i) {
    const bool keep = score[i] != 0u && ((kept >> (grp[i] & 31)) & 1u);
#pragma unroll
    for (int c = 0; c < 4; ++c) key[4 * i + c] = keep ? key[4 * i + c] : 0u;
  }
}

// Group limit, generic path: any G, any number of summed scores.
template <class Shape>
__device__ __forceinline__ void group_limit_generic(const RouteParams& p,
                                                    std::uint32_t (&key)[Shape::kValues], unsigned char* srow,
                                                    int sl) {
  constexpr int W = Shape::W, S = Shape::S;
  std::uint32_t* keys = reinterpret_cast<std::uint32_t*>(srow);
  std::uint32_t* score = keys + Shape::kMaxExperts;
  unsigned char* selected = reinterpret_cast<unsigned char*>(score + p.n_group);
  const int E = p.num_experts;
  const int G = p.group_size;
#pragma unroll
  for (int i = 0; i < S; ++i) {
    const int e0 = 4 * W * i + 4 * sl;
    *reinterpret_cast<uint4*>(keys + e0) =
        make_uint4(key[4 * i], key[4 * i + 1], key[4 * i + 2], key[4 * i + 3]);
  }
  __syncwarp();
  for (int g = sl; g < p.n_group; g += W) {
    // The group's group_take best (key desc, expert asc), summed in that order.
    std::uint32_t prev_k = 0xffffffffu;
    int prev_e = -1;
    float sum = 0.0f;
    for (int r = 0; r < p.group_take; ++r) {
      std::uint32_t best = 0;
      int best_e = -1;
      for (int e = g * G; e < (g + 1) * G; ++e) {
        const std::uint32_t x = keys[e];
        const bool after = x < prev_k || (x == prev_k && e > prev_e);
        if (after && x > best) {
          best = x;
          best_e = e;
        }
      }
      sum = r == 0 ? key_score(best) : __fadd_rn(sum, key_score(best));
      prev_k = best;
      prev_e = best_e;
    }
    score[g] = canonical_key(sum);
  }
  __syncwarp();
  select_groups<Shape>(p, score, selected, sl);
  __syncwarp();
#pragma unroll
  for (int j = 0; j < Shape::kValues; ++j) {
    const int e = value_base<Shape>(j) + 4 * sl;
    const bool keep = e < E && selected[fast_div(static_cast<unsigned>(e), p.group_magic)];
    key[j] = keep ? key[j] : 0u;
  }
  __syncwarp();
}

// Packed keys (select_top_k_packed) index the experts of whole-warp rows of up to 2048 experts, and of
// narrow segments (kNarrowPacked), in their low 7-11 bits.
template <class Shape>
inline constexpr bool kPackedKeys = (Shape::W == 32 && Shape::S <= 16) || kNarrowPacked<Shape>;
// Bits of an expert index below Shape::kMaxExperts.
template <class Shape>
inline constexpr int kIndexBits = Shape::kMaxExperts <= 128    ? 7
                                  : Shape::kMaxExperts <= 256  ? 8
                                  : Shape::kMaxExperts <= 512  ? 9
                                  : Shape::kMaxExperts <= 1024 ? 10
                                                               : 11;
template <class Shape>
inline constexpr std::uint32_t kIndexMask = ~(~0u << kIndexBits<Shape>);
// The low bits of a packed key of value j of a lane (its expert value_base(j) + lane4): the inverted
// expert index kIndexMask - expert, from lane_inv = kIndexMask - lane4.
template <class Shape>
__device__ __forceinline__ std::uint32_t packed_index(std::uint32_t lane_inv, int j) {
  return lane_inv - static_cast<std::uint32_t>(value_base<Shape>(j));
}
// The packed key of value j of a lane with selection key `key`.
template <class Shape>
__device__ __forceinline__ std::uint32_t packed_key(std::uint32_t key, std::uint32_t lane_inv, int j) {
  return (key & ~kIndexMask<Shape>) | packed_index<Shape>(lane_inv, j);
}

// Removes a packed buffer's head (the lane's pick of a round): the rest move up, the tail empties.
template <int D>
__device__ __forceinline__ void packed_pop(std::uint32_t (&bp)[D]) {
#pragma unroll
  for (int d = 0; d + 1 < D; ++d) bp[d] = bp[d + 1];
  bp[D - 1] = 0u;
}

// The packed top-K rounds of a row (select_top_k_packed): K <= W rounds of one segment max over the
// lanes' packed heads bp[0] (a redux.sync for a whole warp, a shuffle butterfly in a narrow
// segment); the winner (a row's packed keys are distinct) pops its head. Returns the packed key of
// pick sl (0 in lanes sl >= K).
template <int W, int D>
__device__ __forceinline__ std::uint32_t packed_rounds(int K, int sl, std::uint32_t (&bp)[D]) {
  std::uint32_t my_pm = 0u;
#pragma unroll
  for (int r = 0; r < W; ++r) {
    if (r >= K) break;  // uniform
    const std::uint32_t pm = segment_max<W>(bp[0]);
    if (sl == r) my_pm = pm;
    if (bp[0] == pm) packed_pop<D>(bp);
  }
  return my_pm;
}

// select_top_k_packed's stripe argument where the caller has no full keys of the row at hand (no packed
// retry, no bucket rounds).
struct NoKeyStripes {
  __device__ void operator()(int, std::uint32_t (&)[4]) const {}
};
// f(j, key) for each value j = 4 i + c of a lane's S stripes, stripe(i, keys) loading stripe i's four
// full keys (the packed retry's rebuild and the bucket rounds' scan).
template <int S, class Stripe, class F>
__device__ __forceinline__ void for_each_stripe_key(const Stripe& stripe, F&& f) {
#pragma unroll
  for (int i = 0; i < S; ++i) {
    std::uint32_t k4[4];
    stripe(i, k4);
#pragma unroll
    for (int c = 0; c < 4; ++c) f(4 * i + c, k4[c]);
  }
}
// Packed retries of a row whose dry lane hides a bucket at or above the last pick's (select_top_k_packed),
// for whole-warp rows of 2 or 4 stripes; 3 stripes (kimi-k2) take one attempt, and only on buffers of 2
// (a second attempt spilled the 32-register kernel); 1 stripe was slower with them
// (docs/decisions/routing-packed-keys.md).
template <class Shape>
inline constexpr bool kPackedRetry = Shape::W == 32 &&
                                     (Shape::S == 2 || Shape::S == 4 || (Shape::S == 3 && Shape::D == 2));
template <class Shape>
inline constexpr int kPackedRetries = Shape::S == 3 ? 1 : 2;
// Bucket rounds of a row whose only doubt is a collision in the last pick's bucket (select_top_k_packed):
// whole-warp rows of 2 or more stripes with their full keys at hand; 1 stripe was slower with them
// (docs/decisions/routing-packed-keys.md).
template <class Shape>
inline constexpr bool kBucketRounds = Shape::W == 32 && Shape::S >= 2;

// Rounds r0 .. K - 1 of packed_rounds on rebuilt buffers (the retry; a runtime loop: it is rare).
template <int W, int D>
__device__ __forceinline__ std::uint32_t packed_rounds_from(int K, int r0, int sl, std::uint32_t (&bp)[D],
                                                            std::uint32_t my_pm) {
#pragma unroll 1
  for (int r = r0; r < K; ++r) {
    const std::uint32_t pm = segment_max<W>(bp[0]);
    if (sl == r) my_pm = pm;
    if (bp[0] == pm) packed_pop<D>(bp);
  }
  return my_pm;
}

// The plain fast pass of select_top_k: rounds of two segment reductions (max key, then min expert
// among equal keys), at most kRounds of them.
template <class Shape, int kRounds>
__device__ __forceinline__ std::uint32_t plain_fast_pass(int K, int sl, int lane4,
                                                         std::uint32_t (&bk)[Shape::D], int (&bb)[Shape::D],
                                                         std::uint32_t (&pick_key)[Shape::kSlots],
                                                         int (&pick_e)[Shape::kSlots]) {
  constexpr int W = Shape::W, D = Shape::D;
  std::uint32_t last_mk = 0u;
#pragma unroll
  for (int r = 0; r < kRounds; ++r) {
    if (r >= K) break;  // uniform
    const std::uint32_t head = bk[0];
    const std::uint32_t mk = segment_max<W>(head);
    const unsigned my_e = static_cast<unsigned>(bb[0] + lane4);
    const unsigned we = segment_min<W>(head == mk ? my_e : 0xffffffffu);
    // A lane's experts are its own, so at most one lane of the segment has my_e == we (a dry
    // lane's stale bb[0] is an expert it already gave away).
    const bool won = head == mk && my_e == we;
    if (sl == r % W) {  // pick r lives in lane r % W, slot r / W (compile-time)
      pick_key[r / W] = mk;
      pick_e[r / W] = static_cast<int>(we);
    }
    if (won) buffer_pop<D>(bk, bb);
    last_mk = mk;
  }
  return last_mk;  // the key of pick K - 1
}

// The exact rounds of select_top_k (see there), run when its fast pass could not vouch for its
// picks: from the first pick whose key is <= hm (the largest key a dry lane hides, or the bound of
// select_top_k_packed's doubt), with the buffers refilled by refill(bk, bb, next, k, e, lane_offset)
// from the candidates ranking after the last pick kept.
template <class Shape, class Refill>
__device__ __forceinline__ void exact_rounds(int K, int sl, int lane4, std::uint32_t (&bk)[Shape::D],
                                             int (&bb)[Shape::D], std::uint32_t& next,
                                             std::uint32_t (&pick_key)[Shape::kSlots],
                                             int (&pick_e)[Shape::kSlots], std::uint32_t hm,
                                             const Refill& refill) {
  constexpr int W = Shape::W, D = Shape::D, SL = Shape::kSlots;
  // First round whose key is <= hm, over the whole warp (K for rows that passed).
  int first = K;
#pragma unroll
  for (int s = 0; s < SL; ++s) {
    const int k = s * W + sl;
    if (k < K && pick_key[s] <= hm) first = min(first, k);
  }
  const int r0 = static_cast<int>(__reduce_min_sync(kFullMask, static_cast<unsigned>(first)));
  // Picks 0 .. r0 - 1 are the row's true top r0, i.e. every candidate that ranks at or above
  // pick r0 - 1 (pk, pe). So each lane's remaining candidates are those ranking after it (all
  // of them when r0 == 0): refill the buffers with the D best of those.
  std::uint32_t pk = 0xffffffffu;  // above every key: "after" holds for every value
  int pe = -1;
  if (r0 > 0) {  // uniform
    const int src = (r0 - 1) % W, slot = (r0 - 1) / W;
#pragma unroll
    for (int s = 0; s < SL; ++s) {  // s compile-time: the pick arrays stay in registers
      const std::uint32_t ks = __shfl_sync(kFullMask, pick_key[s], src, W);
      const int es = __shfl_sync(kFullMask, pick_e[s], src, W);
      if (s == slot) {
        pk = ks;
        pe = es;
      }
    }
  }
  refill(bk, bb, next, pk, pe, lane4);
  std::uint32_t gk = 0u;
  int gb = 0;
  // Exact rounds: a lane whose buffer runs dry shows `next` (the largest key it has left, see
  // buffer_insert) as its head and claims the lowest expert index for it: a "ghost" that
  // wins a round only when the lane may really hold the round's pick. Then the lane rescans
  // its values for the next D candidates after its last pop (gk, gb) and the round is redone.
  int ghost = 0;  // a full register: a bool here was packed into a byte (PRMT) every round
  for (int r = r0; r < K;) {
    const std::uint32_t head = bk[0];
    const std::uint32_t mk = segment_max<W>(head);
    const unsigned my_e = ghost != 0 ? 0u : static_cast<unsigned>(bb[0] + lane4);
    const unsigned we = segment_min<W>(head == mk ? my_e : 0xffffffffu);
    const bool won = head == mk && my_e == we;
    const bool rescan = won && ghost != 0;
    if (__any_sync(kFullMask, rescan)) {
      if (rescan) {
        // Next D candidates after the last pop (gk, gb; gb lane-relative).
        refill(bk, bb, next, gk, gb, 0);
        ghost = 0;
      }
      continue;  // redo the round (segments without a rescan get the same answer)
    }
#pragma unroll
    for (int s = 0; s < SL; ++s) {
      if (r == s * W + sl) {
        pick_key[s] = mk;
        pick_e[s] = static_cast<int>(we);
      }
    }
    if (won) {
      if (D == 1 || bk[D > 1 ? 1 : 0] == 0u) {
        ghost = 1;
        gk = bk[0];
        gb = bb[0];
        bk[0] = next;
      } else {
        buffer_pop<D>(bk, bb);
      }
    }
    ++r;
  }
}

// Step 5 of route_warp (see the file comment): the top-K of a row from the lanes' candidate
// buffers (bk, bb, next: a lane's D best candidates, sorted, and the largest key it holds outside
// them; see buffer_insert) into pick_key / pick_e (pick k in lane k % W of the segment, slot
// k / W). Fast pass: K rounds in which a lane whose buffer ran dry shows key 0. Exact unless a dry
// lane holds a key outside its buffer (`next`) that could rank at or above the last pick; then
// the exact rounds (ghosts and rescans) redo the rounds from the first pick that is not certainly
// right. refill(bk, bb, next, k, e, lane_offset) refills a lane's buffer with its D best
// candidates ranking after (k, e), as buffer_refill_after does; only the exact rounds call it.
template <class Shape, class Refill>
__device__ __forceinline__ void select_top_k(int K, int sl, int lane4, std::uint32_t (&bk)[Shape::D],
                                             int (&bb)[Shape::D], std::uint32_t& next,
                                             std::uint32_t (&pick_key)[Shape::kSlots],
                                             int (&pick_e)[Shape::kSlots], const Refill& refill) {
  constexpr int W = Shape::W, D = Shape::D, V = Shape::kValues, SL = Shape::kSlots;
#pragma unroll
  for (int s = 0; s < SL; ++s) {
    pick_key[s] = 0u;
    pick_e[s] = 0;
  }
  // Check. Picks come in rank order and their keys do not increase. A dry lane (bk[0] == 0)
  // still holds keys <= next outside its buffer; a lane that is not dry shows its true best
  // remaining candidate (everything outside its buffer ranks after it). If every dry lane has
  // next < last_mk (the key of pick K - 1), no candidate hidden in a dry lane ranks above pick
  // K - 1, so every round took the true best remaining candidate: the picks are the oracle's.
  // Otherwise (hm >= last_mk, equality included since `next` carries no expert index) the picks
  // with key > hm are still exact (they rank above every hidden candidate), and the exact rounds
  // resume after them. With D >= V a lane's buffer holds all its candidates (nothing is ever
  // hidden; every row has at least K candidates of key > 0, so last_mk > 0): the fast pass is
  // exact and the check goes.
  const std::uint32_t last_mk =
      plain_fast_pass<Shape, SL * W>(K, sl, lane4, bk, bb, pick_key, pick_e);  // SL * W >= K
  if constexpr (D < V) {
    const std::uint32_t hm = segment_max<W>(bk[0] == 0u ? next : 0u);  // the largest hidden key
    if (__any_sync(kFullMask, hm >= last_mk))                          // uniform
      exact_rounds<Shape>(K, sl, lane4, bk, bb, next, pick_key, pick_e, hm, refill);
  }
}

// Packed candidate buffers (route_warp with kPackedTopK: whole-warp rows up to E = 1024; routing.cu
// uses them for K >= kPackedMinK; route_warp_wide's up to E = 2048). A lane keeps packed keys only: a value's
// key with its low kIndexBits bits (the bucket is what is left) replaced by the inverted expert index, so one
// unsigned compare orders (bucket desc, expert asc), and the buffer insert is five min / max
// instructions (eight per two values, packed_insert2) instead of compares and selects on a key
// and an expert (the ALU pipe bounded these kernels at large T: ncu, 60-77% of its peak). The
// key 0 of a non-candidate packs to bucket 0, below every real key (>= score_key(-inf)), so a lane
// whose head has bucket 0 is dry. (kPackedBuffers<Shape>, the shapes that have them, is defined
// with the shared memory sizes.)

template <int D>
__device__ __forceinline__ void packed_insert(std::uint32_t (&bp)[D], std::uint32_t& next, std::uint32_t x) {
  next = max(next, min(x, bp[D - 1]));
#pragma unroll
  for (int d = D - 1; d >= 1; --d) bp[d] = max(bp[d], min(x, bp[d - 1]));
  bp[0] = max(bp[0], x);
}
// Two values at once into a buffer of depth 2: the top two of {bp[0] >= bp[1], hi >= lo} and the
// third (the largest left out) in eight min / max instructions instead of ten (three-input max).
__device__ __forceinline__ void packed_insert2(std::uint32_t (&bp)[2], std::uint32_t& next, std::uint32_t x,
                                               std::uint32_t y) {
  const std::uint32_t hi = max(x, y), lo = min(x, y);
  const std::uint32_t third = max(min(bp[1], hi), min(bp[0], lo));
  const std::uint32_t second = max(max(min(bp[0], hi), bp[1]), lo);
  bp[0] = max(bp[0], hi);
  bp[1] = second;
  next = max(next, third);
}

// The key of a real packed key whose bucket holds a single key: keys of bf16 / fp16 values have
// their low 13 or more bits all 0 (scores >= +0) or all 1 (below), and kIndexBits <= 11.
template <class Shape>
__device__ __forceinline__ std::uint32_t bucket_key(std::uint32_t x) {
  const std::uint32_t b = x & ~kIndexMask<Shape>;
  return (b & 0x80000000u) != 0u ? b : (b | kIndexMask<Shape>);
}

// Sorts the picks of lanes 0..K-1 (key, e; distinct experts) by key desc, expert asc: a bitonic
// sort over the first w lanes, w the smallest power of two >= K (lanes K..w-1 enter as the lowest
// pair). Lanes >= K leave with key 0, e 0.
__device__ __forceinline__ void sort_picks(int K, int sl, std::uint32_t& key, int& e) {
  int w = 2;
  while (w < K) w <<= 1;
  if (sl >= K) {
    key = 0u;
    e = 0x7fffffff;
  }
  for (int k = 2; k <= w; k <<= 1) {
    const bool desc = (sl & k) == 0;  // this lane's run of k is sorted best first (all, at k = w)
    for (int j = k >> 1; j > 0; j >>= 1) {
      const std::uint32_t ok = __shfl_xor_sync(kFullMask, key, j);
      const int oe = __shfl_xor_sync(kFullMask, e, j);
      const bool other_better = ok > key || (ok == key && oe < e);
      const bool other_worse = ok < key || (ok == key && oe > e);
      // The lower lane of the pair keeps the better one in a descending run, the worse otherwise.
      if (((sl & j) == 0) == desc ? other_better : other_worse) {
        key = ok;
        e = oe;
      }
    }
  }
  if (sl >= K) {
    key = 0u;
    e = 0;
  }
}

// Step 5 of route_warp on packed buffers (bp, next: see packed_insert): K packed rounds
// (packed_rounds, one redux.sync each), then a check.
// - Every candidate in a bucket above the last pick's is a pick or hidden outside a dry lane's
//   buffer (a lane's head ranks after the last pick, its buffer and hidden keys after its head).
// - So the picks are exact unless: a dry lane hides a bucket at or above the last pick's (then the
//   exact rounds run from the first pick whose key could be at or below a hidden one); two
//   neighbouring picks share a bucket with different keys (the exact rounds in the last pick's
//   bucket; above it sort_picks, as such a bucket is all picks); or a lane's head is in the last
//   pick's bucket and might hide a key there that outranks the last pick (its head's key differs
//   from the last pick's, or its next candidate, buffered or hidden, is in that bucket too). The
//   exact rounds then redo only the last pick's bucket (and anything at or below a hidden bucket),
//   after sort_picks, instead of restarting them from the first pick
//   (docs/decisions/routing-packed-keys.md).
//   (tools/packed_topk_model.py fuzzes this, and checks the picks the exact rounds keep.)
// - bucket_exact: every bucket holds one key (bf16 / fp16 logits without pre function or bias): only
//   the dry-lane test remains and a pick's key comes from its bucket.
// full_key(e): the key of expert e of the row; refill as for select_top_k (full keys); stripe(i, keys):
// the full keys of the lane's stripe i (experts value_base(4 i + c) + lane4), for the packed retry and
// the bucket rounds (NoKeyStripes: neither).
template <class Shape, class FullKey, class Refill, class Stripe = NoKeyStripes>
__device__ __forceinline__ void select_top_k_packed(int K, int sl, int lane4, std::uint32_t (&bp)[Shape::D],
                                                    std::uint32_t pnext, bool bucket_exact,
                                                    const FullKey& full_key,
                                                    std::uint32_t (&pick_key)[Shape::kSlots],
                                                    int (&pick_e)[Shape::kSlots], bool keys_needed,
                                                    const Refill& refill, const Stripe& stripe = {}) {
  constexpr int W = Shape::W, D = Shape::D, S = Shape::S, SL = Shape::kSlots;
  constexpr std::uint32_t kIdx = kIndexMask<Shape>;
  constexpr bool kStripes = !std::is_same_v<Stripe, NoKeyStripes>;
  static_assert(kPackedKeys<Shape>, "whole-warp rows up to E = 2048, or narrow segments");
  const std::uint32_t lane_inv = kIdx - static_cast<std::uint32_t>(lane4);
  // K <= W (the launcher's narrow_packed_fits for narrow segments; always true with W = 32): pick k
  // lives in lane k of the segment, slot 0.
  std::uint32_t my_pm = packed_rounds<W, D>(K, sl, bp);  // packed key of pick sl
  // The last pick's bucket and the largest bucket a dry lane hides (its keys are <= hm_bucket | kIdx),
  // after the packed rounds and after each retry.
  std::uint32_t last_bucket, hm_bucket;
  bool dry;
  const auto read_buckets = [&] {
    last_bucket = __shfl_sync(kFullMask, my_pm, K - 1, W) & ~kIdx;
    dry = bp[0] <= kIdx;
    hm_bucket = segment_max<W>(dry ? pnext : 0u) & ~kIdx;
  };
  read_buckets();
  if constexpr (kPackedRetry<Shape> && kStripes) {
    // Packed retry (tools/packed_topk_model.py models it): while a dry lane hides a bucket at or
    // above the last pick's, the picks above every hidden bucket (the first r0) are all the candidates
    // with packed keys >= pick r0 - 1's; every lane refills its buffers from its candidates below
    // thr = that key, and rounds r0 .. K - 1 are redone. Rows still in doubt (no progress, or after
    // kPackedRetries) take the exact rounds below.
    int prev_r0 = 0;
#pragma unroll 1
    for (int attempt = 0; attempt < kPackedRetries<Shape>; ++attempt) {
      if (hm_bucket < last_bucket) break;  // uniform
      const int r0 = static_cast<int>(__reduce_min_sync(
          kFullMask, sl < K && (my_pm & ~kIdx) <= hm_bucket ? static_cast<unsigned>(sl) : 32u));
      if (r0 <= prev_r0) break;  // uniform
      const std::uint32_t thr = __shfl_sync(kFullMask, my_pm, r0 - 1, W);
#pragma unroll
      for (int d = 0; d < D; ++d) bp[d] = 0u;
      pnext = 0u;
      for_each_stripe_key<S>(stripe, [&](int j, std::uint32_t key) {
        const std::uint32_t x = packed_key<Shape>(key, lane_inv, j);
        packed_insert<D>(bp, pnext, x < thr ? x : 0u);
      });
      my_pm = packed_rounds_from<W, D>(K, r0, sl, bp, my_pm);
      read_buckets();
      prev_r0 = r0;
    }
  }
  const bool has = sl < K;
  const bool real = has && my_pm > kIdx;  // not a round in which every lane was dry
  const int e = static_cast<int>(kIdx - (my_pm & kIdx));
#pragma unroll
  for (int s = 1; s < SL; ++s) {
    pick_key[s] = 0u;
    pick_e[s] = 0;
  }
  pick_e[0] = has ? e : 0;
  // Without the key fetch below a pick keeps its bucket: finish_row then only asks whether it is
  // finite (it takes p from the logit when there is a bias), and the bucket of a finite key is
  // finite too (the keys of +-inf are whole buckets).
  pick_key[0] = real ? my_pm & ~kIdx : 0u;
  // Also when the last round found every lane dry. Warp-uniform (the exact rounds shuffle over the
  // whole warp): with narrow segments, one row's doubt sends every row of the warp there, which is
  // exact for the others too (they redo rounds they had right).
  bool exact = hm_bucket >= last_bucket;
  if constexpr (W < 32) exact = __any_sync(kFullMask, exact);
  bool collided = false;
  bool unordered = false;  // picks of one bucket above the last pick's out of key order
  if (bucket_exact) {
    pick_key[0] = real ? bucket_key<Shape>(my_pm) : 0u;
  } else {
    const std::uint32_t pn = __shfl_down_sync(kFullMask, my_pm, 1, W);
    const bool pair_shared = sl + 1 < K && ((my_pm ^ pn) & ~kIdx) == 0u;
    const bool head_in_last = !dry && (bp[0] & ~kIdx) == last_bucket;
    const bool suspect = __any_sync(kFullMask, pair_shared || head_in_last);
    if (keys_needed || suspect || exact) pick_key[0] = real ? full_key(e) : 0u;  // uniform
    if (suspect) {                                                               // uniform
      const std::uint32_t f = pick_key[0];
      const std::uint32_t last_mk = __shfl_sync(kFullMask, f, K - 1, W);
      const std::uint32_t fn = __shfl_down_sync(kFullMask, f, 1, W);
      // Two neighbouring picks of one bucket with different keys. In the last pick's bucket the
      // exact rounds run. Above it only their order can be wrong: the rounds take every candidate of
      // a bucket before any of a lower one, so a bucket above the last pick's is all picks; sorting
      // the picks repairs the order (sort_picks, below).
      const bool differs = pair_shared && f != fn;
      bool bad = differs && (my_pm & ~kIdx) == last_bucket;
      if (head_in_last) {
        const bool alone =
            (D < 2 || (bp[D > 1 ? 1 : 0] & ~kIdx) != last_bucket) && (pnext & ~kIdx) != last_bucket;
        bad = bad || !alone || full_key(static_cast<int>(kIdx - (bp[0] & kIdx))) != last_mk;
      }
      unordered = __any_sync(kFullMask, differs);
      collided = __any_sync(kFullMask, bad);
      exact = exact || collided;
    }
  }
  // The exact rounds keep the picks before the first doubtful one (exact_rounds' r0), which must
  // be in order: the picks are sorted first, so that those above every doubt stay.
  if (unordered) sort_picks(K, sl, pick_key[0], pick_e[0]);  // uniform
  if constexpr (kBucketRounds<Shape> && kStripes) {
    if (collided && hm_bucket < last_bucket) {  // uniform: the collision is the only doubt
      // Bucket rounds. Every candidate of a bucket above the last pick's is a pick (in order, above),
      // and no dry lane hides a key of the last pick's bucket; so picks rb .. K - 1, those of that
      // bucket, are its K - rb best candidates by full key. A lane's keys of that bucket, remapped to
      // (low key bits, inverted expert index), rank them with one redux.sync a round; a lane scans
      // its keys again only after giving a pick while it holds another. (Instead of the exact rounds:
      // they cost ~0.7 us of a lone row's latency, and these rows set the time of most calls from
      // T = 1024 on.)
      const auto bucket_best = [&](std::uint32_t thr, bool& more) {
        std::uint32_t best = 0u;
        int n = 0;
        for_each_stripe_key<S>(stripe, [&](int j, std::uint32_t key) {
          const std::uint32_t inv = packed_index<Shape>(lane_inv, j);
          const std::uint32_t m =
              (key & ~kIdx) == last_bucket ? 0x80000000u | (key & kIdx) << kIndexBits<Shape> | inv : 0u;
          const std::uint32_t below = m < thr ? m : 0u;
          n += below != 0u ? 1 : 0;
          best = max(best, below);
        });
        more = n > 1;
        return best;
      };
      const int rb = static_cast<int>(__reduce_min_sync(
          kFullMask, sl < K && (pick_key[0] & ~kIdx) == last_bucket ? static_cast<unsigned>(sl) : 32u));
      bool more = false;
      std::uint32_t mine = bucket_best(0xffffffffu, more);
#pragma unroll 1
      for (int r = rb; r < K; ++r) {
        const std::uint32_t pm = __reduce_max_sync(kFullMask, mine);
        if (sl == r) {
          pick_key[0] = last_bucket | ((pm >> kIndexBits<Shape>)&kIdx);
          pick_e[0] = static_cast<int>(kIdx - (pm & kIdx));
        }
        if (mine == pm) mine = more ? bucket_best(pm, more) : 0u;
      }
      exact = false;
    }
  }
  if (exact) {  // uniform
    std::uint32_t bk[D] = {}, next = 0u;
    int bb[D] = {};
    // Every hidden key is <= hm_bucket | kIdx. A collision's doubt lies in the last
    // pick's bucket (bad, above), so the picks of the buckets above it stay too: every candidate
    // of such a bucket is a pick, and sorted they are the true first picks (only the last one or
    // two rounds are redone; restarted from the first pick, these rows were the slowest of a
    // call). refill rebuilds the full-key buffers.
    const std::uint32_t bound = collided ? max(hm_bucket, last_bucket) : hm_bucket;
    exact_rounds<Shape>(K, sl, lane4, bk, bb, next, pick_key, pick_e, bound | kIdx, refill);
  }
}

// The last step of the post functions (oracle: detail::post_weights) for N picks a lane holds: w[i]
// from p (pv), the softmax terms (term: exp(p - max)) and the picks' sum in k order (softmax: of
// term; normalize: of p), times scale; 0 for a pick that is not finite (fin). Shared by finish_row
// and route_rows.
template <int N>
__device__ __forceinline__ void post_weights_from_sum(PostFn post, const bool (&fin)[N], const float (&pv)[N],
                                                      const float (&term)[N], float sum, float scale,
                                                      float (&w)[N]) {
  if (post == PostFn::kSoftmax) {
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = fin[i] ? __fmul_rn(__fdiv_rn(term[i], sum), scale) : 0.0f;
  } else if (post == PostFn::kNormalize) {
    const float denom = __fadd_rn(sum, 1e-20f);
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = fin[i] ? __fmul_rn(__fdiv_rn(pv[i], denom), scale) : 0.0f;
  } else if (post == PostFn::kSigmoid) {
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = fin[i] ? __fmul_rn(sigmoid_pre(pv[i]), scale) : 0.0f;
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = fin[i] ? __fmul_rn(pv[i], scale) : 0.0f;
  }
}

// Stores one pick (expert e, weight w) at index `out` of topk_ids / topk_weights in their dtypes.
__device__ __forceinline__ void store_pick(const RouteParams& p, std::int64_t out, int e, float w) {
  if (p.topk_ids != nullptr) {
    if (p.ids_int64) {
      static_cast<std::int64_t*>(p.topk_ids)[out] = e;
    } else {
      static_cast<std::int32_t*>(p.topk_ids)[out] = e;
    }
  }
  if (p.topk_weights != nullptr) {
    if (p.weights_bf16) {
      static_cast<std::uint16_t*>(p.topk_weights)[out] = detail::float_to_bf16(w);
    } else {
      static_cast<float*>(p.topk_weights)[out] = w;
    }
  }
}

// Steps 6 and 7 of route_warp: the weights of the picks from their p (oracle:
// detail::post_weights, sums in k order), then the outputs of the row (lane sl of its segment).
// A pick's p comes from its key, or, where that does not give it (a bias; +-0 without a pre
// function), from sp[e] (the row's p, when the caller kept it) or else the logit and the pre function.
template <class Shape>
__device__ __forceinline__ void finish_row(const RouteParams& p, int K, std::int64_t row, bool row_ok,
                                           const void* row_ptr, const SoftmaxRow& sm, int sl,
                                           const std::uint32_t (&pick_key)[Shape::kSlots],
                                           const int (&pick_e)[Shape::kSlots], const float* sp,
                                           RoutedPicks<Shape>* picks) {
  constexpr int W = Shape::W, SL = Shape::kSlots;
  bool has[SL], fin[SL];
  float pv[SL];
#pragma unroll
  for (int s = 0; s < SL; ++s) {
    has[s] = s * W + sl < K;
    fin[s] = has[s] && key_finite(pick_key[s]);
    pv[s] = key_score(pick_key[s]);
    const bool reload = p.bias != nullptr || (p.pre == PreFn::kNone && pick_key[s] == kZeroKey);
    if (fin[s] && reload) {
      if (sp != nullptr) {
        pv[s] = sp[pick_e[s]];
      } else {
        const float s_logit = load_one(row_ptr, p.logits_dtype, pick_e[s]);
        pv[s] = p.pre == PreFn::kSoftmax ? softmax_pre(s_logit, sm) : elementwise_pre(p.pre, s_logit);
      }
    }
  }
  float w[SL];
  float term[SL];
  float sum = 0.0f;
  if (p.post == PostFn::kSoftmax || p.post == PostFn::kNormalize) {
    float m = 0.0f;
    if (p.post == PostFn::kSoftmax) {
      float lm = neg_inf();
#pragma unroll
      for (int s = 0; s < SL; ++s) lm = fin[s] ? fmaxf(lm, pv[s]) : lm;
      m = key_score(segment_max<W>(score_key(lm)));
#pragma unroll
      for (int s = 0; s < SL; ++s) term[s] = fin[s] ? exp_any(__fadd_rn(pv[s], -m)) : 0.0f;
    } else {
#pragma unroll
      for (int s = 0; s < SL; ++s) term[s] = fin[s] ? pv[s] : 0.0f;
    }
    // Sum in k order. Adding +0 is exact (the sum starts at +0 and is never -0), and term is +0
    // for a non-finite pick and for k >= K (fin is false there): so the terms are gathered 8 at
    // a time (slot and source lane are compile-time, the shuffles' latencies overlap) and all 8
    // are added, in k order, for each block of 8 that starts below K.
#pragma unroll
    for (int k0 = 0; k0 < SL * W; k0 += 8) {
      if (k0 >= K) break;  // uniform
      float t[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int k = k0 + j;
        if (k < SL * W) t[j] = __shfl_sync(kFullMask, term[k / W], k % W, W);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (k0 + j < SL * W) sum = __fadd_rn(sum, t[j]);
      }
    }
  }
  post_weights_from_sum<SL>(p.post, fin, pv, term, sum, p.scale, w);

  // Outputs.
  if (row_ok) {
#pragma unroll
    for (int s = 0; s < SL; ++s) {
      if (has[s]) store_pick(p, row * K + s * W + sl, pick_e[s], w[s]);
    }
  }
  if (picks != nullptr) {
#pragma unroll
    for (int s = 0; s < SL; ++s) {
      picks->expert[s] = has[s] ? pick_e[s] : -1;
      picks->weight[s] = w[s];
    }
  }
}

}  // namespace dev

// ---------------------------------------------------------------------------------------------
// The warp routine (see the top of the file for the contract).

// kEarlyBias: the bias is loaded into registers together with the logits, so that its latency
// (an L2 hit, ~600 cycles on the H200) overlaps theirs; otherwise it is loaded when the keys are
// made, which keeps V registers free (more rows in flight per SM at large T; see routing.cu).
template <class Shape, bool kEarlyBias = false, bool kPackedTopK = true, int kGroupShift = 0>
__device__ __forceinline__ void route_warp(const RouteParams& p, std::int64_t first_row,
                                           unsigned char* warp_smem, RoutedPicks<Shape>* picks) {
  using namespace dev;
  constexpr int W = Shape::W, S = Shape::S, D = Shape::D, V = Shape::kValues, SL = Shape::kSlots;
  constexpr int NA = Shape::kAccs;
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int seg = lane / W;
  const int sl = lane % W;
  const int lane4 = 4 * sl;
  const std::int64_t row = first_row + seg;
  const bool row_ok = row < p.num_tokens;
  const int E = p.num_experts;
  const int K = p.top_k;
  const std::size_t elem = p.logits_dtype == static_cast<int>(DType::kFloat32) ? 4 : 2;
  const void* row_ptr = static_cast<const char*>(p.logits) +
                        (row_ok ? row : 0) * p.row_stride * static_cast<std::int64_t>(elem);

  // 1. Load the row (absent experts read as absent_fill: -inf with a softmax pre function, outside
  // every softmax sum, else 0, whose keys step 3 sets to 0; a dummy row past T reads as zeros, a
  // harmless finite row whose results are not written).
  const float fill = row_ok ? absent_fill(p.pre) : 0.0f;
  float v[V];
#pragma unroll
  for (int i = 0; i < S; ++i)
    load_chunk(row_ptr, p.logits_dtype, p.logits_vec, 4 * W * i + lane4, E, row_ok, fill, &v[4 * i]);
  if constexpr (W < 32) {
    // A dummy row of a narrow segment (T smaller than a warp's rows) takes the distinct values -e / 4
    // instead (within the fast softmax path's range for e < 128): a row of equal values puts every key
    // in one bucket, which sends the warp's packed top-K to its exact rounds.
    if (!row_ok) {
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = -0.25f * static_cast<float>(value_base<Shape>(j) + lane4);
    }
  }
  float bias_early[kEarlyBias ? V : 1];
  if constexpr (kEarlyBias) {
    if (p.bias != nullptr) {
#pragma unroll
      for (int i = 0; i < S; ++i)
        load_chunk(p.bias, p.bias_dtype, p.bias_vec, 4 * W * i + lane4, E, true, 0.0f, &bias_early[4 * i]);
    }
  }

  // 2. Pre-scores p (in v).
  // The per-value math has a fast path (exp_fast, div_fast, rcp_normal) and a general one.
  // Softmax checks the whole warp once and then runs branch-free, without per-value finiteness
  // tests; sigmoid checks per lane. The general loops (one branch per value) only run where
  // extreme or non-finite logits occur.
  SoftmaxRow sm{0.0f, 1.0f, 1.0f};
  std::uint32_t key[V];
  bool keys_ready = false;    // warp-uniform: key[] already holds the selection keys
  bool softmax_done = false;  // warp-uniform: the fast softmax path ran
  if (p.pre == PreFn::kSoftmax) {
    // Fast path, taken when every row of the warp is finite with max - min <= 44 (the common
    // case): no per-value special cases. Otherwise the general code below handles everything.
    // The variant for E == kMaxExperts has no presence tests at all (E is uniform).
    // RouteShape<32, 1, D> (64 < E <= 128) keeps the branchy form of this path, which the compiler
    // fits in 40 registers (softmax_fast: 43, i.e. 48 allocated and one block less per SM).
    if constexpr (W == 32 && S == 1) {
      softmax_done = softmax_fast_branchy<Shape>(v, key, E, lane4, sm);
    } else {
      softmax_done = E >= Shape::kMaxExperts ? softmax_fast<Shape, true>(v, key, E, lane4, sm)
                                             : softmax_fast<Shape, false>(v, key, E, lane4, sm);
    }
    keys_ready = softmax_done && p.bias == nullptr;
  }
  if (!softmax_done) sm = pre_scores<W, NA>(p.pre, v);

  // Shared memory of the row: the group paths' (srow), then, with the packed buffers, the keys
  // (skey) and, with a bias, p for the weights (sp: the keys do not give it). p is stored here,
  // while v still holds it (later v would stay live through the group step).
  unsigned char* srow =
      warp_smem == nullptr ? nullptr : warp_smem + seg * route_smem_bytes_per_row<Shape, kPackedTopK>(p);
  constexpr bool packed = kPackedTopK && kRowPackedBuffers<Shape>;
  const float* sp = nullptr;
  if constexpr (packed) {
    if (p.bias != nullptr) {
      float* spw = reinterpret_cast<float*>(srow + route_group_smem_bytes<Shape>(p)) + Shape::kMaxExperts;
#pragma unroll
      for (int i = 0; i < S; ++i)
        *reinterpret_cast<float4*>(spw + 4 * W * i + lane4) =
            make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
      sp = spw;
    }
  }

  // 3. Selection keys of q = canonical(p (+ bias)); 0 for experts past E.
  if (keys_ready) {
    // set by the fast softmax path
  } else if (p.bias != nullptr) {
    if constexpr (kEarlyBias) {
#pragma unroll
      for (int j = 0; j < V; ++j) key[j] = canonical_key(__fadd_rn(v[j], bias_early[j]));
    } else {
      // Loaded here rather than with the logits to keep 4*S registers free; the bias is shared by
      // every row, so these loads hit in L2.
#pragma unroll
      for (int i = 0; i < S; ++i) {
        float b[4];
        load_chunk(p.bias, p.bias_dtype, p.bias_vec, 4 * W * i + lane4, E, true, 0.0f, b);
#pragma unroll
        for (int c = 0; c < 4; ++c) key[4 * i + c] = canonical_key(__fadd_rn(v[4 * i + c], b[c]));
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) key[j] = canonical_key(v[j]);
  }
#pragma unroll
  for (int i = 0; i < S; ++i) {
    if (4 * W * (i + 1) > E) {  // stripe reaches past E (uniform)
#pragma unroll
      for (int c = 0; c < 4; ++c) key[4 * i + c] = (4 * W * i + lane4 + c < E) ? key[4 * i + c] : 0u;
    }
  }

  // 4. Group limit.
  if (p.group_path == kGroupChunks) {
    bool done = false;
    if constexpr (W == 32) {
      if (p.group_lanes) {
        group_limit_lanes<Shape, kGroupShift>(p, key, sl);
        done = true;
      }
    }
    if (!done) group_limit_chunks<Shape>(p, key, srow, sl);
  } else if (p.group_path == kGroupGeneric) {
    group_limit_generic<Shape>(p, key, srow, sl);
  }

  // 5. Top-K. refill_from(stripe) is select_top_k's refill, with the keys of stripe i from
  // stripe(i, keys).
  std::uint32_t pick_key[SL];
  int pick_e[SL];
  const auto refill_from = [&](const auto& stripe) {
    return [&, stripe](std::uint32_t(&rk)[D], int(&rb)[D], std::uint32_t& rn, std::uint32_t k, int e,
                       int lane_offset) {
      buffer_refill_after<Shape>(
          [&](const auto& f) {
#pragma unroll
            for (int i = 0; i < S; ++i) {
              std::uint32_t keys[4];
              stripe(i, keys);
              f(i, keys);
            }
          },
          rk, rb, rn, k, e, lane_offset);
    };
  };
  if constexpr (packed) {
    // Packed candidate buffers (select_top_k_packed). The full keys go to shared memory for the
    // picks, the check and the exact rounds; expert e = 128 i + lane4 + c sits at skey[e]. (The
    // address is recomputed rather than kept from step 3: holding it there cost the E = 256
    // softmax kernel 9 registers.)
    std::uint32_t* skey = reinterpret_cast<std::uint32_t*>(srow + route_group_smem_bytes<Shape>(p));
#pragma unroll
    for (int i = 0; i < S; ++i) {
      *reinterpret_cast<uint4*>(skey + 4 * W * i + lane4) =
          make_uint4(key[4 * i], key[4 * i + 1], key[4 * i + 2], key[4 * i + 3]);
    }
    __syncwarp();  // also for sp (step 3)
    const std::uint32_t lane_inv = kIndexMask<Shape> - static_cast<std::uint32_t>(lane4);
    std::uint32_t bp[D] = {}, pnext = 0u;
    if constexpr (D == 2) {
#pragma unroll
      for (int j = 0; j < V; j += 2)
        packed_insert2(bp, pnext, packed_key<Shape>(key[j], lane_inv, j),
                       packed_key<Shape>(key[j + 1], lane_inv, j + 1));
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) packed_insert<D>(bp, pnext, packed_key<Shape>(key[j], lane_inv, j));
    }
    const auto skey_stripe = [&](int i, std::uint32_t(&keys)[4]) {
      const uint4 q = *reinterpret_cast<const uint4*>(skey + 4 * W * i + lane4);
      keys[0] = q.x;
      keys[1] = q.y;
      keys[2] = q.z;
      keys[3] = q.w;
    };
    select_top_k_packed<Shape>(
        K, sl, lane4, bp, pnext, bucket_exact_keys(p), [&](int e) { return skey[e]; }, pick_key, pick_e,
        /*keys_needed=*/p.bias == nullptr, refill_from(skey_stripe), skey_stripe);
  } else {
    std::uint32_t bk[D] = {}, next = 0u;
    int bb[D] = {};
#pragma unroll
    for (int j = 0; j < V; ++j) buffer_insert<D>(bk, bb, next, key[j], value_base<Shape>(j));
    select_top_k<Shape>(K, sl, lane4, bk, bb, next, pick_key, pick_e,
                        refill_from([&](int i, std::uint32_t(&keys)[4]) {
#pragma unroll
                          for (int c = 0; c < 4; ++c) keys[c] = key[4 * i + c];
                        }));
  }

  // 6, 7. Weights and outputs.
  finish_row<Shape>(p, K, row, row_ok, row_ptr, sm, sl, pick_key, pick_e, sp, picks);
}

// ---------------------------------------------------------------------------------------------
// Wide rows: route_warp for E > 512 (W = 32, S > 4) without a group limit; also the streamed
// narrow segments (W = kStreamLanes, StreamShape), the same code over E / (4 W) stripes a lane.
//
// route_warp holds a row's 4*S values per lane in registers (64 at E = 2048): its wide kernels
// needed 146-255 registers (1-2 blocks per SM). Here a lane streams its stripes instead, a batch
// at a time: the selection keys of a stripe are computed from the logits (and bias) in memory when
// needed and go straight into the candidate buffer. Softmax takes two extra passes over the row
// first (its max, then its denominator), and the exact rounds of select_top_k recompute the keys
// they rescan. The row is re-read from L1 / L2; the arithmetic per value is route_warp's general
// path (the same operations in the same order: the same bits, i.e. the oracle's). In the
// specialised kernels (kPackedTopK) the buffers hold packed keys, as route_warp's do (five min / max
// per value): bf16 / fp16 logits without pre function or bias (every bucket holds one key, no
// collision check) at every T, other keys from kWidePackedMinTokens rows on
// (docs/decisions/routing-wide-rows.md).

// Stripe i of a lane in a wide row: its logits (absent experts -inf) and, when the pass asked for
// it and there is a bias, its bias.
struct WideStripe {
  float v[4], b[4];
};

// Stripes of a wide row loaded Shape::kStripeBatch (4 for whole warps) at a time: the loads of a batch are
// issued together, then f(i, stripe) runs for each, in stripe order (one stripe's load at a time put a full
// memory latency per stripe on a row's critical path). The batches are a loop, not unrolled:
// every pass over the row (softmax, keys, the rescans of the exact rounds) is a copy of this
// code, and unrolled they made a 49k-instruction kernel at E = 2048. with_bias: the pass needs
// the bias (the key passes do, the softmax passes do not).
template <class Shape, class F>
__device__ __forceinline__ void wide_visit_stripes(const RouteParams& p, const void* row_ptr, int lane4,
                                                   bool with_bias, const F& f) {
  using namespace dev;
  constexpr int W = Shape::W, S = Shape::S, B = Shape::kStripeBatch;
  const int E = p.num_experts;
  // Narrow segments (W < 32) serve any E up to the shape's 4 * W * S: only the stripes that reach
  // into the row run.
  const int stripes = W == 32 ? S : min(S, (E + 4 * W - 1) / (4 * W));
#pragma unroll 1
  for (int g = 0; g < stripes; g += B) {
    WideStripe st[B];
#pragma unroll
    for (int k = 0; k < B && g + k < stripes; ++k) {
      const int e0 = 4 * W * (g + k) + lane4;
      load_chunk(row_ptr, p.logits_dtype, p.logits_vec, e0, E, true, absent_fill(p.pre), st[k].v);
      if (with_bias && p.bias != nullptr)
        load_chunk(p.bias, p.bias_dtype, p.bias_vec, e0, E, true, 0.0f, st[k].b);
    }
#pragma unroll
    for (int k = 0; k < B && g + k < stripes; ++k) f(g + k, st[k]);
  }
}

// The selection keys of stripe i of a lane (experts 4*W*i + lane4 + c, c < 4) from its values:
// route_warp's steps 2-3 for those values. sm and sm_fast (route_warp's per-lane `fast`) are the
// softmax constants of the row when p.pre is softmax.
template <class Shape>
__device__ __forceinline__ void wide_stripe_keys(const RouteParams& p, int lane4, const dev::SoftmaxRow& sm,
                                                 bool sm_fast, int i, const WideStripe& st,
                                                 std::uint32_t (&key)[4]) {
  using namespace dev;
  constexpr int W = Shape::W;
  const int E = p.num_experts;
  float v[4] = {st.v[0], st.v[1], st.v[2], st.v[3]};
  if (p.pre == PreFn::kSoftmax) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const float x = __fadd_rn(v[c], -sm.m);
      const float q = sm_fast ? div_fast(exp_fast(x), sm.sum, sm.rcp) : div_by(exp_any(x), sm.sum, sm.rcp);
      v[c] = finite_abs(v[c]) ? q : v[c];
    }
  } else if (p.pre == PreFn::kSigmoid) {
    const bool fast =
        fabsf(v[0]) <= 86.5f && fabsf(v[1]) <= 86.5f && fabsf(v[2]) <= 86.5f && fabsf(v[3]) <= 86.5f;
    if (fast) {
#pragma unroll
      for (int c = 0; c < 4; ++c) v[c] = sigmoid_fast(v[c]);
    } else {
#pragma unroll
      for (int c = 0; c < 4; ++c) v[c] = sigmoid_pre(v[c]);
    }
  } else if (p.pre == PreFn::kSqrtSoftplus) {
#pragma unroll
    for (int c = 0; c < 4; ++c) v[c] = pre_slow(PreFn::kSqrtSoftplus, v[c]);
  }
  if (p.bias != nullptr) {
#pragma unroll
    for (int c = 0; c < 4; ++c) key[c] = canonical_key(__fadd_rn(v[c], st.b[c]));
  } else {
#pragma unroll
    for (int c = 0; c < 4; ++c) key[c] = canonical_key(v[c]);
  }
  if (4 * W * (i + 1) > E) {  // stripe reaches past E (uniform)
#pragma unroll
    for (int c = 0; c < 4; ++c) key[c] = 4 * W * i + lane4 + c < E ? key[c] : 0u;
  }
}

// route_warp's contract (see the top of this file) for Shape::W == 32 and p.group_path ==
// kGroupNone; warp_smem is not used. The caller skips warps whose row is past T.
template <class Shape, bool kPackedTopK = false>
__device__ __forceinline__ void route_warp_wide(const RouteParams& p, std::int64_t first_row,
                                                RoutedPicks<Shape>* picks) {
  using namespace dev;
  constexpr int W = Shape::W, D = Shape::D, SL = Shape::kSlots;
  static_assert(W == 32 || (kNarrowPacked<Shape> && kPackedTopK), "narrow segments: packed buffers only");
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int sl = lane % W;
  const int lane4 = 4 * sl;
  const int K = p.top_k;
  // A whole warp's row is below T (the caller's check); a row of a narrow segment past T reads the
  // last row instead and writes nothing.
  const std::int64_t row = first_row + lane / W;
  const bool row_ok = W == 32 || row < p.num_tokens;
  const std::int64_t read_row = row_ok ? row : p.num_tokens - 1;
  const std::size_t elem = p.logits_dtype == static_cast<int>(DType::kFloat32) ? 4 : 2;
  const void* row_ptr =
      static_cast<const char*>(p.logits) + read_row * p.row_stride * static_cast<std::int64_t>(elem);

  // Softmax constants: route_warp's general path, one pass for the max, one for the sum (a
  // single accumulator per lane with W = 32, adding the lane's values in stripe order). Narrow
  // segments serve rules without a softmax pre function only: routing.cu's stream Specs fix p.pre.
  SoftmaxRow sm{0.0f, 1.0f, 1.0f};
  bool sm_fast = true;
  if (W == 32 && p.pre == PreFn::kSoftmax) {
    float mx = neg_inf(), mn = __uint_as_float(0x7f800000u);
    wide_visit_stripes<Shape>(p, row_ptr, lane4, /*with_bias=*/false, [&](int, const WideStripe& st) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const bool f = finite_abs(st.v[c]);
        mx = f ? fmaxf(mx, st.v[c]) : mx;
        mn = f ? fminf(mn, st.v[c]) : mn;
      }
    });
    sm.m = key_score(segment_max<W>(score_key(mx)));
    sm_fast = __fadd_rn(mn, -sm.m) >= -44.0f;
    float acc[1] = {0.0f};
    wide_visit_stripes<Shape>(p, row_ptr, lane4, /*with_bias=*/false, [&](int, const WideStripe& st) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float x = __fadd_rn(st.v[c], -sm.m);
        const float e = sm_fast ? exp_fast(x) : exp_any(x);
        acc[0] = __fadd_rn(acc[0], finite_abs(st.v[c]) ? e : 0.0f);
      }
    });
    sm.sum = softmax_row_sum<W>(acc);
    sm.rcp = __frcp_rn(sm.sum);
  }
  const auto visit_keys = [&](const auto& f) {
    wide_visit_stripes<Shape>(p, row_ptr, lane4, /*with_bias=*/true, [&](int i, const WideStripe& st) {
      std::uint32_t key[4];
      wide_stripe_keys<Shape>(p, lane4, sm, sm_fast, i, st, key);
      f(i, key);
    });
  };

  // Candidate buffers, then the top-K (the exact rounds rescan through visit_keys).
  std::uint32_t pick_key[SL];
  int pick_e[SL];
  const auto refill = [&](std::uint32_t(&rk)[D], int(&rb)[D], std::uint32_t& rn, std::uint32_t k, int e,
                          int lane_offset) {
    buffer_refill_after<Shape>(visit_keys, rk, rb, rn, k, e, lane_offset);
  };
  // Packed candidate buffers (route_warp's, see select_top_k_packed; kPackedTopK: the caller's
  // choice, wide_packed_buffers). full_key recomputes an expert's key from its logit (and bias): the
  // checks ask for the picks' keys and some heads' (L1 / L2 hits). bf16 / fp16 logits without pre
  // function or bias have one key per bucket: no collision check and no full keys.
  constexpr bool packed = kPackedTopK && kPackedKeys<Shape>;
  if constexpr (packed) {
    const std::uint32_t lane_inv = kIndexMask<Shape> - static_cast<std::uint32_t>(lane4);
    std::uint32_t bp[D] = {}, pnext = 0u;
    visit_keys([&](int i, const std::uint32_t(&key)[4]) {
#pragma unroll
      for (int c = 0; c < 4; ++c) packed_insert<D>(bp, pnext, packed_key<Shape>(key[c], lane_inv, 4 * i + c));
    });
    // The key of expert e: wide_stripe_keys' arithmetic for one value (softmax_pre and
    // elementwise_pre give the bits of its fast and general paths).
    const auto full_key = [&](int e) {
      const float s = load_one(row_ptr, p.logits_dtype, e);
      float q = p.pre == PreFn::kSoftmax ? softmax_pre(s, sm) : elementwise_pre(p.pre, s);
      if (p.bias != nullptr) q = __fadd_rn(q, load_one(p.bias, p.bias_dtype, e));
      return canonical_key(q);
    };
    // With a bias finish_row takes p from the logit: the picks' keys are not needed there.
    select_top_k_packed<Shape>(K, sl, lane4, bp, pnext, bucket_exact_keys(p), full_key, pick_key, pick_e,
                               /*keys_needed=*/p.bias == nullptr, refill);
  } else {
    std::uint32_t bk[D] = {}, next = 0u;
    int bb[D] = {};
    visit_keys([&](int i, const std::uint32_t(&key)[4]) {
#pragma unroll
      for (int c = 0; c < 4; ++c) buffer_insert<D>(bk, bb, next, key[c], value_base<Shape>(4 * i + c));
    });
    select_top_k<Shape>(K, sl, lane4, bk, bb, next, pick_key, pick_e, refill);
  }
  finish_row<Shape>(p, K, row, row_ok, row_ptr, sm, sl, pick_key, pick_e, /*sp=*/nullptr, picks);
}

}  // namespace switchyard::cuda::routing
