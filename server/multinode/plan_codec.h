// The multi-node plan on the wire (proto/peer.proto): conversions between
// core's plan types and the peer protocol's messages, and the checks a plan
// part received from a peer passes before this node sizes, indexes or runs
// anything by it.
//
// A PlanPart is one node's share of a multi-node job's plan, made by the
// job's coordinator (server/multinode/multinode_load.cc). To the node that receives
// it, it is untrusted bytes: a faulty or malicious coordinator (or a bug)
// may name files, reads, targets or nodes that do not exist, byte ranges
// that overlap, overflow or leave their read, regions outside a buffer,
// ranks this node does not serve. The executor (core/exec/executor.h) trusts its
// plan, so:
//
//   PlanPartContext ctx{job_id, me, coordinator, world_size, own_ranks, limits};
//   absl::StatusOr<LocalPart> local = LocalPartOf(part, ctx);  // ValidatePlanPart first
//   if (!local.ok()) ...fail the job with local.status()...
//   ckpt::ExecutePlan(local->plan, ...);
//
// ValidatePlanPart checks every index, count, offset + length (without
// overflow), file, node, rank and target of a part against the part itself,
// this node's own ranks and PlanPartLimits, before anything is sized by it;
// a refusal is INVALID_ARGUMENT naming the job, the sender and the field
// ("reads[3].file", "ranks[0].copies[12].region"). LocalPartOf turns a part
// that passed into the plan this node executes.
//
// Thread-compatible: pure functions of their inputs.
#ifndef CKPTD_SERVER_MULTINODE_PLAN_CODEC_H_
#define CKPTD_SERVER_MULTINODE_PLAN_CODEC_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/plan/planner.h"
#include "core/write/writer.h"
#include "proto/peer.pb.h"

namespace ckptd {

void ToMsg(const ckpt::TargetTensor& t, peer::v1::TargetMsg* m);
absl::StatusOr<ckpt::TargetTensor> FromMsg(const peer::v1::TargetMsg& m);

void ToMsg(const ckpt::RankPlan& r, peer::v1::RankPlanMsg* m);
absl::StatusOr<ckpt::RankPlan> FromMsg(const peer::v1::RankPlanMsg& m);

void ToMsg(const ckpt::ReadRange& r, peer::v1::ReadMsg* m);
ckpt::ReadRange FromMsg(const peer::v1::ReadMsg& m);

// Caps on one plan part, far above what a real job's plan needs; what is
// over one is refused before anything is sized by it.
struct PlanPartLimits {
  uint64_t max_files = 1 << 20;
  uint64_t max_reads = 1 << 24;
  uint64_t max_nodes = 1 << 12;
  uint64_t max_copies_per_rank = 1 << 24;
  // Bytes of one node address (host:port).
  uint64_t max_node_bytes = 1024;
  // The longest read: its bytes are held whole in memory when they come
  // from or go to a peer. The daemon passes its io_request_size (the
  // coordinator cuts reads at its own: give every node the same one).
  uint64_t max_read_bytes = 64ull << 20;
};

// What a plan part must agree with: the job, who this node is, and what its
// ranks asked for.
struct PlanPartContext {
  std::string job_id;  // the part must name this job
  std::string node;    // this node's peer address: a node of the part
  std::string sender;  // the peer the part came from: a node of the part (named in errors)
  int world_size = 0;  // every rank is in [0, world_size)
  // This node's ranks, ascending, as they registered (not owned): the
  // part's ranks are exactly these, in this order, with the same targets.
  std::vector<const ckpt::RankTargets*> ranks;
  PlanPartLimits limits;
};

// OK, or INVALID_ARGUMENT "job '<id>': plan part from <sender>: <field>:
// <why>" for the first field that fails:
//  - job_id is the context's; nccl_id is empty or an ncclUniqueId (128 bytes);
//  - nodes: distinct, non-empty, at most max_node_bytes, this node and the
//    sender among them;
//  - files: distinct plain file names (core/format/metadata.h IsPlainFileName);
//  - reads: a file index into files; offset + length without overflow (and
//    within int64: file offsets), length at most max_read_bytes; sorted by
//    file name then offset, disjoint (as PlanLoad makes them); each
//    checksum range inside its read; reader empty or a node, needed_by
//    distinct nodes; a read this node needs has a reader;
//  - ranks: exactly the context's ranks and targets (each also passing
//    ckpt::ValidateTarget); missing_keys no more than the targets;
//  - copies: a target of the rank; a read this node reads or fetches; a
//    source layout with a known dtype, a box without overflow, a flat range
//    inside it, a permutation of its axes; a region inside both the source
//    box and the target box; a dtype the target's converts from; the
//    source bytes inside the read; elements at most the region's.
absl::Status ValidatePlanPart(const peer::v1::PlanPart& part, const PlanPartContext& context);

// A read this node reads from storage that other nodes need from it.
struct ServedRead {
  uint32_t read = 0;  // global index
  uint64_t length = 0;
  std::set<std::string> needers;  // the other nodes
};

// This node's share of a validated part.
struct LocalPart {
  // files as in the part; reads: those this node reads or fetches, in the
  // part's order (local indices); ranks: the part's, copies naming local
  // reads.
  ckpt::LoadPlan plan;
  std::vector<uint32_t> global_read;  // local read index -> global
  std::map<uint32_t, std::string> reader;  // global read index -> the node that reads it
  // (file name, offset) -> global index, for the reads in `plan`.
  std::map<std::pair<std::string, uint64_t>, uint32_t> global_index;
  std::set<std::string> local_files;  // files this node reads from storage
  std::vector<ServedRead> served;     // ascending by read
  // Reads fetched from peers of which this node's ranks need less than
  // 95% (kWholeReadPercent; global index -> the spans they copy from, offsets in
  // the read): only those bytes are fetched (FetchReadRequest.spans). A
  // fetched read not listed comes whole and is verified here against the
  // checkpoint's checksums too.
  std::map<uint32_t, std::vector<ckpt::ReadSpan>> fetch_spans;
};

// Spans one fetch may ask for (FetchReadRequest.spans or .span_runs,
// counted one by one): more are merged
// across their smallest gaps (ckpt::NeededSpans).
inline constexpr size_t kMaxFetchSpans = 1 << 16;
// The spans of a fetch (FetchReadRequest.spans, or .span_runs) against its
// read of `length` bytes, as runs: at most kMaxFetchSpans spans in all, each
// non-empty, inside the read, ascending and disjoint; INVALID_ARGUMENT
// naming the first that is not (or both forms at once). Empty: the whole
// read.
absl::StatusOr<std::vector<ckpt::SpanRun>> FetchSpansOf(const peer::v1::FetchReadRequest& req,
                                                        uint64_t length);
// Reads one FetchReads call may ask for.
inline constexpr size_t kMaxFetchReads = 1 << 16;
// A node fetches a read whole when its ranks need at least this share of it
// (percent).
inline constexpr uint64_t kWholeReadPercent = 95;

// ValidatePlanPart, then this node's share of the part.
absl::StatusOr<LocalPart> LocalPartOf(const peer::v1::PlanPart& part,
                                      const PlanPartContext& context);

// --- Multi-node saves (PlanPart.save) ----------------------------------------

// This node's share of a multi-node save, from a part that passed
// LocalSaveOf's checks.
struct LocalSave {
  // writes: world_size entries, non-empty only for this node's ranks;
  // tensors: every tensor of the save.
  ckpt::SavePlan plan;
  std::map<std::string, std::vector<std::string>> flat_mapping;
  bool overwrite = false;
};

// OK, or INVALID_ARGUMENT "job '<id>': plan part from <sender>: <field>:
// <why>" for the first field that fails:
//  - job_id is the context's; nodes as for a load part (this node and the
//    sender among them); no load fields (files, reads, ranks, nccl_id);
//  - save.unique_id is `unique_id` (the version every rank asked for), or,
//    when `picked` (the daemons pick: `unique_id` is this node's proposal,
//    SaveJoin.next_version), at least `unique_id`: a coordinator never
//    picks a version this node already holds;
//    save.checksum_block in [1, 1 GiB];
//  - save.tensors: distinct names, known dtypes, valid global shapes;
//  - save.writes: only this node's ranks, each at most once; every shard
//    one the rank handed over (same name, dtype, global shape, box and flat
//    range), at most once per rank, its tensor among save.tensors with the
//    same dtype and global shape; at most `limits.max_files` flat_mapping
//    entries. The bytes this node writes are thus always ones a rank gave.
absl::StatusOr<LocalSave> LocalSaveOf(const peer::v1::PlanPart& part,
                                      const PlanPartContext& context, int64_t unique_id,
                                      bool picked = false);

void ToMsg(const std::string& tensor, const ckpt::ShardMeta& s, peer::v1::ShardMsg* m);
// A shard a node reported (INVALID_ARGUMENT naming `who` when its dtype or
// box is unusable); the version's metadata is then checked whole
// (ckpt::SaveMetadataJson: files, bounds, sizes, checksum counts, coverage).
absl::StatusOr<std::pair<std::string, ckpt::ShardMeta>> FromMsg(const peer::v1::ShardMsg& m,
                                                                const std::string& who);

}  // namespace ckptd

#endif  // CKPTD_SERVER_MULTINODE_PLAN_CODEC_H_
