#include "core/format/paddle_format.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "core/format/foreign.h"
#include "core/format/safetensors.h"
#include "core/base/status_macros.h"

namespace ckpt {
namespace {

using pickle::Document;
using pickle::Kind;
using pickle::Object;
using pickle::Value;

constexpr char kUnpackInfo[] = "UnpackBigParamInfor@@";

// One LocalTensorMetadata.
struct Ltm {
  Shape offset, local_shape;
  bool has_global_shape = false;  // old versions do not record it
  Shape global_shape;
  std::optional<FlatRange> flat;
  DType dtype = DType::kF32;
};

std::string ShardKey(absl::string_view name, const Shape& offset,
                     const std::optional<FlatRange>& flat) {
  std::string k(name);
  k.push_back('\0');
  k.append(reinterpret_cast<const char*>(offset.data()), offset.size() * sizeof(int64_t));
  if (flat) {
    k.push_back('\1');
    k.append(reinterpret_cast<const char*>(&flat->begin), sizeof(int64_t));
    k.append(reinterpret_cast<const char*>(&flat->end), sizeof(int64_t));
  }
  return k;
}

absl::StatusOr<Shape> OptShape(const Document& doc, const Object& o, absl::string_view field,
                               absl::string_view what) {
  std::optional<Value> v = doc.Field(o, field);
  if (!v) return doc.Error(absl::StrCat(what, ": no '", field, "'"));
  return doc.IntList(*v, absl::StrCat(what, ".", field));
}

// is_flattened / flattened_range (absent in old versions).
absl::StatusOr<std::optional<FlatRange>> ReadFlat(const Document& doc, const Object& o,
                                                  absl::string_view what) {
  bool flattened = false;
  std::optional<Value> isf = doc.Field(o, "is_flattened");
  std::optional<Value> fr = doc.Field(o, "flattened_range");
  if (isf) {
    CKPT_ASSIGN_OR_RETURN(flattened, doc.Bool(*isf, absl::StrCat(what, ".is_flattened")));
  } else {
    flattened = fr && fr->kind != Kind::kNone;
  }
  if (!flattened) return std::optional<FlatRange>();
  if (!fr || fr->kind == Kind::kNone) {
    return doc.Error(absl::StrCat(what, ": is_flattened but no flattened_range"));
  }
  CKPT_ASSIGN_OR_RETURN(Shape r,
                        doc.IntList(*fr, absl::StrCat(what, ".flattened_range")));
  if (r.size() != 2) {
    return doc.Error(absl::StrCat(what, ".flattened_range has ", r.size(), " entries, not 2"));
  }
  return std::optional<FlatRange>(FlatRange{r[0], r[1]});
}

absl::StatusOr<DType> PaddleDType(const Document& doc, const Value& v, absl::string_view what) {
  CKPT_ASSIGN_OR_RETURN(const std::string* s, doc.Text(v, absl::StrCat(what, ".dtype")));
  absl::string_view name = *s;
  absl::ConsumePrefix(&name, "paddle.");
  auto d = ParseDType(name);
  if (!d.ok()) {
    return doc.Error(absl::StrCat(what, ": unknown dtype '", *s, "'"));
  }
  return *d;
}

// ---- numpy arrays in data files ---------------------------------------------

absl::StatusOr<DType> NumpyDType(const Document& doc, const Value& v, absl::string_view what) {
  CKPT_ASSIGN_OR_RETURN(const Object* o, doc.Obj(v, absl::StrCat(what, " dtype")));
  if (doc.Tag(*o) != kTagNpDtype) {
    return doc.Error(absl::StrCat(what, ": dtype is ", doc.ClassName(*o), ", not numpy.dtype"));
  }
  CKPT_ASSIGN_OR_RETURN(const std::vector<Value>* args,
                        doc.Items(o->args, absl::StrCat(what, " dtype args")));
  if (args->empty()) return doc.Error(absl::StrCat(what, ": numpy.dtype without arguments"));
  CKPT_ASSIGN_OR_RETURN(const std::string* code,
                        doc.Text((*args)[0], absl::StrCat(what, " dtype code")));
  std::string order = "|";
  if (o->has_state && o->state.kind == Kind::kTuple) {
    const std::vector<Value>& st = doc.seqs[o->state.ref].items;
    if (st.size() >= 2 && st[1].kind == Kind::kStr) order = doc.strs[st[1].ref].text;
  }
  static const std::map<std::string, DType> kCodes = {
      {"f2", DType::kF16}, {"f4", DType::kF32}, {"f8", DType::kF64}, {"i1", DType::kI8},
      {"i2", DType::kI16}, {"i4", DType::kI32}, {"i8", DType::kI64}, {"u1", DType::kU8},
      {"u2", DType::kU16}, {"u4", DType::kU32}, {"u8", DType::kU64}, {"b1", DType::kBool},
  };
  auto it = kCodes.find(*code);
  if (it == kCodes.end()) {
    return absl::UnimplementedError(absl::StrCat(doc.path, ": ", what, ": numpy dtype '", *code,
                                                 "' is not supported"));
  }
  if (order == ">" && DTypeSize(it->second) > 1) {
    return absl::UnimplementedError(
        absl::StrCat(doc.path, ": ", what, ": big-endian numpy arrays are not supported"));
  }
  return it->second;
}

absl::StatusOr<PaddleArray> ArrayFromPayload(const Document& doc, const Value& data, DType dtype,
                                             const Shape& shape, bool fortran,
                                             absl::string_view what) {
  PaddleArray a;
  a.dtype = dtype;
  a.shape = shape;
  auto nbytes = CheckedNumBytes(shape, DTypeSize(dtype));
  if (!nbytes.ok()) {
    return doc.Error(absl::StrCat(what, ": bad shape ", ShapeString(shape), ": ",
                                  nbytes.status().message()));
  }
  int non_trivial = 0;
  for (int64_t d : shape) non_trivial += d > 1;
  if (fortran && non_trivial > 1) {
    return absl::UnimplementedError(absl::StrCat(
        doc.path, ": ", what, ": array stored in Fortran (column-major) order; ckptd reads "
        "row-major arrays in place only"));
  }
  if (data.kind != Kind::kBytes) {
    return doc.Error(absl::StrCat(what, ": array data is ", doc.Describe(data),
                                  ", not a byte payload"));
  }
  const pickle::Bytes& b = doc.bytes[data.ref];
  if (b.latin1_text) {
    if (*nbytes == 0) {
      a.offset = b.offset;
      return a;
    }
    return absl::UnimplementedError(absl::StrCat(
        doc.path, ": ", what, ": array pickled with protocol 2 (its bytes are stored as "
        "latin-1 text), which cannot be read in place; re-save with protocol 4 or 5"));
  }
  if (b.length != static_cast<uint64_t>(*nbytes)) {
    return doc.Error(absl::StrCat(what, ": ", b.length, " payload bytes but shape ",
                                  ShapeString(shape), " of ", DTypeName(dtype), " needs ",
                                  *nbytes));
  }
  a.offset = b.offset;
  a.nbytes = b.length;
  return a;
}

// An ndarray record -> its location; nullopt for values that are not arrays.
absl::StatusOr<std::optional<PaddleArray>> ToArray(const Document& doc, const Value& v,
                                                   absl::string_view what) {
  if (v.kind != Kind::kObject) return std::optional<PaddleArray>();
  const Object& o = doc.objects[v.ref];
  const int tag = doc.Tag(o);
  if (tag == kTagNpReconstruct) {
    // _reconstruct(ndarray, (0,), b'b') + BUILD (version, shape, dtype, fortran, data).
    const std::vector<Value>& args = doc.seqs[o.args.ref].items;
    if (args.empty() || doc.GlobalTag(args[0]) != kTagNpNdarray) {
      return doc.Error(absl::StrCat(what, ": _reconstruct of something other than ndarray"));
    }
    if (!o.has_state) return doc.Error(absl::StrCat(what, ": ndarray without state"));
    CKPT_ASSIGN_OR_RETURN(const std::vector<Value>* st,
                          doc.Items(o.state, absl::StrCat(what, " state")));
    size_t k = 0;
    if (st->size() == 5) {
      k = 1;  // version
    } else if (st->size() != 4) {
      return doc.Error(absl::StrCat(what, ": ndarray state of ", st->size(), " items"));
    }
    CKPT_ASSIGN_OR_RETURN(Shape shape, doc.IntList((*st)[k], absl::StrCat(what, " shape")));
    CKPT_ASSIGN_OR_RETURN(DType dtype, NumpyDType(doc, (*st)[k + 1], what));
    CKPT_ASSIGN_OR_RETURN(bool fortran, doc.Bool((*st)[k + 2], absl::StrCat(what, " fortran")));
    CKPT_ASSIGN_OR_RETURN(PaddleArray a,
                          ArrayFromPayload(doc, (*st)[k + 3], dtype, shape, fortran, what));
    return std::optional<PaddleArray>(a);
  }
  if (tag == kTagNpFrombuffer) {
    // _frombuffer(buffer, dtype, shape, order)
    const std::vector<Value>& args = doc.seqs[o.args.ref].items;
    if (args.size() != 4) {
      return doc.Error(absl::StrCat(what, ": _frombuffer with ", args.size(), " arguments"));
    }
    CKPT_ASSIGN_OR_RETURN(DType dtype, NumpyDType(doc, args[1], what));
    CKPT_ASSIGN_OR_RETURN(Shape shape, doc.IntList(args[2], absl::StrCat(what, " shape")));
    CKPT_ASSIGN_OR_RETURN(const std::string* order, doc.Text(args[3], absl::StrCat(what, " order")));
    CKPT_ASSIGN_OR_RETURN(PaddleArray a,
                          ArrayFromPayload(doc, args[0], dtype, shape, *order == "F", what));
    return std::optional<PaddleArray>(a);
  }
  return std::optional<PaddleArray>();
}

absl::StatusOr<PaddleDataIndex> ReadSafetensorsIndex(const RandomAccessFile& file) {
  CKPT_ASSIGN_OR_RETURN(SafetensorsHeader h, ReadSafetensorsHeader(file));
  PaddleDataIndex idx;
  idx.safetensors = true;
  for (const SafetensorsTensor& t : h.tensors) {
    idx.arrays[t.name].push_back(PaddleArray{t.begin, t.end - t.begin, t.dtype, t.shape});
  }
  return idx;
}

}  // namespace

absl::StatusOr<PaddleDataIndex> ReadPaddleDataFile(const RandomAccessFile& file) {
  char head[16] = {0};
  const uint64_t n = std::min<uint64_t>(sizeof head, file.size());
  CKPT_RETURN_IF_ERROR(file.Read(0, n, head));
  if (!LooksPickled(absl::string_view(head, n))) {
    if (n > 8 && head[8] == '{') return ReadSafetensorsIndex(file);
    return absl::DataLossError(absl::StrCat(
        file.path(), ": not a Paddle data file (neither a pickle nor safetensors)"));
  }
  CKPT_ASSIGN_OR_RETURN(Document doc, pickle::Parse(file, 0, file.size(), NumpyPickleOptions()));
  CKPT_ASSIGN_OR_RETURN(const std::vector<Value>* items, doc.DictItems(doc.root, "data file"));
  PaddleDataIndex idx;
  absl::flat_hash_map<std::string, PaddleArray> plain;
  for (size_t k = 0; k + 1 < items->size(); k += 2) {
    if ((*items)[k].kind != Kind::kStr || !doc.strs[(*items)[k].ref].loaded) continue;
    const std::string& key = doc.strs[(*items)[k].ref].text;
    CKPT_ASSIGN_OR_RETURN(std::optional<PaddleArray> a,
                          ToArray(doc, (*items)[k + 1], absl::StrCat("array '", key, "'")));
    if (a) plain[key] = *a;
  }
  // Split big params: key -> {"OriginShape": shape, "slices": [key@@.0, ...]}.
  std::set<std::string> pieces;
  if (std::optional<Value> info = doc.DictGet(doc.root, kUnpackInfo);
      info && info->kind != Kind::kNone) {
    CKPT_ASSIGN_OR_RETURN(const std::vector<Value>* entries, doc.DictItems(*info, kUnpackInfo));
    for (size_t k = 0; k + 1 < entries->size(); k += 2) {
      CKPT_ASSIGN_OR_RETURN(const std::string* key,
                            doc.Text((*entries)[k], absl::StrCat(kUnpackInfo, " key")));
      const std::string what = absl::StrCat(kUnpackInfo, "['", *key, "']");
      std::optional<Value> origin = doc.DictGet((*entries)[k + 1], "OriginShape");
      std::optional<Value> slices = doc.DictGet((*entries)[k + 1], "slices");
      if (!origin || !slices) return doc.Error(absl::StrCat(what, ": no OriginShape/slices"));
      CKPT_ASSIGN_OR_RETURN(Shape shape, doc.IntList(*origin, absl::StrCat(what, ".OriginShape")));
      CKPT_ASSIGN_OR_RETURN(const std::vector<Value>* names,
                            doc.Items(*slices, absl::StrCat(what, ".slices")));
      std::vector<PaddleArray> parts;
      int64_t total = 0;
      for (const Value& nv : *names) {
        CKPT_ASSIGN_OR_RETURN(const std::string* part, doc.Text(nv, what));
        auto it = plain.find(*part);
        if (it == plain.end()) {
          return doc.Error(absl::StrCat(what, ": slice '", *part, "' is not an array in the file"));
        }
        if (!parts.empty() && it->second.dtype != parts.front().dtype) {
          return doc.Error(absl::StrCat(what, ": slices of different dtypes"));
        }
        total += NumElements(it->second.shape);
        parts.push_back(it->second);
        pieces.insert(*part);
      }
      auto numel = CheckedNumElements(shape);
      if (!numel.ok() || *numel != total) {
        return doc.Error(absl::StrCat(what, ": slices hold ", total, " elements but OriginShape ",
                                      ShapeString(shape), " has ",
                                      numel.ok() ? absl::StrCat(*numel) : "an invalid size"));
      }
      if (!parts.empty()) parts.front().shape = shape;  // informative only
      idx.arrays[*key] = std::move(parts);
    }
  }
  for (auto& [key, a] : plain) {
    if (!pieces.count(key) && !idx.arrays.count(key)) idx.arrays[key].push_back(a);
  }
  return idx;
}

namespace {

// One LocalTensorMetadata record. Errors carry only the field; callers add
// which record it was (built only on the error path: 10^5 records parse fast).
absl::StatusOr<Ltm> ParseLtm(const Document& doc, const Value& v,
                             absl::flat_hash_map<uint32_t, DType>* dtypes) {
  CKPT_ASSIGN_OR_RETURN(const Object* o, doc.Obj(v, "record"));
  if (doc.Tag(*o) != kTagPdLocalTensorMetadata) {
    return doc.Error(absl::StrCat("record is ", doc.ClassName(*o), ", not LocalTensorMetadata"));
  }
  Ltm l;
  CKPT_ASSIGN_OR_RETURN(l.offset, OptShape(doc, *o, "global_offset", "LocalTensorMetadata"));
  CKPT_ASSIGN_OR_RETURN(l.local_shape, OptShape(doc, *o, "local_shape", "LocalTensorMetadata"));
  if (std::optional<Value> gs = doc.Field(*o, "global_shape"); gs && gs->kind != Kind::kNone) {
    CKPT_ASSIGN_OR_RETURN(l.global_shape, doc.IntList(*gs, "global_shape"));
    l.has_global_shape = true;
  }
  std::optional<Value> dt = doc.Field(*o, "dtype");
  if (!dt) return doc.Error("LocalTensorMetadata without dtype");
  // Memoised dtype strings are one value: parse each once.
  auto cached = dt->kind == Kind::kStr ? dtypes->find(dt->ref) : dtypes->end();
  if (cached != dtypes->end()) {
    l.dtype = cached->second;
  } else {
    CKPT_ASSIGN_OR_RETURN(l.dtype, PaddleDType(doc, *dt, "LocalTensorMetadata"));
    dtypes->emplace(dt->ref, l.dtype);
  }
  CKPT_ASSIGN_OR_RETURN(l.flat, ReadFlat(doc, *o, "LocalTensorMetadata"));
  if (l.offset.size() != l.local_shape.size()) {
    return doc.Error("global_offset and local_shape differ in rank");
  }
  return l;
}

struct Lti {
  const std::string* key = nullptr;
  Shape offset;
  std::optional<FlatRange> flat;
  int64_t replica = 0;
  std::optional<Shape> local_shape;
  const std::string* file = nullptr;
};

absl::StatusOr<Lti> ParseLti(const Document& doc, const Value& k, const Value& v) {
  CKPT_ASSIGN_OR_RETURN(const Object* o, doc.Obj(k, "key"));
  if (doc.Tag(*o) != kTagPdLocalTensorIndex) {
    return doc.Error(absl::StrCat("keyed by ", doc.ClassName(*o), ", not LocalTensorIndex"));
  }
  Lti l;
  std::optional<Value> kv = doc.Field(*o, "tensor_key");
  if (!kv) return doc.Error("LocalTensorIndex without tensor_key");
  CKPT_ASSIGN_OR_RETURN(l.key, doc.Text(*kv, "tensor_key"));
  CKPT_ASSIGN_OR_RETURN(l.offset, OptShape(doc, *o, "global_offset", "LocalTensorIndex"));
  CKPT_ASSIGN_OR_RETURN(l.flat, ReadFlat(doc, *o, "LocalTensorIndex"));
  if (std::optional<Value> r = doc.Field(*o, "replica_id"); r && r->kind != Kind::kNone) {
    CKPT_ASSIGN_OR_RETURN(l.replica, doc.Int(*r, "replica_id"));
  }
  if (std::optional<Value> ls = doc.Field(*o, "local_shape"); ls && ls->kind != Kind::kNone) {
    CKPT_ASSIGN_OR_RETURN(l.local_shape, doc.IntList(*ls, "local_shape"));
  }
  CKPT_ASSIGN_OR_RETURN(l.file, doc.Text(v, "data file name"));
  return l;
}

}  // namespace

namespace {

// A tensor's dtype and global shape from its shards' LocalTensorMetadata
// (their global_shape, else the extent of their offsets + local shapes);
// every shard must agree.
absl::Status TensorFromShards(const Document& doc, const std::string& name,
                              const std::vector<Ltm>& ltms, TensorMeta* t) {
  if (!ltms.empty()) {
    const Ltm& first = ltms.front();
    t->dtype = first.dtype;
    if (first.has_global_shape) {
      t->global_shape = first.global_shape;
    } else {
      t->global_shape.assign(first.offset.size(), 0);
      for (const Ltm& l : ltms) {
        if (l.offset.size() != t->global_shape.size()) continue;  // refused below
        for (size_t d = 0; d < l.offset.size(); ++d) {
          int64_t end = 0;  // checked: found by tests/fuzz:pickle
          if (d >= l.local_shape.size() || l.offset[d] < 0 || l.local_shape[d] < 0 ||
              __builtin_add_overflow(l.offset[d], l.local_shape[d], &end)) {
            return doc.Error(absl::StrCat("tensor '", name, "': a shard's global_offset + "
                                          "local_shape is out of range on axis ", d));
          }
          t->global_shape[d] = std::max(t->global_shape[d], end);
        }
      }
    }
  }
  for (const Ltm& l : ltms) {
    if (l.dtype != t->dtype) {
      return doc.Error(absl::StrCat("tensor '", name, "': shards disagree on dtype (",
                                    DTypeName(t->dtype), " and ", DTypeName(l.dtype), ")"));
    }
    if ((l.has_global_shape && l.global_shape != t->global_shape) ||
        l.offset.size() != t->global_shape.size()) {
      return doc.Error(absl::StrCat("tensor '", name, "': shards disagree on global_shape"));
    }
  }
  return absl::OkStatus();
}

// Metadata.flat_mapping, when present: flat key -> its structured path.
absl::Status ReadFlatMapping(const Document& doc, const Object& root,
                             std::map<std::string, std::vector<std::string>>* out) {
  if (std::optional<Value> fm = doc.Field(root, "flat_mapping"); fm && fm->kind != Kind::kNone) {
    CKPT_ASSIGN_OR_RETURN(const std::vector<Value>* items, doc.DictItems(*fm, "flat_mapping"));
    for (size_t k = 0; k + 1 < items->size(); k += 2) {
      CKPT_ASSIGN_OR_RETURN(const std::string* flat_key, doc.Text((*items)[k], "flat_mapping key"));
      std::vector<std::string> path;
      if ((*items)[k + 1].kind == Kind::kStr) {
        CKPT_ASSIGN_OR_RETURN(const std::string* t, doc.Text((*items)[k + 1], "flat_mapping"));
        path.push_back(*t);
      } else {
        CKPT_ASSIGN_OR_RETURN(const std::vector<Value>* parts,
                              doc.Items((*items)[k + 1], "flat_mapping value"));
        for (const Value& p : *parts) {
          CKPT_ASSIGN_OR_RETURN(const std::string* t, doc.Text(p, "flat_mapping value"));
          path.push_back(*t);
        }
      }
      (*out)[*flat_key] = std::move(path);
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CheckpointMetadata> PaddleMetadataToModel(const Document& doc) {
  CKPT_ASSIGN_OR_RETURN(const MetadataDicts dicts,
                        MetadataDictsOf(doc, kTagPdMetadata, "Paddle's Metadata",
                                        "storage_metadata"));
  const Object* root = dicts.root;
  const std::vector<Value>* tensors = dicts.tensors;
  const std::vector<Value>* storage = dicts.storage;

  CheckpointMetadata m;
  std::map<std::string, std::vector<Ltm>> infos;
  absl::flat_hash_map<uint32_t, DType> dtypes;
  for (size_t k = 0; k + 1 < tensors->size(); k += 2) {
    CKPT_ASSIGN_OR_RETURN(const std::string* name,
                          doc.Text((*tensors)[k], "state_dict_metadata key"));
    auto what = [&] { return absl::StrCat("state_dict_metadata['", *name, "']"); };
    auto list = doc.Items((*tensors)[k + 1], "list of LocalTensorMetadata");
    if (!list.ok()) return Annotate(list.status(), what());
    std::vector<Ltm>& ltms = infos[*name];
    ltms.clear();  // a repeated key: the last one wins, as in a dict
    ltms.reserve((*list)->size());
    for (size_t i = 0; i < (*list)->size(); ++i) {
      auto l = ParseLtm(doc, (**list)[i], &dtypes);
      if (!l.ok()) return Annotate(l.status(), absl::StrCat(what(), "[", i, "]"));
      ltms.push_back(std::move(*l));
    }
  }
  // (tensor, offset, flattened range) -> its LocalTensorMetadata.
  absl::flat_hash_map<std::string, std::pair<const Ltm*, TensorMeta*>> by_key;
  by_key.reserve(storage->size() / 2);
  for (auto& [name, ltms] : infos) {
    TensorMeta& t = m.tensors[name];
    CKPT_RETURN_IF_ERROR(TensorFromShards(doc, name, ltms, &t));
    for (const Ltm& l : ltms) {
      by_key[ShardKey(name, l.offset, l.flat)] = {&l, &t};
    }
    t.shards.reserve(ltms.size());
  }
  for (size_t k = 0; k + 1 < storage->size(); k += 2) {
    auto lti = ParseLti(doc, (*storage)[k], (*storage)[k + 1]);
    if (!lti.ok()) {
      return Annotate(lti.status(), absl::StrCat("storage_metadata entry ", k / 2));
    }
    const std::string& key = *lti->key;
    const std::optional<FlatRange>& flat = lti->flat;
    auto it = by_key.find(ShardKey(key, lti->offset, flat));
    if (it == by_key.end()) {
      return doc.Error(absl::StrCat("tensor '", key, "': storage_metadata names a shard at ",
                                    ShapeString(lti->offset),
                                    flat ? absl::StrCat(" flattened [", flat->begin, ", ",
                                                        flat->end, ")")
                                         : std::string(),
                                    " that state_dict_metadata does not list"));
    }
    const Ltm& l = *it->second.first;
    if (lti->local_shape && *lti->local_shape != l.local_shape) {
      return doc.Error(absl::StrCat("tensor '", key, "': storage_metadata local_shape ",
                                    ShapeString(*lti->local_shape),
                                    " differs from state_dict_metadata's ",
                                    ShapeString(l.local_shape)));
    }
    if (lti->replica < 0 || lti->replica > INT32_MAX) {
      return doc.Error(absl::StrCat("tensor '", key, "': replica_id ", lti->replica));
    }
    if (!IsPlainFileName(*lti->file)) {
      return doc.Error(absl::StrCat("tensor '", key, "': data file '", *lti->file,
                                    "' is not a plain file name inside the directory"));
    }
    auto n = CheckedNumBytes(l.local_shape, DTypeSize(l.dtype));
    if (!n.ok()) {
      return doc.Error(absl::StrCat("tensor '", key, "': local_shape ",
                                    ShapeString(l.local_shape), ": ", n.status().message()));
    }
    ShardMeta s;
    if (flat) {
      if (flat->begin < 0 || flat->end < flat->begin || flat->end > NumElements(l.local_shape)) {
        return doc.Error(absl::StrCat("tensor '", key, "': flattened_range [", flat->begin,
                                      ", ", flat->end, ") outside local_shape ",
                                      ShapeString(l.local_shape)));
      }
      if (flat->begin == flat->end) continue;  // an empty flattened shard holds nothing
      s.nbytes = static_cast<uint64_t>(flat->end - flat->begin) * DTypeSize(l.dtype);
    } else {
      s.nbytes = static_cast<uint64_t>(*n);
    }
    s.file = *lti->file;
    s.box = Box{std::move(lti->offset), l.local_shape};
    s.dtype = l.dtype;
    s.flat_range = flat;
    s.replica_id = static_cast<int>(lti->replica);
    it->second.second->shards.push_back(std::move(s));
  }
  CKPT_RETURN_IF_ERROR(ReadFlatMapping(doc, *root, &m.flat_mapping));
  return m;
}

absl::Status LocatePaddleData(const Directory& dir, CheckpointMetadata* m,
                              std::map<std::string, FileStamp>* stamps) {
  std::map<std::string, std::vector<std::pair<std::string, size_t>>> by_file;
  for (auto& [name, t] : m->tensors) {
    for (size_t i = 0; i < t.shards.size(); ++i) by_file[t.shards[i].file].push_back({name, i});
  }
  // New shard lists (split params turn one shard into several).
  std::map<std::string, std::vector<std::vector<ShardMeta>>> replaced;
  for (auto& [name, t] : m->tensors) replaced[name].resize(t.shards.size());
  for (const auto& [file, shards] : by_file) {
    const std::string path = JoinPath(dir.path(), file);
    auto f = dir.OpenFile(file);
    if (!f.ok()) {
      return absl::Status(f.status().code(),
                          absl::StrCat("checkpoint ", dir.path(), ": data file '", file,
                                       "' named by the metadata cannot be opened: ",
                                       f.status().message()));
    }
    if (stamps != nullptr) {
      CKPT_ASSIGN_OR_RETURN((*stamps)[file], (*f)->Stamp());
    }
    CKPT_ASSIGN_OR_RETURN(PaddleDataIndex idx, ReadPaddleDataFile(**f));
    std::map<std::string, int> uses;
    for (const auto& [name, i] : shards) {
      if (++uses[name] > 1) {
        return absl::DataLossError(absl::StrCat(
            path, ": holds several shards of tensor '", name,
            "' but a data file maps each key to one array; the metadata is inconsistent"));
      }
    }
    for (const auto& [name, i] : shards) {
      const ShardMeta& s = m->tensors[name].shards[i];
      auto it = idx.arrays.find(name);
      if (it == idx.arrays.end()) {
        return absl::DataLossError(absl::StrCat(path, ": no array '", name,
                                                "' although the metadata puts a shard of it "
                                                "here"));
      }
      const std::vector<PaddleArray>& parts = it->second;
      int64_t total = 0;
      for (const PaddleArray& a : parts) {
        if (!StoredDTypeCompatible(s.dtype, a.dtype)) {
          return absl::DataLossError(absl::StrCat(path, ": array '", name, "' is stored as ",
                                                  DTypeName(a.dtype), " but the metadata says ",
                                                  DTypeName(s.dtype)));
        }
        total += static_cast<int64_t>(a.nbytes / DTypeSize(a.dtype));
      }
      if (total != s.num_elements()) {
        return absl::DataLossError(absl::StrCat(path, ": array '", name, "' holds ", total,
                                                " elements but the metadata's shard ",
                                                BoxString(s.box), " has ", s.num_elements()));
      }
      std::vector<ShardMeta>& out = replaced[name][i];
      if (parts.size() == 1) {
        ShardMeta c = s;
        c.data_offset = parts[0].offset;
        out.push_back(std::move(c));
        continue;
      }
      int64_t at = s.flat_range ? s.flat_range->begin : 0;
      for (const PaddleArray& a : parts) {
        const int64_t n = static_cast<int64_t>(a.nbytes / DTypeSize(a.dtype));
        if (n == 0) continue;
        ShardMeta c = s;
        c.flat_range = FlatRange{at, at + n};
        c.data_offset = a.offset;
        c.nbytes = a.nbytes;
        at += n;
        out.push_back(std::move(c));
      }
    }
  }
  for (auto& [name, t] : m->tensors) {
    std::vector<ShardMeta> shards;
    for (auto& v : replaced[name]) {
      for (auto& s : v) shards.push_back(std::move(s));
    }
    t.shards = std::move(shards);
  }
  return absl::OkStatus();
}

}  // namespace ckpt
