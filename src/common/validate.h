// Argument checks of the C++ API layer. Each failure is an InvalidArgument whose message
// names the operation and the argument: "route: argument 'topk_ids': shape [19, 4], expected [19, 8]".
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "switchyard/status.h"
#include "switchyard/tensor.h"

namespace switchyard::detail {

enum class Contiguity {
  kRowStrided,  // last dim contiguous, any row stride >= row length (2-D)
  kContiguous,  // row-major contiguous
};

constexpr std::int64_t kAnySize = -1;

std::string shape_string(const TensorView& t);

class ArgChecker {
 public:
  explicit ArgChecker(const char* op) : op_(op) {}

  Status fail(const std::string& what) const;
  Status fail_arg(const char* name, const std::string& what) const;

  // A present tensor on `device` with one of `dtypes`, exactly `shape` (kAnySize matches any
  // extent), non-null data when it has elements, aligned to its element size.
  Status tensor(const TensorView& t, const char* name, std::initializer_list<DType> dtypes,
                std::initializer_list<std::int64_t> shape, Device device,
                Contiguity contiguity = Contiguity::kContiguous) const;

  // A present, contiguous 1-D int32 array on `device` with at least `min_len` elements.
  Status int32_array(const TensorView& t, const char* name, std::int64_t min_len,
                     Device device) const;

  const char* op() const { return op_; }

 private:
  const char* op_;
};

}  // namespace switchyard::detail
