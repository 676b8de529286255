// CopyRegion / CountRegion / RegionSpan with a storage permutation
// (StoredLayout::perm, used by AOA transposes), checked element by element
// against an oracle over random ranks, permutations, boxes, flat ranges and
// casts.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "core/box.h"
#include "core/copy.h"
#include "core/dtype.h"
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

}  // namespace
}  // namespace ckpt
