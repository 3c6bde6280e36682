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
// bits run to run and on every backend. A token with no placed pick gets acc = 0.
//   y_perm       [R,H] bf16, fp16 or fp32; any row stride >= H; R >= the layout's capacity
//                (rows of layout.permuted_to_token).
//   layout       a Layout filled by layout(); uses expanded_to_permuted [T,K].
//   topk_weights optional [T,K] fp32 or bf16, contiguous.
//   out          [T,H] bf16, fp16 or fp32, contiguous; read too when `accumulate`.
Status combine(const TensorView& y_perm, const Layout& layout, const TensorView& topk_weights,
               const TensorView& out, bool accumulate = false, Stream stream = nullptr);

}  // namespace switchyard
