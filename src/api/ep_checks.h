// Argument checks shared by the CPU and GPU expert-parallel groups.
#pragma once

#include "common/validate.h"
#include "switchyard/ep.h"

namespace switchyard::ep::detail {

// Ok when 0 <= rank < num_ranks, else InvalidArgument naming `op` and the rank.
Status check_rank(const char* op, int rank, int num_ranks);

// Checks one rank's dispatch arguments, every tensor on `device` (message without the op prefix
// when `check` adds it). DispatchOutputs::handle_memory is not checked here.
Status check_dispatch(const GroupConfig& c, const switchyard::detail::ArgChecker& check, const DispatchInputs& in,
                      const DispatchOutputs& out, Device device);

}  // namespace switchyard::ep::detail
