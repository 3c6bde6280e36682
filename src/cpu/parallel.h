// A minimal fork-join helper for the CPU backend: splits [0, n) into contiguous chunks over
// std::threads when the work is large enough to pay for starting them.
#pragma once

#include <cstdint>
#include <functional>

namespace switchyard::cpu {

// Calls fn(begin, end) over disjoint chunks covering [0, n); runs inline when n < 2 * grain
// or only one hardware thread is available. Chunks never overlap, so fn may write its rows.
void parallel_for(std::int64_t n, std::int64_t grain,
                  const std::function<void(std::int64_t, std::int64_t)>& fn);

}  // namespace switchyard::cpu
