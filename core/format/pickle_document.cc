// pickle::Document's accessors (pickle.h); the machine that
// builds a Document is pickle.cc.
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/format/pickle.h"
#include "core/base/status_macros.h"

namespace ckpt {
namespace pickle {


// ---- Document -------------------------------------------------------------

absl::Status Document::Error(absl::string_view what) const {
  return absl::DataLossError(absl::StrCat(path, ": ", what));
}

std::string Document::Describe(const Value& v) const {
  switch (v.kind) {
    case Kind::kInvalid: return "an unset value";
    case Kind::kNone: return "None";
    case Kind::kBool: return v.i ? "True" : "False";
    case Kind::kInt: return absl::StrCat("int ", v.i);
    case Kind::kFloat: {
      double d;
      std::memcpy(&d, &v.i, sizeof d);
      return absl::StrCat("float ", d);
    }
    case Kind::kStr: {
      const Str& s = strs[v.ref];
      if (!s.loaded) return absl::StrCat("str of ", s.length, " bytes");
      std::string t = s.text.size() > 60 ? s.text.substr(0, 60) + "..." : s.text;
      return absl::StrCat("str '", absl::CHexEscape(t), "'");
    }
    case Kind::kBytes: return absl::StrCat("bytes of ", bytes[v.ref].length);
    case Kind::kTuple: return absl::StrCat("tuple of ", seqs[v.ref].items.size());
    case Kind::kList: return absl::StrCat("list of ", seqs[v.ref].items.size());
    case Kind::kDict: return absl::StrCat("dict of ", seqs[v.ref].items.size() / 2);
    case Kind::kGlobal:
      return absl::StrCat("global ", globals[v.ref].module, ".", globals[v.ref].name);
    case Kind::kObject: return absl::StrCat("object ", ClassName(objects[v.ref]));
  }
  return "?";
}

std::string Document::ClassName(const Object& o) const {
  if (o.global < 0) return "persistent id";
  const AllowedGlobal& g = globals[o.global];
  return absl::StrCat(g.module, ".", g.name);
}

int Document::Tag(const Object& o) const { return o.global < 0 ? -1 : globals[o.global].tag; }

int Document::GlobalTag(const Value& v) const {
  return v.kind == Kind::kGlobal ? globals[v.ref].tag : -1;
}

absl::StatusOr<int64_t> Document::Int(const Value& v, absl::string_view what) const {
  if (v.kind == Kind::kInt || v.kind == Kind::kBool) return v.i;
  return Error(absl::StrCat(what, ": expected an int, found ", Describe(v)));
}

absl::StatusOr<bool> Document::Bool(const Value& v, absl::string_view what) const {
  if (v.kind == Kind::kBool || v.kind == Kind::kInt) return v.i != 0;
  if (v.kind == Kind::kNone) return false;
  return Error(absl::StrCat(what, ": expected a bool, found ", Describe(v)));
}

absl::StatusOr<const std::string*> Document::Text(const Value& v, absl::string_view what) const {
  if (v.kind == Kind::kStr && strs[v.ref].loaded) return &strs[v.ref].text;
  return Error(absl::StrCat(what, ": expected a str, found ", Describe(v)));
}

absl::StatusOr<const std::vector<Value>*> Document::Items(const Value& v,
                                                          absl::string_view what) const {
  if (v.kind == Kind::kTuple || v.kind == Kind::kList) return &seqs[v.ref].items;
  return Error(absl::StrCat(what, ": expected a tuple or list, found ", Describe(v)));
}

absl::StatusOr<const std::vector<Value>*> Document::DictItems(const Value& v,
                                                              absl::string_view what) const {
  if (v.kind == Kind::kDict) return &seqs[v.ref].items;
  return Error(absl::StrCat(what, ": expected a dict, found ", Describe(v)));
}

absl::StatusOr<const Object*> Document::Obj(const Value& v, absl::string_view what) const {
  if (v.kind == Kind::kObject) return &objects[v.ref];
  return Error(absl::StrCat(what, ": expected an object, found ", Describe(v)));
}

absl::StatusOr<Shape> Document::IntList(const Value& v, absl::string_view what) const {
  CKPT_ASSIGN_OR_RETURN(const std::vector<Value>* items, Items(v, what));
  Shape out;
  out.reserve(items->size());
  for (const Value& x : *items) {
    if (x.kind != Kind::kInt) {
      return Error(absl::StrCat(what, ": expected ints, found ", Describe(x)));
    }
    out.push_back(x.i);
  }
  return out;
}

std::optional<Value> Document::DictGet(const Value& dict, absl::string_view key) const {
  if (dict.kind != Kind::kDict) return std::nullopt;
  const std::vector<Value>& items = seqs[dict.ref].items;
  for (size_t k = items.size(); k >= 2; k -= 2) {
    const Value& kv = items[k - 2];
    if (kv.kind == Kind::kStr && strs[kv.ref].loaded && strs[kv.ref].text == key) {
      return items[k - 1];
    }
  }
  return std::nullopt;
}

std::optional<Value> Document::Field(const Object& o, absl::string_view field) const {
  if (!o.has_state) return std::nullopt;
  return DictGet(o.state, field);
}

}  // namespace pickle
}  // namespace ckpt
