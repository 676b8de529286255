// Layout files: the JSON description of what each rank holds, used by
// `ckptctl shard` and `ckptctl load` (and by tests and benchmarks).
//
//   {"world_size": 2,
//    "ranks": [{"rank": 0, "tensors": [{"name": "w", "dtype": "F32",
//                "global_shape": [4, 8], "offset": [0, 0], "shape": [2, 8],
//                "flat_range": [0, 10]}]}, ...]}
//
// "flat_range" is optional. Ranks holding the same box are replicas.
#ifndef CKPTD_CORE_LAYOUT_H_
#define CKPTD_CORE_LAYOUT_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/plan/planner.h"

namespace ckpt {

struct Layout {
  int world_size = 0;
  std::vector<RankTargets> ranks;  // sorted by rank, one per rank 0..world_size-1
};

// Parses and validates a layout; `path` names the file in errors. Every rank
// 0..world_size-1 must appear exactly once (a rank may hold no tensors).
absl::StatusOr<Layout> ParseLayout(const std::string& path, const std::string& text);
absl::StatusOr<Layout> ReadLayoutFile(const std::string& path);
std::string LayoutToJson(const Layout& layout);

}  // namespace ckpt

#endif  // CKPTD_CORE_LAYOUT_H_
