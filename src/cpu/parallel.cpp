#include "cpu/parallel.h"

#include <algorithm>
#include <thread>
#include <vector>

namespace switchyard::cpu {

void parallel_for(std::int64_t n, std::int64_t grain,
                  const std::function<void(std::int64_t, std::int64_t)>& fn) {
  if (n <= 0) return;
  const std::int64_t hw = std::max<std::int64_t>(1, std::thread::hardware_concurrency());
  const std::int64_t chunks = std::min<std::int64_t>(hw, n / std::max<std::int64_t>(grain, 1));
  if (chunks < 2) {
    fn(0, n);
    return;
  }
  std::vector<std::thread> threads;
  threads.reserve(chunks - 1);
  const std::int64_t step = (n + chunks - 1) / chunks;
  for (std::int64_t c = 1; c < chunks; ++c) {
    const std::int64_t b = c * step;
    const std::int64_t e = std::min(n, b + step);
    if (b < e) threads.emplace_back(fn, b, e);
  }
  fn(0, std::min(n, step));
  for (std::thread& t : threads) t.join();
}

}  // namespace switchyard::cpu
