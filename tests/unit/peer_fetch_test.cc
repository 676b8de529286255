// Which FetchReads stream each read a node fetches from one peer comes in
// (server/multinode/peer_fetch.h AssignStreams): one stream per peer for a
// small transfer, lanes round-robin for a large one (up to the I/O threads),
// and consecutive segments within a stream's read and span limits.
#include "server/multinode/peer_fetch.h"

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

}  // namespace
}  // namespace ckptd
