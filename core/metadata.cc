#include "core/metadata.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status_macros.h"

namespace ckpt {
namespace {

using json = nlohmann::json;

absl::Status Bad(const std::string& path, absl::string_view what) {
  return absl::DataLossError(absl::StrCat(path, ": invalid checkpoint metadata: ", what));
}

absl::StatusOr<Shape> ReadShape(const std::string& path, const json& j, absl::string_view what) {
  if (!j.is_array()) return Bad(path, absl::StrCat(what, " is not an array"));
  Shape s;
  for (const json& d : j) {
    if (!d.is_number_integer()) return Bad(path, absl::StrCat(what, " has a non-integer entry"));
    s.push_back(d.get<int64_t>());
  }
  return s;
}

absl::StatusOr<uint64_t> ReadU64(const std::string& path, const json& obj, const char* key,
                                 absl::string_view where) {
  auto it = obj.find(key);
  if (it == obj.end() || !it->is_number_unsigned()) {
    return Bad(path, absl::StrCat(where, ": '", key, "' missing or not a non-negative integer"));
  }
  return it->get<uint64_t>();
}

// One entry of "tensors" (its DOM is freed as soon as it is converted).
absl::StatusOr<TensorMeta> ParseTensor(const std::string& path, const std::string& name,
                                       const json& t) {
  const std::string where = absl::StrCat("tensor '", name, "'");
  if (!t.is_object()) return Bad(path, absl::StrCat(where, " is not an object"));
  TensorMeta tm;
  auto dt = t.find("dtype");
  if (dt == t.end() || !dt->is_string()) return Bad(path, absl::StrCat(where, ": no dtype"));
  auto dtype = ParseDType(dt->get<std::string>());
  if (!dtype.ok()) return Bad(path, absl::StrCat(where, ": ", dtype.status().message()));
  tm.dtype = *dtype;
  auto gs = t.find("global_shape");
  if (gs == t.end()) return Bad(path, absl::StrCat(where, ": no global_shape"));
  CKPT_ASSIGN_OR_RETURN(tm.global_shape, ReadShape(path, *gs, where + " global_shape"));
  auto shards = t.find("shards");
  if (shards == t.end() || !shards->is_array()) {
    return Bad(path, absl::StrCat(where, ": no shards array"));
  }
  for (size_t i = 0; i < shards->size(); ++i) {
    const json& s = (*shards)[i];
    const std::string sw = absl::StrCat(where, " shard ", i);
    if (!s.is_object()) return Bad(path, absl::StrCat(sw, " is not an object"));
    ShardMeta sm;
    auto file = s.find("file");
    if (file == s.end() || !file->is_string()) return Bad(path, absl::StrCat(sw, ": no file"));
    sm.file = file->get<std::string>();
    auto off = s.find("offset");
    auto shp = s.find("shape");
    if (off == s.end() || shp == s.end()) {
      return Bad(path, absl::StrCat(sw, ": needs offset and shape"));
    }
    CKPT_ASSIGN_OR_RETURN(sm.box.offset, ReadShape(path, *off, sw + " offset"));
    CKPT_ASSIGN_OR_RETURN(sm.box.shape, ReadShape(path, *shp, sw + " shape"));
    sm.dtype = tm.dtype;
    if (auto sd = s.find("dtype"); sd != s.end()) {
      if (!sd->is_string()) return Bad(path, absl::StrCat(sw, ": dtype is not a string"));
      auto d = ParseDType(sd->get<std::string>());
      if (!d.ok()) return Bad(path, absl::StrCat(sw, ": ", d.status().message()));
      sm.dtype = *d;
    }
    if (auto fr = s.find("flat_range"); fr != s.end() && !fr->is_null()) {
      if (!fr->is_array() || fr->size() != 2 || !(*fr)[0].is_number_integer() ||
          !(*fr)[1].is_number_integer()) {
        return Bad(path, absl::StrCat(sw, ": flat_range is not [begin, end]"));
      }
      sm.flat_range = FlatRange{(*fr)[0].get<int64_t>(), (*fr)[1].get<int64_t>()};
    }
    if (auto rid = s.find("replica_id"); rid != s.end()) {
      if (!rid->is_number_integer()) return Bad(path, absl::StrCat(sw, ": bad replica_id"));
      sm.replica_id = rid->get<int>();
    }
    CKPT_ASSIGN_OR_RETURN(sm.data_offset, ReadU64(path, s, "data_offset", sw));
    CKPT_ASSIGN_OR_RETURN(sm.nbytes, ReadU64(path, s, "nbytes", sw));
    if (auto x = s.find("xxh3"); x != s.end()) {
      if (!x->is_array()) return Bad(path, absl::StrCat(sw, ": xxh3 is not an array"));
      for (const json& h : *x) {
        const std::string hex = h.is_string() ? h.get<std::string>() : "";
        char* endp = nullptr;
        unsigned long long v = std::strtoull(hex.c_str(), &endp, 16);
        if (hex.empty() || hex.size() > 16 || *endp != '\0') {
          return Bad(path, absl::StrCat(sw, ": xxh3 entry '", hex,
                                        "' is not 1-16 hex digits"));
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
  // Each entry of "tensors" is converted as soon as it is parsed and then
  // dropped from the DOM: a checkpoint with 10^4-10^5 shards never holds the
  // whole document as JSON objects (building and freeing that DOM was most
  // of OpenCheckpoint's time).
  CheckpointMetadata m;
  absl::Status tensor_error;
  std::string top_key, tensor_name;
  bool in_tensors = false;  // inside the "tensors" object
  auto on_event = [&](int depth, json::parse_event_t event, json& parsed) -> bool {
    switch (event) {
      case json::parse_event_t::key:
        if (depth == 1) {
          top_key = parsed.get<std::string>();
          in_tensors = false;
        } else if (depth == 2 && in_tensors) {
          tensor_name = parsed.get<std::string>();
        }
        return true;
      case json::parse_event_t::object_start:
        if (depth == 1 && top_key == "tensors") in_tensors = true;
        return true;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
      case json::parse_event_t::value:
        if (depth == 2 && in_tensors) {
          if (tensor_error.ok()) {
            absl::StatusOr<TensorMeta> tm = ParseTensor(path, tensor_name, parsed);
            if (tm.ok()) {
              m.tensors.insert_or_assign(tensor_name, std::move(*tm));
            } else {
              tensor_error = tm.status();
            }
          }
          return false;
        }
        return true;
      default:
        return true;
    }
  };
  json j;
  try {
    j = json::parse(text, on_event);
  } catch (const json::parse_error& e) {
    return Bad(path, absl::StrCat("not valid JSON: ", e.what()));
  }
  if (!j.is_object()) return Bad(path, "not a JSON object");
  auto fmt = j.find("format");
  if (fmt == j.end() || !fmt->is_string() || fmt->get<std::string>() != kMetadataFormatName) {
    return Bad(path, absl::StrCat("'format' is not \"", kMetadataFormatName, "\""));
  }
  auto ver = j.find("version");
  if (ver == j.end() || !ver->is_number_integer()) return Bad(path, "'version' missing");
  if (ver->get<int64_t>() > kMetadataFormatVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": metadata format version ", ver->get<int64_t>(),
                     " is newer than this ckptd supports (", kMetadataFormatVersion, ")"));
  }
  if (auto cb = j.find("checksum_block"); cb != j.end()) {
    if (!cb->is_number_unsigned() || cb->get<uint64_t>() == 0) {
      return Bad(path, "'checksum_block' must be a positive integer");
    }
    m.checksum_block = cb->get<uint64_t>();
  }
  auto uid = j.find("unique_id");
  if (uid != j.end() && uid->is_number_integer()) m.unique_id = uid->get<int64_t>();
  auto tensors = j.find("tensors");
  if (tensors == j.end() || !tensors->is_object()) return Bad(path, "'tensors' missing");
  CKPT_RETURN_IF_ERROR(tensor_error);
  if (auto fm = j.find("flat_mapping"); fm != j.end() && fm->is_object()) {
    for (auto it = fm->begin(); it != fm->end(); ++it) {
      if (!it.value().is_array()) continue;
      std::vector<std::string> parts;
      for (const json& p : it.value()) {
        if (p.is_string()) parts.push_back(p.get<std::string>());
      }
      m.flat_mapping[it.key()] = std::move(parts);
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
  for (const auto& [name, t] : m.tensors) {
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
      covered += s.num_elements();
      pieces.push_back({std::move(cover), std::move(l), i});
    }
    if (covered != numel) {
      return Bad(where, absl::StrCat(tw, ": replica-0 shards hold ", covered, " elements but ",
                                     ShapeString(t.global_shape), " has ", numel,
                                     covered < numel ? " (incomplete coverage)" : " (overlap)"));
    }
    // Sweep over axis 0 to find overlapping pieces without comparing all pairs.
    if (!t.global_shape.empty() && pieces.size() > 1) {
      std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) {
        return a.cover.offset[0] < b.cover.offset[0];
      });
      std::vector<size_t> active;
      for (size_t i = 0; i < pieces.size(); ++i) {
        const Piece& p = pieces[i];
        size_t keep = 0;
        for (size_t a : active) {
          const Piece& q = pieces[a];
          if (q.cover.offset[0] + q.cover.shape[0] <= p.cover.offset[0]) continue;
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
