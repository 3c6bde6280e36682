// CUDA combine_backward (include/switchyard/permute.h, docs/design.md section 7): combine's
// gradients to the expert rows (a weighted gather of grad_out) and to the weights (fp32 dot
// products), in one pass over grad_out and the picked rows of y_perm. No atomics, no allocation,
// no host synchronization: graph-capturable.
//
// Blocks [0, T) take one token each: the block's threads stride over the row's column vectors,
// load grad_out once and, per pick, store the weighted row and accumulate the dot product; the
// dots are then reduced in a fixed tree (lanes by xor shuffles, then warps in order), so the
// result is the same run to run. Blocks [T, T + fill) zero the rows that hold no pick.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/backend.h"
#include "cuda/common/element_formats.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/permute/permute_kernels.cuh"

namespace switchyard::cuda {

namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kPicksPerPass = 8;    // picks whose dots a thread keeps in registers at once
constexpr int kFillRowsPerBlock = 32;

struct Params {
  std::int64_t num_tokens, hidden, capacity_rows;
  int top_k;
  const void* grad_out;
  std::int64_t grad_out_row_stride;  // elements
  const void* y;
  std::int64_t y_row_stride;  // elements
  const std::int32_t* expanded_to_permuted;
  const std::int32_t* permuted_to_token;
  const void* weights;
  bool weights_bf16;
  void* grad_y;
  float* grad_weights;
};

__device__ __forceinline__ float pick_weight(const Params& p, std::int64_t i) {
  if (p.weights == nullptr) return 1.0f;
  if (p.weights_bf16) return detail::bf16_to_float(static_cast<const std::uint16_t*>(p.weights)[i]);
  return static_cast<const float*>(p.weights)[i];
}

// GF: grad_out's format, YF: y_perm's and grad_y_perm's (the API has them equal); kV columns per
// vector (H % kV == 0 and every row start aligned to kV elements, or kV = 1).
template <typename GF, typename YF, int kV>
__global__ void __launch_bounds__(kThreads) combine_backward_kernel(const Params p) {
  using DF = YF;
  using G = typename GF::Storage;
  using Y = typename YF::Storage;
  using D = typename DF::Storage;
  pdl_wait();
  pdl_launch_dependents();
  const std::int64_t H = p.hidden;
  const std::int64_t vecs = H / kV;
  const int K = p.top_k;
  D* dy = static_cast<D*>(p.grad_y);
  if (blockIdx.x >= p.num_tokens) {
    // Zero-fill: each warp takes rows of this block's range that hold no pick.
    const std::int64_t first = (static_cast<std::int64_t>(blockIdx.x) - p.num_tokens) * kFillRowsPerBlock;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (std::int64_t r = first + warp; r < min(first + kFillRowsPerBlock, p.capacity_rows); r += kWarps) {
      const std::int64_t token = p.permuted_to_token[r];
      if (token >= 0 && token < p.num_tokens) continue;
      alignas(16) D zero[kV];
#pragma unroll
      for (int i = 0; i < kV; ++i) zero[i] = DF::from_float(0.0f);
      for (std::int64_t v = lane; v < vecs; v += 32) {
        permute::store_vector<kV * static_cast<int>(sizeof(D))>(dy + r * H + v * kV, zero);
      }
    }
    return;
  }
  const std::int64_t t = blockIdx.x;
  const G* g_row = static_cast<const G*>(p.grad_out) + t * p.grad_out_row_stride;
  const Y* y = static_cast<const Y*>(p.y);
  __shared__ float partial[kWarps][kPicksPerPass];
  for (int k0 = 0; k0 < K; k0 += kPicksPerPass) {
    std::int64_t row[kPicksPerPass];
    float w[kPicksPerPass];
    float dot[kPicksPerPass];
#pragma unroll
    for (int j = 0; j < kPicksPerPass; ++j) {
      const int k = k0 + j;
      const std::int64_t r = k < K ? p.expanded_to_permuted[t * K + k] : -1;
      row[j] = r >= 0 && r < p.capacity_rows ? r : -1;
      w[j] = row[j] >= 0 && dy != nullptr ? pick_weight(p, t * K + k) : 0.0f;
      dot[j] = 0.0f;
    }
    for (std::int64_t v = threadIdx.x; v < vecs; v += kThreads) {
      alignas(16) G gv[kV];
      permute::load_vector<kV * static_cast<int>(sizeof(G))>(gv, g_row + v * kV);
      float gf[kV];
#pragma unroll
      for (int i = 0; i < kV; ++i) gf[i] = GF::to_float(gv[i]);
#pragma unroll
      for (int j = 0; j < kPicksPerPass; ++j) {
        if (row[j] < 0) continue;
        if (dy != nullptr) {
          alignas(16) D out[kV];
#pragma unroll
          for (int i = 0; i < kV; ++i) out[i] = DF::from_float(__fmul_rn(w[j], gf[i]));
          permute::store_vector<kV * static_cast<int>(sizeof(D))>(dy + row[j] * H + v * kV, out);
        }
        if (p.grad_weights != nullptr) {
          alignas(16) Y yv[kV];
          permute::load_vector<kV * static_cast<int>(sizeof(Y))>(yv, y + row[j] * p.y_row_stride + v * kV);
#pragma unroll
          for (int i = 0; i < kV; ++i) dot[j] = __fmaf_rn(gf[i], YF::to_float(yv[i]), dot[j]);
        }
      }
    }
    if (p.grad_weights == nullptr) continue;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int j = 0; j < kPicksPerPass; ++j) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) dot[j] = __fadd_rn(dot[j], __shfl_xor_sync(0xffffffffu, dot[j], o));
      if (lane == 0) partial[warp][j] = dot[j];
    }
    __syncthreads();
    if (threadIdx.x < kPicksPerPass && k0 + static_cast<int>(threadIdx.x) < K) {
      const int j = threadIdx.x;
      float sum = partial[0][j];
#pragma unroll
      for (int i = 1; i < kWarps; ++i) sum = __fadd_rn(sum, partial[i][j]);
      p.grad_weights[t * K + k0 + j] = row[j] >= 0 ? sum : 0.0f;
    }
    __syncthreads();
  }
}

template <typename GF, typename YF>
Status launch_formats(const detail::CombineBackwardArgs& a, const Params& p, Stream stream) {
  auto aligned8 = [](const void* ptr, std::size_t elem, std::int64_t stride) {
    return reinterpret_cast<std::uintptr_t>(ptr) % (8 * elem) == 0 && stride % 8 == 0;
  };
  const bool vec8 = a.hidden % 8 == 0 &&
                    aligned8(a.grad_out, sizeof(typename GF::Storage), a.grad_out_row_stride) &&
                    (a.y_perm == nullptr || aligned8(a.y_perm, sizeof(typename YF::Storage), a.y_row_stride)) &&
                    (a.grad_y_perm == nullptr || aligned8(a.grad_y_perm, sizeof(typename YF::Storage), a.hidden));
  const std::int64_t fill = a.grad_y_perm != nullptr ? (a.capacity_rows + kFillRowsPerBlock - 1) / kFillRowsPerBlock : 0;
  const std::int64_t grid = a.num_tokens + fill;
  if (grid > 0x7fffffff) return Status::Unsupported("combine_backward: more than 2^31 - 1 blocks of work");
  if (grid == 0) return Status::Ok();
  auto kernel = vec8 ? combine_backward_kernel<GF, YF, 8> : combine_backward_kernel<GF, YF, 1>;
  const Status status = launch_kernel("combine_backward", kernel, dim3(static_cast<unsigned>(grid)), dim3(kThreads),
                                      0, stream, /*pdl=*/true, p);
  if (!status.ok()) cudaGetLastError();
  return status;
}

}  // namespace

Status combine_backward(const detail::CombineBackwardArgs& a, Stream stream) {
  Params p;
  p.num_tokens = a.num_tokens;
  p.hidden = a.hidden;
  p.capacity_rows = a.capacity_rows;
  p.top_k = a.top_k;
  p.grad_out = a.grad_out;
  p.grad_out_row_stride = a.grad_out_row_stride;
  p.y = a.y_perm;
  p.y_row_stride = a.y_row_stride;
  p.expanded_to_permuted = a.expanded_to_permuted;
  p.permuted_to_token = a.permuted_to_token;
  p.weights = a.topk_weights;
  p.weights_bf16 = a.weights_dtype == DType::kBFloat16;
  p.grad_y = a.grad_y_perm;
  p.grad_weights = a.grad_weights;
  // y_perm and grad_y_perm share one dtype (checked by the API) when both are given.
  const DType y_dtype = a.grad_weights != nullptr ? a.y_dtype : a.grad_y_dtype;
  Status status = Status::Internal("combine_backward: CUDA backend reached with an invalid dtype");
  with_float_format(a.grad_out_dtype, [&](auto gf) {
    with_float_format(y_dtype, [&](auto yf) { status = launch_formats<decltype(gf), decltype(yf)>(a, p, stream); });
  });
  return status;
}

}  // namespace switchyard::cuda
