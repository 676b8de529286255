// Strided copy of a box intersection between two row-major buffers.
//
// This is the hot loop of every load: the region is walked as runs that are
// contiguous in both source and destination, trailing axes that are whole in
// both are folded into one run, and neighbouring runs are merged, so a copy
// between matching layouts is one memcpy. Thread-safe (no shared state).
//
//   StoredLayout src{box, 0, NumElements(box.shape), DType::kF32};
//   StoredLayout dst{target_box, 0, NumElements(target_box.shape), DType::kBF16};
//   int64_t n = CopyRegion(src, src_ptr, dst, dst_ptr, *Intersect(box, target_box));
#ifndef CKPTD_CORE_COPY_H_
#define CKPTD_CORE_COPY_H_

#include <cstdint>
#include <vector>

#include "core/base/box.h"
#include "core/base/dtype.h"

namespace ckpt {

// How some elements of a tensor are laid out in a buffer: the elements
// flatten(box)[flat_begin, flat_end) in row-major order, each of `dtype`.
// A plain (non-flattened) shard has flat_begin = 0, flat_end = numel(box).
// The buffer's first byte is element `flat_begin`.
//
// `perm` (optional) gives the storage order of the box's axes: empty means
// row-major over axes 0, 1, ..., rank-1 (every stored shard); otherwise the
// elements are row-major over axes perm[0] (outermost), perm[1], ...,
// perm[rank-1] (innermost), and flat indices count in that order. A shard of
// A (m x n) seen as a box of B = A^T (n x m) has perm = {1, 0}. Only AOA
// virtual shards (core/plan/aoa.h) carry a perm; copies with one take a separate,
// slower path, the identity path is untouched.
struct StoredLayout {
  Box box;
  int64_t flat_begin = 0;
  int64_t flat_end = 0;
  DType dtype = DType::kF32;
  std::vector<int> perm;  // empty: row-major in box axis order

  static StoredLayout Whole(Box box, DType dtype);
  int64_t num_elements() const { return flat_end - flat_begin; }
  int64_t num_bytes() const { return num_elements() * static_cast<int64_t>(DTypeSize(dtype)); }
};

// Same-dtype copies whose destination region is at least this large use
// streaming (non-temporal) stores for runs of at least kStreamingMinRun bytes.
inline constexpr uint64_t kStreamingBytes = 32ull << 20;
inline constexpr size_t kStreamingMinRun = 512;

// memcpy with non-temporal stores (x86-64; plain memcpy elsewhere). Call
// StreamingFence() before other threads may read the destination.
void StreamingCopy(void* dst, const void* src, size_t n);
void StreamingFence();

// Folds the trailing axes that are whole in `region`, `src` and `dst` into
// one contiguous run of `*run` elements; returns k: the outer axes 0..k-1
// step from run to run. `region` has rank >= 1.
size_t FoldTrailingAxes(const StoredLayout& src, const StoredLayout& dst, const Box& region,
                        int64_t* run);

// Whether `perm` is empty or the identity [0, 1, ..., n-1].
bool IsIdentityPerm(const std::vector<int>& perm);

// Copies every element of `region` (global coordinates; must lie inside both
// boxes) that is held by both `src` and `dst` from `src_data` into `dst_data`,
// converting src.dtype -> dst.dtype when they differ (CanConvert must hold).
// Returns the number of elements copied.
int64_t CopyRegion(const StoredLayout& src, const void* src_data, const StoredLayout& dst,
                   void* dst_data, const Box& region);

// One run of an identity-layout copy: `len` elements contiguous in both
// buffers, `src` elements after the source buffer's first element (element
// flat_begin) and `dst` after the destination's.
struct CopyRun {
  int64_t src = 0;
  int64_t dst = 0;
  int64_t len = 0;
};

// Appends the runs CopyRegion would copy, in increasing source (and
// destination) order, to `out`. Returns false and appends nothing when a
// layout carries a permutation or the copy may have more than `max_runs`
// runs (an upper bound is checked before walking).
bool AppendCopyRuns(const StoredLayout& src, const StoredLayout& dst, const Box& region,
                    size_t max_runs, std::vector<CopyRun>* out);

// The elements `layout` holds (its flat range of its box, in storage order)
// as at most 2 * rank - 1 disjoint boxes in global coordinates, in storage
// order (every element of one box comes before every element of the next).
// A layout holding its whole box gives that box; an empty range gives none.
std::vector<Box> HeldBoxes(const StoredLayout& layout);

// Number of elements of `region` held by both layouts (what CopyRegion would
// copy), without touching data. Closed form over HeldBoxes: no walk over the
// region's rows, so a flat range whose covering box is huge costs nothing.
int64_t CountRegion(const StoredLayout& src, const StoredLayout& dst, const Box& region);

// The flat-index span [first, last + 1) of `layout`'s stored elements that
// `region` touches, clipped to [flat_begin, flat_end). Empty (first == last)
// if none. Used to read only the byte range a copy needs. With a perm the
// span counts in storage order.
struct FlatSpan {
  int64_t begin = 0;
  int64_t end = 0;
};
FlatSpan RegionSpan(const StoredLayout& layout, const Box& region);

// The flat-index span of `src`'s stored elements (storage order) from the
// first to the last element of `region` that both `src` and `dst` hold:
// exactly what a copy of `region` from `src` into `dst` reads. Tighter than
// RegionSpan(src, region) when `dst` (or `src`) holds a flat range: the
// covering box of a flat range holds elements the copy never reads. Empty
// if the copy reads nothing.
FlatSpan HeldSpan(const StoredLayout& src, const StoredLayout& dst, const Box& region);

}  // namespace ckpt

#endif  // CKPTD_CORE_COPY_H_
