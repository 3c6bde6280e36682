#include "switchyard/tensor.h"

#include "switchyard/status.h"
#include "switchyard/version.h"

namespace switchyard {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kBFloat16: return 2;
    case DType::kFloat16: return 2;
    case DType::kFloat8E4M3: return 1;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "fp32";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat16: return "fp16";
    case DType::kFloat8E4M3: return "fp8_e4m3";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
  }
  return "invalid";
}

TensorView TensorView::of(const void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                          Device device) {
  TensorView t;
  t.data = const_cast<void*>(data);
  t.dtype = dtype;
  t.device = device;
  t.ndim = static_cast<int>(shape.size() > kMaxDims ? kMaxDims : shape.size());
  int d = 0;
  for (std::int64_t v : shape) {
    if (d == kMaxDims) break;
    t.shape[d++] = v;
  }
  std::int64_t stride = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.strides[i] = stride;
    stride *= t.shape[i];
  }
  return t;
}

TensorView TensorView::with_row_stride(std::int64_t row_stride) const {
  TensorView t = *this;
  if (t.ndim >= 2) t.strides[0] = row_stride;
  return t;
}

std::int64_t TensorView::numel() const {
  if (ndim == 0) return data == nullptr ? 0 : 1;
  std::int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  std::int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != stride) return false;
    stride *= shape[d];
  }
  return true;
}

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "Ok";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kUnsupported: return "Unsupported";
    case StatusCode::kCudaError: return "CudaError";
    case StatusCode::kInternal: return "Internal";
    case StatusCode::kTimeout: return "Timeout";
  }
  return "Unknown";
}

std::string Status::to_string() const {
  if (ok()) return "Ok";
  return std::string(status_code_name(code_)) + ": " + message_;
}

const char* version() { return "0.1.0"; }

bool built_with_cuda() {
#if defined(SWITCHYARD_WITH_CUDA)
  return true;
#else
  return false;
#endif
}

}  // namespace switchyard
