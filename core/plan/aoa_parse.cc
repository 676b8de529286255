// AOA statements: the grammar (one statement per line or per string of a
// JSON list) and name patterns with their macros ($LAYER_ID, $EXPERT_ID,
// '*', [a:b] arrays).
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
namespace aoa_internal {

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

}  // namespace aoa_internal

namespace {

using namespace aoa_internal;  // NOLINT: this file's own internals

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

absl::StatusOr<std::string> ReadAoaFile(const std::string& path) {
  auto text = ReadSmallFile(path, 16ull << 20);
  if (!text.ok()) {
    return absl::Status(text.status().code(),
                        absl::StrCat("AOA config ", path, ": ", text.status().message()));
  }
  return text;
}

}  // namespace ckpt
