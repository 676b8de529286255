// Private to core/aoa*.cc: what AOA's statement parser (aoa_parse.cc), its
// values (aoa_values.cc) and its resolver (aoa.cc) share. Not an API.
#ifndef CKPTD_CORE_AOA_INTERNAL_H_
#define CKPTD_CORE_AOA_INTERNAL_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "core/plan/aoa.h"

namespace ckpt {
namespace aoa_internal {

// Bounds on what one statement can make the resolver do (fuzzing found both
// unbounded): names an [a:b] array macro expands to, and steps spent
// matching one pattern against one tensor name.
inline constexpr int64_t kMaxArray = 1 << 16;
// Pattern matching steps one statement may take over all the names it is
// matched against: this many, or kMatchStepsPerName per name if more.
inline constexpr int64_t kMaxMatchSteps = 100'000;
inline constexpr int64_t kMatchStepsPerName = 256;
// The tensor names one program may define, over all its statements: this
// many per checkpoint or model tensor, plus kExtraNames. Statements whose '*'
// patterns match the names earlier statements define multiply the names
// (each `* -> x.*` doubles them), so a short program could otherwise ask for
// millions of virtual tensors.
inline constexpr int64_t kNamesPerTensor = 8;
inline constexpr int64_t kExtraNames = 4096;

// --- Name patterns (aoa_parse.cc) ------------------------------------------

// A name pattern: literal text, $LAYER_ID, $EXPERT_ID and '*' pieces.
struct PatternTok {
  enum Kind { kLit, kLayer, kExpert, kStar } kind = kLit;
  std::string lit;
};

struct Captures {
  std::optional<std::string> layer, expert;
  std::vector<std::string> stars;
};

std::vector<PatternTok> Tokenize(absl::string_view text);
// Whether `text` holds a $LAYER_ID, $EXPERT_ID or '*' macro.
bool HasMacro(absl::string_view text);
// Matches toks[ti..] against s[si..], filling `cap`. `budget`: steps left for
// this pattern; at 0 the match fails (the caller reports the pattern as too
// costly), so '*'-heavy patterns cannot make the backtracking exponential.
bool MatchFrom(const std::vector<PatternTok>& toks, size_t ti, absl::string_view s, size_t si,
               Captures& cap, int64_t& budget);
// Natural order: digit runs compare as numbers (layers.2 < layers.10).
bool NaturalLess(const std::string& a, const std::string& b);
// Expands a name's [first:end] array macro: "q[0:3]" -> q0, q1, q2.
std::vector<std::string> ExpandArray(const std::string& text);

// --- Concrete statements and their values (aoa_values.cc) -------------------

struct Source {
  std::string name;
  bool transpose = false;
};

// One statement after macro expansion (or an optimizer-state follower).
struct Concrete {
  const AoaStatement* st = nullptr;  // options come from here
  std::vector<Source> sources;       // empty: `_ -> targets` (keep)
  std::vector<std::string> targets;  // empty: `sources -> _` (drop)
  std::string follows;               // suffix form a follower applies ("" if explicit)
  bool plain_rename = false;         // scalar follower: a copy of source 0, no options
  std::string Render() const;
};

// A box of a checkpoint tensor placed into a value: destination axis j is
// source axis axes[j]; the piece occupies [dst_offset, dst_offset + shape)
// with shape[j] = src_box.shape[axes[j]].
struct Piece {
  const std::string* tensor = nullptr;  // checkpoint tensor name
  Box src_box;
  std::vector<int> axes;
  Shape dst_offset;
};

struct Value {
  Shape shape;
  DType dtype = DType::kF32;
  std::vector<Piece> pieces;
};

// The optimizer-state names that follow a parameter's statements.
struct FollowerForm {
  std::string label;
  std::function<std::string(const std::string&)> apply;
  bool scalar = false;  // beta pow accumulators: one element per parameter
};

// The whole of checkpoint tensor `name` as a value.
Value CheckpointValue(const std::string& name, const TensorMeta& t);
// out axis j = in axis perm[j].
Value Permute(const Value& in, const std::vector<int>& perm);
// [lo, hi) along `axis`.
Value Slice(const Value& in, int axis, int64_t lo, int64_t hi);
// Concatenates along `axis`; shapes already checked.
Value Concat(const std::vector<Value>& ins, int axis);
// "a.b" -> "a.master_weights.b"; "" without a dot.
std::string InsertMasterWeights(const std::string& name);
// The optimizer-state names that follow a parameter's statements.
const std::vector<FollowerForm>& FollowerForms();

}  // namespace aoa_internal
}  // namespace ckpt

#endif  // CKPTD_CORE_AOA_INTERNAL_H_
