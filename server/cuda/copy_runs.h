// A strided copy (core/exec/copy.h CopyRegion) cut into 2-D blocks, the shape
// cudaMemcpy2DAsync takes: `height` rows of `width` elements, row r at
// src + r * src_pitch and dst + r * dst_pitch. Offsets and pitches count
// elements, from each layout's first stored element (flat_begin), so the
// same blocks serve copies with a dtype cast. Pure C++ (no CUDA): the device
// delivery issues the blocks; tests check them against CopyRegion.
#ifndef CKPTD_SERVER_CUDA_COPY_RUNS_H_
#define CKPTD_SERVER_CUDA_COPY_RUNS_H_

#include <cstdint>
#include <functional>

#include "core/exec/copy.h"

namespace ckptd::gpu {

struct Block2D {
  int64_t src = 0;
  int64_t dst = 0;
  int64_t width = 0;   // elements per row
  int64_t height = 1;  // rows
  int64_t src_pitch = 0;
  int64_t dst_pitch = 0;
  int64_t elements() const { return width * height; }
};

// Calls `emit` for the blocks covering every element of `region` held by
// both layouts (clipped to both flat ranges), merging rows that continue
// each other. Requires row-major layouts (IsRowMajor). Returns the number of
// elements covered: what CopyRegion would copy.
int64_t ForEachBlock(const ckpt::StoredLayout& src, const ckpt::StoredLayout& dst,
                     const ckpt::Box& region, const std::function<void(const Block2D&)>& emit);

namespace internal {
template <typename L>
auto NonIdentityPerm(const L& l, int) -> decltype(l.perm, bool()) {
  for (size_t i = 0; i < l.perm.size(); ++i) {
    if (l.perm[i] != static_cast<int>(i)) return true;
  }
  return false;
}
template <typename L>
bool NonIdentityPerm(const L&, long) {
  return false;
}
}  // namespace internal

// Whether `layout` stores its box row-major in axis order. Written against
// StoredLayout with or without its optional `perm` (AOA virtual shards):
// a layout with a non-identity perm is not row-major.
inline bool IsRowMajor(const ckpt::StoredLayout& layout) {
  return !internal::NonIdentityPerm(layout, 0);
}

}  // namespace ckptd::gpu

#endif  // CKPTD_SERVER_CUDA_COPY_RUNS_H_
