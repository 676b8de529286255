// The job registry and barrier (server/jobs/registry.h) and the save buffer
// (server/save/save_buffer.h), on real threads: ranks register, the last one
// runs the job, the others wait for their outcome or the barrier's deadline.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "server/jobs/registry.h"
#include "server/jobs/restart.h"
#include "server/save/save_buffer.h"

namespace ckptd {
namespace {

using ::testing::HasSubstr;

JobKey Key(const std::string& id, int rank, int world = 2, uid_t owner = 1000) {
  return JobKey{JobKind::kLoad, id, "/ckpt/a", std::nullopt, owner, world, rank, {}};
}

std::shared_ptr<RankSlot> Slot() {
  auto s = std::make_shared<RankSlot>();
  s->registered = absl::Now();
  return s;
}

bool Done(const RankSlot& s) {
  absl::MutexLock lock(&s.mu);
  return s.done;
}

TEST(JobRegistry, TheLastRankRunsTheJobAndEveryRankGetsItsOutcome) {
  JobRegistry jobs(64);
  size_t registered = 0, expected = 0;
  auto s0 = Slot(), s1 = Slot();
  auto r0 = jobs.Register(Key("j", 0), s0, &registered, &expected);
  ASSERT_TRUE(r0.ok()) << r0.status();
  EXPECT_FALSE(r0->second);  // not the runner: rank 1 is still missing
  EXPECT_EQ(registered, 1u);
  EXPECT_EQ(expected, 2u);
  auto r1 = jobs.Register(Key("j", 1), s1, &registered, &expected);
  ASSERT_TRUE(r1.ok()) << r1.status();
  EXPECT_TRUE(r1->second);
  EXPECT_EQ(r0->first, r1->first);
  EXPECT_THAT(SlotsOf(*r1->first), ::testing::ElementsAre(s0, s1));

  std::thread waiter([&] {
    absl::Status st = jobs.AwaitSlot(r0->first, s0, 0, absl::Seconds(30), nullptr, [] { return false; });
    EXPECT_TRUE(st.ok()) << st;
  });
  jobs.Finish(*r1->first, [&] {
    for (const auto& s : {s0, s1}) {
      absl::MutexLock lock(&s->mu);
      s->done = true;
    }
  });
  waiter.join();
  // The job left the registry: the id is free for a new job.
  v1::StatusResponse status;
  jobs.Describe(true, 0, &status);
  EXPECT_EQ(status.jobs_size(), 0);
  auto again = jobs.Register(Key("j", 0), Slot(), &registered, &expected);
  EXPECT_TRUE(again.ok()) << again.status();
}

TEST(JobRegistry, RanksThatDisagreeOrComeTwiceAreRefusedByName) {
  JobRegistry jobs(64);
  size_t registered = 0, expected = 0;
  ASSERT_TRUE(jobs.Register(Key("j", 0, 3), Slot(), &registered, &expected).ok());
  auto twice = jobs.Register(Key("j", 0, 3), Slot(), &registered, &expected);
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(twice.status().message(), HasSubstr("job 'j' rank 0 is already registered"));
  auto world = jobs.Register(Key("j", 1, 4), Slot(), &registered, &expected);
  EXPECT_EQ(world.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(world.status().message(), HasSubstr("world_size 4 vs 3"));
  JobKey save = Key("j", 1, 3);
  save.kind = JobKind::kSave;
  EXPECT_THAT(jobs.Register(save, Slot(), &registered, &expected).status().message(),
              HasSubstr("one side loads, the other saves"));
  auto other_user = jobs.Register(Key("j", 1, 3, 1001), Slot(), &registered, &expected);
  EXPECT_EQ(other_user.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(other_user.status().message(), HasSubstr("belongs to another user (uid 1000)"));
  JobKey not_here = Key("k", 2, 3);
  not_here.node_ranks = {0, 1};
  EXPECT_THAT(jobs.Register(not_here, Slot(), &registered, &expected).status().message(),
              HasSubstr("rank 2 is not among the ranks of this node"));
}

TEST(JobRegistry, AUidHasAtMostItsShareOfJobs) {
  JobRegistry jobs(2);
  size_t registered = 0, expected = 0;
  ASSERT_TRUE(jobs.Register(Key("a", 0), Slot(), &registered, &expected).ok());
  ASSERT_TRUE(jobs.Register(Key("b", 0), Slot(), &registered, &expected).ok());
  auto third = jobs.Register(Key("c", 0), Slot(), &registered, &expected);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.status().message(), HasSubstr("limits.max_jobs_per_uid 2"));
  // Another uid is not counted against it.
  EXPECT_TRUE(jobs.Register(Key("d", 0, 2, 1001), Slot(), &registered, &expected).ok());
}

TEST(JobRegistry, TheBarrierDeadlineFailsTheJobNamingTheRanksThatNeverCame) {
  JobRegistry jobs(64);
  size_t registered = 0, expected = 0;
  auto s0 = Slot();
  auto r0 = jobs.Register(Key("j", 0, 3), s0, &registered, &expected);
  ASSERT_TRUE(r0.ok());
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status st = jobs.AwaitSlot(r0->first, s0, 0, absl::Milliseconds(200), nullptr,
                                   [] { return false; });
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(st.message(), HasSubstr("ranks 1,2 never registered within 200ms (1 of 3"));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  v1::StatusResponse status;
  jobs.Describe(true, 0, &status);
  EXPECT_EQ(status.jobs_size(), 0);  // failed jobs leave the registry
}

TEST(JobRegistry, ARankWhoseClientLeavesTakesItsPlaceBackWhileTheJobWaits) {
  JobRegistry jobs(64);
  size_t registered = 0, expected = 0;
  auto s0 = Slot();
  auto r0 = jobs.Register(Key("j", 0), s0, &registered, &expected);
  ASSERT_TRUE(r0.ok());
  absl::Status st =
      jobs.AwaitSlot(r0->first, s0, 0, absl::Seconds(30), nullptr, [] { return true; });
  EXPECT_EQ(st.code(), absl::StatusCode::kCancelled);
  // Rank 0 may come again (a retry) and the job still forms.
  ASSERT_TRUE(jobs.Register(Key("j", 0), Slot(), &registered, &expected).ok());
  auto r1 = jobs.Register(Key("j", 1), Slot(), &registered, &expected);
  ASSERT_TRUE(r1.ok());
  EXPECT_TRUE(r1->second);
}

TEST(JobRegistry, DescribeShowsOnlyTheCallersJobsUnlessAll) {
  JobRegistry jobs(64);
  size_t registered = 0, expected = 0;
  ASSERT_TRUE(jobs.Register(Key("mine", 1, 3), Slot(), &registered, &expected).ok());
  ASSERT_TRUE(jobs.Register(Key("theirs", 0, 2, 1001), Slot(), &registered, &expected).ok());
  v1::StatusResponse own;
  jobs.Describe(false, 1000, &own);
  ASSERT_EQ(own.jobs_size(), 1);
  EXPECT_EQ(own.jobs(0).job_id(), "mine");
  EXPECT_THAT(own.jobs(0).registered_ranks(), ::testing::ElementsAre(1));
  EXPECT_THAT(own.jobs(0).waiting_for(), ::testing::ElementsAre(0, 2));
  EXPECT_EQ(own.jobs(0).state(), "waiting for ranks");
  v1::StatusResponse all;
  jobs.Describe(true, 0, &all);
  EXPECT_EQ(all.jobs_size(), 2);
}

TEST(JobRegistry, AbortLoadsFailsEveryLoadAndLeavesSaves) {
  JobRegistry jobs(64);
  size_t registered = 0, expected = 0;
  auto load = Slot();
  auto r = jobs.Register(Key("load", 0), load, &registered, &expected);
  ASSERT_TRUE(r.ok());
  JobKey save = Key("save", 0);
  save.kind = JobKind::kSave;
  ASSERT_TRUE(jobs.Register(save, Slot(), &registered, &expected).ok());
  EXPECT_THAT(jobs.AbortLoads("the daemon is stopping"), ::testing::ElementsAre("load"));
  ASSERT_TRUE(Done(*load));
  {
    absl::MutexLock lock(&load->mu);
    EXPECT_EQ(load->status.code(), absl::StatusCode::kUnavailable);
    EXPECT_EQ(load->status.message(), "job 'load': the daemon is stopping");
  }
  EXPECT_EQ(r->first->AbortStatus().code(), absl::StatusCode::kUnavailable);
  v1::StatusResponse status;
  jobs.Describe(true, 0, &status);
  ASSERT_EQ(status.jobs_size(), 1);
  EXPECT_EQ(status.jobs(0).job_id(), "save");
}

TEST(JobRegistry, AbortWaitingFailsJobsWaitingForRanksRetryableAndLeavesRunningOnes) {
  JobRegistry jobs(64);
  size_t registered = 0, expected = 0;
  auto waiting = Slot();
  ASSERT_TRUE(jobs.Register(Key("waiting", 0, 2), waiting, &registered, &expected).ok());
  JobKey save = Key("save-waiting", 0, 2);
  save.kind = JobKind::kSave;
  auto save_slot = Slot();
  ASSERT_TRUE(jobs.Register(save, save_slot, &registered, &expected).ok());
  auto running = jobs.Register(Key("running", 0, 1), Slot(), &registered, &expected);
  ASSERT_TRUE(running.ok() && running->second);  // its one rank came: it runs
  auto ids = jobs.AbortWaiting("ckptd is restarting");
  std::sort(ids.begin(), ids.end());
  EXPECT_THAT(ids, ::testing::ElementsAre("save-waiting", "waiting"));
  for (const auto& s : {waiting, save_slot}) {
    ASSERT_TRUE(Done(*s));
    absl::MutexLock lock(&s->mu);
    EXPECT_EQ(s->status.code(), absl::StatusCode::kUnavailable);
    EXPECT_TRUE(IsRetryAfterRestart(s->status));  // the client retries on the new daemon
  }
  v1::StatusResponse status;
  jobs.Describe(true, 0, &status);
  ASSERT_EQ(status.jobs_size(), 1);
  EXPECT_EQ(status.jobs(0).job_id(), "running");
  // Registering after the drain began: refused the same way (the rank goes to
  // the restarted daemon), not a new job waiting here.
  auto late = jobs.Register(Key("late", 0, 2), Slot(), &registered, &expected);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(IsRetryAfterRestart(late.status()));
  // AbortLoads' failures are retryable too; an error of the request is not.
  EXPECT_THAT(jobs.AbortLoads("drain_timeout ran out"), ::testing::ElementsAre("running"));
  EXPECT_TRUE(IsRetryAfterRestart(running->first->AbortStatus()));
  EXPECT_FALSE(IsRetryAfterRestart(absl::UnavailableError("peer gone")));
}

TEST(JobRegistry, ARanksNewCallReplacesOneWhoseClientWentAway) {
  JobRegistry jobs(64);
  size_t registered = 0, expected = 0;
  auto first = Slot();
  std::atomic<bool> gone{false};
  first->cancelled = [&] { return gone.load(); };
  ASSERT_TRUE(jobs.Register(Key("j", 0, 2), first, &registered, &expected).ok());
  // Still connected: a second call for rank 0 is a second claimant.
  auto twice = jobs.Register(Key("j", 0, 2), Slot(), &registered, &expected);
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kAlreadyExists);
  // Its client went away (a broken connection the call has not noticed):
  // the rank's retry takes the slot, the old call ends CANCELLED.
  gone = true;
  auto retry = Slot();
  auto again = jobs.Register(Key("j", 0, 2), retry, &registered, &expected);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(registered, 1u);
  ASSERT_TRUE(Done(*first));
  {
    absl::MutexLock lock(&first->mu);
    EXPECT_EQ(first->status.code(), absl::StatusCode::kCancelled);
  }
  // A call of rank 0 leaving the barrier (its client gone) that raced the
  // replacement does not take the new slot with it.
  auto left = jobs.AwaitSlot(again->first, Slot(), 0, absl::Seconds(30), nullptr,
                             [] { return true; });
  EXPECT_EQ(left.code(), absl::StatusCode::kCancelled);
  auto last = jobs.Register(Key("j", 1, 2), Slot(), &registered, &expected);
  ASSERT_TRUE(last.ok());
  EXPECT_TRUE(last->second);  // rank 0's new call and rank 1: the job runs
}

TEST(JobRegistry, AnExceptionInTheRunnerFailsEveryRank) {
  JobRegistry jobs(64);
  size_t registered = 0, expected = 0;
  auto s0 = Slot(), s1 = Slot();
  ASSERT_TRUE(jobs.Register(Key("j", 0), s0, &registered, &expected).ok());
  auto r1 = jobs.Register(Key("j", 1), s1, &registered, &expected);
  ASSERT_TRUE(r1.ok());
  jobs.RunGuarded(*r1->first, [] { throw std::runtime_error("boom"); });
  for (const auto& s : {s0, s1}) {
    ASSERT_TRUE(Done(*s));
    absl::MutexLock lock(&s->mu);
    EXPECT_EQ(s->status.code(), absl::StatusCode::kInternal);
    EXPECT_THAT(s->status.message(), HasSubstr("job 'j': internal error (a ckptd bug): boom"));
  }
}

TEST(NewRankSlot, ChecksWhoTheRankIsAndItsTargets) {
  google::protobuf::RepeatedField<int32_t> node_ranks;
  google::protobuf::RepeatedPtrField<v1::Target> targets;
  EXPECT_THAT(NewRankSlot("Load", "", 0, 1, node_ranks, targets).status().message(),
              HasSubstr("Load: job_id is empty"));
  EXPECT_THAT(NewRankSlot("Save", "j", 2, 2, node_ranks, targets).status().message(),
              HasSubstr("job 'j' rank 2: rank is outside world_size 2"));
  node_ranks.Add(5);
  EXPECT_THAT(NewRankSlot("Load", "j", 0, 2, node_ranks, targets).status().message(),
              HasSubstr("node_ranks entry 5 is outside world_size 2"));
  node_ranks.Clear();
  v1::Target* t = targets.Add();
  t->set_name("w");
  t->set_dtype("F33");
  EXPECT_THAT(NewRankSlot("Load", "j", 0, 2, node_ranks, targets).status().message(),
              HasSubstr("job 'j' rank 0 tensor 'w'"));
  t->set_dtype("F32");
  t->add_global_shape(4);
  t->add_offset(0);
  t->add_shape(4);
  auto ok = NewRankSlot("Load", "j", 0, 2, node_ranks, targets);
  ASSERT_TRUE(ok.ok()) << ok.status();
  ASSERT_EQ((*ok)->targets.tensors.size(), 1u);
  EXPECT_EQ((*ok)->targets.tensors[0].num_bytes(), 16u);
  EXPECT_EQ((*ok)->destination, nullptr);
}

TEST(SaveBuffer, ChargesWaitForRoomAndGiveItBack) {
  SaveBuffer buffer(100);
  double waited = 0;
  auto too_big = buffer.Reserve("r", 101, absl::Now() + absl::Seconds(1), nullptr, &waited);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(too_big.status().message(), HasSubstr("101 bytes to stage exceed save_buffer (100"));
  auto a = buffer.Reserve("r0", 60, absl::Now() + absl::Seconds(1), nullptr, &waited);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(buffer.held(), 60u);
  // Full: a second charge waits until the first is given back.
  absl::Notification reserved;
  std::thread t([&] {
    double w = 0;
    auto b = buffer.Reserve("r1", 60, absl::Now() + absl::Seconds(30), nullptr, &w);
    EXPECT_TRUE(b.ok()) << b.status();
    EXPECT_GT(w, 0.05);
    reserved.Notify();
  });
  absl::SleepFor(absl::Milliseconds(150));
  EXPECT_FALSE(reserved.HasBeenNotified());
  a->reset();
  t.join();
  EXPECT_EQ(buffer.held(), 0u);  // b was destroyed in the thread
}

TEST(SaveBuffer, AFullBufferFailsAtTheDeadlineOrWhenTheDaemonStops) {
  SaveBuffer buffer(100);
  double waited = 0;
  auto a = buffer.Reserve("r0", 100, absl::Now() + absl::Seconds(1), nullptr, &waited);
  ASSERT_TRUE(a.ok());
  auto late = buffer.Reserve("r1", 1, absl::Now() + absl::Milliseconds(100), nullptr, &waited);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(late.status().message(), HasSubstr("save_buffer stayed full (100 of 100 bytes"));
  auto gone = buffer.Reserve("r1", 1, absl::Now() + absl::Seconds(30), [] { return true; }, &waited);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kCancelled);
  std::thread stopper([&] {
    absl::SleepFor(absl::Milliseconds(100));
    buffer.Stop();
  });
  auto stopped = buffer.Reserve("r1", 1, absl::Now() + absl::Seconds(30), nullptr, &waited);
  stopper.join();
  EXPECT_EQ(stopped.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(stopped.status().message(), HasSubstr("r1: the daemon is stopping"));
}

}  // namespace
}  // namespace ckptd
