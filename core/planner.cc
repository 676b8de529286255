#include "core/planner.h"

#include <algorithm>
#include <set>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/status_macros.h"

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

absl::StatusOr<LoadPlan> PlanLoad(const CheckpointMetadata& metadata,
                                  const std::vector<RankTargets>& ranks,
                                  const PlanOptions& options) {
  LoadPlan plan;
  absl::flat_hash_map<std::string, uint32_t> file_index;
  auto file_id = [&](const std::string& f) {
    auto [it, inserted] = file_index.emplace(f, static_cast<uint32_t>(plan.files.size()));
    if (inserted) plan.files.push_back(f);
    return it->second;
  };
  std::set<std::string> requested_ckpt_names, missing_all;
  // Copies are built once, straight into the rank plans (plans can hold
  // millions): until reads exist, CopyOp::read holds the file index.
  std::vector<std::vector<int64_t>> filled(ranks.size());
  // Shards touched, per file, by offset: to cut long reads on checksum-block
  // boundaries (which are element boundaries) and to attach checks. By
  // bytes, not by ShardMeta: AOA virtual shards can share a real shard.
  struct Extent {
    uint64_t begin, end;
    const ShardMeta* shard;
    const std::string* tensor;
  };
  std::vector<std::vector<Extent>> extents;
  absl::flat_hash_set<std::pair<uint32_t, uint64_t>> seen_shards;
  // Per stored shard (numbered tensor by tensor), looked up once per target
  // instead of once per copy (plans can hold millions of copies): its file
  // index (-1: not yet known) and whether its extent is recorded.
  absl::flat_hash_map<const TensorMeta*, size_t> shard_base;
  size_t total_shards = 0;
  for (const auto& [name, tm] : metadata.tensors) {
    shard_base[&tm] = total_shards;
    total_shards += tm.shards.size();
  }
  std::vector<int64_t> shard_file(total_shards, -1);
  std::vector<uint8_t> shard_seen(total_shards, 0);

  for (uint32_t ri = 0; ri < ranks.size(); ++ri) {
    const RankTargets& rt = ranks[ri];
    RankPlan rp;
    rp.rank = rt.rank;
    rp.targets = rt.tensors;
    filled[ri].assign(rt.tensors.size(), 0);
    absl::flat_hash_set<std::string> seen;
    bool all_local = !rt.tensors.empty();
    const std::string own = OwnFilePrefix(rt.rank, metadata.unique_id);
    for (uint32_t ti = 0; ti < rt.tensors.size(); ++ti) {
      const TargetTensor& t = rt.tensors[ti];
      CKPT_RETURN_IF_ERROR(ValidateTarget(rt.rank, t));
      if (!seen.insert(t.name).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("rank ", rt.rank, ": tensor '", t.name, "' requested twice"));
      }
      std::string name = t.name;
      auto it = metadata.tensors.find(name);
      if (it == metadata.tensors.end() && options.master_weight_compat) {
        std::string alias = MasterWeightAlias(name);
        if (!alias.empty() && metadata.tensors.count(alias)) {
          plan.renamed_keys[name] = alias;
          it = metadata.tensors.find(alias);
        }
      }
      if (it == metadata.tensors.end()) {
        rp.missing_keys.push_back(t.name);
        missing_all.insert(t.name);
        all_local = false;
        continue;
      }
      const TensorMeta& tm = it->second;
      requested_ckpt_names.insert(it->first);
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
        if (s.replica_id == 0 && s.box == t.box && s.flat_range == t.flat_range &&
            !s.window && s.perm.empty() && absl::StartsWith(s.file, own)) {
          exact = &s;
          break;
        }
      }
      if (exact == nullptr) all_local = false;
      const size_t base = shard_base.at(&tm);
      for (const ShardMeta& s : tm.shards) {
        if (s.replica_id != 0) continue;
        if (exact != nullptr && &s != exact) continue;
        if (!CanConvert(s.dtype, t.dtype)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "rank ", rt.rank, " tensor '", t.name, "': the checkpoint holds ",
              DTypeName(s.dtype), ", which cannot be converted to the requested ",
              DTypeName(t.dtype)));
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
        if (shard_file[si] < 0) shard_file[si] = file_id(s.file);
        const uint32_t file = static_cast<uint32_t>(shard_file[si]);
        if (extents.size() <= file) extents.resize(file + 1);
        // Once per shard; by bytes too (AOA virtual shards can share bytes).
        if (!shard_seen[si]) {
          shard_seen[si] = 1;
          if (seen_shards.insert({file, s.data_offset}).second) {
            extents[file].push_back({s.data_offset, s.data_offset + s.nbytes, &s, &it->first});
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
        filled[ri][ti] += n;
        rp.copies.push_back(std::move(op));
      }
    }
    rp.local_fast_path = all_local;
    plan.ranks.push_back(std::move(rp));
  }

  // Every requested element must be written exactly once. Validated metadata
  // guarantees this; checking here keeps a bug from ever returning a
  // half-filled tensor as success.
  {
    for (size_t ri = 0; ri < ranks.size(); ++ri) {
      const absl::flat_hash_set<std::string> missing(plan.ranks[ri].missing_keys.begin(),
                                                     plan.ranks[ri].missing_keys.end());
      for (size_t ti = 0; ti < ranks[ri].tensors.size(); ++ti) {
        const TargetTensor& t = ranks[ri].tensors[ti];
        if (filled[ri][ti] == 0 && missing.count(t.name)) continue;
        if (filled[ri][ti] != t.num_elements()) {
          return absl::DataLossError(absl::StrCat(
              "rank ", ranks[ri].rank, " tensor '", t.name, "': the checkpoint's shards cover ",
              filled[ri][ti], " of the ", t.num_elements(), " requested elements"));
        }
      }
    }
  }

  // Byte spans per file -> merged reads. Spans are bucketed by file (a
  // counting sort, files in name order) and sorted by offset within each
  // file: integer compares only, over millions of spans.
  std::vector<uint32_t> order(plan.files.size());  // file indices in name order
  for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](uint32_t a, uint32_t b) { return plan.files[a] < plan.files[b]; });
  std::vector<size_t> bucket(plan.files.size() + 1, 0);
  for (const RankPlan& rp : plan.ranks) {
    for (const CopyOp& op : rp.copies) ++bucket[op.read + 1];
  }
  for (size_t f = 0; f < plan.files.size(); ++f) bucket[f + 1] += bucket[f];
  std::vector<std::pair<uint64_t, uint64_t>> spans(bucket.back());  // (begin, end)
  {
    std::vector<size_t> fill(bucket.begin(), bucket.end() - 1);
    for (const RankPlan& rp : plan.ranks) {
      for (const CopyOp& op : rp.copies) {
        spans[fill[op.read]++] = {op.src_offset,
                                  op.src_offset + static_cast<uint64_t>(op.src.num_bytes())};
      }
    }
  }
  std::vector<ReadRange> merged;
  for (uint32_t file : order) {
    auto first = spans.begin() + static_cast<ptrdiff_t>(bucket[file]);
    auto last_span = spans.begin() + static_cast<ptrdiff_t>(bucket[file + 1]);
    std::sort(first, last_span);
    bool open = false;
    for (auto sp = first; sp != last_span; ++sp) {
      if (open) {
        ReadRange& last = merged.back();
        if (sp->first <= last.offset + last.length + options.coalesce_gap) {
          last.length = std::max(last.length, sp->second - last.offset);
          continue;
        }
      }
      merged.push_back({file, sp->first, sp->second - sp->first, {}});
      open = true;
    }
  }
  std::vector<std::pair<uint64_t, uint64_t>>().swap(spans);
  extents.resize(plan.files.size());
  for (auto& e : extents) {
    std::sort(e.begin(), e.end(), [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
  }

  auto extent_at = [&](uint32_t file, uint64_t offset) -> const Extent* {
    const auto& es = extents[file];
    auto it = std::upper_bound(es.begin(), es.end(), offset,
                               [](uint64_t o, const Extent& e) { return o < e.begin; });
    if (it == es.begin()) return nullptr;
    --it;
    return offset < it->end ? &*it : nullptr;
  };
  const uint64_t block = metadata.checksum_block;
  const uint64_t max_read =
      options.max_read_bytes == 0 ? 0 : std::max<uint64_t>(options.max_read_bytes, 8);
  for (const ReadRange& r : merged) {
    uint64_t pos = r.offset;
    const uint64_t end = r.offset + r.length;
    while (max_read > 0 && end - pos > max_read) {
      uint64_t cut = pos + max_read;
      if (const Extent* e = extent_at(r.file, cut)) {
        uint64_t aligned = e->begin + (cut - e->begin) / block * block;
        if (aligned <= pos) {  // max_read < block: fall back to an element boundary
          const uint64_t isz = DTypeSize(e->shard->dtype);
          aligned = e->begin + (cut - e->begin) / isz * isz;
        }
        if (aligned > pos) cut = aligned;
      }
      plan.reads.push_back({r.file, pos, cut - pos, {}});
      pos = cut;
    }
    plan.reads.push_back({r.file, pos, end - pos, {}});
  }
  for (const ReadRange& r : plan.reads) plan.bytes_to_read += r.length;

  // Reads are grouped by file (in name order), by offset within a file.
  std::vector<std::pair<size_t, size_t>> file_reads(plan.files.size(), {0, 0});
  for (size_t i = 0; i < plan.reads.size(); ++i) {
    auto& fr = file_reads[plan.reads[i].file];
    if (fr.second == 0) fr.first = i;
    fr.second = i + 1;
  }
  // Index of the read holding byte `offset` of `file`, or -1.
  auto find_read = [&](uint32_t file, uint64_t offset) -> int64_t {
    const auto [lo, hi] = file_reads[file];
    auto it = std::upper_bound(plan.reads.begin() + static_cast<ptrdiff_t>(lo),
                               plan.reads.begin() + static_cast<ptrdiff_t>(hi), offset,
                               [](uint64_t o, const ReadRange& r) { return o < r.offset; });
    int64_t i = std::distance(plan.reads.begin(), it) - 1;
    if (i < static_cast<int64_t>(lo) || plan.reads[i].file != file ||
        offset >= plan.reads[i].offset + plan.reads[i].length) {
      return -1;
    }
    return i;
  };

  // Attach each copy to the read holding its bytes; a copy whose span
  // crosses a cut is split into one copy per read (appended).
  for (RankPlan& rp : plan.ranks) {
    const size_t n_built = rp.copies.size();
    for (size_t ci = 0; ci < n_built; ++ci) {
      const uint32_t file = rp.copies[ci].read;
      const uint64_t isz = DTypeSize(rp.copies[ci].src.dtype);
      const uint64_t a = rp.copies[ci].src_offset;
      const uint64_t b = a + static_cast<uint64_t>(rp.copies[ci].src.num_bytes());
      const int64_t read = find_read(file, a);
      if (read < 0) {
        return absl::InternalError(absl::StrCat("planner: no read holds the copy of rank ",
                                                rp.rank, " tensor '",
                                                rp.targets[rp.copies[ci].target].name,
                                                "' at byte ", a));
      }
      const ReadRange& first_read = plan.reads[read];
      if (b <= first_read.offset + first_read.length) {
        rp.copies[ci].read = static_cast<uint32_t>(read);
        continue;
      }
      const CopyOp whole = rp.copies[ci];
      const StoredLayout dst = rp.targets[whole.target].layout();
      int64_t total = 0;
      bool first_piece = true;
      for (int64_t r = read; r < static_cast<int64_t>(plan.reads.size()); ++r) {
        const ReadRange& rr = plan.reads[r];
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
    }
  }

  // Checksum blocks entirely inside a read are verified after it.
  for (uint32_t f = 0; f < extents.size(); ++f) {
    for (const Extent& e : extents[f]) {
      const ShardMeta& s = *e.shard;
      for (size_t i = 0; i < s.xxh3.size(); ++i) {
        const uint64_t bo = s.data_offset + i * block;
        const uint64_t bn = std::min<uint64_t>(block, s.nbytes - i * block);
        int64_t r = find_read(f, bo);
        if (r >= 0 && bo + bn <= plan.reads[r].offset + plan.reads[r].length) {
          plan.reads[r].checks.push_back({*e.tensor, bo, bn, s.xxh3[i]});
        }
      }
    }
  }

  plan.missing_keys.assign(missing_all.begin(), missing_all.end());
  for (const auto& [name, t] : metadata.tensors) {
    if (!requested_ckpt_names.count(name)) plan.unexpected_keys.push_back(name);
  }
  return plan;
}

}  // namespace ckpt
