// CPU gather and combine (docs/design.md section 4). combine's arithmetic is the contract the CUDA
// kernel replicates bit for bit: per output element, acc = fmaf(w, y, acc) over k in order
// starting from 0.0f, then `acc + out` when accumulating, then one round to nearest even.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/numeric.h"
#include "cpu/backend.h"
#include "cpu/parallel.h"

namespace switchyard::cpu {

namespace {

// Bytes (gather) or multiply-adds (combine) a thread should get before another one pays off.
constexpr std::int64_t kGatherBytesPerChunk = 1 << 18;
constexpr std::int64_t kCombineFmasPerChunk = 1 << 16;

// acc[h] = fmaf(w, y[h], acc[h]) over one row. An fma is exactly rounded however it runs, so
// the clone built for CPUs with the FMA instruction (chosen once, at load time) gives the bits
// of the portable clone, whose std::fmaf is a libm call, several times faster.
// ThreadSanitizer crashes at load time in ifunc resolvers, so its builds take the portable path.
#if defined(__SANITIZE_THREAD__)
#define SY_FMA_CLONES
#elif defined(__GNUC__) && defined(__x86_64__) && defined(__linux__)
#define SY_FMA_CLONES __attribute__((target_clones("fma", "default")))
#else
#define SY_FMA_CLONES
#endif

SY_FMA_CLONES void fma_row_fp32(float w, const float* y, float* acc, std::int64_t n) {
  for (std::int64_t h = 0; h < n; ++h) acc[h] = std::fmaf(w, y[h], acc[h]);
}
SY_FMA_CLONES void fma_row_bf16(float w, const std::uint16_t* y, float* acc, std::int64_t n) {
  for (std::int64_t h = 0; h < n; ++h) acc[h] = std::fmaf(w, detail::bf16_to_float(y[h]), acc[h]);
}
SY_FMA_CLONES void fma_row_fp16(float w, const std::uint16_t* y, float* acc, std::int64_t n) {
  for (std::int64_t h = 0; h < n; ++h) acc[h] = std::fmaf(w, detail::fp16_to_float(y[h]), acc[h]);
}

// Storage type, fp32 conversions and the row multiply-add of one floating dtype.
struct Fp32 {
  using Storage = float;
  static float load(float v) { return v; }
  static float store(float f) { return f; }
  static void fma_row(float w, const float* y, float* acc, std::int64_t n) { fma_row_fp32(w, y, acc, n); }
};
struct Bf16 {
  using Storage = std::uint16_t;
  static float load(std::uint16_t v) { return detail::bf16_to_float(v); }
  static std::uint16_t store(float f) { return detail::float_to_bf16(f); }
  static void fma_row(float w, const std::uint16_t* y, float* acc, std::int64_t n) {
    fma_row_bf16(w, y, acc, n);
  }
};
struct Fp16 {
  using Storage = std::uint16_t;
  static float load(std::uint16_t v) { return detail::fp16_to_float(v); }
  static std::uint16_t store(float f) { return detail::float_to_fp16(f); }
  static void fma_row(float w, const std::uint16_t* y, float* acc, std::int64_t n) {
    fma_row_fp16(w, y, acc, n);
  }
};

// Calls fn(Format{}) for a bf16 / fp16 / fp32 dtype; false for any other.
template <typename Fn>
bool with_float_format(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32:
      fn(Fp32{});
      return true;
    case DType::kBFloat16:
      fn(Bf16{});
      return true;
    case DType::kFloat16:
      fn(Fp16{});
      return true;
    default:
      return false;
  }
}

float load_weight(const void* weights, DType dtype, std::int64_t i) {
  if (weights == nullptr) return 1.0f;
  if (dtype == DType::kBFloat16) return detail::bf16_to_float(static_cast<const std::uint16_t*>(weights)[i]);
  return static_cast<const float*>(weights)[i];
}

template <typename YFormat, typename OutFormat>
void combine_impl(const detail::CombineArgs& a) {
  using Y = typename YFormat::Storage;
  using Out = typename OutFormat::Storage;
  const Y* y = static_cast<const Y*>(a.y_perm);
  Out* out = static_cast<Out*>(a.out);
  const std::int64_t H = a.hidden;
  const std::int64_t K = a.top_k;
  const std::int64_t grain =
      std::max<std::int64_t>(1, kCombineFmasPerChunk / std::max<std::int64_t>(1, H * K));
  parallel_for(a.num_tokens, grain, [&](std::int64_t t0, std::int64_t t1) {
    // One fp32 accumulator per column; each column sees exactly the operation sequence of the
    // contract, only the loop over columns is hoisted inside the loop over k.
    std::vector<float> acc(static_cast<std::size_t>(H));
    for (std::int64_t t = t0; t < t1; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (std::int64_t k = 0; k < K; ++k) {
        const std::int64_t r = a.expanded_to_permuted[t * K + k];
        if (r < 0 || r >= a.capacity_rows) continue;  // not placed
        const float w = load_weight(a.topk_weights, a.weights_dtype, t * K + k);
        YFormat::fma_row(w, y + r * a.y_row_stride, acc.data(), H);
      }
      Out* out_row = out + t * H;
      if (a.accumulate) {
        for (std::int64_t h = 0; h < H; ++h) {
          out_row[h] = OutFormat::store(detail::cuda_nan_if_nan(acc[h] + OutFormat::load(out_row[h])));
        }
      } else {
        for (std::int64_t h = 0; h < H; ++h) out_row[h] = OutFormat::store(detail::cuda_nan_if_nan(acc[h]));
      }
    }
  });
}

template <typename GFormat, typename YFormat, typename DyFormat>
void combine_backward_impl(const detail::CombineBackwardArgs& a) {
  using G = typename GFormat::Storage;
  using Y = typename YFormat::Storage;
  using Dy = typename DyFormat::Storage;
  const G* g = static_cast<const G*>(a.grad_out);
  const Y* y = static_cast<const Y*>(a.y_perm);
  Dy* dy = static_cast<Dy*>(a.grad_y_perm);
  const std::int64_t H = a.hidden;
  const std::int64_t K = a.top_k;
  const std::int64_t R = a.capacity_rows;
  if (dy != nullptr) {
    // Rows that hold no pick: padding and unused rows.
    parallel_for(R, std::max<std::int64_t>(1, kGatherBytesPerChunk / std::max<std::int64_t>(1, H)),
                 [&](std::int64_t p0, std::int64_t p1) {
                   for (std::int64_t p = p0; p < p1; ++p) {
                     const std::int64_t t = a.permuted_to_token[p];
                     if (t < 0 || t >= a.num_tokens) std::fill(dy + p * H, dy + (p + 1) * H, DyFormat::store(0.0f));
                   }
                 });
  }
  const std::int64_t grain = std::max<std::int64_t>(1, kCombineFmasPerChunk / std::max<std::int64_t>(1, H * K));
  parallel_for(a.num_tokens, grain, [&](std::int64_t t0, std::int64_t t1) {
    std::vector<float> grad(static_cast<std::size_t>(H));
    for (std::int64_t t = t0; t < t1; ++t) {
      for (std::int64_t h = 0; h < H; ++h) grad[h] = GFormat::load(g[t * a.grad_out_row_stride + h]);
      for (std::int64_t k = 0; k < K; ++k) {
        const std::int64_t r = a.expanded_to_permuted[t * K + k];
        const bool placed = r >= 0 && r < R;
        if (placed && dy != nullptr) {
          const float w = load_weight(a.topk_weights, a.weights_dtype, t * K + k);
          for (std::int64_t h = 0; h < H; ++h) dy[r * H + h] = DyFormat::store(detail::cuda_nan_if_nan(w * grad[h]));
        }
        if (a.grad_weights != nullptr) {
          float dot = 0.0f;
          if (placed) {
            for (std::int64_t h = 0; h < H; ++h) {
              dot = std::fmaf(grad[h], YFormat::load(y[r * a.y_row_stride + h]), dot);
            }
          }
          a.grad_weights[t * K + k] = detail::cuda_nan_if_nan(dot);
        }
      }
    }
  });
}

}  // namespace

Status combine_backward(const detail::CombineBackwardArgs& a) {
  bool dispatched = false;
  // Without grad_weights, y is not read: any format stands in for it.
  const DType y_dtype = a.grad_weights != nullptr ? a.y_dtype : DType::kFloat32;
  const DType dy_dtype = a.grad_y_perm != nullptr ? a.grad_y_dtype : DType::kFloat32;
  with_float_format(a.grad_out_dtype, [&](auto gf) {
    with_float_format(y_dtype, [&](auto yf) {
      with_float_format(dy_dtype, [&](auto df) {
        combine_backward_impl<decltype(gf), decltype(yf), decltype(df)>(a);
        dispatched = true;
      });
    });
  });
  if (!dispatched) return Status::Internal("combine_backward: CPU backend reached with an invalid dtype");
  return Status::Ok();
}

Status gather(const detail::GatherArgs& a) {
  const std::size_t elem = dtype_size(a.dtype);
  if (elem == 0) return Status::Internal("gather: CPU backend reached with an invalid dtype");
  const std::size_t row_bytes = static_cast<std::size_t>(a.hidden) * elem;
  const std::size_t scale_bytes = static_cast<std::size_t>(a.scale_cols) * sizeof(float);
  const bool has_scales = a.scale_cols > 0 && a.x_scales != nullptr && a.x_perm_scales != nullptr;
  // totals lives in caller memory; a corrupted value must not send us past the buffers.
  const std::int64_t rows = std::clamp<std::int64_t>(a.totals[kPaddedTotal], 0, a.capacity_rows);
  const auto* x = static_cast<const unsigned char*>(a.x);
  auto* x_perm = static_cast<unsigned char*>(a.x_perm);
  const std::int64_t grain = std::max<std::int64_t>(
      1, kGatherBytesPerChunk / static_cast<std::int64_t>(std::max<std::size_t>(1, row_bytes)));
  parallel_for(rows, grain, [&](std::int64_t p0, std::int64_t p1) {
    for (std::int64_t p = p0; p < p1; ++p) {
      const std::int64_t token = a.permuted_to_token[p];
      unsigned char* dst = x_perm + static_cast<std::size_t>(p) * row_bytes;
      float* dst_scales = has_scales ? a.x_perm_scales + p * a.scale_cols : nullptr;
      if (token >= 0 && token < a.num_tokens) {
        std::memcpy(dst, x + static_cast<std::size_t>(token * a.x_row_stride) * elem, row_bytes);
        if (has_scales) std::memcpy(dst_scales, a.x_scales + token * a.scale_cols, scale_bytes);
      } else if (a.zero_fill_padding) {
        std::memset(dst, 0, row_bytes);
        if (has_scales) std::memset(dst_scales, 0, scale_bytes);
      }
    }
  });
  return Status::Ok();
}

Status combine(const detail::CombineArgs& a) {
  if (a.topk_weights != nullptr && a.weights_dtype != DType::kFloat32 &&
      a.weights_dtype != DType::kBFloat16) {
    return Status::Internal("combine: CPU backend reached with weights dtype " +
                            std::string(dtype_name(a.weights_dtype)));
  }
  bool dispatched = false;
  const bool y_ok = with_float_format(a.y_dtype, [&](auto y_format) {
    dispatched = with_float_format(
        a.out_dtype, [&](auto out_format) { combine_impl<decltype(y_format), decltype(out_format)>(a); });
  });
  if (!y_ok || !dispatched) {
    return Status::Internal("combine: CPU backend reached with y dtype " +
                            std::string(dtype_name(a.y_dtype)) + " and out dtype " +
                            std::string(dtype_name(a.out_dtype)));
  }
  return Status::Ok();
}

}  // namespace switchyard::cpu
