#include "core/format/torch_dcp.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/format/foreign.h"
#include "core/base/status_macros.h"
#include "zlib.h"

namespace ckpt {
namespace {

using pickle::Document;
using pickle::Kind;
using pickle::Object;
using pickle::Value;

constexpr uint32_t kEocdSig = 0x06054b50;
constexpr uint32_t kZip64EocdSig = 0x06064b50;
constexpr uint32_t kZip64LocatorSig = 0x07064b50;
constexpr uint32_t kCentralSig = 0x02014b50;
constexpr uint32_t kLocalSig = 0x04034b50;
constexpr uint64_t kMaxCentralDirectory = 64ull << 20;
constexpr uint64_t kMaxDataPkl = 64ull << 20;

uint64_t LE(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

absl::Status ZipError(const RandomAccessFile& f, uint64_t begin, absl::string_view what) {
  return absl::DataLossError(
      absl::StrCat(f.path(), ": torch.save archive at byte ", begin, ": ", what));
}

// Finds the end-of-central-directory record in the last `tail` bytes.
bool FindEocd(const std::vector<uint8_t>& buf, size_t* at) {
  if (buf.size() < 22) return false;
  for (size_t i = buf.size() - 22 + 1; i-- > 0;) {
    if (LE(&buf[i], 4) == kEocdSig && i + 22 + LE(&buf[i + 20], 2) == buf.size()) {
      *at = i;
      return true;
    }
  }
  return false;
}

absl::StatusOr<DType> TorchDType(const Document& doc, const Value& v, absl::string_view what) {
  int tag = doc.GlobalTag(v);
  if (tag >= kTagTorchDtype && tag < kTagTorchDtypeUnsupported) {
    return static_cast<DType>(tag - kTagTorchDtype);
  }
  if (tag == kTagTorchDtypeUnsupported) {
    return absl::UnimplementedError(absl::StrCat(doc.path, ": ", what, ": dtype ",
                                                 doc.Describe(v), " is not supported"));
  }
  return doc.Error(absl::StrCat(what, ": expected a torch dtype, found ", doc.Describe(v)));
}

std::string ChunkKey(absl::string_view fqn, const Shape& offsets) {
  std::string k(fqn);
  k.push_back('\0');
  k.append(reinterpret_cast<const char*>(offsets.data()), offsets.size() * sizeof(int64_t));
  return k;
}

}  // namespace

absl::StatusOr<std::vector<ZipEntry>> ReadZipDirectory(const RandomAccessFile& f, uint64_t begin,
                                                       uint64_t length) {
  if (begin > f.size() || length > f.size() - begin) {
    return ZipError(f, begin, absl::StrCat("item of ", length, " bytes runs past the end of the file (",
                                           f.size(), " bytes)"));
  }
  if (length < 22) return ZipError(f, begin, "too short to be a zip archive");
  // The EOCD record ends the archive unless a comment follows; torch writes
  // none, so look at a short tail first.
  std::vector<uint8_t> tail;
  size_t eocd = 0;
  bool found = false;
  for (uint64_t want : {uint64_t{512}, uint64_t{22 + 65535 + 20 + 56}}) {
    const uint64_t n = std::min(want, length);
    tail.resize(n);
    CKPT_RETURN_IF_ERROR(f.Read(begin + length - n, n, tail.data()));
    if ((found = FindEocd(tail, &eocd))) break;
    if (n == length) break;
  }
  if (!found) {
    char magic[2] = {0, 0};
    CKPT_RETURN_IF_ERROR(f.Read(begin, 2, magic));
    if (static_cast<uint8_t>(magic[0]) == 0x80) {
      return absl::UnimplementedError(absl::StrCat(
          f.path(), ": item at byte ", begin,
          " is a legacy (pre-1.6, non-zip) torch.save file, which ckptd does not read"));
    }
    return ZipError(f, begin, "no zip end-of-central-directory record");
  }
  const uint64_t tail_start = length - tail.size();  // relative to begin
  const uint8_t* e = &tail[eocd];
  uint64_t entries = LE(e + 10, 2), cd_size = LE(e + 12, 4), cd_offset = LE(e + 16, 4);
  const uint64_t eocd_rel = tail_start + eocd;
  if (eocd_rel >= 20) {
    uint8_t loc[20];
    CKPT_RETURN_IF_ERROR(f.Read(begin + eocd_rel - 20, 20, loc));
    if (LE(loc, 4) == kZip64LocatorSig) {
      const uint64_t z64 = LE(loc + 8, 8);
      if (z64 > length || length - z64 < 56) {
        return ZipError(f, begin, "zip64 end-of-central-directory record outside the archive");
      }
      uint8_t rec[56];
      CKPT_RETURN_IF_ERROR(f.Read(begin + z64, 56, rec));
      if (LE(rec, 4) != kZip64EocdSig) {
        return ZipError(f, begin, "bad zip64 end-of-central-directory signature");
      }
      entries = LE(rec + 32, 8);
      cd_size = LE(rec + 40, 8);
      cd_offset = LE(rec + 48, 8);
    }
  }
  if (cd_offset > length || cd_size > length - cd_offset) {
    return ZipError(f, begin, "central directory outside the archive");
  }
  if (cd_size > kMaxCentralDirectory || entries > cd_size / 46) {
    return ZipError(f, begin, absl::StrCat("implausible central directory (", entries,
                                           " entries in ", cd_size, " bytes)"));
  }
  std::vector<uint8_t> cd(cd_size);
  CKPT_RETURN_IF_ERROR(f.Read(begin + cd_offset, cd_size, cd.data()));
  std::vector<ZipEntry> out;
  out.reserve(entries);
  size_t p = 0;
  for (uint64_t i = 0; i < entries; ++i) {
    if (cd.size() - p < 46 || LE(&cd[p], 4) != kCentralSig) {
      return ZipError(f, begin, absl::StrCat("central directory entry ", i, " is malformed"));
    }
    const uint8_t* h = &cd[p];
    ZipEntry z;
    z.method = static_cast<uint16_t>(LE(h + 10, 2));
    z.compressed = LE(h + 20, 4);
    z.size = LE(h + 24, 4);
    const size_t nlen = LE(h + 28, 2), xlen = LE(h + 30, 2), clen = LE(h + 32, 2);
    z.header_offset = LE(h + 42, 4);
    if (cd.size() - p - 46 < nlen + xlen + clen) {
      return ZipError(f, begin, absl::StrCat("central directory entry ", i, " is truncated"));
    }
    z.name.assign(reinterpret_cast<const char*>(h + 46), nlen);
    // Zip64 extra field: the 0xFFFFFFFF fields, in order.
    const uint8_t* x = h + 46 + nlen;
    for (size_t q = 0; q + 4 <= xlen;) {
      const uint64_t id = LE(x + q, 2), sz = LE(x + q + 2, 2);
      if (q + 4 + sz > xlen) break;
      if (id == 0x0001) {
        const uint8_t* v = x + q + 4;
        size_t left = sz;
        auto take = [&](uint64_t* field) {
          if (*field == 0xFFFFFFFFull && left >= 8) {
            *field = LE(v, 8);
            v += 8;
            left -= 8;
          }
        };
        take(&z.size);
        take(&z.compressed);
        take(&z.header_offset);
      }
      q += 4 + sz;
    }
    p += 46 + nlen + xlen + clen;
    out.push_back(std::move(z));
  }
  return out;
}

absl::StatusOr<uint64_t> ZipEntryDataOffset(const RandomAccessFile& f, uint64_t begin,
                                            uint64_t length, const ZipEntry& z) {
  if (z.header_offset > length || length - z.header_offset < 30) {
    return ZipError(f, begin, absl::StrCat("entry '", z.name, "' starts outside the archive"));
  }
  uint8_t h[30];
  CKPT_RETURN_IF_ERROR(f.Read(begin + z.header_offset, 30, h));
  if (LE(h, 4) != kLocalSig) {
    return ZipError(f, begin, absl::StrCat("entry '", z.name, "': bad local header signature"));
  }
  const uint64_t data = z.header_offset + 30 + LE(h + 26, 2) + LE(h + 28, 2);
  if (z.method != 0 || z.compressed != z.size) {
    return absl::UnimplementedError(absl::StrCat(f.path(), ": torch.save archive at byte ",
                                                 begin, ": entry '", z.name,
                                                 "' is compressed; only stored entries are read"));
  }
  if (data > length || z.size > length - data) {
    return ZipError(f, begin, absl::StrCat("entry '", z.name, "' runs past the archive"));
  }
  return begin + data;
}

absl::StatusOr<TorchSavedTensor> ReadTorchSaveTensor(const RandomAccessFile& f, uint64_t begin,
                                                     uint64_t length) {
  CKPT_ASSIGN_OR_RETURN(std::vector<ZipEntry> entries, ReadZipDirectory(f, begin, length));
  const ZipEntry* pkl = nullptr;
  std::string prefix;
  for (const ZipEntry& z : entries) {
    size_t slash = z.name.find('/');
    if (slash != std::string::npos && z.name.compare(slash, std::string::npos, "/data.pkl") == 0) {
      pkl = &z;
      prefix = z.name.substr(0, slash);
      break;
    }
  }
  if (pkl == nullptr) return ZipError(f, begin, "no <archive>/data.pkl entry");
  if (pkl->size > kMaxDataPkl) return ZipError(f, begin, "data.pkl larger than 64 MiB");
  CKPT_ASSIGN_OR_RETURN(uint64_t pkl_at, ZipEntryDataOffset(f, begin, length, *pkl));
  CKPT_ASSIGN_OR_RETURN(pickle::Document doc,
                        pickle::Parse(f, pkl_at, pkl_at + pkl->size, TorchTensorPickleOptions()));
  const std::string what = absl::StrCat("torch.save item at byte ", begin);
  CKPT_ASSIGN_OR_RETURN(const Object* o, doc.Obj(doc.root, what));
  const int tag = doc.Tag(*o);
  if (tag != kTagTorchRebuildV2 && tag != kTagTorchRebuildV3) {
    return doc.Error(absl::StrCat(what, ": holds ", doc.ClassName(*o), ", not a plain tensor"));
  }
  const std::vector<Value>& a = doc.seqs[o->args.ref].items;
  if (a.size() < (tag == kTagTorchRebuildV3 ? 7u : 6u)) {
    return doc.Error(absl::StrCat(what, ": ", doc.ClassName(*o), " with ", a.size(),
                                  " arguments"));
  }
  CKPT_ASSIGN_OR_RETURN(const Object* st, doc.Obj(a[0], absl::StrCat(what, " storage")));
  if (st->how != Object::How::kPersistentId) {
    return doc.Error(absl::StrCat(what, ": storage is not a persistent id"));
  }
  CKPT_ASSIGN_OR_RETURN(const std::vector<Value>* pid, doc.Items(st->args, what));
  if (pid->size() < 5) return doc.Error(absl::StrCat(what, ": persistent id of ", pid->size()));
  CKPT_ASSIGN_OR_RETURN(const std::string* kind, doc.Text((*pid)[0], what));
  if (*kind != "storage") {
    return doc.Error(absl::StrCat(what, ": persistent id '", *kind, "', not 'storage'"));
  }
  TorchSavedTensor t;
  const int stag = doc.GlobalTag((*pid)[1]);
  if (stag >= kTagTorchStorage && stag < kTagTorchStorage + 100) {
    t.dtype = static_cast<DType>(stag - kTagTorchStorage);
  } else if (stag == kTagTorchUntypedStorage && tag == kTagTorchRebuildV3) {
    CKPT_ASSIGN_OR_RETURN(t.dtype, TorchDType(doc, a[6], what));
  } else {
    return doc.Error(absl::StrCat(what, ": storage type ", doc.Describe((*pid)[1])));
  }
  if (tag == kTagTorchRebuildV3) {
    CKPT_ASSIGN_OR_RETURN(DType d, TorchDType(doc, a[6], what));
    if (d != t.dtype) return doc.Error(absl::StrCat(what, ": storage and tensor dtypes differ"));
  }
  CKPT_ASSIGN_OR_RETURN(const std::string* key, doc.Text((*pid)[2], absl::StrCat(what, " key")));
  CKPT_ASSIGN_OR_RETURN(t.storage_offset, doc.Int(a[1], absl::StrCat(what, " storage offset")));
  CKPT_ASSIGN_OR_RETURN(t.size, doc.IntList(a[2], absl::StrCat(what, " size")));
  CKPT_ASSIGN_OR_RETURN(t.stride, doc.IntList(a[3], absl::StrCat(what, " stride")));
  if (t.size.size() != t.stride.size()) {
    return doc.Error(absl::StrCat(what, ": size and stride differ in rank"));
  }
  const size_t item = DTypeSize(t.dtype);
  auto numel = CheckedNumBytes(t.size, item);
  if (!numel.ok() || t.storage_offset < 0) {
    return doc.Error(absl::StrCat(what, ": bad size ", ShapeString(t.size), " or storage offset"));
  }
  t.nbytes = static_cast<uint64_t>(*numel);
  if (t.nbytes > 0) {
    int64_t expect = 1;
    for (size_t d = t.size.size(); d-- > 0;) {
      if (t.size[d] != 1 && t.stride[d] != expect) {
        return absl::UnimplementedError(absl::StrCat(
            f.path(), ": ", what, ": tensor of size ", ShapeString(t.size), " has strides ",
            ShapeString(t.stride),
            ", not row-major contiguous; ckptd reads contiguous tensors in place only "
            "(save a .contiguous() copy)"));
      }
      expect *= t.size[d];
    }
  }
  const std::string data_name = absl::StrCat(prefix, "/data/", *key);
  const ZipEntry* data = nullptr;
  for (const ZipEntry& z : entries) {
    if (z.name == data_name) data = &z;
  }
  if (data == nullptr) return ZipError(f, begin, absl::StrCat("no entry '", data_name, "'"));
  CKPT_ASSIGN_OR_RETURN(uint64_t data_at, ZipEntryDataOffset(f, begin, length, *data));
  const uint64_t skip = static_cast<uint64_t>(t.storage_offset) * item;
  if (t.nbytes > 0 && (skip > data->size || t.nbytes > data->size - skip)) {
    return ZipError(f, begin, absl::StrCat("tensor of ", t.nbytes, " bytes at storage offset ",
                                           t.storage_offset, " does not fit its storage of ",
                                           data->size, " bytes"));
  }
  t.data_offset = data_at + (t.nbytes > 0 ? skip : 0);
  return t;
}

namespace {

// A DCP storage item: where one chunk's torch.save bytes lie.
struct StorageItem {
  std::string file;
  uint64_t offset = 0, length = 0;
};
using StorageItems = absl::flat_hash_map<std::string, StorageItem>;  // by ChunkKey

// Metadata.storage_data: MetadataIndex -> _StorageInfo pairs, by chunk key.
absl::StatusOr<StorageItems> ReadStorageItems(const Document& doc,
                                              const std::vector<Value>* storage) {
  StorageItems items;
  items.reserve(storage->size() / 2);
  for (size_t k = 0; k + 1 < storage->size(); k += 2) {
    const std::string w = absl::StrCat("storage_data entry ", k / 2);
    CKPT_ASSIGN_OR_RETURN(const Object* mi, doc.Obj((*storage)[k], w));
    CKPT_ASSIGN_OR_RETURN(const Object* si, doc.Obj((*storage)[k + 1], w));
    if (doc.Tag(*mi) != kTagTMetadataIndex || doc.Tag(*si) != kTagTStorageInfo) {
      return doc.Error(absl::StrCat(w, ": ", doc.ClassName(*mi), " -> ", doc.ClassName(*si),
                                    ", not MetadataIndex -> _StorageInfo"));
    }
    std::optional<Value> fqn = doc.Field(*mi, "fqn");
    if (!fqn) return doc.Error(absl::StrCat(w, ": MetadataIndex without fqn"));
    CKPT_ASSIGN_OR_RETURN(const std::string* name, doc.Text(*fqn, absl::StrCat(w, ".fqn")));
    Shape offsets;
    if (std::optional<Value> off = doc.Field(*mi, "offset"); off && off->kind != Kind::kNone) {
      CKPT_ASSIGN_OR_RETURN(offsets, doc.IntList(*off, absl::StrCat(w, ".offset")));
    }
    StorageItem it;
    std::optional<Value> rp = doc.Field(*si, "relative_path");
    std::optional<Value> so = doc.Field(*si, "offset");
    std::optional<Value> sl = doc.Field(*si, "length");
    if (!rp || !so || !sl) {
      return doc.Error(absl::StrCat(w, ": _StorageInfo without relative_path/offset/length"));
    }
    CKPT_ASSIGN_OR_RETURN(const std::string* path, doc.Text(*rp, absl::StrCat(w, ".relative_path")));
    it.file = *path;
    CKPT_ASSIGN_OR_RETURN(int64_t o, doc.Int(*so, absl::StrCat(w, ".offset")));
    CKPT_ASSIGN_OR_RETURN(int64_t l, doc.Int(*sl, absl::StrCat(w, ".length")));
    if (o < 0 || l < 0) return doc.Error(absl::StrCat(w, ": negative offset or length"));
    it.offset = static_cast<uint64_t>(o);
    it.length = static_cast<uint64_t>(l);
    if (std::optional<Value> td = doc.Field(*si, "transform_descriptors");
        td && td->kind != Kind::kNone) {
      CKPT_ASSIGN_OR_RETURN(const std::vector<Value>* tds,
                            doc.Items(*td, absl::StrCat(w, ".transform_descriptors")));
      if (!tds->empty()) {
        return absl::UnimplementedError(absl::StrCat(
            doc.path, ": item '", *name, "' has transform_descriptors (compressed or "
            "transformed storage), which ckptd cannot read in place"));
      }
    }
    items[ChunkKey(*name, offsets)] = std::move(it);
  }
  return items;
}

// One chunk of tensor `name` (ChunkStorageMetadata offsets/sizes): its
// storage item opened (files kept in `files`, stamped into `stamps`) and
// the torch.save record there checked against the metadata's size and dtype.
absl::StatusOr<ShardMeta> ChunkShard(const Document& doc, const Directory& dir,
                                     const std::string& name, const std::string& cw,
                                     const Value& offs, const Value& sizes, DType dtype,
                                     const StorageItems& items,
                                     std::map<std::string, std::unique_ptr<RandomAccessFile>>& files,
                                     std::map<std::string, FileStamp>* stamps) {
  ShardMeta s;
  CKPT_ASSIGN_OR_RETURN(s.box.offset, doc.IntList(offs, cw));
  CKPT_ASSIGN_OR_RETURN(s.box.shape, doc.IntList(sizes, cw));
  s.dtype = dtype;
  auto it = items.find(ChunkKey(name, s.box.offset));
  if (it == items.end()) {
    return doc.Error(absl::StrCat("tensor '", name, "' chunk ", BoxString(s.box),
                                  " has no storage_data entry"));
  }
  const StorageItem& item = it->second;
  if (!IsPlainFileName(item.file)) {
    return doc.Error(absl::StrCat("tensor '", name, "': relative_path '", item.file,
                                  "' is not a plain file name inside the directory"));
  }
  auto& file = files[item.file];
  if (!file) {
    auto f = dir.OpenFile(item.file);
    if (!f.ok()) {
      return absl::Status(f.status().code(),
                          absl::StrCat("checkpoint ", dir.path(), ": data file '", item.file,
                                       "' named by the metadata cannot be opened: ",
                                       f.status().message()));
    }
    if (stamps != nullptr) {
      CKPT_ASSIGN_OR_RETURN((*stamps)[item.file], (*f)->Stamp());
    }
    file = std::move(*f);
  }
  auto saved = ReadTorchSaveTensor(*file, item.offset, item.length);
  if (!saved.ok()) {
    return Annotate(saved.status(), absl::StrCat("tensor '", name, "' chunk ", BoxString(s.box)));
  }
  if (saved->size != s.box.shape) {
    return absl::DataLossError(absl::StrCat(
        file->path(), ": tensor '", name, "' chunk ", BoxString(s.box), " holds size ",
        ShapeString(saved->size), " instead of ", ShapeString(s.box.shape)));
  }
  if (saved->dtype != dtype) {
    return absl::DataLossError(absl::StrCat(file->path(), ": tensor '", name, "' holds ",
                                            DTypeName(saved->dtype), " but the metadata says ",
                                            DTypeName(dtype)));
  }
  s.file = item.file;
  s.data_offset = saved->data_offset;
  s.nbytes = saved->nbytes;
  return s;
}

}  // namespace

absl::StatusOr<CheckpointMetadata> TorchDcpToModel(const Document& doc, const Directory& dir,
                                                   std::vector<std::string>* skipped,
                                                   std::map<std::string, FileStamp>* stamps) {
  CKPT_ASSIGN_OR_RETURN(const MetadataDicts dicts,
                        MetadataDictsOf(doc, kTagTMetadata, "torch DCP Metadata", "storage_data"));
  const std::vector<Value>* tensors = dicts.tensors;
  const std::vector<Value>* storage = dicts.storage;

  CKPT_ASSIGN_OR_RETURN(const StorageItems items, ReadStorageItems(doc, storage));

  CheckpointMetadata m;
  std::map<std::string, std::unique_ptr<RandomAccessFile>> files;
  for (size_t k = 0; k + 1 < tensors->size(); k += 2) {
    CKPT_ASSIGN_OR_RETURN(const std::string* name,
                          doc.Text((*tensors)[k], "state_dict_metadata key"));
    const std::string w = absl::StrCat("state_dict_metadata['", *name, "']");
    CKPT_ASSIGN_OR_RETURN(const Object* tsm, doc.Obj((*tensors)[k + 1], w));
    if (doc.Tag(*tsm) == kTagTBytesStorageMetadata) {
      skipped->push_back(*name);
      continue;
    }
    if (doc.Tag(*tsm) != kTagTTensorStorageMetadata) {
      return doc.Error(absl::StrCat(w, " is ", doc.ClassName(*tsm)));
    }
    std::optional<Value> props = doc.Field(*tsm, "properties");
    std::optional<Value> size = doc.Field(*tsm, "size");
    std::optional<Value> chunks = doc.Field(*tsm, "chunks");
    if (!props || !size || !chunks) {
      return doc.Error(absl::StrCat(w, ": no properties/size/chunks"));
    }
    TensorMeta t;
    CKPT_ASSIGN_OR_RETURN(t.global_shape, doc.IntList(*size, absl::StrCat(w, ".size")));
    CKPT_ASSIGN_OR_RETURN(const Object* p, doc.Obj(*props, absl::StrCat(w, ".properties")));
    // TensorProperties: BUILD with (dtype, layout, requires_grad, memory format,
    // pin_memory) or with a dict.
    std::optional<Value> dtype;
    if (p->has_state && p->state.kind == Kind::kTuple && !doc.seqs[p->state.ref].items.empty()) {
      dtype = doc.seqs[p->state.ref].items[0];
    } else {
      dtype = doc.Field(*p, "dtype");
    }
    if (!dtype) return doc.Error(absl::StrCat(w, ": properties without a dtype"));
    CKPT_ASSIGN_OR_RETURN(t.dtype, TorchDType(doc, *dtype, w));
    CKPT_ASSIGN_OR_RETURN(const std::vector<Value>* cl, doc.Items(*chunks, absl::StrCat(w, ".chunks")));
    for (size_t c = 0; c < cl->size(); ++c) {
      const std::string cw = absl::StrCat(w, ".chunks[", c, "]");
      CKPT_ASSIGN_OR_RETURN(const Object* co, doc.Obj((*cl)[c], cw));
      std::optional<Value> offs = doc.Field(*co, "offsets");
      std::optional<Value> sizes = doc.Field(*co, "sizes");
      if (doc.Tag(*co) != kTagTChunkStorageMetadata || !offs || !sizes) {
        return doc.Error(absl::StrCat(cw, " is not a ChunkStorageMetadata{offsets, sizes}"));
      }
      CKPT_ASSIGN_OR_RETURN(ShardMeta s, ChunkShard(doc, dir, *name, cw, *offs, *sizes, t.dtype,
                                                    items, files, stamps));
      t.shards.push_back(std::move(s));
    }
    m.tensors[*name] = std::move(t);
  }
  return m;
}

// --- Writing ------------------------------------------------------------------

namespace {

constexpr uint64_t kDcpAlign = 64;               // items and tensor data start aligned
constexpr uint64_t kDcpStagingBytes = 8ull << 20;  // private copy, CRC'd then written
constexpr uint16_t kZipVersion = 45;             // 4.5: zip64
constexpr uint16_t kDosDate = (0 << 9) | (1 << 5) | 1;  // 1980-01-01

void Put(std::string* s, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) s->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// A pickle int: BININT1, BININT or an 8-byte LONG1.
void PickleInt(std::string* p, int64_t v) {
  if (v >= 0 && v < 256) {
    p->push_back('K');
    Put(p, static_cast<uint64_t>(v), 1);
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    p->push_back('J');
    Put(p, static_cast<uint64_t>(static_cast<uint32_t>(static_cast<int32_t>(v))), 4);
  } else {
    p->append("\x8a\x08", 2);
    Put(p, static_cast<uint64_t>(v), 8);
  }
}

void PickleText(std::string* p, absl::string_view t) {
  p->push_back('X');  // BINUNICODE
  Put(p, t.size(), 4);
  p->append(t.data(), t.size());
}

void PickleTuple(std::string* p, const Shape& v) {
  p->push_back('(');
  for (int64_t x : v) PickleInt(p, x);
  p->push_back('t');
}

// A local file header; `zip64` entries carry their sizes in a zip64 extra
// field, followed by an "FB" padding field that aligns the data to kDcpAlign
// (archive_at: where the archive starts in the file, itself aligned).
std::string LocalHeader(absl::string_view name, uint32_t crc, uint64_t size, bool zip64,
                        uint64_t header_at) {
  std::string h;
  Put(&h, kLocalSig, 4);
  Put(&h, zip64 ? kZipVersion : 20, 2);
  Put(&h, 0, 2);  // flags
  Put(&h, 0, 2);  // stored
  Put(&h, 0, 2);  // time
  Put(&h, kDosDate, 2);
  Put(&h, crc, 4);
  Put(&h, zip64 ? 0xffffffffu : size, 4);
  Put(&h, zip64 ? 0xffffffffu : size, 4);
  Put(&h, name.size(), 2);
  std::string extra;
  if (zip64) {
    Put(&extra, 0x0001, 2);
    Put(&extra, 16, 2);
    Put(&extra, size, 8);
    Put(&extra, size, 8);
    const uint64_t before = header_at + 30 + name.size() + extra.size() + 4;
    const uint64_t pad = (kDcpAlign - before % kDcpAlign) % kDcpAlign;
    Put(&extra, 0x4246, 2);  // "FB": torch's padding field
    Put(&extra, pad, 2);
    extra.append(pad, 'Z');
  }
  Put(&h, extra.size(), 2);
  h.append(name.data(), name.size());
  h += extra;
  return h;
}

struct CentralEntry {
  std::string name;
  uint32_t crc = 0;
  uint64_t size = 0;
  uint64_t header_offset = 0;  // relative to the archive
  bool zip64 = false;
};

std::string CentralHeader(const CentralEntry& e) {
  std::string h;
  Put(&h, kCentralSig, 4);
  Put(&h, kZipVersion, 2);  // made by
  Put(&h, e.zip64 ? kZipVersion : 20, 2);
  Put(&h, 0, 2);
  Put(&h, 0, 2);
  Put(&h, 0, 2);
  Put(&h, kDosDate, 2);
  Put(&h, e.crc, 4);
  Put(&h, e.zip64 ? 0xffffffffu : e.size, 4);
  Put(&h, e.zip64 ? 0xffffffffu : e.size, 4);
  Put(&h, e.name.size(), 2);
  Put(&h, e.zip64 ? 28 : 0, 2);  // extra
  Put(&h, 0, 2);                 // comment
  Put(&h, 0, 2);                 // disk
  Put(&h, 0, 2);                 // internal attributes
  Put(&h, 0, 4);                 // external attributes
  Put(&h, e.zip64 ? 0xffffffffu : e.header_offset, 4);
  h += e.name;
  if (e.zip64) {
    Put(&h, 0x0001, 2);
    Put(&h, 24, 2);
    Put(&h, e.size, 8);
    Put(&h, e.size, 8);
    Put(&h, e.header_offset, 8);
  }
  return h;
}

// The central directory and the (zip64) end records of an archive whose
// central directory starts at `cd_at` (relative to the archive).
std::string ArchiveTail(const std::vector<CentralEntry>& entries, uint64_t cd_at) {
  std::string t;
  for (const CentralEntry& e : entries) t += CentralHeader(e);
  const uint64_t cd_size = t.size();
  const uint64_t z64_at = cd_at + cd_size;
  Put(&t, kZip64EocdSig, 4);
  Put(&t, 44, 8);
  Put(&t, kZipVersion, 2);
  Put(&t, kZipVersion, 2);
  Put(&t, 0, 4);
  Put(&t, 0, 4);
  Put(&t, entries.size(), 8);
  Put(&t, entries.size(), 8);
  Put(&t, cd_size, 8);
  Put(&t, cd_at, 8);
  Put(&t, kZip64LocatorSig, 4);
  Put(&t, 0, 4);
  Put(&t, z64_at, 8);
  Put(&t, 1, 4);
  Put(&t, kEocdSig, 4);
  Put(&t, 0, 2);
  Put(&t, 0, 2);
  Put(&t, entries.size(), 2);
  Put(&t, entries.size(), 2);
  Put(&t, std::min<uint64_t>(cd_size, 0xffffffffu), 4);
  Put(&t, 0xffffffffu, 4);  // see the zip64 record
  Put(&t, 0, 2);
  return t;
}

uint32_t Crc32(uint32_t crc, const void* p, uint64_t n) {
  return static_cast<uint32_t>(crc32_z(crc, static_cast<const Bytef*>(p), n));
}

}  // namespace

absl::StatusOr<std::string> TorchTensorPickle(DType dtype, const Shape& shape) {
  const char* storage = TorchStorageName(dtype);
  if (storage == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("torch.save has no storage class for dtype ", DTypeName(dtype)));
  }
  CKPT_ASSIGN_OR_RETURN(int64_t nbytes, CheckedNumBytes(shape, DTypeSize(dtype)));
  const int64_t numel = nbytes / static_cast<int64_t>(DTypeSize(dtype));
  Shape stride(shape.size());
  int64_t s = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    stride[d] = s;
    // An empty tensor's other dimensions can be anything CheckedNumBytes let
    // through (its product is 0): the strides must still not overflow.
    if (__builtin_mul_overflow(s, std::max<int64_t>(shape[d], 1), &s)) {
      return absl::InvalidArgumentError(
          absl::StrCat("the strides of shape ", ShapeString(shape), " overflow"));
    }
  }
  std::string p("\x80\x02", 2);  // PROTO 2
  p += "ctorch._utils\n_rebuild_tensor_v2\n";
  p += "((";
  PickleText(&p, "storage");
  p += absl::StrCat("ctorch\n", storage, "\n");
  PickleText(&p, "0");
  PickleText(&p, "cpu");
  PickleInt(&p, numel);
  p += "tQ";  // TUPLE, BINPERSID
  PickleInt(&p, 0);  // storage offset
  PickleTuple(&p, shape);
  PickleTuple(&p, stride);
  p += "\x89";  // NEWFALSE: requires_grad
  p += "ccollections\nOrderedDict\n)R";  // backward hooks: OrderedDict()
  p += "tR.";
  return p;
}

absl::StatusOr<std::vector<DcpItemWritten>> WriteDcpDataFile(
    std::shared_ptr<const Directory> dir, const std::string& name,
    const std::vector<DcpItemToWrite>& items) {
  CKPT_ASSIGN_OR_RETURN(auto w, AtomicFileWriter::CreateIn(std::move(dir), name));
  const std::string path = w->path();
  std::vector<DcpItemWritten> out;
  std::vector<uint8_t> staging;
  auto align = [&]() -> absl::Status {
    const uint64_t pad = (kDcpAlign - w->bytes_written() % kDcpAlign) % kDcpAlign;
    static const char kZeros[kDcpAlign] = {};
    return pad ? w->Append(kZeros, pad) : absl::OkStatus();
  };
  // Appends `n` bytes of `src` through the private staging copy; returns the CRC-32.
  auto copy = [&](const uint8_t* src, uint64_t n, const std::string& what) -> absl::StatusOr<uint32_t> {
    if (n > 0 && src == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": '", what, "' has no data"));
    }
    staging.resize(std::min(n, kDcpStagingBytes));
    uint32_t crc = Crc32(0, nullptr, 0);
    for (uint64_t at = 0; at < n;) {
      const uint64_t m = std::min(kDcpStagingBytes, n - at);
      std::memcpy(staging.data(), src + at, m);
      crc = Crc32(crc, staging.data(), m);
      CKPT_RETURN_IF_ERROR(w->Append(staging.data(), m));
      at += m;
    }
    return crc;
  };
  for (const DcpItemToWrite& it : items) {
    CKPT_RETURN_IF_ERROR(align());
    DcpItemWritten done;
    done.offset = w->bytes_written();
    const uint8_t* src = static_cast<const uint8_t*>(it.data);
    if (it.raw) {
      CKPT_RETURN_IF_ERROR(copy(src, it.nbytes, it.name).status());
      done.length = it.nbytes;
      out.push_back(done);
      continue;
    }
    auto expect = CheckedNumBytes(it.shape, DTypeSize(it.dtype));
    if (!expect.ok() || static_cast<uint64_t>(*expect) != it.nbytes) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", it.name, "' of shape ",
                                                     ShapeString(it.shape), " with ", it.nbytes,
                                                     " bytes"));
    }
    auto pkl = TorchTensorPickle(it.dtype, it.shape);
    if (!pkl.ok()) return Annotate(pkl.status(), absl::StrCat(path, ": tensor '", it.name, "'"));
    const uint64_t a = done.offset;  // archive start
    std::vector<CentralEntry> cd;
    auto add_small = [&](const std::string& entry, absl::string_view bytes) -> absl::Status {
      CentralEntry e{entry, Crc32(0, bytes.data(), bytes.size()), bytes.size(),
                     w->bytes_written() - a, false};
      CKPT_RETURN_IF_ERROR(w->Append(LocalHeader(entry, e.crc, e.size, false, 0)));
      CKPT_RETURN_IF_ERROR(w->Append(bytes));
      cd.push_back(std::move(e));
      return absl::OkStatus();
    };
    // The small entries first: their local headers then sit at offsets under
    // 4 GiB (the central directory records those in 4 bytes), whatever the
    // tensor's size. data.pkl leads: torch.load takes the archive's name from
    // the first entry.
    CKPT_RETURN_IF_ERROR(add_small("archive/data.pkl", *pkl));
    CKPT_RETURN_IF_ERROR(add_small("archive/version", "3\n"));
    CentralEntry data{"archive/data/0", 0, it.nbytes, w->bytes_written() - a, true};
    const uint64_t header_at = w->bytes_written();
    CKPT_RETURN_IF_ERROR(w->Append(LocalHeader(data.name, 0, it.nbytes, true, header_at)));
    CKPT_ASSIGN_OR_RETURN(data.crc, copy(src, it.nbytes, it.name));
    uint8_t crc_le[4];
    for (int i = 0; i < 4; ++i) crc_le[i] = static_cast<uint8_t>(data.crc >> (8 * i));
    CKPT_RETURN_IF_ERROR(w->WriteAt(header_at + 14, crc_le, 4));  // the local header's CRC
    cd.push_back(std::move(data));
    CKPT_RETURN_IF_ERROR(w->Append(ArchiveTail(cd, w->bytes_written() - a)));
    done.length = w->bytes_written() - a;
    out.push_back(done);
  }
  CKPT_RETURN_IF_ERROR(w->Commit());
  return out;
}

}  // namespace ckpt
