// Element types shared by the CUDA data-movement kernels (gather / combine, expert parallelism):
// raw vector types by size, and the float formats with conversions bit-identical to the CPU
// oracle's (common/numeric.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/numeric.h"
#include "switchyard/tensor.h"

namespace switchyard::cuda {

// An unsigned integer (or CUDA vector) type of exactly kBytes bytes, kBytes in 1..16.
template <int kBytes>
struct VecType;
template <>
struct VecType<16> {
  using type = uint4;
};
template <>
struct VecType<8> {
  using type = uint2;
};
template <>
struct VecType<4> {
  using type = unsigned int;
};
template <>
struct VecType<2> {
  using type = unsigned short;
};
template <>
struct VecType<1> {
  using type = unsigned char;
};

// Element formats: storage type and fp32 conversions, bit-identical to those of
// common/numeric.h that the CPU oracle uses. The hardware conversions (one cvt each) round to
// nearest even exactly like numeric.h for every non-NaN value; for NaN, numeric.h's quiet-NaN
// patterns are produced explicitly. fp16 -> fp32 by cvt is exact for every non-NaN half, and a
// NaN only ever reaches an fma or add here, whose NaN result does not depend on the payload.
struct Fp32Format {
  using Storage = float;
  static __device__ __forceinline__ float to_float(float v) { return v; }
  static __device__ __forceinline__ float from_float(float f) { return f; }
};
struct Bf16Format {
  using Storage = std::uint16_t;
  static __device__ __forceinline__ float to_float(std::uint16_t v) { return detail::bf16_to_float(v); }
  static __device__ __forceinline__ std::uint16_t from_float(float f) {
    const std::uint16_t rounded = __bfloat16_as_ushort(__float2bfloat16_rn(f));
    return f != f ? static_cast<std::uint16_t>((__float_as_uint(f) >> 16) | 0x40u) : rounded;
  }
};
struct Fp16Format {
  using Storage = std::uint16_t;
  static __device__ __forceinline__ float to_float(std::uint16_t v) {
    return __half2float(__ushort_as_half(v));
  }
  static __device__ __forceinline__ std::uint16_t from_float(float f) {
    const std::uint16_t rounded = __half_as_ushort(__float2half_rn(f));
    return f != f ? static_cast<std::uint16_t>(((__float_as_uint(f) >> 16) & 0x8000u) | 0x7e00u) : rounded;
  }
};

// Calls fn(Format{}) for a bf16 / fp16 / fp32 dtype and returns true; false for any other.
template <typename Fn>
bool with_float_format(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32:
      fn(Fp32Format{});
      return true;
    case DType::kBFloat16:
      fn(Bf16Format{});
      return true;
    case DType::kFloat16:
      fn(Fp16Format{});
      return true;
    default:
      return false;
  }
}

}  // namespace switchyard::cuda
