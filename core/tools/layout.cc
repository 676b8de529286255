#include "core/tools/layout.h"

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "core/io/file.h"
#include "core/base/status_macros.h"

namespace ckpt {
namespace {

using json = nlohmann::json;

absl::Status Bad(const std::string& path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": invalid layout: ", what));
}

absl::StatusOr<Shape> IntArray(const std::string& path, const json& j, const std::string& what) {
  if (!j.is_array()) return Bad(path, absl::StrCat(what, " is not an array of integers"));
  Shape s;
  for (const json& v : j) {
    if (!v.is_number_integer()) return Bad(path, absl::StrCat(what, " has a non-integer entry"));
    s.push_back(v.get<int64_t>());
  }
  return s;
}

}  // namespace

namespace {
absl::StatusOr<Layout> ParseLayoutJson(const std::string& path, const std::string& text);
}  // namespace

absl::StatusOr<Layout> ParseLayout(const std::string& path, const std::string& text) {
  // Every type is checked before it is read; a json::exception that still
  // escapes is a bad file, never a crash.
  try {
    return ParseLayoutJson(path, text);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": unexpected JSON: ", e.what()));
  }
}

namespace {
absl::StatusOr<Layout> ParseLayoutJson(const std::string& path, const std::string& text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    return Bad(path, absl::StrCat("not valid JSON: ", e.what()));
  }
  if (!j.is_object()) return Bad(path, "not a JSON object");
  auto ws = j.find("world_size");
  if (ws == j.end() || !ws->is_number_integer() || ws->get<int64_t>() < 1 ||
      ws->get<int64_t>() > (1 << 20)) {
    return Bad(path, "'world_size' must be an integer in [1, 2^20]");
  }
  Layout layout;
  layout.world_size = ws->get<int>();
  layout.ranks.resize(layout.world_size);
  std::vector<bool> seen(layout.world_size, false);
  auto ranks = j.find("ranks");
  if (ranks == j.end() || !ranks->is_array()) return Bad(path, "'ranks' must be an array");
  for (const json& r : *ranks) {
    if (!r.is_object() || !r.contains("rank") || !r["rank"].is_number_integer()) {
      return Bad(path, "every entry of 'ranks' needs an integer 'rank'");
    }
    int64_t rank = r["rank"].get<int64_t>();
    if (rank < 0 || rank >= layout.world_size) {
      return Bad(path, absl::StrCat("rank ", rank, " is outside world_size ", layout.world_size));
    }
    if (seen[rank]) return Bad(path, absl::StrCat("rank ", rank, " appears twice"));
    seen[rank] = true;
    RankTargets& rt = layout.ranks[rank];
    rt.rank = static_cast<int>(rank);
    auto tensors = r.find("tensors");
    if (tensors == r.end()) continue;
    if (!tensors->is_array()) return Bad(path, absl::StrCat("rank ", rank, ": 'tensors' not an array"));
    for (const json& t : *tensors) {
      // Checked before anything reads it: json::value() throws on a
      // non-object or a non-string name (found by tests/fuzz:layout_json).
      if (!t.is_object() || !t.contains("name") || !t["name"].is_string()) {
        return Bad(path, absl::StrCat("rank ", rank, ": a tensor has no string 'name'"));
      }
      const std::string w =
          absl::StrCat("rank ", rank, " tensor '", t["name"].get<std::string>(), "'");
      TargetTensor tt;
      tt.name = t["name"].get<std::string>();
      if (!t.contains("dtype") || !t["dtype"].is_string()) return Bad(path, w + ": no 'dtype'");
      auto dt = ParseDType(t["dtype"].get<std::string>());
      if (!dt.ok()) return Bad(path, absl::StrCat(w, ": ", dt.status().message()));
      tt.dtype = *dt;
      if (!t.contains("global_shape")) return Bad(path, w + ": no 'global_shape'");
      CKPT_ASSIGN_OR_RETURN(tt.global_shape, IntArray(path, t["global_shape"], w + " global_shape"));
      if (t.contains("offset")) {
        CKPT_ASSIGN_OR_RETURN(tt.box.offset, IntArray(path, t["offset"], w + " offset"));
      } else {
        tt.box.offset.assign(tt.global_shape.size(), 0);
      }
      if (t.contains("shape")) {
        CKPT_ASSIGN_OR_RETURN(tt.box.shape, IntArray(path, t["shape"], w + " shape"));
      } else {
        tt.box.shape = tt.global_shape;
      }
      if (t.contains("flat_range") && !t["flat_range"].is_null()) {
        CKPT_ASSIGN_OR_RETURN(Shape fr, IntArray(path, t["flat_range"], w + " flat_range"));
        if (fr.size() != 2) return Bad(path, w + ": flat_range must be [start, stop]");
        tt.flat_range = FlatRange{fr[0], fr[1]};
      }
      absl::Status s = ValidateTarget(static_cast<int>(rank), tt);
      if (!s.ok()) return Bad(path, s.message());
      rt.tensors.push_back(std::move(tt));
    }
  }
  for (int r = 0; r < layout.world_size; ++r) {
    if (!seen[r]) {
      return Bad(path, absl::StrCat("rank ", r, " of world_size ", layout.world_size,
                                    " is missing"));
    }
  }
  return layout;
}
}  // namespace

absl::StatusOr<Layout> ReadLayoutFile(const std::string& path) {
  CKPT_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, 1ull << 30));
  return ParseLayout(path, text);
}

std::string LayoutToJson(const Layout& layout) {
  json ranks = json::array();
  for (const RankTargets& rt : layout.ranks) {
    json tensors = json::array();
    for (const TargetTensor& t : rt.tensors) {
      json jt = {{"name", t.name},
                 {"dtype", std::string(DTypeName(t.dtype))},
                 {"global_shape", t.global_shape},
                 {"offset", t.box.offset},
                 {"shape", t.box.shape}};
      if (t.flat_range) jt["flat_range"] = {t.flat_range->begin, t.flat_range->end};
      tensors.push_back(std::move(jt));
    }
    ranks.push_back({{"rank", rt.rank}, {"tensors", std::move(tensors)}});
  }
  return json{{"world_size", layout.world_size}, {"ranks", std::move(ranks)}}.dump(1);
}

}  // namespace ckpt
