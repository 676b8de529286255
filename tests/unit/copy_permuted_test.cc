// CopyRegion / CountRegion / RegionSpan with a storage permutation
// (StoredLayout::perm, used by AOA transposes), checked element by element
// against an oracle over random ranks, permutations, boxes, flat ranges and
// casts.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "core/base/box.h"
#include "core/exec/copy.h"
#include "core/base/dtype.h"
#include "gtest/gtest.h"

namespace ckpt {
namespace {

// Flat index of global index `g` in `l` (storage order), or -1 if not held.
int64_t FlatOf(const StoredLayout& l, const Shape& g) {
  const size_t rank = l.box.rank();
  std::vector<int> order(rank);
  std::iota(order.begin(), order.end(), 0);
  if (!l.perm.empty()) order = l.perm;
  int64_t f = 0;
  for (size_t k = 0; k < rank; ++k) {
    const int a = order[k];
    const int64_t x = g[a] - l.box.offset[a];
    if (x < 0 || x >= l.box.shape[a]) return -1;
    f = f * l.box.shape[a] + x;
  }
  if (f < l.flat_begin || f >= l.flat_end) return -1;
  return f;
}

TEST(CopyPermuted, TransposeSmall) {
  // A = [[0,1,2],[3,4,5]] stored row-major; seen as B = A^T (3x2).
  std::vector<float> a = {0, 1, 2, 3, 4, 5};
  StoredLayout src = StoredLayout::Whole(Box{{0, 0}, {3, 2}}, DType::kF32);
  src.perm = {1, 0};
  StoredLayout dst = StoredLayout::Whole(Box{{0, 0}, {3, 2}}, DType::kF32);
  std::vector<float> b(6, -1);
  EXPECT_EQ(CopyRegion(src, a.data(), dst, b.data(), dst.box), 6);
  EXPECT_EQ(b, (std::vector<float>{0, 3, 1, 4, 2, 5}));
  // Row 1 of B = column 1 of A: elements 1 and 4, flat span [1, 5).
  FlatSpan sp = RegionSpan(src, Box{{1, 0}, {1, 2}});
  EXPECT_EQ(sp.begin, 1);
  EXPECT_EQ(sp.end, 5);
  // Column 1 of B = row 1 of A: contiguous [3, 6).
  sp = RegionSpan(src, Box{{0, 1}, {3, 1}});
  EXPECT_EQ(sp.begin, 3);
  EXPECT_EQ(sp.end, 6);
}

// Stored tensors need not be aligned to their element size (safetensors
// does not require it; a peer's plan may place a shard at any byte): the
// permuted paths (gather, tiled transpose) read and write every element
// through byte copies. The fuzzer's plan_codec input that found it had a
// 2-byte shard at an odd address (UBSan: misaligned load). Under
// --config=asan a misaligned typed load fails this test.
TEST(CopyPermuted, MisalignedSourceAndDestination) {
  for (DType dt : {DType::kF16, DType::kF32, DType::kF64}) {
    const size_t sz = DTypeSize(dt);
    for (const Shape& shape : {Shape{3, 5}, Shape{70, 130}}) {  // small gather, tiled
      const int64_t n = shape[0] * shape[1];
      std::vector<uint8_t> src(n * sz + 1), dst(n * sz + 3, 0xA5);
      for (size_t i = 0; i < n * sz; ++i) src[1 + i] = static_cast<uint8_t>(i * 7 + i / sz);
      StoredLayout s = StoredLayout::Whole(Box{{0, 0}, {shape[1], shape[0]}}, dt);
      s.perm = {1, 0};  // stored as the transpose
      StoredLayout d = StoredLayout::Whole(Box{{0, 0}, {shape[1], shape[0]}}, dt);
      ASSERT_EQ(CopyRegion(s, src.data() + 1, d, dst.data() + 3, d.box), n);
      for (int64_t i = 0; i < shape[1]; ++i) {
        for (int64_t j = 0; j < shape[0]; ++j) {
          // d[i][j] = stored[j][i]
          ASSERT_EQ(std::memcmp(dst.data() + 3 + (i * shape[0] + j) * sz,
                                src.data() + 1 + (j * shape[1] + i) * sz, sz), 0)
              << DTypeName(dt) << " " << i << "," << j;
        }
      }
    }
  }
}

TEST(CopyPermuted, IdentityPermMatchesPlainPath) {
  std::vector<float> a(24);
  std::iota(a.begin(), a.end(), 0.f);
  StoredLayout plain = StoredLayout::Whole(Box{{0, 0, 0}, {2, 3, 4}}, DType::kF32);
  StoredLayout ident = plain;
  ident.perm = {0, 1, 2};
  StoredLayout dst = StoredLayout::Whole(Box{{1, 1, 1}, {1, 2, 3}}, DType::kF32);
  std::vector<float> x(6), y(6);
  CopyRegion(plain, a.data(), dst, x.data(), dst.box);
  CopyRegion(ident, a.data(), dst, y.data(), dst.box);
  EXPECT_EQ(x, y);
}

TEST(CopyPermuted, RandomAgainstOracle) {
  std::mt19937_64 rng(7);
  auto uni = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  const DType kTypes[] = {DType::kF32, DType::kBF16, DType::kF64, DType::kI16, DType::kI64};
  int cases = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    const int rank = static_cast<int>(uni(1, 4));
    Shape global(rank);
    for (auto& e : global) e = uni(1, 5);
    auto rand_box = [&]() {
      Box b;
      for (int d = 0; d < rank; ++d) {
        int64_t a = uni(0, global[d] - 1), c = uni(a + 1, global[d]);
        b.offset.push_back(a);
        b.shape.push_back(c - a);
      }
      return b;
    };
    auto rand_layout = [&](bool permute, DType dt) {
      StoredLayout l = StoredLayout::Whole(rand_box(), dt);
      if (permute) {
        l.perm.resize(rank);
        std::iota(l.perm.begin(), l.perm.end(), 0);
        std::shuffle(l.perm.begin(), l.perm.end(), rng);
      }
      const int64_t n = NumElements(l.box.shape);
      if (n > 1 && uni(0, 3) == 0) {
        l.flat_begin = uni(0, n - 1);
        l.flat_end = uni(l.flat_begin + 1, n);
      }
      return l;
    };
    DType sdt = kTypes[uni(0, 4)];
    DType ddt = sdt;
    if (uni(0, 2) == 0) {
      if (sdt == DType::kF32) ddt = DType::kBF16;
      if (sdt == DType::kBF16) ddt = DType::kF32;
      if (sdt == DType::kI16) ddt = DType::kI64;
    }
    StoredLayout src = rand_layout(true, sdt);
    StoredLayout dst = rand_layout(uni(0, 4) == 0, ddt);
    auto region = Intersect(src.box, dst.box);
    if (!region) continue;
    const size_t ssz = DTypeSize(sdt), dsz = DTypeSize(ddt);
    std::vector<uint8_t> sbuf(src.num_elements() * ssz);
    for (int64_t i = 0; i < src.num_elements(); ++i) {
      double v = static_cast<double>((i * 7) % 200 - 100);
      switch (sdt) {
        case DType::kF32: { float f = v; std::memcpy(sbuf.data() + i * ssz, &f, 4); break; }
        case DType::kF64: std::memcpy(sbuf.data() + i * ssz, &v, 8); break;
        case DType::kBF16: { uint16_t h = FloatToBF16(v); std::memcpy(sbuf.data() + i * ssz, &h, 2); break; }
        case DType::kI16: { int16_t x = static_cast<int16_t>(v); std::memcpy(sbuf.data() + i * ssz, &x, 2); break; }
        default: { int64_t x = static_cast<int64_t>(v); std::memcpy(sbuf.data() + i * ssz, &x, 8); }
      }
    }
    std::vector<uint8_t> got(dst.num_elements() * dsz, 0xAB), want = got;
    int64_t expect_n = 0;
    int64_t span_lo = INT64_MAX, span_hi = INT64_MIN;
    const int64_t rn = NumElements(region->shape);
    for (int64_t f = 0; f < rn; ++f) {
      Shape g = Unravel(region->shape, f);
      for (int d = 0; d < rank; ++d) g[d] += region->offset[d];
      int64_t sf = FlatOf(src, g);
      StoredLayout sfull = src;
      sfull.flat_begin = 0;
      sfull.flat_end = NumElements(src.box.shape);
      int64_t sf_any = FlatOf(sfull, g);
      span_lo = std::min(span_lo, sf_any);
      span_hi = std::max(span_hi, sf_any + 1);
      int64_t df = FlatOf(dst, g);
      if (sf < 0 || df < 0) continue;
      ++expect_n;
      ConvertElements(sbuf.data() + (sf - src.flat_begin) * ssz, sdt,
                      want.data() + (df - dst.flat_begin) * dsz, ddt, 1);
    }
    ASSERT_EQ(CountRegion(src, dst, *region), expect_n) << iter;
    ASSERT_EQ(CopyRegion(src, sbuf.data(), dst, got.data(), *region), expect_n) << iter;
    ASSERT_EQ(got, want) << iter;
    FlatSpan sp = RegionSpan(src, *region);
    int64_t lo = std::max(span_lo, src.flat_begin), hi = std::min(span_hi, src.flat_end);
    if (hi > lo) {
      ASSERT_EQ(sp.begin, lo) << iter;
      ASSERT_EQ(sp.end, hi) << iter;
    } else {
      ASSERT_EQ(sp.end - sp.begin, 0) << iter;
    }
    ++cases;
  }
  EXPECT_GT(cases, 1000);
}


// HeldBoxes against the oracle FlatOf: disjoint boxes inside the layout's box,
// at most 2 * rank - 1 of them, in storage order, covering exactly the
// elements the flat range holds.
TEST(HeldBoxes, RandomAgainstOracle) {
  std::mt19937_64 rng(11);
  auto uni = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int iter = 0; iter < 4000; ++iter) {
    const int rank = static_cast<int>(uni(0, 4));
    StoredLayout l;
    for (int d = 0; d < rank; ++d) {
      l.box.offset.push_back(uni(0, 3));
      l.box.shape.push_back(uni(1, 5));
    }
    const int64_t n = NumElements(l.box.shape);
    l.flat_begin = uni(0, n);
    l.flat_end = uni(l.flat_begin, n);
    if (uni(0, 1) == 0 && rank > 0) {
      l.perm.resize(rank);
      std::iota(l.perm.begin(), l.perm.end(), 0);
      std::shuffle(l.perm.begin(), l.perm.end(), rng);
    }
    const std::vector<Box> parts = HeldBoxes(l);
    ASSERT_LE(parts.size(), static_cast<size_t>(std::max(1, 2 * rank - 1))) << iter;
    std::vector<int> hits(static_cast<size_t>(n), 0);
    int64_t last_flat = -1;
    for (const Box& p : parts) {
      ASSERT_EQ(p.rank(), static_cast<size_t>(rank));
      ASSERT_TRUE(Contains(l.box, p)) << iter << " " << BoxString(p);
      const int64_t pn = NumElements(p.shape);
      ASSERT_GT(pn, 0) << iter;
      int64_t lo = INT64_MAX, hi = -1;
      for (int64_t f = 0; f < pn; ++f) {
        Shape g = Unravel(p.shape, f);
        for (int d = 0; d < rank; ++d) g[d] += p.offset[d];
        const int64_t flat = FlatOf(l, g);
        ASSERT_GE(flat, 0) << iter << ": " << BoxString(p) << " holds an element outside the range";
        ++hits[static_cast<size_t>(flat)];
        lo = std::min(lo, flat);
        hi = std::max(hi, flat);
      }
      ASSERT_GT(lo, last_flat) << iter << ": parts out of storage order";
      last_flat = hi;
    }
    for (int64_t f = 0; f < n; ++f) {
      const int want = f >= l.flat_begin && f < l.flat_end ? 1 : 0;
      ASSERT_EQ(hits[static_cast<size_t>(f)], want) << iter << " flat " << f;
    }
  }
}

// Identity layouts clipped to flat ranges on both sides: CopyRegion,
// CountRegion and AppendCopyRuns (sorted, non-overlapping runs) against the
// oracle.
TEST(CopyFlatRanges, RandomAgainstOracle) {
  std::mt19937_64 rng(13);
  auto uni = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int iter = 0; iter < 3000; ++iter) {
    const int rank = static_cast<int>(uni(1, 4));
    Shape global(rank);
    for (auto& e : global) e = uni(1, 6);
    auto rand_layout = [&]() {
      StoredLayout l;
      for (int d = 0; d < rank; ++d) {
        const int64_t a = uni(0, global[d] - 1), c = uni(a + 1, global[d]);
        l.box.offset.push_back(a);
        l.box.shape.push_back(c - a);
      }
      l.dtype = DType::kI32;
      const int64_t n = NumElements(l.box.shape);
      l.flat_begin = uni(0, 1) ? uni(0, n - 1) : 0;
      l.flat_end = uni(0, 1) ? uni(l.flat_begin + 1, n) : n;
      return l;
    };
    const StoredLayout src = rand_layout(), dst = rand_layout();
    const auto region = Intersect(src.box, dst.box);
    if (!region) continue;
    std::vector<int32_t> sbuf(static_cast<size_t>(src.num_elements()));
    for (size_t i = 0; i < sbuf.size(); ++i) sbuf[i] = static_cast<int32_t>(1000 + i);
    std::vector<int32_t> got(static_cast<size_t>(dst.num_elements()), -7), want = got;
    int64_t expect_n = 0;
    const int64_t rn = NumElements(region->shape);
    for (int64_t f = 0; f < rn; ++f) {
      Shape g = Unravel(region->shape, f);
      for (int d = 0; d < rank; ++d) g[d] += region->offset[d];
      const int64_t sf = FlatOf(src, g), df = FlatOf(dst, g);
      if (sf < 0 || df < 0) continue;
      ++expect_n;
      want[static_cast<size_t>(df - dst.flat_begin)] = sbuf[static_cast<size_t>(sf - src.flat_begin)];
    }
    ASSERT_EQ(CountRegion(src, dst, *region), expect_n) << iter;
    ASSERT_EQ(CopyRegion(src, sbuf.data(), dst, got.data(), *region), expect_n) << iter;
    ASSERT_EQ(got, want) << iter;
    std::vector<CopyRun> runs;
    ASSERT_TRUE(AppendCopyRuns(src, dst, *region, 1 << 20, &runs));
    int64_t sum = 0, next_src = 0, next_dst = 0;
    for (const CopyRun& r : runs) {
      ASSERT_GT(r.len, 0) << iter;
      ASSERT_GE(r.src, next_src) << iter << ": runs not in source order";
      ASSERT_GE(r.dst, next_dst) << iter << ": runs not in destination order";
      next_src = r.src + r.len;
      next_dst = r.dst + r.len;
      sum += r.len;
    }
    ASSERT_EQ(sum, expect_n) << iter;
  }
}

// The shape of tests/fuzz corpus metadata_json regression-count-region: a
// flat range of 2 elements whose covering box is [2, 2^40, 2], against a
// column of the same tensor. Walking the region's rows took hours; held
// parts make it a handful of box intersections, and a copy out of it
// touches only what is held.
TEST(CopyFlatRanges, HugeCoveringBoxCostsItsSize) {
  const int64_t big = int64_t{1} << 40;
  StoredLayout straddle;
  straddle.box = Box{{0, 0, 0}, {2, big, 2}};
  straddle.dtype = DType::kU8;
  straddle.flat_begin = 2 * big - 1;  // the last element of plane 0 and the first of plane 1
  straddle.flat_end = 2 * big + 1;
  StoredLayout column = StoredLayout::Whole(Box{{0, 0, 0}, {2, big, 1}}, DType::kU8);
  ASSERT_EQ(HeldBoxes(straddle).size(), 2u);
  EXPECT_EQ(CountRegion(straddle, column, column.box), 1);  // (1, 0, 0)
  StoredLayout last = StoredLayout::Whole(Box{{0, big - 1, 0}, {2, 1, 2}}, DType::kU8);
  EXPECT_EQ(CountRegion(straddle, last, last.box), 1);  // (0, big-1, 1)
  const uint8_t held[2] = {0x11, 0x22};
  uint8_t out[4] = {0, 0, 0, 0};
  ASSERT_EQ(CopyRegion(straddle, held, last, out, last.box), 1);
  EXPECT_EQ(out[1], 0x11);
  EXPECT_EQ(out[0] + out[2] + out[3], 0);
}

}  // namespace
}  // namespace ckpt
