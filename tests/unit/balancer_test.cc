// The multi-node balancer's rules (core/plan/balancer.h, docs/multi-node.md) on
// hand-built plans with exact expected assignments: every needed read is
// read once by one node (unneeded ones by none); a read a node needs and can
// read locally is read by such a node; otherwise by a node that can read its
// file; among candidates the fewest bytes so far (ties: lowest index), with
// the most constrained and then the largest reads placed first.
#include "core/plan/balancer.h"

#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ckpt {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

struct Read {
  uint32_t file;
  uint64_t length;
  std::vector<int> ranks;  // the ranks that copy from it
};

// A plan over `files` with `reads` (consecutive in each file) and
// `num_ranks` ranks; only what AssignReads looks at is filled in.
LoadPlan MakePlan(std::vector<std::string> files, const std::vector<Read>& reads, int num_ranks) {
  LoadPlan p;
  p.files = std::move(files);
  p.ranks.resize(num_ranks);
  for (int r = 0; r < num_ranks; ++r) p.ranks[r].rank = r;
  std::vector<uint64_t> end(p.files.size(), 0);
  for (size_t i = 0; i < reads.size(); ++i) {
    ReadRange rr;
    rr.file = reads[i].file;
    rr.offset = end[rr.file];
    rr.length = reads[i].length;
    end[rr.file] += rr.length;
    p.reads.push_back(rr);
    for (int r : reads[i].ranks) {
      CopyOp c;
      c.read = static_cast<uint32_t>(i);
      p.ranks[r].copies.push_back(c);
    }
    p.bytes_to_read += rr.length;
  }
  return p;
}

uint64_t Sum(const std::vector<uint64_t>& v) { return std::accumulate(v.begin(), v.end(), 0ull); }

// Every needed read has exactly one reader, an unneeded one none, and the
// bytes per node add up to the needed bytes: each needed byte read once.
TEST(Balancer, EveryNeededReadOnceUnneededNever) {
  // Ranks 0,1 on node 0, ranks 2,3 on node 1; shared storage.
  LoadPlan p = MakePlan({"0.safetensors", "1.safetensors"},
                        {{0, 100, {0, 2}}, {0, 50, {}}, {1, 70, {1, 3}}, {1, 30, {3}}}, 4);
  auto a = AssignReads(p, {0, 0, 1, 1}, {{"0.safetensors", "1.safetensors"},
                                         {"0.safetensors", "1.safetensors"}});
  ASSERT_TRUE(a.ok()) << a.status();
  // The 30 (only node 1 needs it: one candidate) first -> node 1; then
  // 100 -> node 0 (0 < 30); 70 -> node 1 (30 < 100).
  EXPECT_THAT(a->reader, ElementsAre(0, -1, 1, 1));
  EXPECT_THAT(a->needed_by[0], ElementsAre(0, 1));
  EXPECT_TRUE(a->needed_by[1].empty());
  EXPECT_THAT(a->needed_by[2], ElementsAre(0, 1));
  EXPECT_THAT(a->needed_by[3], ElementsAre(1));
  EXPECT_THAT(a->bytes_per_node, ElementsAre(100, 100));
  EXPECT_EQ(Sum(a->bytes_per_node), 200u);  // the unneeded 50 are not read
}

// Node-local storage: a read goes to a node that needs it and has its file,
// however much that node reads already and however idle the others are.
TEST(Balancer, LocalStorageFirst) {
  // Node 0 sees everything (say, a shared mount), node 1 only its own file.
  // Node 1's ranks need both of node 1's reads; node 0 needs nothing.
  LoadPlan p = MakePlan({"a", "b"}, {{1, 1000, {1}}, {1, 100, {1}}, {0, 10, {0}}}, 2);
  auto a = AssignReads(p, {0, 1}, {{"a", "b"}, {"b"}});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_THAT(a->reader, ElementsAre(1, 1, 0));
  EXPECT_THAT(a->bytes_per_node, ElementsAre(10, 1100));
}

// A read no needing node can read goes to a node that can read its file
// (the least loaded of them), after the local reads are placed.
TEST(Balancer, RemoteReadGoesToALeastLoadedNodeWithTheFile) {
  // Node 0 needs reads of file "c" which only nodes 1 and 2 have; node 1
  // already reads 500 bytes of its own "b" locally.
  LoadPlan p = MakePlan({"b", "c"}, {{0, 500, {1}}, {1, 300, {0}}, {1, 200, {0}}}, 2);
  // Three nodes: rank 0 on node 0, rank 1 on node 1; node 2 has no ranks.
  auto a = AssignReads(p, {0, 1}, {{}, {"b", "c"}, {"c"}});
  ASSERT_TRUE(a.ok()) << a.status();
  // 500 -> node 1 (local); then 300 -> node 2 (0 < 500); 200 -> node 2
  // (300 < 500).
  EXPECT_THAT(a->reader, ElementsAre(1, 2, 2));
  EXPECT_THAT(a->bytes_per_node, ElementsAre(0, 500, 500));
}

// Shared storage: every node a candidate; larger reads first, each to the
// node with the fewest bytes so far, ties to the lowest node index.
TEST(Balancer, SharedStorageBalancedByBytesLargestFirst) {
  // Both nodes need every read; reads in file order 100..500 bytes.
  LoadPlan p = MakePlan({"f"},
                        {{0, 100, {0, 1}}, {0, 200, {0, 1}}, {0, 300, {0, 1}},
                         {0, 400, {0, 1}}, {0, 500, {0, 1}}},
                        2);
  auto a = AssignReads(p, {0, 1}, {{"f"}, {"f"}});
  ASSERT_TRUE(a.ok()) << a.status();
  // 500 -> 0; 400 -> 1; 300 -> 1 (400 < 500); 200 -> 0 (500 < 700);
  // 100 -> 0 (700 = 700: the lower index).
  EXPECT_THAT(a->reader, ElementsAre(0, 0, 1, 1, 0));
  EXPECT_THAT(a->bytes_per_node, ElementsAre(800, 700));
}

// A read with fewer candidates is placed before larger ones with more, so
// the flexible reads even out what the constrained one forces.
TEST(Balancer, FewestCandidatesFirst) {
  // "x" only node 0 can read; "y" both. Both nodes need every read.
  LoadPlan p = MakePlan({"x", "y"}, {{0, 100, {0, 1}}, {1, 1000, {0, 1}}, {1, 1000, {0, 1}}}, 2);
  auto a = AssignReads(p, {0, 1}, {{"x", "y"}, {"y"}});
  ASSERT_TRUE(a.ok()) << a.status();
  // 100 -> 0 (its only candidate); 1000 -> 1 (0 < 100); 1000 -> 0.
  EXPECT_THAT(a->reader, ElementsAre(0, 1, 0));
  EXPECT_THAT(a->bytes_per_node, ElementsAre(1100, 1000));
}

// The same inputs give the same assignment.
TEST(Balancer, Deterministic) {
  LoadPlan p = MakePlan({"f", "g"},
                        {{0, 7, {0, 3}}, {0, 7, {1}}, {1, 7, {2, 3}}, {1, 9, {0, 1, 2, 3}}}, 4);
  const std::vector<std::set<std::string>> readable = {{"f", "g"}, {"f", "g"}, {"g"}};
  auto a = AssignReads(p, {0, 1, 2, 2}, readable);
  auto b = AssignReads(p, {0, 1, 2, 2}, readable);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->reader, b->reader);
  EXPECT_EQ(a->bytes_per_node, b->bytes_per_node);
  // The three 7s have one candidate each (f: node 0 of needers 0 and 2,
  // node 1; g: node 2) and go first, in read order; then the 9 (needers
  // 0, 1, 2 all have "g") to node 0 (7 = 7 = 7: the lowest index).
  EXPECT_THAT(a->reader, ElementsAre(0, 1, 2, 0));
  EXPECT_THAT(a->bytes_per_node, ElementsAre(16, 7, 7));
}

// A needed file no node can read is an error naming it; an unneeded one is
// no error.
TEST(Balancer, UnreadableNeededFileIsNamed) {
  LoadPlan p = MakePlan({"here", "gone"}, {{0, 10, {0}}, {1, 10, {1}}}, 2);
  auto a = AssignReads(p, {0, 1}, {{"here"}, {"here"}});
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(a.status().message()), HasSubstr("data file 'gone'"));
  p = MakePlan({"here", "gone"}, {{0, 10, {0}}, {1, 10, {}}}, 2);
  a = AssignReads(p, {0, 1}, {{"here"}, {"here"}});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_THAT(a->reader, ElementsAre(0, -1));
}


// With min_reader_bytes, reads several nodes need go to K readers only, K
// from their bytes read plus the bytes their needers copy out of them, spread
// over the node indices; a read one node needs stays local, and a shared read
// only a node outside the K can read still goes there.
TEST(Balancer, SharedReadsGoToFewReadersWhenSmall) {
  // 8 nodes, one rank each. Reads 0-15: 1000 bytes that every rank copies
  // 124 bytes of (31 F32); read 16: only rank 5's; read 17 (file "x", which
  // only node 3 can read): ranks 1 and 3.
  std::vector<Read> reads;
  for (int i = 0; i < 16; ++i) reads.push_back({0, 1000, {0, 1, 2, 3, 4, 5, 6, 7}});
  reads.push_back({0, 1000, {5}});
  reads.push_back({1, 100, {1, 3}});
  LoadPlan p = MakePlan({"f", "x"}, reads, 8);
  for (RankPlan& rp : p.ranks) {
    for (CopyOp& c : rp.copies) c.elements = 31;
  }
  std::vector<std::set<std::string>> readable(8, std::set<std::string>{"f"});
  readable[3].insert("x");
  const std::vector<int> node_of_rank = {0, 1, 2, 3, 4, 5, 6, 7};

  auto all = AssignReads(p, node_of_rank, readable);  // no limit: every node reads
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->shared_readers, 8);
  for (uint64_t b : all->bytes_per_node) EXPECT_GT(b, 0u);

  // Shared bytes: 16 x (1000 + 8 x 124) + (100 + 2 x 100 capped at the
  // read) = 32172: K = ceil(32172 / 8000) = 5 -> nodes 0, 1, 3, 4, 6.
  AssignOptions o;
  o.min_reader_bytes = 8000;
  auto few = AssignReads(p, node_of_rank, readable, o);
  ASSERT_TRUE(few.ok()) << few.status();
  EXPECT_EQ(few->shared_readers, 5);
  std::set<int> shared_readers;
  for (int i = 0; i < 16; ++i) shared_readers.insert(few->reader[i]);
  EXPECT_THAT(shared_readers, ::testing::ElementsAre(0, 1, 3, 4, 6));
  EXPECT_EQ(few->reader[16], 5);  // one needer: local
  EXPECT_EQ(few->reader[17], 3);  // only node 3 has "x" (preferred anyway)
  EXPECT_EQ(Sum(few->bytes_per_node), 16u * 1000 + 1000 + 100);
  // Balanced over the five: 16 reads -> 4, 3, 3, 3, 3 (node 3 also has "x").
  EXPECT_THAT(few->bytes_per_node, ElementsAre(4000, 3000, 0, 3100, 3000, 1000, 3000, 0));

  // One reader: every shared read of "f" goes to node 0;
  // all 16 go to node 0; "x" still to node 3.
  o.min_reader_bytes = 1ull << 40;
  auto one = AssignReads(p, node_of_rank, readable, o);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->shared_readers, 1);
  EXPECT_EQ(one->bytes_per_node[0], 16000u);
  EXPECT_EQ(one->reader[17], 3);

  // First readers (a coordinator, a rendezvous node) come first, the rest
  // evenly; out-of-range and repeated entries are passed over.
  o.min_reader_bytes = 8000;
  o.first_readers = {5, 2, 5, -1, 9};
  auto first = AssignReads(p, node_of_rank, readable, o);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->shared_readers, 5);
  shared_readers.clear();
  for (int i = 0; i < 16; ++i) shared_readers.insert(first->reader[i]);
  EXPECT_THAT(shared_readers, ::testing::ElementsAre(0, 1, 2, 3, 5));
  o.min_reader_bytes = 1ull << 40;
  auto first_one = AssignReads(p, node_of_rank, readable, o);
  ASSERT_TRUE(first_one.ok()) << first_one.status();
  EXPECT_EQ(first_one->bytes_per_node[5], 16000u + 1000u);  // and its own read 16
  EXPECT_EQ(first_one->bytes_per_node[0], 0u);
}

// A read several nodes need, none of them among the K readers (a block of
// rows that a few nodes share): it goes to one of the K, which sends it to
// all of its needers, not to one of the needers (which would make every
// such block's needers readers, as many as the blocks).
TEST(Balancer, SharedReadsWhoseNeedersAreNoReadersGoToTheReaders) {
  // 8 nodes; reads 0-3 of 4000 bytes, each needed by two nodes: {2, 3},
  // {4, 5}, {6, 7}, {2, 7}; node 6 alone cannot read file "x" (read 4,
  // needed by 1 and 6 with 1 not preferred either).
  std::vector<Read> reads = {{0, 4000, {2, 3}}, {0, 4000, {4, 5}}, {0, 4000, {6, 7}},
                             {0, 4000, {2, 7}}, {1, 4000, {1, 6}}};
  LoadPlan p = MakePlan({"f", "x"}, reads, 8);
  for (RankPlan& rp : p.ranks) {
    for (CopyOp& c : rp.copies) c.elements = 1000;
  }
  std::vector<std::set<std::string>> readable(8, std::set<std::string>{"f", "x"});
  readable[0].erase("x");
  readable[4].erase("x");
  const std::vector<int> node_of_rank = {0, 1, 2, 3, 4, 5, 6, 7};
  AssignOptions o;
  o.min_reader_bytes = 20000;  // 5 x (4000 + 2 x 4000) = 60000: K = 3 -> nodes 0, 2, 5
  auto a = AssignReads(p, node_of_rank, readable, o);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->shared_readers, 3);
  EXPECT_EQ(a->reader[0], 2);  // a needer among the readers: it reads
  EXPECT_EQ(a->reader[1], 5);
  EXPECT_EQ(a->reader[3], 2);
  // {6, 7}: no reader needs it: the least loaded reader that can read it.
  EXPECT_EQ(a->reader[2], 0);
  // "x": 0 cannot read it; 2 and 5 can (balanced by bytes).
  EXPECT_TRUE(a->reader[4] == 2 || a->reader[4] == 5) << a->reader[4];
  for (size_t i = 0; i < reads.size(); ++i) {
    EXPECT_TRUE(a->reader[i] == 0 || a->reader[i] == 2 || a->reader[i] == 5) << "read " << i;
  }
  EXPECT_EQ(Sum(a->bytes_per_node), 5u * 4000);
}

}  // namespace
}  // namespace ckpt
