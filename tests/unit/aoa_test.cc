// AOA: the statement parser, resolution into virtual metadata, and loads
// through it (offline engine) checked value by value against a dense oracle.
#include "core/plan/aoa.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/base/box.h"
#include "core/format/checkpoint.h"
#include "core/base/dtype.h"
#include "core/tools/layout.h"
#include "core/tools/offline.h"
#include "core/format/safetensors.h"
#include "core/write/writer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace ckpt {
namespace {

using ::testing::HasSubstr;

// ---------------------------------------------------------------------------
// A dense oracle.

struct Dense {
  Shape shape;
  std::vector<float> v;
  float at(const Shape& idx) const { return v[Ravel(shape, idx)]; }
};

Dense Iota(Shape shape, float base = 0) {
  Dense d{std::move(shape), {}};
  d.v.resize(NumElements(d.shape));
  for (size_t i = 0; i < d.v.size(); ++i) d.v[i] = base + static_cast<float>(i);
  return d;
}

Dense Transpose(const Dense& a, const std::vector<int>& perm) {  // out axis j = in axis perm[j]
  Dense o;
  for (int p : perm) o.shape.push_back(a.shape[p]);
  o.v.resize(a.v.size());
  for (int64_t f = 0; f < static_cast<int64_t>(o.v.size()); ++f) {
    Shape oi = Unravel(o.shape, f), ii(oi.size());
    for (size_t j = 0; j < perm.size(); ++j) ii[perm[j]] = oi[j];
    o.v[f] = a.at(ii);
  }
  return o;
}

Dense T2(const Dense& a) { return Transpose(a, {1, 0}); }

Dense Slice(const Dense& a, int axis, int64_t lo, int64_t hi) {
  Dense o;
  o.shape = a.shape;
  o.shape[axis] = hi - lo;
  o.v.resize(NumElements(o.shape));
  for (int64_t f = 0; f < static_cast<int64_t>(o.v.size()); ++f) {
    Shape i = Unravel(o.shape, f);
    i[axis] += lo;
    o.v[f] = a.at(i);
  }
  return o;
}

Dense Concat(const std::vector<Dense>& parts, int axis) {
  Dense o;
  o.shape = parts[0].shape;
  o.shape[axis] = 0;
  for (const Dense& p : parts) o.shape[axis] += p.shape[axis];
  o.v.resize(NumElements(o.shape));
  int64_t base = 0;
  for (const Dense& p : parts) {
    for (int64_t f = 0; f < static_cast<int64_t>(p.v.size()); ++f) {
      Shape i = Unravel(p.shape, f);
      i[axis] += base;
      o.v[Ravel(o.shape, i)] = p.v[f];
    }
    base += p.shape[axis];
  }
  return o;
}

// The elements of `box` (optionally a flat range of it), row-major.
std::vector<float> Extract(const Dense& a, const Box& box,
                           std::optional<FlatRange> fr = std::nullopt) {
  std::vector<float> out;
  const int64_t n = NumElements(box.shape);
  for (int64_t f = fr ? fr->begin : 0; f < (fr ? fr->end : n); ++f) {
    Shape i = Unravel(box.shape, f);
    for (size_t d = 0; d < i.size(); ++d) i[d] += box.offset[d];
    out.push_back(a.at(i));
  }
  return out;
}

// ---------------------------------------------------------------------------
// Checkpoints and loads.

struct Named {
  std::string name;
  Dense t;
  DType dtype = DType::kF32;
};

std::vector<uint8_t> Encode(const Dense& t, DType dt) {
  std::vector<uint8_t> b(t.v.size() * DTypeSize(dt));
  ConvertElements(t.v.data(), DType::kF32, b.data(), dt, t.v.size());
  return b;
}

// A HuggingFace-style directory: one model.safetensors with every tensor.
void WriteHf(const std::string& dir, const std::vector<Named>& ts) {
  ASSERT_TRUE(MakeDirs(dir).ok());
  std::vector<std::vector<uint8_t>> bufs;
  std::vector<TensorToWrite> tw;
  for (const Named& n : ts) bufs.push_back(Encode(n.t, n.dtype));
  for (size_t i = 0; i < ts.size(); ++i) tw.push_back({ts[i].name, ts[i].dtype, ts[i].t.shape, bufs[i].data()});
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", tw, {}).ok());
}

TargetTensor Target(const std::string& name, const Shape& global, Box box,
                    DType dt = DType::kF32, std::optional<FlatRange> fr = std::nullopt) {
  return TargetTensor{name, dt, global, std::move(box), fr};
}

TargetTensor Whole(const std::string& name, const Shape& global, DType dt = DType::kF32) {
  return Target(name, global, Box{Shape(global.size(), 0), global}, dt);
}

// Rank r of n owning an equal slab of `global` along `axis`.
Box Slab(const Shape& global, int axis, int r, int n) {
  Box b{Shape(global.size(), 0), global};
  b.shape[axis] = global[axis] / n;
  b.offset[axis] = r * b.shape[axis];
  return b;
}

Layout MakeLayout(std::vector<std::vector<TargetTensor>> per_rank) {
  Layout l;
  l.world_size = static_cast<int>(per_rank.size());
  for (size_t r = 0; r < per_rank.size(); ++r) l.ranks.push_back({static_cast<int>(r), per_rank[r]});
  return l;
}

std::vector<float> AsFloats(const std::vector<uint8_t>& b, DType dt) {
  std::vector<float> f(b.size() / DTypeSize(dt));
  ConvertElements(b.data(), dt, f.data(), DType::kF32, f.size());
  return f;
}

absl::StatusOr<OfflineLoadResult> Load(const std::string& dir, const Layout& layout,
                                       const std::string& aoa) {
  OfflineLoadOptions o;
  o.aoa = aoa;
  o.threads = 2;
  return LoadOffline(dir, layout, o);
}

// Every target of every rank equals the oracle's tensor of that name.
void ExpectExact(const OfflineLoadResult& res, const Layout& layout,
                 const std::map<std::string, Dense>& want) {
  for (size_t r = 0; r < layout.ranks.size(); ++r) {
    for (size_t k = 0; k < layout.ranks[r].tensors.size(); ++k) {
      const TargetTensor& t = layout.ranks[r].tensors[k];
      auto it = want.find(t.name);
      ASSERT_NE(it, want.end()) << t.name;
      EXPECT_EQ(AsFloats(res.buffers[r].tensors[k], t.dtype), Extract(it->second, t.box, t.flat_range))
          << "rank " << r << " tensor " << t.name << " box " << BoxString(t.box);
    }
  }
}

absl::StatusOr<AoaResolution> Resolve(const std::string& text, const CheckpointMetadata& md,
                                      const ModelTensors& model = {}) {
  auto p = ParseAoa(text);
  if (!p.ok()) return p.status();
  return ResolveAoa(*p, md, model);
}

// Metadata of a one-file HF-style checkpoint, without files.
CheckpointMetadata FakeMeta(const std::vector<std::pair<std::string, Shape>>& ts,
                            DType dt = DType::kF32) {
  CheckpointMetadata md;
  uint64_t off = 4096;
  for (const auto& [name, shape] : ts) {
    TensorMeta tm;
    tm.dtype = dt;
    tm.global_shape = shape;
    ShardMeta s;
    s.file = "model.safetensors";
    s.box = Box{Shape(shape.size(), 0), shape};
    s.dtype = dt;
    s.data_offset = off;
    s.nbytes = NumElements(shape) * DTypeSize(dt);
    off += s.nbytes;
    tm.shards.push_back(s);
    md.tensors[name] = tm;
  }
  return md;
}

// ===========================================================================
// Parser

TEST(AoaParse, EveryForm) {
  auto p = ParseAoa(
      "# a comment line\n"
      "a -> b\n"
      "s0, s1 -> s, axis=1   # concat\n"
      "\n"
      "s -> d0,d1, axis=0\n"
      "a -> b, permute='[1,0]'\n"
      "a^T -> b\n"
      "g -> g, dtype='float32'\n"
      "x -> _\n"
      "_ -> y\n"
      "qkv -> Q,K,V, fused_qkv, num_heads=8, num_key_value_groups=2\n"
      "gate, up -> up_gate, fused_ffn\n"
      "layers.$LAYER_ID.experts.$EXPERT_ID.w -> l.$LAYER_ID.e.$EXPERT_ID.w\n"
      "*.bias -> model.*.b\n"
      "s -> d[0:2], axis=-1\n");
  ASSERT_TRUE(p.ok()) << p.status();
  const auto& s = p->statements;
  ASSERT_EQ(s.size(), 13u);
  EXPECT_EQ(s[0].line, 2);
  EXPECT_EQ(s[0].sources[0].text, "a");
  EXPECT_EQ(s[0].targets[0].text, "b");
  EXPECT_EQ(s[1].sources.size(), 2u);
  EXPECT_EQ(*s[1].axis, 1);
  EXPECT_EQ(s[2].line, 5);
  EXPECT_EQ(s[2].targets.size(), 2u);
  EXPECT_EQ(*s[3].permute, (std::vector<int>{1, 0}));
  EXPECT_TRUE(s[4].sources[0].transpose);
  EXPECT_EQ(*s[5].dtype, DType::kF32);
  EXPECT_EQ(s[6].targets[0].text, "_");
  EXPECT_EQ(s[7].sources[0].text, "_");
  EXPECT_EQ(s[8].fused, AoaFused::kQkv);
  EXPECT_EQ(*s[8].num_heads, 8);
  EXPECT_EQ(*s[8].num_key_value_groups, 2);
  EXPECT_EQ(s[9].fused, AoaFused::kFfn);
  EXPECT_EQ(s[10].sources[0].text, "layers.$LAYER_ID.experts.$EXPERT_ID.w");
  EXPECT_EQ(s[11].targets[0].text, "model.*.b");
  EXPECT_EQ(*s[12].axis, -1);
  EXPECT_EQ(s[12].targets[0].text, "d[0:2]");
  EXPECT_EQ(s[12].targets[0].column, 6);
}

TEST(AoaParse, JsonForm) {
  auto p = ParseAoa(R"({"aoa_statements": ["a -> b", "c^T -> d"]})");
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->statements.size(), 2u);
  EXPECT_EQ(p->statements[1].line, 2);
  EXPECT_TRUE(p->statements[1].sources[0].transpose);
  auto bad = ParseAoa(R"(["a -> b", "c d -> e"])", "cfg");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("cfg:2:3: expected ',' or '->'"));
}

TEST(AoaParse, ErrorsPointAtLineAndColumn) {
  struct Case {
    std::string text, want;
  };
  const Case cases[] = {
      {"a -> b\nx y -> z", "f:2:3: expected ',' or '->' after the source names, found 'y'"},
      {"a -> ", "f:1:6: expected a target tensor name or an option, found the end of the statement"},
      {"a -> b, axis=x", "f:1:14: expected an integer, found 'x'"},
      {"a -> b, colour=1", "f:1:9: unknown option 'colour'"},
      {"a -> b^T", "f:1:7: ^T transposes a source"},
      {"a^X -> b", "f:1:3: expected 'T' after '^'"},
      {"$LAYER.a -> b", "f:1:1: unknown macro"},
      {"a[3:1] -> b", "f:1:2: expected an array macro [first:end]"},
      {"a -> b, dtype='float13'", "f:1:16: unknown dtype 'float13'"},
      {"a -> b, permute='[0,0]'", "f:1:18: permute '[0,0]' is not a permutation"},
      {"a -> b, axis=1, c", "f:1:17: expected an option"},
      {"a -> b, axis=1, axis=0", "f:1:17: option 'axis' given twice"},
      {"a, b -> c", "f:1: concatenating several sources needs axis=N"},
      {"a -> b, c", "f:1: splitting into several targets needs axis=N"},
      {"a, b -> c, d, axis=0", "f:1: 2 sources and 2 targets"},
      {"q -> a, b, c, fused_qkv, num_heads=8", "f:1: fused_qkv needs num_heads=H and num_key_value_groups=G"},
      {"q -> a, b, c, fused_qkv, num_heads=8, num_key_value_groups=3", "not a multiple"},
      {"q -> a, b, fused_qkv, num_heads=8, num_key_value_groups=2", "this statement has 1 source(s) and 2 target(s)"},
      {"a, b -> c, permute='[1,0]'", "permute= takes one source and one target"},
      {"_ -> _", "means nothing"},
      {"a, _ -> c, axis=0", "'_' stands alone"},
      {"a -> _, dtype=F32", "(drop) takes no options"},
      {"a -> b, num_heads=2", "num_heads and num_key_value_groups go with fused_qkv"},
      // Arity counts the names after [a:b] expansion.
      {"q -> a, b[0:2], fused_ffn", "this statement has 1 source(s) and 3 target(s)"},
      // Bounded: H + 2G must not overflow, nor a per-group loop run 2^62 times.
      {"q -> a, b, c, fused_qkv, num_heads=4611686018427387904, num_key_value_groups=1",
       "num_heads must be a positive integer of at most 1048576"},
      {"q -> a, b, c, fused_qkv, num_heads=8, num_key_value_groups=2097152",
       "num_key_value_groups must be a positive integer of at most 1048576"},
  };
  for (const Case& c : cases) {
    auto p = ParseAoa(c.text, "f");
    ASSERT_FALSE(p.ok()) << c.text;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(p.status().message()), HasSubstr(c.want)) << c.text;
  }
}

// ===========================================================================
// Operations, each with exact values, through real loads.

class AoaLoad : public ::testing::Test {
 protected:
  testing::TempDir tmp_;
  std::string Dir(const std::string& n) { return tmp_.Sub(n); }
};

// The spec's example: s0,s1 (2,2) -> s, axis=1; s -> d0,d1, axis=0.
// d1 (1,4) is s0 row 1 into cols 0-1 and s1 row 1 into cols 2-3.
TEST_F(AoaLoad, SpecSplitConcatExample) {
  Dense s0{{2, 2}, {0, 1, 2, 3}}, s1{{2, 2}, {10, 11, 12, 13}};
  WriteHf(Dir("ck"), {{"s0", s0}, {"s1", s1}});
  for (const std::string aoa : {"s0,s1 -> s, axis=1\ns -> d0,d1, axis=0",
                                "s[0:2] -> s, axis=1\ns -> d[0:2], axis=0",
                                "s -> d0,d1, axis=0\ns0,s1 -> s, axis=1"}) {  // forward reference
    Layout l = MakeLayout({{Whole("d0", {1, 4}), Whole("d1", {1, 4})},
                           {Target("d1", {1, 4}, Box{{0, 1}, {1, 2}})}});
    auto res = Load(Dir("ck"), l, aoa);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(AsFloats(res->buffers[0].tensors[0], DType::kF32), (std::vector<float>{0, 1, 10, 11}));
    EXPECT_EQ(AsFloats(res->buffers[0].tensors[1], DType::kF32), (std::vector<float>{2, 3, 12, 13}));
    EXPECT_EQ(AsFloats(res->buffers[1].tensors[0], DType::kF32), (std::vector<float>{3, 12}));
    EXPECT_TRUE(res->plan.missing_keys.empty());
    EXPECT_TRUE(res->plan.unexpected_keys.empty());
  }
  // Rank 1 wants d1 cols 1-2 only: it reads s0[1][1] and s1[1][0], the
  // spans of s0 and s1 holding them (4 bytes each), nothing else.
  Layout one = MakeLayout({{Target("d1", {1, 4}, Box{{0, 1}, {1, 2}})}});
  auto res = Load(Dir("ck"), one, "s0,s1 -> s, axis=1\ns -> d0,d1, axis=0");
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_EQ(res->stats.bytes_read, 8u);
}

TEST_F(AoaLoad, RenameDropKeepAndReport) {
  Dense a = Iota({3, 4}), c = Iota({2}, 100), u = Iota({5}, 50);
  WriteHf(Dir("ck"), {{"a", a}, {"c", c}, {"unused", u}, {"gone", u}});
  Layout l = MakeLayout({{Whole("b", {3, 4}), Whole("c", {2}), Whole("mine", {7}), Whole("gone", {5})}});
  auto res = Load(Dir("ck"), l, "a -> b\ngone -> _\n_ -> mine\n");
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_EQ(AsFloats(res->buffers[0].tensors[0], DType::kF32), a.v);
  EXPECT_EQ(AsFloats(res->buffers[0].tensors[1], DType::kF32), c.v);
  EXPECT_TRUE(res->buffers[0].tensors[2].empty());  // kept: not loaded
  EXPECT_TRUE(res->buffers[0].tensors[3].empty());  // dropped: missing
  EXPECT_EQ(res->plan.missing_keys, (std::vector<std::string>{"gone"}));
  EXPECT_EQ(res->plan.ranks[0].missing_keys, (std::vector<std::string>{"gone"}));
  // a feeds b; gone is dropped on purpose; unused is unexpected.
  EXPECT_EQ(res->plan.unexpected_keys, (std::vector<std::string>{"unused"}));
}

TEST_F(AoaLoad, TransposeForms) {
  Dense a = Iota({3, 5});
  Dense t3 = Iota({2, 3, 4}, 1000);
  WriteHf(Dir("ck"), {{"a", a}, {"t3", t3}});
  const Shape ts{5, 3};
  Layout l = MakeLayout({{Whole("b", ts), Target("c", ts, Box{{1, 1}, {3, 2}}),
                          Target("p", {4, 2, 3}, Box{{1, 0, 1}, {2, 2, 2}}),
                          Target("f", ts, Box{{0, 0}, {5, 3}}, DType::kF32, FlatRange{4, 11})}});
  auto res = Load(Dir("ck"), l, "a^T -> b\na -> c, permute='[1,0]'\nt3 -> p, permute='[2,0,1]'\n"
                                "a^T -> f\n");
  ASSERT_TRUE(res.ok()) << res.status();
  ExpectExact(*res, l, {{"b", T2(a)}, {"c", T2(a)}, {"p", Transpose(t3, {2, 0, 1})}, {"f", T2(a)}});
}

TEST_F(AoaLoad, TransposeThenCastChain) {
  Dense a = Iota({4, 6}, -10);  // small integers: exact in BF16
  WriteHf(Dir("ck"), {{"a", a, DType::kBF16}, {"i", Iota({2}), DType::kI32}});
  Layout l = MakeLayout({{Whole("b", {6, 4}, DType::kF32)},
                         {Target("b", {6, 4}, Box{{2, 1}, {3, 2}}, DType::kF32)}});
  auto res = Load(Dir("ck"), l, "a^T -> tmp\ntmp -> b, dtype='float32'\n");
  ASSERT_TRUE(res.ok()) << res.status();
  ExpectExact(*res, l, {{"b", T2(a)}});
  // I32 cannot become float32.
  auto bad = Load(Dir("ck"), MakeLayout({{Whole("j", {2})}}), "i -> j, dtype='float32'");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("aoa:1 (`i -> j, dtype='F32'`): 'i' is I32, which cannot be cast to F32"));
}

TEST_F(AoaLoad, Macros) {
  std::vector<Named> ts;
  for (int layer : {0, 1, 10}) {
    ts.push_back({"layers." + std::to_string(layer) + ".w", Iota({2, 3}, 100 * layer)});
    for (int e : {0, 3}) {
      ts.push_back({"layers." + std::to_string(layer) + ".experts." + std::to_string(e) + ".w",
                    Iota({2}, 100 * layer + 10 * e)});
    }
  }
  ts.push_back({"emb.bias", Iota({3}, 7)});
  ts.push_back({"head.bias", Iota({3}, 9)});
  WriteHf(Dir("ck"), ts);
  const std::string aoa =
      "layers.$LAYER_ID.w^T -> model.layers.$LAYER_ID.weight\n"
      "layers.$LAYER_ID.experts.$EXPERT_ID.w -> l$LAYER_ID.e$EXPERT_ID\n"
      "*.bias -> model.*.b\n";
  std::vector<TargetTensor> want;
  std::map<std::string, Dense> oracle;
  for (const Named& n : ts) {
    if (n.name.rfind(".bias") != std::string::npos) {
      std::string stem = n.name.substr(0, n.name.size() - 5);
      want.push_back(Whole("model." + stem + ".b", {3}));
      oracle["model." + stem + ".b"] = n.t;
    } else if (n.name.find("experts") != std::string::npos) {
      std::string layer = n.name.substr(7, n.name.find('.', 7) - 7);
      std::string e = n.name.substr(n.name.rfind("experts.") + 8, 1);
      want.push_back(Whole("l" + layer + ".e" + e, {2}));
      oracle["l" + layer + ".e" + e] = n.t;
    } else {
      std::string layer = n.name.substr(7, n.name.find('.', 7) - 7);
      want.push_back(Whole("model.layers." + layer + ".weight", {3, 2}));
      oracle["model.layers." + layer + ".weight"] = T2(n.t);
    }
  }
  Layout l = MakeLayout({want});
  auto res = Load(Dir("ck"), l, aoa);
  ASSERT_TRUE(res.ok()) << res.status();
  ExpectExact(*res, l, oracle);
  EXPECT_TRUE(res->plan.missing_keys.empty());
  EXPECT_TRUE(res->plan.unexpected_keys.empty());
  // Expansion in natural order.
  auto r = Resolve(aoa, res->checkpoint.metadata);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_GE(r->expanded.size(), 3u);
  EXPECT_EQ(r->expanded[0], "1: layers.0.w^T -> model.layers.0.weight");
  EXPECT_EQ(r->expanded[1], "1: layers.1.w^T -> model.layers.1.weight");
  EXPECT_EQ(r->expanded[2], "1: layers.10.w^T -> model.layers.10.weight");
}

// Keep statements with macros match the model's names.
TEST(AoaResolve, KeepWithMacroMatchesModel) {
  CheckpointMetadata md = FakeMeta({{"w", {2}}});
  ModelTensors model{{"layers.0.extra", {DType::kF32, {2}}}, {"layers.3.extra", {DType::kF32, {2}}}};
  auto r = Resolve("_ -> layers.$LAYER_ID.extra", md, model);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->kept, (std::set<std::string>{"layers.0.extra", "layers.3.extra"}));
}

// fused_qkv with H=8, G=2: qkv -> Q0,Q1,Q2,Q3,K0,V0,Q4,Q5,Q6,Q7,K1,V1.
TEST_F(AoaLoad, FusedQkvOrdering) {
  const int64_t d = 2, in = 3;  // head size 2
  Dense qkv = Iota({in, 12 * d});
  WriteHf(Dir("fused"), {{"qkv", qkv}});
  // Column blocks of width d, in the documented order.
  auto heads = [&](std::vector<int> blocks) {
    std::vector<Dense> parts;
    for (int b : blocks) parts.push_back(Slice(qkv, 1, b * d, (b + 1) * d));
    return Concat(parts, 1);
  };
  Dense Q = heads({0, 1, 2, 3, 6, 7, 8, 9}), K = heads({4, 10}), V = heads({5, 11});
  Layout l = MakeLayout({{Whole("q", {in, 8 * d}), Whole("k", {in, 2 * d}), Whole("v", {in, 2 * d})}});
  auto res = Load(Dir("fused"), l, "qkv -> q,k,v, fused_qkv, num_heads=8, num_key_value_groups=2");
  ASSERT_TRUE(res.ok()) << res.status();
  ExpectExact(*res, l, {{"q", Q}, {"k", K}, {"v", V}});
  // Exact first row: Q takes columns 0-7 and 12-19, K 8-9 and 20-21, V 10-11 and 22-23.
  EXPECT_EQ(Extract(Q, Box{{0, 0}, {1, 16}}),
            (std::vector<float>{0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15, 16, 17, 18, 19}));
  EXPECT_EQ(Extract(K, Box{{0, 0}, {1, 4}}), (std::vector<float>{8, 9, 20, 21}));
  EXPECT_EQ(Extract(V, Box{{0, 0}, {1, 4}}), (std::vector<float>{10, 11, 22, 23}));

  // And back: q,k,v -> qkv rebuilds the same tensor.
  WriteHf(Dir("sep"), {{"q", Q}, {"k", K}, {"v", V}});
  Layout back = MakeLayout({{Whole("qkv", {in, 12 * d})}});
  auto res2 = Load(Dir("sep"), back, "q,k,v -> qkv, fused_qkv, num_heads=8, num_key_value_groups=2");
  ASSERT_TRUE(res2.ok()) << res2.status();
  ExpectExact(*res2, back, {{"qkv", qkv}});
}

TEST_F(AoaLoad, FusedFfnBothWays) {
  Dense gate = Iota({3, 4}), up = Iota({3, 4}, 100);
  WriteHf(Dir("sep"), {{"gate", gate}, {"up", up}});
  Layout l = MakeLayout({{Whole("gu", {3, 8})}, {Target("gu", {3, 8}, Box{{1, 2}, {2, 4}})}});
  auto res = Load(Dir("sep"), l, "gate, up -> gu, fused_ffn");
  ASSERT_TRUE(res.ok()) << res.status();
  ExpectExact(*res, l, {{"gu", Concat({gate, up}, 1)}});
  WriteHf(Dir("fused"), {{"gu", Concat({gate, up}, 1)}});
  Layout l2 = MakeLayout({{Whole("g", {3, 4}), Whole("u", {3, 4})}});
  auto res2 = Load(Dir("fused"), l2, "gu -> g, u, fused_ffn");
  ASSERT_TRUE(res2.ok()) << res2.status();
  ExpectExact(*res2, l2, {{"g", gate}, {"u", up}});
  // 1-D tensors fuse along axis 0.
  WriteHf(Dir("bias"), {{"gb", Iota({2})}, {"ub", Iota({2}, 5)}});
  Layout l3 = MakeLayout({{Whole("gub", {4})}});
  auto res3 = Load(Dir("bias"), l3, "gb, ub -> gub, fused_ffn");
  ASSERT_TRUE(res3.ok()) << res3.status();
  ExpectExact(*res3, l3, {{"gub", Dense{{4}, {0, 1, 5, 6}}}});
}

// Optimizer states follow their parameter's statement; scalar beta pow
// accumulators are copied from the first source; explicit statements win.
TEST_F(AoaLoad, OptimizerStatesFollowTheirParameter) {
  const int64_t in = 2, d = 1;
  Dense q = Iota({in, 8 * d}), k = Iota({in, 2 * d}, 100), v = Iota({in, 2 * d}, 200);
  std::vector<Named> ts = {{"q", q}, {"k", k}, {"v", v}};
  for (const std::string sfx : {".moment1_0", ".moment2_0", "_fp32_master_0"}) {
    float off = sfx == ".moment1_0" ? 1000 : sfx == ".moment2_0" ? 2000 : 3000;
    ts.push_back({"q" + sfx, Iota(q.shape, off)});
    ts.push_back({"k" + sfx, Iota(k.shape, off + 100)});
    ts.push_back({"v" + sfx, Iota(v.shape, off + 200)});
  }
  ts.push_back({"q.beta1_pow_acc_0", Dense{{1}, {0.5f}}});
  ts.push_back({"k.beta1_pow_acc_0", Dense{{1}, {0.5f}}});
  ts.push_back({"v.beta1_pow_acc_0", Dense{{1}, {0.5f}}});
  ts.push_back({"w", Iota({2, 3})});
  ts.push_back({"w.moment1_0", Iota({2, 3}, 40)});
  ts.push_back({"w.moment2_0", Iota({2, 3}, 80)});
  WriteHf(Dir("ck"), ts);
  auto fuse = [&](const Dense& a, const Dense& b, const Dense& c) {
    std::vector<Dense> parts;
    for (int g = 0; g < 2; ++g) {
      parts.push_back(Slice(a, 1, g * 4 * d, (g + 1) * 4 * d));
      parts.push_back(Slice(b, 1, g * d, (g + 1) * d));
      parts.push_back(Slice(c, 1, g * d, (g + 1) * d));
    }
    return Concat(parts, 1);
  };
  auto get = [&](const std::string& n) {
    return std::find_if(ts.begin(), ts.end(), [&](const Named& x) { return x.name == n; })->t;
  };
  const Shape fs{in, 12 * d};
  Layout l = MakeLayout({{Whole("qkv", fs), Whole("qkv.moment1_0", fs), Whole("qkv.moment2_0", fs),
                          Whole("qkv_fp32_master_0", fs), Whole("qkv.beta1_pow_acc_0", {1}),
                          Whole("wt", {3, 2}), Whole("wt.moment1_0", {3, 2}),
                          Whole("wt.moment2_0", {2, 3})}});
  auto res = Load(Dir("ck"), l,
                  "q,k,v -> qkv, fused_qkv, num_heads=8, num_key_value_groups=2\n"
                  "w^T -> wt\n"
                  "w.moment2_0 -> wt.moment2_0   # explicit: wins over the follower\n");
  ASSERT_TRUE(res.ok()) << res.status();
  ExpectExact(*res, l,
              {{"qkv", fuse(q, k, v)},
               {"qkv.moment1_0", fuse(get("q.moment1_0"), get("k.moment1_0"), get("v.moment1_0"))},
               {"qkv.moment2_0", fuse(get("q.moment2_0"), get("k.moment2_0"), get("v.moment2_0"))},
               {"qkv_fp32_master_0",
                fuse(get("q_fp32_master_0"), get("k_fp32_master_0"), get("v_fp32_master_0"))},
               {"qkv.beta1_pow_acc_0", Dense{{1}, {0.5f}}},
               {"wt", T2(get("w"))},
               {"wt.moment1_0", T2(get("w.moment1_0"))},
               {"wt.moment2_0", get("w.moment2_0")}});
  // k's and v's beta accumulators are not read (q's is).
  EXPECT_EQ(res->plan.unexpected_keys,
            (std::vector<std::string>{"k.beta1_pow_acc_0", "v.beta1_pow_acc_0"}));
}

// ===========================================================================
// Errors name the statement.

TEST(AoaResolve, ErrorsNameTheStatement) {
  CheckpointMetadata md = FakeMeta({{"a", {4, 6}}, {"b", {4, 5}}, {"c", {5}}, {"q", {2, 8}},
                                    {"k", {2, 2}}, {"v", {2, 3}}, {"i", {2}}});
  md.tensors["i"].dtype = DType::kI32;
  md.tensors["i"].shards[0].dtype = DType::kI32;
  struct Case {
    std::string text;
    ModelTensors model;
    std::string want;
  };
  const Case cases[] = {
      {"nope -> x", {}, "aoa:1 (`nope -> x`): unknown source 'nope'"},
      {"a -> x\nb -> x", {}, "aoa:2 (`b -> x`): 'x' is fed twice: line 1 (`a -> x`) already feeds it"},
      {"_ -> x\na -> x", {}, "aoa:2 (`a -> x`): 'x' is fed twice"},
      {"t1 -> t2\nt2 -> t1", {}, "aoa:2 (`t2 -> t1`): cycle: line 1 reads 't1' fed by line 2, line 2 reads 't2' fed by line 1"},
      {"a -> x", {{"x", {DType::kF32, {6, 4}}}}, "aoa:1 (`a -> x`): shape mismatch: 'x' comes out as [4,6] but the model's 'x' is [6,4]"},
      {"a -> x, y, z, w, axis=1", {}, "aoa:1 (`a -> x, y, z, w, axis=1`): cannot split 'a' [4,6] into 4 equal parts along axis 1: 6 is not divisible by 4"},
      {"a -> x, y, axis=0\nc -> p, q, axis=0", {}, "aoa:2 (`c -> p, q, axis=0`): cannot split 'c' [5] into 2 equal parts along axis 0: 5 is not divisible by 2"},
      {"a, b -> x, axis=0", {}, "shape mismatch: 'a' is [4,6] but 'b' is [4,5]; they must agree on every axis but 0"},
      {"a -> x, permute='[0,2,1]'", {}, "permute has 3 axes but 'a' has rank 2"},
      {"a -> x, axis=2, y", {}, "expected an option"},
      {"a, c -> x, axis=3", {}, "axis 3 is out of range for tensors of rank 2"},
      {"layers.$LAYER_ID.w -> x.$LAYER_ID", {}, "aoa:1 (`layers.$LAYER_ID.w -> x.$LAYER_ID`): 'layers.$LAYER_ID.w' matches no tensor"},
      {"a -> x.$LAYER_ID", {}, "target 'x.$LAYER_ID' uses a macro that no source binds"},
      {"q, k, v -> qkv, fused_qkv, num_heads=8, num_key_value_groups=2", {}, "shape mismatch: 'v' has 3 along axis 1, expected num_key_value_groups * head size = 2 * 1 = 2"},
      {"a -> x, y, z, fused_qkv, num_heads=4, num_key_value_groups=2", {}, "'a' has 6 along axis 1, not divisible by num_heads + 2 * num_key_value_groups = 8"},
      {"i -> j, dtype='bfloat16'", {}, "'i' is I32, which cannot be cast to BF16"},
      {"a, i -> x, axis=0", {}, "'a' is F32 but 'i' is I32; add dtype= to combine them"},
      {"a -> x", {{"x", {DType::kI32, {4, 6}}}}, "'x' comes out as F32, which cannot be converted to the model's I32"},
      {"a -> _\na -> x", {}, "aoa:2 (`a -> x`): 'a' was dropped by line 1 before this statement reads it"},
      {"_ -> x\nx -> y", {}, "is kept from the model"},
  };
  for (const Case& c : cases) {
    auto r = Resolve(c.text, md, c.model);
    ASSERT_FALSE(r.ok()) << c.text;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.want)) << c.text;
  }
}

// A '*'-heavy pattern backtracks on every name; its steps are bounded over
// all the names of the checkpoint together (the fuzzer found 17 bytes that
// took 100,000 steps per name, times every name, before this).
TEST(AoaResolve, BacktrackingPatternIsBoundedOverAllNames) {
  std::vector<std::pair<std::string, Shape>> ts;
  for (int i = 0; i < 2000; ++i) {
    ts.push_back({absl::StrCat("layers.", i, ".aaaaaaaaaaaaaaaaaaaaaaaaaaaaa.weight"), {2}});
  }
  CheckpointMetadata md = FakeMeta(ts);
  auto r = Resolve("*a*a*a*a*a*a*a*a*a*a*a*a*.g*xx -> y", md);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("takes more than 512000 steps to match against the 2000 tensor names"));
  // Ordinary patterns over the same names stay well inside the budget.
  auto ok = Resolve("layers.$LAYER_ID.aaaaaaaaaaaaaaaaaaaaaaaaaaaaa.weight -> w.$LAYER_ID", md);
  ASSERT_TRUE(ok.ok()) << ok.status();
  auto star = Resolve("layers.*.weight -> w.*", md);
  ASSERT_TRUE(star.ok()) << star.status();
}

// Statements whose '*' matches what earlier ones define double the names
// each time (the fuzzer's 652-byte program made 12,000 virtual tensors out of
// 12 and took 15 s under ASan). One program defines at most 8 names per
// checkpoint or model tensor, plus 4096; the statement that crosses is named.
TEST(AoaResolve, StatementsThatMultiplyNamesAreBounded) {
  std::vector<std::pair<std::string, Shape>> ts;
  for (int i = 0; i < 100; ++i) ts.push_back({absl::StrCat("w", i), {2}});
  CheckpointMetadata md = FakeMeta(ts);  // limit: 8 * 100 + 4096 = 4896
  std::string text;
  // Defined names: 100, +200, +400, +800, +1600 (3100 in all), then +3200.
  for (int k = 0; k < 6; ++k) absl::StrAppend(&text, "* -> x", k, "*\n");
  auto r = Resolve(text, md);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr(":6 (`* -> x5*`): '*' matches 3200 names, which would make the program define 6300 "
                        "tensor names; the limit is 4896"));
  // Five of them stay inside the bound.
  text.clear();
  for (int k = 0; k < 5; ++k) absl::StrAppend(&text, "* -> x", k, "*\n");
  auto ok = Resolve(text, md);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->metadata.tensors.count("x4x0w7"), 1u);
}

// In-place chains are allowed: a statement may redefine a name it reads.
TEST(AoaResolve, InPlaceChainAndVirtualShards) {
  CheckpointMetadata md = FakeMeta({{"w", {2, 3}}});
  auto r = Resolve("w^T -> w\nw -> w, dtype='float64'", md);
  ASSERT_TRUE(r.ok()) << r.status();
  const TensorMeta& t = r->metadata.tensors.at("w");
  EXPECT_EQ(t.global_shape, (Shape{3, 2}));
  EXPECT_EQ(t.dtype, DType::kF64);
  ASSERT_EQ(t.shards.size(), 1u);
  EXPECT_EQ(t.shards[0].dtype, DType::kF32);  // the bytes stay what they are
  EXPECT_EQ(t.shards[0].perm, (std::vector<int>{1, 0}));
  EXPECT_FALSE(t.shards[0].window.has_value());
  EXPECT_EQ(t.shards[0].data_offset, md.tensors.at("w").shards[0].data_offset);
}

// ===========================================================================
// Resharding and transformation compose.

Dense FuseQkv(const Dense& q, const Dense& k, const Dense& v, int64_t H, int64_t G, int axis) {
  const int64_t d = q.shape[axis] / H, hg = H / G;
  std::vector<Dense> parts;
  for (int64_t g = 0; g < G; ++g) {
    parts.push_back(Slice(q, axis, g * hg * d, (g + 1) * hg * d));
    parts.push_back(Slice(k, axis, g * d, (g + 1) * d));
    parts.push_back(Slice(v, axis, g * d, (g + 1) * d));
  }
  return Concat(parts, axis);
}

// A native checkpoint of separate q/k/v saved with TP=2 (column shards, one
// replicated bias-like tensor), loaded through fused_qkv into TP=2 and TP=4
// target layouts (column and row slabs); and a fused checkpoint saved TP=2
// split back into q/k/v at TP=4.
TEST_F(AoaLoad, SavedTp2LoadedFusedAtTp2AndTp4) {
  const int64_t H = 8, G = 2, d = 4, in = 8;
  Dense q = Iota({in, H * d}), k = Iota({in, G * d}, 1000), v = Iota({in, G * d}, 2000);
  WriteHf(Dir("hf"), {{"q", q}, {"k", k}, {"v", v}});
  Layout save = MakeLayout({{Target("q", q.shape, Slab(q.shape, 1, 0, 2)),
                             Target("k", k.shape, Slab(k.shape, 1, 0, 2)),
                             Target("v", v.shape, Slab(v.shape, 0, 0, 2))},
                            {Target("q", q.shape, Slab(q.shape, 1, 1, 2)),
                             Target("k", k.shape, Slab(k.shape, 1, 1, 2)),
                             Target("v", v.shape, Slab(v.shape, 0, 1, 2))}});
  ShardOptions so;
  so.unique_id = 3;
  so.checksum_block = 64;  // many small checksum blocks: shared-shard checks
  ASSERT_TRUE(ShardCheckpoint(Dir("hf"), save, Dir("tp2"), so).ok());
  const Dense qkv = FuseQkv(q, k, v, H, G, 1);
  const Shape fs = qkv.shape;
  const std::string aoa = "q,k,v -> qkv, fused_qkv, num_heads=8, num_key_value_groups=2";
  for (int tp : {2, 4}) {
    for (int axis : {0, 1}) {
      std::vector<std::vector<TargetTensor>> ranks(tp);
      for (int r = 0; r < tp; ++r) ranks[r].push_back(Target("qkv", fs, Slab(fs, axis, r, tp)));
      Layout l = MakeLayout(ranks);
      auto res = Load(Dir("tp2"), l, aoa);
      ASSERT_TRUE(res.ok()) << res.status();
      ExpectExact(*res, l, {{"qkv", qkv}});
      EXPECT_TRUE(res->plan.unexpected_keys.empty());
      EXPECT_GT(res->stats.checksums_verified, 0);
      // Every byte at most once over the whole job.
      EXPECT_LE(res->stats.bytes_read, (q.v.size() + k.v.size() + v.v.size()) * 4);
    }
  }
  // The fused tensor saved at TP=2 (column shards), split back at TP=4.
  WriteHf(Dir("hf2"), {{"qkv", qkv}});
  Layout save2 = MakeLayout({{Target("qkv", fs, Slab(fs, 1, 0, 2))}, {Target("qkv", fs, Slab(fs, 1, 1, 2))}});
  ASSERT_TRUE(ShardCheckpoint(Dir("hf2"), save2, Dir("tp2f"), so).ok());
  std::vector<std::vector<TargetTensor>> ranks(4);
  for (int r = 0; r < 4; ++r) {
    ranks[r] = {Target("q", q.shape, Slab(q.shape, 1, r, 4)), Target("k", k.shape, Slab(k.shape, 1, r, 4)),
                Target("v", v.shape, Slab(v.shape, 0, r, 4), DType::kF64)};
  }
  Layout l = MakeLayout(ranks);
  auto res = Load(Dir("tp2f"), l, "qkv -> q,k,v, fused_qkv, num_heads=8, num_key_value_groups=2");
  ASSERT_TRUE(res.ok()) << res.status();
  ExpectExact(*res, l, {{"q", q}, {"k", k}, {"v", v}});
}

// HuggingFace q/k/v ([out, in], torch Linear) loaded into a Paddle fused qkv
// ([in, out], fused along axis 1) sharded over 4 ranks by columns: rank r's
// columns are rows of q/k/v, so each rank reads exactly its rows' bytes.
TEST_F(AoaLoad, HfSeparateQkvIntoFusedTp4ReadsOnlyNeededBytes) {
  const int64_t H = 8, G = 2, d = 16, in = 64;
  Dense q = Iota({H * d, in}), k = Iota({G * d, in}, 1e5), v = Iota({G * d, in}, 2e5);
  WriteHf(Dir("hf"), {{"model.layers.0.q_proj.weight", q},
                      {"model.layers.0.k_proj.weight", k},
                      {"model.layers.0.v_proj.weight", v},
                      {"model.layers.0.o_proj.weight", Iota({in, in})}});
  const std::string aoa =
      "model.layers.$LAYER_ID.q_proj.weight^T, model.layers.$LAYER_ID.k_proj.weight^T, "
      "model.layers.$LAYER_ID.v_proj.weight^T -> layers.$LAYER_ID.qkv, fused_qkv, num_heads=8, "
      "num_key_value_groups=2\n"
      "model.layers.$LAYER_ID.o_proj.weight -> _\n";
  const Dense qkv = FuseQkv(T2(q), T2(k), T2(v), H, G, 1);  // [in, 12 * d]
  const Shape fs = qkv.shape;
  // Each rank alone: it reads its 3 heads' rows of q/k/v, 3 * d * in floats.
  for (int r = 0; r < 4; ++r) {
    std::vector<std::vector<TargetTensor>> ranks(4);
    ranks[r].push_back(Target("layers.0.qkv", fs, Slab(fs, 1, r, 4)));
    Layout l = MakeLayout(ranks);
    auto res = Load(Dir("hf"), l, aoa);
    ASSERT_TRUE(res.ok()) << res.status();
    ExpectExact(*res, l, {{"layers.0.qkv", qkv}});
    EXPECT_EQ(res->stats.bytes_read, static_cast<uint64_t>(3 * d * in * 4)) << "rank " << r;
    EXPECT_EQ(res->plan.bytes_to_read, static_cast<uint64_t>(3 * d * in * 4)) << "rank " << r;
    EXPECT_EQ(res->stats.bytes_delivered, static_cast<uint64_t>(in * 3 * d * 4));
  }
  // All 4 ranks together: q/k/v read once, o_proj (dropped) not at all.
  std::vector<std::vector<TargetTensor>> ranks(4);
  for (int r = 0; r < 4; ++r) ranks[r].push_back(Target("layers.0.qkv", fs, Slab(fs, 1, r, 4)));
  Layout l = MakeLayout(ranks);
  auto res = Load(Dir("hf"), l, aoa);
  ASSERT_TRUE(res.ok()) << res.status();
  ExpectExact(*res, l, {{"layers.0.qkv", qkv}});
  EXPECT_EQ(res->stats.bytes_read, static_cast<uint64_t>((H + 2 * G) * d * in * 4));
  EXPECT_TRUE(res->plan.unexpected_keys.empty());
  EXPECT_TRUE(res->plan.missing_keys.empty());
}

// Random chains of transpose/split/concat over random save layouts (with
// flattened shards) and random load boxes, against the dense oracle.
TEST_F(AoaLoad, RandomChainsAgainstOracle) {
  std::mt19937_64 rng(11);
  auto uni = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int iter = 0; iter < 150; ++iter) {
    const int rank = static_cast<int>(uni(2, 3));
    Shape sa(rank);
    for (auto& e : sa) e = uni(1, 2) * 6;  // splits in 2 and in 3
    Dense a = Iota(sa), b = Iota(sa, 500);
    const std::string src = Dir("src" + std::to_string(iter)), dst = Dir("dst" + std::to_string(iter));
    WriteHf(src, {{"a", a}, {"b", b}});
    // Save: each tensor cut along a random axis into 2 (sometimes flattened).
    Layout save = MakeLayout({{}, {}, {}, {}});
    for (const Named& n : std::vector<Named>{{"a", a}, {"b", b}}) {
      int ax = static_cast<int>(uni(0, rank - 1));
      for (int part = 0; part < 2; ++part) {
        Box box = Slab(sa, ax, part, 2);
        if (uni(0, 2) == 0) {
          int64_t m = NumElements(box.shape), cut = uni(1, m - 1);
          save.ranks[part].tensors.push_back(Target(n.name, sa, box, DType::kF32, FlatRange{0, cut}));
          save.ranks[2 + part].tensors.push_back(Target(n.name, sa, box, DType::kF32, FlatRange{cut, m}));
        } else {
          save.ranks[part].tensors.push_back(Target(n.name, sa, box));
        }
      }
    }
    ShardOptions so;
    so.checksum_block = 16;
    ASSERT_TRUE(ShardCheckpoint(src, save, dst, so).ok()) << LayoutToJson(save);
    // A chain: x = perm(a) ; y = concat(x, perm(b)) along c ; split y in 2 along s.
    std::vector<int> perm(rank);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    const int c = static_cast<int>(uni(0, rank - 1)), s = static_cast<int>(uni(0, rank - 1));
    std::string ps = "[";
    for (int i = 0; i < rank; ++i) ps += (i ? "," : "") + std::to_string(perm[i]);
    ps += "]";
    const std::string aoa = absl::StrCat("a -> x, permute='", ps, "'\n", "b -> xb, permute='", ps,
                                         "'\n", "x, xb -> y, axis=", c, "\n",
                                         "y -> out0, out1, axis=", s, "\n",
                                         "out1, out0 -> swapped, axis=", s, "\n",
                                         "y -> t0, t1, t2, axis=", s, "\n",
                                         "t1, t0, t2 -> mixed, axis=", s, "\n");
    Dense y = Concat({Transpose(a, perm), Transpose(b, perm)}, c);
    std::map<std::string, Dense> want{{"out0", Slice(y, s, 0, y.shape[s] / 2)},
                                      {"out1", Slice(y, s, y.shape[s] / 2, y.shape[s])}};
    want["swapped"] = Concat({want["out1"], want["out0"]}, s);
    const int64_t third = y.shape[s] / 3;
    want["mixed"] = Concat({Slice(y, s, third, 2 * third), Slice(y, s, 0, third),
                            Slice(y, s, 2 * third, 3 * third)}, s);
    std::vector<std::vector<TargetTensor>> ranks(2);
    for (int r = 0; r < 2; ++r) {
      for (const auto& [name, t] : want) {
        Box box;
        for (int dd = 0; dd < rank; ++dd) {
          int64_t lo = uni(0, t.shape[dd] - 1), hi = uni(lo + 1, t.shape[dd]);
          box.offset.push_back(lo);
          box.shape.push_back(hi - lo);
        }
        std::optional<FlatRange> fr;
        int64_t m = NumElements(box.shape);
        if (m > 1 && uni(0, 3) == 0) {
          int64_t lo = uni(0, m - 1);
          fr = FlatRange{lo, uni(lo + 1, m)};
        }
        ranks[r].push_back(Target(name, t.shape, box, uni(0, 3) == 0 ? DType::kF64 : DType::kF32, fr));
      }
    }
    Layout l = MakeLayout(ranks);
    auto res = Load(dst, l, aoa);
    ASSERT_TRUE(res.ok()) << res.status() << "\n" << aoa;
    ExpectExact(*res, l, want);
    EXPECT_EQ(res->stats.checksums_verified,
              [&] { int64_t n = 0; for (const auto& rr : res->plan.reads) n += rr.checks.size(); return n; }());
  }
}

// A virtual shard whose box equals a rank's target but holds only a window
// of it must not take the 1:1 local fast path (the rank's own file).
TEST_F(AoaLoad, WindowedShardNeverTakesTheLocalFastPath) {
  WriteHf(Dir("hf"), {{"s", Dense{{1, 6}, {0, 1, 2, 3, 4, 5}}}});
  Layout save = MakeLayout({{Whole("s", {1, 6})}});
  ASSERT_TRUE(ShardCheckpoint(Dir("hf"), save, Dir("native"), ShardOptions{}).ok());
  Layout l = MakeLayout({{Whole("e", {1, 6})}});
  // p2's virtual shard is s's whole box placed at e's box, windowed to [4, 6).
  auto res = Load(Dir("native"), l, "s -> p0, p1, p2, axis=1\np1, p0, p2 -> e, axis=1");
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_EQ(AsFloats(res->buffers[0].tensors[0], DType::kF32), (std::vector<float>{2, 3, 0, 1, 4, 5}));
  EXPECT_FALSE(res->plan.ranks[0].local_fast_path);
  // A plain rename of the own shard still is the fast path.
  auto res2 = Load(Dir("native"), MakeLayout({{Whole("r", {1, 6})}}), "s -> r");
  ASSERT_TRUE(res2.ok()) << res2.status();
  EXPECT_TRUE(res2->plan.ranks[0].local_fast_path);
}

// Same for a transposed shard: its flat range counts in storage order, so a
// target with the same box and the same numbers is not the same elements.
TEST_F(AoaLoad, TransposedFlatShardNeverTakesTheLocalFastPath) {
  Dense a = Iota({2, 3});
  WriteHf(Dir("hf"), {{"a", a}});
  Layout save = MakeLayout({{Target("a", {2, 3}, Box{{0, 0}, {2, 3}}, DType::kF32, FlatRange{0, 3})},
                            {Target("a", {2, 3}, Box{{0, 0}, {2, 3}}, DType::kF32, FlatRange{3, 6})}});
  ASSERT_TRUE(ShardCheckpoint(Dir("hf"), save, Dir("native"), ShardOptions{}).ok());
  Layout l = MakeLayout({{Target("b", {3, 2}, Box{{0, 0}, {3, 2}}, DType::kF32, FlatRange{0, 3})},
                         {Target("b", {3, 2}, Box{{0, 0}, {3, 2}}, DType::kF32, FlatRange{3, 6})}});
  auto res = Load(Dir("native"), l, "a^T -> b");
  ASSERT_TRUE(res.ok()) << res.status();
  ExpectExact(*res, l, {{"b", T2(a)}});
  EXPECT_FALSE(res->plan.ranks[0].local_fast_path);
}

// Scale: an 80-layer model with optimizer states, saved at TP=8 (every
// tensor 8 shards), mapped by macro statements into a fused, transposed
// layout at TP=8: resolution and planning stay well within a second or two.
TEST(AoaResolve, LargeModelPlansQuickly) {
  const int kLayers = 80, kTp = 8;
  const int64_t hid = 1024, ffn = 2048;
  CheckpointMetadata md;
  uint64_t off = 0;
  auto add = [&](const std::string& name, Shape shape) {
    TensorMeta tm;
    tm.dtype = DType::kBF16;
    tm.global_shape = shape;
    for (int r = 0; r < kTp; ++r) {
      ShardMeta sh;
      sh.file = std::to_string(r) + "_0.safetensors";
      sh.box = Slab(shape, 0, r, kTp);
      sh.dtype = DType::kBF16;
      sh.nbytes = NumElements(sh.box.shape) * 2;
      sh.data_offset = off;
      off += sh.nbytes;
      tm.shards.push_back(sh);
    }
    md.tensors[name] = tm;
  };
  for (int l = 0; l < kLayers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    for (const std::string sfx : {"", ".moment1_0", ".moment2_0"}) {
      add(p + "q_proj.weight" + sfx, {hid, hid});
      add(p + "k_proj.weight" + sfx, {hid / 4, hid});
      add(p + "v_proj.weight" + sfx, {hid / 4, hid});
      add(p + "o_proj.weight" + sfx, {hid, hid});
      add(p + "gate_proj.weight" + sfx, {ffn, hid});
      add(p + "up_proj.weight" + sfx, {ffn, hid});
      add(p + "down_proj.weight" + sfx, {hid, ffn});
    }
  }
  const std::string aoa =
      "model.layers.$LAYER_ID.q_proj.weight^T, model.layers.$LAYER_ID.k_proj.weight^T, "
      "model.layers.$LAYER_ID.v_proj.weight^T -> l.$LAYER_ID.qkv, fused_qkv, num_heads=16, "
      "num_key_value_groups=4\n"
      "model.layers.$LAYER_ID.gate_proj.weight^T, model.layers.$LAYER_ID.up_proj.weight^T -> "
      "l.$LAYER_ID.gate_up, fused_ffn\n"
      "model.layers.$LAYER_ID.o_proj.weight^T -> l.$LAYER_ID.o\n"
      "model.layers.$LAYER_ID.down_proj.weight^T -> l.$LAYER_ID.down\n";
  std::vector<RankTargets> ranks(kTp);
  for (int r = 0; r < kTp; ++r) {
    ranks[r].rank = r;
    for (int l = 0; l < kLayers; ++l) {
      const std::string p = "l." + std::to_string(l) + ".";
      for (const std::string sfx : {"", ".moment1_0", ".moment2_0"}) {
        ranks[r].tensors.push_back(Target(p + "qkv" + sfx, {hid, 3 * hid / 2}, Slab({hid, 3 * hid / 2}, 1, r, kTp)));
        ranks[r].tensors.push_back(Target(p + "gate_up" + sfx, {hid, 2 * ffn}, Slab({hid, 2 * ffn}, 1, r, kTp)));
        ranks[r].tensors.push_back(Target(p + "o" + sfx, {hid, hid}, Slab({hid, hid}, 0, r, kTp)));
        ranks[r].tensors.push_back(Target(p + "down" + sfx, {ffn, hid}, Slab({ffn, hid}, 0, r, kTp)));
      }
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto plan = PlanLoadWithAoa(md, aoa, ranks);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->missing_keys.empty());
  EXPECT_TRUE(plan->unexpected_keys.empty());
  uint64_t total = 0;
  for (const auto& [n, t] : md.tensors) total += NumElements(t.global_shape) * 2;
  EXPECT_EQ(plan->bytes_to_read, total);  // everything once
  std::printf("80 layers x 21 tensors x %d shards -> %d ranks: resolve + plan %.3f s\n", kTp, kTp, s);
  EXPECT_LT(s, 30.0);
}

// No statements (or only comments): exactly PlanLoad.
TEST_F(AoaLoad, EmptyConfigIsPlainLoad) {
  WriteHf(Dir("ck"), {{"a", Iota({2, 2})}, {"b", Iota({2})}});
  Layout l = MakeLayout({{Whole("a", {2, 2})}});
  auto res = Load(Dir("ck"), l, "# nothing\n\n");
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_EQ(res->plan.unexpected_keys, (std::vector<std::string>{"b"}));
  ExpectExact(*res, l, {{"a", Iota({2, 2})}});
}

}  // namespace
}  // namespace ckpt
