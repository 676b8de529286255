// Shared fixtures of the integration tests: a small model, layouts that
// split it over ranks, file helpers.
#ifndef CKPTD_TESTS_INTEGRATION_FIXTURES_H_
#define CKPTD_TESTS_INTEGRATION_FIXTURES_H_

#include <algorithm>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/tools/layout.h"
#include "core/plan/planner.h"
#include "core/format/safetensors.h"
#include "core/write/writer.h"
#include "gtest/gtest.h"
#include "tests/testing/files.h"
#include "tests/testing/split.h"

namespace ckpt {

using ckpt::testing::Slurp;

inline TargetTensor T(const std::string& name, DType dt, Shape global, Shape off, Shape shape) {
  return TargetTensor{name, dt, std::move(global), Box{std::move(off), std::move(shape)},
                      std::nullopt};
}

// Splits dim `d` of `global` over `world` ranks (balanced_split).
inline Box Split(const Shape& global, size_t d, int world, int r) {
  return ::ckpt::testing::BalancedSplit(global, d, world, r);
}

struct Model {
  std::string name;
  DType dtype;
  Shape shape;
};

inline const std::vector<Model>& Tensors() {
  static const auto* m = new std::vector<Model>{
      {"embed", DType::kBF16, {512, 256}},
      {"layers.0.w", DType::kF32, {256, 512}},
      {"layers.1.w", DType::kF32, {256, 512}},
      {"layers.0.bias", DType::kF32, {512}},
      {"opt.layers.0.w.moment1_0", DType::kF32, {256, 512}},
  };
  return *m;
}

// The full tensors of Tensors() with random bytes from `seed`, by name:
// what WriteModel writes, kept in memory as the tests' source of truth.
// Every byte is below 0x40, so a byte 0xA5 (the poison the tests fill
// destination buffers with) is never a value the model holds.
using FullModel = std::map<std::string, std::vector<uint8_t>>;
inline FullModel ModelData(uint64_t seed) {
  std::mt19937_64 rng(seed);
  FullModel full;
  for (const Model& m : Tensors()) {
    std::vector<uint8_t>& data = full[m.name];
    data.resize(NumElements(m.shape) * DTypeSize(m.dtype));
    for (auto& b : data) b = static_cast<uint8_t>(rng() & 0x3f);  // no NaNs
  }
  return full;
}

// Writes ModelData(seed) to `dir`/model.safetensors.
inline absl::Status WriteModel(const std::string& dir, uint64_t seed) {
  if (absl::Status s = MakeDirs(dir); !s.ok()) return s;
  const FullModel full = ModelData(seed);
  std::vector<TensorToWrite> tw;
  for (const Model& m : Tensors()) tw.push_back({m.name, m.dtype, m.shape, full.at(m.name).data()});
  return WriteSafetensors(dir + "/model.safetensors", tw, {}).status();
}

// The poison byte destination buffers are filled with before a load
// (ckptctl --fill_byte=165): an element never written shows as 0xA5...
inline constexpr uint8_t kPoison = 0xA5;

// Where the value of element `global_index` of target tensor `name` comes
// from: a tensor of the FullModel and the row-major element index in it.
struct SourceElement {
  std::string tensor;
  int64_t index = 0;
};
using SourceOf = std::function<SourceElement(const std::string& name, const Shape& global_index)>;

inline int64_t RowMajorIndex(const Shape& shape, const Shape& index) {
  int64_t flat = 0;
  for (size_t d = 0; d < shape.size(); ++d) flat = flat * shape[d] + index[d];
  return flat;
}

// The plain oracle: element i of a target is element i of the same-named
// full tensor.
inline SourceElement SameElement(const std::string& name, const Shape& global_index) {
  for (const Model& m : Tensors()) {
    if (m.name == name) return {name, RowMajorIndex(m.shape, global_index)};
  }
  return {name, -1};
}

// The oracle's bytes of target `t`: every element of its box (or of its
// flat range of the box), in row-major order, taken from the element
// `source_of` names in `full` by the global index directly (no planner).
// Empty if the oracle has no such source element.
inline std::vector<uint8_t> OracleBytes(const TargetTensor& t, const FullModel& full,
                                        const SourceOf& source_of = SameElement) {
  const int64_t begin = t.flat_range ? t.flat_range->begin : 0;
  const int64_t end = t.flat_range ? t.flat_range->end : NumElements(t.box.shape);
  const size_t item = DTypeSize(t.dtype);
  std::vector<uint8_t> out((end - begin) * item);
  Shape global(t.box.shape.size(), 0);
  for (int64_t k = begin; k < end; ++k) {
    int64_t rest = k;  // unravel k over the box, row-major
    for (size_t d = t.box.shape.size(); d-- > 0;) {
      global[d] = t.box.offset[d] + rest % t.box.shape[d];
      rest /= t.box.shape[d];
    }
    const SourceElement src = source_of(t.name, global);
    auto it = full.find(src.tensor);
    if (it == full.end() || src.index < 0 ||
        static_cast<uint64_t>(src.index + 1) * item > it->second.size()) {
      return {};
    }
    std::memcpy(out.data() + (k - begin) * item, it->second.data() + src.index * item, item);
  }
  return out;
}

// Compares `n` bytes at `have` with the oracle's bytes of `t` element by
// element; the failure counts the wrong elements and those still holding
// the poison (never written) and names the first one's global index.
inline ::testing::AssertionResult MatchesOracle(const uint8_t* have, uint64_t n,
                                                const TargetTensor& t, const FullModel& full,
                                                const SourceOf& source_of = SameElement) {
  const std::vector<uint8_t> want = OracleBytes(t, full, source_of);
  if (want.empty() && t.num_bytes() != 0) {
    return ::testing::AssertionFailure() << "oracle: no source for tensor " << t.name;
  }
  if (n != want.size()) {
    return ::testing::AssertionFailure() << "tensor " << t.name << ": " << n
                                         << " bytes, the oracle has " << want.size();
  }
  const size_t item = DTypeSize(t.dtype);
  const int64_t begin = t.flat_range ? t.flat_range->begin : 0;
  int64_t wrong = 0, poisoned = 0, first = -1;
  bool first_poisoned = false;
  for (size_t e = 0; e * item < n; ++e) {
    if (std::memcmp(want.data() + e * item, have + e * item, item) == 0) continue;
    ++wrong;
    bool all_poison = true;
    for (size_t b = 0; b < item; ++b) all_poison = all_poison && have[e * item + b] == kPoison;
    poisoned += all_poison;
    if (first < 0) first = static_cast<int64_t>(e), first_poisoned = all_poison;
  }
  if (wrong == 0) return ::testing::AssertionSuccess();
  std::string where;
  int64_t rest = begin + first;
  Shape global(t.box.shape.size(), 0);
  for (size_t d = t.box.shape.size(); d-- > 0;) {
    global[d] = t.box.offset[d] + rest % t.box.shape[d];
    rest /= t.box.shape[d];
  }
  for (size_t d = 0; d < global.size(); ++d) where += (d ? "," : "") + std::to_string(global[d]);
  return ::testing::AssertionFailure()
         << "tensor " << t.name << ": " << wrong << " of " << n / item
         << " elements differ from the oracle (" << poisoned
         << " never written: still poison); the first at global index (" << where << ") "
         << (first_poisoned ? "was never written" : "has a wrong value");
}

// The element-wise oracle, independent of the planner and executor: reads
// `out_dir`/rank<r>.safetensors (what ckptctl load --out writes) and checks
// that it holds exactly the targets of `rt` (flattened ones as 1-D tensors
// of their range) with every element equal to the oracle's (OracleBytes).
inline ::testing::AssertionResult RankMatchesOracle(const std::string& out_dir,
                                                     const RankTargets& rt, const FullModel& full,
                                                     const SourceOf& source_of = SameElement) {
  const std::string path = out_dir + "/rank" + std::to_string(rt.rank) + ".safetensors";
  const std::string file = Slurp(path);
  if (file.size() < 8) return ::testing::AssertionFailure() << path << ": missing or short";
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(file[i]);
  if (n > file.size() - 8) return ::testing::AssertionFailure() << path << ": bad header length";
  auto header = ParseSafetensorsHeader(path, file.substr(8, n), file.size());
  if (!header.ok()) return ::testing::AssertionFailure() << header.status();
  if (header->tensors.size() != rt.tensors.size()) {
    return ::testing::AssertionFailure() << path << ": " << header->tensors.size()
                                         << " tensors, expected " << rt.tensors.size();
  }
  for (const TargetTensor& t : rt.tensors) {
    const SafetensorsTensor* st = header->Find(t.name);
    if (st == nullptr) return ::testing::AssertionFailure() << path << ": no tensor " << t.name;
    const Shape want_shape = t.flat_range ? Shape{t.num_elements()} : t.box.shape;
    if (st->dtype != t.dtype || st->shape != want_shape) {
      return ::testing::AssertionFailure() << path << ": tensor " << t.name
                                           << " has the wrong dtype or shape";
    }
    ::testing::AssertionResult r =
        MatchesOracle(reinterpret_cast<const uint8_t*>(file.data()) + st->begin,
                      st->end - st->begin, t, full, source_of);
    if (!r) return ::testing::AssertionFailure() << path << ": " << r.message();
  }
  return ::testing::AssertionSuccess();
}

// RankMatchesOracle for every rank of `layout`.
inline ::testing::AssertionResult LayoutMatchesOracle(const std::string& out_dir,
                                                       const Layout& layout, const FullModel& full,
                                                       const SourceOf& source_of = SameElement) {
  for (const RankTargets& rt : layout.ranks) {
    ::testing::AssertionResult r = RankMatchesOracle(out_dir, rt, full, source_of);
    if (!r) return r;
  }
  return ::testing::AssertionSuccess();
}

inline Layout MakeLayout(int world, size_t dim, bool flatten_optimizer) {
  Layout l;
  l.world_size = world;
  for (int r = 0; r < world; ++r) {
    RankTargets rt{r, {}};
    for (const Model& m : Tensors()) {
      if (m.shape.size() == 1) {  // replicated
        rt.tensors.push_back(T(m.name, m.dtype, m.shape, {0}, m.shape));
        continue;
      }
      if (flatten_optimizer && m.name.rfind("opt.", 0) == 0) {  // ZeRO-style flat shards
        TargetTensor t = T(m.name, m.dtype, m.shape, {0, 0}, m.shape);
        int64_t n = NumElements(m.shape), chunk = (n + world - 1) / world;
        t.flat_range = FlatRange{std::min(n, r * chunk), std::min(n, (r + 1) * chunk)};
        if (t.flat_range->begin < t.flat_range->end) rt.tensors.push_back(t);
        continue;
      }
      Box b = Split(m.shape, std::min(dim, m.shape.size() - 1), world, r);
      rt.tensors.push_back(T(m.name, m.dtype, m.shape, b.offset, b.shape));
    }
    l.ranks.push_back(rt);
  }
  return l;
}

}  // namespace ckpt

#endif  // CKPTD_TESTS_INTEGRATION_FIXTURES_H_
