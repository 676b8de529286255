// SortedAppend (core/base/sorted_append.h): lists appended one after another
// come out sorted, whether each list is in order, reversed, or interleaved
// with the ones before, on both sides of the bound on merges.
#include "core/base/sorted_append.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace ckpt {
namespace {

TEST(SortedAppend, ListsInAnyOrderComeOutSortedBelowAndPastTheBound) {
  std::mt19937_64 rng(35);
  for (int trial = 0; trial < 400; ++trial) {
    const int max_merges = static_cast<int>(rng() % 4);
    const int lists = 1 + static_cast<int>(rng() % 12);
    std::vector<uint64_t> v, all;
    if (rng() % 3 == 0) {  // a sorted prefix already there
      for (uint64_t x = 0; x < 10; ++x) v.push_back(x * 5);
      all = v;
    }
    SortedAppend sorted(&v, std::less<uint64_t>(), max_merges);
    for (int l = 0; l < lists; ++l) {
      // One rank's runs: a strided walk (in order), now and then reversed
      // or shuffled, starting anywhere among the earlier ones.
      std::vector<uint64_t> list;
      const uint64_t start = rng() % 200, step = 1 + rng() % 9;
      const size_t n = rng() % 30;
      for (size_t i = 0; i < n; ++i) list.push_back(start + i * step);
      if (rng() % 4 == 0) std::reverse(list.begin(), list.end());
      if (rng() % 6 == 0) std::shuffle(list.begin(), list.end(), rng);
      v.insert(v.end(), list.begin(), list.end());
      all.insert(all.end(), list.begin(), list.end());
      sorted.Appended();
    }
    sorted.Finish();
    std::sort(all.begin(), all.end());
    ASSERT_EQ(v, all) << "trial " << trial << ", " << lists << " lists, max_merges "
                      << max_merges;
  }
}

}  // namespace
}  // namespace ckpt
