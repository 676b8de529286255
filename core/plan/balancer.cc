#include "core/plan/balancer.h"

#include <algorithm>
#include <map>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace ckpt {

namespace {

// The K of balancer.h: readers for the shared reads, from their bytes read
// and sent (`need[i]`: bytes each needer copies from read i, at most its
// length).
int SharedReaders(const LoadPlan& plan, const std::vector<std::map<int, uint64_t>>& need,
                  int nodes, const AssignOptions& options) {
  if (options.min_reader_bytes == 0) return nodes;
  uint64_t weight = 0;
  for (size_t i = 0; i < plan.reads.size(); ++i) {
    if (need[i].size() < 2) continue;
    weight += plan.reads[i].length;
    for (const auto& [node, bytes] : need[i]) weight += std::min(bytes, plan.reads[i].length);
  }
  const uint64_t k = (weight + options.min_reader_bytes - 1) / options.min_reader_bytes;
  return static_cast<int>(std::clamp<uint64_t>(k, 1, static_cast<uint64_t>(nodes)));
}

}  // namespace

absl::StatusOr<ReadAssignment> AssignReads(const LoadPlan& plan,
                                           const std::vector<int>& node_of_rank,
                                           const std::vector<std::set<std::string>>& readable,
                                           const AssignOptions& options) {
  const int nodes = static_cast<int>(readable.size());
  if (node_of_rank.size() != plan.ranks.size()) {
    return absl::InvalidArgumentError("AssignReads: one node per plan rank is required");
  }
  ReadAssignment a;
  a.reader.assign(plan.reads.size(), -1);
  a.needed_by.resize(plan.reads.size());
  a.bytes_per_node.assign(nodes, 0);
  // Per read: its needers, with the bytes each copies from it.
  std::vector<std::map<int, uint64_t>> needers(plan.reads.size());
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    const int node = node_of_rank[r];
    if (node < 0 || node >= nodes) {
      return absl::InvalidArgumentError(absl::StrCat("AssignReads: rank ", plan.ranks[r].rank,
                                                     " is on unknown node ", node));
    }
    for (const CopyOp& c : plan.ranks[r].copies) {
      needers[c.read][node] += static_cast<uint64_t>(c.elements) * DTypeSize(c.src.dtype);
    }
  }
  a.shared_readers = SharedReaders(plan, needers, nodes, options);
  // The K nodes shared reads prefer: first_readers, then evenly over the
  // indices (0 among them), then the lowest indices left.
  std::vector<bool> preferred(nodes, false);
  int chosen = 0;
  auto prefer = [&](int n) {
    if (chosen < a.shared_readers && n >= 0 && n < nodes && !preferred[static_cast<size_t>(n)]) {
      preferred[static_cast<size_t>(n)] = true;
      ++chosen;
    }
  };
  for (int n : options.first_readers) prefer(n);
  for (int j = 0; j < a.shared_readers; ++j) {
    prefer(static_cast<int>(static_cast<int64_t>(j) * nodes / a.shared_readers));
  }
  for (int n = 0; n < nodes; ++n) prefer(n);
  struct Item {
    size_t read;
    std::vector<int> candidates;
    bool local;
  };
  std::vector<Item> items;
  for (size_t i = 0; i < plan.reads.size(); ++i) {
    if (needers[i].empty()) continue;
    for (const auto& [node, bytes] : needers[i]) a.needed_by[i].push_back(node);
    const std::string& file = plan.files[plan.reads[i].file];
    Item it{i, {}, true};
    for (int n : a.needed_by[i]) {
      if (readable[n].count(file)) it.candidates.push_back(n);
    }
    if (it.candidates.empty()) {
      it.local = false;
      for (int n = 0; n < nodes; ++n) {
        if (readable[n].count(file)) it.candidates.push_back(n);
      }
    }
    if (a.needed_by[i].size() > 1 && a.shared_readers < nodes) {
      // A preferred node among its needers, else any preferred node that
      // can read it (it sends to every needer then), else its candidates.
      std::vector<int> kept;
      for (int n : it.candidates) {
        if (preferred[static_cast<size_t>(n)]) kept.push_back(n);
      }
      if (kept.empty()) {
        for (int n = 0; n < nodes; ++n) {
          if (preferred[static_cast<size_t>(n)] && readable[n].count(file)) kept.push_back(n);
        }
        if (!kept.empty()) it.local = false;
      }
      if (!kept.empty()) it.candidates = std::move(kept);
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
