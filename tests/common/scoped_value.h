// A variable set for a scope and restored after: the tests' current kernel options
// (switchyard::RouteOptions / LayoutOptions fields), which their calls of the library pass.
#pragma once

#include <utility>

namespace sy_test {

template <typename T>
class ScopedValue {
 public:
  ScopedValue(T& target, T value) : target_(target), old_(std::move(target)) { target_ = std::move(value); }
  ~ScopedValue() { target_ = std::move(old_); }
  ScopedValue(const ScopedValue&) = delete;
  ScopedValue& operator=(const ScopedValue&) = delete;

 private:
  T& target_;
  T old_;
};

}  // namespace sy_test
