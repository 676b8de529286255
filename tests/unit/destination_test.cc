// delivery/destination.h on real memory: a sealed memfd segment (targets
// checked before anything is mapped, host pointers at each target's offset,
// the bytes shared with the client's mapping) and stream buffers (sized by
// the plan, none for a missing key).
#include "server/delivery/destination.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ckptd {
namespace {

using ::testing::HasSubstr;

// A memfd of `size` bytes, as a client would send it.
int Memfd(uint64_t size) {
  const int fd = ::memfd_create("destination-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(::ftruncate(fd, static_cast<off_t>(size)), 0);
  EXPECT_EQ(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), 0);
  return fd;
}

ckpt::TargetTensor F32(const std::string& name, int64_t n) {
  return ckpt::TargetTensor{name, ckpt::DType::kF32, {n}, ckpt::Box{{0}, {n}}, std::nullopt};
}

TEST(Destination, ASegmentHandsOutEachTargetAtItsOffsetInTheClientsMemory) {
  const int fd = Memfd(4096);
  const int client_fd = ::dup(fd);  // the client keeps its own descriptor
  SegmentSource source;
  source.fd = fd;
  source.size = 4096;
  source.what = "rank 0: shm segment (memfd)";
  auto d = SegmentDestination::Open("rank 0", std::move(source),
                                    {{"a", 0, 64}, {"b", 1024, 16}});
  ASSERT_TRUE(d.ok()) << d.status();
  ckpt::RankPlan plan;
  plan.targets = {F32("a", 16), F32("b", 4)};
  RankDelivery rd = (*d)->Prepare(plan);
  ASSERT_EQ(rd.local.host.size(), 2u);
  ASSERT_NE((*d)->segment(), nullptr);
  EXPECT_EQ(static_cast<uint8_t*>(rd.local.host[1]) - static_cast<uint8_t*>(rd.local.host[0]),
            1024);
  // Bytes the daemon writes are the client's.
  std::memset(rd.local.host[1], 0x5a, 16);
  void* mine = ::mmap(nullptr, 4096, PROT_READ, MAP_SHARED, client_fd, 0);
  ASSERT_NE(mine, MAP_FAILED);
  EXPECT_EQ(static_cast<const uint8_t*>(mine)[1024 + 15], 0x5a);
  ::munmap(mine, 4096);
  ::close(client_fd);
}

TEST(Destination, ASegmentTooSmallOrOverlappingIsRefusedBeforeMapping) {
  SegmentSource small;
  small.fd = Memfd(4096);
  small.size = 4096;
  auto d = SegmentDestination::Open("job 'j' rank 1", std::move(small), {{"w", 4000, 200}});
  ASSERT_FALSE(d.ok());
  EXPECT_THAT(std::string(d.status().message()),
              HasSubstr("job 'j' rank 1 tensor 'w' needs bytes [4000, 4200) of the segment"));
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("(segment too small)"));
  SegmentSource overlap;
  overlap.fd = Memfd(4096);
  overlap.size = 4096;
  d = SegmentDestination::Open("rank 0", std::move(overlap), {{"a", 0, 128}, {"b", 64, 64}});
  ASSERT_FALSE(d.ok());
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("two targets overlap in the segment"));
}

TEST(Destination, StreamBuffersFollowThePlanAndSkipMissingKeys) {
  StreamDestination d;
  ckpt::RankPlan plan;
  plan.targets = {F32("a", 8), F32("gone", 1000), F32("b", 2)};
  plan.missing_keys = {"gone"};
  RankDelivery rd = d.Prepare(plan);
  ASSERT_EQ(rd.local.host.size(), 3u);
  ASSERT_EQ(d.streamed().size(), 3u);
  EXPECT_EQ(d.streamed()[0].size(), 32u);
  EXPECT_EQ(d.streamed()[1].size(), 0u);
  EXPECT_EQ(d.streamed()[2].size(), 8u);
  EXPECT_EQ(d.segment(), nullptr);
  EXPECT_EQ(d.views(), nullptr);
}

}  // namespace
}  // namespace ckptd
