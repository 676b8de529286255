#include "core/format/pickle.h"

#include <algorithm>
#include <cstring>
#include <unordered_map>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/format/pickle_reader.h"
#include "core/base/status_macros.h"

namespace ckpt {
namespace pickle {
namespace {

using internal::LoadLE;
using internal::Reader;

// Opcodes (Python's pickletools names).
enum Op : uint8_t {
  MARK = '(',
  STOP = '.',
  POP = '0',
  POP_MARK = '1',
  DUP = '2',
  BINFLOAT = 'G',
  BININT = 'J',
  BININT1 = 'K',
  BININT2 = 'M',
  NONE = 'N',
  BINPERSID = 'Q',
  REDUCE = 'R',
  BINUNICODE = 'X',
  EMPTY_LIST = ']',
  APPEND = 'a',
  BUILD = 'b',
  GLOBAL = 'c',
  APPENDS = 'e',
  BINGET = 'h',
  LONG_BINGET = 'j',
  BINPUT = 'q',
  LONG_BINPUT = 'r',
  SETITEM = 's',
  TUPLE = 't',
  EMPTY_TUPLE = ')',
  SETITEMS = 'u',
  EMPTY_DICT = '}',
  BINBYTES = 'B',
  SHORT_BINBYTES = 'C',
  PROTO = 0x80,
  NEWOBJ = 0x81,
  TUPLE1 = 0x85,
  TUPLE2 = 0x86,
  TUPLE3 = 0x87,
  NEWTRUE = 0x88,
  NEWFALSE = 0x89,
  LONG1 = 0x8a,
  SHORT_BINUNICODE = 0x8c,
  BINUNICODE8 = 0x8d,
  BINBYTES8 = 0x8e,
  STACK_GLOBAL = 0x93,
  MEMOIZE = 0x94,
  FRAME = 0x95,
  BYTEARRAY8 = 0x96,
};

struct OpName {
  uint8_t op;
  const char* name;
};
constexpr OpName kOpNames[] = {
    {'(', "MARK"}, {'.', "STOP"}, {'0', "POP"}, {'1', "POP_MARK"}, {'2', "DUP"},
    {'F', "FLOAT"}, {'I', "INT"}, {'J', "BININT"}, {'K', "BININT1"}, {'L', "LONG"},
    {'M', "BININT2"}, {'N', "NONE"}, {'P', "PERSID"}, {'Q', "BINPERSID"}, {'R', "REDUCE"},
    {'S', "STRING"}, {'T', "BINSTRING"}, {'U', "SHORT_BINSTRING"}, {'V', "UNICODE"},
    {'X', "BINUNICODE"}, {'a', "APPEND"}, {'b', "BUILD"}, {'c', "GLOBAL"}, {'d', "DICT"},
    {'}', "EMPTY_DICT"}, {'e', "APPENDS"}, {'g', "GET"}, {'h', "BINGET"}, {'i', "INST"},
    {'j', "LONG_BINGET"}, {'l', "LIST"}, {']', "EMPTY_LIST"}, {'o', "OBJ"}, {'p', "PUT"},
    {'q', "BINPUT"}, {'r', "LONG_BINPUT"}, {'s', "SETITEM"}, {'t', "TUPLE"},
    {')', "EMPTY_TUPLE"}, {'u', "SETITEMS"}, {'G', "BINFLOAT"}, {0x80, "PROTO"},
    {0x81, "NEWOBJ"}, {0x82, "EXT1"}, {0x83, "EXT2"}, {0x84, "EXT4"}, {0x85, "TUPLE1"},
    {0x86, "TUPLE2"}, {0x87, "TUPLE3"}, {0x88, "NEWTRUE"}, {0x89, "NEWFALSE"},
    {0x8a, "LONG1"}, {0x8b, "LONG4"}, {'B', "BINBYTES"}, {'C', "SHORT_BINBYTES"},
    {0x8c, "SHORT_BINUNICODE"}, {0x8d, "BINUNICODE8"}, {0x8e, "BINBYTES8"},
    {0x8f, "EMPTY_SET"}, {0x90, "ADDITEMS"}, {0x91, "FROZENSET"}, {0x92, "NEWOBJ_EX"},
    {0x93, "STACK_GLOBAL"}, {0x94, "MEMOIZE"}, {0x95, "FRAME"}, {0x96, "BYTEARRAY8"},
    {0x97, "NEXT_BUFFER"}, {0x98, "READONLY_BUFFER"},
};

bool Utf8ToLatin1(absl::string_view s, std::string* out) {
  out->clear();
  out->reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    uint8_t c = static_cast<uint8_t>(s[i]);
    if (c < 0x80) {
      out->push_back(static_cast<char>(c));
    } else if ((c == 0xC2 || c == 0xC3) && i + 1 < s.size() &&
               (static_cast<uint8_t>(s[i + 1]) & 0xC0) == 0x80) {
      out->push_back(static_cast<char>(((c & 0x1F) << 6) | (s[i + 1] & 0x3F)));
      ++i;
    } else {
      return false;
    }
  }
  return true;
}

class Machine {
 public:
  Machine(const RandomAccessFile& f, uint64_t begin, uint64_t end, const Options& o)
      : r_(f, begin, end), begin_(begin), opt_(o), lim_(o.limits) {
    doc_.path = f.path();
    doc_.globals = o.globals;
    index_.reserve(o.globals.size());
    for (size_t i = 0; i < o.globals.size(); ++i) {
      index_.emplace(o.globals[i].module + '\n' + o.globals[i].name, static_cast<int32_t>(i));
    }
    // Seq 0: the shared empty tuple.
    doc_.seqs.push_back(Seq{Kind::kTuple, {}, 1});
  }

  absl::StatusOr<Document> Run();

 private:
  absl::Status Err(uint64_t at, absl::string_view what) const {
    return absl::DataLossError(
        absl::StrCat(doc_.path, ": pickle at byte ", at, ": ", what));
  }
  absl::Status ReadErr(uint64_t at, absl::string_view opname) const {
    if (!r_.io_error().ok()) return r_.io_error();
    return Err(at, absl::StrCat(opname, ": ", r_.why()));
  }

  bool Take(uint64_t n, const uint8_t** p) { return r_.Take(n, p); }

  uint64_t Available() const { return stack_.size() - (marks_.empty() ? 0 : marks_.back()); }

  absl::Status Push(const Value& v, uint64_t at) {
    if (stack_.size() >= lim_.max_stack) {
      return Err(at, absl::StrCat("stack deeper than ", lim_.max_stack, " values"));
    }
    stack_.push_back(v);
    return absl::OkStatus();
  }

  absl::Status CountValue(uint64_t at) {
    if (++values_ > lim_.max_values) {
      return Err(at, absl::StrCat("more than ", lim_.max_values, " values"));
    }
    return absl::OkStatus();
  }

  uint32_t DepthOf(const Value& v) const {
    switch (v.kind) {
      case Kind::kTuple:
      case Kind::kList:
      case Kind::kDict:
        return doc_.seqs[v.ref].depth;
      case Kind::kObject:
        return doc_.objects[v.ref].depth;
      default:
        return 0;
    }
  }

  // Raises `depth` to hold a child `v`; error past the limit.
  absl::Status Nest(uint32_t* depth, const Value& v, uint64_t at) {
    uint32_t d = DepthOf(v) + 1;
    if (d > *depth) {
      if (d > lim_.max_depth) {
        return Err(at, absl::StrCat("nesting deeper than ", lim_.max_depth, " levels"));
      }
      *depth = d;
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Value> NewSeq(Kind kind, std::vector<Value> items, uint64_t at) {
    if (kind == Kind::kTuple && items.empty()) return Value{Kind::kTuple, 0, 0};
    CKPT_RETURN_IF_ERROR(CountValue(at));
    Seq s;
    s.kind = kind;
    for (const Value& v : items) CKPT_RETURN_IF_ERROR(Nest(&s.depth, v, at));
    s.items = std::move(items);
    doc_.seqs.push_back(std::move(s));
    return Value{kind, static_cast<uint32_t>(doc_.seqs.size() - 1), 0};
  }

  absl::StatusOr<Value> NewObject(Object o, uint64_t at) {
    CKPT_RETURN_IF_ERROR(CountValue(at));
    o.depth = 1;
    CKPT_RETURN_IF_ERROR(Nest(&o.depth, o.args, at));
    doc_.objects.push_back(std::move(o));
    return Value{Kind::kObject, static_cast<uint32_t>(doc_.objects.size() - 1), 0};
  }

  // Items above the top MARK; removes them and the mark.
  absl::StatusOr<std::vector<Value>> PopMark(uint64_t at, absl::string_view op) {
    if (marks_.empty()) return Err(at, absl::StrCat(op, " without a MARK"));
    size_t m = marks_.back();
    marks_.pop_back();
    std::vector<Value> items(stack_.begin() + m, stack_.end());
    stack_.resize(m);
    return items;
  }

  absl::Status Underflow(uint64_t at, absl::string_view op, uint64_t need) const {
    return Err(at, absl::StrCat(op, " needs ", need, " value(s) on the stack but ", Available(),
                                " are there"));
  }

  absl::Status LoadString(uint64_t at, uint64_t n, absl::string_view op) {
    CKPT_RETURN_IF_ERROR(CountValue(at));
    Str s;
    s.offset = r_.pos();
    s.length = n;
    if (n <= lim_.max_string) {
      if (!r_.ReadInto(n, &s.text)) return ReadErr(at, op);
      s.loaded = true;
    } else if (!r_.Skip(n)) {
      return ReadErr(at, op);
    }
    doc_.strs.push_back(std::move(s));
    return Push(Value{Kind::kStr, static_cast<uint32_t>(doc_.strs.size() - 1), 0}, at);
  }

  absl::Status LoadBytes(uint64_t at, uint64_t n, bool bytearray, absl::string_view op) {
    CKPT_RETURN_IF_ERROR(CountValue(at));
    Bytes b;
    b.offset = r_.pos();
    b.length = n;
    b.bytearray = bytearray;
    if (n <= lim_.inline_bytes) {
      if (!r_.ReadInto(n, &b.inline_data)) return ReadErr(at, op);
      b.has_inline = true;
    } else if (!r_.Skip(n)) {
      return ReadErr(at, op);
    }
    doc_.bytes.push_back(std::move(b));
    return Push(Value{Kind::kBytes, static_cast<uint32_t>(doc_.bytes.size() - 1), 0}, at);
  }

  absl::Status LoadGlobal(uint64_t at, const std::string& module, const std::string& name) {
    auto it = index_.find(module + '\n' + name);
    if (it == index_.end()) {
      return Err(at, absl::StrCat("global '", module, ".", name,
                                  "' is not allowed (ckptd never imports or calls anything a "
                                  "checkpoint names; only known record classes, numpy arrays "
                                  "and torch storages are read)"));
    }
    return Push(Value{Kind::kGlobal, static_cast<uint32_t>(it->second), 0}, at);
  }

  absl::Status Reduce(uint64_t at);
  absl::Status NewObj(uint64_t at);
  absl::Status Build(uint64_t at);

  Reader r_;
  const uint64_t begin_;  // where the pickle starts in the file
  const Options& opt_;
  const Limits& lim_;
  Document doc_;
  std::unordered_map<std::string, int32_t> index_;
  std::vector<Value> stack_;
  std::vector<size_t> marks_;
  std::vector<Value> memo_;
  uint64_t values_ = 0;
};


absl::Status Machine::Reduce(uint64_t at) {
  if (Available() < 2) return Underflow(at, "REDUCE", 2);
  Value args = stack_.back();
  stack_.pop_back();
  Value callable = stack_.back();
  stack_.pop_back();
  if (callable.kind != Kind::kGlobal) {
    return Err(at, absl::StrCat("REDUCE calls ", doc_.Describe(callable),
                                ", not an allowed global"));
  }
  const AllowedGlobal& g = doc_.globals[callable.ref];
  const std::string gname = absl::StrCat(g.module, ".", g.name);
  if (args.kind != Kind::kTuple) {
    return Err(at, absl::StrCat("REDUCE of ", gname, " with ", doc_.Describe(args),
                                " instead of an argument tuple"));
  }
  const std::vector<Value>& a = doc_.seqs[args.ref].items;
  switch (g.role) {
    case GlobalRole::kClass:
    case GlobalRole::kFunction:
    case GlobalRole::kEnumClass: {
      Object o;
      o.how = Object::How::kReduce;
      o.global = static_cast<int32_t>(callable.ref);
      o.args = args;
      CKPT_ASSIGN_OR_RETURN(Value v, NewObject(std::move(o), at));
      return Push(v, at);
    }
    case GlobalRole::kConstant:
      return Err(at, absl::StrCat("global '", gname, "' is a constant and cannot be called"));
    case GlobalRole::kOrderedDict: {
      if (!a.empty()) {
        return Err(at, absl::StrCat(gname, " called with ", a.size(),
                                    " arguments; only an empty call is allowed"));
      }
      CKPT_ASSIGN_OR_RETURN(Value v, NewSeq(Kind::kDict, {}, at));
      return Push(v, at);
    }
    case GlobalRole::kTupleOfArg: {
      if (a.size() != 1 || (a[0].kind != Kind::kTuple && a[0].kind != Kind::kList)) {
        return Err(at, absl::StrCat(gname, " must be called with one tuple"));
      }
      if (a[0].kind == Kind::kTuple) return Push(a[0], at);
      CKPT_ASSIGN_OR_RETURN(Value v, NewSeq(Kind::kTuple, doc_.seqs[a[0].ref].items, at));
      return Push(v, at);
    }
    case GlobalRole::kLatin1Encode: {
      if (a.size() != 2 || a[0].kind != Kind::kStr || a[1].kind != Kind::kStr ||
          !doc_.strs[a[1].ref].loaded ||
          (doc_.strs[a[1].ref].text != "latin1" && doc_.strs[a[1].ref].text != "latin-1")) {
        return Err(at, absl::StrCat(gname, " is only allowed as ", gname, "(str, 'latin1')"));
      }
      const Str& s = doc_.strs[a[0].ref];
      CKPT_RETURN_IF_ERROR(CountValue(at));
      Bytes b;
      b.offset = s.offset;
      b.length = s.length;
      b.latin1_text = true;
      if (s.loaded && s.length <= lim_.inline_bytes) {
        if (!Utf8ToLatin1(s.text, &b.inline_data)) {
          return Err(at, absl::StrCat(gname, ": the text is not latin-1"));
        }
        b.has_inline = true;
      }
      doc_.bytes.push_back(std::move(b));
      return Push(Value{Kind::kBytes, static_cast<uint32_t>(doc_.bytes.size() - 1), 0}, at);
    }
    case GlobalRole::kEnumGetattr: {
      if (a.size() != 2 || a[0].kind != Kind::kGlobal ||
          doc_.globals[a[0].ref].role != GlobalRole::kEnumClass || a[1].kind != Kind::kStr) {
        return Err(at, absl::StrCat(gname,
                                    " is only allowed to name a member of an allowed enum "
                                    "class, not with ",
                                    a.empty() ? std::string("no arguments")
                                              : doc_.Describe(a[0])));
      }
      Object o;
      o.how = Object::How::kEnumMember;
      o.global = static_cast<int32_t>(a[0].ref);
      CKPT_ASSIGN_OR_RETURN(o.args, NewSeq(Kind::kTuple, {a[1]}, at));
      CKPT_ASSIGN_OR_RETURN(Value v, NewObject(std::move(o), at));
      return Push(v, at);
    }
  }
  return Err(at, "REDUCE: bad role");
}

absl::Status Machine::NewObj(uint64_t at) {
  if (Available() < 2) return Underflow(at, "NEWOBJ", 2);
  Value args = stack_.back();
  stack_.pop_back();
  Value cls = stack_.back();
  stack_.pop_back();
  if (cls.kind != Kind::kGlobal) {
    return Err(at, absl::StrCat("NEWOBJ of ", doc_.Describe(cls), ", not an allowed class"));
  }
  const AllowedGlobal& g = doc_.globals[cls.ref];
  if (g.role != GlobalRole::kClass && g.role != GlobalRole::kEnumClass) {
    return Err(at, absl::StrCat("NEWOBJ of '", g.module, ".", g.name,
                                "', which is not an allowed class"));
  }
  if (args.kind != Kind::kTuple) {
    return Err(at, absl::StrCat("NEWOBJ with ", doc_.Describe(args), " instead of a tuple"));
  }
  Object o;
  o.how = Object::How::kNewObj;
  o.global = static_cast<int32_t>(cls.ref);
  o.args = args;
  CKPT_ASSIGN_OR_RETURN(Value v, NewObject(std::move(o), at));
  return Push(v, at);
}

absl::Status Machine::Build(uint64_t at) {
  if (Available() < 2) return Underflow(at, "BUILD", 2);
  Value state = stack_.back();
  stack_.pop_back();
  const Value& target = stack_.back();
  if (target.kind != Kind::kObject) {
    return Err(at, absl::StrCat("BUILD on ", doc_.Describe(target), "; only records take state"));
  }
  Object& o = doc_.objects[target.ref];
  if (o.how == Object::How::kPersistentId || o.how == Object::How::kEnumMember) {
    return Err(at, "BUILD on a persistent id or enum member");
  }
  uint32_t depth = o.depth;
  CKPT_RETURN_IF_ERROR(Nest(&depth, state, at));
  Object& o2 = doc_.objects[target.ref];
  o2.depth = depth;
  o2.state = state;
  o2.has_state = true;
  return absl::OkStatus();
}

absl::StatusOr<Document> Machine::Run() {
  const uint8_t* p = nullptr;
  for (;;) {
    const uint64_t at = r_.pos();
    if (!Take(1, &p)) return ReadErr(at, "opcode");
    const uint8_t op = *p;
    switch (op) {
      case PROTO: {
        if (!Take(1, &p)) return ReadErr(at, "PROTO");
        if (*p < 2 || *p > 5) {
          return Err(at, absl::StrCat("pickle protocol ", static_cast<int>(*p),
                                      " is not supported (2 to 5 are)"));
        }
        doc_.protocol = *p;
        break;
      }
      case FRAME: {
        if (!Take(8, &p)) return ReadErr(at, "FRAME");
        if (!r_.BeginFrame(LoadLE(p, 8))) return Err(at, r_.why());
        break;
      }
      case STOP: {
        if (!marks_.empty()) return Err(at, "STOP with an unclosed MARK");
        if (stack_.size() != 1) {
          return Err(at, absl::StrCat("STOP with ", stack_.size(),
                                      " values on the stack (expected exactly one)"));
        }
        doc_.root = stack_.back();
        return std::move(doc_);
      }
      case MARK:
        if (marks_.size() >= lim_.max_marks) {
          return Err(at, absl::StrCat("more than ", lim_.max_marks, " nested MARKs"));
        }
        marks_.push_back(stack_.size());
        break;
      case POP:
        if (Available() > 0) {
          stack_.pop_back();
        } else {
          CKPT_RETURN_IF_ERROR(PopMark(at, "POP").status());
        }
        break;
      case POP_MARK:
        CKPT_RETURN_IF_ERROR(PopMark(at, "POP_MARK").status());
        break;
      case DUP:
        if (Available() < 1) return Underflow(at, "DUP", 1);
        CKPT_RETURN_IF_ERROR(Push(stack_.back(), at));
        break;
      case MEMOIZE:
        if (Available() < 1) return Underflow(at, "MEMOIZE", 1);
        if (memo_.size() >= lim_.max_memo) {
          return Err(at, absl::StrCat("memo larger than ", lim_.max_memo, " entries"));
        }
        // (One slot per 1-byte opcode: never more slots than bytes read.)
        memo_.push_back(stack_.back());
        break;
      case BINPUT:
      case LONG_BINPUT: {
        const int n = op == BINPUT ? 1 : 4;
        if (!Take(n, &p)) return ReadErr(at, OpcodeName(op));
        const uint64_t idx = LoadLE(p, n);
        if (Available() < 1) return Underflow(at, OpcodeName(op), 1);
        // A pickler numbers memo entries 0, 1, 2, ... as it stores values,
        // each stored value costing at least one opcode byte: an index past
        // the bytes read so far can only come from a hostile file, which
        // must not make the memo grow faster than the input (a 10-byte file
        // asking for slot 2^26).
        const uint64_t consumed = r_.pos() - begin_;
        if (idx >= lim_.max_memo || idx > memo_.size() + (1u << 20) || idx >= consumed) {
          return Err(at, absl::StrCat(OpcodeName(op), " to memo index ", idx,
                                      " (memo holds ", memo_.size(), " entries; ", consumed,
                                      " bytes read so far, and a pickle cannot number more "
                                      "memo entries than it has bytes)"));
        }
        if (idx >= memo_.size()) memo_.resize(idx + 1, Value{Kind::kInvalid, 0, 0});
        memo_[idx] = stack_.back();
        break;
      }
      case BINGET:
      case LONG_BINGET: {
        const int n = op == BINGET ? 1 : 4;
        if (!Take(n, &p)) return ReadErr(at, OpcodeName(op));
        const uint64_t idx = LoadLE(p, n);
        if (idx >= memo_.size() || memo_[idx].kind == Kind::kInvalid) {
          return Err(at, absl::StrCat(OpcodeName(op), " of memo index ", idx,
                                      ", which was never stored (memo holds ", memo_.size(),
                                      " entries)"));
        }
        CKPT_RETURN_IF_ERROR(Push(memo_[idx], at));
        break;
      }
      case NONE:
        CKPT_RETURN_IF_ERROR(Push(Value{Kind::kNone, 0, 0}, at));
        break;
      case NEWTRUE:
      case NEWFALSE:
        CKPT_RETURN_IF_ERROR(Push(Value{Kind::kBool, 0, op == NEWTRUE ? 1 : 0}, at));
        break;
      case BININT1:
      case BININT2:
      case BININT: {
        const int n = op == BININT1 ? 1 : op == BININT2 ? 2 : 4;
        if (!Take(n, &p)) return ReadErr(at, OpcodeName(op));
        int64_t v = static_cast<int64_t>(LoadLE(p, n));
        if (op == BININT) v = static_cast<int32_t>(static_cast<uint32_t>(v));
        CKPT_RETURN_IF_ERROR(Push(Value{Kind::kInt, 0, v}, at));
        break;
      }
      case LONG1: {
        if (!Take(1, &p)) return ReadErr(at, "LONG1");
        const int n = *p;
        if (n > 8) {
          return Err(at, absl::StrCat("LONG1 integer of ", n, " bytes does not fit 64 bits"));
        }
        int64_t v = 0;
        if (n > 0) {
          if (!Take(n, &p)) return ReadErr(at, "LONG1");
          uint64_t u = LoadLE(p, n);
          if (n < 8 && (p[n - 1] & 0x80)) u |= ~0ull << (8 * n);  // sign-extend
          v = static_cast<int64_t>(u);
        }
        CKPT_RETURN_IF_ERROR(Push(Value{Kind::kInt, 0, v}, at));
        break;
      }
      case BINFLOAT: {
        if (!Take(8, &p)) return ReadErr(at, "BINFLOAT");
        uint64_t bits = 0;
        for (int k = 0; k < 8; ++k) bits = (bits << 8) | p[k];  // big-endian
        CKPT_RETURN_IF_ERROR(Push(Value{Kind::kFloat, 0, static_cast<int64_t>(bits)}, at));
        break;
      }
      case SHORT_BINUNICODE:
      case BINUNICODE:
      case BINUNICODE8: {
        const int n = op == SHORT_BINUNICODE ? 1 : op == BINUNICODE ? 4 : 8;
        if (!Take(n, &p)) return ReadErr(at, OpcodeName(op));
        CKPT_RETURN_IF_ERROR(LoadString(at, LoadLE(p, n), OpcodeName(op)));
        break;
      }
      case SHORT_BINBYTES:
      case BINBYTES:
      case BINBYTES8:
      case BYTEARRAY8: {
        const int n = op == SHORT_BINBYTES ? 1 : op == BINBYTES ? 4 : 8;
        if (!Take(n, &p)) return ReadErr(at, OpcodeName(op));
        CKPT_RETURN_IF_ERROR(LoadBytes(at, LoadLE(p, n), op == BYTEARRAY8, OpcodeName(op)));
        break;
      }
      case EMPTY_TUPLE:
        CKPT_RETURN_IF_ERROR(Push(Value{Kind::kTuple, 0, 0}, at));
        break;
      case TUPLE1:
      case TUPLE2:
      case TUPLE3: {
        const size_t n = op - TUPLE1 + 1;
        if (Available() < n) return Underflow(at, OpcodeName(op), n);
        std::vector<Value> items(stack_.end() - n, stack_.end());
        stack_.resize(stack_.size() - n);
        CKPT_ASSIGN_OR_RETURN(Value v, NewSeq(Kind::kTuple, std::move(items), at));
        CKPT_RETURN_IF_ERROR(Push(v, at));
        break;
      }
      case TUPLE: {
        CKPT_ASSIGN_OR_RETURN(std::vector<Value> items, PopMark(at, "TUPLE"));
        CKPT_ASSIGN_OR_RETURN(Value v, NewSeq(Kind::kTuple, std::move(items), at));
        CKPT_RETURN_IF_ERROR(Push(v, at));
        break;
      }
      case EMPTY_LIST:
      case EMPTY_DICT: {
        CKPT_ASSIGN_OR_RETURN(Value v,
                              NewSeq(op == EMPTY_LIST ? Kind::kList : Kind::kDict, {}, at));
        CKPT_RETURN_IF_ERROR(Push(v, at));
        break;
      }
      case APPEND:
      case SETITEM: {
        const size_t n = op == APPEND ? 1 : 2;
        if (Available() < n + 1) return Underflow(at, OpcodeName(op), n + 1);
        const Value& target = stack_[stack_.size() - n - 1];
        const Kind want = op == APPEND ? Kind::kList : Kind::kDict;
        if (target.kind != want) {
          return Err(at, absl::StrCat(OpcodeName(op), " on ", doc_.Describe(target)));
        }
        Seq& s = doc_.seqs[target.ref];
        for (size_t k = stack_.size() - n; k < stack_.size(); ++k) {
          CKPT_RETURN_IF_ERROR(Nest(&s.depth, stack_[k], at));
          s.items.push_back(stack_[k]);
        }
        stack_.resize(stack_.size() - n);
        break;
      }
      case APPENDS:
      case SETITEMS: {
        CKPT_ASSIGN_OR_RETURN(std::vector<Value> items, PopMark(at, OpcodeName(op)));
        if (Available() < 1) return Underflow(at, OpcodeName(op), 1);
        const Value& target = stack_.back();
        const Kind want = op == APPENDS ? Kind::kList : Kind::kDict;
        if (target.kind != want) {
          return Err(at, absl::StrCat(OpcodeName(op), " on ", doc_.Describe(target)));
        }
        if (op == SETITEMS && items.size() % 2 != 0) {
          return Err(at, "SETITEMS with an odd number of values");
        }
        Seq& s = doc_.seqs[target.ref];
        for (const Value& v : items) CKPT_RETURN_IF_ERROR(Nest(&s.depth, v, at));
        s.items.insert(s.items.end(), items.begin(), items.end());
        break;
      }
      case GLOBAL: {
        // Two newline-terminated lines: module, name.
        std::string parts[2];
        for (std::string& part : parts) {
          for (;;) {
            if (!Take(1, &p)) return ReadErr(at, "GLOBAL");
            if (*p == '\n') break;
            if (part.size() >= 256) return Err(at, "GLOBAL name longer than 256 bytes");
            part.push_back(static_cast<char>(*p));
          }
        }
        CKPT_RETURN_IF_ERROR(LoadGlobal(at, parts[0], parts[1]));
        break;
      }
      case STACK_GLOBAL: {
        if (Available() < 2) return Underflow(at, "STACK_GLOBAL", 2);
        Value name = stack_.back();
        stack_.pop_back();
        Value module = stack_.back();
        stack_.pop_back();
        if (module.kind != Kind::kStr || name.kind != Kind::kStr ||
            !doc_.strs[module.ref].loaded || !doc_.strs[name.ref].loaded) {
          return Err(at, "STACK_GLOBAL needs two strings");
        }
        CKPT_RETURN_IF_ERROR(
            LoadGlobal(at, doc_.strs[module.ref].text, doc_.strs[name.ref].text));
        break;
      }
      case REDUCE:
        CKPT_RETURN_IF_ERROR(Reduce(at));
        break;
      case NEWOBJ:
        CKPT_RETURN_IF_ERROR(NewObj(at));
        break;
      case BUILD:
        CKPT_RETURN_IF_ERROR(Build(at));
        break;
      case BINPERSID: {
        if (!opt_.allow_persistent_id) {
          return Err(at, "BINPERSID (a persistent id) is not allowed in this file");
        }
        if (Available() < 1) return Underflow(at, "BINPERSID", 1);
        Object o;
        o.how = Object::How::kPersistentId;
        o.args = stack_.back();
        stack_.pop_back();
        CKPT_ASSIGN_OR_RETURN(Value v, NewObject(std::move(o), at));
        CKPT_RETURN_IF_ERROR(Push(v, at));
        break;
      }
      default: {
        absl::string_view name = OpcodeName(op);
        if (name.empty()) {
          return Err(at, absl::StrFormat("unknown opcode 0x%02x", op));
        }
        return Err(at, absl::StrCat("opcode ", name, absl::StrFormat(" (0x%02x)", op),
                                    " is not allowed (ckptd reads a safe subset of pickle)"));
      }
    }
  }
}

}  // namespace

absl::string_view OpcodeName(uint8_t op) {
  for (const OpName& o : kOpNames) {
    if (o.op == op) return o.name;
  }
  return "";
}

absl::StatusOr<Document> Parse(const RandomAccessFile& file, uint64_t begin, uint64_t end,
                               const Options& options) {
  if (begin > end || end > file.size()) {
    return absl::DataLossError(absl::StrCat(file.path(), ": pickle range [", begin, ", ", end,
                                            ") is outside the file (", file.size(),
                                            " bytes)"));
  }
  Machine m(file, begin, end, options);
  return m.Run();
}

absl::StatusOr<Document> ParseBuffer(const std::string& path, absl::string_view data,
                                     const Options& options) {
  MemoryFile f(path, data);
  return Parse(f, 0, data.size(), options);
}

}  // namespace pickle
}  // namespace ckpt
