#include "core/tools/convert.h"

#include <limits.h>
#include <stdlib.h>

#include <algorithm>
#include <map>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "core/tools/layout.h"
#include "core/tools/offline.h"
#include "core/base/status_macros.h"

namespace ckpt {

absl::StatusOr<ConvertReport> ConvertCheckpoint(const std::string& src_dir,
                                                const std::string& out_dir,
                                                const ConvertOptions& options) {
  auto a = Storage::Default()->Canonical(src_dir);
  auto b = Storage::Default()->Canonical(out_dir);
  if (a.ok() && b.ok() && *a == *b) {
    return absl::InvalidArgumentError(
        absl::StrCat("convert: the output directory ", out_dir, " is the source directory"));
  }
  OpenOptions oo;
  oo.unique_id = options.source_unique_id;
  oo.confine = options.confine;
  CKPT_ASSIGN_OR_RETURN(Checkpoint src, OpenCheckpoint(src_dir, oo));
  ConvertReport report;
  report.source_format = src.format;
  report.skipped_items = src.skipped_items;
  std::map<std::string, int> file_rank;
  for (const std::string& f : src.data_files) {
    file_rank.emplace(f, static_cast<int>(file_rank.size()));
  }
  // Replica-0 shards grouped by (tensor, file, box); contiguous flattened
  // pieces of one box in one file are joined (whole again if they cover it).
  struct Piece {
    int64_t begin, end;
  };
  std::map<std::tuple<std::string, std::string, Shape, Shape>, std::vector<Piece>> groups;
  for (const auto& [name, t] : src.metadata.tensors) {
    for (const ShardMeta& s : t.shards) {
      if (s.replica_id != 0) continue;
      const int64_t n = NumElements(s.box.shape);
      Piece p = s.flat_range ? Piece{s.flat_range->begin, s.flat_range->end} : Piece{0, n};
      groups[{name, s.file, s.box.offset, s.box.shape}].push_back(p);
    }
  }
  std::vector<RankTargets> ranks(file_rank.size());
  for (size_t r = 0; r < ranks.size(); ++r) ranks[r].rank = static_cast<int>(r);
  std::vector<std::map<std::string, int>> held(ranks.size());
  for (auto& [key, pieces] : groups) {
    const auto& [name, file, offset, shape] = key;
    const TensorMeta& t = src.metadata.tensors.at(name);
    std::sort(pieces.begin(), pieces.end(),
              [](const Piece& x, const Piece& y) { return x.begin < y.begin; });
    std::vector<Piece> merged;
    for (const Piece& p : pieces) {
      if (!merged.empty() && merged.back().end == p.begin) {
        merged.back().end = p.end;
      } else {
        merged.push_back(p);
      }
    }
    const int64_t n = NumElements(shape);
    for (const Piece& p : merged) {
      TargetTensor tt;
      tt.name = name;
      tt.dtype = t.dtype;
      tt.global_shape = t.global_shape;
      tt.box = Box{offset, shape};
      if (!(p.begin == 0 && p.end == n)) tt.flat_range = FlatRange{p.begin, p.end};
      // The rank of the source file, or the first extra rank that does not
      // hold this tensor yet (a rank holds at most one shard of a tensor).
      size_t r = static_cast<size_t>(file_rank.at(file));
      while (r < ranks.size() && held[r].count(name)) {
        r = r < file_rank.size() ? file_rank.size() : r + 1;
      }
      if (r >= ranks.size()) {
        ranks.push_back(RankTargets{static_cast<int>(r), {}});
        held.emplace_back();
      }
      held[r][name] = 1;
      report.bytes += tt.num_bytes();
      ranks[r].tensors.push_back(std::move(tt));
    }
  }
  Layout layout;
  layout.world_size = static_cast<int>(ranks.size());
  layout.ranks = std::move(ranks);
  ShardOptions so;
  so.source_unique_id = src.unique_id;
  so.unique_id = options.unique_id;
  so.threads = options.threads;
  so.confine = options.confine;
  so.overwrite = options.overwrite;
  CKPT_RETURN_IF_ERROR(ShardCheckpoint(src_dir, layout, out_dir, so));
  report.files_written = layout.world_size;
  report.tensors = src.metadata.tensors.size();
  return report;
}

}  // namespace ckpt
