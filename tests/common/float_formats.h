// 16-bit float formats for the tests, written independently of src/common/numeric.h (the
// library's conversions are what the tests check), and element access by dtype.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "common/test_data.h"
#include "switchyard/tensor.h"

namespace sy_test {

inline float fp16_value(std::uint16_t h) {
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  double v;
  if (exp == 0) {
    v = std::ldexp(static_cast<double>(mant), -24);
  } else if (exp == 31) {
    v = mant == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  } else {
    v = std::ldexp(1024.0 + mant, exp - 25);
  }
  return static_cast<float>((h & 0x8000) ? -v : v);
}

// Round to nearest even (std::nearbyint in the default rounding mode); NaN to a quiet NaN.
inline std::uint16_t fp16_bits(float f) {
  const std::uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (std::isnan(f)) return sign | 0x7e00;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return sign | 0x7c00;
  if (a < std::ldexp(1.0, -14)) {
    // Subnormal quantum 2^-24; a result of 1024 is the smallest normal, whose bits are 0x400.
    return sign | static_cast<std::uint16_t>(std::nearbyint(std::ldexp(a, 24)));
  }
  int e = std::ilogb(a);                             // 2^e <= a < 2^(e+1)
  double m = std::nearbyint(std::ldexp(a, 10 - e));  // in [1024, 2048]
  if (m == 2048.0) {
    m = 1024.0;
    ++e;
  }
  if (e > 15) return sign | 0x7c00;
  return sign | static_cast<std::uint16_t>(((e + 15) << 10) | (static_cast<int>(m) - 1024));
}

inline std::uint32_t f32_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Element i of a bf16 / fp16 / fp32 array as a float (NaN for other dtypes).
inline float load_as_float(switchyard::DType dtype, const void* base, std::int64_t i) {
  switch (dtype) {
    case switchyard::DType::kFloat32:
      return static_cast<const float*>(base)[i];
    case switchyard::DType::kBFloat16:
      return bf16_value(static_cast<const std::uint16_t*>(base)[i]);
    case switchyard::DType::kFloat16:
      return fp16_value(static_cast<const std::uint16_t*>(base)[i]);
    default:
      return std::numeric_limits<float>::quiet_NaN();
  }
}

}  // namespace sy_test
