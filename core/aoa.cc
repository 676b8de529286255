#include "core/aoa.h"

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
#include "core/file.h"
#include "core/status_macros.h"

namespace ckpt {
namespace {
// Bounds on what one statement can make the resolver do (fuzzing found both
// unbounded): names an [a:b] array macro expands to, and steps spent
// matching one pattern against one tensor name.
constexpr int64_t kMaxArray = 1 << 16;
// Pattern matching steps one statement may take over all the names it is
// matched against: this many, or kMatchStepsPerName per name if more.
constexpr int64_t kMaxMatchSteps = 100'000;
constexpr int64_t kMatchStepsPerName = 256;
// The tensor names one program may define, over all its statements: this
// many per checkpoint or model tensor, plus kExtraNames. Statements whose '*'
// patterns match the names earlier statements define multiply the names
// (each `* -> x.*` doubles them), so a short program could otherwise ask for
// millions of virtual tensors.
constexpr int64_t kNamesPerTensor = 8;
constexpr int64_t kExtraNames = 4096;
std::vector<std::string> ExpandArray(const std::string& text);
}  // namespace

namespace {

// ===========================================================================
// Parsing
// ===========================================================================

bool IsNameChar(absl::string_view s, size_t i) {
  const char c = s[i];
  if (std::isalnum(static_cast<unsigned char>(c))) return true;
  switch (c) {
    case '_': case '.': case '$': case '*': case '/': case '[': case ']': case ':': case '@':
      return true;
    case '-':
      return i + 1 >= s.size() || s[i + 1] != '>';
    default:
      return false;
  }
}

// Scans one statement (one line, or one string of a JSON list).
class StatementParser {
 public:
  StatementParser(absl::string_view text, std::string location)
      : s_(text), location_(std::move(location)) {}

  // Returns nullopt for a blank or comment-only line.
  absl::StatusOr<std::optional<AoaStatement>> Parse(int line) {
    SkipSpace();
    if (AtEnd()) return std::optional<AoaStatement>();
    AoaStatement st;
    st.line = line;
    size_t end = s_.find('#');
    st.text = std::string(absl::StripAsciiWhitespace(s_.substr(0, end)));
    // Sources.
    while (true) {
      SkipSpace();
      CKPT_ASSIGN_OR_RETURN(AoaName n, ParseName("a source tensor name"));
      SkipSpace();
      if (Peek() == '^') {
        if (pos_ + 1 < s_.size() && s_[pos_ + 1] == 'T') {
          n.transpose = true;
          pos_ += 2;
        } else {
          return Error(pos_ + 1, "expected 'T' after '^' (write a^T to transpose a)");
        }
      }
      st.sources.push_back(std::move(n));
      SkipSpace();
      if (Peek() == ',') {
        ++pos_;
        continue;
      }
      break;
    }
    SkipSpace();
    if (!Consume("->")) return Error(pos_, absl::StrCat("expected ',' or '->' after the source names, found ", Found()));
    // Targets, then options.
    bool in_options = false;
    std::set<std::string> seen_options;
    while (true) {
      SkipSpace();
      const size_t start = pos_;
      // An option is an identifier followed by '=' or a bare flag.
      size_t p = pos_;
      while (p < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[p])) || s_[p] == '_')) ++p;
      absl::string_view ident = s_.substr(pos_, p - pos_);
      size_t q = p;
      while (q < s_.size() && (s_[q] == ' ' || s_[q] == '\t')) ++q;
      const bool is_assign = !ident.empty() && q < s_.size() && s_[q] == '=';
      const bool is_flag = (ident == "fused_qkv" || ident == "fused_ffn") &&
                           (q >= s_.size() || s_[q] == ',' || s_[q] == '#');
      if (is_assign || is_flag) {
        in_options = true;
        if (!seen_options.insert(std::string(ident)).second) {
          return Error(start, absl::StrCat("option '", ident, "' given twice"));
        }
        if (is_flag) {
          pos_ = p;
          if (st.fused != AoaFused::kNone) return Error(start, "only one of fused_qkv, fused_ffn");
          st.fused = ident == "fused_qkv" ? AoaFused::kQkv : AoaFused::kFfn;
        } else {
          pos_ = q + 1;
          SkipSpace();
          CKPT_RETURN_IF_ERROR(ParseOption(ident, start, st));
        }
      } else if (in_options) {
        return Error(start, absl::StrCat("expected an option (axis=, permute=, dtype=, num_heads=, ",
                                         "num_key_value_groups=, fused_qkv, fused_ffn), found ",
                                         Found()));
      } else {
        CKPT_ASSIGN_OR_RETURN(AoaName n, ParseName("a target tensor name or an option"));
        SkipSpace();
        if (Peek() == '^') return Error(pos_, "^T transposes a source; it cannot follow a target");
        st.targets.push_back(std::move(n));
      }
      SkipSpace();
      if (AtEnd()) break;
      if (Peek() == ',') {
        ++pos_;
        continue;
      }
      return Error(pos_, absl::StrCat("expected ',' or the end of the statement, found ", Found()));
    }
    if (st.targets.empty()) return Error(pos_, "expected at least one target name after '->'");
    CKPT_RETURN_IF_ERROR(CheckForm(st));
    return std::optional<AoaStatement>(std::move(st));
  }

 private:
  bool AtEnd() const { return pos_ >= s_.size() || s_[pos_] == '#'; }
  char Peek() const { return AtEnd() ? '\0' : s_[pos_]; }
  void SkipSpace() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\r')) ++pos_;
  }
  bool Consume(absl::string_view tok) {
    if (s_.substr(pos_, tok.size()) == tok) {
      pos_ += tok.size();
      return true;
    }
    return false;
  }
  std::string Found() const {
    if (AtEnd()) return "the end of the statement";
    size_t e = pos_ + 1;
    while (e < s_.size() && e < pos_ + 12 && IsNameChar(s_, e) && IsNameChar(s_, pos_)) ++e;
    return absl::StrCat("'", s_.substr(pos_, e - pos_), "'");
  }
  absl::Status Error(size_t pos, absl::string_view msg) const {
    return absl::InvalidArgumentError(absl::StrCat(location_, ":", pos + 1, ": ", msg));
  }

  absl::StatusOr<AoaName> ParseName(absl::string_view what) {
    const size_t start = pos_;
    while (pos_ < s_.size() && IsNameChar(s_, pos_)) ++pos_;
    if (pos_ == start) return Error(start, absl::StrCat("expected ", what, ", found ", Found()));
    AoaName n;
    n.text = std::string(s_.substr(start, pos_ - start));
    n.column = static_cast<int>(start) + 1;
    // Macros: $LAYER_ID, $EXPERT_ID; at most one [a:b] array.
    int arrays = 0;
    for (size_t i = 0; i < n.text.size(); ++i) {
      const char c = n.text[i];
      if (c == '$') {
        absl::string_view rest = absl::string_view(n.text).substr(i);
        if (!absl::StartsWith(rest, "$LAYER_ID") && !absl::StartsWith(rest, "$EXPERT_ID")) {
          return Error(start + i, "unknown macro: expected $LAYER_ID or $EXPERT_ID");
        }
      } else if (c == '[') {
        size_t close = n.text.find(']', i);
        int64_t a = 0, b = 0;
        std::vector<std::string> parts;
        if (close != std::string::npos) {
          parts = absl::StrSplit(n.text.substr(i + 1, close - i - 1), ':');
        }
        if (close == std::string::npos || parts.size() != 2 || !absl::SimpleAtoi(parts[0], &a) ||
            !absl::SimpleAtoi(parts[1], &b) || a < 0 || b <= a) {
          return Error(start + i, "expected an array macro [first:end] with 0 <= first < end");
        }
        if (b - a > kMaxArray) {  // each name is materialised (found by tests/fuzz:aoa)
          return Error(start + i, absl::StrCat("an array macro names at most ", kMaxArray,
                                               " tensors, this one ", b - a));
        }
        if (++arrays > 1) return Error(start + i, "at most one [first:end] array macro per name");
        i = close;
      } else if (c == ']' || c == ':') {
        return Error(start + i, absl::StrCat("unexpected '", std::string(1, c), "' in a name"));
      }
    }
    return n;
  }

  absl::StatusOr<int64_t> ParseInt(size_t start) {
    size_t p = pos_;
    if (p < s_.size() && (s_[p] == '-' || s_[p] == '+')) ++p;
    while (p < s_.size() && std::isdigit(static_cast<unsigned char>(s_[p]))) ++p;
    int64_t v = 0;
    if (!absl::SimpleAtoi(s_.substr(pos_, p - pos_), &v)) {
      return Error(pos_, absl::StrCat("expected an integer, found ", Found()));
    }
    pos_ = p;
    (void)start;
    return v;
  }

  // A value, optionally quoted ('...' or "..."); a bare [...] list reads to
  // its closing bracket.
  absl::StatusOr<std::pair<std::string, size_t>> ParseValue() {
    const size_t start = pos_;
    if (Peek() == '\'' || Peek() == '"') {
      const char q = s_[pos_];
      size_t close = s_.find(q, pos_ + 1);
      if (close == absl::string_view::npos) return Error(start, "unterminated quoted value");
      std::string v(s_.substr(pos_ + 1, close - pos_ - 1));
      pos_ = close + 1;
      return std::make_pair(v, start + 1);
    }
    if (Peek() == '[') {
      size_t close = s_.find(']', pos_);
      if (close == absl::string_view::npos) return Error(start, "expected ']' closing the list");
      std::string v(s_.substr(pos_, close + 1 - pos_));
      pos_ = close + 1;
      return std::make_pair(v, start);
    }
    while (pos_ < s_.size() && IsNameChar(s_, pos_)) ++pos_;
    if (pos_ == start) return Error(start, absl::StrCat("expected a value, found ", Found()));
    return std::make_pair(std::string(s_.substr(start, pos_ - start)), start);
  }

  static constexpr int64_t kMaxHeads = 1 << 20;

  absl::Status ParseOption(absl::string_view key, size_t key_pos, AoaStatement& st) {
    if (key == "axis" || key == "num_heads" || key == "num_key_value_groups") {
      size_t vpos = pos_;
      bool quoted = Peek() == '\'' || Peek() == '"';
      if (quoted) ++pos_;
      CKPT_ASSIGN_OR_RETURN(int64_t v, ParseInt(vpos));
      if (quoted) {
        if (Peek() != s_[vpos]) return Error(pos_, "expected the closing quote");
        ++pos_;
      }
      if (key == "axis") {
        if (v < -64 || v > 64) return Error(vpos, "axis out of range");
        st.axis = static_cast<int>(v);
      } else if (v <= 0 || v > kMaxHeads) {
        // Bounded so that H + 2G cannot overflow and a per-group loop stays
        // small whatever the tensor (a zero-size axis divides by anything).
        return Error(vpos, absl::StrCat(key, " must be a positive integer of at most ", kMaxHeads));
      } else if (key == "num_heads") {
        st.num_heads = v;
      } else {
        st.num_key_value_groups = v;
      }
      return absl::OkStatus();
    }
    if (key == "dtype") {
      CKPT_ASSIGN_OR_RETURN(auto v, ParseValue());
      auto d = ParseDType(v.first);
      if (!d.ok()) return Error(v.second, absl::StrCat("unknown dtype '", v.first, "'"));
      st.dtype = *d;
      return absl::OkStatus();
    }
    if (key == "permute") {
      CKPT_ASSIGN_OR_RETURN(auto v, ParseValue());
      absl::string_view body = absl::StripAsciiWhitespace(v.first);
      if (body.size() < 2 || body.front() != '[' || body.back() != ']') {
        return Error(v.second, "expected permute='[i,j,...]'");
      }
      std::vector<int> perm;
      for (absl::string_view part : absl::StrSplit(body.substr(1, body.size() - 2), ',')) {
        int x = 0;
        if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &x) || x < 0) {
          return Error(v.second, "expected permute='[i,j,...]' of non-negative axis numbers");
        }
        perm.push_back(x);
      }
      std::vector<int> sorted = perm;
      std::sort(sorted.begin(), sorted.end());
      for (size_t i = 0; i < sorted.size(); ++i) {
        if (sorted[i] != static_cast<int>(i)) {
          return Error(v.second, absl::StrCat("permute '", body, "' is not a permutation of 0..",
                                              perm.size() - 1));
        }
      }
      st.permute = std::move(perm);
      return absl::OkStatus();
    }
    return Error(key_pos, absl::StrCat("unknown option '", key, "' (expected axis, permute, dtype, ",
                                       "num_heads, num_key_value_groups, fused_qkv, fused_ffn)"));
  }

  // Checks the statement's shape: which options go with which forms.
  absl::Status CheckForm(const AoaStatement& st) const {
    auto err = [&](absl::string_view msg) {
      return absl::InvalidArgumentError(absl::StrCat(location_, ": ", msg));
    };
    // Counted after [a:b] expansion: the arity checks below must hold for
    // the names the resolver will see (found by tests/fuzz:aoa: a fused
    // statement whose array macro added a target read past the split).
    size_t ns = 0, nt = 0;
    for (const AoaName& n : st.sources) ns += ExpandArray(n.text).size();
    for (const AoaName& n : st.targets) nt += ExpandArray(n.text).size();
    auto is_any = [](const std::vector<AoaName>& v) {
      return std::any_of(v.begin(), v.end(), [](const AoaName& n) { return n.text == "_"; });
    };
    const bool keep = is_any(st.sources), drop = is_any(st.targets);
    const bool has_opts = st.axis || st.permute || st.dtype || st.fused != AoaFused::kNone ||
                          st.num_heads || st.num_key_value_groups;
    if (keep && drop) return err("'_ -> _' means nothing");
    if (keep || drop) {
      if ((keep && ns != 1) || (drop && nt != 1)) return err("'_' stands alone on its side of '->'");
      if (keep && st.sources[0].transpose) return err("'_^T' means nothing");
      if (has_opts) return err(keep ? "'_ -> name' (keep) takes no options" : "'name -> _' (drop) takes no options");
      return absl::OkStatus();
    }
    if (st.fused == AoaFused::kQkv) {
      if (!st.num_heads || !st.num_key_value_groups) {
        return err("fused_qkv needs num_heads=H and num_key_value_groups=G");
      }
      if (*st.num_heads % *st.num_key_value_groups != 0) {
        return err(absl::StrCat("fused_qkv: num_heads=", *st.num_heads,
                                " is not a multiple of num_key_value_groups=",
                                *st.num_key_value_groups));
      }
      if (!((ns == 1 && nt == 3) || (ns == 3 && nt == 1))) {
        return err(absl::StrCat("fused_qkv maps qkv -> q,k,v or q,k,v -> qkv; this statement has ",
                                ns, " source(s) and ", nt, " target(s)"));
      }
    } else if (st.num_heads || st.num_key_value_groups) {
      return err("num_heads and num_key_value_groups go with fused_qkv");
    }
    if (st.fused == AoaFused::kFfn && !((ns == 1 && nt == 2) || (ns == 2 && nt == 1))) {
      return err(absl::StrCat("fused_ffn maps gate,up -> gate_up or gate_up -> gate,up; this "
                              "statement has ", ns, " source(s) and ", nt, " target(s)"));
    }
    if (st.permute && (ns != 1 || nt != 1)) return err("permute= takes one source and one target");
    if (st.fused == AoaFused::kNone) {
      if (ns > 1 && nt > 1) {
        return err(absl::StrCat(ns, " sources and ", nt, " targets: a statement concatenates ",
                                "(several -> one) or splits (one -> several), not both"));
      }
      if ((ns > 1 || nt > 1) && !st.axis) {
        return err(ns > 1 ? "concatenating several sources needs axis=N"
                          : "splitting into several targets needs axis=N");
      }
    }
    return absl::OkStatus();
  }

  absl::string_view s_;
  std::string location_;
  size_t pos_ = 0;
};

// ===========================================================================
// Macro expansion
// ===========================================================================

// A name pattern: literal text, $LAYER_ID, $EXPERT_ID and '*' pieces.
struct PatternTok {
  enum Kind { kLit, kLayer, kExpert, kStar } kind = kLit;
  std::string lit;
};

std::vector<PatternTok> Tokenize(absl::string_view text) {
  std::vector<PatternTok> toks;
  std::string lit;
  auto flush = [&]() {
    if (!lit.empty()) toks.push_back({PatternTok::kLit, std::move(lit)});
    lit.clear();
  };
  for (size_t i = 0; i < text.size();) {
    absl::string_view rest = text.substr(i);
    if (absl::StartsWith(rest, "$LAYER_ID")) {
      flush();
      toks.push_back({PatternTok::kLayer, ""});
      i += 9;
    } else if (absl::StartsWith(rest, "$EXPERT_ID")) {
      flush();
      toks.push_back({PatternTok::kExpert, ""});
      i += 10;
    } else if (text[i] == '*') {
      flush();
      toks.push_back({PatternTok::kStar, ""});
      ++i;
    } else {
      lit.push_back(text[i++]);
    }
  }
  flush();
  return toks;
}

bool HasMacro(absl::string_view text) {
  return text.find('$') != absl::string_view::npos || text.find('*') != absl::string_view::npos;
}

struct Captures {
  std::optional<std::string> layer, expert;
  std::vector<std::string> stars;
};

// `budget`: steps left for this pattern; at 0 the match fails (the caller
// reports the pattern as too costly), so '*'-heavy patterns cannot make the
// backtracking exponential.
bool MatchFrom(const std::vector<PatternTok>& toks, size_t ti, absl::string_view s, size_t si,
               Captures& cap, int64_t& budget) {
  // Backtracks in place: a capture is pushed (or a slot set) before trying
  // the rest and taken back if that fails, so a step costs O(1) captures,
  // not a copy of all of them.
  if (--budget <= 0) return false;
  if (ti == toks.size()) return si == s.size();
  const PatternTok& t = toks[ti];
  switch (t.kind) {
    case PatternTok::kLit:
      if (s.substr(si, t.lit.size()) != t.lit) return false;
      return MatchFrom(toks, ti + 1, s, si + t.lit.size(), cap, budget);
    case PatternTok::kLayer:
    case PatternTok::kExpert: {
      std::optional<std::string>& slot = t.kind == PatternTok::kLayer ? cap.layer : cap.expert;
      size_t e = si;
      while (e < s.size() && std::isdigit(static_cast<unsigned char>(s[e]))) ++e;
      for (size_t end = e; end > si; --end) {
        const absl::string_view v = s.substr(si, end - si);
        if (slot) {  // bound earlier in the pattern: must be the same digits
          if (*slot == v && MatchFrom(toks, ti + 1, s, end, cap, budget)) return true;
          continue;
        }
        slot = std::string(v);
        if (MatchFrom(toks, ti + 1, s, end, cap, budget)) return true;
        slot.reset();
      }
      return false;
    }
    case PatternTok::kStar:
      for (size_t end = s.size(); end > si; --end) {  // greedy, at least one character
        cap.stars.emplace_back(s.substr(si, end - si));
        if (MatchFrom(toks, ti + 1, s, end, cap, budget)) return true;
        cap.stars.pop_back();
      }
      return false;
  }
  return false;
}

// Natural order: digit runs compare as numbers (layers.2 < layers.10).
bool NaturalLess(const std::string& a, const std::string& b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const bool da = std::isdigit(static_cast<unsigned char>(a[i]));
    const bool db = std::isdigit(static_cast<unsigned char>(b[j]));
    if (da && db) {
      size_t ie = i, je = j;
      while (ie < a.size() && std::isdigit(static_cast<unsigned char>(a[ie]))) ++ie;
      while (je < b.size() && std::isdigit(static_cast<unsigned char>(b[je]))) ++je;
      absl::string_view na = absl::string_view(a).substr(i, ie - i);
      absl::string_view nb = absl::string_view(b).substr(j, je - j);
      while (na.size() > 1 && na[0] == '0') na.remove_prefix(1);
      while (nb.size() > 1 && nb[0] == '0') nb.remove_prefix(1);
      if (na.size() != nb.size()) return na.size() < nb.size();
      if (na != nb) return na < nb;
      i = ie;
      j = je;
    } else {
      if (a[i] != b[j]) return a[i] < b[j];
      ++i;
      ++j;
    }
  }
  if ((a.size() - i) != (b.size() - j)) return a.size() - i < b.size() - j;
  return a < b;
}

// Expands a name's [first:end] array macro: "q[0:3]" -> q0, q1, q2.
std::vector<std::string> ExpandArray(const std::string& text) {
  size_t open = text.find('[');
  if (open == std::string::npos) return {text};
  size_t close = text.find(']', open);
  std::vector<std::string> parts = absl::StrSplit(text.substr(open + 1, close - open - 1), ':');
  int64_t a = 0, b = 0;
  (void)absl::SimpleAtoi(parts[0], &a);
  (void)absl::SimpleAtoi(parts[1], &b);
  std::vector<std::string> out;
  for (int64_t i = a; i < b; ++i) {
    out.push_back(absl::StrCat(text.substr(0, open), i, text.substr(close + 1)));
  }
  return out;
}

// ===========================================================================
// Concrete statements and their values
// ===========================================================================

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

std::string Concrete::Render() const {
  std::vector<std::string> src, dst, opts;
  for (const Source& s : sources) src.push_back(s.transpose ? s.name + "^T" : s.name);
  if (src.empty()) src.push_back("_");
  dst = targets;
  if (dst.empty()) dst.push_back("_");
  if (!plain_rename) {
    if (st->fused == AoaFused::kQkv) opts.push_back("fused_qkv");
    if (st->fused == AoaFused::kFfn) opts.push_back("fused_ffn");
    if (st->axis) opts.push_back(absl::StrCat("axis=", *st->axis));
    if (st->permute) opts.push_back(absl::StrCat("permute='[", absl::StrJoin(*st->permute, ","), "]'"));
    if (st->num_heads) opts.push_back(absl::StrCat("num_heads=", *st->num_heads));
    if (st->num_key_value_groups) {
      opts.push_back(absl::StrCat("num_key_value_groups=", *st->num_key_value_groups));
    }
    if (st->dtype && follows.empty()) opts.push_back(absl::StrCat("dtype='", DTypeName(*st->dtype), "'"));
  }
  std::string out = absl::StrCat(absl::StrJoin(src, ", "), " -> ", absl::StrJoin(dst, ", "));
  if (!opts.empty()) absl::StrAppend(&out, ", ", absl::StrJoin(opts, ", "));
  return out;
}

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

Value CheckpointValue(const std::string& name, const TensorMeta& t) {
  Value v;
  v.shape = t.global_shape;
  v.dtype = t.dtype;
  Piece p;
  p.tensor = &name;
  p.src_box = Box{Shape(t.global_shape.size(), 0), t.global_shape};
  p.axes.resize(t.global_shape.size());
  std::iota(p.axes.begin(), p.axes.end(), 0);
  p.dst_offset = Shape(t.global_shape.size(), 0);
  v.pieces.push_back(std::move(p));
  return v;
}

// out axis j = in axis perm[j].
Value Permute(const Value& in, const std::vector<int>& perm) {
  Value v;
  v.dtype = in.dtype;
  for (int a : perm) v.shape.push_back(in.shape[a]);
  for (const Piece& p : in.pieces) {
    Piece q;
    q.tensor = p.tensor;
    q.src_box = p.src_box;
    for (int a : perm) {
      q.axes.push_back(p.axes[a]);
      q.dst_offset.push_back(p.dst_offset[a]);
    }
    v.pieces.push_back(std::move(q));
  }
  return v;
}

// [lo, hi) along `axis`.
Value Slice(const Value& in, int axis, int64_t lo, int64_t hi) {
  Value v;
  v.dtype = in.dtype;
  v.shape = in.shape;
  v.shape[axis] = hi - lo;
  for (const Piece& p : in.pieces) {
    const int sa = p.axes[axis];
    const int64_t o = p.dst_offset[axis], len = p.src_box.shape[sa];
    const int64_t a = std::max(o, lo), b = std::min(o + len, hi);
    if (b <= a) continue;
    Piece q = p;
    q.src_box.offset[sa] += a - o;
    q.src_box.shape[sa] = b - a;
    q.dst_offset[axis] = a - lo;
    v.pieces.push_back(std::move(q));
  }
  return v;
}

// Concatenates along `axis`; shapes already checked.
Value Concat(const std::vector<Value>& ins, int axis) {
  Value v;
  v.dtype = ins[0].dtype;
  v.shape = ins[0].shape;
  v.shape[axis] = 0;
  for (const Value& in : ins) {
    for (const Piece& p : in.pieces) {
      Piece q = p;
      q.dst_offset[axis] += v.shape[axis];
      v.pieces.push_back(std::move(q));
    }
    v.shape[axis] += in.shape[axis];
  }
  return v;
}

// The optimizer-state names that follow a parameter's statements.
struct FollowerForm {
  std::string label;
  std::function<std::string(const std::string&)> apply;
  bool scalar = false;  // beta pow accumulators: one element per parameter
};

std::string InsertMasterWeights(const std::string& name) {
  size_t dot = name.find('.');
  if (dot == std::string::npos) return "";
  return absl::StrCat(name.substr(0, dot), ".master_weights", name.substr(dot));
}

const std::vector<FollowerForm>& FollowerForms() {
  static const auto* forms = new std::vector<FollowerForm>{
      {".moment1_0", [](const std::string& n) { return n + ".moment1_0"; }, false},
      {".moment2_0", [](const std::string& n) { return n + ".moment2_0"; }, false},
      {".w_0", [](const std::string& n) { return n + ".w_0"; }, false},
      {"_fp32_master_0", [](const std::string& n) { return n + "_fp32_master_0"; }, false},
      {"master_weights", InsertMasterWeights, false},
      {".beta1_pow_acc_0", [](const std::string& n) { return n + ".beta1_pow_acc_0"; }, true},
      {".beta2_pow_acc_0", [](const std::string& n) { return n + ".beta2_pow_acc_0"; }, true},
  };
  return *forms;
}

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

absl::StatusOr<AoaProgram> ParseAoa(absl::string_view text, const std::string& where) {
  AoaProgram program;
  program.where = where;
  absl::string_view trimmed = absl::StripLeadingAsciiWhitespace(text);
  if (!trimmed.empty() && (trimmed[0] == '{' || trimmed[0] == '[')) {
    nlohmann::json j = nlohmann::json::parse(trimmed.begin(), trimmed.end(), nullptr, false);
    if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(where, ": not valid JSON"));
    if (j.is_object()) {
      if (!j.contains("aoa_statements")) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": a JSON config needs an \"aoa_statements\" list of strings"));
      }
      j = j["aoa_statements"];
    }
    if (!j.is_array()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": \"aoa_statements\" must be a list of strings"));
    }
    for (size_t i = 0; i < j.size(); ++i) {
      if (!j[i].is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ":", i + 1, ": aoa_statements[", i, "] is not a string"));
      }
      std::string s = j[i].get<std::string>();
      StatementParser p(s, absl::StrCat(where, ":", i + 1));
      CKPT_ASSIGN_OR_RETURN(auto st, p.Parse(static_cast<int>(i) + 1));
      if (st) program.statements.push_back(std::move(*st));
    }
    return program;
  }
  int line = 0;
  for (absl::string_view l : absl::StrSplit(text, '\n')) {
    ++line;
    StatementParser p(l, absl::StrCat(where, ":", line));
    CKPT_ASSIGN_OR_RETURN(auto st, p.Parse(line));
    if (st) program.statements.push_back(std::move(*st));
  }
  return program;
}

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

absl::StatusOr<std::string> ReadAoaFile(const std::string& path) {
  auto text = ReadSmallFile(path, 16ull << 20);
  if (!text.ok()) {
    return absl::Status(text.status().code(),
                        absl::StrCat("AOA config ", path, ": ", text.status().message()));
  }
  return text;
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
