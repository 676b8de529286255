#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "core/base/box.h"
#include "core/exec/copy.h"
#include "core/base/dtype.h"
#include "gtest/gtest.h"

namespace ckpt {
namespace {

TEST(Box, IntersectAndBounds) {
  Box a{{0, 0}, {4, 4}}, b{{2, 2}, {4, 4}};
  auto c = Intersect(a, b);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(*c, (Box{{2, 2}, {2, 2}}));
  EXPECT_FALSE(Intersect(Box{{0}, {2}}, Box{{2}, {2}}).has_value());
  EXPECT_TRUE(Intersect(Box{{}, {}}, Box{{}, {}}).has_value());
  EXPECT_TRUE(InBounds(Box{{2, 0}, {2, 8}}, Shape{4, 8}));
  EXPECT_FALSE(InBounds(Box{{3, 0}, {2, 8}}, Shape{4, 8}));
  EXPECT_FALSE(InBounds(Box{{-1, 0}, {2, 8}}, Shape{4, 8}));
}

TEST(Box, RavelUnravel) {
  Shape s{3, 4, 5};
  for (int64_t i = 0; i < 60; ++i) EXPECT_EQ(Ravel(s, Unravel(s, i)), i);
  EXPECT_EQ(Ravel(s, Shape{1, 2, 3}), 1 * 20 + 2 * 5 + 3);
}

TEST(Box, CheckedSizesOverflow) {
  EXPECT_FALSE(CheckedNumElements(Shape{1ll << 40, 1ll << 40}).ok());
  EXPECT_FALSE(CheckedNumBytes(Shape{1ll << 31, 1ll << 31}, 4).ok());
  EXPECT_FALSE(CheckedNumElements(Shape{-1, 2}).ok());
  EXPECT_EQ(*CheckedNumElements(Shape{}), 1);
  EXPECT_EQ(*CheckedNumElements(Shape{3, 0}), 0);
}

// The spec's flattened example: a (4,6) parameter as flat ranges [0,10) and [10,24).
TEST(Box, CoveringBoxSpecExample) {
  EXPECT_EQ(CoveringBox(Shape{4, 6}, 0, 10), (Box{{0, 0}, {2, 6}}));
  EXPECT_EQ(CoveringBox(Shape{4, 6}, 10, 24), (Box{{1, 0}, {3, 6}}));
}

// Paddle's rule gives axis 2 = [1,2) for shape (2,2,2), range [1,6), which
// misses element 2 = (0,1,0). The covering box must hold every element.
TEST(Box, CoveringBoxCorrectIn3D) {
  Box b = CoveringBox(Shape{2, 2, 2}, 1, 6);
  for (int64_t f = 1; f < 6; ++f) {
    Shape idx = Unravel(Shape{2, 2, 2}, f);
    EXPECT_TRUE(Contains(b, Box{idx, {1, 1, 1}})) << f;
  }
  EXPECT_EQ(b, (Box{{0, 0, 0}, {2, 2, 2}}));
  // Exhaustive over a 3x4x5 tensor: the box covers the range and is minimal
  // on the first axis.
  Shape s{3, 4, 5};
  for (int64_t lo = 0; lo < 60; ++lo) {
    for (int64_t hi = lo + 1; hi <= 60; ++hi) {
      Box c = CoveringBox(s, lo, hi);
      for (int64_t f = lo; f < hi; ++f) {
        ASSERT_TRUE(Contains(c, Box{Unravel(s, f), {1, 1, 1}})) << lo << " " << hi << " " << f;
      }
      EXPECT_EQ(c.offset[0], Unravel(s, lo)[0]);
      EXPECT_EQ(c.offset[0] + c.shape[0] - 1, Unravel(s, hi - 1)[0]);
    }
  }
}

// The spec's resharding example: w = arange(32).reshape(4,8) saved Shard(0)
// on 2 ranks, loaded Shard(1) on 2 ranks.
TEST(Copy, SpecShard0ToShard1) {
  std::vector<float> w(32);
  std::iota(w.begin(), w.end(), 0.f);
  Box a{{0, 0}, {2, 8}}, b{{2, 0}, {2, 8}};
  for (int r = 0; r < 2; ++r) {
    Box target{{0, 4 * r}, {4, 4}};
    std::vector<float> out(16, -1.f);
    auto dst = StoredLayout::Whole(target, DType::kF32);
    int64_t n = 0;
    for (const Box& src_box : {a, b}) {
      auto region = Intersect(src_box, target);
      ASSERT_TRUE(region.has_value());
      EXPECT_EQ(region->shape, (Shape{2, 4}));
      n += CopyRegion(StoredLayout::Whole(src_box, DType::kF32), w.data() + src_box.offset[0] * 8,
                      dst, out.data(), *region);
    }
    EXPECT_EQ(n, 16);
    for (int i = 0; i < 4; ++i) {
      for (int j = 0; j < 4; ++j) EXPECT_EQ(out[i * 4 + j], w[i * 8 + 4 * r + j]);
    }
  }
}

TEST(Copy, FlattenedSpecExample) {
  std::vector<float> full(24);
  std::iota(full.begin(), full.end(), 0.f);
  Box whole{{0, 0}, {4, 6}};
  // Stored as two flat shards of the whole box.
  StoredLayout s0{whole, 0, 10, DType::kF32}, s1{whole, 10, 24, DType::kF32};
  // Target: rows 1..2 as a plain box.
  Box target{{1, 0}, {2, 6}};
  std::vector<float> out(12, -1.f);
  auto dst = StoredLayout::Whole(target, DType::kF32);
  int64_t n = CopyRegion(s0, full.data(), dst, out.data(), target) +
              CopyRegion(s1, full.data() + 10, dst, out.data(), target);
  EXPECT_EQ(n, 12);
  for (int i = 0; i < 12; ++i) EXPECT_EQ(out[i], full[6 + i]);
  EXPECT_EQ(RegionSpan(s0, target).begin, 6);
  EXPECT_EQ(RegionSpan(s0, target).end, 10);
  EXPECT_EQ(RegionSpan(s1, target).begin, 10);
  EXPECT_EQ(RegionSpan(s1, target).end, 18);
}

TEST(Copy, ScalarAndCast) {
  float v = 3.5f;
  uint16_t out = 0;
  auto s = StoredLayout::Whole(Box{{}, {}}, DType::kF32);
  auto d = StoredLayout::Whole(Box{{}, {}}, DType::kBF16);
  EXPECT_EQ(CopyRegion(s, &v, d, &out, Box{{}, {}}), 1);
  EXPECT_EQ(BF16ToFloat(out), 3.5f);
}

TEST(DType, ParseNames) {
  EXPECT_EQ(*ParseDType("F32"), DType::kF32);
  EXPECT_EQ(*ParseDType("bfloat16"), DType::kBF16);
  EXPECT_EQ(*ParseDType("paddle.float16"), DType::kF16);
  EXPECT_EQ(*ParseDType("float8_e4m3fn"), DType::kF8E4M3);
  EXPECT_EQ(*ParseDType("bool"), DType::kBool);
  EXPECT_FALSE(ParseDType("complex64").ok());
  EXPECT_NE(ParseDType("Q7").status().message().find("Q7"), std::string::npos);
}

TEST(DType, HalfConversions) {
  // Exactly representable values round-trip.
  for (float f : {0.f, 1.f, -2.5f, 65504.f, 6.1035156e-05f, 5.9604645e-08f}) {
    EXPECT_EQ(F16ToFloat(FloatToF16(f)), f) << f;
  }
  // 1e-3 = 1.024 * 2^-10: exponent 5, mantissa 0.024 * 1024 = 24.576, rounded
  // to 25: 0x1419, which is (1 + 25/1024) * 2^-10 (worked out by hand).
  EXPECT_EQ(FloatToF16(1e-3f), 0x1419);
  EXPECT_EQ(F16ToFloat(0x1419), 1.0244140625f / 1024.f);
  EXPECT_EQ(FloatToF16(1e6f), 0x7c00);
  EXPECT_EQ(FloatToF16(65519.f), 0x7bff);
  EXPECT_EQ(FloatToF16(65520.f), 0x7c00);
  // Every half value round-trips through float.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) continue;  // NaN payloads
    EXPECT_EQ(FloatToF16(F16ToFloat(static_cast<uint16_t>(h))), h);
  }
  for (uint32_t b = 0; b < 0x10000; b += 7) {
    if ((b & 0x7f80) == 0x7f80 && (b & 0x7f)) continue;
    EXPECT_EQ(FloatToBF16(BF16ToFloat(static_cast<uint16_t>(b))), b);
  }
  EXPECT_EQ(FloatToBF16(1.00390625f), 0x3f80);  // tie rounds to even
  EXPECT_TRUE(CanConvert(DType::kI32, DType::kI64));
  EXPECT_FALSE(CanConvert(DType::kI64, DType::kI32));
  int32_t i32[3] = {-5, 0, 7};
  int64_t i64[3];
  ConvertElements(i32, DType::kI32, i64, DType::kI64, 3);
  EXPECT_EQ(i64[0], -5);
  EXPECT_EQ(i64[2], 7);
}

}  // namespace
}  // namespace ckpt

namespace ckpt {
namespace {

// Large regions take the streaming-store path: exact bytes for every
// alignment of runs and of the destination, including ragged tails.
TEST(Copy, StreamingStoresForLargeRegionsAreExact) {
  for (const int64_t cols : {int64_t{4099}, int64_t{8192}}) {
    const int64_t rows = (kStreamingBytes / 4) / (cols / 2) + 3;  // dst region >= threshold
    std::vector<float> src(rows * cols);
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<float>(i % 1000003);
    Box whole{{0, 0}, {rows, cols}};
    for (const int64_t off : {int64_t{1}, int64_t{3}}) {
      Box target{{0, off}, {rows, cols / 2}};
      std::vector<float> out(rows * (cols / 2) + 1, -1.f);
      // Shift the destination by one float so its alignment is odd too.
      int64_t n = CopyRegion(StoredLayout::Whole(whole, DType::kF32), src.data(),
                             StoredLayout::Whole(target, DType::kF32), out.data() + 1, target);
      ASSERT_EQ(n, rows * (cols / 2));
      EXPECT_EQ(out[0], -1.f);
      for (int64_t r = 0; r < rows; r += 97) {
        for (int64_t c = 0; c < cols / 2; ++c) {
          ASSERT_EQ(out[1 + r * (cols / 2) + c], src[r * cols + off + c]) << r << "," << c;
        }
      }
      const int64_t last = rows - 1;
      for (int64_t c = 0; c < cols / 2; ++c) {
        ASSERT_EQ(out[1 + last * (cols / 2) + c], src[last * cols + off + c]);
      }
    }
  }
  std::vector<uint8_t> a(1000), b(1000, 0);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<uint8_t>(i * 7);
  for (size_t len : {size_t{0}, size_t{1}, size_t{63}, size_t{64}, size_t{65}, size_t{999}}) {
    std::fill(b.begin(), b.end(), 0);
    StreamingCopy(b.data() + 1, a.data(), len);
    StreamingFence();
    EXPECT_TRUE(std::equal(a.begin(), a.begin() + len, b.begin() + 1)) << len;
    if (len + 1 < b.size()) {
      EXPECT_EQ(b[len + 1], 0);
    }
  }
}

}  // namespace
}  // namespace ckpt
