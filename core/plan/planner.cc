#include "core/plan/planner.h"

#include <algorithm>
#include <set>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/base/status_macros.h"

namespace ckpt {
namespace {

// The box of global elements a layout's stored elements can touch.
Box CoverOf(const StoredLayout& l) {
  if (!l.perm.empty()) return l.box;  // AOA transposed shard: the whole box (conservative)
  int64_t numel = NumElements(l.box.shape);
  if (l.flat_begin == 0 && l.flat_end == numel) return l.box;
  Box c = CoveringBox(l.box.shape, l.flat_begin, l.flat_end);
  for (size_t d = 0; d < c.rank(); ++d) c.offset[d] += l.box.offset[d];
  return c;
}

uint64_t SpanByteOffset(const ShardMeta& s, int64_t flat) {
  int64_t first = s.flat_range ? s.flat_range->begin : 0;
  return s.data_offset + static_cast<uint64_t>(flat - first) * DTypeSize(s.dtype);
}

std::string OwnFilePrefix(int rank, int64_t uid) { return absl::StrCat(rank, "_", uid, "."); }

}  // namespace

StoredLayout TargetTensor::layout() const {
  StoredLayout l;
  l.box = box;
  l.dtype = dtype;
  l.flat_begin = flat_range ? flat_range->begin : 0;
  l.flat_end = flat_range ? flat_range->end : NumElements(box.shape);
  return l;
}

int64_t TargetTensor::num_elements() const {
  return flat_range ? flat_range->end - flat_range->begin : NumElements(box.shape);
}

uint64_t TargetTensor::num_bytes() const {
  return static_cast<uint64_t>(num_elements()) * DTypeSize(dtype);
}

uint64_t LoadPlan::bytes_to_deliver() const {
  uint64_t n = 0;
  for (const RankPlan& r : ranks) {
    for (const CopyOp& c : r.copies) {
      n += static_cast<uint64_t>(c.elements) * DTypeSize(r.targets[c.target].dtype);
    }
  }
  return n;
}

absl::Status ValidateTarget(int rank, const TargetTensor& t) {
  const std::string w = absl::StrCat("rank ", rank, " tensor '", t.name, "'");
  if (t.name.empty()) return absl::InvalidArgumentError(absl::StrCat("rank ", rank, ": empty name"));
  auto n = CheckedNumBytes(t.global_shape, DTypeSize(t.dtype));
  if (!n.ok()) return absl::InvalidArgumentError(absl::StrCat(w, ": ", n.status().message()));
  if (t.box.offset.size() != t.box.shape.size() || !InBounds(t.box, t.global_shape)) {
    return absl::InvalidArgumentError(absl::StrCat(w, ": box ", BoxString(t.box),
                                                   " lies outside the global shape ",
                                                   ShapeString(t.global_shape)));
  }
  if (t.flat_range) {
    int64_t numel = NumElements(t.box.shape);
    if (t.flat_range->begin < 0 || t.flat_range->end > numel ||
        t.flat_range->begin >= t.flat_range->end) {
      return absl::InvalidArgumentError(absl::StrCat(
          w, ": flat_range [", t.flat_range->begin, ", ", t.flat_range->end,
          ") is not a non-empty range inside its box of ", numel, " elements"));
    }
  }
  return absl::OkStatus();
}

std::string MasterWeightAlias(const std::string& key) {
  std::vector<std::string> parts = absl::StrSplit(key, '.');
  auto mw = std::find(parts.begin(), parts.end(), "master_weights");
  if (mw != parts.end()) {
    parts.erase(mw);
    return absl::StrCat(absl::StrJoin(parts, "."), "_fp32_master_0");
  }
  absl::string_view last = parts.back();
  if (absl::ConsumeSuffix(&last, "_fp32_master_0") && parts.size() >= 1) {
    parts.back() = std::string(last);
    parts.insert(parts.begin() + 1, "master_weights");
    return absl::StrJoin(parts, ".");
  }
  return "";
}

namespace {

// The state PlanLoad's phases share. Copies are built once, straight into
// the rank plans (plans can hold millions); until reads exist,
// CopyOp::read holds the file index.
class PlanBuilder {
 public:
  PlanBuilder(const CheckpointMetadata& metadata, const PlanOptions& options)
      : metadata_(metadata), options_(options) {
    size_t total_shards = 0;
    for (const auto& [name, tm] : metadata.tensors) {
      shard_base_[&tm] = total_shards;
      total_shards += tm.shards.size();
    }
    shard_file_.assign(total_shards, -1);
    shard_seen_.assign(total_shards, 0);
  }

  // Phase 1: the copies of one rank's targets, from the shards that hold
  // their elements (the rank's own exact shard when it has one).
  absl::Status AddRank(const RankTargets& rt);
  // Phase 2: every requested element is written exactly once. Validated
  // metadata guarantees this; checking keeps a bug from ever returning a
  // half-filled tensor as success.
  absl::Status CheckCoverage(const std::vector<RankTargets>& ranks) const;
  // Phase 3: byte spans per file merged into reads, cut at max_read_bytes on
  // checksum-block (else element) boundaries.
  void MakeReads();
  // Phase 4: each copy attached to the read holding its bytes; a copy whose
  // span crosses a cut becomes one copy per read.
  absl::Status AttachCopies();
  // Phase 5: checksum blocks entirely inside a read are verified after it.
  void AttachChecks();
  LoadPlan Finish() &&;

 private:
  // A shard's bytes in a file, for cutting reads and attaching checks. By
  // bytes, not by ShardMeta: AOA virtual shards can share a real shard.
  struct Extent {
    uint64_t begin, end;
    const ShardMeta* shard;
    const std::string* tensor;
  };
  uint32_t FileId(const std::string& f) {
    auto [it, inserted] = file_index_.emplace(f, static_cast<uint32_t>(plan_.files.size()));
    if (inserted) plan_.files.push_back(f);
    return it->second;
  }
  // Target `ti` of rank `rt`; `all_local` is cleared unless it is exactly a
  // shard of the rank's own file.
  // `own`: the prefix of the rank's own data files ({rank}_{uid}.).
  absl::Status AddTarget(const RankTargets& rt, uint32_t ti, const std::string& own, RankPlan& rp,
                         int64_t& filled, bool& all_local);
  // The read holding byte `offset` of `file`, or -1 (MakeReads done).
  int64_t FindRead(uint32_t file, uint64_t offset) const;
  const Extent* ExtentAt(uint32_t file, uint64_t offset) const;
  std::vector<std::pair<uint64_t, uint64_t>> SpansByFile(std::vector<size_t>* bucket) const;
  absl::Status SplitCopy(RankPlan& rp, size_t ci, int64_t read);

  const CheckpointMetadata& metadata_;
  const PlanOptions& options_;
  LoadPlan plan_;
  absl::flat_hash_map<std::string, uint32_t> file_index_;
  std::set<std::string> requested_ckpt_names_, missing_all_;
  std::vector<std::vector<int64_t>> filled_;  // per rank, per target: elements copied
  std::vector<std::vector<Extent>> extents_;  // per file
  absl::flat_hash_set<std::pair<uint32_t, uint64_t>> seen_shards_;
  // Per stored shard (numbered tensor by tensor), looked up once per target
  // instead of once per copy: its file index (-1: not yet known) and
  // whether its extent is recorded.
  absl::flat_hash_map<const TensorMeta*, size_t> shard_base_;
  std::vector<int64_t> shard_file_;
  std::vector<uint8_t> shard_seen_;
  // Reads of each file: [first, last) indices into plan_.reads.
  std::vector<std::pair<size_t, size_t>> file_reads_;
};

absl::Status PlanBuilder::AddRank(const RankTargets& rt) {
  RankPlan rp;
  rp.rank = rt.rank;
  rp.targets = rt.tensors;
  filled_.emplace_back(rt.tensors.size(), 0);
  const std::string own = OwnFilePrefix(rt.rank, metadata_.unique_id);
  absl::flat_hash_set<std::string> seen;
  bool all_local = !rt.tensors.empty();
  for (uint32_t ti = 0; ti < rt.tensors.size(); ++ti) {
    const TargetTensor& t = rt.tensors[ti];
    CKPT_RETURN_IF_ERROR(ValidateTarget(rt.rank, t));
    if (!seen.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", rt.rank, ": tensor '", t.name, "' requested twice"));
    }
    CKPT_RETURN_IF_ERROR(AddTarget(rt, ti, own, rp, filled_.back()[ti], all_local));
  }
  rp.local_fast_path = all_local;
  plan_.ranks.push_back(std::move(rp));
  return absl::OkStatus();
}

absl::Status PlanBuilder::AddTarget(const RankTargets& rt, uint32_t ti, const std::string& own,
                                    RankPlan& rp, int64_t& filled, bool& all_local) {
  const TargetTensor& t = rt.tensors[ti];
  auto it = metadata_.tensors.find(t.name);
  if (it == metadata_.tensors.end() && options_.master_weight_compat) {
    std::string alias = MasterWeightAlias(t.name);
    if (!alias.empty() && metadata_.tensors.count(alias)) {
      plan_.renamed_keys[t.name] = alias;
      it = metadata_.tensors.find(alias);
    }
  }
  if (it == metadata_.tensors.end()) {
    rp.missing_keys.push_back(t.name);
    missing_all_.insert(t.name);
    all_local = false;
    return absl::OkStatus();
  }
  const TensorMeta& tm = it->second;
  requested_ckpt_names_.insert(it->first);
  if (tm.global_shape != t.global_shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", rt.rank, " tensor '", t.name, "': requested global shape ",
        ShapeString(t.global_shape), " but the checkpoint has ", ShapeString(tm.global_shape)));
  }
  const StoredLayout dst = t.layout();
  const Box dst_cover = CoverOf(dst);
  // Local fast path candidate: the exact shard in the rank's own file.
  const ShardMeta* exact = nullptr;
  for (const ShardMeta& s : tm.shards) {
    if (s.replica_id == 0 && s.box == t.box && s.flat_range == t.flat_range && !s.window &&
        s.perm.empty() && absl::StartsWith(s.file, own)) {
      exact = &s;
      break;
    }
  }
  if (exact == nullptr) all_local = false;
  const size_t base = shard_base_.at(&tm);
  for (const ShardMeta& s : tm.shards) {
    if (s.replica_id != 0) continue;
    if (exact != nullptr && &s != exact) continue;
    if (!CanConvert(s.dtype, t.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", rt.rank, " tensor '", t.name, "': the checkpoint holds ", DTypeName(s.dtype),
          ", which cannot be converted to the requested ", DTypeName(t.dtype)));
    }
    const StoredLayout src = s.layout();
    std::optional<Box> region =
        exact != nullptr ? std::optional<Box>(dst_cover) : Intersect(CoverOf(src), dst_cover);
    if (region && s.window) region = Intersect(*region, *s.window);  // AOA virtual shard
    if (!region) continue;
    int64_t n = exact != nullptr ? t.num_elements() : CountRegion(src, dst, *region);
    if (n == 0) continue;
    const FlatSpan span = HeldSpan(src, dst, *region);
    const size_t si = base + static_cast<size_t>(&s - tm.shards.data());
    if (shard_file_[si] < 0) shard_file_[si] = FileId(s.file);
    const uint32_t file = static_cast<uint32_t>(shard_file_[si]);
    if (extents_.size() <= file) extents_.resize(file + 1);
    // Once per shard; by bytes too (AOA virtual shards can share bytes).
    if (!shard_seen_[si]) {
      shard_seen_[si] = 1;
      if (seen_shards_.insert({file, s.data_offset}).second) {
        extents_[file].push_back({s.data_offset, s.data_offset + s.nbytes, &s, &it->first});
      }
    }
    CopyOp op;
    op.target = ti;
    op.read = file;  // until reads exist
    op.src = src;
    op.src.flat_begin = span.begin;
    op.src.flat_end = span.end;
    op.src_offset = SpanByteOffset(s, span.begin);
    op.region = std::move(*region);
    op.elements = n;
    filled += n;
    rp.copies.push_back(std::move(op));
  }
  return absl::OkStatus();
}

absl::Status PlanBuilder::CheckCoverage(const std::vector<RankTargets>& ranks) const {
  for (size_t ri = 0; ri < ranks.size(); ++ri) {
    const absl::flat_hash_set<std::string> missing(plan_.ranks[ri].missing_keys.begin(),
                                                   plan_.ranks[ri].missing_keys.end());
    for (size_t ti = 0; ti < ranks[ri].tensors.size(); ++ti) {
      const TargetTensor& t = ranks[ri].tensors[ti];
      if (filled_[ri][ti] == 0 && missing.count(t.name)) continue;
      if (filled_[ri][ti] != t.num_elements()) {
        return absl::DataLossError(absl::StrCat(
            "rank ", ranks[ri].rank, " tensor '", t.name, "': the checkpoint's shards cover ",
            filled_[ri][ti], " of the ", t.num_elements(), " requested elements"));
      }
    }
  }
  return absl::OkStatus();
}

// Every copy's byte span, bucketed by file (a counting sort: integer work
// only, over millions of spans); *bucket[f] is file f's first span.
std::vector<std::pair<uint64_t, uint64_t>> PlanBuilder::SpansByFile(
    std::vector<size_t>* bucket) const {
  bucket->assign(plan_.files.size() + 1, 0);
  for (const RankPlan& rp : plan_.ranks) {
    for (const CopyOp& op : rp.copies) ++(*bucket)[op.read + 1];
  }
  for (size_t f = 0; f < plan_.files.size(); ++f) (*bucket)[f + 1] += (*bucket)[f];
  std::vector<std::pair<uint64_t, uint64_t>> spans(bucket->back());  // (begin, end)
  std::vector<size_t> fill(bucket->begin(), bucket->end() - 1);
  for (const RankPlan& rp : plan_.ranks) {
    for (const CopyOp& op : rp.copies) {
      spans[fill[op.read]++] = {op.src_offset,
                                op.src_offset + static_cast<uint64_t>(op.src.num_bytes())};
    }
  }
  return spans;
}

const PlanBuilder::Extent* PlanBuilder::ExtentAt(uint32_t file, uint64_t offset) const {
  const auto& es = extents_[file];
  auto it = std::upper_bound(es.begin(), es.end(), offset,
                             [](uint64_t o, const Extent& e) { return o < e.begin; });
  if (it == es.begin()) return nullptr;
  --it;
  return offset < it->end ? &*it : nullptr;
}

void PlanBuilder::MakeReads() {
  // Files in name order; spans sorted by offset within each file, merged.
  std::vector<uint32_t> order(plan_.files.size());
  for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](uint32_t a, uint32_t b) { return plan_.files[a] < plan_.files[b]; });
  std::vector<size_t> bucket;
  std::vector<std::pair<uint64_t, uint64_t>> spans = SpansByFile(&bucket);
  std::vector<ReadRange> merged;
  for (uint32_t file : order) {
    auto first = spans.begin() + static_cast<ptrdiff_t>(bucket[file]);
    auto last_span = spans.begin() + static_cast<ptrdiff_t>(bucket[file + 1]);
    std::sort(first, last_span);
    bool open = false;
    for (auto sp = first; sp != last_span; ++sp) {
      if (open) {
        ReadRange& last = merged.back();
        if (sp->first <= last.offset + last.length + options_.coalesce_gap) {
          last.length = std::max(last.length, sp->second - last.offset);
          continue;
        }
      }
      merged.push_back({file, sp->first, sp->second - sp->first, {}});
      open = true;
    }
  }
  std::vector<std::pair<uint64_t, uint64_t>>().swap(spans);
  extents_.resize(plan_.files.size());
  for (auto& e : extents_) {
    std::sort(e.begin(), e.end(), [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
  }
  const uint64_t block = metadata_.checksum_block;
  const uint64_t max_read =
      options_.max_read_bytes == 0 ? 0 : std::max<uint64_t>(options_.max_read_bytes, 8);
  for (const ReadRange& r : merged) {
    uint64_t pos = r.offset;
    const uint64_t end = r.offset + r.length;
    while (max_read > 0 && end - pos > max_read) {
      uint64_t cut = pos + max_read;
      if (const Extent* e = ExtentAt(r.file, cut)) {
        uint64_t aligned = e->begin + (cut - e->begin) / block * block;
        if (aligned <= pos) {  // max_read < block: fall back to an element boundary
          const uint64_t isz = DTypeSize(e->shard->dtype);
          aligned = e->begin + (cut - e->begin) / isz * isz;
        }
        if (aligned > pos) cut = aligned;
      }
      plan_.reads.push_back({r.file, pos, cut - pos, {}});
      pos = cut;
    }
    plan_.reads.push_back({r.file, pos, end - pos, {}});
  }
  for (const ReadRange& r : plan_.reads) plan_.bytes_to_read += r.length;
  // Reads are grouped by file (in name order), by offset within a file.
  file_reads_.assign(plan_.files.size(), {0, 0});
  for (size_t i = 0; i < plan_.reads.size(); ++i) {
    auto& fr = file_reads_[plan_.reads[i].file];
    if (fr.second == 0) fr.first = i;
    fr.second = i + 1;
  }
}

int64_t PlanBuilder::FindRead(uint32_t file, uint64_t offset) const {
  const auto [lo, hi] = file_reads_[file];
  auto it = std::upper_bound(plan_.reads.begin() + static_cast<ptrdiff_t>(lo),
                             plan_.reads.begin() + static_cast<ptrdiff_t>(hi), offset,
                             [](uint64_t o, const ReadRange& r) { return o < r.offset; });
  int64_t i = std::distance(plan_.reads.begin(), it) - 1;
  if (i < static_cast<int64_t>(lo) || plan_.reads[i].file != file ||
      offset >= plan_.reads[i].offset + plan_.reads[i].length) {
    return -1;
  }
  return i;
}

absl::Status PlanBuilder::AttachCopies() {
  for (RankPlan& rp : plan_.ranks) {
    const size_t n_built = rp.copies.size();
    for (size_t ci = 0; ci < n_built; ++ci) {
      const uint32_t file = rp.copies[ci].read;
      const uint64_t a = rp.copies[ci].src_offset;
      const uint64_t b = a + static_cast<uint64_t>(rp.copies[ci].src.num_bytes());
      const int64_t read = FindRead(file, a);
      if (read < 0) {
        return absl::InternalError(absl::StrCat("planner: no read holds the copy of rank ",
                                                rp.rank, " tensor '",
                                                rp.targets[rp.copies[ci].target].name,
                                                "' at byte ", a));
      }
      const ReadRange& first_read = plan_.reads[read];
      if (b <= first_read.offset + first_read.length) {
        rp.copies[ci].read = static_cast<uint32_t>(read);
        continue;
      }
      CKPT_RETURN_IF_ERROR(SplitCopy(rp, ci, read));
    }
  }
  return absl::OkStatus();
}

// Copy `ci` of `rp` spans several reads from `read` on: it becomes the first
// piece, the others are appended.
absl::Status PlanBuilder::SplitCopy(RankPlan& rp, size_t ci, int64_t read) {
  const CopyOp whole = rp.copies[ci];
  const uint32_t file = whole.read;
  const uint64_t isz = DTypeSize(whole.src.dtype);
  const uint64_t a = whole.src_offset;
  const uint64_t b = a + static_cast<uint64_t>(whole.src.num_bytes());
  const StoredLayout dst = rp.targets[whole.target].layout();
  int64_t total = 0;
  bool first_piece = true;
  for (int64_t r = read; r < static_cast<int64_t>(plan_.reads.size()); ++r) {
    const ReadRange& rr = plan_.reads[r];
    if (rr.file != file || rr.offset >= b) break;
    const uint64_t lo = std::max(a, rr.offset), hi = std::min(b, rr.offset + rr.length);
    CopyOp op = whole;
    op.read = static_cast<uint32_t>(r);
    op.src.flat_begin = whole.src.flat_begin + static_cast<int64_t>((lo - a) / isz);
    op.src.flat_end = whole.src.flat_begin + static_cast<int64_t>((hi - a) / isz);
    op.src_offset = lo;
    op.elements = CountRegion(op.src, dst, op.region);
    total += op.elements;
    if (op.elements == 0) continue;
    if (first_piece) {
      rp.copies[ci] = std::move(op);
      first_piece = false;
    } else {
      rp.copies.push_back(std::move(op));
    }
  }
  if (total != whole.elements || first_piece) {
    return absl::InternalError(absl::StrCat(
        "planner: rank ", rp.rank, " tensor '", rp.targets[whole.target].name,
        "' split into reads covers ", total, " of ", whole.elements, " elements"));
  }
  return absl::OkStatus();
}

void PlanBuilder::AttachChecks() {
  const uint64_t block = metadata_.checksum_block;
  for (uint32_t f = 0; f < extents_.size(); ++f) {
    for (const Extent& e : extents_[f]) {
      const ShardMeta& s = *e.shard;
      for (size_t i = 0; i < s.xxh3.size(); ++i) {
        const uint64_t bo = s.data_offset + i * block;
        const uint64_t bn = std::min<uint64_t>(block, s.nbytes - i * block);
        int64_t r = FindRead(f, bo);
        if (r >= 0 && bo + bn <= plan_.reads[r].offset + plan_.reads[r].length) {
          plan_.reads[r].checks.push_back({*e.tensor, bo, bn, s.xxh3[i]});
        }
      }
    }
  }
}

LoadPlan PlanBuilder::Finish() && {
  plan_.missing_keys.assign(missing_all_.begin(), missing_all_.end());
  for (const auto& [name, t] : metadata_.tensors) {
    if (!requested_ckpt_names_.count(name)) plan_.unexpected_keys.push_back(name);
  }
  return std::move(plan_);
}

}  // namespace

absl::StatusOr<LoadPlan> PlanLoad(const CheckpointMetadata& metadata,
                                  const std::vector<RankTargets>& ranks,
                                  const PlanOptions& options) {
  PlanBuilder b(metadata, options);
  for (const RankTargets& rt : ranks) CKPT_RETURN_IF_ERROR(b.AddRank(rt));
  CKPT_RETURN_IF_ERROR(b.CheckCoverage(ranks));
  b.MakeReads();
  CKPT_RETURN_IF_ERROR(b.AttachCopies());
  b.AttachChecks();
  return std::move(b).Finish();
}

std::string MissingKeysText(const std::vector<std::string>& missing) {
  constexpr size_t kNamed = 8;
  const size_t named = std::min(missing.size(), kNamed);
  std::string text = absl::StrJoin(missing.begin(), missing.begin() + named, ", ");
  if (missing.size() > named) absl::StrAppend(&text, ", ... (", missing.size(), " missing)");
  return text;
}

uint64_t SpanBytes(const std::vector<ReadSpan>& spans) {
  uint64_t n = 0;
  for (const ReadSpan& s : spans) n += s.end - s.begin;
  return n;
}

std::vector<SpanRun> PackSpans(const std::vector<ReadSpan>& spans) {
  std::vector<SpanRun> out;
  for (const ReadSpan& s : spans) {
    const uint64_t len = s.end - s.begin;
    if (!out.empty()) {
      SpanRun& r = out.back();
      const uint64_t last = r.begin + (r.count - 1) * r.stride;
      if (r.length == len && s.begin > last &&
          (r.count == 1 ? s.begin - last >= len : s.begin - last == r.stride)) {
        if (r.count == 1) r.stride = s.begin - last;
        ++r.count;
        continue;
      }
    }
    out.push_back({s.begin, len, 0, 1});
  }
  return out;
}

std::vector<std::vector<ReadSpan>> NeededSpans(const LoadPlan& plan, size_t max_spans) {
  std::vector<std::vector<ReadSpan>> out(plan.reads.size());
  // Runs of one copy beyond this are read as its whole span (bounds the
  // work for copies of tiny runs; their span is then close to dense anyway).
  constexpr size_t kMaxRunsPerCopy = 1 << 14;
  std::vector<CopyRun> runs;
  for (const RankPlan& rp : plan.ranks) {
    for (const CopyOp& op : rp.copies) {
      if (op.read >= plan.reads.size() || op.target >= rp.targets.size()) continue;
      const ReadRange& rr = plan.reads[op.read];
      const uint64_t base = op.src_offset - rr.offset;
      const uint64_t esz = DTypeSize(op.src.dtype);
      std::vector<ReadSpan>& spans = out[op.read];
      runs.clear();
      if (AppendCopyRuns(op.src, rp.targets[op.target].layout(), op.region, kMaxRunsPerCopy,
                         &runs)) {
        for (const CopyRun& r : runs) {
          if (r.len <= 0) continue;
          const uint64_t b = base + static_cast<uint64_t>(r.src) * esz;
          spans.push_back({b, b + static_cast<uint64_t>(r.len) * esz});
        }
      } else if (op.src.num_bytes() > 0) {
        spans.push_back({base, base + static_cast<uint64_t>(op.src.num_bytes())});
      }
    }
  }
  const size_t cap = std::max<size_t>(max_spans, 1);
  for (std::vector<ReadSpan>& spans : out) {
    if (spans.empty()) continue;
    std::sort(spans.begin(), spans.end(),
              [](const ReadSpan& a, const ReadSpan& b) { return a.begin < b.begin; });
    auto merge = [&spans](uint64_t gap) {
      size_t k = 0;
      for (size_t i = 1; i < spans.size(); ++i) {
        if (spans[i].begin <= spans[k].end + gap) {
          spans[k].end = std::max(spans[k].end, spans[i].end);
        } else {
          spans[++k] = spans[i];
        }
      }
      spans.resize(k + 1);
    };
    merge(0);
    if (spans.size() > cap) {
      // Close the smallest gaps: every gap up to the (n - cap)-th smallest.
      std::vector<uint64_t> gaps;
      gaps.reserve(spans.size() - 1);
      for (size_t i = 1; i < spans.size(); ++i) gaps.push_back(spans[i].begin - spans[i - 1].end);
      const size_t k = spans.size() - cap - 1;
      std::nth_element(gaps.begin(), gaps.begin() + k, gaps.end());
      merge(gaps[k]);
    }
  }
  return out;
}

}  // namespace ckpt
