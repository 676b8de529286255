// The executor copying from a read of which the source holds only some spans
// back to back (RangeView::spans: a node's share of a read a peer sent it):
// the same bytes land as from the whole read, by runs into host memory or
// another process's memory (rows received back to back go as one write),
// copy by copy where a read cannot go by runs, and spans that miss bytes a
// copy takes fail the load. A real checkpoint in a temporary directory.
#include <sys/uio.h>

#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "core/exec/executor.h"
#include "core/exec/process_memory.h"
#include "core/format/checkpoint.h"
#include "core/plan/planner.h"
#include "core/write/writer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace ckpt {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int64_t kRows = 256;

std::vector<float> Values(int64_t rows, int64_t cols) {
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i) * 0.5f + 1.f;
  return v;
}

// "w" [kRows, cols] F32 saved whole by one rank into `dir`.
void Save(const std::string& dir, int64_t cols) {
  std::vector<float> v = Values(kRows, cols);
  std::vector<RankTargets> ranks{
      {0, {TargetTensor{"w", DType::kF32, {kRows, cols}, Box{{0, 0}, {kRows, cols}}, std::nullopt}}}};
  auto plan = PlanSave(ranks, 1, 1, 1 << 20);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(MakeDirs(dir).ok());
  auto shards = WriteRankFile(dir, *plan, 0, {v.data()});
  ASSERT_TRUE(shards.ok()) << shards.status();
  ASSERT_TRUE(FinishSave(dir, *plan, *shards).ok());
}

// Two ranks, each a column half of "w", in 2 reads (of 128 rows: a read
// goes by runs when it has at most one row per 256 bytes of it).
LoadPlan PlanHalves(const std::string& dir, int64_t cols) {
  auto c = OpenCheckpoint(dir);
  EXPECT_TRUE(c.ok()) << c.status();
  std::vector<RankTargets> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back({r, {TargetTensor{"w", DType::kF32, {kRows, cols},
                                      Box{{0, r * cols / 2}, {kRows, cols / 2}}, std::nullopt}}});
  }
  PlanOptions po;
  po.max_read_bytes = static_cast<uint64_t>(kRows * cols * 4 / 2);
  auto plan = PlanLoad(c->metadata, ranks, po);
  EXPECT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->reads.size(), 2u);
  return *plan;
}

// Serves each read as only the spans `spans` names for it (offsets from the
// read's first byte), packed, read from the directory.
class PackedSource final : public RangeSource {
 public:
  PackedSource(const std::string& dir, const LoadPlan& plan,
               std::vector<std::vector<ReadSpan>> spans)
      : inner_(dir) {
    for (size_t i = 0; i < plan.reads.size(); ++i) {
      by_read_[{plan.files[plan.reads[i].file], plan.reads[i].offset}] =
          std::make_shared<const std::vector<ReadSpan>>(std::move(spans[i]));
    }
  }
  absl::StatusOr<RangeView> Fetch(const std::string& file, uint64_t offset, uint64_t n,
                                  std::vector<uint8_t>& scratch,
                                  const std::function<absl::Status(const uint8_t*)>&) override {
    auto whole = inner_.Fetch(file, offset, n, scratch, nullptr);
    if (!whole.ok()) return whole.status();
    auto spans = by_read_.at({file, offset});
    auto packed = std::make_shared<std::vector<uint8_t>>();
    for (const ReadSpan& s : *spans) {
      packed->insert(packed->end(), whole->data + s.begin, whole->data + s.end);
    }
    packed->push_back(0xee);  // a byte past the spans: never copied
    ++served_;
    return RangeView{packed->data(), packed, false, spans};
  }
  int served() const { return served_; }

 private:
  DirectorySource inner_;
  std::map<std::pair<std::string, uint64_t>, std::shared_ptr<const std::vector<ReadSpan>>>
      by_read_;
  std::atomic<int> served_{0};
};

// Another process's memory, here this one's: writes what it is given and
// counts the iovecs.
class CountingMemory final : public RemoteMemory {
 public:
  absl::Status Write(const iovec* local, const iovec* remote, size_t n) override {
    for (size_t i = 0; i < n; ++i) {
      EXPECT_EQ(local[i].iov_len, remote[i].iov_len);
      std::memcpy(remote[i].iov_base, local[i].iov_base, local[i].iov_len);
    }
    iovecs += n;
    return absl::OkStatus();
  }
  std::atomic<size_t> iovecs{0};
};

std::vector<float> Expected(int64_t cols, int r) {
  std::vector<float> all = Values(kRows, cols), out;
  for (int64_t i = 0; i < kRows; ++i) {
    for (int64_t j = r * cols / 2; j < (r + 1) * cols / 2; ++j) out.push_back(all[i * cols + j]);
  }
  return out;
}

class SpanViews : public ::testing::Test {
 protected:
  std::string Dir(int64_t cols) {
    const std::string d = tmp_.path() + "/c" + std::to_string(cols);
    Save(d, cols);
    return d;
  }
  testing::TempDir tmp_;
};

TEST_F(SpanViews, RunsIntoHostMemoryFromPackedSpans) {
  // 256 columns: rows of 512 bytes per rank, few runs per read: by runs.
  const std::string dir = Dir(256);
  const LoadPlan plan = PlanHalves(dir, 256);
  for (int only = 0; only < 2; ++only) {
    // Spans of rank `only` alone (the other rank skipped), then of both.
    std::vector<float> out0(kRows * 128, -1.f), out1(kRows * 128, -1.f);
    ExecuteOptions eo;
    eo.skip_rank = [&](size_t r) { return only == 0 && r == 1; };
    PackedSource src(dir, plan, NeededSpans(plan, 1 << 20));
    auto st = ExecutePlan(plan, src, {{out0.data()}, {out1.data()}}, eo);
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(src.served(), 2);
    EXPECT_EQ(out0, Expected(256, 0));
    if (only == 1) {
      EXPECT_EQ(out1, Expected(256, 1));
    }
  }
}

TEST_F(SpanViews, RowsReceivedBackToBackGoToAnotherProcessAsOneWrite) {
  const std::string dir = Dir(256);
  const LoadPlan plan = PlanHalves(dir, 256);
  std::vector<float> out0(kRows * 128, -1.f), out1(kRows * 128, -1.f);
  // Only rank 0's spans: its rows are back to back in what was received
  // and in its tensor.
  std::vector<RankTargets> one{{0, {plan.ranks[0].targets[0]}}};
  auto c = OpenCheckpoint(dir);
  ASSERT_TRUE(c.ok());
  PlanOptions po;
  po.max_read_bytes = kRows * 256 * 4 / 4;
  auto plan0 = PlanLoad(c->metadata, one, po);
  ASSERT_TRUE(plan0.ok()) << plan0.status();
  auto memory = std::make_shared<CountingMemory>();
  std::vector<RemoteRank> remote(1);
  remote[0].memory = memory;
  remote[0].targets = {RemoteTarget{reinterpret_cast<uintptr_t>(out0.data())}};
  ProcessDelivery delivery(std::make_unique<HostDelivery>(std::vector<std::vector<void*>>{{nullptr}}),
                           remote);
  PackedSource src(dir, *plan0, NeededSpans(*plan0, 1 << 20));
  auto st = ExecutePlan(*plan0, src, delivery);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(out0, Expected(256, 0));
  // One iovec per read (two where a read ends inside a row), not one per
  // row (256).
  EXPECT_GE(memory->iovecs.load(), plan0->reads.size());
  EXPECT_LE(memory->iovecs.load(), 2 * plan0->reads.size());
}

TEST_F(SpanViews, CopyByCopyWhereRunsAreTooShort) {
  // 32 columns: rows of 64 bytes per rank, more runs than a read goes by
  // runs with (one per 256 bytes): copy by copy from the spans put in place.
  const std::string dir = Dir(32);
  const LoadPlan plan = PlanHalves(dir, 32);
  std::vector<float> out0(kRows * 16, -1.f), out1(kRows * 16, -1.f);
  PackedSource src(dir, plan, NeededSpans(plan, 1 << 20));
  auto st = ExecutePlan(plan, src, {{out0.data()}, {out1.data()}});
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(out0, Expected(32, 0));
  EXPECT_EQ(out1, Expected(32, 1));
}

TEST_F(SpanViews, SpansThatMissBytesACopyTakesFailTheLoad) {
  const std::string dir = Dir(256);
  const LoadPlan plan = PlanHalves(dir, 256);
  std::vector<std::vector<ReadSpan>> spans = NeededSpans(plan, 1 << 20);
  // Both halves of every row: one span per read. Leave 512 bytes out.
  ASSERT_EQ(spans[1].size(), 1u);
  const ReadSpan s = spans[1][0];
  ASSERT_GT(s.end - s.begin, 2048u);
  spans[1] = {ReadSpan{s.begin, s.begin + 512}, ReadSpan{s.begin + 1024, s.end}};
  std::vector<float> out0(kRows * 128), out1(kRows * 128);
  PackedSource src(dir, plan, spans);
  auto st = ExecutePlan(plan, src, {{out0.data()}, {out1.data()}});
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.status().code(), absl::StatusCode::kDataLoss) << st.status();
  EXPECT_THAT(std::string(st.status().message()),
              AllOf(HasSubstr(plan.files[plan.reads[1].file]), HasSubstr("spans received hold")));
}

}  // namespace
}  // namespace ckpt
