// The multi-node plan part on the wire (server/plan_codec.h): a part the
// coordinator makes from a real plan passes ValidatePlanPart and becomes the
// node's local plan; every index, range, file, node and rank a corrupt or
// malicious part could get wrong is refused with INVALID_ARGUMENT naming the
// job, the sender and the field.
#include "server/multinode/job_plan.h"
#include "server/multinode/plan_codec.h"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/plan/balancer.h"
#include "core/format/metadata.h"
#include "core/plan/planner.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ckptd {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Pair;
namespace pv1 = peer::v1;

constexpr char kJob[] = "job-1";
constexpr char kA[] = "10.0.0.1:7071";  // this node
constexpr char kB[] = "10.0.0.2:7071";  // the coordinator

ckpt::TargetTensor Target(std::string name, ckpt::DType dtype, ckpt::Shape global, ckpt::Box box) {
  ckpt::TargetTensor t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.global_shape = std::move(global);
  t.box = std::move(box);
  return t;
}

void SetBox(pv1::BoxMsg* m, std::vector<int64_t> offset, std::vector<int64_t> shape) {
  m->clear_offset();
  m->clear_shape();
  for (int64_t d : offset) m->add_offset(d);
  for (int64_t d : shape) m->add_shape(d);
}

// Rank 1 of a 2-rank job, served by node A: "w", rows 4..7 of an [8, 4] F32
// tensor stored as two files of 4 rows each ([0,4) in 0_1, [4,8) in 1_1).
class PlanPartTest : public ::testing::Test {
 protected:
  void SetUp() override {
    rank1_.rank = 1;
    rank1_.tensors.push_back(Target("w", ckpt::DType::kF32, {8, 4}, {{4, 0}, {4, 4}}));
    ctx_.job_id = kJob;
    ctx_.node = kA;
    ctx_.sender = kB;
    ctx_.world_size = 2;
    ctx_.ranks = {&rank1_};
    ctx_.limits.max_read_bytes = 1 << 20;

    part_.set_job_id(kJob);
    part_.add_nodes(kA);
    part_.add_nodes(kB);
    part_.add_files("0_1.safetensors");
    part_.add_files("1_1.safetensors");
    // read 0: rows 0..3 (B reads them; nobody here needs them)
    pv1::ReadMsg* r = part_.add_reads();
    r->set_file(0);
    r->set_offset(128);
    r->set_length(64);
    r->set_reader(kB);
    r->add_needed_by(kB);
    // read 1: rows 4..5 (B reads, A needs); read 2: rows 6..7 (A reads, both need)
    for (int i = 0; i < 2; ++i) {
      r = part_.add_reads();
      r->set_file(1);
      r->set_offset(128 + 32 * i);
      r->set_length(32);
      r->set_reader(i == 0 ? kB : kA);
      r->add_needed_by(kA);
      if (i == 1) r->add_needed_by(kB);
      pv1::CheckMsg* c = r->add_checks();
      c->set_tensor("w");
      c->set_offset(128 + 32 * i);
      c->set_nbytes(32);
      c->set_xxh3(7);
    }
    pv1::RankPlanMsg* rp = part_.add_ranks();
    rp->set_rank(1);
    ToMsg(rank1_.tensors[0], rp->add_targets());
    for (int i = 0; i < 2; ++i) {
      pv1::CopyMsg* c = rp->add_copies();
      c->set_target(0);
      c->set_read(1 + i);
      SetBox(c->mutable_src()->mutable_box(), {4, 0}, {4, 4});
      c->mutable_src()->set_flat_begin(8 * i);
      c->mutable_src()->set_flat_end(8 * i + 8);
      c->mutable_src()->set_dtype("F32");
      c->set_src_offset(128 + 32 * i);
      SetBox(c->mutable_region(), {4 + 2 * i, 0}, {2, 4});
      c->set_elements(8);
    }
  }

  // The part after `change`: refused with INVALID_ARGUMENT naming `field`,
  // the job and the sender.
  void ExpectRefused(const std::function<void(pv1::PlanPart&)>& change, const std::string& field,
                     const std::string& why = "") {
    pv1::PlanPart p = part_;
    change(p);
    const absl::Status st = ValidatePlanPart(p, ctx_);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_THAT(std::string(st.message()),
                HasSubstr(absl::StrCat("job '", kJob, "': plan part from ", kB, ": ", field, ": ")));
    if (!why.empty()) {
      EXPECT_THAT(std::string(st.message()), HasSubstr(why));
    }
    // LocalPartOf refuses it the same way, before building anything.
    EXPECT_EQ(LocalPartOf(p, ctx_).status(), st);
  }

  pv1::CopyMsg& Copy(pv1::PlanPart& p, int i = 0) { return *p.mutable_ranks(0)->mutable_copies(i); }

  ckpt::RankTargets rank1_;
  PlanPartContext ctx_;
  pv1::PlanPart part_;
};

TEST_F(PlanPartTest, AValidPartBecomesTheLocalPlan) {
  ASSERT_EQ(ValidatePlanPart(part_, ctx_), absl::OkStatus());
  auto local = LocalPartOf(part_, ctx_);
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_THAT(local->plan.files, ElementsAre("0_1.safetensors", "1_1.safetensors"));
  ASSERT_EQ(local->plan.reads.size(), 2u);  // read 0 is neither read nor needed here
  EXPECT_THAT(local->global_read, ElementsAre(1u, 2u));
  EXPECT_THAT(local->reader, ElementsAre(Pair(1u, kB), Pair(2u, kA)));
  EXPECT_EQ(local->plan.reads[0].offset, 128u);
  EXPECT_EQ(local->plan.reads[1].offset, 160u);
  EXPECT_EQ(local->global_index.size(), 2u);
  EXPECT_EQ(local->global_index.at({"1_1.safetensors", 160}), 2u);
  EXPECT_THAT(local->local_files, ElementsAre("1_1.safetensors"));
  ASSERT_EQ(local->served.size(), 1u);
  EXPECT_EQ(local->served[0].read, 2u);
  EXPECT_EQ(local->served[0].length, 32u);
  EXPECT_THAT(local->served[0].needers, ElementsAre(kB));
  ASSERT_EQ(local->plan.ranks.size(), 1u);
  ASSERT_EQ(local->plan.ranks[0].copies.size(), 2u);
  EXPECT_EQ(local->plan.ranks[0].copies[0].read, 0u);  // local indices
  EXPECT_EQ(local->plan.ranks[0].copies[1].read, 1u);
}

// A part holding some of the job's reads names each by its index in the
// job's plan (ReadMsg.id, ascending): what the node fetches and serves by.
TEST_F(PlanPartTest, ReadsNamedByTheirIndexInTheJobsPlan) {
  part_.mutable_reads(0)->set_id(5);
  part_.mutable_reads(1)->set_id(7);
  part_.mutable_reads(2)->set_id(9);
  auto local = LocalPartOf(part_, ctx_);
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_THAT(local->global_read, ElementsAre(7u, 9u));
  EXPECT_THAT(local->reader, ElementsAre(Pair(7u, kB), Pair(9u, kA)));
  EXPECT_EQ(local->global_index.at({"1_1.safetensors", 160}), 9u);
  ExpectRefused([](pv1::PlanPart& p) { p.mutable_reads(1)->set_id(4); }, "reads[1].id",
                "is not above reads[0]'s 5");
  ExpectRefused([](pv1::PlanPart& p) { p.mutable_reads(2)->set_id(1u << 30); }, "reads[2].id");
}

TEST_F(PlanPartTest, RefusesIndicesOutOfRange) {
  ExpectRefused([](pv1::PlanPart& p) { p.mutable_reads(1)->set_file(2); }, "reads[1].file",
                "2 is not an index into files (2 files)");
  ExpectRefused([](pv1::PlanPart& p) { p.mutable_reads(1)->set_file(UINT32_MAX); }, "reads[1].file");
  ExpectRefused([&](pv1::PlanPart& p) { Copy(p).set_read(3); }, "ranks[0].copies[0].read",
                "3 is not an index into reads (3 reads)");
  ExpectRefused([&](pv1::PlanPart& p) { Copy(p, 1).set_read(UINT32_MAX); },
                "ranks[0].copies[1].read");
  ExpectRefused([&](pv1::PlanPart& p) { Copy(p).set_target(1); }, "ranks[0].copies[0].target",
                "1 is not an index into the rank's 1 targets");
}

TEST_F(PlanPartTest, RefusesReadsThisNodeNeitherReadsNorFetches) {
  // Read 0 exists but is B's alone: a copy from it would find no local read.
  ExpectRefused([&](pv1::PlanPart& p) { Copy(p).set_read(0); }, "ranks[0].copies[0].read",
                "neither read by this node nor needed by it");
  ExpectRefused([](pv1::PlanPart& p) { p.mutable_reads(1)->clear_reader(); }, "reads[1].reader",
                "this node needs the read");
}

TEST_F(PlanPartTest, RefusesRanksThisNodeDoesNotServe) {
  ExpectRefused([](pv1::PlanPart& p) { p.mutable_ranks(0)->set_rank(2); }, "ranks[0].rank",
                "outside the job's world of 2 ranks");
  ExpectRefused([](pv1::PlanPart& p) { p.mutable_ranks(0)->set_rank(-1); }, "ranks[0].rank");
  ExpectRefused([](pv1::PlanPart& p) { p.mutable_ranks(0)->set_rank(0); }, "ranks[0].rank",
                "this node's rank 0 is 1");
  ExpectRefused([](pv1::PlanPart& p) { p.add_ranks()->set_rank(0); }, "ranks",
                "2 ranks, but this node serves 1");
  ExpectRefused([](pv1::PlanPart& p) { p.clear_ranks(); }, "ranks");
}

TEST_F(PlanPartTest, RefusesTargetsOtherThanTheRankAskedFor) {
  ExpectRefused([](pv1::PlanPart& p) { SetBox(p.mutable_ranks(0)->mutable_targets(0)->mutable_box(), {0, 0}, {8, 4}); },
                "ranks[0].targets[0]", "is not the target rank 1 asked for");
  ExpectRefused([](pv1::PlanPart& p) { p.mutable_ranks(0)->mutable_targets(0)->set_dtype("BF16"); },
                "ranks[0].targets[0]");
  ExpectRefused([](pv1::PlanPart& p) { p.mutable_ranks(0)->mutable_targets(0)->set_dtype("F99"); },
                "ranks[0].targets[0]");
  ExpectRefused([](pv1::PlanPart& p) { p.mutable_ranks(0)->add_targets()->set_name("x"); },
                "ranks[0].targets", "2 targets, but rank 1 asked for 1");
  ExpectRefused([](pv1::PlanPart& p) { SetBox(p.mutable_ranks(0)->mutable_targets(0)->mutable_box(), {4}, {4, 4}); },
                "ranks[0].targets[0].box", "offset has 1 axes, shape 2");
  ExpectRefused(
      [](pv1::PlanPart& p) {
        for (int i = 0; i < 2; ++i) p.mutable_ranks(0)->add_missing_keys("w");
      },
      "ranks[0].missing_keys");
}

TEST_F(PlanPartTest, RefusesOverflowingOrMisplacedByteRanges) {
  ExpectRefused([](pv1::PlanPart& p) { p.mutable_reads(2)->set_offset(UINT64_MAX - 8); },
                "reads[2].offset", "past the largest file offset");
  ExpectRefused([](pv1::PlanPart& p) { p.mutable_reads(2)->set_offset(uint64_t{1} << 63); },
                "reads[2].offset");
  ExpectRefused([](pv1::PlanPart& p) { p.mutable_reads(2)->set_length(2 << 20); }, "reads[2].length",
                "over the longest read this node takes (1048576 bytes");
  // Sorted by file name and offset, disjoint (DistSource keys reads by them).
  ExpectRefused([](pv1::PlanPart& p) { p.mutable_reads(2)->set_offset(150); }, "reads[2]",
                "is not after reads[1]");
  ExpectRefused([](pv1::PlanPart& p) { p.mutable_reads(2)->set_offset(128); }, "reads[2]");
  ExpectRefused([](pv1::PlanPart& p) { p.mutable_reads(0)->set_file(1); }, "reads[1]");
  // Checksum ranges inside their read.
  ExpectRefused([](pv1::PlanPart& p) { p.mutable_reads(1)->mutable_checks(0)->set_nbytes(33); },
                "reads[1].checks[0]", "not inside the read [128, +32)");
  ExpectRefused([](pv1::PlanPart& p) { p.mutable_reads(1)->mutable_checks(0)->set_offset(100); },
                "reads[1].checks[0]");
  ExpectRefused(
      [](pv1::PlanPart& p) {
        p.mutable_reads(1)->mutable_checks(0)->set_offset(130);
        p.mutable_reads(1)->mutable_checks(0)->set_nbytes(UINT64_MAX);
      },
      "reads[1].checks[0]");
  // A copy's source bytes inside its read.
  ExpectRefused([&](pv1::PlanPart& p) { Copy(p).set_src_offset(130); }, "ranks[0].copies[0].src_offset",
                "source bytes [130, +32) are not inside read 1 [128, +32)");
  ExpectRefused([&](pv1::PlanPart& p) { Copy(p).set_src_offset(UINT64_MAX); },
                "ranks[0].copies[0].src_offset");
  ExpectRefused([&](pv1::PlanPart& p) { Copy(p).set_src_offset(0); }, "ranks[0].copies[0].src_offset");
}

TEST_F(PlanPartTest, RefusesCopiesOutsideTheirBoxes) {
  ExpectRefused([&](pv1::PlanPart& p) { SetBox(Copy(p).mutable_region(), {2, 0}, {2, 4}); },
                "ranks[0].copies[0].region", "not inside the target box");
  ExpectRefused([&](pv1::PlanPart& p) { SetBox(Copy(p).mutable_region(), {4, 0}, {2, 5}); },
                "ranks[0].copies[0].region");
  ExpectRefused([&](pv1::PlanPart& p) { SetBox(Copy(p).mutable_region(), {4}, {2}); },
                "ranks[0].copies[0].region");
  ExpectRefused([&](pv1::PlanPart& p) { SetBox(Copy(p).mutable_region(), {4, 0}, {2}); },
                "ranks[0].copies[0].region", "offset has 2 axes, shape 1");
  ExpectRefused([&](pv1::PlanPart& p) { SetBox(Copy(p).mutable_region(), {INT64_MAX, 0}, {2, 4}); },
                "ranks[0].copies[0].region", "not a range of non-negative int64 indices");
  ExpectRefused([&](pv1::PlanPart& p) { SetBox(Copy(p).mutable_src()->mutable_box(), {5, 0}, {3, 4}); },
                "ranks[0].copies[0].region", "not inside the source box");
  ExpectRefused([&](pv1::PlanPart& p) { SetBox(Copy(p).mutable_src()->mutable_box(), {-1, 0}, {4, 4}); },
                "ranks[0].copies[0].src.box");
  ExpectRefused(
      [&](pv1::PlanPart& p) { SetBox(Copy(p).mutable_src()->mutable_box(), {0, 0}, {INT64_MAX / 2, 4}); },
      "ranks[0].copies[0].src.box", "overflows int64");
  ExpectRefused([&](pv1::PlanPart& p) { Copy(p).mutable_src()->set_flat_end(17); },
                "ranks[0].copies[0].src.flat_begin", "not a range inside the source box's 16 elements");
  ExpectRefused([&](pv1::PlanPart& p) { Copy(p).mutable_src()->set_flat_begin(-1); },
                "ranks[0].copies[0].src.flat_begin");
  ExpectRefused([&](pv1::PlanPart& p) { Copy(p).mutable_src()->set_flat_begin(9); },
                "ranks[0].copies[0].src.flat_begin");
  ExpectRefused([&](pv1::PlanPart& p) { Copy(p).mutable_src()->add_perm(0); }, "ranks[0].copies[0].src.perm");
  ExpectRefused(
      [&](pv1::PlanPart& p) {
        Copy(p).mutable_src()->add_perm(1);
        Copy(p).mutable_src()->add_perm(1);
      },
      "ranks[0].copies[0].src.perm");
  ExpectRefused([&](pv1::PlanPart& p) { Copy(p).mutable_src()->set_dtype("I64"); },
                "ranks[0].copies[0].src.dtype", "does not convert to the target's F32");
  ExpectRefused([&](pv1::PlanPart& p) { Copy(p).mutable_src()->set_dtype(""); },
                "ranks[0].copies[0].src.dtype");
  ExpectRefused([&](pv1::PlanPart& p) { Copy(p).set_elements(9); }, "ranks[0].copies[0].elements");
  ExpectRefused([&](pv1::PlanPart& p) { Copy(p).set_elements(-1); }, "ranks[0].copies[0].elements");
}

TEST_F(PlanPartTest, RefusesUnknownNodesAndFiles) {
  ExpectRefused([](pv1::PlanPart& p) { p.set_job_id("job-2"); }, "job_id");
  ExpectRefused([](pv1::PlanPart& p) { p.set_nccl_id("short"); }, "nccl_id");
  ExpectRefused([](pv1::PlanPart& p) { p.mutable_nodes()->RemoveLast(); }, "nodes",
                "the sender '10.0.0.2:7071' is not among them");
  ExpectRefused([](pv1::PlanPart& p) { p.set_nodes(0, "10.0.0.3:7071"); }, "nodes",
                "this node");
  ExpectRefused([](pv1::PlanPart& p) { p.add_nodes(kA); }, "nodes[2]", "appears twice");
  ExpectRefused([](pv1::PlanPart& p) { p.add_nodes(""); }, "nodes[2]", "empty");
  ExpectRefused([](pv1::PlanPart& p) { p.add_nodes(std::string(2000, 'x')); }, "nodes[2]",
                "2000 bytes, over the limit of 1024");
  ExpectRefused([](pv1::PlanPart& p) { p.mutable_reads(1)->set_reader("10.0.0.3:7071"); },
                "reads[1].reader", "is not a node of the job");
  ExpectRefused([](pv1::PlanPart& p) { p.mutable_reads(1)->add_needed_by("10.0.0.3:7071"); },
                "reads[1].needed_by[1]");
  ExpectRefused([](pv1::PlanPart& p) { p.mutable_reads(2)->add_needed_by(kA); },
                "reads[2].needed_by[2]", "appears twice");
  ExpectRefused([](pv1::PlanPart& p) { p.set_files(1, "../1_1.safetensors"); }, "files[1]",
                "not a plain file name");
  ExpectRefused([](pv1::PlanPart& p) { p.set_files(1, std::string("1_1\0x", 5)); }, "files[1]");
  ExpectRefused([](pv1::PlanPart& p) { p.set_files(1, "0_1.safetensors"); }, "files[1]",
                "appears twice");
}

TEST_F(PlanPartTest, RefusesCountsOverTheLimits) {
  ctx_.limits.max_files = 1;
  ExpectRefused([](pv1::PlanPart&) {}, "files", "2 entries, over the limit of 1");
  ctx_.limits.max_files = 2;
  ctx_.limits.max_reads = 2;
  ExpectRefused([](pv1::PlanPart&) {}, "reads", "3 entries, over the limit of 2");
  ctx_.limits.max_reads = 3;
  ctx_.limits.max_nodes = 1;
  ExpectRefused([](pv1::PlanPart&) {}, "nodes");
  ctx_.limits.max_nodes = 2;
  ctx_.limits.max_copies_per_rank = 1;
  ExpectRefused([](pv1::PlanPart&) {}, "ranks[0].copies", "2 copies, over the limit of 1");
}

TEST_F(PlanPartTest, PeerStringsInMessagesAreEscapedAndShort) {
  pv1::PlanPart p = part_;
  p.set_files(1, std::string(300, '/') + "\n");
  const absl::Status st = ValidatePlanPart(p, ctx_);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("... (301 bytes)"));
  EXPECT_THAT(std::string(st.message()), ::testing::Not(HasSubstr("\n")));
  EXPECT_LT(st.message().size(), 200u);
}

// What the coordinator makes (PlanLoad, AssignReads, one part per node as
// CoordinatePlan builds them) passes on every node and covers its ranks.
TEST(PlanPartFromARealPlan, PassesOnEveryNode) {
  ckpt::CheckpointMetadata md;
  md.unique_id = 1;
  md.checksum_block = 256;
  uint64_t end[2] = {0, 0};
  for (const char* name : {"a", "b"}) {
    ckpt::TensorMeta t;
    t.dtype = ckpt::DType::kF32;
    t.global_shape = {64, 16};
    for (int r = 0; r < 2; ++r) {
      ckpt::ShardMeta s;
      s.file = absl::StrCat(r, "_1.safetensors");
      s.dtype = t.dtype;
      s.box = {{32 * r, 0}, {32, 16}};
      s.nbytes = 32 * 16 * 4;
      s.data_offset = end[r];
      end[r] += s.nbytes;
      s.xxh3.assign(s.nbytes / md.checksum_block, 1);
      t.shards.push_back(std::move(s));
    }
    md.tensors[name] = std::move(t);
  }
  ASSERT_EQ(ckpt::ValidateMetadata(md, "test"), absl::OkStatus());
  // 4 ranks; nodes 0 and 1 serve ranks {0, 1} and {2, 3}. Split on dim 1
  // every rank needs both files; on dim 0 node 0's ranks need only 0_1.
  for (const bool whole_tables : {false, true}) {
    for (const int dim : {1, 0}) {
      SCOPED_TRACE(absl::StrCat("dim ", dim, whole_tables ? ", whole tables" : ""));
      std::vector<ckpt::RankTargets> ranks(4);
      for (int r = 0; r < 4; ++r) {
        ranks[r].rank = r;
        const ckpt::Box box = dim == 1 ? ckpt::Box{{0, 4 * r}, {64, 4}} : ckpt::Box{{16 * r, 0}, {16, 16}};
        for (const char* name : {"a", "b"}) {
          ranks[r].tensors.push_back(Target(name, ckpt::DType::kF32, {64, 16}, box));
        }
      }
      ranks[3].tensors[1].dtype = ckpt::DType::kBF16;  // a cast
      const std::vector<std::string> nodes = {kA, kB};
      std::vector<pv1::JoinRequest> joins(2);
      for (int n = 0; n < 2; ++n) {
        joins[n].set_node(nodes[n]);
        for (int r = 2 * n; r < 2 * n + 2; ++r) {
          pv1::RankTargetsMsg* rm = joins[n].add_ranks();
          rm->set_rank(r);
          for (const auto& t : ranks[r].tensors) ToMsg(t, rm->add_targets());
        }
      }
      joins[0].add_readable()->set_name("0_1.safetensors");
      joins[1].add_readable()->set_name("0_1.safetensors");
      joins[1].add_readable()->set_name("1_1.safetensors");
      JobPlanInput in;
      in.job_id = kJob;
      in.metadata = &md;
      in.nodes = nodes;
      in.joins = {&joins[0], &joins[1]};
      in.coordinator = kB;
      in.max_read_bytes = 1024;  // several reads per file
      in.whole_tables = whole_tables;
      auto planned = PlanJobParts(in);
      ASSERT_TRUE(planned.ok()) << planned.status();
      ASSERT_EQ(planned->parts.size(), 2u);
      for (size_t n = 0; n < nodes.size(); ++n) {
        SCOPED_TRACE(nodes[n]);
        const pv1::PlanPart& part = planned->parts.at(nodes[n]);
        EXPECT_EQ(part.job_nodes(), 2u);
        PlanPartContext ctx;
        ctx.job_id = kJob;
        ctx.node = nodes[n];
        ctx.sender = kB;
        ctx.world_size = 4;
        ctx.limits.max_read_bytes = in.max_read_bytes;
        for (int r = 2 * static_cast<int>(n); r < 2 * static_cast<int>(n) + 2; ++r) {
          ctx.ranks.push_back(&ranks[r]);
        }
        ASSERT_EQ(ValidatePlanPart(part, ctx), absl::OkStatus());
        auto local = LocalPartOf(part, ctx);
        ASSERT_TRUE(local.ok()) << local.status();
        ASSERT_EQ(local->plan.ranks.size(), 2u);
        for (const ckpt::RankPlan& rp : local->plan.ranks) {
          for (const ckpt::CopyOp& c : rp.copies) {
            ASSERT_LT(c.read, local->plan.reads.size());
            const ckpt::ReadRange& r = local->plan.reads[c.read];
            EXPECT_GE(c.src_offset, r.offset);
            EXPECT_LE(c.src_offset + static_cast<uint64_t>(c.src.num_bytes()), r.offset + r.length);
          }
        }
        if (whole_tables) {
          EXPECT_EQ(static_cast<size_t>(part.reads_size()), planned->reads);
        } else {
          // Only reads this node makes or needs, each needed_by naming only
          // this node unless this node serves it.
          for (const auto& rm : part.reads()) {
            const bool here = std::find(rm.needed_by().begin(), rm.needed_by().end(), nodes[n]) !=
                              rm.needed_by().end();
            EXPECT_TRUE(rm.reader() == nodes[n] || here);
            if (rm.reader() != nodes[n]) EXPECT_EQ(rm.needed_by_size(), 1);
          }
          if (dim == 0 && n == 0) {
            // Node 0 needs rows 0-31 (0_1) and B reads all of 1_1 for itself.
            EXPECT_THAT(part.files(), ElementsAre("0_1.safetensors"));
            EXPECT_LT(static_cast<size_t>(part.reads_size()), planned->reads);
          }
        }
        ASSERT_GT(part.reads_size(), 1);
        // The read limit is the coordinator's cut: a smaller one refuses the part.
        ctx.limits.max_read_bytes = in.max_read_bytes / 2;
        EXPECT_THAT(std::string(ValidatePlanPart(part, ctx).message()), HasSubstr(".length"));
      }
    }
  }
}

// --- Multi-node saves -------------------------------------------------------

// Node A serves rank 1 of a 2-rank save; rank 1 handed over rows 4..7 of "w".
class SavePartTest : public ::testing::Test {
 protected:
  void SetUp() override {
    rank1_.rank = 1;
    rank1_.tensors.push_back(Target("w", ckpt::DType::kF32, {8, 4}, {{4, 0}, {4, 4}}));
    ctx_.job_id = kJob;
    ctx_.node = kA;
    ctx_.sender = kB;
    ctx_.world_size = 2;
    ctx_.ranks = {&rank1_};
    part_.set_job_id(kJob);
    part_.add_nodes(kA);
    part_.add_nodes(kB);
    pv1::SavePart* sp = part_.mutable_save();
    sp->set_unique_id(3);
    sp->set_checksum_block(1 << 20);
    pv1::TensorInfoMsg* t = sp->add_tensors();
    t->set_name("w");
    t->set_dtype("F32");
    t->add_global_shape(8);
    t->add_global_shape(4);
    pv1::RankTargetsMsg* w = sp->add_writes();
    w->set_rank(1);
    ToMsg(rank1_.tensors[0], w->add_targets());
  }
  absl::Status Check() { return LocalSaveOf(part_, ctx_, 3).status(); }
  ckpt::RankTargets rank1_;
  PlanPartContext ctx_;
  pv1::PlanPart part_;
};

TEST_F(SavePartTest, ValidPartBecomesThisNodesWrites) {
  auto local = LocalSaveOf(part_, ctx_, 3);
  ASSERT_TRUE(local.ok()) << local.status();
  ASSERT_EQ(local->plan.writes.size(), 2u);
  EXPECT_TRUE(local->plan.writes[0].empty());
  ASSERT_EQ(local->plan.writes[1].size(), 1u);
  EXPECT_EQ(local->plan.writes[1][0].box, (ckpt::Box{{4, 0}, {4, 4}}));
  EXPECT_EQ(local->plan.tensors.count("w"), 1u);
}

TEST_F(SavePartTest, ShardTheRankDidNotHandOverIsRefused) {
  // A larger box than rank 1 gave: writing it would read past its bytes.
  SetBox(part_.mutable_save()->mutable_writes(0)->mutable_targets(0)->mutable_box(), {0, 0}, {8, 4});
  EXPECT_THAT(Check().message(), HasSubstr("is not a shard rank 1 handed over"));
}

TEST_F(SavePartTest, RankOfAnotherNodeVersionAndBlockAreRefused) {
  pv1::PlanPart other = part_;
  other.mutable_save()->mutable_writes(0)->set_rank(0);
  EXPECT_THAT(LocalSaveOf(other, ctx_, 3).status().message(), HasSubstr("rank 0 is not served here"));
  EXPECT_THAT(LocalSaveOf(part_, ctx_, 4).status().message(), HasSubstr("save.unique_id"));
  // The daemons pick: the coordinator's version (3) is taken when it is at
  // least this node's proposal, refused when this node already holds it.
  auto picked = LocalSaveOf(part_, ctx_, 2, /*picked=*/true);
  ASSERT_TRUE(picked.ok()) << picked.status();
  EXPECT_EQ(picked->plan.unique_id, 3);
  EXPECT_THAT(LocalSaveOf(part_, ctx_, 4, /*picked=*/true).status().message(),
              HasSubstr("this node's directory is at version 3"));
  part_.mutable_save()->set_checksum_block(0);
  EXPECT_THAT(Check().message(), HasSubstr("save.checksum_block"));
}

TEST_F(SavePartTest, TensorInfoDisagreeingWithTheShardIsRefused) {
  part_.mutable_save()->mutable_tensors(0)->set_dtype("BF16");
  EXPECT_THAT(Check().message(), HasSubstr("disagrees with save.tensors"));
}

TEST(ShardMsg, RoundTripAndBadBoxRefused) {
  ckpt::ShardMeta s;
  s.file = "1_3.safetensors";
  s.box = ckpt::Box{{4, 0}, {4, 4}};
  s.dtype = ckpt::DType::kF32;
  s.data_offset = 128;
  s.nbytes = 64;
  s.xxh3 = {42};
  pv1::ShardMsg m;
  ToMsg("w", s, &m);
  auto back = FromMsg(m, "node B");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->first, "w");
  EXPECT_EQ(back->second.box, s.box);
  EXPECT_EQ(back->second.xxh3, s.xxh3);
  EXPECT_EQ(back->second.nbytes, 64u);
  SetBox(m.mutable_box(), {0}, {4, 4});
  EXPECT_THAT(FromMsg(m, "node B").status().message(), HasSubstr("node B"));
}

// FetchSpansOf: the spans a peer's fetch asks for, in either form.
pv1::FetchReadRequest Runs(const std::vector<uint64_t>& q) {
  pv1::FetchReadRequest r;
  for (uint64_t v : q) r.add_span_runs(v);
  return r;
}

std::string Refusal(const pv1::FetchReadRequest& r, uint64_t length) {
  absl::StatusOr<std::vector<ckpt::SpanRun>> got = FetchSpansOf(r, length);
  if (got.ok()) return "accepted";
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
  return std::string(got.status().message());
}

TEST(FetchSpansOf, BothFormsBecomeRuns) {
  pv1::FetchReadRequest old;
  for (auto [b, e] : {std::pair<int64_t, int64_t>{0, 4}, {4, 8}, {100, 101}}) {
    pv1::Range* r = old.add_spans();
    r->set_begin(b);
    r->set_end(e);
  }
  EXPECT_THAT(*FetchSpansOf(old, 101),
              ElementsAre(ckpt::SpanRun{0, 4, 0, 1}, ckpt::SpanRun{4, 4, 0, 1},
                          ckpt::SpanRun{100, 1, 0, 1}));
  // 16 rows of 64 bytes, 4096 apart, ending at the read's last byte; then
  // touching spans (stride == length).
  EXPECT_THAT(*FetchSpansOf(Runs({4032, 64, 4096, 16}), 16 * 4096),
              ElementsAre(ckpt::SpanRun{4032, 64, 4096, 16}));
  EXPECT_THAT(*FetchSpansOf(Runs({0, 8, 8, 4, 32, 1, 0, 1}), 33),
              ElementsAre(ckpt::SpanRun{0, 8, 8, 4}, ckpt::SpanRun{32, 1, 0, 1}));
  EXPECT_TRUE(FetchSpansOf(Runs({}), 10)->empty());  // the whole read
}

TEST(FetchSpansOf, RefusesRunsThatOverlapLeaveTheReadOrOverflow) {
  EXPECT_THAT(Refusal(Runs({0, 4, 8}), 100), HasSubstr("3 span_runs values (quadruples"));
  EXPECT_THAT(Refusal(Runs({0, 8, 4, 2}), 100), HasSubstr("span_runs[0] (begin 0, length 8, stride 4, count 2)"));
  EXPECT_THAT(Refusal(Runs({0, 4, 8, 0}), 100), HasSubstr("span_runs[0]"));   // no span
  EXPECT_THAT(Refusal(Runs({0, 0, 8, 2}), 100), HasSubstr("span_runs[0]"));   // empty spans
  EXPECT_EQ(Refusal(Runs({0, 4, 8, 13}), 100), "accepted");  // the last: [96, 100)
  EXPECT_THAT(Refusal(Runs({0, 4, 8, 14}), 100), HasSubstr("span_runs[0]"));  // [104, 108)
  // After [88, 92): from 92 on.
  EXPECT_EQ(Refusal(Runs({0, 4, 8, 12, 92, 4, 0, 1}), 100), "accepted");
  EXPECT_THAT(Refusal(Runs({0, 4, 8, 12, 91, 4, 0, 1}), 100), HasSubstr("span_runs[1]"));
  EXPECT_THAT(Refusal(Runs({101, 1, 0, 1}), 100), HasSubstr("span_runs[0]"));
  // Values that wrap 64 bits: a begin, a length or a stride times a count.
  const uint64_t big = ~uint64_t{0};
  EXPECT_THAT(Refusal(Runs({big, 2, 0, 1}), 100), HasSubstr("span_runs[0]"));
  EXPECT_THAT(Refusal(Runs({4, big, 0, 1}), 100), HasSubstr("span_runs[0]"));
  EXPECT_THAT(Refusal(Runs({0, 1, uint64_t{1} << 62, 5}), 100), HasSubstr("span_runs[0]"));
  EXPECT_THAT(Refusal(Runs({0, 1, 1, big}), 100), HasSubstr("span_runs[0]"));
  // More than kMaxFetchSpans spans in all, however few runs.
  const uint64_t half = kMaxFetchSpans / 2;
  EXPECT_EQ(Refusal(Runs({0, 1, 1, half, half, 1, 1, half}), 1 << 20), "accepted");
  EXPECT_THAT(Refusal(Runs({0, 1, 1, half, half, 1, 1, half + 1}), 1 << 20),
              HasSubstr("span_runs[1]"));
  // Not both forms.
  pv1::FetchReadRequest both = Runs({0, 1, 0, 1});
  pv1::Range* r = both.add_spans();
  r->set_begin(4);
  r->set_end(5);
  EXPECT_THAT(Refusal(both, 100), HasSubstr("both spans and span_runs"));
}

}  // namespace
}  // namespace ckptd
