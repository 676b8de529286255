// Property test: for random tensors (rank 0-4, random dtypes), random save
// layouts (random splits per dimension, replicas, flattened ranges) and
// random load layouts (sub-boxes, flattened ranges, dtype casts), `shard`
// then `load` gives exactly the bytes an element-by-element oracle computes
// from the full tensors.
#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "core/base/box.h"
#include "core/format/checkpoint.h"
#include "core/base/dtype.h"
#include "core/tools/layout.h"
#include "core/tools/offline.h"
#include "core/format/safetensors.h"
#include "core/write/writer.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace ckpt {
namespace {

struct FullTensor {
  std::string name;
  DType dtype;
  Shape shape;
  std::vector<uint8_t> bytes;
};

constexpr DType kDTypes[] = {DType::kF64, DType::kF32, DType::kF16, DType::kBF16,
                             DType::kF8E4M3, DType::kI64, DType::kI32, DType::kI16,
                             DType::kI8, DType::kU8, DType::kBool};

class Gen {
 public:
  explicit Gen(uint64_t seed) : rng_(seed) {}
  int64_t Int(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng_); }
  bool Coin(double p = 0.5) { return std::bernoulli_distribution(p)(rng_); }

  FullTensor Tensor(const std::string& name) {
    FullTensor t;
    t.name = name;
    t.dtype = kDTypes[Int(0, std::size(kDTypes) - 1)];
    int rank = static_cast<int>(Int(0, 4));
    for (int i = 0; i < rank; ++i) t.shape.push_back(Int(1, rank >= 3 ? 4 : 7));
    size_t n = NumElements(t.shape);
    t.bytes.resize(n * DTypeSize(t.dtype));
    // Values that survive every supported cast exactly: small integers.
    for (size_t i = 0; i < n; ++i) {
      double v = static_cast<double>(Int(-100, 100));
      uint8_t* p = t.bytes.data() + i * DTypeSize(t.dtype);
      switch (t.dtype) {
        case DType::kF64: std::memcpy(p, &v, 8); break;
        case DType::kF32: { float f = v; std::memcpy(p, &f, 4); break; }
        case DType::kF16: { uint16_t h = FloatToF16(v); std::memcpy(p, &h, 2); break; }
        case DType::kBF16: { uint16_t h = FloatToBF16(v); std::memcpy(p, &h, 2); break; }
        case DType::kBool: *p = static_cast<uint8_t>(Int(0, 1)); break;
        case DType::kU8: *p = static_cast<uint8_t>(Int(0, 255)); break;
        default:
          for (size_t b = 0; b < DTypeSize(t.dtype); ++b) p[b] = static_cast<uint8_t>(Int(0, 255));
      }
    }
    return t;
  }

  // Random cut points splitting [0, n) into up to `max_parts` pieces.
  std::vector<int64_t> Cuts(int64_t n, int max_parts) {
    int parts = static_cast<int>(Int(1, std::min<int64_t>(n, max_parts)));
    std::vector<int64_t> cuts{0};
    std::vector<int64_t> inner;
    for (int64_t i = 1; i < n; ++i) inner.push_back(i);
    std::shuffle(inner.begin(), inner.end(), rng_);
    inner.resize(parts - 1);
    std::sort(inner.begin(), inner.end());
    cuts.insert(cuts.end(), inner.begin(), inner.end());
    cuts.push_back(n);
    return cuts;
  }

  // A grid partition of `shape` into boxes.
  std::vector<Box> Grid(const Shape& shape, int max_boxes) {
    std::vector<Box> boxes{Box{Shape(), Shape()}};
    for (size_t d = 0; d < shape.size(); ++d) {
      int budget = std::max<int>(1, max_boxes / static_cast<int>(boxes.size()));
      std::vector<int64_t> cuts = Cuts(shape[d], std::min(budget, 3));
      std::vector<Box> next;
      for (const Box& b : boxes) {
        for (size_t i = 0; i + 1 < cuts.size(); ++i) {
          Box nb = b;
          nb.offset.push_back(cuts[i]);
          nb.shape.push_back(cuts[i + 1] - cuts[i]);
          next.push_back(nb);
        }
      }
      boxes = std::move(next);
    }
    return boxes;
  }

  // A save layout: every element stored once in replica 0 (plus replicas).
  Layout SaveLayout(const std::vector<FullTensor>& ts, int world) {
    Layout l;
    l.world_size = world;
    for (int r = 0; r < world; ++r) l.ranks.push_back(RankTargets{r, {}});
    for (const FullTensor& t : ts) {
      std::vector<TargetTensor> pieces;
      for (const Box& b : Grid(t.shape, world)) {
        int64_t n = NumElements(b.shape);
        if (Coin(0.3) && n > 1) {  // flatten this box and cut its range
          std::vector<int64_t> cuts = Cuts(n, 3);
          for (size_t i = 0; i + 1 < cuts.size(); ++i) {
            pieces.push_back({t.name, t.dtype, t.shape, b, FlatRange{cuts[i], cuts[i + 1]}});
          }
        } else {
          pieces.push_back({t.name, t.dtype, t.shape, b, std::nullopt});
        }
      }
      if (static_cast<int>(pieces.size()) > world) {  // too many: store whole instead
        pieces = {{t.name, t.dtype, t.shape, Box{Shape(t.shape.size(), 0), t.shape}, std::nullopt}};
      }
      std::vector<int> ranks(world);
      std::iota(ranks.begin(), ranks.end(), 0);
      std::shuffle(ranks.begin(), ranks.end(), rng_);
      for (size_t i = 0; i < pieces.size(); ++i) l.ranks[ranks[i]].tensors.push_back(pieces[i]);
      // Replicas: some remaining ranks hold a copy of a random piece.
      for (size_t i = pieces.size(); i < ranks.size(); ++i) {
        if (Coin(0.4)) l.ranks[ranks[i]].tensors.push_back(pieces[Int(0, pieces.size() - 1)]);
      }
    }
    return l;
  }

  // A load layout: random sub-boxes (some flattened, some cast).
  Layout LoadLayout(const std::vector<FullTensor>& ts, int world) {
    Layout l;
    l.world_size = world;
    for (int r = 0; r < world; ++r) {
      RankTargets rt{r, {}};
      for (const FullTensor& t : ts) {
        if (Coin(0.15)) continue;  // this rank does not want it
        TargetTensor tt{t.name, t.dtype, t.shape, Box{}, std::nullopt};
        for (int64_t ext : t.shape) {
          int64_t a = Int(0, ext - 1), b = Int(a + 1, ext);
          tt.box.offset.push_back(a);
          tt.box.shape.push_back(b - a);
        }
        int64_t n = NumElements(tt.box.shape);
        if (n > 1 && Coin(0.25)) {
          int64_t a = Int(0, n - 1), b = Int(a + 1, n);
          tt.flat_range = FlatRange{a, b};
        }
        if (Coin(0.2)) {
          // A supported cast.
          if (t.dtype == DType::kF32) tt.dtype = Coin() ? DType::kBF16 : DType::kF64;
          if (t.dtype == DType::kBF16 || t.dtype == DType::kF16) tt.dtype = DType::kF32;
          if (t.dtype == DType::kI32) tt.dtype = DType::kI64;
          if (t.dtype == DType::kBool) tt.dtype = DType::kI32;
        }
        rt.tensors.push_back(tt);
      }
      l.ranks.push_back(std::move(rt));
    }
    return l;
  }

 private:
  std::mt19937_64 rng_;
};

// Element-by-element oracle.
std::vector<uint8_t> Expected(const FullTensor& t, const TargetTensor& target) {
  const size_t isz = DTypeSize(t.dtype), osz = DTypeSize(target.dtype);
  int64_t fb = target.flat_range ? target.flat_range->begin : 0;
  int64_t fe = target.flat_range ? target.flat_range->end : NumElements(target.box.shape);
  std::vector<uint8_t> out((fe - fb) * osz);
  for (int64_t f = fb; f < fe; ++f) {
    Shape idx = Unravel(target.box.shape, f);
    for (size_t d = 0; d < idx.size(); ++d) idx[d] += target.box.offset[d];
    int64_t g = Ravel(t.shape, idx);
    ConvertElements(t.bytes.data() + g * isz, t.dtype, out.data() + (f - fb) * osz, target.dtype, 1);
  }
  return out;
}

class ReshardProperty : public ::testing::TestWithParam<int> {};

TEST_P(ReshardProperty, ShardThenLoadIsExact) {
  const int block = GetParam();
  testing::TempDir tmp;
  int cases = 0;
  for (int i = 0; i < 250; ++i) {
    const uint64_t seed = static_cast<uint64_t>(block) * 100000 + i;
    Gen g(seed);
    std::vector<FullTensor> ts;
    int n_tensors = static_cast<int>(g.Int(1, 4));
    for (int k = 0; k < n_tensors; ++k) ts.push_back(g.Tensor("t" + std::to_string(k)));
    const std::string src = tmp.Sub("src" + std::to_string(i));
    const std::string dst = tmp.Sub("dst" + std::to_string(i));
    ASSERT_TRUE(MakeDirs(src).ok());
    std::vector<TensorToWrite> tw;
    for (const auto& t : ts) tw.push_back({t.name, t.dtype, t.shape, t.bytes.data()});
    ASSERT_TRUE(WriteSafetensors(src + "/model.safetensors", tw, {}).ok());

    int save_world = static_cast<int>(g.Int(1, 6));
    Layout save = g.SaveLayout(ts, save_world);
    ShardOptions so;
    so.unique_id = g.Int(0, 12);
    so.checksum_block = std::vector<uint64_t>{8, 24, 64, 1 << 20}[g.Int(0, 3)];
    absl::Status s = ShardCheckpoint(src, save, dst, so);
    ASSERT_TRUE(s.ok()) << "seed " << seed << ": " << s << "\n" << LayoutToJson(save);

    int load_world = static_cast<int>(g.Int(1, 6));
    Layout load = g.LoadLayout(ts, load_world);
    OfflineLoadOptions lo;
    lo.threads = 1 + (i % 2);
    lo.plan.max_read_bytes = std::vector<uint64_t>{0, 8, 16, 48, 64ull << 20}[g.Int(0, 4)];
    // Pieces of the executor's piece-wise reads: tiny ones cut runs, casts
    // and checksum blocks at many places.
    lo.piece_bytes = std::vector<uint64_t>{64, 100, 192, 1000, 256 << 10}[g.Int(0, 4)];
    // Reads around the page cache: aligned pieces, bytes outside the read
    // ignored, EOF inside the last piece.
    lo.direct_io = g.Coin(0.3) ? DirectIo::kAlways : DirectIo::kNever;
    lo.plan.coalesce_gap = g.Coin(0.2) ? 64 : 0;
    // Poisoned destinations: an element the load never writes cannot pass
    // as a 0 the expected tensor happens to hold.
    lo.fill_byte = static_cast<uint8_t>(g.Int(1, 255));
    // The daemon's process_memory delivery (process_vm_writev into this
    // process): remote runs, cast bounces, copies that go element-wise.
    lo.via_process_memory = g.Coin(0.3);
    auto res = LoadOffline(dst, load, lo);
    ASSERT_TRUE(res.ok()) << "seed " << seed << ": " << res.status() << "\n" << LayoutToJson(load);
    EXPECT_TRUE(res->plan.missing_keys.empty());
    uint64_t wanted_bytes = 0;
    for (size_t r = 0; r < load.ranks.size(); ++r) {
      for (size_t k = 0; k < load.ranks[r].tensors.size(); ++k) {
        const TargetTensor& target = load.ranks[r].tensors[k];
        const FullTensor& full = *std::find_if(ts.begin(), ts.end(),
                                               [&](const FullTensor& f) { return f.name == target.name; });
        ASSERT_EQ(res->buffers[r].tensors[k], Expected(full, target))
            << "seed " << seed << " rank " << r << " tensor " << target.name << " box "
            << BoxString(target.box) << "\nsave layout " << LayoutToJson(save);
        wanted_bytes += target.num_bytes();
      }
    }
    EXPECT_EQ(res->stats.bytes_delivered, wanted_bytes);
    // Independent oracle for what is read: per (target, replica-0 shard),
    // the byte span from the first to the last element the target needs
    // from that shard, found by walking the target's elements one by one;
    // spans of one file merged when they touch (or lie within coalesce_gap).
    // bytes_read must equal their total exactly: every needed byte read,
    // once, and nothing else. Checksum blocks (checksum_block bytes from each
    // shard's start) lying whole inside a merged span must all be verified.
    std::map<std::string, std::vector<std::pair<uint64_t, uint64_t>>> spans;
    // The shards some target reads from, by file (a shard no target needs
    // is not verified even where a coalesced read passes over it).
    std::map<std::string, std::set<const ShardMeta*>> shards_of_file;
    for (const RankTargets& rl : load.ranks) {
      for (const TargetTensor& target : rl.tensors) {
        const auto& tm = res->checkpoint.metadata.tensors.at(target.name);
        const int64_t fb = target.flat_range ? target.flat_range->begin : 0;
        const int64_t fe =
            target.flat_range ? target.flat_range->end : NumElements(target.box.shape);
        for (const ShardMeta& sh : tm.shards) {
          if (sh.replica_id != 0) continue;
          const int64_t sfb = sh.flat_range ? sh.flat_range->begin : 0;
          const int64_t sfe = sh.flat_range ? sh.flat_range->end : NumElements(sh.box.shape);
          int64_t lo_el = INT64_MAX, hi_el = -1;
          for (int64_t f = fb; f < fe; ++f) {
            Shape g = Unravel(target.box.shape, f);
            bool inside = true;
            for (size_t d = 0; d < g.size(); ++d) {
              g[d] += target.box.offset[d] - sh.box.offset[d];
              inside = inside && g[d] >= 0 && g[d] < sh.box.shape[d];
            }
            if (!inside) continue;
            const int64_t sf = Ravel(sh.box.shape, g);
            if (sf < sfb || sf >= sfe) continue;
            lo_el = std::min(lo_el, sf);
            hi_el = std::max(hi_el, sf);
          }
          if (hi_el < 0) continue;
          shards_of_file[sh.file].insert(&sh);
          const uint64_t isz = DTypeSize(sh.dtype);
          spans[sh.file].push_back({sh.data_offset + (lo_el - sfb) * isz,
                                    sh.data_offset + (hi_el + 1 - sfb) * isz});
        }
      }
    }
    uint64_t expect_read = 0;
    int64_t expect_checks = 0;
    const uint64_t cblock = res->checkpoint.metadata.checksum_block;
    for (auto& [file, v] : spans) {
      std::sort(v.begin(), v.end());
      std::vector<std::pair<uint64_t, uint64_t>> merged;
      for (const auto& sp : v) {
        if (!merged.empty() && sp.first <= merged.back().second + lo.plan.coalesce_gap) {
          merged.back().second = std::max(merged.back().second, sp.second);
        } else {
          merged.push_back(sp);
        }
      }
      for (const auto& m : merged) expect_read += m.second - m.first;
      for (const ShardMeta* sh : shards_of_file[file]) {
        for (size_t b = 0; b < sh->xxh3.size(); ++b) {
          const uint64_t bb = sh->data_offset + b * cblock;
          const uint64_t be = std::min(bb + cblock, sh->data_offset + sh->nbytes);
          for (const auto& m : merged) {
            if (m.first <= bb && be <= m.second) {
              ++expect_checks;
              break;
            }
          }
        }
      }
    }
    EXPECT_EQ(res->stats.bytes_read, expect_read)
        << "seed " << seed << "\nsave layout " << LayoutToJson(save) << "\nload layout "
        << LayoutToJson(load);
    // A read cut below the block size (max_read_bytes < checksum_block)
    // cannot verify the blocks it cuts; otherwise cuts fall on block
    // boundaries and every whole block is checked.
    if (lo.plan.max_read_bytes == 0 || lo.plan.max_read_bytes >= cblock) {
      EXPECT_EQ(res->stats.checksums_verified, expect_checks) << "seed " << seed;
    } else {
      EXPECT_LE(res->stats.checksums_verified, expect_checks) << "seed " << seed;
    }
    for (const auto& r : res->plan.reads) {
      if (lo.plan.max_read_bytes >= 8) {
        EXPECT_LE(r.length, lo.plan.max_read_bytes);
      }
    }
    ++cases;
  }
  EXPECT_EQ(cases, 250);
}

// One read that many ranks need a column each of: its copies' runs
// interleave row by row, more copies than the executor merges one by one
// (it sorts them all instead).
TEST(ReshardManyCopies, ColumnsOfOneReadForSixteenRanksLandExactly) {
  testing::TempDir tmp;
  // Runs of 512 bytes: the read goes by runs (not copy by copy).
  const int64_t rows = 48, cols = 2048, world = 16;
  std::vector<float> full(rows * cols);
  for (size_t i = 0; i < full.size(); ++i) full[i] = static_cast<float>(i) * 0.5f;
  const std::string src = tmp.Sub("src"), dst = tmp.Sub("dst");
  ASSERT_TRUE(MakeDirs(src).ok());
  ASSERT_TRUE(WriteSafetensors(src + "/model.safetensors",
                               {{"w", DType::kF32, {rows, cols},
                                 reinterpret_cast<const uint8_t*>(full.data())}},
                               {})
                  .ok());
  Layout save;
  save.world_size = 1;
  save.ranks.push_back(RankTargets{0, {{"w", DType::kF32, {rows, cols}, Box{{0, 0}, {rows, cols}},
                                        std::nullopt}}});
  ASSERT_TRUE(ShardCheckpoint(src, save, dst, ShardOptions{}).ok());
  Layout load;
  load.world_size = world;
  const int64_t width = cols / world;
  for (int r = 0; r < world; ++r) {
    load.ranks.push_back(RankTargets{
        r, {{"w", DType::kF32, {rows, cols}, Box{{0, r * width}, {rows, width}}, std::nullopt}}});
  }
  for (bool remote : {false, true}) {
    OfflineLoadOptions lo;
    lo.threads = 1;
    lo.piece_bytes = 4000;  // the read in pieces: segments taken up in offset order
    lo.fill_byte = 0xff;
    lo.via_process_memory = remote;
    auto res = LoadOffline(dst, load, lo);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->plan.reads.size(), 1u);
    for (int r = 0; r < world; ++r) {
      std::vector<float> want;
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = r * width; j < (r + 1) * width; ++j) want.push_back(full[i * cols + j]);
      }
      const std::vector<uint8_t>& got = res->buffers[r].tensors[0];
      ASSERT_EQ(got.size(), want.size() * sizeof(float));
      EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size()), 0) << "rank " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Blocks, ReshardProperty, ::testing::Range(0, 12));

}  // namespace
}  // namespace ckpt
