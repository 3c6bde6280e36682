// Gather and combine: move hidden states into the Layout and reduce expert outputs back per
// token. docs/design.md section 4.
#pragma once

#include "switchyard/layout.h"
#include "switchyard/status.h"
#include "switchyard/tensor.h"

namespace switchyard {

// Columns per scale group for fp8 rows scaled per 128-column group.
constexpr int kScaleGroupSize = 128;

// gather: x_perm[p] = x[permuted_to_token[p]] for every row p < padded_total holding a
// token. Padding rows (permuted_to_token == T) are zero-filled, scales included, when
// `zero_fill_padding`; otherwise left untouched. Rows >= padded_total are never written.
//   x             [T,H] bf16, fp16, fp32 or fp8 e4m3; any row stride >= H.
//   x_scales      optional fp32 scales moved with each row: [T] or [T,1] (per token) or
//                 [T, ceil(H/128)] (per 128-column group); contiguous.
//   layout        a Layout filled by layout(); uses permuted_to_token and totals, and
//                 expanded_to_permuted when present ([T,K]: the CUDA backend then reads each
//                 token row once and writes all its copies; same output).
//   x_perm        [R,H], dtype of x, contiguous, R >= layout.permuted_to_token rows.
//   x_perm_scales [R] / [R,1] / [R,G] like x_scales; present iff x_scales is.
Status gather(const TensorView& x, const TensorView& x_scales, const Layout& layout,
              const TensorView& x_perm, const TensorView& x_perm_scales,
              bool zero_fill_padding = false, Stream stream = nullptr);

// combine: out[t] = cast(acc + (accumulate ? out[t] : 0)), with
//   acc = sum over k = 0..K-1 with expanded_to_permuted[t,k] >= 0 of
//         w[t,k] * y_perm[expanded_to_permuted[t,k]]
// accumulated in fp32 in k order with fma (w = 1 when topk_weights is absent): the same
// bits run to run and on every backend (a NaN result is CUDA's 0x7fffffff on every backend).
// A token with no placed pick gets acc = 0.
//   y_perm       [R,H] bf16, fp16 or fp32; any row stride >= H; R >= the layout's capacity
//                (rows of layout.permuted_to_token).
//   layout       a Layout filled by layout(); uses expanded_to_permuted [T,K].
//   topk_weights optional [T,K] fp32 or bf16, contiguous.
//   out          [T,H] bf16, fp16 or fp32, contiguous; read too when `accumulate`.
Status combine(const TensorView& y_perm, const Layout& layout, const TensorView& topk_weights,
               const TensorView& out, bool accumulate = false, Stream stream = nullptr);

// combine_backward: combine's gradients from grad_out = d loss / d out (docs/design.md section 7).
//   grad_y_perm[p]   = cast(w[t,k] * grad_out[t]) (one fp32 product; w = 1 without topk_weights)
//                      for the row p = expanded_to_permuted[t,k] of each placed pick, and 0 on
//                      every other row p < R (padding and unused rows); rows >= R untouched.
//   grad_weights[t,k] = <grad_out[t], y_perm[p]>, an fp32 sum of fp32 products for a placed
//                      pick, 0 for the others. The CPU sums in column order with fma; the CUDA
//                      kernel in a fixed tree (the same bits run to run; within fp32 rounding of
//                      the sum of |products| of the CPU's).
// No atomics: every output element has one writer.
//   grad_out      [T,H] bf16, fp16 or fp32; any row stride >= H.
//   y_perm        [>= R, H] bf16, fp16 or fp32; any row stride >= H; needed with grad_weights.
//   layout        a Layout filled by layout(); uses expanded_to_permuted [T,K] and
//                 permuted_to_token [R] (combine's arrays; rows with a token outside [0, T)
//                 hold no pick).
//   topk_weights  optional [T,K] fp32 or bf16, contiguous (combine's weights).
//   grad_y_perm   optional [>= R, H] bf16, fp16 or fp32 (y_perm's dtype when both are given),
//                 contiguous.
//   grad_weights  optional [T,K] fp32, contiguous.
Status combine_backward(const TensorView& grad_out, const TensorView& y_perm, const Layout& layout,
                        const TensorView& topk_weights, const TensorView& grad_y_perm,
                        const TensorView& grad_weights, Stream stream = nullptr);

}  // namespace switchyard
