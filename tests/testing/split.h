// Test helper: Paddle's balanced_split of one axis of a tensor over ranks.
#ifndef CKPTD_TESTS_TESTING_SPLIT_H_
#define CKPTD_TESTS_TESTING_SPLIT_H_

#include <algorithm>

#include "core/base/box.h"

namespace ckpt::testing {

// Rank r's box when axis `d` of `global` is cut into `world` chunks of
// ceil(n / world), the last ones smaller (possibly empty).
inline Box BalancedSplit(const Shape& global, size_t d, int world, int r) {
  Box b{Shape(global.size(), 0), global};
  const int64_t chunk = (global[d] + world - 1) / world;
  b.offset[d] = std::min<int64_t>(r * chunk, global[d]);
  b.shape[d] = std::max<int64_t>(0, std::min<int64_t>(chunk, global[d] - b.offset[d]));
  return b;
}

}  // namespace ckpt::testing

#endif  // CKPTD_TESTS_TESTING_SPLIT_H_
