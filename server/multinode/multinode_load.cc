// A load whose ranks span several daemons (multinode_load.h), on one node.
//
// Flow for a job whose ranks span several daemons:
//  1. Each daemon waits for its own ranks (the local barrier in Load).
//  2. The daemon serving `coordinator_rank` gathers every node's ranks and
//     readable data files through Join, plans once, assigns every read to
//     one node (core/plan/balancer.h) and answers each Join with that node's part.
//  3. Every node executes its part: reads assigned to it come from storage
//     (through its data cache) and are served to the nodes that need them
//     (FetchRead, chunked gRPC stream: flow-controlled, one read in memory
//     per transfer); reads other nodes do are fetched from them.
//  4. Every node reports to the coordinator (Complete); the coordinator
//     answers all of them with one outcome, so all nodes succeed or fail
//     together. Every wait is bounded by peer_timeout and names who it
//     waited for.
#include "server/multinode/multinode_load.h"

#include <algorithm>
#include <chrono>

#include <spdlog/spdlog.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/format/checkpoint.h"
#include "server/multinode/job_plan.h"
#include "server/multinode/peer_nccl.h"
#include "server/multinode/plan_codec.h"

namespace ckptd {

using ckpt::TargetTensor;

namespace {

// The identity of each file of `dir` that node `me` reads from storage for
// its part (the caching source checks every read against it).
absl::Status StampLocalFiles(const std::string& dir, const std::set<std::string>& files,
                             const std::string& me, std::map<std::string, ckpt::FileStamp>* out) {
  for (const std::string& f : files) {
    auto st = ckpt::StatFile(ckpt::JoinPath(dir, f));
    if (!st.ok()) {
      return absl::NotFoundError(absl::StrCat(me, ": data file ", f, " assigned to this node: ",
                                              st.status().message()));
    }
    (*out)[f] = *st;
  }
  return absl::OkStatus();
}

// Data-file-like names in `dir` (what this node can read).
std::vector<peer::v1::FileInfo> ListReadable(const std::string& dir) {
  std::vector<peer::v1::FileInfo> out;
  auto d = ckpt::Directory::Open(dir, /*confine=*/false);
  if (!d.ok()) return out;
  auto names = (*d)->List();
  if (!names.ok()) return out;
  for (const std::string& n : *names) {
    if (absl::EndsWith(n, ".metadata")) continue;
    auto st = ckpt::StatFile(ckpt::JoinPath(dir, n));
    if (!st.ok()) continue;
    peer::v1::FileInfo fi;
    fi.set_name(n);
    fi.set_size(st->size);
    out.push_back(std::move(fi));
  }
  return out;
}

}  // namespace

absl::StatusOr<std::map<std::string, peer::v1::PlanPart>> MultiNodeLoad::PlanParts(
    const DistJob& dj, const std::vector<std::string>& nodes,
    const std::vector<peer::v1::JoinRequest>& joins, std::chrono::steady_clock::time_point t0) {
  CKPT_ASSIGN_OR_RETURN(auto opened,
                        p_.metadata->Open(dj.local_dir, dj.unique_id, /*all_files_local=*/false));
  // NCCL between the nodes when every one of them can (peer_nccl.h); its
  // links need every read and node in every part.
  bool nccl = nodes.size() > 1;
  for (const auto& j : joins) nccl = nccl && j.nccl();
  for (const auto& j : joins) {
    for (const auto& u : j.nccl_unreachable()) {
      if (nccl && std::find(nodes.begin(), nodes.end(), u) != nodes.end()) {
        spdlog::info("coordinator job={}: {} recently failed to connect NCCL links with {}; "
                     "peers use gRPC", dj.id, j.node(), u);
        nccl = false;
      }
    }
  }
  std::string nccl_id;
  if (nccl) {
    auto id = p_.gpu->NewNcclId();
    if (id.ok()) {
      nccl_id = *id;
    } else {
      spdlog::warn("coordinator job={}: no NCCL id ({}); peers use gRPC", dj.id,
                   id.status().ToString());
    }
  }
  JobPlanInput in;
  in.job_id = dj.id;
  in.metadata = &opened->checkpoint.metadata;
  in.aoa = dj.aoa;
  in.nodes = nodes;
  for (const auto& j : joins) in.joins.push_back(&j);
  in.coordinator = p_.config->peer_listen;
  in.max_read_bytes = p_.config->io_request_size;
  in.min_reader_bytes = p_.config->peer_reader_min_bytes;
  // This node and the rendezvous node the joiners asked: every node has
  // called both already.
  in.first_readers = {in.coordinator};
  if (!dj.announced_at.empty()) in.first_readers.push_back(dj.announced_at.front());
  in.whole_tables = !nccl_id.empty();
  in.format = ckpt::FormatName(opened->checkpoint.format);
  in.unique_id = opened->checkpoint.unique_id.value_or(0);
  CKPT_ASSIGN_OR_RETURN(JobParts planned, PlanJobParts(in));
  const double plan_s = Seconds(t0);
  uint64_t part_bytes = 0;
  for (auto& [n, part] : planned.parts) {
    part.set_plan_s(plan_s);
    if (!nccl_id.empty()) part.set_nccl_id(nccl_id);
    part_bytes += part.ByteSizeLong();
  }
  std::string balance;
  for (size_t n = 0; n < nodes.size(); ++n) {
    balance += absl::StrCat(n ? " " : "", nodes[n], "=", planned.bytes_per_node[n], "B");
  }
  spdlog::info("coordinator job={} nodes={} ranks={} reads={} plan={:.4f}s parts={}B shared "
               "readers={} storage reads: {}",
               dj.id, nodes.size(), planned.ranks, planned.reads, plan_s, part_bytes,
               planned.shared_readers, balance);
  return std::move(planned.parts);
}

absl::StatusOr<peer::v1::JoinRequest> MultiNodeLoad::JoinOf(
    const Job& job, const std::vector<std::shared_ptr<RankSlot>>& slots) {
  const std::string& me = p_.config->peer_listen;
  if (me.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job.id, "' spans several daemons (this one serves ", job.expected.size(),
        " of ", job.world_size, " ranks) but this daemon has no peer_listen configured"));
  }
  CKPT_RETURN_IF_ERROR(CheckJobKeyed(job, p_.config->peer_unkeyed_jobs));
  const int coord_rank = slots.front()->request.coordinator_rank();
  for (const auto& s : slots) {
    if (s->request.path() != slots.front()->request.path()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "job '", job.id, "': ranks name the checkpoint differently ('",
          slots.front()->request.path(), "' vs '", s->request.path(), "')"));
    }
    if (s->request.coordinator_rank() != coord_rank) {
      return absl::InvalidArgumentError(absl::StrCat(
          "job '", job.id, "': ranks disagree on coordinator_rank (", coord_rank, " vs ",
          s->request.coordinator_rank(), ")"));
    }
  }
  peer::v1::JoinRequest own = BaseJoin(job, slots, me, slots.front()->request.path(), coord_rank);
  own.set_nccl(NcclWanted(*p_.gpu));
  for (const std::string& n : p_.dist_jobs->NcclUnreachable()) own.add_nccl_unreachable(n);
  own.set_aoa_config(slots.front()->request.aoa_config());
  for (auto& f : ListReadable(job.path)) *own.add_readable() = std::move(f);
  return own;
}

void MultiNodeLoad::Run(const std::shared_ptr<Job>& job,
                               const std::vector<std::shared_ptr<RankSlot>>& slots,
                               std::chrono::steady_clock::time_point t_start) {
  auto fail_all = [&](const absl::Status& s) {
    p_.loads->FailLoadJob(*job, slots.size(), p_.config->peer_listen, s);
  };
  const std::string me = p_.config->peer_listen;
  absl::StatusOr<peer::v1::JoinRequest> joined = JoinOf(*job, slots);
  if (!joined.ok()) return fail_all(joined.status());
  const peer::v1::JoinRequest& own = *joined;
  const int coord_rank = own.coordinator_rank();

  DistJobKind kind;
  kind.aoa = slots.front()->request.aoa_config();
  std::shared_ptr<DistJob> dj = p_.dist_jobs->New(*job, slots.front()->request.path(),
                                               job->expected.count(coord_rank) > 0, kind);
  job->SetPhase(dj->coordinator ? "gathering the job's ranks from peers"
                                : "joining the coordinator");
  // 1. The plan part of this node.
  auto planned = p_.dist_jobs->PlanPartOf(
      dj, own, [&](const auto&... gathered) { return PlanParts(*dj, gathered...); });
  if (!planned.ok()) return fail_all(planned.status());
  const peer::v1::PlanPart& part = planned->first;
  const std::string& coordinator = planned->second;

  // 2. This node's share of the part.
  LocalPart mine;
  absl::Status exec =
      p_.dist_jobs->AdoptPart(dj, part, coordinator, PartContextOf(*job, slots, me, coordinator), &mine);
  ckpt::LoadPlan& lp = mine.plan;
  // 3. Execute.
  if (p_.config->testing_delay_part > absl::ZeroDuration()) {
    absl::SleepFor(p_.config->testing_delay_part);  // fault injection for tests only
  }
  std::map<std::string, ckpt::FileStamp> stamps;  // none when the part was refused
  if (exec.ok()) exec = StampLocalFiles(job->path, mine.local_files, me, &stamps);
  ckpt::LoadStats stats;
  std::unique_ptr<RemoteReads> peers;
  if (exec.ok()) {
    peers = p_.dist_jobs->PeerReadsFor(dj, part, mine);
    auto st = p_.loads->RunNodePart(job, slots, lp, stamps, "reading (multi-node)", peers.get());
    if (st.ok()) {
      stats = *st;
    } else {
      exec = st.status();
    }
  }
  exec = dj->EndPart(std::move(exec));
  // 4. Agree on the outcome with every node.
  job->SetPhase("waiting for the other nodes");
  peer::v1::CompleteRequest done = CompletionOf(job->id, me, exec);
  done.set_bytes_read(stats.bytes_read);
  const uint64_t received = peers ? peers->bytes_received() : 0;
  done.set_bytes_received(received);
  done.set_bytes_sent(peers ? peers->bytes_sent() : 0);  // so far: peers may still fetch
  absl::StatusOr<peer::v1::CompleteResponse> outcome = p_.dist_jobs->ReportCompletion(dj, coordinator, done);
  // Every node has completed (the outcome says so): its fetches are done.
  const uint64_t sent = peers ? peers->bytes_sent() : 0;
  p_.dist_jobs->Retire(dj, absl::Seconds(1));
  absl::Status final_status = JobOutcome(job->id, exec, outcome);
  if (!final_status.ok()) {
    spdlog::warn("multi-node job={} failed on {}: {}", job->id, me, final_status.ToString());
    return fail_all(final_status);
  }
  JobFigures fig;
  fig.start = t_start;
  fig.stats = &stats;
  fig.unexpected_keys.assign(part.unexpected_keys().begin(), part.unexpected_keys().end());
  fig.renamed_keys.insert(part.renamed_keys().begin(), part.renamed_keys().end());
  // Peer reads are not from storage; the executor counts them (whole) with
  // cache hits.
  const uint64_t from_peers = peers ? peers->peer_read_length() : 0;
  fig.bytes_from_cache = stats.bytes_from_cache - std::min(stats.bytes_from_cache, from_peers);
  fig.unique_id = part.unique_id();
  fig.format = part.format();
  fig.plan_s = part.plan_s();
  LoadJobRecord rec{job->id, job->path, me, slots.size()};
  rec.bytes_from_peers = received;
  rec.bytes_to_peers = sent;
  rec.job_bytes_read = outcome->job_bytes_read();
  p_.loads->FinishLoadJob(job, slots, lp, fig, std::move(rec), [&](v1::LoadResult& r) {
    r.set_bytes_from_peers(received);
    r.set_bytes_to_peers(sent);
    for (const auto& n : part.nodes()) r.add_nodes(n);
    r.set_job_nodes(part.job_nodes());
    r.set_job_bytes_read(outcome->job_bytes_read());
  });
}

}  // namespace ckptd
