// Element loads and stores of the CPU backend by run-time dtype (bf16, fp16, or else fp32), with
// common/numeric.h's conversions (those the CUDA kernels replicate bit for bit).
#pragma once

#include <cstdint>

#include "common/numeric.h"
#include "switchyard/tensor.h"

namespace switchyard::cpu {

inline float load_float(const void* base, DType dtype, std::int64_t i) {
  switch (dtype) {
    case DType::kBFloat16:
      return detail::bf16_to_float(static_cast<const std::uint16_t*>(base)[i]);
    case DType::kFloat16:
      return detail::fp16_to_float(static_cast<const std::uint16_t*>(base)[i]);
    default:
      return static_cast<const float*>(base)[i];
  }
}

inline void store_float(void* base, DType dtype, std::int64_t i, float v) {
  switch (dtype) {
    case DType::kBFloat16:
      static_cast<std::uint16_t*>(base)[i] = detail::float_to_bf16(v);
      break;
    case DType::kFloat16:
      static_cast<std::uint16_t*>(base)[i] = detail::float_to_fp16(v);
      break;
    default:
      static_cast<float*>(base)[i] = v;
  }
}

}  // namespace switchyard::cpu
