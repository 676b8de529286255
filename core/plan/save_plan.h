// The save plan: which rank writes which shard of a checkpoint being saved
// (replicated shards once, balanced by bytes over the ranks, or the nodes,
// holding them). Pure; thread-compatible. core/write writes the plan's files.
#ifndef CKPTD_CORE_PLAN_SAVE_PLAN_H_
#define CKPTD_CORE_PLAN_SAVE_PLAN_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "core/base/checksum.h"
#include "core/base/dtype.h"
#include "core/plan/planner.h"

namespace ckpt {

struct SavePlan {
  int64_t unique_id = 0;
  uint64_t checksum_block = kChecksumBlock;  // bytes per recorded checksum
  int world_size = 0;
  // writes[r]: the targets rank r writes into `{r}_{uid}.safetensors`.
  std::vector<std::vector<TargetTensor>> writes;
  // Tensor dtype and global shape (checked identical across ranks).
  std::map<std::string, std::pair<DType, Shape>> tensors;
};

// Ranks holding the same (name, box, flat range) are replicas: one of them,
// the one with the fewest bytes assigned so far (ties: lowest rank), writes
// it. Errors: a rank outside [0, world_size), a tensor twice on one rank,
// replicas or ranks disagreeing on dtype or global shape, boxes out of bounds.
absl::StatusOr<SavePlan> PlanSave(const std::vector<RankTargets>& ranks, int world_size,
                                  int64_t unique_id, uint64_t checksum_block = kChecksumBlock);
// The same for ranks spread over nodes (a multi-node save: every node writes
// its own ranks' files). `node_of_rank[r]` is rank r's node (world_size
// entries, each >= 0). A replicated shard goes to the node with the fewest
// bytes to write so far, then to that node's holder with the fewest (ties:
// lowest node, lowest rank): storage bandwidth is per node, so the nodes'
// bytes are what must balance.
absl::StatusOr<SavePlan> PlanSave(const std::vector<RankTargets>& ranks, int world_size,
                                  int64_t unique_id, const std::vector<int>& node_of_rank,
                                  uint64_t checksum_block = kChecksumBlock);

}  // namespace ckpt

#endif  // CKPTD_CORE_PLAN_SAVE_PLAN_H_
