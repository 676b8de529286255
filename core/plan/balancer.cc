#include "core/plan/balancer.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace ckpt {

absl::StatusOr<ReadAssignment> AssignReads(const LoadPlan& plan,
                                           const std::vector<int>& node_of_rank,
                                           const std::vector<std::set<std::string>>& readable) {
  const int nodes = static_cast<int>(readable.size());
  if (node_of_rank.size() != plan.ranks.size()) {
    return absl::InvalidArgumentError("AssignReads: one node per plan rank is required");
  }
  ReadAssignment a;
  a.reader.assign(plan.reads.size(), -1);
  a.needed_by.resize(plan.reads.size());
  a.bytes_per_node.assign(nodes, 0);
  std::vector<std::set<int>> needers(plan.reads.size());
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    const int node = node_of_rank[r];
    if (node < 0 || node >= nodes) {
      return absl::InvalidArgumentError(absl::StrCat("AssignReads: rank ", plan.ranks[r].rank,
                                                     " is on unknown node ", node));
    }
    for (const CopyOp& c : plan.ranks[r].copies) needers[c.read].insert(node);
  }
  struct Item {
    size_t read;
    std::vector<int> candidates;
    bool local;
  };
  std::vector<Item> items;
  for (size_t i = 0; i < plan.reads.size(); ++i) {
    if (needers[i].empty()) continue;
    a.needed_by[i].assign(needers[i].begin(), needers[i].end());
    const std::string& file = plan.files[plan.reads[i].file];
    Item it{i, {}, true};
    for (int n : needers[i]) {
      if (readable[n].count(file)) it.candidates.push_back(n);
    }
    if (it.candidates.empty()) {
      it.local = false;
      for (int n = 0; n < nodes; ++n) {
        if (readable[n].count(file)) it.candidates.push_back(n);
      }
    }
    if (it.candidates.empty()) {
      return absl::NotFoundError(absl::StrCat(
          "data file '", file, "' is needed (bytes [", plan.reads[i].offset, ", ",
          plan.reads[i].offset + plan.reads[i].length, ") by node(s) ",
          absl::StrJoin(a.needed_by[i], ","), ") but no node of the job can read it"));
    }
    items.push_back(std::move(it));
  }
  // Local reads first (phase 1), then remote ones; within a phase the most
  // constrained and the largest first.
  std::sort(items.begin(), items.end(), [&](const Item& x, const Item& y) {
    if (x.local != y.local) return x.local;
    if (x.candidates.size() != y.candidates.size()) return x.candidates.size() < y.candidates.size();
    const ReadRange& rx = plan.reads[x.read];
    const ReadRange& ry = plan.reads[y.read];
    if (rx.length != ry.length) return rx.length > ry.length;
    return x.read < y.read;
  });
  for (const Item& it : items) {
    int best = it.candidates.front();
    for (int n : it.candidates) {
      if (a.bytes_per_node[n] < a.bytes_per_node[best] ||
          (a.bytes_per_node[n] == a.bytes_per_node[best] && n < best)) {
        best = n;
      }
    }
    a.reader[it.read] = best;
    a.bytes_per_node[best] += plan.reads[it.read].length;
  }
  return a;
}

}  // namespace ckpt
