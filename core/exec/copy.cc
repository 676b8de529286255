#include "core/exec/copy.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

namespace ckpt {
namespace {

// One step of an odometer over `n` axes of `region` (position n-1 is the
// fastest; position p is axis axis_of(p)): bumps idx[p] and moves both flat
// positions by the axes' strides. False once every index wrapped to 0.
template <typename AxisOf>
inline bool OdometerStep(size_t n, AxisOf axis_of, const Box& region, int64_t* idx,
                         const int64_t* ss, const int64_t* ds, int64_t& src_flat,
                         int64_t& dst_flat) {
  for (size_t p = n; p-- > 0;) {
    const size_t a = static_cast<size_t>(axis_of(p));
    if (++idx[p] < region.shape[a]) {
      src_flat += ss[a];
      dst_flat += ds[a];
      return true;
    }
    src_flat -= (region.shape[a] - 1) * ss[a];
    dst_flat -= (region.shape[a] - 1) * ds[a];
    idx[p] = 0;
  }
  return false;
}


// Appends to `out` (storage coordinates relative to the layout's box: pairs
// of offset, shape) boxes covering the flat positions [b, e) of a row-major
// array of shape s, whose axes before `d` are fixed at prefix[0..d-1]. At
// most 2 * (s.size() - d) - 1 boxes, in flat order.
void SplitFlatRange(const Shape& s, size_t d, int64_t b, int64_t e, Shape& prefix,
                    std::vector<std::pair<Shape, Shape>>* out) {
  if (b >= e) return;
  const size_t r = s.size();
  auto block = [&](int64_t lo, int64_t hi) {
    Shape off(r, 0), shp(r, 1);
    for (size_t k = 0; k < d; ++k) off[k] = prefix[k];
    off[d] = lo;
    shp[d] = hi - lo;
    for (size_t k = d + 1; k < r; ++k) shp[k] = s[k];
    out->emplace_back(std::move(off), std::move(shp));
  };
  int64_t inner = 1;
  for (size_t k = d + 1; k < r; ++k) inner *= s[k];
  if (inner <= 0) return;
  int64_t b0 = b / inner;
  const int64_t br = b % inner, e0 = e / inner, er = e % inner;
  if (b0 == e0) {
    prefix[d] = b0;
    SplitFlatRange(s, d + 1, br, er, prefix, out);
    return;
  }
  if (br != 0) {
    prefix[d] = b0;
    SplitFlatRange(s, d + 1, br, inner, prefix, out);
    ++b0;
  }
  if (e0 > b0) block(b0, e0);
  if (er != 0) {
    prefix[d] = e0;
    SplitFlatRange(s, d + 1, 0, er, prefix, out);
  }
}

bool ClipsFlatRange(const StoredLayout& l) {
  return l.flat_begin > 0 || l.flat_end < NumElements(l.box.shape);
}

// Walks `region`, every element of which both layouts hold, as runs
// contiguous in both and calls push(src_flat, dst_flat, len) with flat
// indices relative to each layout's box, in increasing order.
template <typename Push>
void WalkRuns(const StoredLayout& src, const StoredLayout& dst, const Box& region, Push& push) {
  const size_t rank = region.rank();
  int64_t run = 0;
  const size_t k = FoldTrailingAxes(src, dst, region, &run);
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
  std::vector<int64_t> idx(k, 0);
  do {
    push(src_flat, dst_flat, run);
  } while (OdometerStep(k, [](size_t p) { return p; }, region, idx.data(), src_stride.data(),
                        dst_stride.data(), src_flat, dst_flat));
}

// Calls walk(sub) for every non-empty part of `region` held by both layouts,
// as boxes: the whole region when neither layout is clipped to a flat range,
// else its intersections with their HeldBoxes (in storage order of both when
// neither has a permutation). The walk never visits rows that hold nothing,
// so a small flat range inside a huge covering box costs only its size.
template <typename Walk>
void ForEachHeldPart(const StoredLayout& src, const StoredLayout& dst, const Box& region,
                     Walk walk) {
  if (!ClipsFlatRange(src) && !ClipsFlatRange(dst)) {
    walk(region);
    return;
  }
  const std::vector<Box> sp = HeldBoxes(src), dp = HeldBoxes(dst);
  for (const Box& p : sp) {
    std::optional<Box> rp = Intersect(region, p);
    if (!rp) continue;
    for (const Box& q : dp) {
      std::optional<Box> r = Intersect(*rp, q);
      if (r) walk(*r);
    }
  }
}

// Walks `region` as runs contiguous in both layouts and calls
// emit(src_flat, dst_flat, len) with flat indices relative to each layout's
// box, restricted to the elements both flat ranges hold and merged with
// neighbours, in increasing order.
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
  ForEachHeldPart(src, dst, region, [&](const Box& part) { WalkRuns(src, dst, part, push); });
  if (pend_len > 0) emit(pend_src, pend_dst, pend_len);
}

// ---------------------------------------------------------------------------
// Layouts with a storage permutation (AOA transposes). Kept apart from the
// identity path above so that path stays exactly as it was.

// Element strides of each box axis in `l`'s storage order.
void StorageStrides(const StoredLayout& l, int64_t* stride) {
  const size_t rank = l.box.rank();
  int64_t s = 1;
  if (l.perm.empty()) {
    for (size_t i = rank; i-- > 0;) {
      stride[i] = s;
      s *= l.box.shape[i];
    }
  } else {
    for (size_t k = rank; k-- > 0;) {
      const int a = l.perm[k];
      stride[a] = s;
      s *= l.box.shape[a];
    }
  }
}

// Walks `region`, every element of which both layouts hold, in the
// destination's storage order as runs along the destination's innermost
// axis: emit(src_flat, dst_flat, len, src_step), where the run's destination
// elements are contiguous and its source elements are `src_step` apart.
template <typename Emit>
void WalkStridedRuns(const StoredLayout& src, const StoredLayout& dst, const Box& region,
                     Emit& emit) {
  const size_t rank = region.rank();
  std::vector<int64_t> ss(rank), ds(rank);
  StorageStrides(src, ss.data());
  StorageStrides(dst, ds.data());
  // Axes in destination storage order; the last one is the run axis.
  std::vector<int> order(rank);
  for (size_t k = 0; k < rank; ++k) {
    order[k] = dst.perm.empty() ? static_cast<int>(k) : dst.perm[k];
  }
  const int inner = order.back();
  const int64_t len = region.shape[inner];
  const int64_t sstep = ss[inner];
  int64_t src_flat = 0, dst_flat = 0;
  for (size_t i = 0; i < rank; ++i) {
    src_flat += (region.offset[i] - src.box.offset[i]) * ss[i];
    dst_flat += (region.offset[i] - dst.box.offset[i]) * ds[i];
  }
  std::vector<int64_t> idx(rank, 0);  // by position in `order`
  do {
    emit(src_flat, dst_flat, len, sstep);
  } while (OdometerStep(rank - 1, [&](size_t p) { return order[p]; }, region, idx.data(),
                        ss.data(), ds.data(), src_flat, dst_flat));
}

// The same over every element of `region` held by both layouts' flat ranges
// (in no particular order across the held parts).
template <typename Emit>
void ForEachStridedRun(const StoredLayout& src, const StoredLayout& dst, const Box& region,
                       Emit emit) {
  const size_t rank = region.rank();
  if (rank == 0) {
    if (src.flat_begin <= 0 && 0 < src.flat_end && dst.flat_begin <= 0 && 0 < dst.flat_end) {
      emit(0, 0, 1, 1);
    }
    return;
  }
  for (size_t i = 0; i < rank; ++i) {
    if (region.shape[i] == 0) return;
  }
  ForEachHeldPart(src, dst, region,
                  [&](const Box& part) { WalkStridedRuns(src, dst, part, emit); });
}

// Element loads and stores through memcpy: stored tensors need not be
// aligned to their element size (safetensors does not require it, and a
// plan may place a shard at any byte), and a misaligned T* is undefined
// behaviour. The compiler turns each into one plain move.
template <typename T>
inline T LoadAt(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}
template <typename T>
inline void StoreAt(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

template <typename T>
void Gather(const uint8_t* s, int64_t step, uint8_t* d, int64_t n) {
  const int64_t stride = step * static_cast<int64_t>(sizeof(T));
  for (int64_t i = 0; i < n; ++i) StoreAt<T>(d + i * sizeof(T), LoadAt<T>(s + i * stride));
}

// Copies `n` elements `step` apart in `s` into contiguous `d` (same dtype).
void GatherElements(const uint8_t* s, int64_t step, uint8_t* d, int64_t n, size_t size) {
  if (step == 1) {
    std::memcpy(d, s, n * size);
    return;
  }
  switch (size) {
    case 1: Gather<uint8_t>(s, step, d, n); break;
    case 2: Gather<uint16_t>(s, step, d, n); break;
    case 4: Gather<uint32_t>(s, step, d, n); break;
    case 8: Gather<uint64_t>(s, step, d, n); break;
    default:
      for (int64_t i = 0; i < n; ++i) std::memcpy(d + i * size, s + i * step * size, size);
  }
}

// Blocked 2-D transpose: dst[i * d_row + j] = src[i + j * s_row] for
// i < ni (contiguous in the source), j < nj (contiguous in the destination),
// in 64 x 64 tiles (measured best of 8..256 on the dev VM, bench/transpose_bench).
constexpr int64_t kTile = 64;

template <typename T>
void TransposeTiles(const uint8_t* s8, int64_t s_row, uint8_t* d8, int64_t d_row, int64_t ni,
                    int64_t nj) {
  constexpr int64_t kSize = sizeof(T);
  for (int64_t i0 = 0; i0 < ni; i0 += kTile) {
    const int64_t ie = std::min(ni, i0 + kTile);
    for (int64_t j0 = 0; j0 < nj; j0 += kTile) {
      const int64_t je = std::min(nj, j0 + kTile);
      for (int64_t i = i0; i < ie; ++i) {
        uint8_t* dp = d8 + i * d_row * kSize;
        const uint8_t* sp = s8 + i * kSize;
        for (int64_t j = j0; j < je; ++j) StoreAt<T>(dp + j * kSize, LoadAt<T>(sp + j * s_row * kSize));
      }
    }
  }
}

// The same with a dtype conversion: each tile is transposed into `tmp`
// (source dtype) and converted row by row.
void TransposeTilesConvert(const uint8_t* s, DType sdt, int64_t s_row, uint8_t* d, DType ddt,
                           int64_t d_row, int64_t ni, int64_t nj) {
  const size_t ssz = DTypeSize(sdt), dsz = DTypeSize(ddt);
  uint8_t tmp[kTile * kTile * 8];
  for (int64_t i0 = 0; i0 < ni; i0 += kTile) {
    const int64_t ie = std::min(ni, i0 + kTile);
    for (int64_t j0 = 0; j0 < nj; j0 += kTile) {
      const int64_t je = std::min(nj, j0 + kTile);
      for (int64_t i = i0; i < ie; ++i) {
        uint8_t* tp = tmp + (i - i0) * kTile * ssz;
        GatherElements(s + (i + j0 * s_row) * ssz, s_row, tp, je - j0, ssz);
      }
      for (int64_t i = i0; i < ie; ++i) {
        ConvertElements(tmp + (i - i0) * kTile * ssz, sdt, d + (i * d_row + j0) * dsz, ddt,
                        static_cast<size_t>(je - j0));
      }
    }
  }
}

// Copies `region` by 2-D tiles over the source's innermost axis and the
// destination's innermost axis when they differ and no flat range clips;
// returns -1 when the layouts do not fit that shape.
int64_t CopyTiled(const StoredLayout& src, const uint8_t* s, const StoredLayout& dst, uint8_t* d,
                  const Box& region) {
  const size_t rank = region.rank();
  if (rank < 2) return -1;
  if (src.flat_begin > 0 || dst.flat_begin > 0 || src.flat_end < NumElements(src.box.shape) ||
      dst.flat_end < NumElements(dst.box.shape)) {
    return -1;
  }
  const int si = src.perm.empty() ? static_cast<int>(rank) - 1 : src.perm.back();
  const int di = dst.perm.empty() ? static_cast<int>(rank) - 1 : dst.perm.back();
  if (si == di || region.shape[si] < 2 || region.shape[di] < 2) return -1;
  for (size_t i = 0; i < rank; ++i) {
    if (region.shape[i] == 0) return 0;
  }
  std::vector<int64_t> ss(rank), ds(rank);
  StorageStrides(src, ss.data());
  StorageStrides(dst, ds.data());
  const size_t ssz = DTypeSize(src.dtype), dsz = DTypeSize(dst.dtype);
  int64_t src_flat = 0, dst_flat = 0;
  for (size_t i = 0; i < rank; ++i) {
    src_flat += (region.offset[i] - src.box.offset[i]) * ss[i];
    dst_flat += (region.offset[i] - dst.box.offset[i]) * ds[i];
  }
  std::vector<int> outer;  // the other axes, in destination storage order
  for (size_t k = 0; k < rank; ++k) {
    const int a = dst.perm.empty() ? static_cast<int>(k) : dst.perm[k];
    if (a != si && a != di) outer.push_back(a);
  }
  const int64_t ni = region.shape[si], nj = region.shape[di];
  std::vector<int64_t> idx(outer.size(), 0);
  while (true) {
    const uint8_t* sp = s + src_flat * ssz;
    uint8_t* dp = d + dst_flat * dsz;
    if (src.dtype != dst.dtype) {
      TransposeTilesConvert(sp, src.dtype, ss[di], dp, dst.dtype, ds[si], ni, nj);
    } else {
      switch (ssz) {
        case 1: TransposeTiles<uint8_t>(sp, ss[di], dp, ds[si], ni, nj); break;
        case 2: TransposeTiles<uint16_t>(sp, ss[di], dp, ds[si], ni, nj); break;
        case 4: TransposeTiles<uint32_t>(sp, ss[di], dp, ds[si], ni, nj); break;
        default: TransposeTiles<uint64_t>(sp, ss[di], dp, ds[si], ni, nj); break;
      }
    }
    if (!OdometerStep(outer.size(), [&](size_t p) { return outer[p]; }, region, idx.data(),
                      ss.data(), ds.data(), src_flat, dst_flat)) {
      return NumElements(region.shape);
    }
  }
}

int64_t CopyRegionPermuted(const StoredLayout& src, const void* src_data, const StoredLayout& dst,
                           void* dst_data, const Box& region) {
  const size_t ssz = DTypeSize(src.dtype), dsz = DTypeSize(dst.dtype);
  const uint8_t* s = static_cast<const uint8_t*>(src_data);
  uint8_t* d = static_cast<uint8_t*>(dst_data);
  if (ssz <= 8) {
    const int64_t n = CopyTiled(src, s, dst, d, region);
    if (n >= 0) return n;
  }
  int64_t copied = 0;
  if (src.dtype == dst.dtype) {
    ForEachStridedRun(src, dst, region, [&](int64_t sf, int64_t df, int64_t len, int64_t step) {
      GatherElements(s + (sf - src.flat_begin) * ssz, step, d + (df - dst.flat_begin) * dsz, len,
                     ssz);
      copied += len;
    });
  } else {
    constexpr int64_t kChunk = 1024;
    uint8_t tmp[kChunk * 8];
    ForEachStridedRun(src, dst, region, [&](int64_t sf, int64_t df, int64_t len, int64_t step) {
      const uint8_t* sp = s + (sf - src.flat_begin) * ssz;
      uint8_t* dp = d + (df - dst.flat_begin) * dsz;
      if (step == 1) {
        ConvertElements(sp, src.dtype, dp, dst.dtype, static_cast<size_t>(len));
      } else {
        for (int64_t i = 0; i < len; i += kChunk) {
          const int64_t n = std::min(kChunk, len - i);
          GatherElements(sp + i * step * ssz, step, tmp, n, ssz);
          ConvertElements(tmp, src.dtype, dp + i * dsz, dst.dtype, static_cast<size_t>(n));
        }
      }
      copied += len;
    });
  }
  return copied;
}

}  // namespace

#if defined(__x86_64__)
namespace {

// n a multiple of 64, d 64-byte aligned (StreamingCopy aligns it first).
void StreamSse2(uint8_t* d, const uint8_t* s, size_t n) {
  for (size_t i = 0; i < n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
}

__attribute__((target("avx2"))) void StreamAvx2(uint8_t* d, const uint8_t* s, size_t n) {
  for (size_t i = 0; i < n; i += 64) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
  }
}

bool HasAvx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return has;
}

}  // namespace
#endif

void StreamingCopy(void* dst, const void* src, size_t n) {
  uint8_t* d = static_cast<uint8_t*>(dst);
  const uint8_t* s = static_cast<const uint8_t*>(src);
#if defined(__x86_64__)
  // One stream, front to back, a whole 64-byte line at a time. An earlier
  // version interleaved four 4 KiB pages 64 bytes each (several DRAM streams
  // in flight: 10.3 against 8.5 GB/s on one dev VM); on a later one it ran
  // at 2.5-3.3 GB/s against 11-14 for one stream (docs/benchmarks.md), and
  // one stream was never far behind it.
  const size_t head = std::min(n, static_cast<size_t>(-reinterpret_cast<uintptr_t>(d) & 63));
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  const size_t body = n & ~static_cast<size_t>(63);
  if (HasAvx2()) {
    StreamAvx2(d, s, body);
  } else {
    StreamSse2(d, s, body);
  }
  d += body;
  s += body;
  n -= body;
#endif
  std::memcpy(d, s, n);
}

void StreamingFence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

size_t FoldTrailingAxes(const StoredLayout& src, const StoredLayout& dst, const Box& region,
                        int64_t* run) {
  size_t k = region.rank() - 1;
  *run = region.shape[k];
  while (k > 0 && region.shape[k] == src.box.shape[k] && region.shape[k] == dst.box.shape[k]) {
    --k;
    *run *= region.shape[k];
  }
  return k;
}

bool IsIdentityPerm(const std::vector<int>& perm) {
  for (size_t i = 0; i < perm.size(); ++i) {
    if (perm[i] != static_cast<int>(i)) return false;
  }
  return true;
}

StoredLayout StoredLayout::Whole(Box box, DType dtype) {
  StoredLayout l;
  l.flat_end = NumElements(box.shape);
  l.box = std::move(box);
  l.dtype = dtype;
  return l;
}

int64_t CopyRegion(const StoredLayout& src, const void* src_data, const StoredLayout& dst,
                   void* dst_data, const Box& region) {
  if (!src.perm.empty() || !dst.perm.empty()) {
    return CopyRegionPermuted(src, src_data, dst, dst_data, region);
  }
  const size_t ssz = DTypeSize(src.dtype), dsz = DTypeSize(dst.dtype);
  const uint8_t* s = static_cast<const uint8_t*>(src_data);
  uint8_t* d = static_cast<uint8_t*>(dst_data);
  int64_t copied = 0;
  if (src.dtype == dst.dtype) {
    // A destination far larger than the caches is written with streaming
    // stores (what glibc's memcpy does for one huge buffer, but a strided
    // copy's runs stay below its threshold): no read-for-ownership, no
    // eviction of the source. Short runs keep memcpy.
    const bool stream = static_cast<uint64_t>(NumElements(region.shape)) * dsz >= kStreamingBytes;
    ForEachRun(src, dst, region, [&](int64_t sf, int64_t df, int64_t len) {
      uint8_t* dp = d + (df - dst.flat_begin) * dsz;
      const uint8_t* sp = s + (sf - src.flat_begin) * ssz;
      const size_t n = static_cast<size_t>(len) * ssz;
      if (stream && n >= kStreamingMinRun) {
        StreamingCopy(dp, sp, n);
      } else {
        std::memcpy(dp, sp, n);
      }
      copied += len;
    });
    if (stream) StreamingFence();
  } else {
    ForEachRun(src, dst, region, [&](int64_t sf, int64_t df, int64_t len) {
      ConvertElements(s + (sf - src.flat_begin) * ssz, src.dtype, d + (df - dst.flat_begin) * dsz,
                      dst.dtype, static_cast<size_t>(len));
      copied += len;
    });
  }
  return copied;
}

bool AppendCopyRuns(const StoredLayout& src, const StoredLayout& dst, const Box& region,
                    size_t max_runs, std::vector<CopyRun>* out) {
  if (!src.perm.empty() || !dst.perm.empty()) return false;
  if (region.rank() > 0) {
    int64_t run = 0;
    const size_t k = FoldTrailingAxes(src, dst, region, &run);
    uint64_t outer = 1;  // runs before merging: an upper bound
    for (size_t i = 0; i < k; ++i) {
      outer *= static_cast<uint64_t>(std::max<int64_t>(region.shape[i], 0));
      if (outer > max_runs) return false;
    }
  }
  ForEachRun(src, dst, region, [&](int64_t sf, int64_t df, int64_t len) {
    out->push_back(CopyRun{sf - src.flat_begin, df - dst.flat_begin, len});
  });
  return true;
}

std::vector<Box> HeldBoxes(const StoredLayout& layout) {
  const size_t rank = layout.box.rank();
  const int64_t total = NumElements(layout.box.shape);
  const int64_t b = std::max<int64_t>(layout.flat_begin, 0);
  const int64_t e = std::min<int64_t>(layout.flat_end, total);
  std::vector<Box> out;
  if (b >= e) return out;
  if (rank == 0 || (b == 0 && e == total)) {
    out.push_back(layout.box);
    return out;
  }
  // Storage order: storage axis k is box axis perm[k].
  auto axis_of = [&](size_t k) {
    return layout.perm.empty() ? k : static_cast<size_t>(layout.perm[k]);
  };
  Shape storage_shape(rank);
  for (size_t k = 0; k < rank; ++k) storage_shape[k] = layout.box.shape[axis_of(k)];
  Shape prefix(rank, 0);
  std::vector<std::pair<Shape, Shape>> parts;
  SplitFlatRange(storage_shape, 0, b, e, prefix, &parts);
  out.reserve(parts.size());
  for (const auto& [off, shp] : parts) {
    Box box;
    box.offset = layout.box.offset;
    box.shape = layout.box.shape;
    for (size_t k = 0; k < rank; ++k) {
      box.offset[axis_of(k)] += off[k];
      box.shape[axis_of(k)] = shp[k];
    }
    out.push_back(std::move(box));
  }
  return out;
}

int64_t CountRegion(const StoredLayout& src, const StoredLayout& dst, const Box& region) {
  if (region.rank() == 0) {
    return src.flat_begin <= 0 && 0 < src.flat_end && dst.flat_begin <= 0 && 0 < dst.flat_end
               ? 1
               : 0;
  }
  int64_t n = 0;
  ForEachHeldPart(src, dst, region, [&](const Box& part) { n += NumElements(part.shape); });
  return n;
}

FlatSpan HeldSpan(const StoredLayout& src, const StoredLayout& dst, const Box& region) {
  const size_t rank = region.rank();
  if (rank == 0) {
    if (CountRegion(src, dst, region) == 0) return {};
    return {0, 1};
  }
  Shape stride(rank);  // inline: no allocation per planned copy
  StorageStrides(src, stride.data());
  int64_t lo = INT64_MAX, hi = INT64_MIN;
  // Flat indices grow with every coordinate, so a box's first and last
  // stored elements are its two corners, whatever the storage order.
  ForEachHeldPart(src, dst, region, [&](const Box& part) {
    int64_t first = 0, last = 0;
    for (size_t i = 0; i < rank; ++i) {
      const int64_t o = part.offset[i] - src.box.offset[i];
      first += o * stride[i];
      last += (o + part.shape[i] - 1) * stride[i];
    }
    lo = std::min(lo, first);
    hi = std::max(hi, last + 1);
  });
  if (lo >= hi) return {};
  return {lo, hi};
}

FlatSpan RegionSpan(const StoredLayout& layout, const Box& region) {
  const size_t rank = region.rank();
  Shape first(rank), last(rank);
  for (size_t i = 0; i < rank; ++i) {
    if (region.shape[i] == 0) return {};
    first[i] = region.offset[i] - layout.box.offset[i];
    last[i] = first[i] + region.shape[i] - 1;
  }
  int64_t b, e;
  if (layout.perm.empty()) {
    b = Ravel(layout.box.shape, first);
    e = Ravel(layout.box.shape, last) + 1;
  } else {
    // Flat indices grow with every coordinate, so the first and last
    // corners still bound the span.
    std::vector<int64_t> stride(rank);
    StorageStrides(layout, stride.data());
    b = 0;
    e = 1;
    for (size_t i = 0; i < rank; ++i) {
      b += first[i] * stride[i];
      e += last[i] * stride[i];
    }
  }
  b = std::max(b, layout.flat_begin);
  e = std::min(e, layout.flat_end);
  if (e <= b) return {};
  return {b, e};
}

}  // namespace ckpt
