// Printable names of the routing enums, for test traces, and a RoutingConfig builder.
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

inline switchyard::RoutingConfig make_config(int E, int K, switchyard::PreFn pre, switchyard::PostFn post,
                                             float scale = 1.0f,
                                             switchyard::GroupRule rule = switchyard::GroupRule::kNone,
                                             int n_group = 1, int topk_group = 1) {
  switchyard::RoutingConfig c;
  c.num_experts = E;
  c.top_k = K;
  c.pre = pre;
  c.post = post;
  c.scale = scale;
  c.group_rule = rule;
  c.n_group = n_group;
  c.topk_group = topk_group;
  return c;
}

}  // namespace sy_test
