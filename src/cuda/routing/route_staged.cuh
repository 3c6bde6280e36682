// Staged rows: one thread per row at large T (docs/design.md section 2) for three rule families
// (StagedRule): sigmoid + bias (DeepSeek-V3 with its groups of 32 experts, Kimi-K2, GLM-4.5), logits
// without a pre function (Qwen3, gpt-oss, Llama 4), and softmax -> normalize. Same contract and bits as
// route_warp (route_warp.cuh), whose device arithmetic it calls, except for the weights of
// softmax -> normalize rows (step 5).
//
// Why: route_warp gives a row a whole warp. At T = 65536 it is bound by instruction issue, and
// most of a row's ~830 warp instructions (deepseek-v3, ncu) serve only that row: the
// group limit, the K top-K rounds, the weights. Here every warp instruction serves 32 rows, and a
// row's work is the per-expert arithmetic (for sigmoid: the oracle's exp and division, ~20
// instructions; else none) and a sorting network (~10 per expert). Rows come through shared memory:
// a warp stages 32 experts of its 32 rows at a time with cp.async (coalesced 128-byte row pieces, a
// ring of kStages stages so that several chunks are in flight), and each lane reads its own row from
// there (swizzled pieces: conflict-free 16-byte reads). A lane's loads straight from global memory
// would touch 32 lines per instruction (docs/decisions/routing-staged-kernels.md).
//
// A row, in one thread, chunk by chunk (32 experts; E % 32 == 0):
//   1. Selection keys (route_warp's ordered 32-bit keys): of q = canonical(sigmoid(logit) + bias)
//      (the exact sigmoid: its fast path when every |logit| of the chunk is <= 86.5), or of the logit
//      itself (softmax is monotone; see 4 for where it is not strictly so). Then the packed key: the
//      key with its low bits (as many as E - 1 needs) replaced by the inverted expert index, so that
//      packed keys order by (bucket desc, expert asc), the oracle's order unless two keys share a
//      bucket (see 4). bf16 logits keyed as they are lose nothing (their keys' low 16 bits are
//      constant): exact.
//   2. Group limit (groups of exactly one chunk): the group's score from the two largest full keys
//      (a max / second-max tree: exact, as the oracle's sum of the two best q), and the best
//      topk_group groups so far (score desc, group asc: a later group displaces the worst kept one
//      only when strictly better), each with its top 8 packed keys.
//   3. The chunk's top 8 packed keys and the largest one left out ("ninth"): four 8-sorters (19
//      comparators) and three bitonic top-8 merges (common/top8_network.h), whose losers' maximum is the
//      ninth. Without a group limit they merge into the row's running top 8.
//   4. After the last chunk (with a group limit: the kept groups' lists merged), the K best packed
//      keys. Exact unless the K-th pick shares its bucket with the best key left out (the K+1-th,
//      or the ninth when K = 8): then every non-pick's key is below every pick's. Otherwise (rare:
//      keys within 2^-14 or so of each other) the whole warp routes the row again with route_warp,
//      one such row after another (the rows' logits are still in L2). A lane that redid its row
//      exactly from global memory would run a serial chain of E loads, and the slowest warps would
//      then set the call's time. The picks'
//      p and full keys are recomputed from their logits (p is needed for the weights anyway), and
//      picks of one bucket are put in key order. The picks' logits: fp32 rows without a group limit
//      carry them with the running top 8 (each chunk's top 8 read from its stage by expert), bf16
//      logits keyed as they are give them by their keys, other rows read them again. Softmax rows are also
//      redone where unequal logits could round to one p (the oracle ranks those by expert):
//      common/softmax_picks.h.
//   5. Weights and outputs: route_rows.cuh's store_thread_row, the oracle's arithmetic. Softmax ->
//      normalize rows: w = exp(s - m) / (sum of the picks' exp(s - m)) * scale in fp64, one rounding
//      (the oracle's full softmax cancels out of its normalisation; its sum over all E experts would
//      cost every expert an exact exp). Within 1e-6 relative of the oracle's weights, not their bits.
//
// Approximate selection (kApprox, sigmoid + bias rows; RouteOptions::staged_approx, off by default
// until measured on the GPU). The exact sigmoid is most of such a row's per-expert work (~17 of ~49
// instructions an expert, against 2 and a second MUFU for sigmoid_approx). The picks are selected on
// q' = RN(sigmoid_approx(s) + b) (chunks with a |logit| > 86.5 or a NaN take the exact sigmoid), then
// certified on exact scores, which the weights need anyway (common/approx_certify.h): the K picks'
// exact q (recomputed from their logits, as every row does) must all lie above the top of the bucket
// of the best key left out plus a margin of 4 x the approximation's bound, and with a group limit the
// worst kept group's score must lie 16 x that bound above the best dropped one; the picks are then put
// in exact (key desc, expert asc) order. A row that fails (keys within ~2^-15 relative of each other,
// about as rare as the exact keys' bucket collisions it replaces) is routed again exactly by the whole
// warp, as in step 4, so ids and weights keep the oracle's bits (docs/decisions/routing-approx-sigmoid.md).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/approx_certify.h"
#include "common/softmax_picks.h"
#include "common/top8_network.h"
#include "cuda/common/launch.cuh"
#include "cuda/routing/route_rows.cuh"
#include "cuda/routing/route_warp.cuh"

namespace switchyard::cuda::routing {

// The staged kernels' sizes (kStagedChunk ..., StagedLayout), rules (StagedRule) and the launcher's
// choice (staged_fits, use_staged): route_plan.h.

namespace dev {

__device__ __forceinline__ void cp_async16(unsigned smem_addr, const void* gptr) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr), "l"(gptr) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most kPending committed groups of the calling thread are pending.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void prefetch_line_l2(const void* ptr) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(ptr));
}

using ::switchyard::detail::approx_groups_certified;  // common/approx_certify.h
using ::switchyard::detail::approx_margins;
using ::switchyard::detail::approx_picks_certified;
using ::switchyard::detail::merge8;  // common/top8_network.h
using ::switchyard::detail::merge8_carry;
using ::switchyard::detail::softmax_picks_doubtful;  // common/softmax_picks.h
using ::switchyard::detail::sort8;

}  // namespace dev

// Routes the 32 rows first_row .. first_row + 31 of p (lane l: row first_row + l; rows >= T read row
// T - 1 and write nothing) in the calling warp (all 32 lanes, converged). stages: the warp's
// StagedLayout::kWarpBytes of shared memory (16-byte aligned); bias: the E bias values in shared
// memory (kSigmoidBias). kGroups: groups of 32 experts (staged_fits; kSigmoidBias only); else no group
// limit. kApprox (kSigmoidBias only): select on approximate sigmoids and certify (see "Approximate
// selection" above).
template <DType kDtype, StagedRule kRule, bool kGroups, bool kApprox = false>
__device__ __forceinline__ void route_staged_warp(const RouteParams& p, std::int64_t first_row,
                                                  unsigned char* stages, const float* bias) {
  using namespace dev;
  using L = StagedLayout<kDtype>;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int E = p.num_experts;
  const int K = p.top_k;
  const int chunks = E / kStagedChunk;
  const std::int64_t pitch = p.row_stride * L::kElem;  // bytes
  const auto* logits = static_cast<const unsigned char*>(p.logits);
  const std::int64_t last = p.num_tokens - 1;
  const std::int64_t row = first_row + lane;
  const unsigned char* row_ptr = logits + (row < last ? row : last) * pitch;
  static_assert(!kApprox || kRule == StagedRule::kSigmoidBias, "approximate selection: sigmoid + bias only");

  // The warp's copies of chunk c into stage s: lane l copies piece l % kPieces of rows
  // kRowsPerCopy * i + l / kPieces.
  const unsigned stage_base = static_cast<unsigned>(__cvta_generic_to_shared(stages));
  const auto issue = [&](int c, int s) {
#pragma unroll
    for (int i = 0; i < L::kPieces; ++i) {
      const int r = L::kRowsPerCopy * i + lane / L::kPieces;
      const std::int64_t g = first_row + r < last ? first_row + r : last;
      const int piece = lane % L::kPieces;
      cp_async16(stage_base + s * L::kStageBytes + r * L::kChunkBytes + 16 * L::piece_at(r, piece),
                 logits + g * pitch + c * L::kChunkBytes + 16 * piece);
    }
  };

  // Index bits of the packed keys: enough for E - 1.
  int bits = 1;
  while ((1 << bits) < E) ++bits;
  const std::uint32_t index_mask = (1u << bits) - 1u;

  // Without a group limit: the row's running top 8 (0: empty), with kCarry their logits' bits (below),
  // and the largest key left out.
  std::uint32_t run[kStagedTopK];
  std::uint32_t run_bits[kStagedTopK];
  std::uint32_t run_out = 0u;
  // With one: the best topk_group groups so far (slot j: score, group, top 8, largest left out).
  float gscore[kStagedMaxGroups];
  int gid[kStagedMaxGroups];
  std::uint32_t glist[kStagedMaxGroups][kStagedTopK];
  std::uint32_t gout[kStagedMaxGroups];
  float gdrop = neg_inf();  // kApprox: the best score of a group not kept
#pragma unroll
  for (int i = 0; i < kStagedTopK; ++i) run[i] = run_bits[i] = 0u;
  if constexpr (kGroups) {
#pragma unroll
    for (int j = 0; j < kStagedMaxGroups; ++j) {
      gscore[j] = neg_inf();
      gid[j] = 0;
      gout[j] = 0u;
#pragma unroll
      for (int i = 0; i < kStagedTopK; ++i) glist[j][i] = 0u;
    }
  }

  // bf16 logits keyed as they are (kLogits, kSoftmaxPicks): a key's low 16 bits are 0 (>= +0) or all
  // ones (< 0), so the packed keys lose nothing and order exactly as (key desc, expert asc).
  constexpr bool kExactPacked = kDtype == DType::kBFloat16 && kRule != StagedRule::kSigmoidBias;
  // Where the picks' logits come from after the last chunk. kExactPacked: their keys (but -0). kCarry
  // (fp32 logits without a group limit): the running top 8 carries them (merge8_carry), each chunk's
  // top 8 read from its stage by expert: a reload from global memory costs at T = 65536, where the
  // lines read first have left L2. Otherwise (kReloadPicks: bf16 sigmoid + bias rows, whose lines stay
  // in L2, and rows with a group limit, whose kept groups' lists would need 32 more registers) they
  // are read again, their lines prefetched into L2 during the last chunk (not for bf16 logits keyed
  // as they are, where the prefetch cost). docs/decisions/routing-staged-kernels.md.
  constexpr bool kCarry = !kGroups && kDtype == DType::kFloat32;
  constexpr bool kReloadPicks = !kCarry && !kExactPacked;

  // Chunk c goes to stage c % kStages, as copy group c (groups without a chunk are empty).
#pragma unroll
  for (int c = 0; c + 1 < L::kStages; ++c) {
    if (c < chunks) issue(c, c);
    cp_async_commit();
  }
  int stage = 0;               // chunk c's
  int ahead = L::kStages - 1;  // chunk c + kStages - 1's
  for (int c = 0; c < chunks; ++c) {
    if (c + L::kStages - 1 < chunks) issue(c + L::kStages - 1, ahead);
    if (kReloadPicks && c + 1 == chunks && c > 0) {
      // The picks' logits are read again at the end; by then the lines read first may have left L2
      // (fp32 at T = 65536: 67 MB). Back into L2 now, during the last chunk: the lines of the kept
      // groups, or of the running top 8.
      if constexpr (kGroups) {
#pragma unroll
        for (int j = 0; j < kStagedMaxGroups; ++j)
          if (j < p.topk_group) prefetch_line_l2(row_ptr + gid[j] * L::kChunkBytes);
      } else {
#pragma unroll
        for (int k = 0; k < kStagedTopK; ++k)
          prefetch_line_l2(row_ptr + static_cast<int>(index_mask - (run[k] & index_mask)) * L::kElem);
      }
    }
    cp_async_commit();  // possibly empty: groups 0 .. c done = chunk c landed
    cp_async_wait<L::kStages - 1>();
    __syncwarp();
    // 1. The chunk's logits (own row) and bias.
    float v[kStagedChunk];
    const unsigned char* mine = stages + stage * L::kStageBytes + lane * L::kChunkBytes;
#pragma unroll
    for (int m = 0; m < L::kPieces; ++m) {
      const uint4 u = *reinterpret_cast<const uint4*>(mine + 16 * L::piece_at(lane, m));
      const unsigned w[4] = {u.x, u.y, u.z, u.w};
      if constexpr (kDtype == DType::kFloat32) {
#pragma unroll
        for (int t = 0; t < 4; ++t) v[4 * m + t] = __uint_as_float(w[t]);
      } else {
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          v[8 * m + 2 * t] = __uint_as_float(w[t] << 16);
          v[8 * m + 2 * t + 1] = __uint_as_float(w[t] & 0xffff0000u);
        }
      }
    }
    // Every lane has read this stage before chunk c + kStages is copied into it (kCarry: below).
    if constexpr (!kCarry) __syncwarp();
    stage = stage + 1 == L::kStages ? 0 : stage + 1;
    ahead = ahead + 1 == L::kStages ? 0 : ahead + 1;
    std::uint32_t key[kStagedChunk];
    if constexpr (kRule == StagedRule::kSigmoidBias) {
      float mx = 0.0f;
#pragma unroll
      for (int j = 0; j < kStagedChunk; ++j) mx = max_nan(mx, fabsf(v[j]));
      if constexpr (kApprox) {
        // Where every |logit| is <= 86.5 (NaN fails the test) the approximate keys: q is never NaN there
        // (the kernel stored NaN biases as -inf, which ranks the same) nor -0 (the sigmoid is > 0), so
        // they need neither canonical_key's max nor its + 0. Else the exact keys.
        const float4* bc = reinterpret_cast<const float4*>(bias + c * kStagedChunk);
        const auto keys = [&](auto key_of) {  // key[j] = key_of(v[j], bias of expert 32c + j)
#pragma unroll
          for (int m = 0; m < kStagedChunk / 4; ++m) {
            const float4 b4 = bc[m];
            const float b[4] = {b4.x, b4.y, b4.z, b4.w};
#pragma unroll
            for (int t = 0; t < 4; ++t) key[4 * m + t] = key_of(v[4 * m + t], b[t]);
          }
        };
        if (mx <= 86.5f) {
          keys([](float s, float b) { return score_key_signed(__fadd_rn(sigmoid_approx(s), b)); });
        } else {
          keys([](float s, float b) { return canonical_key(__fadd_rn(sigmoid_pre(s), b)); });
        }
      } else {
        // Written out rather than through a key_of loop as above: that form changed the fp32 / bf16
        // kernels' SASS, and these are the default kernels.
        if (mx <= 86.5f) {
#pragma unroll
          for (int j = 0; j < kStagedChunk; ++j) v[j] = sigmoid_fast(v[j]);
        } else {
#pragma unroll
          for (int j = 0; j < kStagedChunk; ++j) v[j] = sigmoid_pre(v[j]);
        }
        const float* bc = bias + c * kStagedChunk;
#pragma unroll
        for (int m = 0; m < kStagedChunk / 4; ++m) {
          const float4 b = *reinterpret_cast<const float4*>(bc + 4 * m);
          key[4 * m] = canonical_key(__fadd_rn(v[4 * m], b.x));
          key[4 * m + 1] = canonical_key(__fadd_rn(v[4 * m + 1], b.y));
          key[4 * m + 2] = canonical_key(__fadd_rn(v[4 * m + 2], b.z));
          key[4 * m + 3] = canonical_key(__fadd_rn(v[4 * m + 3], b.w));
        }
      }
    } else {
      // Softmax is monotone, so the logits order the experts as p does, except where two logits
      // round to one p; kSoftmaxPicks tests that below (step 4).
#pragma unroll
      for (int j = 0; j < kStagedChunk; ++j) key[j] = canonical_key(v[j]);
    }
    // 2. The group's score: its two largest full keys (with multiplicity), by a tree.
    float score = 0.0f;
    if constexpr (kGroups) {
      std::uint32_t hi[kStagedChunk / 2], lo[kStagedChunk / 2];
#pragma unroll
      for (int i = 0; i < kStagedChunk / 2; ++i) {
        hi[i] = max(key[2 * i], key[2 * i + 1]);
        lo[i] = min(key[2 * i], key[2 * i + 1]);
      }
#pragma unroll
      for (int level = 0; level < 4; ++level) {  // n = 8, 4, 2, 1 (a constant trip count: registers)
        const int n = (kStagedChunk / 4) >> level;
#pragma unroll
        for (int i = 0; i < kStagedChunk / 4; ++i) {
          if (i < n) {
            const std::uint32_t h = max(hi[i], hi[i + n]);
            lo[i] = max(min(hi[i], hi[i + n]), max(lo[i], lo[i + n]));
            hi[i] = h;
          }
        }
      }
      const float s1 = key_score(hi[0]);
      score = p.group_take == 1 ? s1 : fmaxf(__fadd_rn(s1, key_score(lo[0])), neg_inf());
    }
    // 3. Packed keys, the chunk's top 8 and the largest left out.
    const std::uint32_t inv_base = index_mask - static_cast<std::uint32_t>(c * kStagedChunk);
#pragma unroll
    for (int j = 0; j < kStagedChunk; ++j) key[j] = (key[j] & ~index_mask) | (inv_base - j);
#pragma unroll
    for (int q = 0; q < 4; ++q) sort8(key + 8 * q);
    std::uint32_t out0 = 0u, out2 = 0u;
    merge8(key, out0, key + 8, 0u);
    merge8(key + 16, out2, key + 24, 0u);
    merge8(key, out0, key + 16, out2);
    if constexpr (kGroups) {
      // Group c into the kept groups. Slots are unordered (merging their lists gives the same top 8 in
      // any order): the first topk_group groups fill them, then a group replaces the worst kept one
      // (lowest score, of those the latest group) when its score is strictly higher (it comes later).
      // Selects on every slot: written as a move through the slot index, the compiler kept the
      // lists in local memory.
      float worst = gscore[0];
      int worst_gid = gid[0], w = 0;
#pragma unroll
      for (int j = 1; j < kStagedMaxGroups; ++j) {
        const bool worse =
            j < p.topk_group && (gscore[j] < worst || (gscore[j] == worst && gid[j] > worst_gid));
        w = worse ? j : w;
        worst = worse ? gscore[j] : worst;
        worst_gid = worse ? gid[j] : worst_gid;
      }
      const bool fill = c < p.topk_group;
      const unsigned take = (fill || score > worst) ? 1u << (fill ? c : w) : 0u;
      if constexpr (kApprox) gdrop = fmaxf(gdrop, fill ? neg_inf() : (take ? worst : score));
#pragma unroll
      for (int j = 0; j < kStagedMaxGroups; ++j) {
        const bool s = (take >> j) & 1u;
        gscore[j] = s ? score : gscore[j];
        gid[j] = s ? c : gid[j];
        gout[j] = s ? out0 : gout[j];
#pragma unroll
        for (int i = 0; i < kStagedTopK; ++i) glist[j][i] = s ? key[i] : glist[j][i];
      }
    } else if constexpr (kCarry) {
      // The chunk's top 8's fp32 logits, from the stage by expert (before the stage is copied into
      // again): expert j's 4 bytes sit in piece 4j / 16.
      std::uint32_t bits_of[kStagedTopK];
#pragma unroll
      for (int r = 0; r < kStagedTopK; ++r) {
        const int byte = static_cast<int>(inv_base - (key[r] & index_mask)) * 4;
        bits_of[r] =
            *reinterpret_cast<const std::uint32_t*>(mine + 16 * L::piece_at(lane, byte / 16) + byte % 16);
      }
      __syncwarp();
      merge8_carry(run, run_bits, run_out, key, bits_of, out0);
    } else {
      merge8(run, run_out, key, out0);
    }
  }

  // 4. The K best packed keys and the exactness test.
  if constexpr (kGroups) {
#pragma unroll
    for (int i = 0; i < kStagedTopK; ++i) run[i] = glist[0][i];
    run_out = gout[0];
#pragma unroll
    for (int j = 1; j < kStagedMaxGroups; ++j) {
      if (j < p.topk_group) merge8(run, run_out, glist[j], gout[j]);
    }
  }
  // The K-th key and the one after it, by selects on a bit mask (a loop on k == K - 1 the compiler
  // turned into an indexed load from a local copy of run).
  std::uint32_t kth = run[0], after = run_out;
  const unsigned kth_bit = 1u << (K - 1);
#pragma unroll
  for (int k = 1; k < kStagedTopK; ++k) {
    kth = (kth_bit >> k) & 1u ? run[k] : kth;
    after = (kth_bit >> (k - 1)) & 1u ? run[k] : after;
  }
  const auto full_key = [&](std::uint32_t packed) {
    return (packed & 0xffff0000u) | ((packed & 0x80000000u) ? 0u : 0xffffu);
  };
  bool redo = !kExactPacked && !kApprox && row <= last && ((kth ^ after) & ~index_mask) == 0;
  int e[kStagedTopK];
#pragma unroll
  for (int k = 0; k < kStagedTopK; ++k) e[k] = static_cast<int>(index_mask - (run[k] & index_mask));

  // The picks' p (kSoftmaxPicks: the logits) and full keys, from their logits; picks of one bucket
  // into key order.
  float pv[kStagedTopK];
  std::uint32_t fk[kStagedTopK];
  const auto load_picks = [&]() {
    if constexpr (kExactPacked) {
      // p from the key, but for -0 (whose key is +0's): read the logit then.
#pragma unroll
      for (int k = 0; k < kStagedTopK; ++k) {
        fk[k] = full_key(run[k]);
        pv[k] = fk[k] == kZeroKey ? load_one(row_ptr, static_cast<int>(kDtype), e[k]) : key_score(fk[k]);
      }
      return;
    }
    bool sorted = true;
#pragma unroll
    for (int k = 0; k < kStagedTopK; ++k) {
      const float s =
          kCarry ? __uint_as_float(run_bits[k]) : load_one(row_ptr, static_cast<int>(kDtype), e[k]);
      if constexpr (kRule == StagedRule::kSigmoidBias) {
        pv[k] = sigmoid_pre(s);
        fk[k] = canonical_key(__fadd_rn(pv[k], bias[e[k]]));
      } else {
        pv[k] = s;
        fk[k] = canonical_key(s);
      }
      if constexpr (kApprox) {
        // Equal exact keys may come from different approximate buckets, out of expert order.
        if (k > 0 && k < K && (fk[k] > fk[k - 1] || (fk[k] == fk[k - 1] && e[k] < e[k - 1]))) sorted = false;
      } else {
        if (k > 0 && k < K && fk[k] > fk[k - 1]) sorted = false;
      }
    }
    if (!sorted) {
      // Odd-even transposition sort of the K picks by (key desc, expert asc), static indices: rare.
#pragma unroll 1
      for (int pass = 0; pass < kStagedTopK; ++pass) {
#pragma unroll
        for (int k = 0; k + 1 < kStagedTopK; ++k) {
          const bool swap = (k & 1) == (pass & 1) && k + 1 < K &&
                            (fk[k + 1] > fk[k] || (fk[k + 1] == fk[k] && e[k + 1] < e[k]));
          const std::uint32_t tk = fk[k];
          fk[k] = swap ? fk[k + 1] : fk[k];
          fk[k + 1] = swap ? tk : fk[k + 1];
          const int te = e[k];
          e[k] = swap ? e[k + 1] : e[k];
          e[k + 1] = swap ? te : e[k + 1];
          const float tp = pv[k];
          pv[k] = swap ? pv[k + 1] : pv[k];
          pv[k + 1] = swap ? tp : pv[k + 1];
        }
      }
    }
  };
  // kSoftmaxPicks: the p test (common/softmax_picks.h); t[k] = exp(s_k - m) serves the weights.
  float t[kStagedTopK];
  if constexpr (kRule == StagedRule::kSoftmaxPicks) {
    load_picks();
    // The best logit left out; with exact packed keys (bf16) one equal to the K-th pick's needs no test
    // (equal p, ranked by expert as packed), so the test takes the next bf16 value below instead: no
    // distinct logit left out is larger.
    float after_s;
    if constexpr (kExactPacked) {
      std::uint32_t below = full_key(after);
#pragma unroll
      for (int k = 0; k < kStagedTopK; ++k)
        if (((kth_bit >> k) & 1u) && below == fk[k]) below -= 0x10000u;
      after_s = key_score(below);
    } else if constexpr (kCarry) {
      after_s = key_score(after | index_mask);  // the largest logit of its bucket: an upper bound
    } else {
      after_s =
          load_one(row_ptr, static_cast<int>(kDtype), static_cast<int>(index_mask - (after & index_mask)));
    }
    const bool doubt = softmax_picks_doubtful(
        K, pv, fk, e, after_s, [](float x) { return exp_any(x); }, t);
    redo = redo || (row <= last && doubt);
  }

  if constexpr (kApprox) {
    // The kept groups and the picks, certified on exact scores (common/approx_certify.h). The largest
    // score of the bucket of the best key left out bounds every approximate score left out. With a
    // group limit the margin grows with the largest finite |bias|.
    ::switchyard::detail::ApproxMargins margins = approx_margins(0.0f, kSigmoidApproxErr);
    if constexpr (kGroups) {
      float b_max = 0.0f;
      for (int i = lane; i < E; i += 32) {
        const float b = fabsf(bias[i]);  // NaN: not below inf
        b_max = b < __uint_as_float(0x7f800000u) ? fmaxf(b_max, b) : b_max;
      }
#pragma unroll
      for (int off = 16; off >= 1; off /= 2) b_max = fmaxf(b_max, __shfl_xor_sync(kFullMask, b_max, off));
      margins = approx_margins(b_max, kSigmoidApproxErr);
      float kept_min = gscore[0];
#pragma unroll
      for (int j = 1; j < kStagedMaxGroups; ++j)
        kept_min = j < p.topk_group ? fminf(kept_min, gscore[j]) : kept_min;
      redo = row <= last && !approx_groups_certified(kept_min, gdrop, margins);
    }
    load_picks();
    std::uint32_t worst_pick = fk[0];  // exact keys, sorted: the K-th
#pragma unroll
    for (int k = 1; k < kStagedTopK; ++k) worst_pick = (kth_bit >> k) & 1u ? fk[k] : worst_pick;
    redo = redo || (row <= last &&
                    !approx_picks_certified(key_score(worst_pick), key_score(after | index_mask), margins));
  }

  // Rows whose selection may not be exact are routed again, one at a time, by the whole warp
  // (route_warp on the stages' memory, which the chunks no longer need), and are done.
  for (unsigned m = __ballot_sync(kFullMask, redo); m != 0; m &= m - 1) {
    route_warp<StagedRedoShape>(p, first_row + (__ffs(m) - 1), stages, nullptr);
    __syncwarp();  // the next redo writes the shared memory this one's lanes read
  }
  if (redo || row > last) return;

  if constexpr (kRule == StagedRule::kSoftmaxPicks) {
    // 5. Weights: softmax -> normalize gives w_k = p_k / sum of the picks' p = t_k / sum of the picks' t
    // (times scale; the oracle's + 1e-20 is below an ulp of that sum, which is >= 1 / E), computed here
    // in fp64 and rounded once: within (K + 4) fp32 ulps of the oracle's rounded fp32 steps (< 1e-6
    // relative for K <= 8), not its bits. The ids are exact.
    double sum = 0.0;
#pragma unroll
    for (int k = 0; k < kStagedTopK; ++k) sum += k < K ? static_cast<double>(t[k]) : 0.0;
    const double f = static_cast<double>(p.scale) / sum;
    float w[kStagedTopK];
#pragma unroll
    for (int k = 0; k < kStagedTopK; ++k) w[k] = static_cast<float>(static_cast<double>(t[k]) * f);
    store_thread_outputs<kStagedTopK>(p, row, K, w, e);
  } else {
    if constexpr (!kApprox) load_picks();
    bool fin[kStagedTopK];
#pragma unroll
    for (int k = 0; k < kStagedTopK; ++k) fin[k] = k < K && key_finite(fk[k]);
    store_thread_row<kStagedTopK>(p, row, K, fin, pv, e);
  }
}

}  // namespace switchyard::cuda::routing
