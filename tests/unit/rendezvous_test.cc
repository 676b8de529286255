// The rendezvous of a multi-node job (server/multinode/rendezvous.h): the ring
// every node computes alike, the announcements a rendezvous node keeps
// (bounded, expiring) and the wait for one.
#include "server/multinode/rendezvous.h"

#include <algorithm>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ckptd {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(RendezvousRing, SameOnEveryNodeWhateverTheOrderAndSpreadOverJobs) {
  const std::vector<std::string> peers = {"10.0.0.3:7071", "10.0.0.1:7071", "10.0.0.2:7071",
                                          "10.0.0.4:7071"};
  std::vector<std::string> shuffled = {peers[2], peers[0], peers[3], peers[1], peers[0]};
  const auto ring = RendezvousRing("job-a", peers);
  EXPECT_EQ(RendezvousRing("job-a", shuffled), ring);
  ASSERT_EQ(ring.size(), 4u);  // every member once, in sorted order from some start
  std::vector<std::string> sorted = ring;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_THAT(sorted, ElementsAre("10.0.0.1:7071", "10.0.0.2:7071", "10.0.0.3:7071",
                                  "10.0.0.4:7071"));
  // Jobs start at different nodes: 64 job ids use every node first.
  std::set<std::string> firsts;
  for (int j = 0; j < 64; ++j) firsts.insert(RendezvousRing("job-" + std::to_string(j), peers)[0]);
  EXPECT_EQ(firsts.size(), 4u);
  EXPECT_TRUE(RendezvousRing("x", {}).empty());
}

TEST(Rendezvous, AnAnnouncementEndsTheWaitOfEveryoneAsking) {
  Rendezvous r(absl::Seconds(10));
  std::vector<std::thread> askers;
  std::vector<absl::StatusOr<std::vector<Rendezvous::Coordinator>>> got(3, absl::UnknownError(""));
  for (int i = 0; i < 3; ++i) {
    askers.emplace_back([&, i] { got[i] = r.Await("j", absl::Now() + absl::Seconds(10), nullptr); });
  }
  absl::SleepFor(absl::Milliseconds(100));
  ASSERT_TRUE(r.Announce("j", "10.0.0.1:7071", "mac").ok());
  for (auto& t : askers) t.join();
  for (const auto& g : got) {
    ASSERT_TRUE(g.ok()) << g.status();
    ASSERT_EQ(g->size(), 1u);
    EXPECT_EQ((*g)[0].node, "10.0.0.1:7071");
    EXPECT_EQ((*g)[0].mac, "mac");
  }
}

TEST(Rendezvous, WaitsEndAtTheDeadlineOrWhenTheCallerLeaves) {
  Rendezvous r(absl::Seconds(10));
  const absl::Time t0 = absl::Now();
  auto late = r.Await("j", t0 + absl::Milliseconds(300), nullptr);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(late.status().message()), HasSubstr("no coordinator of job 'j'"));
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(300));
  auto gone = r.Await("j", absl::Now() + absl::Seconds(30), [] { return true; });
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kCancelled);
}

TEST(Rendezvous, BoundedInJobsCoordinatorsAndSizesAndForgetsOldJobs) {
  Rendezvous::Limits l;
  l.max_jobs = 2;
  l.max_coordinators_per_job = 2;
  Rendezvous r(absl::Milliseconds(200), l);
  ASSERT_TRUE(r.Announce("a", "n1", "m").ok());
  ASSERT_TRUE(r.Announce("a", "n1", "m2").ok());  // the same node again: replaced
  ASSERT_TRUE(r.Announce("a", "n2", "m").ok());
  EXPECT_EQ(r.Announce("a", "n3", "m").code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(r.Announce("b", "n1", "m").ok());
  EXPECT_EQ(r.Announce("c", "n1", "m").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(r.Announce(std::string(2000, 'j'), "n1", "m").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.Announce("d", "", "m").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.Announce("d", "n1", std::string(65, 'm')).code(),
            absl::StatusCode::kInvalidArgument);
  auto a = r.Await("a", absl::Now(), nullptr);
  ASSERT_TRUE(a.ok());
  ASSERT_EQ(a->size(), 2u);
  EXPECT_EQ((*a)[0].mac, "m2");
  absl::SleepFor(absl::Milliseconds(300));  // both expire
  EXPECT_TRUE(r.Announce("c", "n1", "m").ok());
  EXPECT_EQ(r.size(), 1u);
}

}  // namespace
}  // namespace ckptd
