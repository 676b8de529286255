#include "core/copy.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace ckpt {
namespace {

// Walks `region` as runs contiguous in both layouts and calls
// emit(src_flat, dst_flat, len) with flat indices relative to each layout's
// box, already clipped to both flat ranges and merged with neighbours.
template <typename Emit>
void ForEachRun(const StoredLayout& src, const StoredLayout& dst, const Box& region, Emit emit) {
  const size_t rank = region.rank();
  if (rank == 0) {
    if (src.flat_begin <= 0 && 0 < src.flat_end && dst.flat_begin <= 0 && 0 < dst.flat_end) {
      emit(0, 0, 1);
    }
    return;
  }
  for (size_t i = 0; i < rank; ++i) {
    if (region.shape[i] == 0) return;
  }
  // Fold trailing axes that are whole in region, src and dst into one run.
  size_t k = rank - 1;
  int64_t run = region.shape[k];
  while (k > 0 && region.shape[k] == src.box.shape[k] && region.shape[k] == dst.box.shape[k]) {
    --k;
    run *= region.shape[k];
  }
  // Outer axes are 0..k-1; axis k and beyond form the run.
  std::vector<int64_t> src_stride(rank), dst_stride(rank);
  int64_t ss = 1, ds = 1;
  for (size_t i = rank; i-- > 0;) {
    src_stride[i] = ss;
    dst_stride[i] = ds;
    ss *= src.box.shape[i];
    ds *= dst.box.shape[i];
  }
  int64_t src_flat = 0, dst_flat = 0;
  for (size_t i = 0; i < rank; ++i) {
    src_flat += (region.offset[i] - src.box.offset[i]) * src_stride[i];
    dst_flat += (region.offset[i] - dst.box.offset[i]) * dst_stride[i];
  }
  const bool clip = src.flat_begin > 0 || dst.flat_begin > 0 ||
                    src.flat_end < NumElements(src.box.shape) ||
                    dst.flat_end < NumElements(dst.box.shape);
  int64_t pend_src = 0, pend_dst = 0, pend_len = 0;
  auto push = [&](int64_t s, int64_t d, int64_t len) {
    if (pend_len > 0 && pend_src + pend_len == s && pend_dst + pend_len == d) {
      pend_len += len;
      return;
    }
    if (pend_len > 0) emit(pend_src, pend_dst, pend_len);
    pend_src = s;
    pend_dst = d;
    pend_len = len;
  };
  std::vector<int64_t> idx(k, 0);
  while (true) {
    if (!clip) {
      push(src_flat, dst_flat, run);
    } else {
      int64_t lo = std::max<int64_t>({0, src.flat_begin - src_flat, dst.flat_begin - dst_flat});
      int64_t hi = std::min<int64_t>({run, src.flat_end - src_flat, dst.flat_end - dst_flat});
      if (hi > lo) push(src_flat + lo, dst_flat + lo, hi - lo);
    }
    // Advance the odometer over the outer axes.
    size_t a = k;
    while (a > 0) {
      --a;
      if (++idx[a] < region.shape[a]) {
        src_flat += src_stride[a];
        dst_flat += dst_stride[a];
        break;
      }
      src_flat -= (region.shape[a] - 1) * src_stride[a];
      dst_flat -= (region.shape[a] - 1) * dst_stride[a];
      idx[a] = 0;
      if (a == 0) {
        if (pend_len > 0) emit(pend_src, pend_dst, pend_len);
        return;
      }
    }
    if (k == 0) {
      if (pend_len > 0) emit(pend_src, pend_dst, pend_len);
      return;
    }
  }
}

}  // namespace

StoredLayout StoredLayout::Whole(Box box, DType dtype) {
  StoredLayout l;
  l.flat_end = NumElements(box.shape);
  l.box = std::move(box);
  l.dtype = dtype;
  return l;
}

int64_t CopyRegion(const StoredLayout& src, const void* src_data, const StoredLayout& dst,
                   void* dst_data, const Box& region) {
  const size_t ssz = DTypeSize(src.dtype), dsz = DTypeSize(dst.dtype);
  const uint8_t* s = static_cast<const uint8_t*>(src_data);
  uint8_t* d = static_cast<uint8_t*>(dst_data);
  int64_t copied = 0;
  if (src.dtype == dst.dtype) {
    ForEachRun(src, dst, region, [&](int64_t sf, int64_t df, int64_t len) {
      std::memcpy(d + (df - dst.flat_begin) * dsz, s + (sf - src.flat_begin) * ssz, len * ssz);
      copied += len;
    });
  } else {
    ForEachRun(src, dst, region, [&](int64_t sf, int64_t df, int64_t len) {
      ConvertElements(s + (sf - src.flat_begin) * ssz, src.dtype, d + (df - dst.flat_begin) * dsz,
                      dst.dtype, static_cast<size_t>(len));
      copied += len;
    });
  }
  return copied;
}

int64_t CountRegion(const StoredLayout& src, const StoredLayout& dst, const Box& region) {
  int64_t n = 0;
  ForEachRun(src, dst, region, [&](int64_t, int64_t, int64_t len) { n += len; });
  return n;
}

FlatSpan RegionSpan(const StoredLayout& layout, const Box& region) {
  const size_t rank = region.rank();
  Shape first(rank), last(rank);
  for (size_t i = 0; i < rank; ++i) {
    if (region.shape[i] == 0) return {};
    first[i] = region.offset[i] - layout.box.offset[i];
    last[i] = first[i] + region.shape[i] - 1;
  }
  int64_t b = Ravel(layout.box.shape, first);
  int64_t e = Ravel(layout.box.shape, last) + 1;
  b = std::max(b, layout.flat_begin);
  e = std::min(e, layout.flat_end);
  if (e <= b) return {};
  return {b, e};
}

}  // namespace ckpt
