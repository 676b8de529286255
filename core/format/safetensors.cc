#include "core/format/safetensors.h"

#include <algorithm>
#include <cstring>

#include <simdjson.h>

#include <optional>
#include <string_view>

#include <nlohmann/json.hpp>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/base/xxh3.h"

namespace ckpt {
namespace {

using json = nlohmann::json;

constexpr uint64_t kDataAlignment = 4096;

absl::Status Corrupt(const std::string& path, absl::string_view what) {
  return absl::DataLossError(absl::StrCat(path, ": invalid safetensors file: ", what));
}

}  // namespace

const SafetensorsTensor* SafetensorsHeader::Find(const std::string& name) const {
  for (const auto& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

absl::StatusOr<SafetensorsHeader> ReadSafetensorsHeader(const RandomAccessFile& file) {
  const std::string& path = file.path();
  if (file.size() < 8) {
    return Corrupt(path, absl::StrCat("file is ", file.size(),
                                      " bytes, shorter than the 8-byte header length"));
  }
  uint8_t len_bytes[8];
  CKPT_RETURN_IF_ERROR(file.Read(0, 8, len_bytes));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len_bytes[i];
  if (n > kMaxSafetensorsHeader) {
    return Corrupt(path, absl::StrCat("header length ", n, " exceeds the limit of ",
                                      kMaxSafetensorsHeader, " bytes"));
  }
  if (n > file.size() - 8) {
    return Corrupt(path, absl::StrCat("truncated: header length ", n, " but the file has only ",
                                      file.size() - 8, " bytes after the length field"));
  }
  std::string header(n, '\0');
  CKPT_RETURN_IF_ERROR(file.Read(8, n, header.data()));
  return ParseSafetensorsHeader(path, header, file.size());
}

namespace {

using simdjson::dom::element_type;

// A JSON integer >= 0 (simdjson keeps those under 2^63 as INT64).
std::optional<uint64_t> UnsignedOf(const simdjson::dom::element& e) {
  if (e.type() == element_type::UINT64) return e.get_uint64().value_unsafe();
  if (e.type() == element_type::INT64 && e.get_int64().value_unsafe() >= 0) {
    return static_cast<uint64_t>(e.get_int64().value_unsafe());
  }
  return std::nullopt;
}

// The header's "__metadata__": string values only.
absl::Status ParseHeaderMetadata(const std::string& path, const simdjson::dom::element& v,
                                 std::map<std::string, std::string>* out) {
  simdjson::dom::object md;
  if (v.get(md) != simdjson::SUCCESS) return Corrupt(path, "__metadata__ is not an object");
  for (simdjson::dom::key_value_pair m : md) {
    std::string_view value;
    if (m.value.get(value) != simdjson::SUCCESS) {
      return Corrupt(path, absl::StrCat("__metadata__ value for '", std::string(m.key),
                                        "' is not a string"));
    }
    (*out)[std::string(m.key)] = std::string(value);
  }
  return absl::OkStatus();
}

// One tensor's entry: dtype, shape and data_offsets (relative to the data
// area of `data_len` bytes), its byte count matching dtype and shape.
// begin/end are left relative.
absl::StatusOr<SafetensorsTensor> ParseTensorEntry(const std::string& path,
                                                   const std::string& name,
                                                   const simdjson::dom::element& v,
                                                   uint64_t data_len) {
  const std::string where = absl::StrCat("tensor '", name, "'");
  simdjson::dom::object obj;
  if (v.get(obj) != simdjson::SUCCESS) {
    return Corrupt(path, absl::StrCat(where, " is not an object"));
  }
  std::string_view dt;
  simdjson::dom::array sh, off;
  if (obj["dtype"].get(dt) != simdjson::SUCCESS) {
    return Corrupt(path, absl::StrCat(where, " has no string 'dtype'"));
  }
  if (obj["shape"].get(sh) != simdjson::SUCCESS) {
    return Corrupt(path, absl::StrCat(where, " has no array 'shape'"));
  }
  if (obj["data_offsets"].get(off) != simdjson::SUCCESS || off.size() != 2) {
    return Corrupt(path, absl::StrCat(where, " has no 2-element 'data_offsets'"));
  }
  SafetensorsTensor t;
  t.name = name;
  auto dtype = ParseDType(std::string(dt));
  if (!dtype.ok()) return Corrupt(path, absl::StrCat(where, ": ", dtype.status().message()));
  t.dtype = *dtype;
  for (simdjson::dom::element d : sh) {
    std::optional<uint64_t> x = UnsignedOf(d);
    if (!x) {
      return Corrupt(path, absl::StrCat(where, " has a shape entry that is not a "
                                               "non-negative integer"));
    }
    if (*x > static_cast<uint64_t>(INT64_MAX)) {
      return Corrupt(path, absl::StrCat(where, " has a shape entry over int64"));
    }
    t.shape.push_back(static_cast<int64_t>(*x));
  }
  std::optional<uint64_t> ob = UnsignedOf(off.at(0).value_unsafe());
  std::optional<uint64_t> oe = UnsignedOf(off.at(1).value_unsafe());
  if (!ob || !oe) {
    return Corrupt(path, absl::StrCat(where, " has data_offsets that are not non-negative "
                                             "integers"));
  }
  const uint64_t b = *ob, e = *oe;
  if (e < b) return Corrupt(path, absl::StrCat(where, " has data_offsets end < begin"));
  if (e > data_len) {
    return Corrupt(path, absl::StrCat(where, " has data_offsets [", b, ", ", e,
                                      ") past the end of the data (", data_len,
                                      " bytes): file truncated or offsets wrong"));
  }
  auto nbytes = CheckedNumBytes(t.shape, DTypeSize(t.dtype));
  if (!nbytes.ok()) return Corrupt(path, absl::StrCat(where, ": ", nbytes.status().message()));
  if (static_cast<uint64_t>(*nbytes) != e - b) {
    return Corrupt(path, absl::StrCat(where, " holds ", e - b, " bytes but ", DTypeName(t.dtype),
                                      ShapeString(t.shape), " needs ", *nbytes));
  }
  t.begin = b;
  t.end = e;
  return t;
}

// The tensors tile the data area: sorted by offset, no overlap, no hole.
absl::Status CheckTensorsTile(const std::string& path, SafetensorsHeader& h) {
  const uint64_t data_len = h.file_size - h.data_start;
  std::sort(h.tensors.begin(), h.tensors.end(),
            [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  uint64_t pos = h.data_start;
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    const auto& t = h.tensors[i];
    if (t.begin < pos) {
      return Corrupt(path, absl::StrCat("tensor '", t.name, "' overlaps tensor '",
                                        h.tensors[i - 1].name, "'"));
    }
    if (t.begin > pos) {
      return Corrupt(path, absl::StrCat("hole of ", t.begin - pos, " bytes before tensor '",
                                        t.name, "'"));
    }
    pos = t.end;
  }
  if (pos != h.file_size) {
    return Corrupt(path, absl::StrCat("data area is ", data_len, " bytes but the tensors cover ",
                                      pos - h.data_start));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(const std::string& path,
                                                         const std::string& text,
                                                         uint64_t file_size) {
  SafetensorsHeader h;
  h.file_size = file_size;
  h.data_start = 8 + text.size();
  if (h.data_start > file_size) return Corrupt(path, "header runs past the end of the file");
  const uint64_t data_len = file_size - h.data_start;
  if (text.empty() || text[0] != '{') return Corrupt(path, "header does not start with '{'");
  // simdjson (DESIGN.md: hot header parsing): headers of 10^4-10^5 tensors.
  simdjson::dom::parser parser;
  simdjson::dom::element root;
  if (auto err = parser.parse(text).get(root); err != simdjson::SUCCESS) {
    return Corrupt(path, absl::StrCat("header is not valid JSON: ", simdjson::error_message(err)));
  }
  simdjson::dom::object j;
  if (root.get(j) != simdjson::SUCCESS) return Corrupt(path, "header is not a JSON object");
  absl::flat_hash_set<std::string> names;
  for (simdjson::dom::key_value_pair kv : j) {
    const std::string name(kv.key);
    if (name == "__metadata__") {
      CKPT_RETURN_IF_ERROR(ParseHeaderMetadata(path, kv.value, &h.metadata));
      continue;
    }
    if (!names.insert(name).second) {
      return Corrupt(path, absl::StrCat("tensor '", name, "' appears twice"));
    }
    CKPT_ASSIGN_OR_RETURN(SafetensorsTensor t, ParseTensorEntry(path, name, kv.value, data_len));
    t.begin += h.data_start;
    t.end += h.data_start;
    h.tensors.push_back(std::move(t));
  }
  CKPT_RETURN_IF_ERROR(CheckTensorsTile(path, h));
  return h;
}

namespace {

// Bytes copied, hashed and written at a time.
constexpr uint64_t kStagingBytes = 4ull << 20;

absl::StatusOr<std::vector<WrittenTensor>> WriteSafetensorsTo(
    AtomicFileWriter& writer, const std::vector<TensorToWrite>& tensors,
    const std::map<std::string, std::string>& metadata, uint64_t checksum_block) {
  const std::string& path = writer.path();
  if (checksum_block == 0) return absl::InvalidArgumentError("checksum block must be > 0");
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<WrittenTensor> out;
  absl::flat_hash_set<std::string> names;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    if (t.name == "__metadata__" || !names.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": duplicate or reserved tensor name '", t.name, "'"));
    }
    CKPT_ASSIGN_OR_RETURN(int64_t nbytes, CheckedNumBytes(t.shape, DTypeSize(t.dtype)));
    header[t.name] = {{"dtype", std::string(DTypeName(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + static_cast<uint64_t>(nbytes)}}};
    WrittenTensor w;
    w.name = t.name;
    w.begin = offset;
    w.end = offset + static_cast<uint64_t>(nbytes);
    out.push_back(w);
    offset += static_cast<uint64_t>(nbytes);
  }
  std::string text = header.dump();
  uint64_t total = 8 + text.size();
  uint64_t padded = (total + kDataAlignment - 1) / kDataAlignment * kDataAlignment;
  text.append(padded - total, ' ');
  uint8_t len[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(n >> (8 * i));
  CKPT_RETURN_IF_ERROR(writer.Append(len, 8));
  CKPT_RETURN_IF_ERROR(writer.Append(text));
  std::vector<uint8_t> staging;
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(),
                                                                 &XXH3_freeState);
  if (state == nullptr) return absl::ResourceExhaustedError("out of memory (XXH3 state)");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t nbytes = out[i].end - out[i].begin;
    out[i].begin += padded;
    out[i].end += padded;
    const uint8_t* src = static_cast<const uint8_t*>(tensors[i].data);
    if (nbytes > 0 && src == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor '", tensors[i].name, "' has no data"));
    }
    if (staging.size() < std::min(nbytes, kStagingBytes)) {
      staging.resize(std::min(nbytes, kStagingBytes));
    }
    // Block by block; each block in staging-sized pieces: copy, hash the
    // copy, write the copy.
    for (uint64_t block = 0; block < nbytes; block += checksum_block) {
      const uint64_t block_end = std::min(nbytes, block + checksum_block);
      XXH3_64bits_reset(state.get());
      for (uint64_t at = block; at < block_end;) {
        const uint64_t m = std::min(kStagingBytes, block_end - at);
        std::memcpy(staging.data(), src + at, m);
        XXH3_64bits_update(state.get(), staging.data(), m);
        CKPT_RETURN_IF_ERROR(writer.Append(staging.data(), m));
        at += m;
      }
      out[i].xxh3.push_back(XXH3_64bits_digest(state.get()));
    }
  }
  CKPT_RETURN_IF_ERROR(writer.Commit());
  return out;
}

}  // namespace

absl::StatusOr<std::vector<WrittenTensor>> WriteSafetensors(
    const std::string& path, const std::vector<TensorToWrite>& tensors,
    const std::map<std::string, std::string>& metadata, uint64_t checksum_block) {
  CKPT_ASSIGN_OR_RETURN(auto writer, AtomicFileWriter::Create(path));
  return WriteSafetensorsTo(*writer, tensors, metadata, checksum_block);
}

absl::StatusOr<std::vector<WrittenTensor>> WriteSafetensorsIn(
    std::shared_ptr<const Directory> dir, const std::string& name,
    const std::vector<TensorToWrite>& tensors, const std::map<std::string, std::string>& metadata,
    uint64_t checksum_block) {
  CKPT_ASSIGN_OR_RETURN(auto writer, AtomicFileWriter::CreateIn(std::move(dir), name));
  return WriteSafetensorsTo(*writer, tensors, metadata, checksum_block);
}

}  // namespace ckpt
