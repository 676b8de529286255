#include "server/multinode/job_plan.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/plan/aoa.h"
#include "core/plan/balancer.h"
#include "server/multinode/plan_codec.h"

namespace ckptd {
namespace {

// Every rank of `joins` with its targets and its node's index, in rank order.
absl::Status RanksOf(const std::vector<const peer::v1::JoinRequest*>& joins,
                     std::vector<ckpt::RankTargets>* ranks, std::vector<int>* node_of_rank) {
  std::vector<std::pair<int, int>> rank_node;  // (rank, node index)
  std::map<int, const peer::v1::RankTargetsMsg*> by_rank;
  for (size_t n = 0; n < joins.size(); ++n) {
    for (const auto& r : joins[n]->ranks()) {
      by_rank[r.rank()] = &r;
      rank_node.push_back({r.rank(), static_cast<int>(n)});
    }
  }
  std::sort(rank_node.begin(), rank_node.end());
  ranks->reserve(rank_node.size());
  for (const auto& [rank, node] : rank_node) {
    ckpt::RankTargets rt;
    rt.rank = rank;
    for (const auto& t : by_rank[rank]->targets()) {
      CKPT_ASSIGN_OR_RETURN(ckpt::TargetTensor tt, FromMsg(t));
      rt.tensors.push_back(std::move(tt));
    }
    ranks->push_back(std::move(rt));
    node_of_rank->push_back(node);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<JobParts> PlanJobParts(const JobPlanInput& in) {
  const size_t num_nodes = in.nodes.size();
  if (in.joins.size() != num_nodes || in.metadata == nullptr) {
    return absl::InternalError("PlanJobParts: a join per node and the metadata are needed");
  }
  std::vector<ckpt::RankTargets> ranks;
  std::vector<int> node_of_rank;
  CKPT_RETURN_IF_ERROR(RanksOf(in.joins, &ranks, &node_of_rank));
  ckpt::PlanOptions po;
  po.max_read_bytes = in.max_read_bytes;
  CKPT_ASSIGN_OR_RETURN(ckpt::LoadPlan plan,
                        ckpt::PlanLoadWithAoa(*in.metadata, in.aoa, ranks, po, "aoa_config"));
  std::vector<std::set<std::string>> readable(num_nodes);
  for (size_t n = 0; n < num_nodes; ++n) {
    for (const auto& f : in.joins[n]->readable()) readable[n].insert(f.name());
  }
  ckpt::AssignOptions ao;
  if (!in.whole_tables) ao.min_reader_bytes = in.min_reader_bytes;
  for (const std::string& f : in.first_readers) {
    auto at = std::find(in.nodes.begin(), in.nodes.end(), f);
    if (at != in.nodes.end()) ao.first_readers.push_back(static_cast<int>(at - in.nodes.begin()));
  }
  CKPT_ASSIGN_OR_RETURN(ckpt::ReadAssignment assign,
                        ckpt::AssignReads(plan, node_of_rank, readable, ao));

  // Which reads each part holds (ascending): the node's own and those its
  // ranks copy from.
  std::vector<std::vector<uint32_t>> part_reads(num_nodes);
  for (size_t i = 0; i < plan.reads.size(); ++i) {
    const uint32_t id = static_cast<uint32_t>(i);
    if (in.whole_tables) {
      for (auto& pr : part_reads) pr.push_back(id);
      continue;
    }
    if (assign.reader[i] >= 0) part_reads[static_cast<size_t>(assign.reader[i])].push_back(id);
    for (int m : assign.needed_by[i]) {
      if (m != assign.reader[i]) part_reads[static_cast<size_t>(m)].push_back(id);
    }
  }
  const int coordinator_index = static_cast<int>(
      std::find(in.nodes.begin(), in.nodes.end(), in.coordinator) - in.nodes.begin());

  JobParts out;
  out.reads = plan.reads.size();
  out.ranks = plan.ranks.size();
  out.bytes_per_node = assign.bytes_per_node;
  out.shared_readers = assign.shared_readers;
  out.bytes_to_read = plan.bytes_to_read;
  std::vector<std::vector<size_t>> ranks_of_node(num_nodes);
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    ranks_of_node[static_cast<size_t>(node_of_rank[r])].push_back(r);
  }
  std::vector<int32_t> file_in_part(plan.files.size(), -1);
  for (size_t n = 0; n < num_nodes; ++n) {
    peer::v1::PlanPart& part = out.parts[in.nodes[n]];
    part.set_job_id(in.job_id);
    const std::vector<uint32_t>& mine = part_reads[n];
    std::set<int> peers = {static_cast<int>(n)};
    if (coordinator_index < static_cast<int>(num_nodes)) peers.insert(coordinator_index);
    std::vector<uint32_t> files_used;
    for (uint32_t id : mine) {
      const ckpt::ReadRange& rr = plan.reads[id];
      if (file_in_part[rr.file] < 0) {
        file_in_part[rr.file] = static_cast<int32_t>(part.files_size());
        part.add_files(plan.files[rr.file]);
        files_used.push_back(rr.file);
      }
      peer::v1::ReadMsg* rm = part.add_reads();
      ToMsg(rr, rm);
      rm->set_file(static_cast<uint32_t>(file_in_part[rr.file]));
      rm->set_id(id);
      const int reader = assign.reader[id];
      if (reader >= 0) rm->set_reader(in.nodes[static_cast<size_t>(reader)]);
      if (in.whole_tables || reader == static_cast<int>(n)) {
        for (int m : assign.needed_by[id]) {
          rm->add_needed_by(in.nodes[static_cast<size_t>(m)]);
          peers.insert(m);
        }
      } else {
        rm->add_needed_by(in.nodes[n]);
        if (reader >= 0) peers.insert(reader);
      }
    }
    for (uint32_t f : files_used) file_in_part[f] = -1;  // ready for the next part
    for (size_t r : ranks_of_node[n]) {
      peer::v1::RankPlanMsg* rpm = part.add_ranks();
      ToMsg(plan.ranks[r], rpm);
      for (peer::v1::CopyMsg& c : *rpm->mutable_copies()) {
        // Global read index -> its position in this part (present: the
        // node's ranks copy from it).
        c.set_read(static_cast<uint32_t>(std::lower_bound(mine.begin(), mine.end(), c.read()) -
                                         mine.begin()));
      }
    }
    for (const auto& k : plan.unexpected_keys) part.add_unexpected_keys(k);
    for (const auto& [a, b] : plan.renamed_keys) (*part.mutable_renamed_keys())[a] = b;
    if (in.whole_tables) {
      for (const auto& nn : in.nodes) part.add_nodes(nn);
    } else {
      for (int m : peers) part.add_nodes(in.nodes[static_cast<size_t>(m)]);
    }
    part.set_job_nodes(static_cast<uint32_t>(num_nodes));
    part.set_job_bytes_to_read(plan.bytes_to_read);
    part.set_format(in.format);
    part.set_unique_id(in.unique_id);
  }
  return out;
}

}  // namespace ckptd
