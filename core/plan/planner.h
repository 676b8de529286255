// The load planner: one plan for all ranks of a load.
//
// Input: a checkpoint's metadata and every rank's targets (the box of each
// tensor it owns, optionally a flattened range of that box, and the dtype it
// wants). Output: per rank, the copies (source shard bytes -> target box);
// for the whole load, the byte ranges to read, each read once even when many
// ranks need it, and only the spans some copy touches; missing keys
// (requested, not in the checkpoint) and unexpected keys (in the checkpoint,
// requested by no rank). Replicas with replica_id > 0 are ignored. The
// offline tools, the daemon and multi-node loads all use this planner.
//
// Thread-compatible: PlanLoad is a pure function of its inputs.
#ifndef CKPTD_CORE_PLANNER_H_
#define CKPTD_CORE_PLANNER_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/base/box.h"
#include "core/exec/copy.h"
#include "core/format/metadata.h"

namespace ckpt {

// One tensor (or flattened piece of one) a rank wants filled.
struct TargetTensor {
  std::string name;
  DType dtype = DType::kF32;
  Shape global_shape;
  Box box;                              // the part of the global tensor it owns
  std::optional<FlatRange> flat_range;  // a range of flatten(box), if flattened

  // Layout of the rank's buffer for this target.
  StoredLayout layout() const;
  int64_t num_elements() const;
  uint64_t num_bytes() const;
};

struct RankTargets {
  int rank = 0;
  std::vector<TargetTensor> tensors;
};

// Checks a target against itself (box inside the global shape, flat range
// inside the box, sizes without overflow); errors name the rank and tensor.
absl::Status ValidateTarget(int rank, const TargetTensor& t);

// A byte range of one file to read.
struct ReadRange {
  uint32_t file = 0;  // index into LoadPlan::files
  uint64_t offset = 0;
  uint64_t length = 0;
  // Shards entirely inside this range that carry a checksum; verified after
  // the read.
  struct Check {
    std::string tensor;
    uint64_t offset = 0;
    uint64_t nbytes = 0;
    uint64_t xxh3 = 0;
  };
  std::vector<Check> checks;
};

// Copy `region` of one stored shard into a target's buffer. The source
// elements `src` (a shard layout narrowed to the span this copy touches)
// start at byte `src_offset` of file `file`, inside read `read`.
struct CopyOp {
  uint32_t target = 0;  // index into the rank's targets
  uint32_t read = 0;    // index into LoadPlan::reads
  StoredLayout src;
  uint64_t src_offset = 0;
  Box region;
  int64_t elements = 0;  // elements this copy writes
};

struct RankPlan {
  int rank = 0;
  std::vector<TargetTensor> targets;  // as requested; checkpoint names resolved
  std::vector<CopyOp> copies;
  std::vector<std::string> missing_keys;
  // Whether every target is exactly a shard stored in this rank's own data
  // file ({rank}_{uid}.*): the copies are then 1:1 and need no search.
  bool local_fast_path = false;
};

struct PlanOptions {
  // Merge read spans of one file whose gap is at most this many bytes.
  uint64_t coalesce_gap = 0;
  // Cut reads longer than this (on checksum-block boundaries, so each piece
  // stays verifiable); bounds the memory of one read. 0: never cut.
  uint64_t max_read_bytes = 64ull << 20;
  // Resolve `a.master_weights.b` <-> `a.b_fp32_master_0` when one is missing.
  bool master_weight_compat = true;
};

struct LoadPlan {
  std::vector<std::string> files;  // file names relative to the checkpoint dir
  std::vector<ReadRange> reads;    // sorted by (file, offset), disjoint
  std::vector<RankPlan> ranks;     // same order as the input
  std::vector<std::string> missing_keys;     // union over ranks, sorted
  std::vector<std::string> unexpected_keys;  // sorted
  std::map<std::string, std::string> renamed_keys;  // requested -> checkpoint name
  uint64_t bytes_to_read = 0;

  uint64_t bytes_to_deliver() const;
};

// Missing keys as a strict load's error names them: the first eight, then
// "..., (N missing)" when there are more (a typo'd prefix misses them all).
std::string MissingKeysText(const std::vector<std::string>& missing);

absl::StatusOr<LoadPlan> PlanLoad(const CheckpointMetadata& metadata,
                                  const std::vector<RankTargets>& ranks,
                                  const PlanOptions& options = {});

// A byte range [begin, end) inside one read (offsets from the read's first
// byte).
struct ReadSpan {
  uint64_t begin = 0;
  uint64_t end = 0;
  bool operator==(const ReadSpan& o) const { return begin == o.begin && end == o.end; }
};

// Per read of `plan` (same order as plan.reads): the bytes its ranks'
// copies read from it, sorted, disjoint, touching spans merged: what a node
// whose ranks are `plan.ranks` needs of a read another node made (a copy's
// runs, or its whole source span when it has a permutation or more runs than
// a bound). When a read would have more than `max_spans` spans, the
// smallest gaps between them are closed until it has at most that many. An
// unused read gets none.
std::vector<std::vector<ReadSpan>> NeededSpans(const LoadPlan& plan, size_t max_spans);

// Bytes in `spans`.
uint64_t SpanBytes(const std::vector<ReadSpan>& spans);

// `count` spans of `length` bytes each, the first at `begin`, each next
// `stride` bytes after the one before (stride >= length; 0 when count is 1):
// a column slice of a row-major tensor is one run per read instead of one
// span per row.
struct SpanRun {
  uint64_t begin = 0;
  uint64_t length = 0;
  uint64_t stride = 0;
  uint64_t count = 0;
  bool operator==(const SpanRun& o) const {
    return begin == o.begin && length == o.length && stride == o.stride && count == o.count;
  }
};

// `spans` (sorted, disjoint, non-empty) as runs, in order: each span joins
// the run before it when it has that run's length and lies its stride after
// the run's last span (the second span of a run sets the stride).
std::vector<SpanRun> PackSpans(const std::vector<ReadSpan>& spans);

// The master-weight alternative name of `key`, or "" if it has none.
std::string MasterWeightAlias(const std::string& key);

}  // namespace ckpt

#endif  // CKPTD_CORE_PLANNER_H_
