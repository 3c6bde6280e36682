// The body of routing_shapes_<unit>.cu: unit SY_ROUTE_SHAPE_UNIT's shape launchers (route_shapes.h).
#include <utility>

#include "cuda/routing/route_shape_launch.cuh"
#include "cuda/routing/route_shapes.h"

namespace switchyard::cuda::routing {

template <>
ShapePlanner unit_shape_planner<SY_ROUTE_SHAPE_UNIT>(int index) {
  constexpr int kFirst = kShapeUnitFirst[SY_ROUTE_SHAPE_UNIT];
  constexpr int kCount = kShapeUnitFirst[SY_ROUTE_SHAPE_UNIT + 1] - kFirst;
  static constexpr ShapePlannerTable<kCount> kPlanners =
      shape_planners<kFirst>(std::make_integer_sequence<int, kCount>{});
  return kPlanners[static_cast<std::size_t>(index - kFirst)];
}

}  // namespace switchyard::cuda::routing
