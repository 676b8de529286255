// Multi-node saves: a save job whose ranks span several daemons (each node's
// SaveRequests carry node_ranks, a strict subset of the world). Two phases,
// so that a version is visible only when every byte of it is durable:
//  1. Plan. Each node sends its ranks' shards to the coordinator (the node
//     serving rank 0) through Join. The coordinator plans once for the whole
//     job (ckpt::PlanSave with every rank's node: a replicated shard is
//     written once, by the node with the fewest bytes to write) and answers
//     each node with what its ranks write (PlanPart.save).
//  2. Prepare. Every node writes its ranks' data files into its own copy of
//     the directory (node-local disks or one shared directory), each file
//     fsynced and renamed, the directory fsynced, and reports the shards it
//     wrote through Complete.
//  3. Commit. Once every node prepared, the coordinator's outcome carries
//     every node's shards and each node writes `{uid}.metadata` from them
//     (temporary name, fsync, rename, directory fsync). A node that failed
//     or went away fails the save on every node (the outcome names it; a
//     node lost is found by Ping within peer_timeout) and no node writes
//     metadata: no version appears.
// docs/saving.md ("Saves across nodes") tells the rules to users.
#include "server/multinode/multinode_save.h"

#include <algorithm>
#include <chrono>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/base/status_macros.h"
#include "core/io/file.h"
#include "core/write/writer.h"
#include "server/save/native_save.h"
#include "server/save/saves.h"

namespace ckptd {

namespace {
// The rank whose node coordinates a multi-node save.
constexpr int kSaveCoordinatorRank = 0;
}  // namespace

absl::StatusOr<std::map<std::string, peer::v1::PlanPart>> MultiNodeSave::PlanParts(
    const DistJob& dj, const std::vector<std::string>& nodes,
    const std::vector<peer::v1::JoinRequest>& joins, std::chrono::steady_clock::time_point t0) {
  std::vector<ckpt::RankTargets> ranks;
  std::vector<int> node_of_rank(static_cast<size_t>(dj.world_size), 0);
  std::map<std::string, std::vector<std::string>> flat;
  std::map<std::string, std::string> flat_from;  // key -> the node that sent it first
  for (size_t n = 0; n < joins.size(); ++n) {
    for (const auto& r : joins[n].ranks()) {
      ckpt::RankTargets rt;
      rt.rank = r.rank();
      for (const auto& t : r.targets()) {
        auto tt = FromMsg(t);
        if (!tt.ok()) return ckpt::Annotate(tt.status(), absl::StrCat("node ", nodes[n], " rank ", r.rank()));
        rt.tensors.push_back(*std::move(tt));
      }
      node_of_rank[static_cast<size_t>(r.rank())] = static_cast<int>(n);
      ranks.push_back(std::move(rt));
    }
    for (const auto& [key, parts] : joins[n].save().flat_mapping()) {
      std::vector<std::string> p(parts.parts().begin(), parts.parts().end());
      auto [it, inserted] = flat.emplace(key, p);
      if (inserted) {
        flat_from[key] = nodes[n];
      } else if (it->second != p) {
        return absl::InvalidArgumentError(absl::StrCat(
            "save job '", dj.id, "': flat_mapping of '", key, "' differs between nodes ",
            flat_from[key], " and ", nodes[n]));
      }
    }
  }
  // The version: the ranks', or (the daemons pick) the largest any node
  // proposes, so that it is newer than every node's copy of the directory.
  int64_t version = dj.unique_id.value_or(0);
  if (!dj.unique_id) {
    for (size_t n = 0; n < joins.size(); ++n) {
      const int64_t proposed = joins[n].save().next_version();
      if (proposed < 0) {
        return absl::InvalidArgumentError(absl::StrCat("save job '", dj.id, "': node ", nodes[n],
                                                       " proposes version ", proposed));
      }
      version = std::max(version, proposed);
    }
  }
  CKPT_ASSIGN_OR_RETURN(ckpt::SavePlan plan,
                        ckpt::PlanSave(ranks, dj.world_size, version, node_of_rank));
  std::vector<uint64_t> bytes_of_node(nodes.size(), 0);
  size_t shards = 0;
  for (int r = 0; r < dj.world_size; ++r) {
    for (const auto& t : plan.writes[static_cast<size_t>(r)]) {
      bytes_of_node[static_cast<size_t>(node_of_rank[static_cast<size_t>(r)])] += t.num_bytes();
      ++shards;
    }
  }
  std::map<std::string, peer::v1::PlanPart> parts;
  for (size_t n = 0; n < nodes.size(); ++n) {
    peer::v1::PlanPart& part = parts[nodes[n]];
    part.set_job_id(dj.id);
    for (const auto& nn : nodes) part.add_nodes(nn);
    part.set_unique_id(plan.unique_id);
    part.set_format("ckptd");
    part.set_plan_s(Seconds(t0));
    peer::v1::SavePart* sp = part.mutable_save();
    sp->set_unique_id(plan.unique_id);
    sp->set_checksum_block(plan.checksum_block);
    sp->set_overwrite(dj.overwrite);
    for (const auto& [name, info] : plan.tensors) {
      peer::v1::TensorInfoMsg* t = sp->add_tensors();
      t->set_name(name);
      t->set_dtype(std::string(ckpt::DTypeName(info.first)));
      for (int64_t d : info.second) t->add_global_shape(d);
    }
    for (int r = 0; r < dj.world_size; ++r) {
      if (node_of_rank[static_cast<size_t>(r)] != static_cast<int>(n)) continue;
      peer::v1::RankTargetsMsg* w = sp->add_writes();
      w->set_rank(r);
      for (const auto& t : plan.writes[static_cast<size_t>(r)]) ToMsg(t, w->add_targets());
    }
    for (const auto& [key, p] : flat) {
      auto* kp = &(*sp->mutable_flat_mapping())[key];
      for (const auto& s : p) kp->add_parts(s);
    }
  }
  std::string balance;
  for (size_t n = 0; n < nodes.size(); ++n) {
    absl::StrAppend(&balance, n ? " " : "", nodes[n], "=", bytes_of_node[n], "B");
  }
  spdlog::info("coordinator save job={} nodes={} ranks={} shards={} plan={:.4f}s bytes to write: {}",
               dj.id, nodes.size(), ranks.size(), shards, Seconds(t0), balance);
  return parts;
}

// What this node's ranks of a multi-node save tell the coordinator: their
// targets, the save's overwrite and every rank's flat mapping.
peer::v1::JoinRequest SaveJoinOf(const Job& job,
                                 const std::vector<std::shared_ptr<RankSlot>>& slots,
                                 const std::string& me, int64_t version) {
  const v1::SaveRequest& first = slots.front()->save_request;
  peer::v1::JoinRequest own = BaseJoin(job, slots, me, first.path(), kSaveCoordinatorRank);
  own.mutable_save()->set_overwrite(first.overwrite());
  if (!job.unique_id) own.mutable_save()->set_next_version(version);
  for (const auto& s : slots) {
    for (const auto& [key, parts] : s->save_request.flat_mapping()) {
      *(*own.mutable_save()->mutable_flat_mapping())[key].mutable_parts() = parts.parts();
    }
  }
  return own;
}

absl::StatusOr<LocalSave> MultiNodeSave::AdoptPart(const Job& job,
                                                const std::vector<std::shared_ptr<RankSlot>>& slots,
                                                const std::shared_ptr<DistJob>& dj,
                                                const peer::v1::PlanPart& part,
                                                const std::string& coordinator, int64_t version) {
  absl::StatusOr<LocalSave> local =
      LocalSaveOf(part, PartContextOf(job, slots, p_.config->peer_listen, coordinator), version,
                  /*picked=*/!job.unique_id);
  const absl::Status& exec = local.status();
  {
    absl::MutexLock lock(&dj->mu);
    if (exec.ok()) {
      dj->nodes.assign(part.nodes().begin(), part.nodes().end());
    } else {
      dj->exec_status = exec;
    }
    dj->part_known = true;
  }
  if (!exec.ok()) {
    spdlog::warn("multi-node save job={}: refused the plan part from {}: {}", job.id, coordinator,
                 exec.ToString());
  } else if (!dj->coordinator) {
    size_t shards = 0;
    for (const auto& w : local->plan.writes) shards += w.size();
    spdlog::info("multi-node save job={}: plan part received from coordinator {} ({} shards to "
                 "write here)", job.id, coordinator, shards);
  }
  return local;
}

absl::Status MultiNodeSave::Commit(const Job& job, const LocalSave& local,
                                const peer::v1::CompleteResponse& outcome,
                                const std::string& coordinator) {
  const int64_t version = local.plan.unique_id;
  std::vector<std::pair<std::string, ckpt::ShardMeta>> shards;
  const std::string who = absl::StrCat("save job '", job.id, "': outcome from ", coordinator);
  for (const auto& m : outcome.shards()) {
    CKPT_ASSIGN_OR_RETURN(auto sh, FromMsg(m, who));
    shards.push_back(std::move(sh));
  }
  CKPT_ASSIGN_OR_RETURN(std::string json,
                        ckpt::SaveMetadataJson(local.plan, shards, local.flat_mapping,
                                               absl::StrCat("save job '", job.id, "' into ",
                                                            job.path)));
  CKPT_ASSIGN_OR_RETURN(auto lock, ckpt::LockDirectory(job.path, 60'000));
  const std::string name = absl::StrCat(version, ".metadata");
  CKPT_ASSIGN_OR_RETURN(bool exists, lock.directory()->Exists(name));
  if (exists) {
    // A directory the nodes share: another node of the job committed it.
    auto have = lock.directory()->ReadSmallFile(name, json.size() + 1);
    if (have.ok() && *have == json) return absl::OkStatus();
    if (!local.overwrite) {
      return absl::AlreadyExistsError(absl::StrCat(
          job.path, ": version ", version, " appeared while save job '", job.id,
          "' was writing it (another writer of the directory); the data files of both may "
          "be mixed: save again with overwrite"));
    }
  }
  return ckpt::WriteFileAtomicIn(lock.directory(), name, json);
}

absl::StatusOr<NativeSaved> MultiNodeSave::WritePart(
    const std::shared_ptr<Job>& job, const std::vector<std::shared_ptr<RankSlot>>& slots,
    const LocalSave& local) {
  const int64_t version = local.plan.unique_id;
  NativeSave save = NativeSaveOf(*job, slots, local.plan);
  save.flat_mapping = local.flat_mapping;
  save.overwrite = local.overwrite;
  uint64_t total = 0;
  for (const auto& w : save.plan.writes) {
    for (const auto& t : w) total += t.num_bytes();
  }
  {
    absl::MutexLock lock(&job->mu);
    job->phase = "writing (multi-node save)";
    job->total = total;
  }
  CKPT_RETURN_IF_ERROR(ckpt::MakeDirs(job->path));
  CKPT_ASSIGN_OR_RETURN(auto lock, ckpt::LockDirectory(job->path, 60'000));
  CKPT_RETURN_IF_ERROR(ckpt::PrepareSave(*lock.directory(), version, save.overwrite));
  return WriteNativeFiles(save, lock.directory(), &job->progress, nullptr);
}


void MultiNodeSave::Run(const std::shared_ptr<Job>& job,
                        const std::vector<std::shared_ptr<RankSlot>>& slots, int64_t proposed) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string me = p_.config->peer_listen;
  auto fail_all = [&](const absl::Status& s) {
    spdlog::warn("multi-node save job={} failed on {}: {}", job->id, me, s.ToString());
    p_.jobs->Fail(*job, s);
  };
  if (me.empty()) {
    return fail_all(absl::FailedPreconditionError(absl::StrCat(
        "save job '", job->id, "' spans several daemons (this one serves ", job->expected.size(),
        " of ", job->world_size, " ranks) but this daemon has no peer_listen configured")));
  }
  const v1::SaveRequest& first = slots.front()->save_request;
  if (first.async_save()) {
    return fail_all(absl::InvalidArgumentError(absl::StrCat(
        "save job '", job->id, "': async_save is for saves on one node (this job spans ",
        job->world_size, " ranks, ", job->expected.size(),
        " of them here); save across nodes without async_save")));
  }
  if (absl::Status k = CheckJobKeyed(*job, p_.config->peer_unkeyed_jobs); !k.ok()) {
    return fail_all(k);
  }
  const peer::v1::JoinRequest own = SaveJoinOf(*job, slots, me, proposed);
  DistJobKind kind;
  kind.save = true;
  kind.overwrite = first.overwrite();
  const bool coordinates = job->expected.count(kSaveCoordinatorRank) > 0;
  std::shared_ptr<DistJob> dj = p_.dist_jobs->New(*job, first.path(), coordinates, kind);
  job->SetPhase(coordinates ? "gathering the save's ranks from peers" : "joining the coordinator");
  // 1. The plan: what this node's ranks write.
  auto planned = p_.dist_jobs->PlanPartOf(
      dj, own, [&](const auto&... gathered) { return PlanParts(*dj, gathered...); });
  if (!planned.ok()) return fail_all(planned.status());
  const peer::v1::PlanPart& part = planned->first;
  const std::string& coordinator = planned->second;
  absl::StatusOr<LocalSave> local = AdoptPart(*job, slots, dj, part, coordinator, proposed);
  absl::Status exec = local.status();
  if (p_.config->testing_delay_part > absl::ZeroDuration()) {
    absl::SleepFor(p_.config->testing_delay_part);  // fault injection for tests only
  }
  // 2. Prepare: this node's ranks' data files, durable.
  NativeSaved written;
  const int64_t version = local.ok() ? local->plan.unique_id : proposed;
  if (exec.ok()) {
    auto w = WritePart(job, slots, *local);
    if (w.ok()) {
      written = *std::move(w);
    } else {
      exec = ckpt::Annotate(w.status(), absl::StrCat("save job '", job->id, "' on ", me));
    }
  }
  exec = dj->EndPart(std::move(exec));
  job->SetPhase("waiting for the other nodes to prepare");
  peer::v1::CompleteRequest done = CompletionOf(job->id, me, exec);
  done.set_bytes_written(written.bytes);
  for (const auto& [name, shard] : written.shards) ToMsg(name, shard, done.add_shards());
  absl::StatusOr<peer::v1::CompleteResponse> outcome = p_.dist_jobs->ReportCompletion(dj, coordinator, done);
  p_.dist_jobs->Retire(dj, absl::Seconds(1));
  absl::Status final_status = JobOutcome(job->id, exec, outcome);
  if (!final_status.ok()) return fail_all(final_status);
  // 3. Commit: every node prepared; the version's metadata, from every
  // node's shards, here.
  job->SetPhase("committing");
  if (absl::Status c = Commit(*job, *local, *outcome, coordinator); !c.ok()) {
    return fail_all(ckpt::Annotate(c, absl::StrCat("save job '", job->id, "' on ", me,
                                                   ": every node prepared, the commit failed")));
  }
  p_.metadata->Drop(job->path);
  FinishSaveJob(*p_.jobs, *job, slots, [&](const RankSlot& s, v1::SaveResponse& r) {
    for (const auto& f : written.files_of_rank[s.targets.rank]) r.add_files(f);
    r.set_bytes_written(outcome->job_bytes_written());
    r.set_metadata_file(absl::StrCat(version, ".metadata"));
    r.set_unique_id(version);
    r.set_persisted(true);
  });
  spdlog::info("multi-node save job={} path={} version={} nodes={} ranks here={}: {}B written "
               "here, {}B in the job, committed in {:.3f}s",
               job->id, job->path, version, part.nodes_size(), slots.size(), written.bytes,
               outcome->job_bytes_written(), Seconds(t0));
}

}  // namespace ckptd
