#include "common/validate.h"

#include <cstdint>
#include <vector>

namespace switchyard::detail {

// Plain string building (no iostreams): the messages are built on error paths inside host
// processes such as Python interpreters, where locale-dependent stream code is one more thing
// that can differ between the libraries loaded.
std::string shape_string(const TensorView& t) {
  std::string s = "[";
  const int ndim = t.ndim < 0 ? 0 : (t.ndim > kMaxDims ? kMaxDims : t.ndim);
  for (int d = 0; d < ndim; ++d) s += (d ? ", " : "") + std::to_string(t.shape[d]);
  return s + "]";
}

namespace {

std::string shape_list(std::initializer_list<std::int64_t> shape) {
  std::string s = "[";
  int d = 0;
  for (std::int64_t v : shape) {
    s += (d++ ? ", " : "");
    s += v == kAnySize ? std::string("*") : std::to_string(v);
  }
  return s + "]";
}

std::string dtype_list(std::initializer_list<DType> dtypes) {
  std::string s;
  for (DType d : dtypes) s += (s.empty() ? "" : " or ") + std::string(dtype_name(d));
  return s;
}

std::string device_string(Device d) {
  return d.is_cuda() ? "cuda:" + std::to_string(d.index) : "cpu";
}

}  // namespace

Status ArgChecker::fail(const std::string& what) const {
  return Status::InvalidArgument(std::string(op_) + ": " + what);
}

Status ArgChecker::fail_arg(const char* name, const std::string& what) const {
  return Status::InvalidArgument(std::string(op_) + ": argument '" + name + "': " + what);
}

Status ArgChecker::tensor(const TensorView& t, const char* name, std::initializer_list<DType> dtypes,
                          std::initializer_list<std::int64_t> shape, Device device,
                          Contiguity contiguity) const {
  if (t.absent()) return fail_arg(name, "is required but absent");
  // Before anything reads shape[] or strides[]: both hold kMaxDims entries.
  if (t.ndim < 0 || t.ndim > kMaxDims) {
    return fail_arg(name,
                    "ndim " + std::to_string(t.ndim) + " is outside [0, " + std::to_string(kMaxDims) + "]");
  }
  bool dtype_ok = false;
  for (DType d : dtypes) dtype_ok = dtype_ok || d == t.dtype;
  if (!dtype_ok) {
    return fail_arg(name, std::string("dtype ") + dtype_name(t.dtype) + " is not supported, expected " +
                              dtype_list(dtypes));
  }
  bool shape_ok = t.ndim == static_cast<int>(shape.size());
  int d = 0;
  for (std::int64_t v : shape) {
    if (!shape_ok) break;
    shape_ok = (v == kAnySize ? t.shape[d] >= 0 : t.shape[d] == v);
    ++d;
  }
  if (!shape_ok) return fail_arg(name, "shape " + shape_string(t) + ", expected " + shape_list(shape));
  if (t.device != device) {
    return fail_arg(name, "is on " + device_string(t.device) + ", expected " + device_string(device) +
                              " like the other arguments");
  }
  if (t.numel() > 0 && t.data == nullptr) return fail_arg(name, "data pointer is null");
  if (reinterpret_cast<std::uintptr_t>(t.data) % dtype_size(t.dtype) != 0) {
    return fail_arg(name, "data pointer is not aligned to its " + std::to_string(dtype_size(t.dtype)) +
                              "-byte element size");
  }
  if (t.numel() > 0) {
    if (contiguity == Contiguity::kContiguous && !t.is_contiguous()) {
      return fail_arg(name, "must be contiguous");
    }
    if (contiguity == Contiguity::kRowStrided) {
      const bool last_ok = t.strides[t.ndim - 1] == 1 || t.shape[t.ndim - 1] == 1;
      const bool rows_ok = t.ndim < 2 || t.strides[0] >= t.shape[1] || t.shape[0] == 1;
      if (!last_ok || !rows_ok) {
        return fail_arg(name, "last dimension must be contiguous and the row stride at least the row length");
      }
    }
  }
  return Status::Ok();
}

Status ArgChecker::int32_array(const TensorView& t, const char* name, std::int64_t min_len,
                               Device device) const {
  SY_RETURN_IF_ERROR(tensor(t, name, {DType::kInt32}, {kAnySize}, device));
  if (t.shape[0] < min_len) {
    return fail_arg(name, "has " + std::to_string(t.shape[0]) + " elements, needs at least " +
                              std::to_string(min_len));
  }
  return Status::Ok();
}

}  // namespace switchyard::detail
