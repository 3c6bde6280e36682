// CUDA route_backward (include/switchyard/routing.h): one warp per row, the arithmetic of
// common/route_backward_math.h in the CPU oracle's order (compiled with -fmad=false), so that
// both give the same bits. A row is read twice (softmax: three times, through L1) and written
// once: every expert gets p * (0 - c) (softmax) or 0, then the picked experts are rewritten by
// the lanes holding their picks.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/numeric.h"
#include "common/route_backward_math.h"
#include "common/routing_math.h"
#include "cuda/backend.h"
#include "cuda/common/element_formats.cuh"
#include "cuda/common/launch.cuh"

namespace switchyard::cuda {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

struct Params {
  RoutingConfig config;
  std::int64_t num_tokens;
  const void* logits;
  std::int64_t row_stride;
  DType logits_dtype;
  const void* bias;
  DType bias_dtype;
  const void* ids;
  bool ids64;
  const void* grad_weights;
  bool weights_bf16;
  void* grad_logits;
};

__device__ __forceinline__ float load_float(const void* base, DType dtype, std::int64_t i) {
  if (dtype == DType::kBFloat16) return detail::bf16_to_float(static_cast<const std::uint16_t*>(base)[i]);
  if (dtype == DType::kFloat16) return detail::fp16_to_float(static_cast<const std::uint16_t*>(base)[i]);
  return static_cast<const float*>(base)[i];
}

__device__ __forceinline__ void store_float(void* base, DType dtype, std::int64_t i, float v) {
  if (dtype == DType::kBFloat16) {
    static_cast<std::uint16_t*>(base)[i] = Bf16Format::from_float(v);
  } else if (dtype == DType::kFloat16) {
    static_cast<std::uint16_t*>(base)[i] = Fp16Format::from_float(v);
  } else {
    static_cast<float*>(base)[i] = v;
  }
}

__global__ void __launch_bounds__(kThreads) route_backward_kernel(const Params p) {
  pdl_wait();
  pdl_launch_dependents();
  const RoutingConfig& c = p.config;
  const int E = c.num_experts, K = c.top_k;
  const bool softmax = c.pre == PreFn::kSoftmax;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // The picks of the warp's row, shared by its lanes (K <= kMaxGpuTopK = 32).
  __shared__ float g_sh[kWarps][kMaxGpuTopK], u_sh[kWarps][kMaxGpuTopK], dg_sh[kWarps][kMaxGpuTopK];
  __shared__ int id_sh[kWarps][kMaxGpuTopK];
  __shared__ bool valid_sh[kWarps][kMaxGpuTopK];
  for (std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kWarps + warp; t < p.num_tokens;
       t += static_cast<std::int64_t>(gridDim.x) * kWarps) {
    const std::int64_t row = t * p.row_stride;
    float m = detail::neg_inf(), sum = 0.0f;
    if (softmax) {
      for (int e = lane; e < E; e += 32) {
        const float s = load_float(p.logits, p.logits_dtype, row + e);
        if (detail::is_finite(s) && s > m) m = s;
      }
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      // The canonical denominator: this lane's experts (e / 4) % 32 == lane, ascending, then
      // the butterfly.
      float part = 0.0f;
      for (int base = 4 * lane; base < E; base += 4 * 32) {
        for (int i = 0; i < 4 && base + i < E; ++i) {
          const float s = load_float(p.logits, p.logits_dtype, row + base + i);
          if (detail::is_finite(s)) part += detail::exp_f32(s - m);
        }
      }
      for (int o = 16; o > 0; o >>= 1) part = part + __shfl_xor_sync(0xffffffffu, part, o);
      sum = part;
    }
    if (lane < K) {
      const std::int64_t id = p.ids64 ? static_cast<const std::int64_t*>(p.ids)[t * K + lane]
                                      : static_cast<const std::int32_t*>(p.ids)[t * K + lane];
      bool ok = id >= 0 && id < E;
      const float s = ok ? load_float(p.logits, p.logits_dtype, row + id) : 0.0f;
      ok = ok && detail::is_finite(s);
      if (ok && p.bias != nullptr) ok = detail::is_finite(load_float(p.bias, p.bias_dtype, id));
      const std::int64_t x = t * K + lane;
      const float gw = p.weights_bf16 ? detail::bf16_to_float(static_cast<const std::uint16_t*>(p.grad_weights)[x])
                                      : static_cast<const float*>(p.grad_weights)[x];
      valid_sh[warp][lane] = ok;
      id_sh[warp][lane] = ok ? static_cast<int>(id) : -1;
      g_sh[warp][lane] = ok ? detail::pre_value(c.pre, s, m, sum) : 0.0f;
      u_sh[warp][lane] = ok ? gw * c.scale : 0.0f;
    }
    __syncwarp();
    // Every lane runs the post backward over the K picks (the same sums in k order); lane 0 stores.
    detail::post_backward(
        c.post, K, [&](int k) { return g_sh[warp][k]; }, [&](int k) { return valid_sh[warp][k]; },
        [&](int k) { return u_sh[warp][k]; },
        [&](int k, float v) {
          if (lane == 0) dg_sh[warp][k] = v;
        });
    __syncwarp();
    float cs = 0.0f;
    if (softmax) {
      for (int k = 0; k < K; ++k)
        if (valid_sh[warp][k]) cs = cs + g_sh[warp][k] * dg_sh[warp][k];
    }
    for (int e = lane; e < E; e += 32) {
      float v = 0.0f;
      if (softmax) {
        const float s = load_float(p.logits, p.logits_dtype, row + e);
        if (detail::is_finite(s)) v = detail::pre_value(c.pre, s, m, sum) * (0.0f - cs);
      }
      store_float(p.grad_logits, p.logits_dtype, t * E + e, v);
    }
    __syncwarp();
    if (lane < K && valid_sh[warp][lane]) {
      const int id = id_sh[warp][lane];
      float dp = 0.0f;
      bool first = true;
      for (int j = 0; j < K; ++j) {
        if (!valid_sh[warp][j] || id_sh[warp][j] != id) continue;
        dp = first ? dg_sh[warp][j] : dp + dg_sh[warp][j];
        first = false;
      }
      const float gk = g_sh[warp][lane];
      const float v = softmax ? gk * (dp - cs)
                              : detail::pre_backward_elementwise(c.pre, load_float(p.logits, p.logits_dtype, row + id),
                                                                 gk, dp);
      store_float(p.grad_logits, p.logits_dtype, t * E + id, v);
    }
    __syncwarp();
  }
}

}  // namespace

Status route_backward(const detail::RouteBackwardArgs& a, Stream stream) {
  const detail::RouteArgs& r = a.route;
  Params p;
  p.config = r.config;
  p.num_tokens = r.num_tokens;
  p.logits = r.logits;
  p.row_stride = r.logits_row_stride;
  p.logits_dtype = r.logits_dtype;
  p.bias = r.bias;
  p.bias_dtype = r.bias_dtype;
  p.ids = r.topk_ids;
  p.ids64 = r.ids_dtype == DType::kInt64;
  p.grad_weights = r.topk_weights;
  p.weights_bf16 = r.weights_dtype == DType::kBFloat16;
  p.grad_logits = a.grad_logits;
  int sms = 0;
  SY_RETURN_IF_ERROR(current_sm_count("route_backward", &sms));
  const std::int64_t blocks_needed = (r.num_tokens + kWarps - 1) / kWarps;
  const std::int64_t blocks = blocks_needed < 16 * static_cast<std::int64_t>(sms) ? blocks_needed : 16 * sms;
  const Status status = launch_kernel("route_backward", route_backward_kernel, dim3(static_cast<unsigned>(blocks)),
                                      dim3(kThreads), 0, stream, /*pdl=*/true, p);
  if (!status.ok()) cudaGetLastError();
  return status;
}

}  // namespace switchyard::cuda
