// CPU test of server/cuda/copy_runs: the 2-D blocks the device delivery
// issues (cudaMemcpy2DAsync) must copy exactly what ckpt::CopyRegion copies,
// for random boxes, flattened ranges on either side and casts.
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "core/base/box.h"
#include "core/exec/copy.h"
#include "core/base/dtype.h"
#include "server/cuda/copy_runs.h"

namespace ckptd::gpu {
namespace {

using ckpt::Box;
using ckpt::DType;
using ckpt::Shape;
using ckpt::StoredLayout;

Box RandomBox(std::mt19937& rng, const Shape& global) {
  Box b{Shape(global.size()), Shape(global.size())};
  for (size_t i = 0; i < global.size(); ++i) {
    int64_t lo = std::uniform_int_distribution<int64_t>(0, global[i] - 1)(rng);
    int64_t hi = std::uniform_int_distribution<int64_t>(lo + 1, global[i])(rng);
    // Often take the whole axis, so trailing axes fold.
    if (rng() % 3 == 0) lo = 0, hi = global[i];
    b.offset[i] = lo;
    b.shape[i] = hi - lo;
  }
  return b;
}

StoredLayout RandomLayout(std::mt19937& rng, const Shape& global, DType dt) {
  Box b = RandomBox(rng, global);
  StoredLayout l = StoredLayout::Whole(b, dt);
  if (rng() % 3 == 0) {  // a flattened range of the box
    int64_t n = ckpt::NumElements(b.shape);
    int64_t a = std::uniform_int_distribution<int64_t>(0, n - 1)(rng);
    int64_t e = std::uniform_int_distribution<int64_t>(a + 1, n)(rng);
    l.flat_begin = a;
    l.flat_end = e;
  }
  return l;
}

// Applies the blocks with plain memcpy (and a cast per row when needed).
int64_t ApplyBlocks(const StoredLayout& src, const uint8_t* s, const StoredLayout& dst, uint8_t* d,
                    const Box& region) {
  const size_t ssz = ckpt::DTypeSize(src.dtype), dsz = ckpt::DTypeSize(dst.dtype);
  const int64_t src_n = src.num_elements(), dst_n = dst.num_elements();
  return ForEachBlock(src, dst, region, [&](const Block2D& k) {
    ASSERT_GT(k.width, 0);
    ASSERT_GT(k.height, 0);
    if (k.height > 1) {
      ASSERT_GE(k.src_pitch, k.width);
      ASSERT_GE(k.dst_pitch, k.width);
    }
    for (int64_t r = 0; r < k.height; ++r) {
      const int64_t so = k.src + r * k.src_pitch, doff = k.dst + r * k.dst_pitch;
      ASSERT_GE(so, 0);
      ASSERT_GE(doff, 0);
      ASSERT_LE(so + k.width, src_n);
      ASSERT_LE(doff + k.width, dst_n);
      ckpt::ConvertElements(s + so * ssz, src.dtype, d + doff * dsz, dst.dtype, k.width);
    }
  });
}

void CheckCase(std::mt19937& rng, DType sdt, DType ddt) {
  const size_t rank = 1 + rng() % 4;
  Shape global(rank);
  for (auto& g : global) g = 1 + rng() % 7;
  StoredLayout src = RandomLayout(rng, global, sdt);
  StoredLayout dst = RandomLayout(rng, global, ddt);
  auto region = ckpt::Intersect(src.box, dst.box);
  if (!region) return;
  std::vector<uint8_t> sb(src.num_bytes());
  for (size_t i = 0; i < sb.size(); ++i) sb[i] = static_cast<uint8_t>(rng());
  if (sdt == DType::kF32) {  // finite floats, so casts compare bit-exactly
    for (int64_t i = 0; i < src.num_elements(); ++i) {
      float f = static_cast<float>(i) * 0.25f - 3.0f;
      std::memcpy(sb.data() + 4 * i, &f, 4);
    }
  }
  std::vector<uint8_t> want(dst.num_bytes(), 0xAB), got(dst.num_bytes(), 0xAB);
  const int64_t n_ref = ckpt::CopyRegion(src, sb.data(), dst, want.data(), *region);
  const int64_t n = ApplyBlocks(src, sb.data(), dst, got.data(), *region);
  ASSERT_EQ(n, n_ref) << ckpt::BoxString(src.box) << " -> " << ckpt::BoxString(dst.box);
  ASSERT_EQ(n, ckpt::CountRegion(src, dst, *region));
  ASSERT_EQ(got, want) << ckpt::BoxString(src.box) << " [" << src.flat_begin << "," << src.flat_end
                       << ") -> " << ckpt::BoxString(dst.box) << " [" << dst.flat_begin << ","
                       << dst.flat_end << ")";
}

TEST(CopyBlocks, MatchesCopyRegionSameDtype) {
  std::mt19937 rng(7);
  for (int i = 0; i < 4000; ++i) CheckCase(rng, DType::kF32, DType::kF32);
}

TEST(CopyBlocks, MatchesCopyRegionWithCasts) {
  std::mt19937 rng(11);
  for (int i = 0; i < 1500; ++i) CheckCase(rng, DType::kF32, DType::kBF16);
  for (int i = 0; i < 1500; ++i) CheckCase(rng, DType::kBF16, DType::kF32);
}

TEST(CopyBlocks, ColumnSliceIsOne2DBlock) {
  // [8, 6] row-major source, destination = columns [2, 5): 8 rows of 3.
  StoredLayout src = StoredLayout::Whole(Box{{0, 0}, {8, 6}}, DType::kF32);
  StoredLayout dst = StoredLayout::Whole(Box{{0, 2}, {8, 3}}, DType::kF32);
  std::vector<Block2D> blocks;
  ForEachBlock(src, dst, dst.box, [&](const Block2D& b) { blocks.push_back(b); });
  ASSERT_EQ(blocks.size(), 1u);
  EXPECT_EQ(blocks[0].src, 2);
  EXPECT_EQ(blocks[0].dst, 0);
  EXPECT_EQ(blocks[0].width, 3);
  EXPECT_EQ(blocks[0].height, 8);
  EXPECT_EQ(blocks[0].src_pitch, 6);
  EXPECT_EQ(blocks[0].dst_pitch, 3);
}

TEST(CopyBlocks, RowSliceIsOneLinearCopy) {
  StoredLayout src = StoredLayout::Whole(Box{{0, 0, 0}, {4, 5, 6}}, DType::kBF16);
  StoredLayout dst = StoredLayout::Whole(Box{{1, 0, 0}, {2, 5, 6}}, DType::kBF16);
  std::vector<Block2D> blocks;
  ForEachBlock(src, dst, dst.box, [&](const Block2D& b) { blocks.push_back(b); });
  ASSERT_EQ(blocks.size(), 1u);
  EXPECT_EQ(blocks[0].height, 1);
  EXPECT_EQ(blocks[0].width, 60);
  EXPECT_EQ(blocks[0].src, 30);
}

TEST(CopyBlocks, ScalarAndEmpty) {
  StoredLayout a = StoredLayout::Whole(Box{{}, {}}, DType::kF32);
  int blocks = 0;
  EXPECT_EQ(ForEachBlock(a, a, Box{{}, {}}, [&](const Block2D&) { ++blocks; }), 1);
  EXPECT_EQ(blocks, 1);
  StoredLayout b = StoredLayout::Whole(Box{{0}, {4}}, DType::kF32);
  EXPECT_EQ(ForEachBlock(b, b, Box{{0}, {0}}, [&](const Block2D&) { ++blocks; }), 0);
}

TEST(CopyBlocks, RowMajorLayouts) {
  EXPECT_TRUE(IsRowMajor(StoredLayout::Whole(Box{{0, 0}, {2, 3}}, DType::kF32)));
}

}  // namespace
}  // namespace ckptd::gpu
