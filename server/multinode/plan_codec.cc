#include "server/multinode/plan_codec.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/base/box.h"
#include "core/base/dtype.h"
#include "core/format/metadata.h"
#include "core/base/status_macros.h"

namespace ckptd {
namespace {

void ToMsg(const ckpt::Box& b, peer::v1::BoxMsg* m) {
  for (int64_t d : b.offset) m->add_offset(d);
  for (int64_t d : b.shape) m->add_shape(d);
}

ckpt::Box FromMsg(const peer::v1::BoxMsg& m) {
  return ckpt::Box{ckpt::Shape(m.offset().begin(), m.offset().end()),
                   ckpt::Shape(m.shape().begin(), m.shape().end())};
}

}  // namespace

void ToMsg(const ckpt::TargetTensor& t, peer::v1::TargetMsg* m) {
  m->set_name(t.name);
  m->set_dtype(std::string(ckpt::DTypeName(t.dtype)));
  for (int64_t d : t.global_shape) m->add_global_shape(d);
  ToMsg(t.box, m->mutable_box());
  if (t.flat_range) {
    m->mutable_flat_range()->set_begin(t.flat_range->begin);
    m->mutable_flat_range()->set_end(t.flat_range->end);
  }
}

absl::StatusOr<ckpt::TargetTensor> FromMsg(const peer::v1::TargetMsg& m) {
  ckpt::TargetTensor t;
  t.name = m.name();
  CKPT_ASSIGN_OR_RETURN(t.dtype, ckpt::ParseDType(m.dtype()));
  t.global_shape.assign(m.global_shape().begin(), m.global_shape().end());
  t.box = FromMsg(m.box());
  if (m.has_flat_range()) t.flat_range = ckpt::FlatRange{m.flat_range().begin(), m.flat_range().end()};
  return t;
}

void ToMsg(const ckpt::RankPlan& r, peer::v1::RankPlanMsg* m) {
  m->set_rank(r.rank);
  for (const auto& t : r.targets) ToMsg(t, m->add_targets());
  for (const ckpt::CopyOp& c : r.copies) {
    peer::v1::CopyMsg* cm = m->add_copies();
    cm->set_target(c.target);
    cm->set_read(c.read);
    ToMsg(c.src.box, cm->mutable_src()->mutable_box());
    cm->mutable_src()->set_flat_begin(c.src.flat_begin);
    cm->mutable_src()->set_flat_end(c.src.flat_end);
    cm->mutable_src()->set_dtype(std::string(ckpt::DTypeName(c.src.dtype)));
    for (int a : c.src.perm) cm->mutable_src()->add_perm(a);
    cm->set_src_offset(c.src_offset);
    ToMsg(c.region, cm->mutable_region());
    cm->set_elements(c.elements);
  }
  for (const auto& k : r.missing_keys) m->add_missing_keys(k);
  m->set_local_fast_path(r.local_fast_path);
}

absl::StatusOr<ckpt::RankPlan> FromMsg(const peer::v1::RankPlanMsg& m) {
  ckpt::RankPlan r;
  r.rank = m.rank();
  for (const auto& t : m.targets()) {
    CKPT_ASSIGN_OR_RETURN(ckpt::TargetTensor tt, FromMsg(t));
    r.targets.push_back(std::move(tt));
  }
  for (const auto& cm : m.copies()) {
    ckpt::CopyOp c;
    c.target = cm.target();
    c.read = cm.read();
    c.src.box = FromMsg(cm.src().box());
    c.src.flat_begin = cm.src().flat_begin();
    c.src.flat_end = cm.src().flat_end();
    CKPT_ASSIGN_OR_RETURN(c.src.dtype, ckpt::ParseDType(cm.src().dtype()));
    c.src.perm.assign(cm.src().perm().begin(), cm.src().perm().end());
    if (!c.src.perm.empty()) {
      // A permutation of the box's axes, or the copy could index anywhere.
      std::vector<bool> seen(c.src.box.rank(), false);
      bool ok = c.src.perm.size() == c.src.box.rank();
      for (int a : c.src.perm) {
        ok = ok && a >= 0 && static_cast<size_t>(a) < seen.size() && !seen[a];
        if (ok) seen[a] = true;
      }
      if (!ok) {
        return absl::DataLossError(absl::StrCat("plan part: copy of rank ", r.rank,
                                                " has an invalid axis permutation"));
      }
    }
    c.src_offset = cm.src_offset();
    c.region = FromMsg(cm.region());
    c.elements = cm.elements();
    if (c.target >= r.targets.size()) {
      return absl::DataLossError(absl::StrCat("plan part: copy of rank ", r.rank,
                                              " names target ", c.target, " of ", r.targets.size()));
    }
    r.copies.push_back(std::move(c));
  }
  r.missing_keys.assign(m.missing_keys().begin(), m.missing_keys().end());
  r.local_fast_path = m.local_fast_path();
  return r;
}

void ToMsg(const ckpt::ReadRange& r, peer::v1::ReadMsg* m) {
  m->set_file(r.file);
  m->set_offset(r.offset);
  m->set_length(r.length);
  for (const auto& c : r.checks) {
    peer::v1::CheckMsg* cm = m->add_checks();
    cm->set_tensor(c.tensor);
    cm->set_offset(c.offset);
    cm->set_nbytes(c.nbytes);
    cm->set_xxh3(c.xxh3);
  }
}

ckpt::ReadRange FromMsg(const peer::v1::ReadMsg& m) {
  ckpt::ReadRange r;
  r.file = m.file();
  r.offset = m.offset();
  r.length = m.length();
  for (const auto& c : m.checks()) r.checks.push_back({c.tensor(), c.offset(), c.nbytes(), c.xxh3()});
  return r;
}

namespace {

constexpr size_t kNcclIdBytes = 128;  // sizeof(ncclUniqueId)
constexpr uint64_t kMaxFileOffset = static_cast<uint64_t>(INT64_MAX);  // off_t
constexpr size_t kMaxFileNameBytes = 255;                             // NAME_MAX

// A string from the peer as it appears in a message: escaped, at most 64
// bytes of it.
std::string Shown(absl::string_view s) {
  constexpr size_t kMax = 64;
  std::string out = absl::StrCat("'", absl::CEscape(s.substr(0, kMax)), "'");
  if (s.size() > kMax) absl::StrAppend(&out, "... (", s.size(), " bytes)");
  return out;
}

// Why a box from the wire is unusable ("" if it is not): offset and shape of
// the same rank, offsets and extents >= 0, offset + extent within int64.
std::string BoxProblem(const peer::v1::BoxMsg& m) {
  if (m.offset_size() != m.shape_size()) {
    return absl::StrCat("offset has ", m.offset_size(), " axes, shape ", m.shape_size());
  }
  for (int i = 0; i < m.shape_size(); ++i) {
    const int64_t o = m.offset(i), n = m.shape(i);
    if (o < 0 || n < 0 || o > INT64_MAX - n) {
      return absl::StrCat("axis ", i, ": offset ", o, " and extent ", n,
                          " are not a range of non-negative int64 indices");
    }
  }
  return "";
}

ckpt::Box ToBox(const peer::v1::BoxMsg& m) { return FromMsg(m); }

bool SameTarget(const ckpt::TargetTensor& a, const ckpt::TargetTensor& b) {
  return a.name == b.name && a.dtype == b.dtype && a.global_shape == b.global_shape &&
         a.box == b.box && a.flat_range.has_value() == b.flat_range.has_value() &&
         (!a.flat_range || *a.flat_range == *b.flat_range);
}

std::string TargetString(const ckpt::TargetTensor& t) {
  std::string s = absl::StrCat(Shown(t.name), " ", ckpt::DTypeName(t.dtype), " ",
                               ckpt::BoxString(t.box), " of ", ckpt::ShapeString(t.global_shape));
  if (t.flat_range) absl::StrAppend(&s, " flat [", t.flat_range->begin, ", ", t.flat_range->end, ")");
  return s;
}

class PartChecker {
 public:
  PartChecker(const peer::v1::PlanPart& part, const PlanPartContext& ctx)
      : part_(part), ctx_(ctx), limits_(ctx.limits) {}

  absl::Status Check() {
    CKPT_RETURN_IF_ERROR(CheckCounts());
    if (part_.job_id() != ctx_.job_id) {
      return Bad("job_id", absl::StrCat(Shown(part_.job_id()), " is not this job"));
    }
    if (!part_.nccl_id().empty() && part_.nccl_id().size() != kNcclIdBytes) {
      return Bad("nccl_id", absl::StrCat(part_.nccl_id().size(), " bytes, not an ncclUniqueId (",
                                         kNcclIdBytes, ")"));
    }
    CKPT_RETURN_IF_ERROR(CheckNodes());
    CKPT_RETURN_IF_ERROR(CheckFiles());
    CKPT_RETURN_IF_ERROR(CheckReads());
    return CheckRanks();
  }

 private:
  absl::Status Bad(absl::string_view field, absl::string_view why) const {
    return absl::InvalidArgumentError(absl::StrCat(
        "job '", ctx_.job_id, "': plan part",
        ctx_.sender.empty() ? std::string() : absl::StrCat(" from ", ctx_.sender), ": ", field,
        ": ", why));
  }

  absl::Status CheckCounts() const {
    struct Count {
      const char* field;
      uint64_t n, max;
    };
    for (const Count& c : {Count{"files", static_cast<uint64_t>(part_.files_size()), limits_.max_files},
                           Count{"reads", static_cast<uint64_t>(part_.reads_size()), limits_.max_reads},
                           Count{"nodes", static_cast<uint64_t>(part_.nodes_size()), limits_.max_nodes}}) {
      if (c.n > c.max) return Bad(c.field, absl::StrCat(c.n, " entries, over the limit of ", c.max));
    }
    return absl::OkStatus();
  }

  absl::Status CheckNodes() {
    for (int n = 0; n < part_.nodes_size(); ++n) {
      const std::string& a = part_.nodes(n);
      const std::string f = absl::StrCat("nodes[", n, "]");
      if (a.empty()) return Bad(f, "empty");
      if (a.size() > limits_.max_node_bytes) {
        return Bad(f, absl::StrCat(a.size(), " bytes, over the limit of ", limits_.max_node_bytes));
      }
      if (!nodes_.insert(a).second) return Bad(f, absl::StrCat(Shown(a), " appears twice"));
    }
    if (!nodes_.count(ctx_.node)) {
      return Bad("nodes", absl::StrCat("this node ", Shown(ctx_.node), " is not among them"));
    }
    if (!ctx_.sender.empty() && !nodes_.count(ctx_.sender)) {
      return Bad("nodes", absl::StrCat("the sender ", Shown(ctx_.sender), " is not among them"));
    }
    return absl::OkStatus();
  }

  absl::Status CheckFiles() const {
    std::set<absl::string_view> seen;
    for (int i = 0; i < part_.files_size(); ++i) {
      const std::string& name = part_.files(i);
      const std::string f = absl::StrCat("files[", i, "]");
      if (!ckpt::IsPlainFileName(name) || name.size() > kMaxFileNameBytes) {
        return Bad(f, absl::StrCat(Shown(name), " is not a plain file name inside the checkpoint "
                                                "directory"));
      }
      if (!seen.insert(name).second) return Bad(f, absl::StrCat(Shown(name), " appears twice"));
    }
    return absl::OkStatus();
  }

  bool IsNode(const std::string& a) const { return nodes_.count(a) > 0; }

  absl::Status CheckReads() {
    mine_.assign(static_cast<size_t>(part_.reads_size()), false);
    uint64_t prev_id = 0;
    for (int g = 0; g < part_.reads_size(); ++g) {
      const peer::v1::ReadMsg& r = part_.reads(g);
      const std::string f = absl::StrCat("reads[", g, "]");
      if (r.file() >= static_cast<uint32_t>(part_.files_size())) {
        return Bad(absl::StrCat(f, ".file"), absl::StrCat(r.file(), " is not an index into files (",
                                                          part_.files_size(), " files)"));
      }
      if (r.length() > limits_.max_read_bytes) {
        return Bad(absl::StrCat(f, ".length"),
                   absl::StrCat(r.length(), " bytes, over the longest read this node takes (",
                                limits_.max_read_bytes, " bytes: io_request_size)"));
      }
      if (r.offset() > kMaxFileOffset - r.length()) {
        return Bad(absl::StrCat(f, ".offset"),
                   absl::StrCat("offset ", r.offset(), " + length ", r.length(),
                                " is past the largest file offset"));
      }
      const uint64_t id = r.has_id() ? r.id() : static_cast<uint64_t>(g);
      if (id >= limits_.max_reads || (g > 0 && id <= prev_id)) {
        return Bad(absl::StrCat(f, ".id"),
                   absl::StrCat(id, " is not above reads[", g - 1, "]'s ", prev_id,
                                " and below ", limits_.max_reads,
                                " (reads ascend by their index in the job's plan)"));
      }
      prev_id = id;
      if (g > 0) {
        const peer::v1::ReadMsg& p = part_.reads(g - 1);
        const std::string& pf = part_.files(static_cast<int>(p.file()));
        const std::string& rf = part_.files(static_cast<int>(r.file()));
        const bool after = p.file() == r.file()
                               ? r.offset() > p.offset() && r.offset() >= p.offset() + p.length()
                               : pf < rf;
        if (!after) {
          return Bad(f, absl::StrCat("[", r.offset(), ", +", r.length(), ") of ", Shown(rf),
                                     " is not after reads[", g - 1, "] [", p.offset(), ", +",
                                     p.length(), ") of ", Shown(pf),
                                     " (reads are sorted by file name and offset, disjoint)"));
        }
      }
      for (int k = 0; k < r.checks_size(); ++k) {
        const peer::v1::CheckMsg& c = r.checks(k);
        if (c.offset() < r.offset() || c.offset() - r.offset() > r.length() ||
            c.nbytes() > r.length() - (c.offset() - r.offset())) {
          return Bad(absl::StrCat(f, ".checks[", k, "]"),
                     absl::StrCat("bytes [", c.offset(), ", +", c.nbytes(),
                                  ") are not inside the read [", r.offset(), ", +", r.length(),
                                  ")"));
        }
      }
      if (!r.reader().empty() && !IsNode(r.reader())) {
        return Bad(absl::StrCat(f, ".reader"),
                   absl::StrCat(Shown(r.reader()), " is not a node of the job"));
      }
      bool needed_here = false;
      std::set<absl::string_view> needers;
      for (int k = 0; k < r.needed_by_size(); ++k) {
        const std::string& n = r.needed_by(k);
        const std::string nf = absl::StrCat(f, ".needed_by[", k, "]");
        if (!IsNode(n)) return Bad(nf, absl::StrCat(Shown(n), " is not a node of the job"));
        if (!needers.insert(n).second) return Bad(nf, absl::StrCat(Shown(n), " appears twice"));
        needed_here = needed_here || n == ctx_.node;
      }
      if (needed_here && r.reader().empty()) {
        return Bad(absl::StrCat(f, ".reader"), "empty, but this node needs the read");
      }
      mine_[g] = needed_here || r.reader() == ctx_.node;
    }
    return absl::OkStatus();
  }

  absl::Status CheckRanks() const {
    if (static_cast<size_t>(part_.ranks_size()) != ctx_.ranks.size()) {
      return Bad("ranks", absl::StrCat(part_.ranks_size(), " ranks, but this node serves ",
                                       ctx_.ranks.size()));
    }
    for (int k = 0; k < part_.ranks_size(); ++k) {
      CKPT_RETURN_IF_ERROR(CheckRank(k, part_.ranks(k), *ctx_.ranks[static_cast<size_t>(k)]));
    }
    return absl::OkStatus();
  }

  absl::Status CheckRank(int k, const peer::v1::RankPlanMsg& m, const ckpt::RankTargets& want) const {
    const std::string f = absl::StrCat("ranks[", k, "]");
    if (m.rank() < 0 || m.rank() >= ctx_.world_size) {
      return Bad(absl::StrCat(f, ".rank"),
                 absl::StrCat(m.rank(), " is outside the job's world of ", ctx_.world_size, " ranks"));
    }
    if (m.rank() != want.rank) {
      return Bad(absl::StrCat(f, ".rank"),
                 absl::StrCat(m.rank(), ", but this node's rank ", k, " is ", want.rank));
    }
    if (static_cast<size_t>(m.targets_size()) != want.tensors.size()) {
      return Bad(absl::StrCat(f, ".targets"),
                 absl::StrCat(m.targets_size(), " targets, but rank ", want.rank, " asked for ",
                              want.tensors.size()));
    }
    std::vector<ckpt::TargetTensor> targets;
    targets.reserve(want.tensors.size());
    for (int j = 0; j < m.targets_size(); ++j) {
      const std::string tf = absl::StrCat(f, ".targets[", j, "]");
      absl::StatusOr<ckpt::TargetTensor> t = ckptd::FromMsg(m.targets(j));
      if (!t.ok()) return Bad(tf, t.status().message());
      if (std::string p = BoxProblem(m.targets(j).box()); !p.empty()) {
        return Bad(absl::StrCat(tf, ".box"), p);
      }
      if (absl::Status v = ckpt::ValidateTarget(m.rank(), *t); !v.ok()) return Bad(tf, v.message());
      const ckpt::TargetTensor& w = want.tensors[static_cast<size_t>(j)];
      if (!SameTarget(*t, w)) {
        return Bad(tf, absl::StrCat(TargetString(*t), " is not the target rank ", want.rank,
                                    " asked for: ", TargetString(w)));
      }
      targets.push_back(*std::move(t));
    }
    if (m.missing_keys_size() > m.targets_size()) {
      return Bad(absl::StrCat(f, ".missing_keys"),
                 absl::StrCat(m.missing_keys_size(), " keys for ", m.targets_size(), " targets"));
    }
    if (static_cast<uint64_t>(m.copies_size()) > limits_.max_copies_per_rank) {
      return Bad(absl::StrCat(f, ".copies"), absl::StrCat(m.copies_size(), " copies, over the limit of ",
                                                         limits_.max_copies_per_rank));
    }
    for (int i = 0; i < m.copies_size(); ++i) {
      CKPT_RETURN_IF_ERROR(CheckCopy(absl::StrCat(f, ".copies[", i, "]"), m.copies(i), targets));
    }
    return absl::OkStatus();
  }

  absl::Status CheckCopy(const std::string& f, const peer::v1::CopyMsg& c,
                         const std::vector<ckpt::TargetTensor>& targets) const {
    if (c.target() >= targets.size()) {
      return Bad(absl::StrCat(f, ".target"), absl::StrCat(c.target(), " is not an index into the rank's ",
                                                         targets.size(), " targets"));
    }
    if (c.read() >= static_cast<uint32_t>(part_.reads_size())) {
      return Bad(absl::StrCat(f, ".read"), absl::StrCat(c.read(), " is not an index into reads (",
                                                       part_.reads_size(), " reads)"));
    }
    if (!mine_[c.read()]) {
      return Bad(absl::StrCat(f, ".read"),
                 absl::StrCat("read ", c.read(), " is neither read by this node nor needed by it"));
    }
    const ckpt::TargetTensor& t = targets[c.target()];
    const peer::v1::LayoutMsg& src = c.src();
    absl::StatusOr<ckpt::DType> dtype = ckpt::ParseDType(src.dtype());
    if (!dtype.ok()) return Bad(absl::StrCat(f, ".src.dtype"), dtype.status().message());
    if (!ckpt::CanConvert(*dtype, t.dtype)) {
      return Bad(absl::StrCat(f, ".src.dtype"),
                 absl::StrCat(ckpt::DTypeName(*dtype), " does not convert to the target's ",
                              ckpt::DTypeName(t.dtype)));
    }
    if (std::string p = BoxProblem(src.box()); !p.empty()) return Bad(absl::StrCat(f, ".src.box"), p);
    const ckpt::Box src_box = ToBox(src.box());
    absl::StatusOr<int64_t> src_bytes =
        ckpt::CheckedNumBytes(src_box.shape, ckpt::DTypeSize(*dtype));
    if (!src_bytes.ok()) return Bad(absl::StrCat(f, ".src.box"), src_bytes.status().message());
    const int64_t numel = ckpt::NumElements(src_box.shape);
    if (src.flat_begin() < 0 || src.flat_begin() > src.flat_end() || src.flat_end() > numel) {
      return Bad(absl::StrCat(f, ".src.flat_begin"),
                 absl::StrCat("[", src.flat_begin(), ", ", src.flat_end(),
                              ") is not a range inside the source box's ", numel, " elements"));
    }
    if (src.perm_size() > 0) {
      std::vector<bool> seen(src_box.rank(), false);
      bool ok = static_cast<size_t>(src.perm_size()) == src_box.rank();
      for (int a : src.perm()) {
        ok = ok && a >= 0 && static_cast<size_t>(a) < seen.size() && !seen[static_cast<size_t>(a)];
        if (ok) seen[static_cast<size_t>(a)] = true;
      }
      if (!ok) return Bad(absl::StrCat(f, ".src.perm"), "not a permutation of the source box's axes");
    }
    if (std::string p = BoxProblem(c.region()); !p.empty()) return Bad(absl::StrCat(f, ".region"), p);
    const ckpt::Box region = ToBox(c.region());
    if (region.rank() != t.box.rank() || !ckpt::Contains(t.box, region)) {
      return Bad(absl::StrCat(f, ".region"),
                 absl::StrCat(ckpt::BoxString(region), " is not inside the target box ",
                              ckpt::BoxString(t.box)));
    }
    if (region.rank() != src_box.rank() || !ckpt::Contains(src_box, region)) {
      return Bad(absl::StrCat(f, ".region"),
                 absl::StrCat(ckpt::BoxString(region), " is not inside the source box ",
                              ckpt::BoxString(src_box)));
    }
    const int64_t region_numel = ckpt::NumElements(region.shape);  // <= the target box's
    if (c.elements() < 0 || c.elements() > region_numel) {
      return Bad(absl::StrCat(f, ".elements"),
                 absl::StrCat(c.elements(), " is not a count of the region's ", region_numel,
                              " elements"));
    }
    const peer::v1::ReadMsg& r = part_.reads(static_cast<int>(c.read()));
    const uint64_t n = static_cast<uint64_t>(src.flat_end() - src.flat_begin()) *
                       ckpt::DTypeSize(*dtype);  // <= *src_bytes
    if (c.src_offset() < r.offset() || c.src_offset() - r.offset() > r.length() ||
        n > r.length() - (c.src_offset() - r.offset())) {
      return Bad(absl::StrCat(f, ".src_offset"),
                 absl::StrCat("source bytes [", c.src_offset(), ", +", n,
                              ") are not inside read ", c.read(), " [", r.offset(), ", +",
                              r.length(), ")"));
    }
    return absl::OkStatus();
  }

  const peer::v1::PlanPart& part_;
  const PlanPartContext& ctx_;
  const PlanPartLimits& limits_;
  std::set<absl::string_view> nodes_;  // views into part_.nodes()
  std::vector<bool> mine_;             // per read: read or fetched by this node
};

}  // namespace

absl::Status ValidatePlanPart(const peer::v1::PlanPart& part, const PlanPartContext& context) {
  return PartChecker(part, context).Check();
}

absl::StatusOr<LocalPart> LocalPartOf(const peer::v1::PlanPart& part,
                                      const PlanPartContext& context) {
  CKPT_RETURN_IF_ERROR(ValidatePlanPart(part, context));
  const std::string& me = context.node;
  LocalPart out;
  out.plan.files.assign(part.files().begin(), part.files().end());
  constexpr uint32_t kNone = UINT32_MAX;
  std::vector<uint32_t> local_of(static_cast<size_t>(part.reads_size()), kNone);
  for (int g = 0; g < part.reads_size(); ++g) {
    const peer::v1::ReadMsg& rm = part.reads(g);
    // Validated: ascending, below max_reads.
    const uint32_t gi = rm.has_id() ? rm.id() : static_cast<uint32_t>(g);
    const bool needed_here =
        std::find(rm.needed_by().begin(), rm.needed_by().end(), me) != rm.needed_by().end();
    if (rm.reader() != me && !needed_here) continue;
    out.reader[gi] = rm.reader();
    local_of[static_cast<size_t>(g)] = static_cast<uint32_t>(out.plan.reads.size());
    out.global_read.push_back(gi);
    out.plan.reads.push_back(FromMsg(rm));
    const std::string& file = out.plan.files[rm.file()];
    out.global_index[{file, rm.offset()}] = gi;
    if (rm.reader() != me) continue;
    out.local_files.insert(file);
    ServedRead sv;
    sv.read = gi;
    sv.length = rm.length();
    for (const auto& n : rm.needed_by()) {
      if (n != me) sv.needers.insert(n);
    }
    if (!sv.needers.empty()) out.served.push_back(std::move(sv));
  }
  for (const auto& rpm : part.ranks()) {
    CKPT_ASSIGN_OR_RETURN(ckpt::RankPlan rp, FromMsg(rpm));
    for (ckpt::CopyOp& c : rp.copies) c.read = local_of[c.read];  // validated: one of ours
    out.plan.ranks.push_back(std::move(rp));
  }
  // What to fetch of each read a peer makes: the bytes the ranks here copy.
  std::vector<std::vector<ckpt::ReadSpan>> needed = ckpt::NeededSpans(out.plan, kMaxFetchSpans);
  for (size_t l = 0; l < out.plan.reads.size(); ++l) {
    const uint32_t g = out.global_read[l];
    if (out.reader[g] == me || needed[l].empty()) continue;
    if (ckpt::SpanBytes(needed[l]) * 100 >= out.plan.reads[l].length * kWholeReadPercent) continue;
    out.fetch_spans[g] = std::move(needed[l]);
  }
  return out;
}

absl::StatusOr<LocalSave> LocalSaveOf(const peer::v1::PlanPart& part,
                                      const PlanPartContext& context, int64_t unique_id,
                                      bool picked) {
  const std::string from =
      context.sender.empty() ? std::string() : absl::StrCat(" from ", context.sender);
  auto bad = [&](absl::string_view field, absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("job '", context.job_id, "': plan part", from, ": ", field, ": ", why));
  };
  if (part.job_id() != context.job_id) {
    return bad("job_id", absl::StrCat(Shown(part.job_id()), " is not this job"));
  }
  if (!part.has_save()) return bad("save", "missing (this node's ranks are saving)");
  if (part.files_size() || part.reads_size() || part.ranks_size() || !part.nccl_id().empty()) {
    return bad("files/reads/ranks/nccl_id", "a save part carries no load plan");
  }
  // Nodes: the checks of a load part.
  peer::v1::PlanPart nodes_only;
  nodes_only.set_job_id(part.job_id());
  *nodes_only.mutable_nodes() = part.nodes();
  PlanPartContext no_ranks = context;
  no_ranks.ranks.clear();
  CKPT_RETURN_IF_ERROR(ValidatePlanPart(nodes_only, no_ranks));
  const peer::v1::SavePart& sp = part.save();
  if (picked && sp.unique_id() < unique_id) {
    return bad("save.unique_id",
               absl::StrCat(sp.unique_id(), " but this node's directory is at version ",
                            unique_id - 1, " (the daemons pick the version: it must be newer)"));
  }
  if (!picked && sp.unique_id() != unique_id) {
    return bad("save.unique_id", absl::StrCat(sp.unique_id(), " but the ranks save version ", unique_id));
  }
  constexpr uint64_t kMaxChecksumBlock = 1ull << 30;
  if (sp.checksum_block() == 0 || sp.checksum_block() > kMaxChecksumBlock) {
    return bad("save.checksum_block", absl::StrCat(sp.checksum_block(), " is not in [1, ",
                                                   kMaxChecksumBlock, "]"));
  }
  LocalSave out;
  out.overwrite = sp.overwrite();
  out.plan.unique_id = sp.unique_id();
  out.plan.checksum_block = sp.checksum_block();
  out.plan.world_size = context.world_size;
  out.plan.writes.resize(static_cast<size_t>(std::max(context.world_size, 0)));
  for (int i = 0; i < sp.tensors_size(); ++i) {
    const peer::v1::TensorInfoMsg& t = sp.tensors(i);
    const std::string f = absl::StrCat("save.tensors[", i, "]");
    auto dtype = ckpt::ParseDType(t.dtype());
    if (!dtype.ok()) return bad(f, dtype.status().message());
    ckpt::Shape shape(t.global_shape().begin(), t.global_shape().end());
    if (auto n = ckpt::CheckedNumBytes(shape, ckpt::DTypeSize(*dtype)); !n.ok()) {
      return bad(f, n.status().message());
    }
    if (!out.plan.tensors.emplace(t.name(), std::make_pair(*dtype, shape)).second) {
      return bad(f, absl::StrCat(Shown(t.name()), " appears twice"));
    }
  }
  std::map<int, const ckpt::RankTargets*> mine;
  for (const ckpt::RankTargets* r : context.ranks) mine[r->rank] = r;
  std::set<int> seen_ranks;
  for (int w = 0; w < sp.writes_size(); ++w) {
    const peer::v1::RankTargetsMsg& rw = sp.writes(w);
    const std::string f = absl::StrCat("save.writes[", w, "]");
    auto rank = mine.find(rw.rank());
    if (rank == mine.end() || rw.rank() < 0 || rw.rank() >= context.world_size) {
      return bad(f, absl::StrCat("rank ", rw.rank(), " is not served here"));
    }
    if (!seen_ranks.insert(rw.rank()).second) return bad(f, absl::StrCat("rank ", rw.rank(), " twice"));
    std::set<std::string> names;
    for (int t = 0; t < rw.targets_size(); ++t) {
      const std::string tf = absl::StrCat(f, ".targets[", t, "]");
      if (std::string p = BoxProblem(rw.targets(t).box()); !p.empty()) return bad(tf, p);
      auto tt = FromMsg(rw.targets(t));
      if (!tt.ok()) return bad(tf, tt.status().message());
      const auto& given = rank->second->tensors;
      const bool handed_over = std::any_of(given.begin(), given.end(), [&](const ckpt::TargetTensor& g) {
        return SameTarget(g, *tt);
      });
      if (!handed_over) {
        return bad(tf, absl::StrCat(TargetString(*tt), " is not a shard rank ", rw.rank(),
                                    " handed over"));
      }
      if (!names.insert(tt->name).second) return bad(tf, absl::StrCat(Shown(tt->name), " twice"));
      auto info = out.plan.tensors.find(tt->name);
      if (info == out.plan.tensors.end() || info->second.first != tt->dtype ||
          info->second.second != tt->global_shape) {
        return bad(tf, absl::StrCat(TargetString(*tt), " disagrees with save.tensors"));
      }
      out.plan.writes[static_cast<size_t>(rw.rank())].push_back(*std::move(tt));
    }
  }
  if (static_cast<uint64_t>(sp.flat_mapping_size()) > context.limits.max_files) {
    return bad("save.flat_mapping", absl::StrCat(sp.flat_mapping_size(), " entries, over the limit of ",
                                                 context.limits.max_files));
  }
  for (const auto& [k, v] : sp.flat_mapping()) {
    out.flat_mapping[k].assign(v.parts().begin(), v.parts().end());
  }
  return out;
}

void ToMsg(const std::string& tensor, const ckpt::ShardMeta& s, peer::v1::ShardMsg* m) {
  m->set_tensor(tensor);
  m->set_file(s.file);
  ToMsg(s.box, m->mutable_box());
  m->set_dtype(std::string(ckpt::DTypeName(s.dtype)));
  if (s.flat_range) {
    m->mutable_flat_range()->set_begin(s.flat_range->begin);
    m->mutable_flat_range()->set_end(s.flat_range->end);
  }
  m->set_data_offset(s.data_offset);
  m->set_nbytes(s.nbytes);
  for (uint64_t h : s.xxh3) m->add_xxh3(h);
}

absl::StatusOr<std::pair<std::string, ckpt::ShardMeta>> FromMsg(const peer::v1::ShardMsg& m,
                                                                const std::string& who) {
  const std::string what = absl::StrCat(who, ": shard of ", Shown(m.tensor()), " in ", Shown(m.file()));
  if (std::string p = BoxProblem(m.box()); !p.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": box: ", p));
  }
  ckpt::ShardMeta s;
  auto dtype = ckpt::ParseDType(m.dtype());
  if (!dtype.ok()) return absl::InvalidArgumentError(absl::StrCat(what, ": ", dtype.status().message()));
  s.dtype = *dtype;
  s.file = m.file();
  s.box = FromMsg(m.box());
  if (m.has_flat_range()) s.flat_range = ckpt::FlatRange{m.flat_range().begin(), m.flat_range().end()};
  s.data_offset = m.data_offset();
  s.nbytes = m.nbytes();
  s.xxh3.assign(m.xxh3().begin(), m.xxh3().end());
  return std::make_pair(m.tensor(), std::move(s));
}

absl::StatusOr<std::vector<ckpt::SpanRun>> FetchSpansOf(const peer::v1::FetchReadRequest& req,
                                                        uint64_t length) {
  std::vector<ckpt::SpanRun> out;
  if (req.spans_size() > 0 && req.span_runs_size() > 0) {
    return absl::InvalidArgumentError("both spans and span_runs (at most one of them)");
  }
  if (static_cast<size_t>(req.spans_size()) > kMaxFetchSpans) {
    return absl::InvalidArgumentError(
        absl::StrCat(req.spans_size(), " spans (at most ", kMaxFetchSpans, ")"));
  }
  int64_t prev_end = 0;
  for (int i = 0; i < req.spans_size(); ++i) {
    const peer::v1::Range& r = req.spans(i);
    if (r.begin() < prev_end || r.end() <= r.begin() ||
        static_cast<uint64_t>(r.end()) > length) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spans[", i, "] [", r.begin(), ", ", r.end(), ") (spans are non-empty, ascending, "
          "disjoint and inside the read of ", length, " bytes)"));
    }
    out.push_back({static_cast<uint64_t>(r.begin()),
                   static_cast<uint64_t>(r.end() - r.begin()), 0, 1});
    prev_end = r.end();
  }
  const int q = req.span_runs_size();
  if (q % 4 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(q, " span_runs values (quadruples: begin, length, stride, count)"));
  }
  uint64_t spans = 0, end = 0;
  for (int i = 0; i < q; i += 4) {
    const ckpt::SpanRun r{req.span_runs(i), req.span_runs(i + 1), req.span_runs(i + 2),
                          req.span_runs(i + 3)};
    // Every bound checked without an overflow: begin <= length, then the
    // first span inside, then the last (count - 1 strides further).
    const bool ok = r.count >= 1 && r.count <= kMaxFetchSpans - spans && r.length >= 1 &&
                    r.begin >= end && r.begin <= length && r.length <= length - r.begin &&
                    (r.count == 1 || (r.stride >= r.length &&
                                      r.count - 1 <= (length - r.begin - r.length) / r.stride));
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          "span_runs[", i / 4, "] (begin ", r.begin, ", length ", r.length, ", stride ",
          r.stride, ", count ", r.count, ") (spans are non-empty, ascending, disjoint, inside the "
          "read of ", length, " bytes, at most ", kMaxFetchSpans, " in all)"));
    }
    spans += r.count;
    end = r.begin + (r.count - 1) * r.stride + r.length;
    out.push_back(r);
  }
  return out;
}

}  // namespace ckptd
