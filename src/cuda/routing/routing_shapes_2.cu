// Routing kernels of shape unit 2 (route_shapes.h); compiled with -fmad=false.
#define SY_ROUTE_SHAPE_UNIT 2
#include "cuda/routing/route_shapes_unit.cuh"
