// The routing kernels of route_warp.cuh's row shapes compile in kShapeUnits translation units,
// routing_shapes_<unit>.cu, so that the build runs them in parallel: unit u instantiates
// plan_route_shape (route_shape_launch.cuh) for the shape indices [kShapeUnitFirst[u],
// kShapeUnitFirst[u + 1]) of kShapeTable, and shape_planner(index) finds it from routing.cu.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstddef>

#include "cuda/routing/route_warp.cuh"
#include "switchyard/status.h"

namespace switchyard::cuda::routing {

using ShapePlanner = Status (*)(const RouteParams&, const RouteChoice&, const DeviceProps&, RoutePlan*);
template <std::size_t N>
using ShapePlannerTable = std::array<ShapePlanner, N>;

// Units of about equal compile time: 75, 86, 92 and 66 kernels (the last ones widest).
inline constexpr int kShapeUnits = 4;
inline constexpr int kShapeUnitFirst[kShapeUnits + 1] = {0, 9, 15, 21, kNumShapes};

constexpr int shape_unit(int index) {
  int u = 0;
  while (u + 1 < kShapeUnits && index >= kShapeUnitFirst[u + 1]) ++u;
  return u;
}

// Entries of one shape type (the same W, S, D) share a unit: in two units, its kernels would be
// compiled twice.
constexpr bool shape_units_disjoint() {
  for (int i = 0; i < kNumShapes; ++i) {
    for (int j = i + 1; j < kNumShapes; ++j) {
      const ShapeEntry &a = kShapeTable[i], &b = kShapeTable[j];
      if (a.w == b.w && a.s == b.s && a.d == b.d && shape_unit(i) != shape_unit(j)) return false;
    }
  }
  return true;
}
static_assert(shape_units_disjoint(), "a row shape in two units");

// Unit kUnit's launcher of shape `index` (in its range); defined in routing_shapes_<kUnit>.cu.
template <int kUnit>
ShapePlanner unit_shape_planner(int index);
template <>
ShapePlanner unit_shape_planner<0>(int index);
template <>
ShapePlanner unit_shape_planner<1>(int index);
template <>
ShapePlanner unit_shape_planner<2>(int index);
template <>
ShapePlanner unit_shape_planner<3>(int index);
static_assert(kShapeUnits == 4, "one declaration above (and one routing_shapes_<unit>.cu) per unit");

inline ShapePlanner shape_planner(int index) {
  switch (shape_unit(index)) {
    case 0:
      return unit_shape_planner<0>(index);
    case 1:
      return unit_shape_planner<1>(index);
    case 2:
      return unit_shape_planner<2>(index);
    default:
      return unit_shape_planner<3>(index);
  }
}

}  // namespace switchyard::cuda::routing
