// Shared fixtures of the integration tests: a small model, layouts that
// split it over ranks, file helpers.
#ifndef CKPTD_TESTS_INTEGRATION_FIXTURES_H_
#define CKPTD_TESTS_INTEGRATION_FIXTURES_H_

#include <algorithm>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/layout.h"
#include "core/planner.h"
#include "core/safetensors.h"
#include "core/writer.h"
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

// Writes Tensors() with random bytes (from `seed`) to `dir`/model.safetensors.
inline absl::Status WriteModel(const std::string& dir, uint64_t seed) {
  if (absl::Status s = MakeDirs(dir); !s.ok()) return s;
  std::mt19937_64 rng(seed);
  std::vector<std::vector<uint8_t>> data;
  std::vector<TensorToWrite> tw;
  for (const Model& m : Tensors()) {
    data.emplace_back(NumElements(m.shape) * DTypeSize(m.dtype));
    for (auto& b : data.back()) b = static_cast<uint8_t>(rng() & 0x3f);
    tw.push_back({m.name, m.dtype, m.shape, data.back().data()});
  }
  return WriteSafetensors(dir + "/model.safetensors", tw, {}).status();
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
