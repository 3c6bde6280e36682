// CPU route_backward (include/switchyard/routing.h): the oracle of the CUDA kernel, with the
// arithmetic of common/route_backward_math.h in the order the kernel uses.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/numeric.h"
#include "common/route_backward_math.h"
#include "common/routing_math.h"
#include "cpu/backend.h"
#include "cpu/elements.h"
#include "cpu/parallel.h"
#include "cpu/routing/routing_cpu.h"

namespace switchyard::cpu {

namespace {

std::int64_t load_id(const void* ids, DType dtype, std::int64_t i) {
  return dtype == DType::kInt64 ? static_cast<const std::int64_t*>(ids)[i] : static_cast<const std::int32_t*>(ids)[i];
}

}  // namespace

Status route_backward(const detail::RouteBackwardArgs& a) {
  const detail::RouteArgs& r = a.route;
  const RoutingConfig& c = r.config;
  const int E = c.num_experts, K = c.top_k;
  const bool softmax = c.pre == PreFn::kSoftmax;
  parallel_for(r.num_tokens, std::max<std::int64_t>(1, 4096 / E), [&](std::int64_t t0, std::int64_t t1) {
    std::vector<float> s(E), g(K), u(K), dg(K);
    std::vector<std::int64_t> id(K);
    std::vector<char> valid(K);
    for (std::int64_t t = t0; t < t1; ++t) {
      for (int e = 0; e < E; ++e) s[e] = load_float(r.logits, r.logits_dtype, t * r.logits_row_stride + e);
      float m = detail::neg_inf(), sum = 0.0f;
      if (softmax) canonical_softmax_terms(s.data(), E, &m, &sum);
      for (int k = 0; k < K; ++k) {
        id[k] = load_id(r.topk_ids, r.ids_dtype, t * K + k);
        bool ok = id[k] >= 0 && id[k] < E && detail::is_finite(s[id[k]]);
        if (ok && r.bias != nullptr) ok = detail::is_finite(load_float(r.bias, r.bias_dtype, id[k]));
        valid[k] = ok;
        g[k] = ok ? detail::pre_value(c.pre, s[id[k]], m, sum) : 0.0f;
        u[k] = ok ? load_float(r.topk_weights, r.weights_dtype, t * K + k) * c.scale : 0.0f;
      }
      detail::post_backward(
          c.post, K, [&](int k) { return g[k]; }, [&](int k) { return valid[k] != 0; }, [&](int k) { return u[k]; },
          [&](int k, float v) { dg[k] = v; });
      float cs = 0.0f;  // softmax: sum over the picks of p * dg, in k order
      if (softmax) {
        for (int k = 0; k < K; ++k)
          if (valid[k]) cs = cs + g[k] * dg[k];
      }
      // Every expert: no pick names it (dp = 0) ...
      for (int e = 0; e < E; ++e) {
        float v = 0.0f;
        if (softmax && detail::is_finite(s[e])) v = detail::pre_value(c.pre, s[e], m, sum) * (0.0f - cs);
        store_float(a.grad_logits, r.logits_dtype, t * E + e, detail::cuda_nan_if_nan(v));
      }
      // ... then the picked experts, dp = their picks' dg summed in k order.
      for (int k = 0; k < K; ++k) {
        if (!valid[k]) continue;
        float dp = 0.0f;
        bool first = true;
        for (int j = 0; j < K; ++j) {
          if (!valid[j] || id[j] != id[k]) continue;
          dp = first ? dg[j] : dp + dg[j];
          first = false;
        }
        const float v = softmax ? g[k] * (dp - cs) : detail::pre_backward_elementwise(c.pre, s[id[k]], g[k], dp);
        store_float(a.grad_logits, r.logits_dtype, t * E + id[k], detail::cuda_nan_if_nan(v));
      }
    }
  });
  return Status::Ok();
}

}  // namespace switchyard::cpu
