// A few blocking calls at once: object storage answers each HEAD or GET
// after a round trip, and a checkpoint of many objects would add them up.
#ifndef CKPTD_CORE_BASE_PARALLEL_H_
#define CKPTD_CORE_BASE_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <system_error>
#include <thread>
#include <vector>

namespace ckpt {

// Runs fn(i) for every i in [0, n) on up to `max_threads` threads (the
// calling one among them), each taking the next index; returns once all
// are done (with fewer threads where no more can be started). `fn` must
// not throw.
template <typename Fn>
void ParallelFor(size_t n, size_t max_threads, Fn fn) {
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < n;) fn(i);
  };
  const size_t threads = std::min(std::max<size_t>(max_threads, 1), n);
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) {
    try {
      pool.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // no thread to be had: the ones there (this one at least) do the rest
    }
  }
  work();
  for (std::thread& t : pool) t.join();
}

}  // namespace ckpt

#endif  // CKPTD_CORE_BASE_PARALLEL_H_
