// An environment variable set for a scope (the libraries' testing knobs, e.g. SWITCHYARD_LAYOUT_PATH
// and SWITCHYARD_ROUTE_WIDE_PACKED, are read on every call), restored to its previous state after.
#pragma once

#include <cstdlib>
#include <string>

namespace sy_test {

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_) {
      setenv(name_.c_str(), old_.c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  bool had_ = false;
  std::string old_;
};

}  // namespace sy_test
