// AOA resolution: statements matched against the checkpoint's and the
// model's tensor names, their values computed, and the checkpoint metadata
// of virtual shards the planner reads (aoa.h). Parsing is aoa_parse.cc,
// values aoa_values.cc.
#include "core/plan/aoa.h"
#include "core/plan/aoa_internal.h"

#include <algorithm>
#include <cctype>
#include <functional>
#include <numeric>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/io/file.h"
#include "core/base/status_macros.h"

namespace ckpt {
namespace {

using namespace aoa_internal;  // NOLINT: this file's own internals

// ===========================================================================
// Resolution
// ===========================================================================

class Resolver {
 public:
  Resolver(const AoaProgram& program, const CheckpointMetadata& ckpt, const ModelTensors& model)
      : program_(program), ckpt_(ckpt), model_(model) {}

  absl::StatusOr<AoaResolution> Run() {
    CKPT_RETURN_IF_ERROR(Expand());
    AddFollowers();
    CKPT_RETURN_IF_ERROR(Bind());
    values_.resize(stmts_.size());
    state_.assign(stmts_.size(), 0);
    for (size_t i = 0; i < stmts_.size(); ++i) CKPT_RETURN_IF_ERROR(Eval(i));
    return Build();
  }

 private:
  // "WHERE:LINE (`statement`): "
  std::string At(const Concrete& c) const {
    std::string s = absl::StrCat(program_.where, ":", c.st->line, " (`", c.Render(), "`");
    if (!c.follows.empty()) absl::StrAppend(&s, ", following its parameter for '", c.follows, "'");
    absl::StrAppend(&s, "): ");
    return s;
  }
  absl::Status Err(const Concrete& c, absl::string_view msg) const {
    return absl::InvalidArgumentError(absl::StrCat(At(c), msg));
  }
  absl::Status Err(const AoaStatement& st, absl::string_view msg) const {
    return absl::InvalidArgumentError(
        absl::StrCat(program_.where, ":", st.line, " (`", st.text, "`): ", msg));
  }

  // --- macro expansion ----------------------------------------------------

  absl::StatusOr<std::string> Substitute(const AoaStatement& st, const std::string& text,
                                         const Captures& cap, const std::string& pattern) const {
    std::string out;
    size_t star = 0;
    for (const PatternTok& t : Tokenize(text)) {
      switch (t.kind) {
        case PatternTok::kLit: out += t.lit; break;
        case PatternTok::kLayer:
          if (!cap.layer) return Err(st, absl::StrCat("'", text, "' uses $LAYER_ID but the pattern '", pattern, "' does not bind it"));
          out += *cap.layer;
          break;
        case PatternTok::kExpert:
          if (!cap.expert) return Err(st, absl::StrCat("'", text, "' uses $EXPERT_ID but the pattern '", pattern, "' does not bind it"));
          out += *cap.expert;
          break;
        case PatternTok::kStar:
          if (star >= cap.stars.size()) return Err(st, absl::StrCat("'", text, "' has more '*' than the pattern '", pattern, "'"));
          out += cap.stars[star++];
          break;
      }
    }
    return out;
  }

  absl::Status Expand() {
    std::set<std::string> available;
    for (const auto& [name, t] : ckpt_.tensors) available.insert(name);
    const int64_t max_names =
        kNamesPerTensor * static_cast<int64_t>(ckpt_.tensors.size() + model_.size()) + kExtraNames;
    int64_t defined = 0;  // target names of the statements so far
    for (const AoaStatement& st : program_.statements) {
      std::vector<Source> srcs;
      std::vector<std::string> tgts;
      const bool keep = st.sources[0].text == "_";
      const bool drop = st.targets[0].text == "_";
      if (!keep) {
        for (const AoaName& n : st.sources) {
          for (std::string& e : ExpandArray(n.text)) srcs.push_back({std::move(e), n.transpose});
        }
      }
      if (!drop) {
        for (const AoaName& n : st.targets) {
          for (std::string& e : ExpandArray(n.text)) tgts.push_back(std::move(e));
        }
      }
      // The pattern: the first source with a macro; for `_ -> t` the first
      // target with one, matched against the model's names.
      std::string pattern;
      for (const Source& s : srcs) {
        if (HasMacro(s.name)) {
          pattern = s.name;
          break;
        }
      }
      bool on_model = false;
      if (pattern.empty()) {
        for (const std::string& t : tgts) {
          if (!HasMacro(t)) continue;
          if (!keep) {
            return Err(st, absl::StrCat("target '", t, "' uses a macro that no source binds"));
          }
          pattern = t;
          on_model = true;
          break;
        }
      }
      std::vector<Concrete> out;
      if (pattern.empty()) {
        out.push_back({&st, srcs, tgts, "", false});
      } else {
        const std::vector<PatternTok> toks = Tokenize(pattern);
        std::vector<std::pair<std::string, Captures>> matches;
        // One budget for the whole statement, not per name: a pattern that
        // backtracks (many '*') against every one of many names must not
        // multiply its cost by the number of names.
        const int64_t names = static_cast<int64_t>(on_model ? model_.size() : available.size());
        const int64_t limit = std::max(kMaxMatchSteps, kMatchStepsPerName * names);
        int64_t budget = limit;
        bool exhausted = false;
        auto try_name = [&](const std::string& name) {
          if (exhausted) return;
          Captures cap;
          if (MatchFrom(toks, 0, name, 0, cap, budget)) matches.emplace_back(name, std::move(cap));
          exhausted = budget <= 0;
        };
        if (on_model) {
          for (const auto& [name, m] : model_) try_name(name);
        } else {
          for (const std::string& name : available) try_name(name);
        }
        if (exhausted) {
          return Err(st, absl::StrCat("'", pattern, "' takes more than ", limit,
                                      " steps to match against the ", names,
                                      " tensor names (too many '*' or macros)"));
        }
        if (matches.empty() && !on_model) {
          return Err(st, absl::StrCat("'", pattern, "' matches no tensor of the checkpoint ",
                                      "(nor any name an earlier statement feeds)"));
        }
        const int64_t adds = static_cast<int64_t>(matches.size()) * static_cast<int64_t>(tgts.size());
        if (defined + adds > max_names) {
          return Err(st, absl::StrCat(
              "'", pattern, "' matches ", matches.size(), " names, which would make the program define ",
              defined + adds, " tensor names; the limit is ", max_names, " (", kNamesPerTensor,
              " per checkpoint or model tensor, plus ", kExtraNames,
              "): statements whose '*' matches what earlier ones define multiply the names"));
        }
        std::sort(matches.begin(), matches.end(),
                  [](const auto& a, const auto& b) { return NaturalLess(a.first, b.first); });
        for (const auto& [name, cap] : matches) {
          Concrete c{&st, {}, {}, "", false};
          for (const Source& s : srcs) {
            CKPT_ASSIGN_OR_RETURN(std::string n, Substitute(st, s.name, cap, pattern));
            c.sources.push_back({std::move(n), s.transpose});
          }
          for (const std::string& t : tgts) {
            CKPT_ASSIGN_OR_RETURN(std::string n, Substitute(st, t, cap, pattern));
            c.targets.push_back(std::move(n));
          }
          out.push_back(std::move(c));
        }
      }
      for (Concrete& c : out) {
        defined += static_cast<int64_t>(c.targets.size());
        for (const std::string& t : c.targets) available.insert(t);
        explicit_.push_back(std::move(c));
      }
    }
    return absl::OkStatus();
  }

  // Optimizer states named after a parameter follow its statements, unless
  // a statement of the config feeds them explicitly.
  void AddFollowers() {
    std::set<std::string> explicit_targets;
    for (const Concrete& c : explicit_) explicit_targets.insert(c.targets.begin(), c.targets.end());
    std::set<std::string> available;
    for (const auto& [name, t] : ckpt_.tensors) available.insert(name);
    std::set<std::string> scalar;  // follower outputs that are scalar accumulators
    auto is_scalar = [&](const std::string& n) {
      auto it = ckpt_.tensors.find(n);
      if (it != ckpt_.tensors.end()) return NumElements(it->second.global_shape) == 1;
      return scalar.count(n) > 0;
    };
    for (Concrete& c : explicit_) {
      for (const std::string& t : c.targets) available.insert(t);
      const Concrete base = c;
      stmts_.push_back(std::move(c));
      for (const FollowerForm& f : FollowerForms()) {
        if (base.sources.empty()) {  // keep: the model's own states too
          for (const std::string& t : base.targets) {
            std::string ft = f.apply(t);
            if (!ft.empty() && model_.count(ft) && !explicit_targets.count(ft)) {
              stmts_.push_back({base.st, {}, {ft}, f.label, false});
            }
          }
          continue;
        }
        std::vector<Source> fs;
        for (const Source& s : base.sources) {
          std::string n = f.apply(s.name);
          if (n.empty() || !available.count(n)) break;
          fs.push_back({n, s.transpose});
        }
        if (base.targets.empty()) {  // drop: whichever states exist
          for (const Source& s : fs) stmts_.push_back({base.st, {s}, {}, f.label, false});
          continue;
        }
        if (fs.size() != base.sources.size()) continue;
        std::vector<std::string> ft;
        bool skip = false;
        for (const std::string& t : base.targets) {
          std::string n = f.apply(t);
          if (n.empty() || explicit_targets.count(n)) skip = true;
          ft.push_back(n);
        }
        if (skip) continue;
        if (f.scalar && is_scalar(fs[0].name)) {
          // One element per parameter: every target gets source 0's.
          for (const std::string& t : ft) {
            stmts_.push_back({base.st, {{fs[0].name, false}}, {t}, f.label, true});
            scalar.insert(t);
          }
        } else {
          stmts_.push_back({base.st, fs, ft, f.label, false});
        }
        for (const std::string& t : ft) available.insert(t);
      }
    }
  }

  // --- binding: which definition each source reads -----------------------

  struct Binding {
    int stmt = -1;  // -1: the checkpoint tensor
    size_t target = 0;
  };

  absl::Status Bind() {
    // Definitions of each name, in statement order.
    for (size_t i = 0; i < stmts_.size(); ++i) {
      const Concrete& c = stmts_[i];
      std::set<std::string> seen;
      for (size_t k = 0; k < c.targets.size(); ++k) {
        if (!seen.insert(c.targets[k]).second) {
          return Err(c, absl::StrCat("'", c.targets[k], "' is a target twice"));
        }
        defs_[c.targets[k]].push_back({static_cast<int>(i), k});
      }
      for (const Source& s : c.sources) {
        if (c.targets.empty()) deletes_[s.name].push_back(static_cast<int>(i));
      }
    }
    bindings_.resize(stmts_.size());
    std::map<std::pair<std::string, int>, int> reads;  // (name, def stmt) -> times read
    for (size_t i = 0; i < stmts_.size(); ++i) {
      const Concrete& c = stmts_[i];
      for (const Source& s : c.sources) {
        Binding b;
        const auto dit = defs_.find(s.name);
        const Binding* earlier = nullptr;
        const Binding* later = nullptr;
        if (dit != defs_.end()) {
          for (const Binding& d : dit->second) {
            if (d.stmt < static_cast<int>(i)) earlier = &d;
            if (d.stmt > static_cast<int>(i)) later = &d;  // the last one
          }
        }
        // A drop after the latest definition hides it again.
        int last_delete = -1;
        if (auto del = deletes_.find(s.name); del != deletes_.end()) {
          for (int d : del->second) {
            if (d < static_cast<int>(i)) last_delete = d;
          }
        }
        if (earlier != nullptr && earlier->stmt > last_delete) {
          b = *earlier;
        } else if (last_delete >= 0) {
          return Err(c, absl::StrCat("'", s.name, "' was dropped by line ",
                                     stmts_[last_delete].st->line, " before this statement reads it"));
        } else if (ckpt_.tensors.count(s.name)) {
          b.stmt = -1;
        } else if (later != nullptr) {
          b = *later;  // forward reference to an intermediate: its final value
        } else if (earlier != nullptr) {
          b = *earlier;
        } else {
          return Err(c, absl::StrCat("unknown source '", s.name, "': not a checkpoint tensor and ",
                                     "no statement feeds it"));
        }
        if (b.stmt >= 0 && stmts_[b.stmt].sources.empty()) {
          return Err(c, absl::StrCat("'", s.name, "' is kept from the model (`_ -> ", s.name,
                                     "`, line ", stmts_[b.stmt].st->line, ") and cannot be read"));
        }
        if (b.stmt >= 0) ++reads[{s.name, b.stmt}];
        bindings_[i].push_back(b);
      }
    }
    // A name fed again while the value fed before is never read: fed twice.
    for (const auto& [name, ds] : defs_) {
      for (size_t k = 0; k + 1 < ds.size(); ++k) {
        const Concrete& first = stmts_[ds[k].stmt];
        if (reads.count({name, ds[k].stmt})) continue;
        // A drop in between is an explicit reset.
        bool dropped = false;
        if (auto del = deletes_.find(name); del != deletes_.end()) {
          for (int d : del->second) dropped |= d > ds[k].stmt && d < ds[k + 1].stmt;
        }
        if (dropped) continue;
        return Err(stmts_[ds[k + 1].stmt],
                   absl::StrCat("'", name, "' is fed twice: line ", first.st->line, " (`",
                                first.Render(), "`) already feeds it and nothing reads that value"));
      }
    }
    return absl::OkStatus();
  }

  // --- evaluation ----------------------------------------------------------

  absl::StatusOr<Value> Input(size_t i, size_t k) {
    const Binding& b = bindings_[i][k];
    const Source& s = stmts_[i].sources[k];
    Value v;
    if (b.stmt < 0) {
      auto it = ckpt_.tensors.find(s.name);
      v = CheckpointValue(it->first, it->second);
    } else {
      if (state_[b.stmt] == 1) {
        // Report the cycle along the evaluation stack.
        std::vector<std::string> chain;
        bool in = false;
        for (const StackEntry& e : stack_) {
          if (e.reader == static_cast<size_t>(b.stmt)) in = true;
          if (in) {
            chain.push_back(absl::StrCat("line ", stmts_[e.reader].st->line, " reads '", e.name,
                                         "' fed by line ", stmts_[e.feeder].st->line));
          }
        }
        chain.push_back(absl::StrCat("line ", stmts_[i].st->line, " reads '", s.name,
                                     "' fed by line ", stmts_[b.stmt].st->line));
        return Err(stmts_[i], absl::StrCat("cycle: ", absl::StrJoin(chain, ", ")));
      }
      stack_.push_back({i, s.name, static_cast<size_t>(b.stmt)});
      absl::Status st = Eval(b.stmt);
      stack_.pop_back();
      CKPT_RETURN_IF_ERROR(st);
      v = values_[b.stmt][b.target];
    }
    if (s.transpose) {
      std::vector<int> rev(v.shape.size());
      for (size_t a = 0; a < rev.size(); ++a) rev[a] = static_cast<int>(rev.size() - 1 - a);
      v = Permute(v, rev);
    }
    return v;
  }

  absl::StatusOr<int> Axis(const Concrete& c, size_t rank, bool fused) {
    int axis = c.st->axis ? *c.st->axis : (fused ? (rank >= 2 ? 1 : 0) : 0);
    if (axis < 0) axis += static_cast<int>(rank);
    if (axis < 0 || axis >= static_cast<int>(rank)) {
      return Err(c, absl::StrCat("axis ", c.st->axis ? *c.st->axis : axis,
                                 " is out of range for tensors of rank ", rank));
    }
    return axis;
  }

  absl::Status SameShapeBut(const Concrete& c, const std::vector<Value>& ins, int axis) {
    for (size_t k = 1; k < ins.size(); ++k) {
      bool ok = ins[k].shape.size() == ins[0].shape.size();
      for (size_t a = 0; ok && a < ins[0].shape.size(); ++a) {
        if (static_cast<int>(a) != axis && ins[k].shape[a] != ins[0].shape[a]) ok = false;
      }
      if (!ok) {
        return Err(c, absl::StrCat("shape mismatch: '", c.sources[0].name, "' is ",
                                   ShapeString(ins[0].shape), " but '", c.sources[k].name, "' is ",
                                   ShapeString(ins[k].shape),
                                   axis < 0 ? std::string("; they must have the same shape")
                                            : absl::StrCat("; they must agree on every axis but ",
                                                           axis)));
      }
    }
    return absl::OkStatus();
  }

  absl::Status Eval(size_t i) {
    if (state_[i] == 2) return absl::OkStatus();
    state_[i] = 1;
    const Concrete& c = stmts_[i];
    std::vector<Value> ins;
    for (size_t k = 0; k < c.sources.size(); ++k) {
      CKPT_ASSIGN_OR_RETURN(Value v, Input(i, k));
      ins.push_back(std::move(v));
    }
    std::vector<Value> outs;
    const AoaStatement& st = *c.st;
    // Followers take the statement's layout, not its cast: the rank's dtype
    // decides how their elements convert anyway.
    const bool cast = c.follows.empty() && st.dtype.has_value();
    const DType cast_to = cast ? *st.dtype : DType::kF32;
    if (c.sources.empty() || c.targets.empty()) {
      // keep / drop: no values
    } else if (c.plain_rename) {
      outs.push_back(ins[0]);
    } else {
      // Sources must share a dtype unless the statement casts.
      for (size_t k = 1; k < ins.size(); ++k) {
        if (ins[k].dtype != ins[0].dtype && !cast) {
          return Err(c, absl::StrCat("'", c.sources[0].name, "' is ", DTypeName(ins[0].dtype),
                                     " but '", c.sources[k].name, "' is ", DTypeName(ins[k].dtype),
                                     "; add dtype= to combine them"));
        }
      }
      if (cast) {
        for (size_t k = 0; k < ins.size(); ++k) {
          if (!CanConvert(ins[k].dtype, cast_to)) {
            return Err(c, absl::StrCat("'", c.sources[k].name, "' is ", DTypeName(ins[k].dtype),
                                       ", which cannot be cast to ", DTypeName(cast_to)));
          }
          ins[k].dtype = cast_to;
        }
      }
      const size_t rank = ins[0].shape.size();
      if (st.fused == AoaFused::kQkv) {
        CKPT_ASSIGN_OR_RETURN(int axis, Axis(c, rank, true));
        CKPT_RETURN_IF_ERROR(FusedQkv(c, ins, axis, outs));
      } else if (st.fused == AoaFused::kFfn) {
        CKPT_ASSIGN_OR_RETURN(int axis, Axis(c, rank, true));
        if (ins.size() == 2) {
          CKPT_RETURN_IF_ERROR(SameShapeBut(c, ins, -1));
          outs.push_back(Concat(ins, axis));
        } else {
          CKPT_RETURN_IF_ERROR(Split(c, ins[0], axis, 2, outs));
        }
      } else if (st.permute) {
        if (st.permute->size() != rank) {
          return Err(c, absl::StrCat("permute has ", st.permute->size(), " axes but '",
                                     c.sources[0].name, "' has rank ", rank, " (",
                                     ShapeString(ins[0].shape), ")"));
        }
        outs.push_back(Permute(ins[0], *st.permute));
      } else if (ins.size() > 1) {
        CKPT_ASSIGN_OR_RETURN(int axis, Axis(c, rank, false));
        CKPT_RETURN_IF_ERROR(SameShapeBut(c, ins, axis));
        outs.push_back(Concat(ins, axis));
      } else if (c.targets.size() > 1) {
        CKPT_ASSIGN_OR_RETURN(int axis, Axis(c, rank, false));
        CKPT_RETURN_IF_ERROR(Split(c, ins[0], axis, static_cast<int64_t>(c.targets.size()), outs));
      } else {
        outs.push_back(ins[0]);
      }
    }
    values_[i] = std::move(outs);
    state_[i] = 2;
    return absl::OkStatus();
  }

  absl::Status Split(const Concrete& c, const Value& in, int axis, int64_t parts,
                     std::vector<Value>& outs) {
    const int64_t n = in.shape[axis];
    if (n % parts != 0) {
      return Err(c, absl::StrCat("cannot split '", c.sources[0].name, "' ", ShapeString(in.shape),
                                 " into ", parts, " equal parts along axis ", axis, ": ", n,
                                 " is not divisible by ", parts));
    }
    const int64_t w = n / parts;
    for (int64_t k = 0; k < parts; ++k) outs.push_back(Slice(in, axis, k * w, (k + 1) * w));
    return absl::OkStatus();
  }

  // qkv along `axis` = for each group g: the H/G query heads of g, K_g, V_g.
  absl::Status FusedQkv(const Concrete& c, const std::vector<Value>& ins, int axis,
                        std::vector<Value>& outs) {
    const int64_t H = *c.st->num_heads, G = *c.st->num_key_value_groups, HG = H / G;
    if (ins.size() == 1) {
      const Value& qkv = ins[0];
      const int64_t n = qkv.shape[axis];
      if (n % (H + 2 * G) != 0) {
        return Err(c, absl::StrCat("'", c.sources[0].name, "' has ", n, " along axis ", axis,
                                   ", not divisible by num_heads + 2 * num_key_value_groups = ",
                                   H + 2 * G));
      }
      const int64_t d = n / (H + 2 * G), block = (HG + 2) * d;
      std::vector<Value> q, k, v;
      for (int64_t g = 0; g < G; ++g) {
        q.push_back(Slice(qkv, axis, g * block, g * block + HG * d));
        k.push_back(Slice(qkv, axis, g * block + HG * d, g * block + (HG + 1) * d));
        v.push_back(Slice(qkv, axis, g * block + (HG + 1) * d, (g + 1) * block));
      }
      outs.push_back(Concat(q, axis));
      outs.push_back(Concat(k, axis));
      outs.push_back(Concat(v, axis));
      return absl::OkStatus();
    }
    CKPT_RETURN_IF_ERROR(SameShapeBut(c, ins, axis));
    const int64_t nq = ins[0].shape[axis];
    if (nq % H != 0) {
      return Err(c, absl::StrCat("'", c.sources[0].name, "' has ", nq, " along axis ", axis,
                                 ", not divisible by num_heads=", H));
    }
    const int64_t d = nq / H;
    for (size_t s = 1; s < 3; ++s) {
      if (ins[s].shape[axis] != G * d) {
        return Err(c, absl::StrCat("shape mismatch: '", c.sources[s].name, "' has ",
                                   ins[s].shape[axis], " along axis ", axis, ", expected ",
                                   "num_key_value_groups * head size = ", G, " * ", d, " = ", G * d));
      }
    }
    std::vector<Value> parts;
    for (int64_t g = 0; g < G; ++g) {
      parts.push_back(Slice(ins[0], axis, g * HG * d, (g + 1) * HG * d));
      parts.push_back(Slice(ins[1], axis, g * d, (g + 1) * d));
      parts.push_back(Slice(ins[2], axis, g * d, (g + 1) * d));
    }
    outs.push_back(Concat(parts, axis));
    return absl::OkStatus();
  }

  // --- the virtual checkpoint -------------------------------------------

  // The virtual shards of `v`: each real shard a piece overlaps, placed at
  // the piece's destination.
  TensorMeta Materialize(const Value& v, std::set<std::string>& sources) const {
    TensorMeta tm;
    tm.dtype = v.dtype;
    tm.global_shape = v.shape;
    const size_t rank = v.shape.size();
    for (const Piece& p : v.pieces) {
      sources.insert(*p.tensor);
      const TensorMeta& src = ckpt_.tensors.at(*p.tensor);
      std::vector<int> perm(rank);  // storage axis k is destination axis perm[k]
      for (size_t j = 0; j < rank; ++j) perm[p.axes[j]] = static_cast<int>(j);
      auto place = [&](const Box& b) {  // source box -> destination box
        Box o;
        for (size_t j = 0; j < rank; ++j) {
          const int a = p.axes[j];
          o.offset.push_back(p.dst_offset[j] + b.offset[a] - p.src_box.offset[a]);
          o.shape.push_back(b.shape[a]);
        }
        return o;
      };
      for (const ShardMeta& s : src.shards) {
        if (s.replica_id != 0) continue;
        std::optional<Box> part = Intersect(s.box, p.src_box);
        if (!part) continue;
        if (NumElements(part->shape) == 0 && rank > 0) continue;
        ShardMeta vs = s;
        vs.box = place(s.box);
        Box window = place(*part);
        if (window != vs.box) vs.window = window;
        if (!IsIdentityPerm(perm)) vs.perm = perm;
        tm.shards.push_back(std::move(vs));
      }
    }
    return tm;
  }

  absl::StatusOr<AoaResolution> Build() {
    AoaResolution res;
    res.metadata.unique_id = ckpt_.unique_id;
    res.metadata.checksum_block = ckpt_.checksum_block;
    res.metadata.flat_mapping = ckpt_.flat_mapping;
    for (const Concrete& c : stmts_) res.expanded.push_back(absl::StrCat(c.st->line, ": ", c.Render()));
    // Final definition of every name, counting drops.
    struct Final {
      int stmt = -1;
      size_t target = 0;
      bool deleted = false;
    };
    std::map<std::string, Final> finals;
    for (const auto& [name, ds] : defs_) finals[name] = {ds.back().stmt, ds.back().target, false};
    for (const auto& [name, dels] : deletes_) {
      auto it = finals.find(name);
      if (it == finals.end() || dels.back() > it->second.stmt) finals[name] = {dels.back(), 0, true};
    }
    // Checkpoint tensors a drop reads directly.
    for (size_t i = 0; i < stmts_.size(); ++i) {
      if (!stmts_[i].targets.empty()) continue;
      for (size_t k = 0; k < stmts_[i].sources.size(); ++k) {
        if (bindings_[i][k].stmt < 0) res.dropped.insert(stmts_[i].sources[k].name);
      }
    }
    for (const auto& [name, f] : finals) {
      if (f.deleted) continue;
      const Concrete& c = stmts_[f.stmt];
      if (c.sources.empty()) {
        res.kept.insert(name);
        continue;
      }
      const Value& v = values_[f.stmt][f.target];
      auto m = model_.find(name);
      if (m != model_.end()) {
        if (m->second.global_shape != v.shape) {
          return Err(c, absl::StrCat("shape mismatch: '", name, "' comes out as ",
                                     ShapeString(v.shape), " but the model's '", name, "' is ",
                                     ShapeString(m->second.global_shape)));
        }
        if (!CanConvert(v.dtype, m->second.dtype)) {
          return Err(c, absl::StrCat("'", name, "' comes out as ", DTypeName(v.dtype),
                                     ", which cannot be converted to the model's ",
                                     DTypeName(m->second.dtype)));
        }
      }
      res.metadata.tensors[name] = Materialize(v, res.sources[name]);
    }
    for (const auto& [name, t] : ckpt_.tensors) {
      if (finals.count(name)) continue;
      res.metadata.tensors[name] = t;
      res.sources[name].insert(name);
    }
    return res;
  }

  const AoaProgram& program_;
  const CheckpointMetadata& ckpt_;
  const ModelTensors& model_;
  std::vector<Concrete> explicit_;
  std::vector<Concrete> stmts_;
  std::map<std::string, std::vector<Binding>> defs_;
  std::map<std::string, std::vector<int>> deletes_;
  std::vector<std::vector<Binding>> bindings_;
  std::vector<std::vector<Value>> values_;
  std::vector<int> state_;  // 0 new, 1 evaluating, 2 done
  struct StackEntry {
    size_t reader;
    std::string name;
    size_t feeder;
  };
  std::vector<StackEntry> stack_;
};

}  // namespace


ModelTensors ModelTensorsOf(const std::vector<RankTargets>& ranks) {
  ModelTensors m;
  for (const RankTargets& r : ranks) {
    for (const TargetTensor& t : r.tensors) m.emplace(t.name, ModelTensor{t.dtype, t.global_shape});
  }
  return m;
}

absl::StatusOr<AoaResolution> ResolveAoa(const AoaProgram& program,
                                         const CheckpointMetadata& checkpoint,
                                         const ModelTensors& model) {
  return Resolver(program, checkpoint, model).Run();
}

void FinishAoaPlan(const AoaResolution& resolution, const CheckpointMetadata& checkpoint,
                   LoadPlan* plan) {
  auto drop_kept = [&](std::vector<std::string>& keys) {
    keys.erase(std::remove_if(keys.begin(), keys.end(),
                              [&](const std::string& k) { return resolution.kept.count(k) > 0; }),
               keys.end());
  };
  drop_kept(plan->missing_keys);
  std::set<std::string> used;
  for (RankPlan& rp : plan->ranks) {
    drop_kept(rp.missing_keys);
    for (const TargetTensor& t : rp.targets) {
      std::string name = t.name;
      if (auto r = plan->renamed_keys.find(name); r != plan->renamed_keys.end()) name = r->second;
      if (auto s = resolution.sources.find(name); s != resolution.sources.end()) {
        used.insert(s->second.begin(), s->second.end());
      }
    }
  }
  plan->unexpected_keys.clear();
  for (const auto& [name, t] : checkpoint.tensors) {
    if (!used.count(name) && !resolution.dropped.count(name)) plan->unexpected_keys.push_back(name);
  }
}


absl::StatusOr<LoadPlan> PlanLoadWithAoa(const CheckpointMetadata& checkpoint,
                                         absl::string_view aoa_text,
                                         const std::vector<RankTargets>& ranks,
                                         const PlanOptions& options, const std::string& where) {
  CKPT_ASSIGN_OR_RETURN(AoaProgram program, ParseAoa(aoa_text, where));
  if (program.statements.empty()) return PlanLoad(checkpoint, ranks, options);
  CKPT_ASSIGN_OR_RETURN(AoaResolution res, ResolveAoa(program, checkpoint, ModelTensorsOf(ranks)));
  CKPT_ASSIGN_OR_RETURN(LoadPlan plan, PlanLoad(res.metadata, ranks, options));
  FinishAoaPlan(res, checkpoint, &plan);
  return plan;
}

}  // namespace ckpt
