// Public gather / combine API: validation and backend dispatch.
#include <cstdint>
#include <string>

#include "api/backend_dispatch.h"
#include "common/op_args.h"
#include "common/validate.h"
#include "cpu/backend.h"
#include "switchyard/permute.h"
#if defined(SWITCHYARD_WITH_CUDA)
#include "cuda/backend.h"
#endif

namespace switchyard {

namespace {

using detail::ArgChecker;
using detail::Contiguity;
using detail::kAnySize;

// Scale columns of a [T] / [T,1] / [T,G] scale tensor, or an error naming it.
Status scale_columns(const ArgChecker& check, const TensorView& s, const char* name, std::int64_t rows,
                     std::int64_t hidden, Device device, bool rows_at_least, std::int64_t* cols) {
  const std::int64_t groups = (hidden + kScaleGroupSize - 1) / kScaleGroupSize;
  if (s.ndim == 1) {
    SY_RETURN_IF_ERROR(check.tensor(s, name, {DType::kFloat32}, {kAnySize}, device));
    *cols = 1;
  } else {
    SY_RETURN_IF_ERROR(check.tensor(s, name, {DType::kFloat32}, {kAnySize, kAnySize}, device));
    *cols = s.shape[1];
    if (*cols != 1 && *cols != groups) {
      return check.fail_arg(name, "has " + std::to_string(*cols) + " columns; expected 1 (per token) or " +
                                      std::to_string(groups) + " (per 128-column group)");
    }
  }
  const bool rows_ok = rows_at_least ? s.shape[0] >= rows : s.shape[0] == rows;
  if (!rows_ok) {
    return check.fail_arg(name, "has " + std::to_string(s.shape[0]) + " rows, expected " +
                                    (rows_at_least ? "at least " : "") + std::to_string(rows));
  }
  return Status::Ok();
}

}  // namespace

Status gather(const TensorView& x, const TensorView& x_scales, const Layout& layout, const TensorView& x_perm,
              const TensorView& x_perm_scales, bool zero_fill_padding, Stream stream) {
  const ArgChecker check("gather");
  SY_RETURN_IF_ERROR(check.tensor(x, "x", {DType::kBFloat16, DType::kFloat16, DType::kFloat32, DType::kFloat8E4M3},
                                  {kAnySize, kAnySize}, x.device, Contiguity::kRowStrided));
  const Device device = x.device;
  const std::int64_t T = x.shape[0];
  const std::int64_t H = x.shape[1];
  SY_RETURN_IF_ERROR(check.int32_array(layout.permuted_to_token, "layout.permuted_to_token", 0, device));
  SY_RETURN_IF_ERROR(check.int32_array(layout.totals, "layout.totals", kNumTotals, device));
  const std::int64_t R = layout.permuted_to_token.shape[0];
  SY_RETURN_IF_ERROR(check.tensor(x_perm, "x_perm", {x.dtype}, {kAnySize, H}, device));
  if (x_perm.shape[0] < R) {
    return check.fail_arg("x_perm", "has " + std::to_string(x_perm.shape[0]) + " rows, fewer than the layout's " +
                                        std::to_string(R));
  }
  std::int64_t cols = 0;
  if (x_scales.absent() != x_perm_scales.absent()) {
    return check.fail_arg(x_scales.absent() ? "x_scales" : "x_perm_scales",
                          "x_scales and x_perm_scales must be given together");
  }
  if (!x_scales.absent()) {
    std::int64_t out_cols = 0;
    SY_RETURN_IF_ERROR(scale_columns(check, x_scales, "x_scales", T, H, device, false, &cols));
    SY_RETURN_IF_ERROR(scale_columns(check, x_perm_scales, "x_perm_scales", R, H, device, true, &out_cols));
    if (out_cols != cols) return check.fail_arg("x_perm_scales", "must have as many columns as x_scales");
  }
  SY_RETURN_IF_ERROR(detail::backend_available("gather", device));
  detail::GatherArgs args;
  args.num_tokens = T;
  args.hidden = H;
  args.dtype = x.dtype;
  args.x = x.data;
  args.x_row_stride = T > 1 ? x.strides[0] : H;
  args.x_scales = static_cast<const float*>(x_scales.data);
  args.scale_cols = cols;
  args.permuted_to_token = static_cast<const std::int32_t*>(layout.permuted_to_token.data);
  if (!layout.expanded_to_permuted.absent()) {
    SY_RETURN_IF_ERROR(check.tensor(layout.expanded_to_permuted, "layout.expanded_to_permuted", {DType::kInt32},
                                    {T, kAnySize}, device));
    args.expanded_to_permuted = static_cast<const std::int32_t*>(layout.expanded_to_permuted.data);
    args.top_k = static_cast<int>(layout.expanded_to_permuted.shape[1]);
  }
  args.totals = static_cast<const std::int32_t*>(layout.totals.data);
  args.capacity_rows = R;
  args.x_perm = x_perm.data;
  args.x_perm_scales = static_cast<float*>(x_perm_scales.data);
  args.zero_fill_padding = zero_fill_padding;
  if (R == 0 || H == 0) return Status::Ok();
#if defined(SWITCHYARD_WITH_CUDA)
  if (device.is_cuda()) return cuda::gather(args, stream);
#endif
  (void)stream;
  return cpu::gather(args);
}

Status combine(const TensorView& y_perm, const Layout& layout, const TensorView& topk_weights, const TensorView& out,
               bool accumulate, Stream stream) {
  const ArgChecker check("combine");
  SY_RETURN_IF_ERROR(check.tensor(y_perm, "y_perm", {DType::kBFloat16, DType::kFloat16, DType::kFloat32},
                                  {kAnySize, kAnySize}, y_perm.device, Contiguity::kRowStrided));
  const Device device = y_perm.device;
  const std::int64_t H = y_perm.shape[1];
  SY_RETURN_IF_ERROR(check.tensor(layout.expanded_to_permuted, "layout.expanded_to_permuted", {DType::kInt32},
                                  {kAnySize, kAnySize}, device));
  SY_RETURN_IF_ERROR(check.int32_array(layout.permuted_to_token, "layout.permuted_to_token", 0, device));
  const std::int64_t T = layout.expanded_to_permuted.shape[0];
  const std::int64_t K = layout.expanded_to_permuted.shape[1];
  const std::int64_t R = layout.permuted_to_token.shape[0];
  if (y_perm.shape[0] < R) {
    return check.fail_arg("y_perm", "has " + std::to_string(y_perm.shape[0]) + " rows, fewer than the layout's " +
                                        std::to_string(R));
  }
  if (!topk_weights.absent()) {
    SY_RETURN_IF_ERROR(check.tensor(topk_weights, "topk_weights", {DType::kFloat32, DType::kBFloat16}, {T, K}, device));
  }
  SY_RETURN_IF_ERROR(check.tensor(out, "out", {DType::kBFloat16, DType::kFloat16, DType::kFloat32}, {T, H}, device));
  SY_RETURN_IF_ERROR(detail::backend_available("combine", device));
  detail::CombineArgs args;
  args.num_tokens = T;
  args.top_k = static_cast<int>(K);
  args.hidden = H;
  args.y_perm = y_perm.data;
  args.y_dtype = y_perm.dtype;
  args.y_row_stride = y_perm.shape[0] > 1 ? y_perm.strides[0] : H;
  args.expanded_to_permuted = static_cast<const std::int32_t*>(layout.expanded_to_permuted.data);
  args.capacity_rows = R;
  args.topk_weights = topk_weights.absent() ? nullptr : topk_weights.data;
  args.weights_dtype = topk_weights.dtype;
  args.out = out.data;
  args.out_dtype = out.dtype;
  args.accumulate = accumulate;
  if (T == 0 || H == 0) return Status::Ok();
#if defined(SWITCHYARD_WITH_CUDA)
  if (device.is_cuda()) return cuda::combine(args, stream);
#endif
  (void)stream;
  return cpu::combine(args);
}

Status combine_backward(const TensorView& grad_out, const TensorView& y_perm, const Layout& layout,
                        const TensorView& topk_weights, const TensorView& grad_y_perm,
                        const TensorView& grad_weights, Stream stream) {
  const ArgChecker check("combine_backward");
  const std::initializer_list<DType> floats = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};
  SY_RETURN_IF_ERROR(
      check.tensor(grad_out, "grad_out", floats, {kAnySize, kAnySize}, grad_out.device, Contiguity::kRowStrided));
  const Device device = grad_out.device;
  const std::int64_t T = grad_out.shape[0];
  const std::int64_t H = grad_out.shape[1];
  SY_RETURN_IF_ERROR(check.tensor(layout.expanded_to_permuted, "layout.expanded_to_permuted", {DType::kInt32},
                                  {T, kAnySize}, device));
  SY_RETURN_IF_ERROR(check.int32_array(layout.permuted_to_token, "layout.permuted_to_token", 0, device));
  const std::int64_t K = layout.expanded_to_permuted.shape[1];
  const std::int64_t R = layout.permuted_to_token.shape[0];
  if (grad_y_perm.absent() && grad_weights.absent()) {
    return check.fail_arg("grad_y_perm", "and grad_weights are both absent: nothing to compute");
  }
  if (!topk_weights.absent()) {
    SY_RETURN_IF_ERROR(check.tensor(topk_weights, "topk_weights", {DType::kFloat32, DType::kBFloat16}, {T, K}, device));
  }
  if (!grad_y_perm.absent()) {
    SY_RETURN_IF_ERROR(check.tensor(grad_y_perm, "grad_y_perm", floats, {kAnySize, H}, device));
    if (grad_y_perm.shape[0] < R) {
      return check.fail_arg("grad_y_perm", "has " + std::to_string(grad_y_perm.shape[0]) +
                                               " rows, fewer than the layout's " + std::to_string(R));
    }
  }
  if (!grad_weights.absent()) {
    SY_RETURN_IF_ERROR(check.tensor(grad_weights, "grad_weights", {DType::kFloat32}, {T, K}, device));
    if (y_perm.absent()) return check.fail_arg("y_perm", "is needed for grad_weights");
    SY_RETURN_IF_ERROR(check.tensor(y_perm, "y_perm", floats, {kAnySize, H}, device, Contiguity::kRowStrided));
    if (y_perm.shape[0] < R) {
      return check.fail_arg("y_perm", "has " + std::to_string(y_perm.shape[0]) + " rows, fewer than the layout's " +
                                          std::to_string(R));
    }
  }
  if (!grad_y_perm.absent() && !grad_weights.absent() && grad_y_perm.dtype != y_perm.dtype) {
    return check.fail_arg("grad_y_perm", std::string("must have y_perm's dtype (") + dtype_name(y_perm.dtype) + ")");
  }
  SY_RETURN_IF_ERROR(detail::backend_available("combine_backward", device));
  detail::CombineBackwardArgs args;
  args.num_tokens = T;
  args.top_k = static_cast<int>(K);
  args.hidden = H;
  args.grad_out = grad_out.data;
  args.grad_out_dtype = grad_out.dtype;
  args.grad_out_row_stride = T > 1 ? grad_out.strides[0] : H;
  if (!grad_weights.absent()) {
    args.y_perm = y_perm.data;
    args.y_dtype = y_perm.dtype;
    args.y_row_stride = y_perm.shape[0] > 1 ? y_perm.strides[0] : H;
  }
  args.expanded_to_permuted = static_cast<const std::int32_t*>(layout.expanded_to_permuted.data);
  args.permuted_to_token = static_cast<const std::int32_t*>(layout.permuted_to_token.data);
  args.capacity_rows = R;
  args.topk_weights = topk_weights.absent() ? nullptr : topk_weights.data;
  args.weights_dtype = topk_weights.dtype;
  args.grad_y_perm = grad_y_perm.absent() ? nullptr : grad_y_perm.data;
  args.grad_y_dtype = grad_y_perm.absent() ? DType::kFloat32 : grad_y_perm.dtype;
  args.grad_weights = static_cast<float*>(grad_weights.data);
  if ((T == 0 || K == 0) && R == 0) return Status::Ok();
#if defined(SWITCHYARD_WITH_CUDA)
  if (device.is_cuda()) return cuda::combine_backward(args, stream);
#endif
  (void)stream;
  return cpu::combine_backward(args);
}

}  // namespace switchyard
