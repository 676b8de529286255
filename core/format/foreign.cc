#include "core/format/foreign.h"

#include <limits.h>
#include <stdlib.h>

#include <algorithm>
#include <map>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"

namespace ckpt {
namespace {

using pickle::AllowedGlobal;
using pickle::GlobalRole;

void AddTorchDtypes(std::vector<AllowedGlobal>* g) {
  const std::pair<const char*, DType> kDtypes[] = {
      {"float64", DType::kF64},      {"double", DType::kF64},
      {"float32", DType::kF32},      {"float", DType::kF32},
      {"float16", DType::kF16},      {"half", DType::kF16},
      {"bfloat16", DType::kBF16},    {"float8_e4m3fn", DType::kF8E4M3},
      {"float8_e5m2", DType::kF8E5M2}, {"int64", DType::kI64},
      {"long", DType::kI64},         {"int32", DType::kI32},
      {"int", DType::kI32},          {"int16", DType::kI16},
      {"short", DType::kI16},        {"int8", DType::kI8},
      {"uint8", DType::kU8},         {"uint16", DType::kU16},
      {"uint32", DType::kU32},       {"uint64", DType::kU64},
      {"bool", DType::kBool},
  };
  for (const auto& [name, d] : kDtypes) {
    g->push_back({"torch", name, GlobalRole::kConstant, kTagTorchDtype + static_cast<int>(d)});
  }
  for (const char* name : {"complex32", "complex64", "complex128", "cfloat", "cdouble", "chalf",
                           "qint8", "quint8", "qint32", "quint4x2", "float8_e4m3fnuz",
                           "float8_e5m2fnuz"}) {
    g->push_back({"torch", name, GlobalRole::kConstant, kTagTorchDtypeUnsupported});
  }
}

pickle::Options MakeMetadataOptions() {
  pickle::Options o;
  auto& g = o.globals;
  for (const char* mod :
       {"paddle.distributed.flex_checkpoint.dcp.metadata", "paddle.distributed.checkpoint.metadata"}) {
    g.push_back({mod, "Metadata", GlobalRole::kClass, kTagPdMetadata});
    g.push_back({mod, "LocalTensorMetadata", GlobalRole::kClass, kTagPdLocalTensorMetadata});
    g.push_back({mod, "LocalTensorIndex", GlobalRole::kClass, kTagPdLocalTensorIndex});
  }
  for (const char* mod :
       {"torch.distributed._shard.checkpoint.metadata", "torch.distributed.checkpoint.metadata"}) {
    g.push_back({mod, "Metadata", GlobalRole::kClass, kTagTMetadata});
    g.push_back({mod, "TensorStorageMetadata", GlobalRole::kClass, kTagTTensorStorageMetadata});
    g.push_back({mod, "BytesStorageMetadata", GlobalRole::kClass, kTagTBytesStorageMetadata});
    g.push_back({mod, "ChunkStorageMetadata", GlobalRole::kClass, kTagTChunkStorageMetadata});
    g.push_back({mod, "MetadataIndex", GlobalRole::kClass, kTagTMetadataIndex});
    g.push_back({mod, "TensorProperties", GlobalRole::kClass, kTagTTensorProperties});
    g.push_back({mod, "StorageMeta", GlobalRole::kClass, kTagTStorageMeta});
    g.push_back({mod, "_MEM_FORMAT_ENCODING", GlobalRole::kEnumClass, kTagTInert});
  }
  g.push_back({"torch.distributed._shard.sharded_tensor.metadata", "TensorProperties",
               GlobalRole::kClass, kTagTTensorProperties});
  g.push_back({"torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING",
               GlobalRole::kEnumClass, kTagTInert});
  for (const char* mod :
       {"torch.distributed._shard.checkpoint.filesystem", "torch.distributed.checkpoint.filesystem"}) {
    g.push_back({mod, "_StorageInfo", GlobalRole::kClass, kTagTStorageInfo});
  }
  g.push_back({"torch", "Size", GlobalRole::kTupleOfArg, kTagNone});
  g.push_back({"torch.serialization", "_get_layout", GlobalRole::kFunction, kTagTInert});
  g.push_back({"torch", "strided", GlobalRole::kConstant, kTagTInert});
  g.push_back({"torch", "sparse_coo", GlobalRole::kConstant, kTagTInert});
  g.push_back({"builtins", "getattr", GlobalRole::kEnumGetattr, kTagNone});
  g.push_back({"collections", "OrderedDict", GlobalRole::kOrderedDict, kTagNone});
  for (const char* cls : {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}) {
    g.push_back({"pathlib", cls, GlobalRole::kClass, kTagTInert});
  }
  AddTorchDtypes(&g);
  return o;
}

pickle::Options MakeNumpyOptions() {
  pickle::Options o;
  auto& g = o.globals;
  for (const char* mod : {"numpy.core.multiarray", "numpy._core.multiarray"}) {
    g.push_back({mod, "_reconstruct", GlobalRole::kFunction, kTagNpReconstruct});
    g.push_back({mod, "scalar", GlobalRole::kFunction, kTagNpScalar});
  }
  for (const char* mod : {"numpy.core.numeric", "numpy._core.numeric"}) {
    g.push_back({mod, "_frombuffer", GlobalRole::kFunction, kTagNpFrombuffer});
  }
  g.push_back({"numpy", "ndarray", GlobalRole::kClass, kTagNpNdarray});
  g.push_back({"numpy", "dtype", GlobalRole::kClass, kTagNpDtype});
  g.push_back({"_codecs", "encode", GlobalRole::kLatin1Encode, kTagNone});
  g.push_back({"collections", "OrderedDict", GlobalRole::kOrderedDict, kTagNone});
  return o;
}

// torch's legacy typed-storage classes (what torch.save names in a tensor's
// persistent id), by the dtype they hold.
constexpr std::pair<const char*, DType> kTorchStorages[] = {
    {"DoubleStorage", DType::kF64}, {"FloatStorage", DType::kF32},
    {"HalfStorage", DType::kF16},   {"BFloat16Storage", DType::kBF16},
    {"LongStorage", DType::kI64},   {"IntStorage", DType::kI32},
    {"ShortStorage", DType::kI16},  {"CharStorage", DType::kI8},
    {"ByteStorage", DType::kU8},    {"BoolStorage", DType::kBool},
};

pickle::Options MakeTorchTensorOptions() {
  pickle::Options o;
  o.allow_persistent_id = true;
  auto& g = o.globals;
  g.push_back({"torch._utils", "_rebuild_tensor_v2", GlobalRole::kFunction, kTagTorchRebuildV2});
  g.push_back({"torch._utils", "_rebuild_tensor_v3", GlobalRole::kFunction, kTagTorchRebuildV3});
  for (const auto& [name, d] : kTorchStorages) {
    g.push_back({"torch", name, GlobalRole::kConstant, kTagTorchStorage + static_cast<int>(d)});
  }
  g.push_back({"torch", "UntypedStorage", GlobalRole::kConstant, kTagTorchUntypedStorage});
  g.push_back({"collections", "OrderedDict", GlobalRole::kOrderedDict, kTagNone});
  AddTorchDtypes(&g);
  return o;
}

}  // namespace

const pickle::Options& MetadataPickleOptions() {
  static const pickle::Options* o = new pickle::Options(MakeMetadataOptions());
  return *o;
}
const pickle::Options& NumpyPickleOptions() {
  static const pickle::Options* o = new pickle::Options(MakeNumpyOptions());
  return *o;
}
const char* TorchStorageName(DType d) {
  for (const auto& [name, dt] : kTorchStorages) {
    if (dt == d) return name;
  }
  return nullptr;
}

const pickle::Options& TorchTensorPickleOptions() {
  static const pickle::Options* o = new pickle::Options(MakeTorchTensorOptions());
  return *o;
}

bool LooksPickled(absl::string_view head) {
  return !head.empty() && static_cast<uint8_t>(head[0]) == 0x80;
}

bool StoredDTypeCompatible(DType metadata, DType file) {
  if (metadata == file) return true;
  if (DTypeSize(metadata) != DTypeSize(file)) return false;
  if (metadata == DType::kBF16 || metadata == DType::kF16) {
    return file == DType::kU16 || file == DType::kI16;
  }
  if (metadata == DType::kF8E4M3 || metadata == DType::kF8E5M2) {
    return file == DType::kU8 || file == DType::kI8;
  }
  return false;
}



absl::StatusOr<MetadataDicts> MetadataDictsOf(const pickle::Document& doc, ForeignTag tag,
                                              absl::string_view format,
                                              absl::string_view storage_field) {
  CKPT_ASSIGN_OR_RETURN(const pickle::Object* root, doc.Obj(doc.root, "metadata"));
  if (doc.Tag(*root) != tag) {
    return doc.Error(absl::StrCat("root is ", doc.ClassName(*root), ", not ", format));
  }
  std::optional<pickle::Value> sdm = doc.Field(*root, "state_dict_metadata");
  std::optional<pickle::Value> st = doc.Field(*root, storage_field);
  if (!sdm || !st) {
    return doc.Error(absl::StrCat("Metadata without state_dict_metadata/", storage_field));
  }
  MetadataDicts out;
  out.root = root;
  CKPT_ASSIGN_OR_RETURN(out.tensors, doc.DictItems(*sdm, "state_dict_metadata"));
  CKPT_ASSIGN_OR_RETURN(out.storage, doc.DictItems(*st, storage_field));
  return out;
}

}  // namespace ckpt
