// Fuzz target: AOA statements (core/plan/aoa.h), which reach the daemon as
// LoadRequest.aoa_config text: ParseAoa, then resolution and planning
// against a fixed checkpoint (fuzz_model.h, examples/tiny-model saved as
// two ranks):
//  1. what PlanLoadWithAoa does for the daemon and ckptctl, step by step
//     (so the statements are resolved once per input, not twice): ResolveAoa
//     with the model of two fixed ranks (a fused qkv and gate_up split by
//     columns, renamed and cast tensors, a flattened lm_head), PlanLoad of
//     those ranks on the virtual metadata, FinishAoaPlan;
//  2. PlanLoad on the same virtual metadata of every tensor the resolution
//     produced (whole on rank 0, the second half of axis 0 on rank 1), and
//     FinishAoaPlan: the virtual shards themselves, whatever the statements
//     made of them.
// Every plan must satisfy CheckPlan (the executor trusts plans).
#include <cstdint>
#include <string>
#include <vector>

#include "core/plan/aoa.h"
#include "core/plan/planner.h"
#include "tests/fuzz/fuzz_model.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using ckpt::Box;
using ckpt::DType;
using ckptd_fuzz::Target;

const std::vector<ckpt::RankTargets>& FixedRanks() {
  static const auto* ranks = [] {
    auto* rs = new std::vector<ckpt::RankTargets>(2);
    for (int r = 0; r < 2; ++r) {
      auto& t = (*rs)[r].tensors;
      (*rs)[r].rank = r;
      t.push_back(Target("layers.0.qkv", DType::kF32, {64, 192}, Box{{0, 96 * r}, {64, 96}}));
      t.push_back(Target("layers.0.gate_up", DType::kF32, {64, 256}, Box{{0, 128 * r}, {64, 128}}));
      t.push_back(Target("embed", DType::kF32, {256, 64}, Box{{128 * r, 0}, {128, 64}}));
      t.push_back(Target("model.norm.weight", DType::kF32, {64}, Box{{0}, {64}}));
      ckpt::TargetTensor lm = Target("lm_head.weight", DType::kBF16, {256, 64}, Box{{0, 0}, {256, 64}});
      lm.flat_range = ckpt::FlatRange{r * 8192, (r + 1) * 8192};
      t.push_back(lm);
      t.push_back(Target("model.layers.1.self_attn.q_proj.weight", DType::kF32, {64, 64},
                         Box{{32 * r, 0}, {32, 64}}));
    }
    return rs;
  }();
  return *ranks;
}

// Rank 0 asks for the whole of each tensor, rank 1 for the second half of
// axis 0 (both in the tensor's dtype); at most `limit` tensors.
std::vector<ckpt::RankTargets> RanksFor(const ckpt::CheckpointMetadata& md, size_t limit) {
  std::vector<ckpt::RankTargets> ranks(2);
  ranks[0].rank = 0;
  ranks[1].rank = 1;
  for (const auto& [name, t] : md.tensors) {
    if (limit-- == 0) break;
    Box whole{ckpt::Shape(t.global_shape.size(), 0), t.global_shape};
    ranks[0].tensors.push_back(Target(name, t.dtype, t.global_shape, whole));
    if (!t.global_shape.empty() && t.global_shape[0] >= 2) {
      Box half = whole;
      half.offset[0] = t.global_shape[0] / 2;
      half.shape[0] = t.global_shape[0] - half.offset[0];
      ranks[1].tensors.push_back(Target(name, t.dtype, t.global_shape, half));
    }
  }
  return ranks;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text = ckptd_fuzz::Str(data, size);
  auto program = ckpt::ParseAoa(text, "fuzz.aoa");
  ckptd_fuzz::Note("ParseAoa", program.status());
  if (!program.ok()) return 0;
  const ckpt::CheckpointMetadata& md = ckptd_fuzz::TinyCheckpoint();

  const auto& ranks = FixedRanks();
  if (program->statements.empty()) {  // PlanLoadWithAoa: a plain load
    auto plan = ckpt::PlanLoad(md, ranks);
    ckptd_fuzz::Note("PlanLoad(no statements)", plan.status());
    if (plan.ok()) ckptd_fuzz::CheckPlan(*plan, ranks, "PlanLoad(no statements)");
    return 0;
  }
  auto res = ckpt::ResolveAoa(*program, md, ckpt::ModelTensorsOf(ranks));
  ckptd_fuzz::Note("ResolveAoa", res.status());
  if (!res.ok()) return 0;

  auto plan = ckpt::PlanLoad(res->metadata, ranks);
  ckptd_fuzz::Note("PlanLoad(model ranks)", plan.status());
  if (plan.ok()) {
    ckpt::FinishAoaPlan(*res, md, &*plan);
    ckptd_fuzz::CheckPlan(*plan, ranks, "PlanLoad(model ranks)");
  }

  const std::vector<ckpt::RankTargets> own = RanksFor(res->metadata, 64);
  auto own_plan = ckpt::PlanLoad(res->metadata, own);
  ckptd_fuzz::Note("PlanLoad(every tensor)", own_plan.status());
  if (own_plan.ok()) {
    ckpt::FinishAoaPlan(*res, md, &*own_plan);
    ckptd_fuzz::CheckPlan(*own_plan, own, "PlanLoad(every tensor)");
  }
  return 0;
}
