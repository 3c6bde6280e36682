// Thread-per-row routing (docs/design.md section 2) for rows of up to kRowsMaxExperts experts with
// K <= kRowsMaxTopK and no group limit: the large-T form of the smallest expert counts (Mixtral
// E = 8, DBRX 16). Same contract and bits as route_warp (route_warp.cuh), whose
// device arithmetic it calls.
//
// Why: route_warp serves such rows with narrow segments (W = 2-16 lanes a row), whose per-row
// work is mostly segment bookkeeping (ncu at T = 65536: ~620 warp instructions per warp of 8 DBRX
// rows, issue slots 49% busy). Here one thread holds a whole row in registers and does every
// step alone: no shuffles, no segment reductions, and every warp instruction serves 32 rows.
// The cost is latency: a row's chain is serial, so the launcher takes this form only from
// kRowsMinTokens8 / 16 rows on (route_warp is faster below; docs/decisions/routing-row-forms.md).
//
// A row, in one thread: the logits (vector loads where aligned; absent experts e >= E read -inf
// for softmax, else 0, and get key 0, "not a candidate"), the pre function in route_warp's order
// (softmax: max of the finite logits, exp into the canonical partials (e / 4) % 32, the butterfly
// over them, which here is the in-register butterfly over the kE / 4 nonzero partials, the
// exact division), the selection keys of canonical(p + bias), then a sorted buffer of the best
// kK (key, expert) pairs, filled in ascending expert order with strict comparisons so that equal
// keys keep the lower expert first: (key desc, expert asc), the oracle's order. p of a pick is
// its key's score, or recomputed from the logit where the key does not give it (bias; -0 with no
// pre function), as finish_row does; the post function sums in k order.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/launch.cuh"
#include "cuda/routing/route_warp.cuh"

namespace switchyard::cuda::routing {

// kRowsMaxExperts, kRowsMaxTopK and the launcher's choice (use_rows_kernel): route_plan.h.

__device__ __forceinline__ unsigned pack_bits(int x) { return static_cast<unsigned>(x); }
__device__ __forceinline__ unsigned pack_bits(float x) { return __float_as_uint(x); }

// Stores x[0 .. N) (N = 2, 4 or 8 four-byte values) at dst, aligned to min(4 N, 16) bytes, with 8- or
// 16-byte stores.
template <int N, typename T>
__device__ __forceinline__ void store_pack(T* dst, const T (&x)[N]) {
  static_assert(sizeof(T) == 4 && (N == 2 || N == 4 || N == 8), "pack of 2, 4 or 8 four-byte values");
  if constexpr (N == 2) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(pack_bits(x[0]), pack_bits(x[1]));
  } else {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      *reinterpret_cast<uint4*>(dst + i) =
          make_uint4(pack_bits(x[i]), pack_bits(x[i + 1]), pack_bits(x[i + 2]), pack_bits(x[i + 3]));
    }
  }
}

// Step 6 of a row routed in one thread: its K ids be and weights w (rank order). One or two 8- /
// 16-byte stores each for int32 ids and fp32 weights when K == kK and the arrays are aligned (a
// row's K values are then aligned too); else one store per value.
template <int kK>
__device__ __forceinline__ void store_thread_outputs(const RouteParams& p, std::int64_t row, int K,
                                                     const float (&w)[kK], const int (&be)[kK]) {
  using namespace dev;
  const std::int64_t out = row * K;
  constexpr unsigned kPackBytes = 4 * kK < 16 ? 4 * kK : 16;
  const auto aligned = [&](const void* ptr) {
    return ptr == nullptr || reinterpret_cast<std::uintptr_t>(ptr) % kPackBytes == 0;
  };
  if (K == kK && !p.ids_int64 && !p.weights_bf16 && aligned(p.topk_ids) && aligned(p.topk_weights)) {
    if (p.topk_ids != nullptr) store_pack<kK>(static_cast<std::int32_t*>(p.topk_ids) + out, be);
    if (p.topk_weights != nullptr) store_pack<kK>(static_cast<float*>(p.topk_weights) + out, w);
    return;
  }
#pragma unroll
  for (int k = 0; k < kK; ++k) {
    if (k >= K) break;  // uniform
    store_pick(p, out + k, be[k], w[k]);
  }
}

// Steps 5 (its second half) and 6 of a row routed in one thread (route_row_thread, route_staged.cuh):
// the weights of the picks from their p (finish_row's arithmetic, one thread holding every pick; the
// post function sums in k order), then the outputs. fin[k]: pick k < K has a finite selection score;
// pv[k]: its p; be: the picks' experts in rank order.
template <int kK>
__device__ __forceinline__ void store_thread_row(const RouteParams& p, std::int64_t row, int K,
                                                 const bool (&fin)[kK], const float (&pv)[kK],
                                                 const int (&be)[kK]) {
  using namespace dev;
  float w[kK];
  float term[kK];
  float sum = 0.0f;  // k order; a non-finite pick adds +0, which is exact (sum is never -0)
  if (p.post == PostFn::kSoftmax) {
    float m = neg_inf();
#pragma unroll
    for (int k = 0; k < kK; ++k) m = fin[k] ? fmaxf(m, pv[k]) : m;
#pragma unroll
    for (int k = 0; k < kK; ++k) {
      term[k] = fin[k] ? exp_any(__fadd_rn(pv[k], -m)) : 0.0f;
      sum = __fadd_rn(sum, term[k]);
    }
  } else if (p.post == PostFn::kNormalize) {
#pragma unroll
    for (int k = 0; k < kK; ++k) sum = __fadd_rn(sum, fin[k] ? pv[k] : 0.0f);
  }
  post_weights_from_sum<kK>(p.post, fin, pv, term, sum, p.scale, w);
  store_thread_outputs<kK>(p, row, K, w, be);
}

// Steps 5 and 6 of route_row_thread from the picks' keys bk and experts be (rank order): p of a pick
// is its key's score, or recomputed from the logit at row_ptr where the key does not give it (bias;
// -0 with no pre function); sm: the row's softmax constants (pre softmax only).
template <int kK>
__device__ __forceinline__ void finish_thread_row(const RouteParams& p, std::int64_t row, int K,
                                                  const std::uint32_t (&bk)[kK], const int (&be)[kK],
                                                  const void* row_ptr, const dev::SoftmaxRow& sm) {
  using namespace dev;
  bool fin[kK];
  float pv[kK];
#pragma unroll
  for (int k = 0; k < kK; ++k) {
    fin[k] = k < K && key_finite(bk[k]);
    pv[k] = key_score(bk[k]);
    const bool reload = p.bias != nullptr || (p.pre == PreFn::kNone && bk[k] == kZeroKey);
    if (fin[k] && reload) {
      const float s = load_one(row_ptr, p.logits_dtype, be[k]);
      pv[k] = p.pre == PreFn::kSoftmax ? softmax_pre(s, sm) : elementwise_pre(p.pre, s);
    }
  }
  store_thread_row<kK>(p, row, K, fin, pv, be);
}

// Routes row `row` (< p.num_tokens) of p in the calling thread. kE: experts held (a multiple of 4,
// E <= kE, kE / 4 a power of two); kK: buffer depth (K <= kK).
template <int kE, int kK>
__device__ __forceinline__ void route_row_thread(const RouteParams& p, std::int64_t row) {
  using namespace dev;
  static_assert(kE % 4 == 0 && ((kE / 4) & (kE / 4 - 1)) == 0 && kE / 4 <= 32,
                "kE / 4: a power of two <= 32");
  static_assert(kK >= 1 && kK <= kE, "buffer depth");
  constexpr int NP = kE / 4;  // nonzero softmax partials
  const int E = p.num_experts;
  const int K = p.top_k;
  const std::int64_t elem = p.logits_dtype == static_cast<int>(DType::kFloat32) ? 4 : 2;
  const void* row_ptr = static_cast<const char*>(p.logits) + row * p.row_stride * elem;

  // 1. The row. Absent experts are outside every softmax sum as -inf; for the other pre
  // functions 0 keeps the sigmoid's fast-path test true (their keys are cleared below).
  const float fill = p.pre == PreFn::kSoftmax ? neg_inf() : 0.0f;
  float v[kE];
#pragma unroll
  for (int i = 0; i < NP; ++i)
    load_chunk(row_ptr, p.logits_dtype, p.logits_vec, 4 * i, E, true, fill, &v[4 * i]);

  // 2. Pre-scores p (in v): route_warp's general code with W = 1 (the partials (e / 4) % 32 of the
  // canonical softmax layout are the NP accumulators; their butterfly is the oracle's, whose steps
  // past NP add zeros).
  const SoftmaxRow sm = pre_scores<1, NP>(p.pre, v);

  // 3. Selection keys of canonical(p (+ bias)); 0 past E.
  std::uint32_t key[kE];
  if (p.bias != nullptr) {
#pragma unroll
    for (int i = 0; i < NP; ++i) {
      float b[4];
      load_chunk(p.bias, p.bias_dtype, p.bias_vec, 4 * i, E, true, 0.0f, b);
#pragma unroll
      for (int c = 0; c < 4; ++c) key[4 * i + c] = canonical_key(__fadd_rn(v[4 * i + c], b[c]));
    }
  } else {
#pragma unroll
    for (int j = 0; j < kE; ++j) key[j] = canonical_key(v[j]);
  }
#pragma unroll
  for (int j = 0; j < kE; ++j) key[j] = j < E ? key[j] : 0u;

  // 4. Top-K: the best kK (key, expert) pairs, sorted. Every real key is >= score_key(-inf) > 0,
  // so the empty slots (key 0) fill first and an absent expert never enters.
  std::uint32_t bk[kK];
  int be[kK];
#pragma unroll
  for (int d = 0; d < kK; ++d) {
    bk[d] = 0u;
    be[d] = 0;
  }
  std::uint32_t unused_next = 0u;  // buffer_insert's largest key left out: not needed here
#pragma unroll
  for (int j = 0; j < kE; ++j) buffer_insert<kK>(bk, be, unused_next, key[j], j);

  // 5-6. Weights and outputs.
  finish_thread_row<kK>(p, row, K, bk, be, row_ptr, sm);
}

}  // namespace switchyard::cuda::routing
