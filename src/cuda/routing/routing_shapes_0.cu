// Routing kernels of shape unit 0 (route_shapes.h); compiled with -fmad=false.
#define SY_ROUTE_SHAPE_UNIT 0
#include "cuda/routing/route_shapes_unit.cuh"
