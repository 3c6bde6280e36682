// Sorting networks on 32-bit keys, descending, shared by the staged routing kernels
// (cuda/routing/route_staged.cuh) and the CPU test that checks them (tests/routing/routing_cpu_test.cpp:
// every 0-1 input, by the 0-1 principle, and random keys with ties). The networks are textbook ones: the
// 19-comparator sorter of 8 inputs (Knuth, TAOCP vol. 3, section 5.3.4) and Batcher's bitonic merge;
// keeping the losers' maximum as the largest key left out is ours.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace switchyard::detail {

SY_HD std::uint32_t umax32(std::uint32_t a, std::uint32_t b) {
#if defined(__CUDA_ARCH__)
  return max(a, b);
#else
  return a > b ? a : b;
#endif
}
SY_HD std::uint32_t umin32(std::uint32_t a, std::uint32_t b) {
#if defined(__CUDA_ARCH__)
  return min(a, b);
#else
  return a < b ? a : b;
#endif
}

// Descending compare-exchange.
SY_HD void cx(std::uint32_t& a, std::uint32_t& b) {
  const std::uint32_t hi = umax32(a, b);
  b = umin32(a, b);
  a = hi;
}

// x[0 .. 8) sorted descending: the 19-comparator network.
SY_HD void sort8(std::uint32_t* x) {
  cx(x[0], x[2]), cx(x[1], x[3]), cx(x[4], x[6]), cx(x[5], x[7]);
  cx(x[0], x[4]), cx(x[1], x[5]), cx(x[2], x[6]), cx(x[3], x[7]);
  cx(x[0], x[1]), cx(x[2], x[3]), cx(x[4], x[5]), cx(x[6], x[7]);
  cx(x[2], x[4]), cx(x[3], x[5]);
  cx(x[1], x[4]), cx(x[3], x[6]);
  cx(x[1], x[2]), cx(x[3], x[4]), cx(x[5], x[6]);
}

// a := the top 8 of a and b (both sorted descending), sorted; na := the largest key of both left out
// (na, nb: those left out of a and b before). max(a[i], b[7 - i]) is bitonic; the rest are the losers.
SY_HD void merge8(std::uint32_t* a, std::uint32_t& na, const std::uint32_t* b, std::uint32_t nb) {
  std::uint32_t lo[8];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < 8; ++i) {
    lo[i] = umin32(a[i], b[7 - i]);
    a[i] = umax32(a[i], b[7 - i]);
  }
  na = umax32(umax32(umax32(na, nb), umax32(umax32(lo[0], lo[1]), umax32(lo[2], lo[3]))),
              umax32(umax32(lo[4], lo[5]), umax32(lo[6], lo[7])));
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < 4; ++i) cx(a[i], a[i + 4]);
  cx(a[0], a[2]), cx(a[1], a[3]), cx(a[4], a[6]), cx(a[5], a[7]);
  cx(a[0], a[1]), cx(a[2], a[3]), cx(a[4], a[5]), cx(a[6], a[7]);
}

// Descending compare-exchange of a and b that moves a value with each key (keys distinct).
SY_HD void cx_carry(std::uint32_t& a, std::uint32_t& av, std::uint32_t& b, std::uint32_t& bv) {
  const bool swap = b > a;
  const std::uint32_t t = a, tv = av;
  a = swap ? b : a;
  av = swap ? bv : av;
  b = swap ? t : b;
  bv = swap ? tv : bv;
}

// merge8 with a 32-bit value carried by each key (av[i] belongs to a[i], bv[i] to b[i]; keys distinct):
// a, av := the top 8 of a and b and their values; na as merge8's (a key only).
SY_HD void merge8_carry(std::uint32_t* a, std::uint32_t* av, std::uint32_t& na, const std::uint32_t* b,
                        const std::uint32_t* bv, std::uint32_t nb) {
  std::uint32_t lo[8];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < 8; ++i) {
    const bool take = b[7 - i] > a[i];
    lo[i] = take ? a[i] : b[7 - i];
    a[i] = take ? b[7 - i] : a[i];
    av[i] = take ? bv[7 - i] : av[i];
  }
  na = umax32(umax32(umax32(na, nb), umax32(umax32(lo[0], lo[1]), umax32(lo[2], lo[3]))),
              umax32(umax32(lo[4], lo[5]), umax32(lo[6], lo[7])));
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < 4; ++i) cx_carry(a[i], av[i], a[i + 4], av[i + 4]);
  cx_carry(a[0], av[0], a[2], av[2]), cx_carry(a[1], av[1], a[3], av[3]);
  cx_carry(a[4], av[4], a[6], av[6]), cx_carry(a[5], av[5], a[7], av[7]);
  cx_carry(a[0], av[0], a[1], av[1]), cx_carry(a[2], av[2], a[3], av[3]);
  cx_carry(a[4], av[4], a[5], av[5]), cx_carry(a[6], av[6], a[7], av[7]);
}

}  // namespace switchyard::detail
