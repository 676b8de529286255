// Fuzz target: the multi-node plan part a daemon receives from its job's
// coordinator (Peer.Join's reply, proto/peer.proto) and checks, decodes and
// runs with server/plan_codec.h: the input is a serialized
// ckptd.peer.v1.PlanPart.
//
//  - FromMsg on every rank, every rank's targets and every read, and the
//    ToMsg round trip;
//  - ValidatePlanPart and LocalPartOf as RunDistributedJob calls them, with
//    the part's own job id, its first node as the sender, each of its first
//    three nodes as "this node", and its ranks' own targets as what this
//    node's ranks asked for (so every check past "is this my job and my
//    ranks" is reachable);
//  - a part that passes: its local plan is run by the executor
//    (core/exec/executor.h ExecutePlan, one thread) from a source of patterned
//    bytes into host buffers of exactly each target's size, so any index or
//    byte range ValidatePlanPart let through that the executor would take
//    out of bounds is an ASan report (parts with at most 256 KiB of targets
//    and 1 MiB of reads; once without checksum verification, which runs the
//    copies, and once with it when the plan has checksums).
//
// Properties: what FromMsg accepts survives ToMsg -> FromMsg unchanged
// (compared through deterministic serialization); a decoded rank's copies
// name existing targets and carry valid axis permutations; ValidatePlanPart
// and LocalPartOf agree, a refusal is INVALID_ARGUMENT naming the job; a
// local plan satisfies what the executor assumes (CheckPlan in
// fuzz_model.h), its reads are this node's, each once, and the reads it
// serves are its own.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/stubs/logging.h"
#include "core/exec/executor.h"
#include "core/plan/planner.h"
#include "proto/peer.pb.h"
#include "server/multinode/plan_codec.h"
#include "tests/fuzz/fuzz_model.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using ckptd::peer::v1::PlanPart;

constexpr uint64_t kMaxTargetBytes = 256 << 10;
constexpr uint64_t kMaxReadBytes = 1 << 20;

template <typename Msg>
std::string Bytes(const Msg& m) {
  std::string s;
  google::protobuf::io::StringOutputStream out(&s);
  google::protobuf::io::CodedOutputStream coded(&out);
  coded.SetSerializationDeterministic(true);
  m.SerializeToCodedStream(&coded);
  coded.Trim();
  return s;
}

// Bytes that depend on where they are in the file.
class PatternSource final : public ckpt::RangeSource {
 public:
  absl::StatusOr<ckpt::RangeView> Fetch(
      const std::string& file, uint64_t offset, uint64_t n, std::vector<uint8_t>& scratch,
      const std::function<absl::Status(const uint8_t*)>& verify) override {
    FUZZ_CHECK(n <= kMaxReadBytes, absl::StrCat("a fetch of ", n, " bytes"));
    if (scratch.size() < n) scratch.resize(n);
    for (uint64_t i = 0; i < n; ++i) scratch[i] = static_cast<uint8_t>((offset + i) * 131 + file.size());
    if (verify) {
      absl::Status s = verify(scratch.data());
      if (!s.ok()) return s;
    }
    return ckpt::RangeView{scratch.data(), nullptr, true};
  }
};

// The checks on one node's share of a part that passed.
void CheckLocalPart(const PlanPart& part, const ckptd::PlanPartContext& ctx,
                    const ckptd::LocalPart& local, const std::vector<ckpt::RankTargets>& ranks) {
  const ckpt::LoadPlan& plan = local.plan;
  ckptd_fuzz::CheckPlan(plan, ranks, "LocalPartOf");
  FUZZ_CHECK(plan.files.size() == static_cast<size_t>(part.files_size()), "files");
  FUZZ_CHECK(local.reader.size() == plan.reads.size(), "reader");
  FUZZ_CHECK(local.global_read.size() == plan.reads.size(), "global_read");
  FUZZ_CHECK(local.global_index.size() == plan.reads.size(), "a (file, offset) of two reads");
  std::map<uint32_t, int> position;  // read id -> its position in the part
  for (int k = 0; k < part.reads_size(); ++k) {
    const auto& rm = part.reads(k);
    position[rm.has_id() ? rm.id() : static_cast<uint32_t>(k)] = k;
  }
  for (size_t i = 0; i < local.global_read.size(); ++i) {
    const uint32_t g = local.global_read[i];
    FUZZ_CHECK(position.count(g) && local.reader.count(g) && (i == 0 || g > local.global_read[i - 1]),
               absl::StrCat("local read ", i, " is global read ", g));
    const auto& rm = part.reads(position[g]);
    FUZZ_CHECK(local.reader.at(g) == rm.reader(), "reader");
    const bool needed = std::find(rm.needed_by().begin(), rm.needed_by().end(), ctx.node) !=
                        rm.needed_by().end();
    FUZZ_CHECK(rm.reader() == ctx.node || needed, absl::StrCat("read ", g, " is not this node's"));
    auto it = local.global_index.find({plan.files[plan.reads[i].file], plan.reads[i].offset});
    FUZZ_CHECK(it != local.global_index.end() && it->second == g, "global_index");
  }
  for (const auto& [g, spans] : local.fetch_spans) {
    FUZZ_CHECK(local.reader.count(g) && local.reader.at(g) != ctx.node && !spans.empty() &&
                   spans.size() <= ckptd::kMaxFetchSpans,
               absl::StrCat("fetch spans of read ", g));
    const uint64_t length = part.reads(position[g]).length();
    for (size_t k = 0; k < spans.size(); ++k) {
      FUZZ_CHECK(spans[k].begin < spans[k].end && spans[k].end <= length &&
                     (k == 0 || spans[k].begin > spans[k - 1].end),
                 absl::StrCat("span ", k, " of read ", g));
    }
  }
  std::set<std::string> nodes(part.nodes().begin(), part.nodes().end());
  for (size_t i = 0; i < local.served.size(); ++i) {
    const ckptd::ServedRead& s = local.served[i];
    FUZZ_CHECK(local.reader.count(s.read) && local.reader.at(s.read) == ctx.node,
               absl::StrCat("serves read ", s.read, " it does not read"));
    FUZZ_CHECK(i == 0 || s.read > local.served[i - 1].read, "served order");
    FUZZ_CHECK(!s.needers.empty() && !s.needers.count(ctx.node), "needers");
    for (const std::string& n : s.needers) FUZZ_CHECK(nodes.count(n), "a needer not of the job");
  }
  for (const std::string& f : local.local_files) {
    FUZZ_CHECK(std::find(plan.files.begin(), plan.files.end(), f) != plan.files.end(), f);
  }

  // Run it, when small enough, into buffers of exactly each target's size.
  uint64_t target_bytes = 0, read_bytes = 0;
  for (const ckpt::RankPlan& rp : plan.ranks) {
    for (const ckpt::TargetTensor& t : rp.targets) target_bytes += t.num_bytes();
  }
  for (const ckpt::ReadRange& r : plan.reads) read_bytes += r.length;
  if (target_bytes > kMaxTargetBytes || read_bytes > kMaxReadBytes) return;
  std::vector<std::vector<std::vector<uint8_t>>> buffers(plan.ranks.size());
  std::vector<std::vector<void*>> dests(plan.ranks.size());
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    for (const ckpt::TargetTensor& t : plan.ranks[r].targets) {
      buffers[r].emplace_back(t.num_bytes());
      dests[r].push_back(buffers[r].back().data());
    }
  }
  bool checks = false;
  for (const ckpt::ReadRange& r : plan.reads) checks = checks || !r.checks.empty();
  // Unverified (the pattern fails every checksum: this is what runs the
  // copies), then verified when there is something to verify.
  for (const bool verify : {false, true}) {
    if (verify && !checks) break;
    PatternSource source;
    ckpt::ExecuteOptions eo;
    eo.threads = 1;
    eo.verify_checksums = verify;
    eo.piece_bytes = 64;
    auto stats = ckpt::ExecutePlan(plan, source, dests, eo);
    ckptd_fuzz::Note(verify ? "ExecutePlan(verify)" : "ExecutePlan", stats.status());
  }
}

}  // namespace

// Protobuf logs an ERROR line for every string field with invalid UTF-8 it
// parses: half a gigabyte an hour of a long run's log, none of it a finding
// (the parse result is what the target checks). Dropped.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  PlanPart part;
  const bool parsed = part.ParseFromArray(data, static_cast<int>(size));
  ckptd_fuzz::Note("ParseFromArray", parsed ? absl::OkStatus() : absl::DataLossError("no"));
  if (!parsed) return 0;

  for (const auto& rm : part.ranks()) {
    for (const auto& tm : rm.targets()) {
      auto t = ckptd::FromMsg(tm);
      if (t.ok()) (void)ckpt::ValidateTarget(rm.rank(), *t);
    }
    auto r = ckptd::FromMsg(rm);
    ckptd_fuzz::Note("FromMsg(RankPlanMsg)", r.status());
    if (!r.ok()) continue;
    for (const ckpt::CopyOp& c : r->copies) {
      FUZZ_CHECK(c.target < r->targets.size(), absl::StrCat("copy names target ", c.target));
      if (!c.src.perm.empty()) {
        std::vector<bool> seen(c.src.box.rank(), false);
        FUZZ_CHECK(c.src.perm.size() == c.src.box.rank(), "perm rank");
        for (int a : c.src.perm) {
          FUZZ_CHECK(a >= 0 && static_cast<size_t>(a) < seen.size() && !seen[a], "perm axis");
          seen[a] = true;
        }
      }
    }
    ckptd::peer::v1::RankPlanMsg m1, m2;
    ckptd::ToMsg(*r, &m1);
    auto r2 = ckptd::FromMsg(m1);
    FUZZ_CHECK(r2.ok(), r2.status().ToString());
    ckptd::ToMsg(*r2, &m2);
    FUZZ_CHECK(Bytes(m1) == Bytes(m2), "RankPlanMsg round trip differs");
  }
  for (const auto& read : part.reads()) {
    ckpt::ReadRange r = ckptd::FromMsg(read);
    ckptd::peer::v1::ReadMsg m1, m2;
    ckptd::ToMsg(r, &m1);
    ckptd::ToMsg(ckptd::FromMsg(m1), &m2);
    FUZZ_CHECK(Bytes(m1) == Bytes(m2), "ReadMsg round trip differs");
  }

  // What this node's ranks asked for: the part's own targets.
  std::vector<ckpt::RankTargets> asked;
  int max_rank = 0;
  for (const auto& rm : part.ranks()) {
    ckpt::RankTargets rt;
    rt.rank = rm.rank();
    max_rank = std::max(max_rank, rm.rank());
    for (const auto& tm : rm.targets()) {
      auto t = ckptd::FromMsg(tm);
      if (t.ok()) rt.tensors.push_back(*std::move(t));
    }
    asked.push_back(std::move(rt));
  }
  ckptd::PlanPartContext ctx;
  ctx.job_id = part.job_id();
  ctx.sender = part.nodes_size() > 0 ? part.nodes(0) : "";
  ctx.world_size = max_rank == INT_MAX ? INT_MAX : max_rank + 1;
  for (const auto& rt : asked) ctx.ranks.push_back(&rt);
  ctx.limits.max_read_bytes = kMaxReadBytes;
  const int mes = std::max(1, std::min(3, part.nodes_size()));
  for (int n = 0; n < mes; ++n) {
    ctx.node = part.nodes_size() > 0 ? part.nodes(n) : "";
    const absl::Status valid = ckptd::ValidatePlanPart(part, ctx);
    ckptd_fuzz::Note("ValidatePlanPart", valid);
    auto local = ckptd::LocalPartOf(part, ctx);
    FUZZ_CHECK(local.status() == valid, local.status().ToString());
    if (!valid.ok()) {
      FUZZ_CHECK(valid.code() == absl::StatusCode::kInvalidArgument, valid.ToString());
      FUZZ_CHECK(absl::StartsWith(valid.message(), absl::StrCat("job '", ctx.job_id, "': plan part")),
                 valid.ToString());
      continue;
    }
    CheckLocalPart(part, ctx, *local, asked);
  }

  // A save part (PlanPart.save) as RunDistributedSave checks it: this
  // node's ranks handed over the shards the part's own writes name (those
  // that parse), in a world just large enough for them.
  if (part.has_save()) {
    std::vector<ckpt::RankTargets> handed;
    int world = 0;
    for (const auto& rw : part.save().writes()) {
      if (rw.rank() < 0 || rw.rank() >= 1 << 16) continue;
      world = std::max(world, rw.rank() + 1);
      ckpt::RankTargets rt;
      rt.rank = rw.rank();
      for (const auto& tm : rw.targets()) {
        auto t = ckptd::FromMsg(tm);
        if (t.ok()) rt.tensors.push_back(*std::move(t));
      }
      handed.push_back(std::move(rt));
    }
    ckptd::PlanPartContext sctx = ctx;
    sctx.node = part.nodes_size() > 0 ? part.nodes(0) : "";
    sctx.world_size = world;
    sctx.ranks.clear();
    for (const auto& rt : handed) sctx.ranks.push_back(&rt);
    auto local = ckptd::LocalSaveOf(part, sctx, part.save().unique_id());
    ckptd_fuzz::Note("LocalSaveOf", local.status());
    if (!local.ok()) {
      FUZZ_CHECK(local.status().code() == absl::StatusCode::kInvalidArgument, local.status().ToString());
      FUZZ_CHECK(absl::StartsWith(local.status().message(),
                                  absl::StrCat("job '", sctx.job_id, "': plan part")),
                 local.status().ToString());
    } else {
      // Every shard to write is one a rank of this node handed over, and
      // its tensor's dtype and global shape are the metadata's.
      FUZZ_CHECK(local->plan.writes.size() == static_cast<size_t>(world), "writes size");
      for (size_t r = 0; r < local->plan.writes.size(); ++r) {
        for (const ckpt::TargetTensor& t : local->plan.writes[r]) {
          bool found = false;
          for (const auto& rt : handed) {
            if (rt.rank != static_cast<int>(r)) continue;
            for (const auto& g : rt.tensors) found |= g.name == t.name && g.box == t.box && g.dtype == t.dtype;
          }
          FUZZ_CHECK(found, absl::StrCat("rank ", r, " writes '", t.name, "' it did not hand over"));
          const auto& info = local->plan.tensors.at(t.name);
          FUZZ_CHECK(info.first == t.dtype && info.second == t.global_shape, "tensor info");
        }
      }
    }
    // The daemons pick the version (SaveJoin.next_version): a part whose
    // version is this node's proposal is taken exactly as above; one older
    // than the proposal is refused.
    const int64_t uid = part.save().unique_id();
    auto picked = ckptd::LocalSaveOf(part, sctx, uid, /*picked=*/true);
    FUZZ_CHECK(picked.ok() == local.ok(), picked.status().ToString());
    if (uid < std::numeric_limits<int64_t>::max()) {
      auto older = ckptd::LocalSaveOf(part, sctx, uid + 1, /*picked=*/true);
      FUZZ_CHECK(!older.ok() && older.status().code() == absl::StatusCode::kInvalidArgument,
                 older.status().ToString());
    }
  }
  return 0;
}
