// AOA values: a tensor as pieces of checkpoint tensors, and the transposes,
// slices and concatenations statements apply to them.
#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/plan/aoa.h"
#include "core/plan/aoa_internal.h"

namespace ckpt {
namespace aoa_internal {




std::string Concrete::Render() const {
  std::vector<std::string> src, dst, opts;
  for (const Source& s : sources) src.push_back(s.transpose ? s.name + "^T" : s.name);
  if (src.empty()) src.push_back("_");
  dst = targets;
  if (dst.empty()) dst.push_back("_");
  if (!plain_rename) {
    if (st->fused == AoaFused::kQkv) opts.push_back("fused_qkv");
    if (st->fused == AoaFused::kFfn) opts.push_back("fused_ffn");
    if (st->axis) opts.push_back(absl::StrCat("axis=", *st->axis));
    if (st->permute) opts.push_back(absl::StrCat("permute='[", absl::StrJoin(*st->permute, ","), "]'"));
    if (st->num_heads) opts.push_back(absl::StrCat("num_heads=", *st->num_heads));
    if (st->num_key_value_groups) {
      opts.push_back(absl::StrCat("num_key_value_groups=", *st->num_key_value_groups));
    }
    if (st->dtype && follows.empty()) opts.push_back(absl::StrCat("dtype='", DTypeName(*st->dtype), "'"));
  }
  std::string out = absl::StrCat(absl::StrJoin(src, ", "), " -> ", absl::StrJoin(dst, ", "));
  if (!opts.empty()) absl::StrAppend(&out, ", ", absl::StrJoin(opts, ", "));
  return out;
}



Value CheckpointValue(const std::string& name, const TensorMeta& t) {
  Value v;
  v.shape = t.global_shape;
  v.dtype = t.dtype;
  Piece p;
  p.tensor = &name;
  p.src_box = Box{Shape(t.global_shape.size(), 0), t.global_shape};
  p.axes.resize(t.global_shape.size());
  std::iota(p.axes.begin(), p.axes.end(), 0);
  p.dst_offset = Shape(t.global_shape.size(), 0);
  v.pieces.push_back(std::move(p));
  return v;
}

// out axis j = in axis perm[j].
Value Permute(const Value& in, const std::vector<int>& perm) {
  Value v;
  v.dtype = in.dtype;
  for (int a : perm) v.shape.push_back(in.shape[a]);
  for (const Piece& p : in.pieces) {
    Piece q;
    q.tensor = p.tensor;
    q.src_box = p.src_box;
    for (int a : perm) {
      q.axes.push_back(p.axes[a]);
      q.dst_offset.push_back(p.dst_offset[a]);
    }
    v.pieces.push_back(std::move(q));
  }
  return v;
}

// [lo, hi) along `axis`.
Value Slice(const Value& in, int axis, int64_t lo, int64_t hi) {
  Value v;
  v.dtype = in.dtype;
  v.shape = in.shape;
  v.shape[axis] = hi - lo;
  for (const Piece& p : in.pieces) {
    const int sa = p.axes[axis];
    const int64_t o = p.dst_offset[axis], len = p.src_box.shape[sa];
    const int64_t a = std::max(o, lo), b = std::min(o + len, hi);
    if (b <= a) continue;
    Piece q = p;
    q.src_box.offset[sa] += a - o;
    q.src_box.shape[sa] = b - a;
    q.dst_offset[axis] = a - lo;
    v.pieces.push_back(std::move(q));
  }
  return v;
}

// Concatenates along `axis`; shapes already checked.
Value Concat(const std::vector<Value>& ins, int axis) {
  Value v;
  v.dtype = ins[0].dtype;
  v.shape = ins[0].shape;
  v.shape[axis] = 0;
  for (const Value& in : ins) {
    for (const Piece& p : in.pieces) {
      Piece q = p;
      q.dst_offset[axis] += v.shape[axis];
      v.pieces.push_back(std::move(q));
    }
    v.shape[axis] += in.shape[axis];
  }
  return v;
}


std::string InsertMasterWeights(const std::string& name) {
  size_t dot = name.find('.');
  if (dot == std::string::npos) return "";
  return absl::StrCat(name.substr(0, dot), ".master_weights", name.substr(dot));
}

const std::vector<FollowerForm>& FollowerForms() {
  static const auto* forms = new std::vector<FollowerForm>{
      {".moment1_0", [](const std::string& n) { return n + ".moment1_0"; }, false},
      {".moment2_0", [](const std::string& n) { return n + ".moment2_0"; }, false},
      {".w_0", [](const std::string& n) { return n + ".w_0"; }, false},
      {"_fp32_master_0", [](const std::string& n) { return n + "_fp32_master_0"; }, false},
      {"master_weights", InsertMasterWeights, false},
      {".beta1_pow_acc_0", [](const std::string& n) { return n + ".beta1_pow_acc_0"; }, true},
      {".beta2_pow_acc_0", [](const std::string& n) { return n + ".beta2_pow_acc_0"; }, true},
  };
  return *forms;
}

}  // namespace aoa_internal
}  // namespace ckpt
