// Prints the routing kernels the plan reaches over route_plan_space.h's configurations, one
// signature a line (RoutePlan::name), sorted: tools/kernel_resources.py reach compares them with
// the kernels compiled into the library, so that no instantiated kernel is unreachable.
#include <cstdio>
#include <set>
#include <string>

#include "cuda/routing/route_plan.h"
#include "routing/route_plan_space.h"

int main() {
  std::set<std::string> reached;
  long calls = 0, errors = 0;
  for (int sms : {132, 78}) {
    const switchyard::cuda::DeviceProps props = sy_test::plan_props(sms);
    sy_test::for_each_plan_config([&](const switchyard::detail::RouteArgs& args) {
      switchyard::cuda::routing::RoutePlan plan;
      ++calls;
      if (!switchyard::cuda::routing::plan_route(args, props, &plan).ok()) {
        ++errors;
        return;
      }
      reached.insert(plan.name);
    });
  }
  for (const std::string& name : reached) std::printf("%s\n", name.c_str());
  std::fprintf(stderr, "route_plan_reach: %zu kernels reached by %ld plans (%ld refused)\n", reached.size(), calls,
               errors);
  return 0;
}
