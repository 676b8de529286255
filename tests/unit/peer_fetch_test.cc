// Which FetchReads stream each read a node fetches from one peer comes in
// (server/multinode/peer_fetch.h AssignStreams): one stream per peer for a
// small transfer, lanes round-robin for a large one (up to the I/O threads),
// and consecutive segments within a stream's read and span limits; and the
// receive buffers recycled over a node's streams (ReceiveBuffers).
#include "server/multinode/peer_fetch.h"

#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ckptd {
namespace {

using ::testing::ElementsAre;

std::vector<StreamRead> Reads(size_t n, uint64_t bytes, uint64_t spans = 1) {
  return std::vector<StreamRead>(n, StreamRead{bytes, spans});
}

TEST(AssignStreams, ASmallTransferIsOneStream) {
  EXPECT_THAT(AssignStreams(Reads(4, 1 << 20), 64 << 20, 4), ElementsAre(0, 0, 0, 0));
  EXPECT_TRUE(AssignStreams({}, 64 << 20, 4).empty());
}

TEST(AssignStreams, ALargeTransferIsDealtOverLanesUpToTheThreads) {
  // 6 reads of 32 MiB = 192 MiB: 3 lanes of 64 MiB; at most 2 threads.
  EXPECT_THAT(AssignStreams(Reads(6, 32 << 20), 64 << 20, 4), ElementsAre(0, 1, 2, 0, 1, 2));
  EXPECT_THAT(AssignStreams(Reads(6, 32 << 20), 64 << 20, 2), ElementsAre(0, 1, 0, 1, 0, 1));
  EXPECT_THAT(AssignStreams(Reads(3, 32 << 20), 64 << 20, 0), ElementsAre(0, 0, 0));
}

TEST(AssignStreams, SegmentsKeepEachStreamWithinItsLimits) {
  // At most 3 reads a stream: consecutive segments, each its own stream.
  EXPECT_THAT(AssignStreams(Reads(7, 1), 64 << 20, 4, /*max_reads=*/3),
              ElementsAre(0, 0, 0, 1, 1, 1, 2));
  // At most 10 spans a stream: 4 + 4 fit, the third read opens a segment.
  EXPECT_THAT(AssignStreams(Reads(5, 1, 4), 64 << 20, 4, 1000, /*max_spans=*/10),
              ElementsAre(0, 0, 1, 1, 2));
  // Two lanes: segment s's reads go to streams 2s and 2s + 1; every stream
  // within the limit of 3 reads.
  EXPECT_THAT(AssignStreams(Reads(8, 64 << 20), 64 << 20, 2, /*max_reads=*/3),
              ElementsAre(0, 1, 0, 2, 3, 2, 4, 5));
  // A read with more spans than the limit still goes somewhere (alone).
  EXPECT_THAT(AssignStreams({{1, 20}, {1, 1}}, 64 << 20, 4, 1000, 10), ElementsAre(0, 1));
}

// A buffer the executor let go serves the next read of a like size (its
// pages are in already); the latest max_kept wait; one more than twice the
// size asked is not handed out; buffers outlive the pool safely.
TEST(ReceiveBuffers, LetGoBuffersServeTheNextReadsWithinTheBound) {
  auto pool = std::make_shared<ReceiveBuffers>(2);
  std::shared_ptr<uint8_t> a = pool->Get(1 << 20);
  uint8_t* const pa = a.get();
  pa[(1 << 20) - 1] = 7;
  a.reset();                                  // kept
  std::shared_ptr<uint8_t> b = pool->Get(1 << 20);
  EXPECT_EQ(b.get(), pa);                     // the same memory again
  EXPECT_EQ(b.get()[(1 << 20) - 1], 7);       // as the last read left it
  std::shared_ptr<uint8_t> small = pool->Get(1000);
  EXPECT_NE(small.get(), pa);
  b.reset();
  std::shared_ptr<uint8_t> tiny = pool->Get(100);  // 1 MiB is over twice 100 bytes
  EXPECT_NE(tiny.get(), pa);
  std::shared_ptr<uint8_t> again = pool->Get(600 << 10);  // within twice
  EXPECT_EQ(again.get(), pa);
  again.reset();

  EXPECT_EQ(pool->kept(), 1u);

  // Four let go, the last two kept (the 1 MiB one, over twice 4096, goes);
  // taken again by the next two.
  std::vector<std::shared_ptr<uint8_t>> held;
  for (int i = 0; i < 4; ++i) held.push_back(pool->Get(4096));
  EXPECT_EQ(pool->kept(), 1u);
  held.clear();
  EXPECT_EQ(pool->kept(), 2u);
  for (int i = 0; i < 2; ++i) held.push_back(pool->Get(4096));
  EXPECT_EQ(pool->kept(), 0u);

  // The pool goes first: the buffers still held are freed by their holders
  // (the sanitizer runs check it).
  pool.reset();
  held.clear();
  small.reset();
  tiny.reset();
}

}  // namespace
}  // namespace ckptd
