#include "core/format/metadata.h"

#include <algorithm>

#include <simdjson.h>

#include <cstdint>
#include <optional>
#include <string_view>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/base/status_macros.h"

namespace ckpt {
namespace {

using json = nlohmann::json;

absl::Status Bad(const std::string& path, absl::string_view what) {
  return absl::DataLossError(absl::StrCat(path, ": invalid checkpoint metadata: ", what));
}

// simdjson's DOM (DESIGN.md: simdjson for hot parsing): ~10x nlohmann's
// parse speed on metadata of 10^4-10^5 shards. nlohmann writes it.
using Element = simdjson::dom::element;
using ElementType = simdjson::dom::element_type;

bool IsInteger(const Element& e) {
  return e.type() == ElementType::INT64 || e.type() == ElementType::UINT64;
}

// A non-negative integer (INT64 >= 0 or UINT64), or nullopt.
std::optional<uint64_t> AsUnsigned(const Element& e) {
  if (e.type() == ElementType::UINT64) return e.get_uint64().value_unsafe();
  if (e.type() == ElementType::INT64 && e.get_int64().value_unsafe() >= 0) {
    return static_cast<uint64_t>(e.get_int64().value_unsafe());
  }
  return std::nullopt;
}

// An integer that fits int64, or nullopt.
std::optional<int64_t> AsSigned(const Element& e) {
  if (e.type() == ElementType::INT64) return e.get_int64().value_unsafe();
  return std::nullopt;
}

// obj[key], or nullopt when absent.
std::optional<Element> Field(const simdjson::dom::object& obj, std::string_view key) {
  Element v;
  if (obj[key].get(v) != simdjson::SUCCESS) return std::nullopt;
  return v;
}

absl::StatusOr<Shape> ReadShape(const std::string& path, const Element& j, absl::string_view what) {
  simdjson::dom::array arr;
  if (j.get(arr) != simdjson::SUCCESS) return Bad(path, absl::StrCat(what, " is not an array"));
  Shape s;
  for (Element d : arr) {
    std::optional<int64_t> v = AsSigned(d);
    if (!v) return Bad(path, absl::StrCat(what, " has a non-integer entry"));
    s.push_back(*v);
  }
  return s;
}

absl::StatusOr<uint64_t> ReadU64(const std::string& path, const simdjson::dom::object& obj,
                                 const char* key, absl::string_view where) {
  std::optional<Element> e = Field(obj, key);
  std::optional<uint64_t> v = e ? AsUnsigned(*e) : std::nullopt;
  if (!v) {
    return Bad(path, absl::StrCat(where, ": '", key, "' missing or not a non-negative integer"));
  }
  return *v;
}

absl::StatusOr<DType> ReadDType(const std::string& path, const Element& e,
                                absl::string_view where) {
  std::string_view text;
  if (e.get(text) != simdjson::SUCCESS) {
    return Bad(path, absl::StrCat(where, ": dtype is not a string"));
  }
  auto d = ParseDType(std::string(text));
  if (!d.ok()) return Bad(path, absl::StrCat(where, ": ", d.status().message()));
  return *d;
}

// One entry of "tensors".
absl::StatusOr<TensorMeta> ParseTensor(const std::string& path, const std::string& name,
                                       const Element& value) {
  const std::string where = absl::StrCat("tensor '", name, "'");
  simdjson::dom::object t;
  if (value.get(t) != simdjson::SUCCESS) return Bad(path, absl::StrCat(where, " is not an object"));
  TensorMeta tm;
  std::optional<Element> dt = Field(t, "dtype");
  if (!dt || !dt->is_string()) return Bad(path, absl::StrCat(where, ": no dtype"));
  CKPT_ASSIGN_OR_RETURN(tm.dtype, ReadDType(path, *dt, where));
  std::optional<Element> gs = Field(t, "global_shape");
  if (!gs) return Bad(path, absl::StrCat(where, ": no global_shape"));
  CKPT_ASSIGN_OR_RETURN(tm.global_shape, ReadShape(path, *gs, where + " global_shape"));
  std::optional<Element> shards_e = Field(t, "shards");
  simdjson::dom::array shards;
  if (!shards_e || shards_e->get(shards) != simdjson::SUCCESS) {
    return Bad(path, absl::StrCat(where, ": no shards array"));
  }
  size_t i = 0;
  for (Element se : shards) {
    const std::string sw = absl::StrCat(where, " shard ", i++);
    simdjson::dom::object s;
    if (se.get(s) != simdjson::SUCCESS) return Bad(path, absl::StrCat(sw, " is not an object"));
    ShardMeta sm;
    std::optional<Element> file = Field(s, "file");
    std::string_view file_name;
    if (!file || file->get(file_name) != simdjson::SUCCESS) {
      return Bad(path, absl::StrCat(sw, ": no file"));
    }
    sm.file = std::string(file_name);
    std::optional<Element> off = Field(s, "offset"), shp = Field(s, "shape");
    if (!off || !shp) return Bad(path, absl::StrCat(sw, ": needs offset and shape"));
    CKPT_ASSIGN_OR_RETURN(sm.box.offset, ReadShape(path, *off, sw + " offset"));
    CKPT_ASSIGN_OR_RETURN(sm.box.shape, ReadShape(path, *shp, sw + " shape"));
    sm.dtype = tm.dtype;
    if (std::optional<Element> sd = Field(s, "dtype")) {
      CKPT_ASSIGN_OR_RETURN(sm.dtype, ReadDType(path, *sd, sw));
    }
    if (std::optional<Element> fr = Field(s, "flat_range"); fr && !fr->is_null()) {
      simdjson::dom::array a;
      std::optional<int64_t> b, e;
      if (fr->get(a) == simdjson::SUCCESS && a.size() == 2) {
        b = AsSigned(a.at(0).value_unsafe());
        e = AsSigned(a.at(1).value_unsafe());
      }
      if (!b || !e) return Bad(path, absl::StrCat(sw, ": flat_range is not [begin, end]"));
      sm.flat_range = FlatRange{*b, *e};
    }
    if (std::optional<Element> rid = Field(s, "replica_id")) {
      std::optional<int64_t> r = AsSigned(*rid);
      if (!r || *r < INT32_MIN || *r > INT32_MAX) {
        return Bad(path, absl::StrCat(sw, ": bad replica_id"));
      }
      sm.replica_id = static_cast<int>(*r);
    }
    CKPT_ASSIGN_OR_RETURN(sm.data_offset, ReadU64(path, s, "data_offset", sw));
    CKPT_ASSIGN_OR_RETURN(sm.nbytes, ReadU64(path, s, "nbytes", sw));
    if (std::optional<Element> x = Field(s, "xxh3")) {
      simdjson::dom::array hs;
      if (x->get(hs) != simdjson::SUCCESS) {
        return Bad(path, absl::StrCat(sw, ": xxh3 is not an array"));
      }
      for (Element h : hs) {
        std::string_view hv;
        const std::string hex = h.get(hv) == simdjson::SUCCESS ? std::string(hv) : "";
        char* endp = nullptr;
        unsigned long long v = std::strtoull(hex.c_str(), &endp, 16);
        if (hex.empty() || hex.size() > 16 || *endp != '\0') {
          return Bad(path, absl::StrCat(sw, ": xxh3 entry '", hex, "' is not 1-16 hex digits"));
        }
        sm.xxh3.push_back(v);
      }
    }
    tm.shards.push_back(std::move(sm));
  }
  return tm;
}

}  // namespace

int64_t ShardMeta::num_elements() const {
  return flat_range ? flat_range->end - flat_range->begin : NumElements(box.shape);
}

StoredLayout ShardMeta::layout() const {
  StoredLayout l;
  l.box = box;
  l.dtype = dtype;
  if (flat_range) {
    l.flat_begin = flat_range->begin;
    l.flat_end = flat_range->end;
  } else {
    l.flat_begin = 0;
    l.flat_end = NumElements(box.shape);
  }
  if (!IsIdentityPerm(perm)) l.perm = perm;
  return l;
}

bool IsPlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

absl::StatusOr<CheckpointMetadata> ParseMetadataJson(const std::string& path,
                                                     const std::string& text) {
  simdjson::dom::parser parser;
  Element root;
  if (auto err = parser.parse(text).get(root); err != simdjson::SUCCESS) {
    return Bad(path, absl::StrCat("not valid JSON: ", simdjson::error_message(err)));
  }
  simdjson::dom::object j;
  if (root.get(j) != simdjson::SUCCESS) return Bad(path, "not a JSON object");
  std::optional<Element> fmt = Field(j, "format");
  std::string_view fmt_text;
  if (!fmt || fmt->get(fmt_text) != simdjson::SUCCESS || fmt_text != kMetadataFormatName) {
    return Bad(path, absl::StrCat("'format' is not \"", kMetadataFormatName, "\""));
  }
  std::optional<Element> ver = Field(j, "version");
  if (!ver || !IsInteger(*ver)) return Bad(path, "'version' missing");
  if (!AsSigned(*ver) || *AsSigned(*ver) > kMetadataFormatVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": metadata format version ", simdjson::to_string(*ver),
                     " is newer than this ckptd supports (", kMetadataFormatVersion, ")"));
  }
  CheckpointMetadata m;
  if (std::optional<Element> cb = Field(j, "checksum_block")) {
    std::optional<uint64_t> v = AsUnsigned(*cb);
    if (!v || *v == 0) return Bad(path, "'checksum_block' must be a positive integer");
    m.checksum_block = *v;
  }
  if (std::optional<Element> uid = Field(j, "unique_id")) {
    if (std::optional<int64_t> v = AsSigned(*uid)) m.unique_id = *v;
  }
  std::optional<Element> tensors_e = Field(j, "tensors");
  simdjson::dom::object tensors;
  if (!tensors_e || tensors_e->get(tensors) != simdjson::SUCCESS) {
    return Bad(path, "'tensors' missing");
  }
  for (simdjson::dom::key_value_pair kv : tensors) {
    std::string name(kv.key);
    CKPT_ASSIGN_OR_RETURN(TensorMeta tm, ParseTensor(path, name, kv.value));
    m.tensors.insert_or_assign(std::move(name), std::move(tm));
  }
  simdjson::dom::object fm;
  if (std::optional<Element> fme = Field(j, "flat_mapping");
      fme && fme->get(fm) == simdjson::SUCCESS) {
    for (simdjson::dom::key_value_pair kv : fm) {
      simdjson::dom::array parts_e;
      if (kv.value.get(parts_e) != simdjson::SUCCESS) continue;
      std::vector<std::string> parts;
      for (Element p : parts_e) {
        std::string_view pv;
        if (p.get(pv) == simdjson::SUCCESS) parts.emplace_back(pv);
      }
      m.flat_mapping[std::string(kv.key)] = std::move(parts);
    }
  }
  CKPT_RETURN_IF_ERROR(ValidateMetadata(m, path));
  return m;
}

std::string MetadataToJson(const CheckpointMetadata& m) {
  json tensors = json::object();
  for (const auto& [name, t] : m.tensors) {
    json shards = json::array();
    for (const ShardMeta& s : t.shards) {
      json js = {{"file", s.file},
                 {"offset", s.box.offset},
                 {"shape", s.box.shape},
                 {"data_offset", s.data_offset},
                 {"nbytes", s.nbytes}};
      if (s.dtype != t.dtype) js["dtype"] = std::string(DTypeName(s.dtype));
      if (s.flat_range) js["flat_range"] = {s.flat_range->begin, s.flat_range->end};
      if (s.replica_id != 0) js["replica_id"] = s.replica_id;
      if (!s.xxh3.empty()) {
        json hs = json::array();
        for (uint64_t h : s.xxh3) hs.push_back(absl::StrFormat("%016x", h));
        js["xxh3"] = std::move(hs);
      }
      shards.push_back(std::move(js));
    }
    tensors[name] = {{"dtype", std::string(DTypeName(t.dtype))},
                     {"global_shape", t.global_shape},
                     {"shards", std::move(shards)}};
  }
  json j = {{"format", kMetadataFormatName},
            {"version", kMetadataFormatVersion},
            {"unique_id", m.unique_id},
            {"checksum_block", m.checksum_block},
            {"tensors", std::move(tensors)}};
  if (!m.flat_mapping.empty()) j["flat_mapping"] = m.flat_mapping;
  return j.dump(1);
}

absl::Status ValidateMetadata(const CheckpointMetadata& m, const std::string& where) {
  for (const auto& entry : m.tensors) {
    const std::string& name = entry.first;
    const TensorMeta& t = entry.second;  // not a structured binding: lambdas below capture it
    const std::string tw = absl::StrCat("tensor '", name, "'");
    CKPT_ASSIGN_OR_RETURN(int64_t numel, [&]() -> absl::StatusOr<int64_t> {
      auto n = CheckedNumBytes(t.global_shape, DTypeSize(t.dtype));
      if (!n.ok()) return Bad(where, absl::StrCat(tw, ": ", n.status().message()));
      return NumElements(t.global_shape);
    }());
    struct Piece {
      Box cover;
      StoredLayout layout;
      size_t index;
    };
    std::vector<Piece> pieces;
    int64_t covered = 0;
    for (size_t i = 0; i < t.shards.size(); ++i) {
      const ShardMeta& s = t.shards[i];
      const std::string sw = absl::StrCat(tw, " shard ", i, " ", BoxString(s.box));
      if (!IsPlainFileName(s.file)) {
        return Bad(where, absl::StrCat(sw, ": file '", s.file,
                                       "' is not a plain file name inside the checkpoint "
                                       "directory"));
      }
      if (s.box.offset.size() != t.global_shape.size() || !InBounds(s.box, t.global_shape)) {
        return Bad(where, absl::StrCat(sw, " lies outside the global shape ",
                                       ShapeString(t.global_shape)));
      }
      int64_t box_numel = NumElements(s.box.shape);
      if (s.flat_range && (s.flat_range->begin < 0 || s.flat_range->end > box_numel ||
                           s.flat_range->begin >= s.flat_range->end)) {
        return Bad(where, absl::StrCat(sw, ": flat_range [", s.flat_range->begin, ", ",
                                       s.flat_range->end, ") is not inside its box of ",
                                       box_numel, " elements"));
      }
      const uint64_t want = static_cast<uint64_t>(s.num_elements()) * DTypeSize(s.dtype);
      if (s.nbytes != want) {
        return Bad(where, absl::StrCat(sw, ": nbytes ", s.nbytes, " but ", s.num_elements(),
                                       " elements of ", DTypeName(s.dtype), " need ", want));
      }
      if (s.data_offset > UINT64_MAX - s.nbytes) {
        return Bad(where, absl::StrCat(sw, ": data_offset + nbytes overflows"));
      }
      const uint64_t blocks = (s.nbytes + m.checksum_block - 1) / m.checksum_block;
      if (!s.xxh3.empty() && s.xxh3.size() != blocks) {
        return Bad(where, absl::StrCat(sw, ": ", s.xxh3.size(), " checksums but ", blocks,
                                       " blocks of ", m.checksum_block, " bytes"));
      }
      if (s.replica_id != 0) continue;
      StoredLayout l = s.layout();
      Box cover = s.box;
      if (s.flat_range) {
        cover = CoveringBox(s.box.shape, s.flat_range->begin, s.flat_range->end);
        for (size_t d = 0; d < cover.rank(); ++d) cover.offset[d] += s.box.offset[d];
      }
      // Checked: five shards of a [2^62] tensor must not wrap around to
      // exactly its size (found by tests/fuzz:metadata_json).
      if (__builtin_add_overflow(covered, s.num_elements(), &covered) || covered > numel) {
        return Bad(where, absl::StrCat(tw, ": replica-0 shards hold more elements than ",
                                       ShapeString(t.global_shape), " has ", numel, " (overlap)"));
      }
      pieces.push_back({std::move(cover), std::move(l), i});
    }
    if (covered != numel) {
      return Bad(where, absl::StrCat(tw, ": replica-0 shards hold ", covered, " elements but ",
                                     ShapeString(t.global_shape), " has ", numel,
                                     covered < numel ? " (incomplete coverage)" : " (overlap)"));
    }
    // Sweep along one axis to find overlapping pieces without comparing all
    // pairs: the axis the shards are cut along most (distinct offsets), so
    // a tensor split by columns sweeps columns (axis 0 would keep every
    // shard active at once: quadratic).
    if (!t.global_shape.empty() && pieces.size() > 1) {
      size_t axis = 0, best = 0;
      std::vector<int64_t> offs(pieces.size());
      for (size_t d = 0; d < t.global_shape.size(); ++d) {
        for (size_t i = 0; i < pieces.size(); ++i) offs[i] = pieces[i].cover.offset[d];
        std::sort(offs.begin(), offs.end());
        const size_t distinct =
            static_cast<size_t>(std::unique(offs.begin(), offs.end()) - offs.begin());
        if (distinct > best) {
          best = distinct;
          axis = d;
        }
      }
      std::sort(pieces.begin(), pieces.end(), [axis](const Piece& a, const Piece& b) {
        return a.cover.offset[axis] < b.cover.offset[axis];
      });
      std::vector<size_t> active;
      for (size_t i = 0; i < pieces.size(); ++i) {
        const Piece& p = pieces[i];
        size_t keep = 0;
        for (size_t a : active) {
          const Piece& q = pieces[a];
          if (q.cover.offset[axis] + q.cover.shape[axis] <= p.cover.offset[axis]) continue;
          active[keep++] = a;
          auto region = Intersect(p.cover, q.cover);
          if (region && CountRegion(p.layout, q.layout, *region) > 0) {
            return Bad(where, absl::StrCat(tw, ": shards ", q.index, " ", BoxString(q.layout.box),
                                           " and ", p.index, " ", BoxString(p.layout.box),
                                           " overlap"));
          }
        }
        active.resize(keep);
        active.push_back(i);
      }
    } else if (t.global_shape.empty() && pieces.size() > 1) {
      return Bad(where, absl::StrCat(tw, ": scalar stored more than once as replica 0"));
    }
  }
  return absl::OkStatus();
}

}  // namespace ckpt
