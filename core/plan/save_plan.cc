#include "core/plan/save_plan.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"

namespace ckpt {
namespace {

using ShardKey = std::tuple<std::string, Shape, Shape, int64_t, int64_t>;

ShardKey KeyOf(const TargetTensor& t) {
  return {t.name, t.box.offset, t.box.shape, t.flat_range ? t.flat_range->begin : -1,
          t.flat_range ? t.flat_range->end : -1};
}

}  // namespace

absl::StatusOr<SavePlan> PlanSave(const std::vector<RankTargets>& ranks, int world_size,
                                  int64_t unique_id, uint64_t checksum_block) {
  // One node holding every rank: the balance is the ranks'.
  return PlanSave(ranks, world_size, unique_id, std::vector<int>(std::max(world_size, 0), 0),
                  checksum_block);
}

absl::StatusOr<SavePlan> PlanSave(const std::vector<RankTargets>& ranks, int world_size,
                                  int64_t unique_id, const std::vector<int>& node_of_rank,
                                  uint64_t checksum_block) {
  if (world_size < 0 || node_of_rank.size() != static_cast<size_t>(world_size)) {
    return absl::InvalidArgumentError(absl::StrCat("PlanSave: ", node_of_rank.size(),
                                                   " node entries for world_size ", world_size));
  }
  int nodes = 0;
  for (int n : node_of_rank) {
    if (n < 0) return absl::InvalidArgumentError("PlanSave: a negative node index");
    nodes = std::max(nodes, n + 1);
  }
  if (checksum_block == 0) return absl::InvalidArgumentError("checksum block must be > 0");
  SavePlan plan;
  plan.checksum_block = checksum_block;
  plan.unique_id = unique_id;
  plan.world_size = world_size;
  plan.writes.resize(world_size);
  // Unique shard -> ranks holding it (ascending), and its size.
  std::map<ShardKey, std::vector<int>> holders;
  std::map<ShardKey, TargetTensor> desc;
  for (const RankTargets& rt : ranks) {
    if (rt.rank < 0 || rt.rank >= world_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", rt.rank, " is outside world_size ", world_size));
    }
    std::set<std::string> seen;
    for (const TargetTensor& t : rt.tensors) {
      CKPT_RETURN_IF_ERROR(ValidateTarget(rt.rank, t));
      if (!seen.insert(t.name).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("rank ", rt.rank, ": tensor '", t.name, "' listed twice"));
      }
      auto [it, inserted] = plan.tensors.emplace(t.name, std::make_pair(t.dtype, t.global_shape));
      if (!inserted && (it->second.first != t.dtype || it->second.second != t.global_shape)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor '", t.name, "': rank ", rt.rank, " has ", DTypeName(t.dtype),
            ShapeString(t.global_shape), " but another rank has ", DTypeName(it->second.first),
            ShapeString(it->second.second)));
      }
      ShardKey k = KeyOf(t);
      holders[k].push_back(rt.rank);
      desc.emplace(k, t);
    }
  }
  // Single-holder shards first (their loads are fixed), then replicas by
  // descending size so the greedy balance is tight; ties by key order.
  std::vector<uint64_t> load(world_size, 0), node_load(nodes, 0);
  std::vector<std::pair<const ShardKey*, const std::vector<int>*>> replicated;
  for (const auto& [k, hs] : holders) {
    if (hs.size() == 1) {
      plan.writes[hs[0]].push_back(desc.at(k));
      load[hs[0]] += desc.at(k).num_bytes();
      node_load[node_of_rank[hs[0]]] += desc.at(k).num_bytes();
    } else {
      replicated.push_back({&k, &hs});
    }
  }
  std::stable_sort(replicated.begin(), replicated.end(), [&](const auto& a, const auto& b) {
    return desc.at(*a.first).num_bytes() > desc.at(*b.first).num_bytes();
  });
  for (const auto& [k, hs] : replicated) {
    int best = (*hs)[0];
    auto rank_key = [&](int r) {
      return std::make_tuple(node_load[node_of_rank[r]], node_of_rank[r], load[r], r);
    };
    for (int r : *hs) {
      if (rank_key(r) < rank_key(best)) best = r;
    }
    plan.writes[best].push_back(desc.at(*k));
    load[best] += desc.at(*k).num_bytes();
    node_load[node_of_rank[best]] += desc.at(*k).num_bytes();
  }
  for (auto& w : plan.writes) {
    std::sort(w.begin(), w.end(),
              [](const TargetTensor& a, const TargetTensor& b) { return a.name < b.name; });
  }
  return plan;
}

}  // namespace ckpt
