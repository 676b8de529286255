// Checkpoint format, versions, planner semantics, merge, and every bad input
// the foundation must turn into a clear error.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>

#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "core/format/checkpoint.h"
#include "core/io/file.h"
#include "core/tools/layout.h"
#include "core/tools/offline.h"
#include "core/plan/planner.h"
#include "core/format/safetensors.h"
#include "core/write/writer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/files.h"
#include "tests/testing/temp_dir.h"

namespace ckpt {
namespace {

using ::testing::HasSubstr;
using ::testing::ElementsAre;
namespace fs = std::filesystem;

using ckpt::testing::Slurp;
using ckpt::testing::Spit;

std::vector<float> Arange(int n) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), 0.f);
  return v;
}

TargetTensor Target(const std::string& name, Shape global, Shape offset, Shape shape,
                    DType dtype = DType::kF32) {
  return TargetTensor{name, dtype, std::move(global), Box{std::move(offset), std::move(shape)},
                      std::nullopt};
}

// A HuggingFace-style source directory holding `w` = arange(32).reshape(4,8).
std::string MakeSource(const testing::TempDir& tmp, const std::vector<float>& w) {
  std::string dir = tmp.Sub("src");
  EXPECT_TRUE(MakeDirs(dir).ok());
  EXPECT_TRUE(WriteSafetensors(dir + "/model.safetensors",
                               {{"w", DType::kF32, {4, 8}, w.data()}}, {})
                  .ok());
  return dir;
}

Layout TwoRankRows() {
  Layout l;
  l.world_size = 2;
  l.ranks = {{0, {Target("w", {4, 8}, {0, 0}, {2, 8})}},
             {1, {Target("w", {4, 8}, {2, 0}, {2, 8})}}};
  return l;
}

// --- The spec's examples ----------------------------------------------------

TEST(SpecExamples, Shard0ToShard1) {
  testing::TempDir tmp;
  auto w = Arange(32);
  std::string src = MakeSource(tmp, w);
  ASSERT_TRUE(ShardCheckpoint(src, TwoRankRows(), tmp.Sub("ckpt"), {}).ok());
  Layout load;
  load.world_size = 2;
  load.ranks = {{0, {Target("w", {4, 8}, {0, 0}, {4, 4})}},
                {1, {Target("w", {4, 8}, {0, 4}, {4, 4})}}};
  auto res = LoadOffline(tmp.Sub("ckpt"), load, {});
  ASSERT_TRUE(res.ok()) << res.status();
  for (int r = 0; r < 2; ++r) {
    // Two copies per rank: (2,4) from each saved shard.
    ASSERT_EQ(res->plan.ranks[r].copies.size(), 2u);
    for (const CopyOp& c : res->plan.ranks[r].copies) EXPECT_EQ(c.region.shape, (Shape{2, 4}));
    const float* out = reinterpret_cast<const float*>(res->buffers[r].tensors[0].data());
    for (int i = 0; i < 4; ++i) {
      for (int j = 0; j < 4; ++j) ASSERT_EQ(out[i * 4 + j], w[i * 8 + 4 * r + j]);
    }
  }
  // Every byte read once.
  EXPECT_EQ(res->stats.bytes_read, 32u * 4);
}

TEST(SpecExamples, FlattenedFourBySix) {
  testing::TempDir tmp;
  auto p = Arange(24);
  std::string src = tmp.Sub("src");
  ASSERT_TRUE(MakeDirs(src).ok());
  ASSERT_TRUE(WriteSafetensors(src + "/model.safetensors", {{"p", DType::kF32, {4, 6}, p.data()}}, {})
                  .ok());
  Layout save;
  save.world_size = 2;
  TargetTensor a = Target("p", {4, 6}, {0, 0}, {4, 6}), b = a;
  a.flat_range = FlatRange{0, 10};
  b.flat_range = FlatRange{10, 24};
  save.ranks = {{0, {a}}, {1, {b}}};
  ASSERT_TRUE(ShardCheckpoint(src, save, tmp.Sub("ckpt"), {}).ok());
  auto ckpt = OpenCheckpoint(tmp.Sub("ckpt"));
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  ASSERT_EQ(ckpt->metadata.tensors.at("p").shards.size(), 2u);
  // Load as rows (a plain reshard of flattened shards) and as the same ranges.
  Layout load;
  load.world_size = 2;
  load.ranks = {{0, {Target("p", {4, 6}, {0, 0}, {2, 6})}}, {1, {b}}};
  auto res = LoadOffline(tmp.Sub("ckpt"), load, {});
  ASSERT_TRUE(res.ok()) << res.status();
  const float* r0 = reinterpret_cast<const float*>(res->buffers[0].tensors[0].data());
  for (int i = 0; i < 12; ++i) EXPECT_EQ(r0[i], p[i]);
  const float* r1 = reinterpret_cast<const float*>(res->buffers[1].tensors[0].data());
  for (int i = 0; i < 14; ++i) EXPECT_EQ(r1[i], p[10 + i]);
  EXPECT_TRUE(res->plan.ranks[1].local_fast_path);
  EXPECT_FALSE(res->plan.ranks[0].local_fast_path);
}

// --- Formats and versions ---------------------------------------------------

TEST(Checkpoint, NativeFilesAreSafetensorsWithGlobalInfo) {
  testing::TempDir tmp;
  std::string src = MakeSource(tmp, Arange(32));
  ASSERT_TRUE(ShardCheckpoint(src, TwoRankRows(), tmp.Sub("ckpt"), {}).ok());
  auto f = OpenFile(tmp.Sub("ckpt/1_0.safetensors"));
  ASSERT_TRUE(f.ok());
  auto h = ReadSafetensorsHeader(**f);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->data_start % 4096, 0u);
  auto info = nlohmann::json::parse(h->metadata.at("ckptd.tensor.w"));
  EXPECT_EQ(info["global_shape"], nlohmann::json({4, 8}));
  EXPECT_EQ(info["global_offset"], nlohmann::json({2, 0}));
  auto m = nlohmann::json::parse(Slurp(tmp.Sub("ckpt/0.metadata")));
  EXPECT_EQ(m["format"], "ckptd.checkpoint");
  EXPECT_EQ(m["version"], 1);
  EXPECT_EQ(m["tensors"]["w"]["shards"].size(), 2u);
  EXPECT_TRUE(m["tensors"]["w"]["shards"][0].contains("xxh3"));
}

TEST(Checkpoint, VersionsMatchExactlyAndNewestIsDefault) {
  testing::TempDir tmp;
  std::string src = MakeSource(tmp, Arange(32));
  for (int64_t uid : {1, 11, 3}) {
    ShardOptions so;
    so.unique_id = uid;
    ASSERT_TRUE(ShardCheckpoint(src, TwoRankRows(), tmp.Sub("ckpt"), so).ok());
  }
  auto c = OpenCheckpoint(tmp.Sub("ckpt"));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(*c->unique_id, 11);
  EXPECT_THAT(c->versions, ElementsAre(1, 3, 11));
  OpenOptions oo;
  oo.unique_id = 1;
  c = OpenCheckpoint(tmp.Sub("ckpt"), oo);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->metadata_file, "1.metadata");
  EXPECT_THAT(c->data_files, ElementsAre("0_1.safetensors", "1_1.safetensors"));
  oo.unique_id = 2;
  c = OpenCheckpoint(tmp.Sub("ckpt"), oo);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(c.status().message(), HasSubstr("no version 2"));
  // uid 1 removed: must not fall back to 11.metadata.
  fs::remove(tmp.Sub("ckpt/1.metadata"));
  oo.unique_id = 1;
  EXPECT_FALSE(OpenCheckpoint(tmp.Sub("ckpt"), oo).ok());
}

TEST(Checkpoint, DistcpAndSafetensorsTogetherIsAnError) {
  testing::TempDir tmp;
  std::string src = MakeSource(tmp, Arange(32));
  ASSERT_TRUE(ShardCheckpoint(src, TwoRankRows(), tmp.Sub("ckpt"), {}).ok());
  Spit(tmp.Sub("ckpt/0_0.distcp"), "x");
  auto c = OpenCheckpoint(tmp.Sub("ckpt"));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(c.status().message(), HasSubstr("both .distcp and .safetensors"));
}

TEST(Checkpoint, HuggingFaceIndexDirectory) {
  testing::TempDir tmp;
  std::string dir = tmp.Sub("hf");
  ASSERT_TRUE(MakeDirs(dir).ok());
  auto a = Arange(6), b = Arange(4);
  ASSERT_TRUE(WriteSafetensors(dir + "/model-00001-of-00002.safetensors",
                               {{"a", DType::kF32, {2, 3}, a.data()}}, {})
                  .ok());
  ASSERT_TRUE(WriteSafetensors(dir + "/model-00002-of-00002.safetensors",
                               {{"b", DType::kF32, {4}, b.data()}}, {})
                  .ok());
  Spit(dir + "/model.safetensors.index.json",
       R"({"metadata":{"total_size":40},"weight_map":{"a":"model-00001-of-00002.safetensors",)"
       R"("b":"model-00002-of-00002.safetensors"}})");
  auto before = fs::directory_iterator(dir);
  size_t n_before = std::distance(before, fs::directory_iterator());
  auto c = OpenCheckpoint(dir);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->format, CheckpointFormat::kHuggingFace);
  EXPECT_EQ(c->metadata.tensors.size(), 2u);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()),
            static_cast<long>(n_before));  // nothing written
  Layout l;
  l.world_size = 1;
  l.ranks = {{0, {Target("a", {2, 3}, {1, 1}, {1, 2}), Target("missing", {2}, {0}, {2})}}};
  auto res = LoadOffline(dir, l, {});
  ASSERT_TRUE(res.ok()) << res.status();
  const float* out = reinterpret_cast<const float*>(res->buffers[0].tensors[0].data());
  EXPECT_EQ(out[0], 4.f);
  EXPECT_EQ(out[1], 5.f);
  EXPECT_THAT(res->plan.missing_keys, ElementsAre("missing"));
  EXPECT_THAT(res->plan.unexpected_keys, ElementsAre("b"));
  // Only the needed bytes: one row's two floats.
  EXPECT_EQ(res->stats.bytes_read, 8u);
}

TEST(Planner, MasterWeightNameCompatibility) {
  EXPECT_EQ(MasterWeightAlias("opt.master_weights.linear_0.w_0"), "opt.linear_0.w_0_fp32_master_0");
  EXPECT_EQ(MasterWeightAlias("opt.linear_0.w_0_fp32_master_0"), "opt.master_weights.linear_0.w_0");
  EXPECT_EQ(MasterWeightAlias("linear_0.w_0"), "");
  CheckpointMetadata m;
  TensorMeta t;
  t.global_shape = {2};
  ShardMeta s;
  s.file = "0_0.safetensors";
  s.box = Box{{0}, {2}};
  s.nbytes = 8;
  t.shards.push_back(s);
  m.tensors["opt.linear_0.w_0_fp32_master_0"] = t;
  auto plan = PlanLoad(m, {{0, {Target("opt.master_weights.linear_0.w_0", {2}, {0}, {2})}}});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->missing_keys.empty());
  EXPECT_TRUE(plan->unexpected_keys.empty());
  EXPECT_EQ(plan->renamed_keys.at("opt.master_weights.linear_0.w_0"),
            "opt.linear_0.w_0_fp32_master_0");
}

TEST(Planner, ReplicasAboveZeroAreIgnoredAndReadsAreShared) {
  CheckpointMetadata m;
  TensorMeta t;
  t.global_shape = {4};
  for (int rep = 0; rep < 3; ++rep) {
    ShardMeta s;
    s.file = absl::StrCat(rep, "_0.safetensors");
    s.box = Box{{0}, {4}};
    s.nbytes = 16;
    s.data_offset = 4096;
    s.replica_id = rep;
    t.shards.push_back(s);
  }
  m.tensors["w"] = t;
  ASSERT_TRUE(ValidateMetadata(m, "test").ok());
  std::vector<RankTargets> ranks;
  for (int r = 0; r < 4; ++r) ranks.push_back({r, {Target("w", {4}, {r}, {1})}});
  auto plan = PlanLoad(m, ranks);
  ASSERT_TRUE(plan.ok());
  EXPECT_THAT(plan->files, ElementsAre("0_0.safetensors"));
  ASSERT_EQ(plan->reads.size(), 1u);  // four ranks, one read
  EXPECT_EQ(plan->reads[0].length, 16u);
}

TEST(Writer, ReplicasWrittenOnceBalancedByBytes) {
  std::vector<RankTargets> ranks;
  // Two ranks each hold a big private shard and a small replicated tensor;
  // rank 1's private shard is smaller, so it writes the replica.
  ranks.push_back({0, {Target("big", {10, 4}, {0, 0}, {6, 4}), Target("b", {4}, {0}, {4})}});
  ranks.push_back({1, {Target("big", {10, 4}, {6, 0}, {4, 4}), Target("b", {4}, {0}, {4})}});
  auto plan = PlanSave(ranks, 2, 0);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->writes[0].size(), 1u);
  ASSERT_EQ(plan->writes[1].size(), 2u);
  EXPECT_EQ(plan->writes[1][0].name, "b");
}

TEST(Writer, ReplicasBalancedByNodeBytesAcrossNodes) {
  // Node 0 serves ranks 0-2, node 1 rank 3. Four 16-element replicas held by
  // every rank: by rank bytes, node 0 (3 ranks) would write three of them;
  // by node bytes each node writes two.
  std::vector<RankTargets> ranks;
  for (int r = 0; r < 4; ++r) {
    ranks.push_back({r, {Target("a", {16}, {0}, {16}), Target("b", {16}, {0}, {16}),
                         Target("c", {16}, {0}, {16}), Target("d", {16}, {0}, {16})}});
  }
  auto plan = PlanSave(ranks, 4, 0, std::vector<int>{0, 0, 0, 1});
  ASSERT_TRUE(plan.ok()) << plan.status();
  size_t node0 = 0;
  for (int r = 0; r < 3; ++r) node0 += plan->writes[r].size();
  EXPECT_EQ(node0, 2u);
  EXPECT_EQ(plan->writes[3].size(), 2u);
  // Every replica written exactly once.
  std::set<std::string> names;
  for (const auto& w : plan->writes) {
    for (const auto& t : w) EXPECT_TRUE(names.insert(t.name).second) << t.name;
  }
  EXPECT_EQ(names.size(), 4u);
  // A node list that does not cover the world is refused.
  EXPECT_FALSE(PlanSave(ranks, 4, 0, std::vector<int>{0, 0, 1}).ok());
}

TEST(Merge, HuggingFaceShardsAndIndex) {
  testing::TempDir tmp;
  std::string src = tmp.Sub("src");
  ASSERT_TRUE(MakeDirs(src).ok());
  auto a = Arange(8), b = Arange(4), c = Arange(2);
  ASSERT_TRUE(WriteSafetensors(src + "/model.safetensors",
                               {{"model.a", DType::kF32, {2, 4}, a.data()},
                                {"model.b", DType::kF32, {4}, b.data()},
                                {"model.a.moment1_0", DType::kF32, {2}, c.data()},
                                {"other", DType::kF32, {2}, c.data()}},
                               {})
                  .ok());
  Layout l;
  l.world_size = 2;
  l.ranks = {{0, {Target("model.a", {2, 4}, {0, 0}, {1, 4}), Target("model.b", {4}, {0}, {4}),
                  Target("model.a.moment1_0", {2}, {0}, {2}), Target("other", {2}, {0}, {2})}},
             {1, {Target("model.a", {2, 4}, {1, 0}, {1, 4}), Target("model.b", {4}, {0}, {4})}}};
  ASSERT_TRUE(ShardCheckpoint(src, l, tmp.Sub("ckpt"), {}).ok());
  auto ck = OpenCheckpoint(tmp.Sub("ckpt"));
  ASSERT_TRUE(ck.ok());
  MergeOptions mo;
  mo.prefix = "model";
  mo.skip_postfix = {"moment1_0"};
  mo.shards = 2;
  auto rep = MergeToHuggingFace(*ck, tmp.Sub("merged"), mo);
  ASSERT_TRUE(rep.ok()) << rep.status();
  EXPECT_THAT(rep->files, ElementsAre("model-00001-of-00002.safetensors",
                                      "model-00002-of-00002.safetensors"));
  auto index = nlohmann::json::parse(Slurp(tmp.Sub("merged/model.safetensors.index.json")));
  EXPECT_EQ(index["metadata"]["total_size"], 48);
  EXPECT_EQ(index["weight_map"]["a"], "model-00001-of-00002.safetensors");
  EXPECT_EQ(index["weight_map"]["b"], "model-00002-of-00002.safetensors");
  EXPECT_EQ(index["weight_map"].size(), 2u);
  // The merged directory is itself a loadable HF checkpoint with the values.
  auto merged = OpenCheckpoint(tmp.Sub("merged"));
  ASSERT_TRUE(merged.ok()) << merged.status();
  Layout whole;
  whole.world_size = 1;
  whole.ranks = {{0, {Target("a", {2, 4}, {0, 0}, {2, 4})}}};
  auto res = LoadOffline(tmp.Sub("merged"), whole, {});
  ASSERT_TRUE(res.ok());
  EXPECT_EQ(std::memcmp(res->buffers[0].tensors[0].data(), a.data(), 32), 0);
}

// --- Bad input ----------------------------------------------------------------

class BadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    src_ = MakeSource(tmp_, Arange(32));
    ckpt_ = tmp_.Sub("ckpt");
    ASSERT_TRUE(ShardCheckpoint(src_, TwoRankRows(), ckpt_, {}).ok());
  }
  absl::Status Load(uint64_t piece_bytes = OfflineLoadOptions{}.piece_bytes,
                    DirectIo direct_io = DirectIo::kNever) {
    Layout l;
    l.world_size = 1;
    l.ranks = {{0, {Target("w", {4, 8}, {0, 0}, {4, 8})}}};
    OfflineLoadOptions options;
    options.piece_bytes = piece_bytes;
    options.direct_io = direct_io;
    auto res = LoadOffline(ckpt_, l, options);
    if (res.ok()) {
      absl::Status s = WriteRankOutputs(*res, tmp_.Sub("out"));
      if (!s.ok()) return s;
    }
    return res.status();
  }
  nlohmann::json Meta() { return nlohmann::json::parse(Slurp(ckpt_ + "/0.metadata")); }
  void SetMeta(const nlohmann::json& j) { Spit(ckpt_ + "/0.metadata", j.dump()); }
  void ExpectError(absl::Status s, const std::string& needle) {
    EXPECT_FALSE(s.ok());
    EXPECT_THAT(std::string(s.message()), HasSubstr(needle)) << s;
    EXPECT_FALSE(fs::exists(tmp_.Sub("out"))) << "output written despite the error";
  }

  testing::TempDir tmp_;
  std::string src_, ckpt_;
};

absl::Status HeaderStatus(const std::string& path) {
  auto f = OpenFile(path);
  if (!f.ok()) return f.status();
  return ReadSafetensorsHeader(**f).status();
}

std::string WithHeader(const std::string& json, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = json.size();
  std::memcpy(out.data(), &n, 8);
  return out + json + data;
}

TEST_F(BadInput, TruncatedSafetensors) {
  std::string data = Slurp(ckpt_ + "/0_0.safetensors");
  Spit(ckpt_ + "/0_0.safetensors", data.substr(0, data.size() - 5));
  ExpectError(Load(), "0_0.safetensors");
  Spit(tmp_.Sub("short.safetensors"), "abc");
  EXPECT_THAT(std::string(HeaderStatus(tmp_.Sub("short.safetensors")).message()),
              HasSubstr("shorter than the 8-byte header length"));
  Spit(tmp_.Sub("h.safetensors"), data.substr(0, 100));
  EXPECT_THAT(std::string(HeaderStatus(tmp_.Sub("h.safetensors")).message()), HasSubstr("truncated"));
}

TEST_F(BadInput, CorruptHeaderJson) {
  Spit(tmp_.Sub("x.safetensors"), WithHeader("{\"w\": {\"dtype\": \"F32\", ", ""));
  absl::Status s = HeaderStatus(tmp_.Sub("x.safetensors"));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), HasSubstr("x.safetensors: invalid safetensors file: header is not valid JSON"));
}

TEST(Metadata, OverlapFoundAlongTheAxisShardsAreCutOn) {
  auto columns = [](int64_t rows, std::vector<std::pair<int64_t, int64_t>> cuts) {
    TensorMeta t;
    t.dtype = DType::kF32;
    t.global_shape = {rows, 0};
    uint64_t off = 0;
    for (const auto& [col, n] : cuts) {
      ShardMeta s;
      s.file = "0_0.safetensors";
      s.box = Box{{0, col}, {rows, n}};
      s.dtype = DType::kF32;
      s.data_offset = off;
      s.nbytes = static_cast<uint64_t>(rows * n) * 4;
      off += s.nbytes;
      t.global_shape[1] = std::max(t.global_shape[1], col + n);
      t.shards.push_back(s);
    }
    CheckpointMetadata m;
    m.tensors["w"] = t;
    return m;
  };
  // Columns [0, 4) and [3, 7) of 8: as many elements as the tensor has, so
  // only the overlap check can tell.
  auto bad = columns(4, {{0, 4}, {3, 4}});
  bad.tensors["w"].global_shape = {4, 8};
  absl::Status s = ValidateMetadata(bad, "m.metadata");
  EXPECT_THAT(std::string(s.message()), HasSubstr("overlap")) << s;
  // 4,096 column shards of one tensor (every shard shares axis-0's offset).
  std::vector<std::pair<int64_t, int64_t>> cuts;
  for (int64_t c = 0; c < 4096; ++c) cuts.push_back({c, 1});
  EXPECT_TRUE(ValidateMetadata(columns(2, cuts), "m.metadata").ok());
  // Column 100 missing, column 101 twice: the counts agree, the sweep
  // finds the pair.
  cuts[100] = {101, 1};
  s = ValidateMetadata(columns(2, cuts), "m.metadata");
  EXPECT_THAT(std::string(s.message()), HasSubstr("shards 100 (2,1)@(0,101) and 101 (2,1)@(0,101) overlap"))
      << s;
}

TEST_F(BadInput, DuplicateTensorInHeader) {
  Spit(tmp_.Sub("d.safetensors"),
       WithHeader(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                  R"("w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                  std::string(8, 'x')));
  absl::Status s = HeaderStatus(tmp_.Sub("d.safetensors"));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), HasSubstr("d.safetensors: invalid safetensors file: "
                                                  "tensor 'w' appears twice"));
}

TEST_F(BadInput, LyingOffsets) {
  Spit(tmp_.Sub("a.safetensors"),
       WithHeader(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,80]}})", std::string(8, 'x')));
  EXPECT_THAT(std::string(HeaderStatus(tmp_.Sub("a.safetensors")).message()),
              HasSubstr("tensor 'w' has data_offsets [0, 80) past the end of the data"));
  Spit(tmp_.Sub("b.safetensors"),
       WithHeader(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(8, 'x')));
  EXPECT_THAT(std::string(HeaderStatus(tmp_.Sub("b.safetensors")).message()),
              HasSubstr("tensor 'w' holds 8 bytes but F32[3] needs 12"));
  Spit(tmp_.Sub("c.safetensors"),
       WithHeader(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                  R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                  std::string(12, 'x')));
  EXPECT_THAT(std::string(HeaderStatus(tmp_.Sub("c.safetensors")).message()), HasSubstr("overlaps"));
  // Metadata pointing at bytes the file does not hold there.
  auto m = Meta();
  m["tensors"]["w"]["shards"][0]["data_offset"] = 4100;
  SetMeta(m);
  ExpectError(Load(), "no tensor at bytes [4100");
}

TEST_F(BadInput, HeaderOverTheCap) {
  std::string data(8, '\0');
  uint64_t n = kMaxSafetensorsHeader + 1;
  std::memcpy(data.data(), &n, 8);
  Spit(tmp_.Sub("big.safetensors"), data + "{}");
  EXPECT_THAT(std::string(HeaderStatus(tmp_.Sub("big.safetensors")).message()),
              HasSubstr("exceeds the limit"));
}

TEST_F(BadInput, ShapeProductOverflows) {
  Spit(tmp_.Sub("o.safetensors"),
       WithHeader(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", ""));
  EXPECT_THAT(std::string(HeaderStatus(tmp_.Sub("o.safetensors")).message()), HasSubstr("overflows"));
  auto m = Meta();
  m["tensors"]["w"]["global_shape"] = {int64_t{1} << 40, int64_t{1} << 40};
  SetMeta(m);
  ExpectError(Load(), "overflows");
}

TEST_F(BadInput, DtypeMismatchBetweenMetadataAndFile) {
  auto m = Meta();
  m["tensors"]["w"]["dtype"] = "I32";
  SetMeta(m);
  ExpectError(Load(), "tensor 'w': metadata says I32 but the file holds F32");
}

TEST_F(BadInput, UnknownDtype) {
  auto m = Meta();
  m["tensors"]["w"]["dtype"] = "complex64";
  SetMeta(m);
  ExpectError(Load(), "tensor 'w': unknown dtype 'complex64'");
  EXPECT_FALSE(ParseLayout("l.json",
                           R"({"world_size":1,"ranks":[{"rank":0,"tensors":[{"name":"w","dtype":"Q8",)"
                           R"("global_shape":[2]}]}]})")
                   .ok());
}

TEST_F(BadInput, ShardFileMissing) {
  fs::remove(ckpt_ + "/1_0.safetensors");
  auto c = OpenCheckpoint(ckpt_);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  ExpectError(c.status(), "data file '1_0.safetensors' named by the metadata cannot be opened");
}

TEST_F(BadInput, MetadataNamingFilesOutsideTheDirectory) {
  for (const char* bad : {"../x.safetensors", "/etc/passwd", "..", "sub/0_0.safetensors"}) {
    auto m = Meta();
    m["tensors"]["w"]["shards"][0]["file"] = bad;
    SetMeta(m);
    ExpectError(Load(), "is not a plain file name inside the checkpoint directory");
  }
}

TEST_F(BadInput, OverlappingAndIncompleteCoverage) {
  auto m = Meta();
  m["tensors"]["w"]["shards"][1]["offset"] = {1, 0};
  SetMeta(m);
  ExpectError(Load(), "overlap");
  m = Meta();
  m["tensors"]["w"]["shards"].erase(1);
  SetMeta(m);
  ExpectError(Load(), "incomplete coverage");
}

TEST_F(BadInput, LayoutBoxOutsideGlobalShape) {
  auto l = ParseLayout("l.json",
                       R"({"world_size":1,"ranks":[{"rank":0,"tensors":[{"name":"w","dtype":"F32",)"
                       R"("global_shape":[4,8],"offset":[3,0],"shape":[2,8]}]}]})");
  EXPECT_THAT(std::string(l.status().message()),
              HasSubstr("l.json: invalid layout: rank 0 tensor 'w': box (2,8)@(3,0) lies outside "
                        "the global shape [4,8]"));
  auto missing_rank = ParseLayout("l.json", R"({"world_size":2,"ranks":[{"rank":0}]})");
  EXPECT_THAT(std::string(missing_rank.status().message()), HasSubstr("rank 1 of world_size 2 is missing"));
  // A global shape that disagrees with the checkpoint.
  Layout wrong;
  wrong.world_size = 1;
  wrong.ranks = {{0, {Target("w", {4, 9}, {0, 0}, {4, 9})}}};
  auto res = LoadOffline(ckpt_, wrong, {});
  EXPECT_THAT(std::string(res.status().message()),
              HasSubstr("rank 0 tensor 'w': requested global shape [4,9] but the checkpoint has [4,8]"));
}

TEST_F(BadInput, CorruptDataFailsChecksum) {
  int fd = ::open((ckpt_ + "/1_0.safetensors").c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::pwrite(fd, "\xff\xff", 2, 4096 + 10), 2);
  ::close(fd);
  ExpectError(Load(), "1_0.safetensors: tensor 'w' bytes [4096, 4160) fail their checksum");
  // The same from the piece-wise reader with one piece per 64 bytes, and
  // reading around the page cache.
  ExpectError(Load(64), "1_0.safetensors: tensor 'w' bytes [4096, 4160) fail their checksum");
  ExpectError(Load(64, DirectIo::kAlways),
              "1_0.safetensors: tensor 'w' bytes [4096, 4160) fail their checksum");
}

TEST(File, DirectReadsMatchBufferedAndReportTruncation) {
  testing::TempDir tmp;
  const std::string path = tmp.Sub("f.bin");
  std::string data(3 * kDirectAlign + 100, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7 + 3);
  Spit(path, data);
  auto f = OpenFile(path);
  ASSERT_TRUE(f.ok());
  void* mem = nullptr;
  ASSERT_EQ(::posix_memalign(&mem, kDirectAlign, 4 * kDirectAlign), 0);
  std::unique_ptr<char, decltype(&std::free)> buf(static_cast<char*>(mem), &std::free);
  // The last page ends inside the request: fewer bytes, no error.
  auto got = (*f)->ReadDirect(0, 4 * kDirectAlign, buf.get());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, data.size());
  EXPECT_EQ(std::string(buf.get(), data.size()), data);
  got = (*f)->ReadDirect(kDirectAlign, kDirectAlign, buf.get());
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(std::string(buf.get(), kDirectAlign), data.substr(kDirectAlign, kDirectAlign));
  // Shorter than when it was opened: truncated, named.
  ASSERT_EQ(::truncate(path.c_str(), kDirectAlign), 0);
  got = (*f)->ReadDirect(kDirectAlign, kDirectAlign, buf.get());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kOutOfRange) << got.status();
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("f.bin: truncated"));
}

TEST(File, CachedProbeAgreesWithMincore) {
  testing::TempDir tmp;
  const std::string path = tmp.Sub("f.bin");
  Spit(path, std::string(8u << 20, 'x'));
  auto f = OpenFile(path);
  ASSERT_TRUE(f.ok());
  const uint64_t n = (*f)->size();
  // What the page cache holds of the pages Cached() probes, by mincore.
  auto resident = [&] {
    int fd = ::open(path.c_str(), O_RDONLY);
    void* m = ::mmap(nullptr, n, PROT_READ, MAP_SHARED, fd, 0);
    std::vector<unsigned char> vec((n + 4095) / 4096);
    ::mincore(m, n, vec.data());
    ::munmap(m, n);
    ::close(fd);
    return (vec.front() & 1) && (vec[vec.size() / 2] & 1) && (vec.back() & 1);
  };
  // The page cache is shared with everything else on the machine (reclaim,
  // readahead, other tests), so one observation can disagree with the probe
  // made a moment later; each state gets a few tries and must agree in one.
  // A probe that always says "cached" (or never) still fails: a full read
  // makes every page resident, and POSIX_FADV_DONTNEED drops clean pages on
  // a disk file system.
  std::string all(n, '\0');
  std::string tries;
  bool agreed_after_read = false;
  for (int attempt = 0; attempt < 5 && !agreed_after_read; ++attempt) {
    ASSERT_TRUE((*f)->Read(0, n, all.data()).ok());
    const bool was_resident = resident();
    const bool cached = (*f)->Cached(0, n);
    agreed_after_read = was_resident && cached;
    absl::StrAppend(&tries, " after read: mincore ", was_resident, " probe ", cached, ";");
  }
  EXPECT_TRUE(agreed_after_read) << tries;
  bool agreed_after_drop = false;
  for (int attempt = 0; attempt < 5 && !agreed_after_drop; ++attempt) {
    int fd = ::open(path.c_str(), O_RDONLY);
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
    // mincore first: a RWF_NOWAIT probe of a page not in the page cache fails
    // with EAGAIN but starts readahead of it, so resident() after Cached()
    // could see pages the probe itself brought in.
    const bool was_resident = resident();
    const bool cached = (*f)->Cached(0, n);
    agreed_after_drop = was_resident == cached;
    absl::StrAppend(&tries, " after drop: mincore ", was_resident, " probe ", cached, ";");
  }
  EXPECT_TRUE(agreed_after_drop) << tries;
}

TEST_F(BadInput, FailedShardLeavesNoMetadata) {
  Layout l = TwoRankRows();
  l.ranks[1].tensors[0].name = "nope";
  absl::Status s = ShardCheckpoint(src_, l, tmp_.Sub("ckpt2"), {});
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(s.message()), HasSubstr("nope"));
  EXPECT_FALSE(fs::exists(tmp_.Sub("ckpt2/0.metadata")));
  // Incomplete coverage on save is refused before the metadata is written.
  Layout half;
  half.world_size = 1;
  half.ranks = {{0, {Target("w", {4, 8}, {0, 0}, {2, 8})}}};
  s = ShardCheckpoint(src_, half, tmp_.Sub("ckpt3"), {});
  EXPECT_THAT(std::string(s.message()), HasSubstr("incomplete coverage"));
  EXPECT_FALSE(fs::exists(tmp_.Sub("ckpt3/0.metadata")));
  for (const auto& e : fs::directory_iterator(tmp_.Sub("ckpt3"))) {
    EXPECT_EQ(e.path().string().find(".tmp."), std::string::npos) << e.path();
  }
}

TEST_F(BadInput, UnconvertibleTargetDtype) {
  Layout l;
  l.world_size = 1;
  l.ranks = {{0, {Target("w", {4, 8}, {0, 0}, {4, 8}, DType::kI8)}}};
  auto res = LoadOffline(ckpt_, l, {});
  EXPECT_THAT(std::string(res.status().message()),
              HasSubstr("rank 0 tensor 'w': the checkpoint holds F32, which cannot be converted to "
                        "the requested I8"));
}

// A strict load's error names the first eight missing keys and how many.
TEST(MissingKeysText, NamesTheFirstEightAndTheCount) {
  EXPECT_EQ(MissingKeysText({"a", "b"}), "a, b");
  std::vector<std::string> twelve;
  for (int i = 0; i < 12; ++i) twelve.push_back("k" + std::to_string(i));
  EXPECT_EQ(MissingKeysText(twelve), "k0, k1, k2, k3, k4, k5, k6, k7, ... (12 missing)");
  EXPECT_EQ(MissingKeysText({}), "");
}

}  // namespace
}  // namespace ckpt
