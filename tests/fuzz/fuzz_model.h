// The fixed checkpoint the aoa and layout_json fuzz targets plan against,
// and the invariants every plan they get must satisfy.
#ifndef CKPTD_TESTS_FUZZ_FUZZ_MODEL_H_
#define CKPTD_TESTS_FUZZ_FUZZ_MODEL_H_

#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/base/box.h"
#include "core/base/dtype.h"
#include "core/format/metadata.h"
#include "core/plan/planner.h"
#include "tests/fuzz/fuzz_util.h"

namespace ckptd_fuzz {

// examples/tiny-model (a two-layer LLaMA-like model; names and shapes as in
// its safetensors file) saved as two tensor-parallel ranks: tensors of rank
// >= 1 split by rows over 0_1.safetensors and 1_1.safetensors (odd rows
// whole in rank 0's file), plus a gate projection (so fused_ffn has a pair)
// and Adam states of layer 0's projections (so AOA followers have something
// to follow). Checksums every 4 KiB, no data files needed: nothing is read.
inline const ckpt::CheckpointMetadata& TinyCheckpoint() {
  static const ckpt::CheckpointMetadata* md = [] {
    auto* m = new ckpt::CheckpointMetadata;
    m->unique_id = 1;
    m->checksum_block = 4096;
    uint64_t end[2] = {4096, 4096};
    auto add = [&](const std::string& name, ckpt::DType dt, ckpt::Shape shape) {
      ckpt::TensorMeta t;
      t.dtype = dt;
      t.global_shape = shape;
      const int parts = (!shape.empty() && shape[0] % 2 == 0) ? 2 : 1;
      for (int r = 0; r < parts; ++r) {
        ckpt::ShardMeta s;
        s.file = absl::StrCat(r, "_1.safetensors");
        s.dtype = dt;
        s.box.offset.assign(shape.size(), 0);
        s.box.shape = shape;
        if (parts == 2) {
          s.box.shape[0] = shape[0] / 2;
          s.box.offset[0] = r * (shape[0] / 2);
        }
        s.nbytes = ckpt::NumElements(s.box.shape) * ckpt::DTypeSize(dt);
        s.data_offset = end[r];
        end[r] += s.nbytes;
        s.xxh3.assign((s.nbytes + m->checksum_block - 1) / m->checksum_block, 0x1234);
        t.shards.push_back(std::move(s));
      }
      m->tensors[name] = std::move(t);
    };
    using ckpt::DType;
    add("model.embed_tokens.weight", DType::kBF16, {256, 64});
    for (int l = 0; l < 2; ++l) {
      const std::string p = absl::StrCat("model.layers.", l, ".");
      for (const char* w : {"q_proj", "k_proj", "v_proj", "o_proj"}) {
        add(absl::StrCat(p, "self_attn.", w, ".weight"), DType::kF32, {64, 64});
        if (l == 0) {
          add(absl::StrCat(p, "self_attn.", w, ".weight.moment1_0"), DType::kF32, {64, 64});
          add(absl::StrCat(p, "self_attn.", w, ".weight.moment2_0"), DType::kF32, {64, 64});
          add(absl::StrCat(p, "self_attn.", w, ".weight.beta1_pow_acc_0"), DType::kF32, {1});
        }
      }
      add(p + "mlp.gate_proj.weight", DType::kF32, {128, 64});
      add(p + "mlp.up_proj.weight", DType::kF32, {128, 64});
      add(p + "mlp.down_proj.weight", DType::kF32, {64, 128});
      add(p + "input_layernorm.weight", DType::kF32, {64});
    }
    add("model.norm.weight", DType::kF32, {64});
    add("lm_head.weight", DType::kBF16, {256, 64});
    add("step", DType::kI64, {});
    absl::Status s = ckpt::ValidateMetadata(*m, "fuzz_model.h");
    FUZZ_CHECK(s.ok(), s.ToString());
    return m;
  }();
  return *md;
}

inline ckpt::TargetTensor Target(std::string name, ckpt::DType dt, ckpt::Shape global,
                                 ckpt::Box box) {
  ckpt::TargetTensor t;
  t.name = std::move(name);
  t.dtype = dt;
  t.global_shape = std::move(global);
  t.box = std::move(box);
  return t;
}

// What a plan promises the executor, which trusts it (core/plan/planner.h): the
// ranks as requested, copies naming existing targets and reads, regions
// inside both the source box and the target box, each copy's source bytes
// inside its read, reads naming a file of the plan, sorted by file name and
// offset, disjoint.
inline void CheckPlan(const ckpt::LoadPlan& plan, const std::vector<ckpt::RankTargets>& ranks,
                      const char* which) {
  if (Verbose()) std::fprintf(stderr, "  CheckPlan(%s): %zu reads\n", which, plan.reads.size());
  FUZZ_CHECK(plan.ranks.size() == ranks.size(), absl::StrCat(which, ": rank count"));
  for (size_t i = 0; i < plan.reads.size(); ++i) {
    const ckpt::ReadRange& r = plan.reads[i];
    FUZZ_CHECK(r.file < plan.files.size(), absl::StrCat("read ", i, " names file ", r.file));
    FUZZ_CHECK(r.offset + r.length >= r.offset, absl::StrCat("read ", i, " overflows"));
    if (i > 0) {
      const ckpt::ReadRange& p = plan.reads[i - 1];
      // Sorted by file name (file indices are in first-use order), then offset.
      FUZZ_CHECK(plan.files[p.file] < plan.files[r.file] ||
                     (p.file == r.file && p.offset + p.length <= r.offset),
                 absl::StrCat("reads ", i - 1, " (file ", p.file, " [", p.offset, ", +", p.length,
                              ")) and ", i, " (file ", r.file, " [", r.offset, ", +", r.length,
                              ")) unsorted or overlapping"));
    }
  }
  for (size_t k = 0; k < plan.ranks.size(); ++k) {
    const ckpt::RankPlan& rp = plan.ranks[k];
    FUZZ_CHECK(rp.targets.size() == ranks[k].tensors.size(), absl::StrCat("rank ", k, " targets"));
    for (const ckpt::CopyOp& c : rp.copies) {
      const std::string w = absl::StrCat("rank ", k, " copy of target ", c.target, " from read ",
                                         c.read, " region ", ckpt::BoxString(c.region));
      FUZZ_CHECK(c.target < rp.targets.size(), w);
      FUZZ_CHECK(c.read < plan.reads.size(), w);
      const ckpt::TargetTensor& t = rp.targets[c.target];
      FUZZ_CHECK(c.region.rank() == t.box.rank() && ckpt::Contains(t.box, c.region),
                 absl::StrCat(w, ": outside the target box ", ckpt::BoxString(t.box)));
      FUZZ_CHECK(c.region.rank() == c.src.box.rank() && ckpt::Contains(c.src.box, c.region),
                 absl::StrCat(w, ": outside the source box ", ckpt::BoxString(c.src.box)));
      FUZZ_CHECK(c.src.flat_begin >= 0 && c.src.flat_end >= c.src.flat_begin &&
                     c.src.flat_end <= ckpt::NumElements(c.src.box.shape),
                 absl::StrCat(w, ": source flat range"));
      const ckpt::ReadRange& r = plan.reads[c.read];
      const uint64_t n = static_cast<uint64_t>(c.src.num_bytes());
      FUZZ_CHECK(c.src_offset >= r.offset && c.src_offset - r.offset <= r.length &&
                     n <= r.length - (c.src_offset - r.offset),
                 absl::StrCat(w, ": source bytes [", c.src_offset, ", +", n, ") outside read [",
                              r.offset, ", +", r.length, ")"));
    }
  }
}

}  // namespace ckptd_fuzz

#endif  // CKPTD_TESTS_FUZZ_FUZZ_MODEL_H_
