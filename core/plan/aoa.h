// AOA ("all in one arrow"): tensor transformations applied while loading.
//
// A checkpoint's tensors are mapped onto the model's tensors by statements,
// one per line ('#' starts a comment):
//
//   layers.$LAYER_ID.q_proj.weight^T, layers.$LAYER_ID.k_proj.weight^T,
//       layers.$LAYER_ID.v_proj.weight^T -> layers.$LAYER_ID.qkv.weight,
//       fused_qkv, num_heads=8, num_key_value_groups=2      (one line)
//   s0,s1 -> s, axis=1          # concat
//   s -> d0,d1, axis=0          # split in equal parts
//   a -> b, permute='[1,0]'     # transpose (a^T -> b reverses all axes)
//   g -> g, dtype='float32'     # cast
//   a -> _                      # drop a
//   _ -> b                      # keep the model's own b (not loaded)
//
// See docs/aoa.md for the full language.
//
// Nothing is ever transformed in memory. Resolution works on boxes: it turns
// the checkpoint's metadata into a *virtual* CheckpointMetadata whose tensors
// are the model's names, each made of virtual shards that point at the real
// shards' bytes (same file, offset, length, checksums) but sit at remapped
// boxes (ShardMeta::window keeps the part that belongs to the tensor,
// ShardMeta::perm records a transpose, a cast is the shard dtype differing
// from the tensor's). PlanLoad then runs unchanged on the virtual metadata,
// so resharding and transformation compose: a rank owning some rows of a
// fused qkv reads only the byte spans of q, k and v that feed those rows.
//
// Thread-compatible: all functions are pure.
#ifndef CKPTD_CORE_AOA_H_
#define CKPTD_CORE_AOA_H_

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/base/dtype.h"
#include "core/format/metadata.h"
#include "core/plan/planner.h"

namespace ckpt {

// One tensor name of a statement as written, macros unexpanded.
struct AoaName {
  std::string text;        // "layers.$LAYER_ID.q", "s[0:2]", "_"
  bool transpose = false;  // written with a ^T suffix (sources only)
  int column = 0;          // 1-based
};

enum class AoaFused { kNone, kQkv, kFfn };

struct AoaStatement {
  int line = 0;      // 1-based line (or statement index of a JSON list)
  std::string text;  // the statement as written, for messages
  std::vector<AoaName> sources;
  std::vector<AoaName> targets;
  std::optional<int> axis;
  std::optional<std::vector<int>> permute;
  std::optional<DType> dtype;
  AoaFused fused = AoaFused::kNone;
  std::optional<int64_t> num_heads;
  std::optional<int64_t> num_key_value_groups;
};

struct AoaProgram {
  std::string where;  // names the config in messages (a path, "aoa_config")
  std::vector<AoaStatement> statements;
};

// Parses statements, one per line. Also accepts Paddle's JSON form
// {"aoa_statements": ["a -> b", ...]} (or a bare JSON list of strings), one
// statement per string. Errors are INVALID_ARGUMENT
// "WHERE:LINE:COLUMN: what was expected, what was found".
absl::StatusOr<AoaProgram> ParseAoa(absl::string_view text, const std::string& where = "aoa");

// Dtype and global shape the model wants for each of its tensor names.
struct ModelTensor {
  DType dtype = DType::kF32;
  Shape global_shape;
};
using ModelTensors = std::map<std::string, ModelTensor>;

// Every name the ranks request (first request of a name wins for dtype).
ModelTensors ModelTensorsOf(const std::vector<RankTargets>& ranks);

struct AoaResolution {
  // The virtual checkpoint: statement outputs (by their final names) plus
  // every checkpoint tensor that no statement redefines or drops, as is.
  CheckpointMetadata metadata;
  // Model names listed as `_ -> name`: neither loaded nor missing.
  std::set<std::string> kept;
  // Checkpoint tensors dropped by `name -> _`: never unexpected.
  std::set<std::string> dropped;
  // Virtual tensor -> the checkpoint tensors its shards read.
  std::map<std::string, std::set<std::string>> sources;
  // The statements after macro expansion and follower generation, as
  // "LINE: a, b -> c, options" (what was executed; for reports and tests).
  std::vector<std::string> expanded;
};

// Expands macros, adds the optimizer-state followers of each statement,
// evaluates the statements on boxes and builds the virtual metadata.
// Errors (INVALID_ARGUMENT, naming the statement's line and text): unknown
// source, a macro pattern matching nothing, a name fed twice, a cycle, a
// shape that does not fit (concat, split not divisible, fused layouts, the
// model's global shape), bad axis or permutation, impossible casts.
absl::StatusOr<AoaResolution> ResolveAoa(const AoaProgram& program,
                                         const CheckpointMetadata& checkpoint,
                                         const ModelTensors& model);

// Rewrites a plan made on `resolution.metadata` in checkpoint terms: kept
// names are no longer missing, and unexpected keys are the checkpoint
// tensors that feed no requested tensor (dropped ones excluded).
void FinishAoaPlan(const AoaResolution& resolution, const CheckpointMetadata& checkpoint,
                   LoadPlan* plan);

// Reads an AOA config file (at most 16 MiB); errors name the path.
absl::StatusOr<std::string> ReadAoaFile(const std::string& path);

// The whole AOA load planning in one call: PlanLoad when `aoa_text` is
// empty (or only comments), else parse + resolve + PlanLoad on the virtual
// metadata + FinishAoaPlan. `where` names the config in messages.
absl::StatusOr<LoadPlan> PlanLoadWithAoa(const CheckpointMetadata& checkpoint,
                                         absl::string_view aoa_text,
                                         const std::vector<RankTargets>& ranks,
                                         const PlanOptions& options = {},
                                         const std::string& where = "aoa");

}  // namespace ckpt

#endif  // CKPTD_CORE_AOA_H_
