// server/await.h: waits with a deadline for as long as the caller is there,
// and a gRPC cancellation check asked at most once per period.
#include "server/await.h"

#include <atomic>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace ckptd {
namespace {

TEST(ThrottledCancel, AsksAtOnceThenAtMostOncePerPeriod) {
  std::atomic<int> asked{0};
  std::function<bool()> check = ThrottledCancel(
      [&] {
        ++asked;
        return false;
      },
      absl::Hours(1));
  EXPECT_FALSE(check());
  EXPECT_EQ(asked.load(), 1);  // the first time: asked at once
  for (int i = 0; i < 1000; ++i) EXPECT_FALSE(check());
  EXPECT_EQ(asked.load(), 1);  // within the period: the last answer
}

TEST(ThrottledCancel, AsksAgainOnceThePeriodPassed) {
  std::atomic<int> asked{0};
  std::atomic<bool> gone{false};
  std::function<bool()> check = ThrottledCancel(
      [&] {
        ++asked;
        return gone.load();
      },
      absl::Milliseconds(20));
  EXPECT_FALSE(check());
  gone = true;
  EXPECT_FALSE(check());  // not asked yet: the client's cancel is noticed later
  EXPECT_EQ(asked.load(), 1);
  absl::SleepFor(absl::Milliseconds(30));
  EXPECT_TRUE(check());
  EXPECT_EQ(asked.load(), 2);
  // Once cancelled, always cancelled, without asking again.
  absl::SleepFor(absl::Milliseconds(30));
  gone = false;
  for (int i = 0; i < 100; ++i) EXPECT_TRUE(check());
  EXPECT_EQ(asked.load(), 2);
}

TEST(ThrottledCancel, ManyThreadsAskOnceAPeriod) {
  std::atomic<int> asked{0};
  std::atomic<int> inside{0};
  std::atomic<int> most_inside{0};
  std::function<bool()> check = ThrottledCancel(
      [&] {
        const int now = ++inside;
        int m = most_inside.load();
        while (now > m && !most_inside.compare_exchange_weak(m, now)) {
        }
        ++asked;
        absl::SleepFor(absl::Milliseconds(1));
        --inside;
        return false;
      },
      absl::Milliseconds(5));
  const absl::Time end = absl::Now() + absl::Milliseconds(200);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      while (absl::Now() < end) EXPECT_FALSE(check());
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(most_inside.load(), 1);  // one thread asks at a time
  // About one question per 5 ms + 1 ms of asking over 200 ms, not one per call.
  EXPECT_GE(asked.load(), 5);
  EXPECT_LE(asked.load(), 45);
}

TEST(ThrottledCancel, NoCheckStaysNoCheck) {
  EXPECT_FALSE(static_cast<bool>(ThrottledCancel(nullptr, absl::Milliseconds(10))));
}

TEST(AwaitOrCancel, ReturnsWhenTheConditionHolds) {
  absl::Mutex mu;
  bool ready = false;
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(20));
    absl::MutexLock lock(&mu);
    ready = true;
  });
  {
    absl::MutexLock lock(&mu);
    EXPECT_TRUE(AwaitOrCancel(&mu, absl::Condition(&ready), absl::Now() + absl::Seconds(10),
                              [] { return false; }));
  }
  setter.join();
}

TEST(AwaitOrCancel, FailsAtTheDeadline) {
  absl::Mutex mu;
  bool ready = false;
  absl::MutexLock lock(&mu);
  const absl::Time start = absl::Now();
  EXPECT_FALSE(AwaitOrCancel(&mu, absl::Condition(&ready), start + absl::Milliseconds(50),
                             [] { return false; }));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(50));
}

TEST(AwaitOrCancel, FailsWhenTheCallerWentAwayAskingOnlyAfterWaiting) {
  absl::Mutex mu;
  bool ready = false;
  int asked = 0;
  absl::MutexLock lock(&mu);
  const absl::Time start = absl::Now();
  EXPECT_FALSE(AwaitOrCancel(&mu, absl::Condition(&ready), start + absl::Seconds(30), [&] {
    ++asked;
    return true;
  }));
  EXPECT_EQ(asked, 1);
  // Asked after the first 100 ms of waiting, not before, and long before the deadline.
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(100));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  // A condition that already holds asks nothing.
  ready = true;
  EXPECT_TRUE(AwaitOrCancel(&mu, absl::Condition(&ready), start, [&] {
    ++asked;
    return true;
  }));
  EXPECT_EQ(asked, 1);
}

}  // namespace
}  // namespace ckptd
