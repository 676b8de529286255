// The checkpoint metadata model: which shard of which tensor lives where.
//
// It expresses everything Paddle's flex_checkpoint metadata does (global
// shape/offset, local shape, dtype, flattened range, replica id, file per
// shard, flat_mapping) plus the byte range of each shard in its file and an
// optional XXH3-64 checksum. The native `{unique_id}.metadata` file is this
// model as JSON (see docs/file-format.md); other formats (HuggingFace
// safetensors, later Paddle and PyTorch DCP) are converted into it.
#ifndef CKPTD_CORE_METADATA_H_
#define CKPTD_CORE_METADATA_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/base/box.h"
#include "core/exec/copy.h"
#include "core/base/dtype.h"

namespace ckpt {

inline constexpr int kMetadataFormatVersion = 1;
inline constexpr char kMetadataFormatName[] = "ckptd.checkpoint";

// [begin, end) of the row-major flattening of a shard's box.
struct FlatRange {
  int64_t begin = 0;
  int64_t end = 0;
  bool operator==(const FlatRange& o) const { return begin == o.begin && end == o.end; }
};

struct ShardMeta {
  std::string file;  // data file name, relative to the checkpoint directory
  Box box;           // global offset + local shape
  DType dtype = DType::kF32;
  std::optional<FlatRange> flat_range;  // set for flattened (ZeRO) shards
  int replica_id = 0;                   // loaders use replica 0 only
  uint64_t data_offset = 0;             // absolute byte offset in `file`
  uint64_t nbytes = 0;
  // XXH3-64 of each checksum_block-byte block of the shard's bytes; empty
  // when not recorded (e.g. HuggingFace files).
  std::vector<uint64_t> xxh3;

  // In-memory only (never read from or written to metadata files): set on
  // the virtual shards that AOA resolution (core/plan/aoa.h) builds, which place
  // a real shard's bytes at a remapped box of another tensor.
  // - perm: the shard's bytes are stored in this axis order of `box` (see
  //   StoredLayout::perm); empty for ordinary row-major shards.
  // - window: only this part of `box` belongs to the tensor (the rest of the
  //   stored elements belong elsewhere, e.g. the other outputs of a split);
  //   `box` may then extend outside the global shape. Loads copy only
  //   elements inside the window. nullopt: the whole box.
  std::vector<int> perm;
  std::optional<Box> window;

  int64_t num_elements() const;
  // How the shard's bytes lay out its elements.
  StoredLayout layout() const;
};

struct TensorMeta {
  DType dtype = DType::kF32;
  Shape global_shape;
  std::vector<ShardMeta> shards;
};

struct CheckpointMetadata {
  int64_t unique_id = 0;
  uint64_t checksum_block = 64ull << 20;  // bytes per checksum block
  std::map<std::string, TensorMeta> tensors;  // ordered: deterministic plans
  // flat key -> path in the nested state dict ("model.a.0" -> ["model", "a.0"]).
  std::map<std::string, std::vector<std::string>> flat_mapping;
};

// Parses the native JSON metadata; `path` names the file in errors.
absl::StatusOr<CheckpointMetadata> ParseMetadataJson(const std::string& path,
                                                     const std::string& text);
std::string MetadataToJson(const CheckpointMetadata& metadata);

// Checks the model is self-consistent; errors name `where` and the tensor:
// shapes and boxes in bounds and overflow-free, flattened ranges inside their
// box, nbytes = elements * itemsize, file names plain (no "/", no ".."), and
// the replica-0 shards of every tensor cover it exactly once (no overlap, no
// gap).
absl::Status ValidateMetadata(const CheckpointMetadata& metadata, const std::string& where);

// Whether `name` is a plain file name inside a directory (no separators, not
// "." or "..", not empty).
bool IsPlainFileName(const std::string& name);

}  // namespace ckpt

#endif  // CKPTD_CORE_METADATA_H_
