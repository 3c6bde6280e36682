// Bit-exact conversions between fp32 and the 16-bit float formats, round to nearest even,
// identical on host and device.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/host_device.h"

namespace switchyard::detail {

SY_HD std::uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

SY_HD float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

SY_HD float bf16_to_float(std::uint16_t h) { return bits_float(static_cast<std::uint32_t>(h) << 16); }

// The NaN that CUDA's fp32 add, multiply and fma return for any NaN operand (0x7fffffff, PTX ISA).
// The CPU oracle maps its arithmetic results to it, so that both backends store the same bits
// (x86 instead keeps the first NaN operand's payload).
SY_HD float cuda_nan_if_nan(float f) { return f != f ? bits_float(0x7fffffffu) : f; }

SY_HD std::uint16_t float_to_bf16(float f) {
  std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

SY_HD float fp16_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // zero or subnormal: mant * 2^-24, exact in fp32
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return bits_float(float_bits(mag) | sign);
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (mant << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

SY_HD std::uint16_t float_to_fp16(float f) {
  std::uint32_t x = float_bits(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  std::uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);  // NaN
  if (ax >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (ax >= 0x38800000u) {  // normal half
    const std::uint32_t mant_odd = (ax >> 13) & 1u;
    ax += 0xc8000fffu + mant_odd;  // rebias exponent by -112 and round to nearest even
    return static_cast<std::uint16_t>(sign | (ax >> 13));
  }
  // Subnormal half or zero: adding 0.5 lines the half's last mantissa bit up with fp32's,
  // so the hardware's round-to-nearest-even does the rounding (idea: F. Giesen's
  // float_to_half_fast3_rtne).
  const float v = bits_float(ax) + 0.5f;
  return static_cast<std::uint16_t>(sign | (float_bits(v) - 0x3f000000u));
}

}  // namespace switchyard::detail
