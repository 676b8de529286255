// Shared by the GPU programs of tests/gpu (built with --config=cuda): the
// device check that makes them skip cleanly, and a small model checkpoint
// (bf16 and f32 tensors) saved with one layout and loaded with another.
#ifndef CKPTD_TESTS_GPU_GPU_TESTLIB_H_
#define CKPTD_TESTS_GPU_GPU_TESTLIB_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/tools/layout.h"
#include "core/tools/offline.h"
#include "core/plan/planner.h"
#include "tests/testing/split.h"
#include "core/format/safetensors.h"
#include "core/write/writer.h"

namespace ckpt::gputest {

// Whether a CUDA device can be used; `why` says why not.
inline bool HaveGpu(std::string* why) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    *why = absl::StrCat("no usable CUDA device (cudaGetDeviceCount: ", cudaGetErrorString(e), ")");
    cudaGetLastError();
    return false;
  }
  if (n == 0) {
    *why = "no CUDA device (cudaGetDeviceCount == 0)";
    return false;
  }
  return true;
}

struct ModelTensor {
  std::string name;
  DType dtype;
  Shape shape;
};

inline const std::vector<ModelTensor>& Model() {
  static const auto* m = new std::vector<ModelTensor>{
      {"embed", DType::kBF16, {1024, 512}},
      {"layers.0.w", DType::kBF16, {768, 512}},
      {"layers.0.proj", DType::kF32, {512, 768}},
      {"layers.0.bias", DType::kF32, {768}},
      {"opt.layers.0.proj.m", DType::kF32, {512, 768}},
  };
  return *m;
}

inline TargetTensor Target(const ModelTensor& m, DType dt, Box box) {
  return TargetTensor{m.name, dt, m.shape, std::move(box), std::nullopt};
}

inline Box Split(const Shape& global, size_t d, int world, int r) {
  return ::ckpt::testing::BalancedSplit(global, d, world, r);
}

// Saved: 4 ranks, every matrix split along dim 0, the bias replicated.
inline Layout SaveLayout() {
  Layout l;
  l.world_size = 4;
  for (int r = 0; r < 4; ++r) {
    RankTargets rt{r, {}};
    for (const auto& m : Model()) {
      Box b = m.shape.size() == 1 ? Box{{0}, m.shape} : Split(m.shape, 0, 4, r);
      rt.tensors.push_back(Target(m, m.dtype, b));
    }
    l.ranks.push_back(rt);
  }
  return l;
}

// Loaded: `world` ranks, bf16 matrices resharded along dim 1 (strided copies),
// the f32 projection cast to bf16, the optimizer state as flat (ZeRO) ranges,
// the bias whole.
inline Layout LoadLayout(int world) {
  Layout l;
  l.world_size = world;
  for (int r = 0; r < world; ++r) {
    RankTargets rt{r, {}};
    for (const auto& m : Model()) {
      if (m.shape.size() == 1) {
        rt.tensors.push_back(Target(m, m.dtype, Box{{0}, m.shape}));
      } else if (m.name.rfind("opt.", 0) == 0) {
        TargetTensor t = Target(m, m.dtype, Box{{0, 0}, m.shape});
        const int64_t n = NumElements(m.shape), chunk = (n + world - 1) / world;
        t.flat_range = FlatRange{std::min(n, r * chunk), std::min(n, (r + 1) * chunk)};
        if (t.flat_range->begin < t.flat_range->end) rt.tensors.push_back(t);
      } else if (m.dtype == DType::kF32) {
        rt.tensors.push_back(Target(m, DType::kBF16, Split(m.shape, 1, world, r)));
      } else {
        rt.tensors.push_back(Target(m, m.dtype, Split(m.shape, 1, world, r)));
      }
    }
    l.ranks.push_back(rt);
  }
  return l;
}

// Writes `model` (deterministic finite values) as a HuggingFace file in
// `src` and shards it with `save` into a native checkpoint in `out`.
inline absl::Status MakeCheckpointOf(const std::vector<ModelTensor>& model, const Layout& save,
                                     const std::string& src, const std::string& out) {
  if (absl::Status s = MakeDirs(src); !s.ok()) return s;
  std::mt19937_64 rng(42);
  std::vector<std::vector<uint8_t>> data;
  data.reserve(model.size());
  std::vector<TensorToWrite> tw;
  for (const auto& m : model) {
    data.emplace_back(NumElements(m.shape) * DTypeSize(m.dtype));
    for (auto& b : data.back()) b = static_cast<uint8_t>(rng() & 0x3f);  // finite values
    tw.push_back({m.name, m.dtype, m.shape, data.back().data()});
  }
  auto w = WriteSafetensors(src + "/model.safetensors", tw, {});
  if (!w.ok()) return w.status();
  return ShardCheckpoint(src, save, out, {});
}

// The small model, saved with SaveLayout().
inline absl::Status MakeCheckpoint(const std::string& src, const std::string& out) {
  return MakeCheckpointOf(Model(), SaveLayout(), src, out);
}

}  // namespace ckpt::gputest

#endif  // CKPTD_TESTS_GPU_GPU_TESTLIB_H_
