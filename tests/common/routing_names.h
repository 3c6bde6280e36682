// Printable names of the routing enums, for test traces.
#pragma once

#include "switchyard/routing.h"

namespace sy_test {

inline const char* pre_name(switchyard::PreFn f) {
  switch (f) {
    case switchyard::PreFn::kNone:
      return "none";
    case switchyard::PreFn::kSoftmax:
      return "softmax";
    case switchyard::PreFn::kSigmoid:
      return "sigmoid";
    case switchyard::PreFn::kSqrtSoftplus:
      return "sqrtsoftplus";
  }
  return "?";
}

inline const char* post_name(switchyard::PostFn f) {
  switch (f) {
    case switchyard::PostFn::kNone:
      return "none";
    case switchyard::PostFn::kSoftmax:
      return "softmax";
    case switchyard::PostFn::kSigmoid:
      return "sigmoid";
    case switchyard::PostFn::kNormalize:
      return "normalize";
  }
  return "?";
}

inline const char* rule_name(switchyard::GroupRule r) {
  switch (r) {
    case switchyard::GroupRule::kNone:
      return "none";
    case switchyard::GroupRule::kTop2Sum:
      return "top2_sum";
    case switchyard::GroupRule::kMax:
      return "max";
    case switchyard::GroupRule::kTopKSum:
      return "topk_sum";
  }
  return "?";
}

}  // namespace sy_test
