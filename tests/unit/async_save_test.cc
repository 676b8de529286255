// The asynchronous save path of ckptd::Daemon in one process, without gRPC
// (docs/saving.md): two rank threads hand over arenas the daemon lent (so the
// daemon copies their bytes), change them right after their call, wait with
// AwaitSave while the main thread polls Status; the persist thread writes the
// version; a save over save_buffer waits, one past it alone is refused. The
// version is read back offline and compared with what the ranks held at the
// call. tests/run.sh also runs it under ThreadSanitizer (//tests/unit:all):
// the handler, runner, persist and Status threads of a real Daemon.
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/ckptd_client.h"
#include "core/format/checkpoint.h"
#include "core/tools/layout.h"
#include "core/tools/offline.h"
#include "gtest/gtest.h"
#include "server/daemon.h"
#include "tests/testing/temp_dir.h"

namespace ckptd {
namespace {

constexpr int kRows = 4, kCols = 4096;  // F32 [4, 4096], 2 rows per rank

float Value(int row, int col) { return static_cast<float>(row * kCols + col) * 0.5f; }

Caller Me() {
  Caller c;
  c.via = Caller::Via::kUnix;
  c.uid = ::getuid();
  c.gid = ::getgid();
  c.pid = ::getpid();
  return c;
}

v1::SaveRequest Request(const std::string& job, int rank, const std::string& path, int64_t uid,
                        const ShmArena& arena) {
  v1::SaveRequest req;
  req.set_job_id(job);
  req.set_rank(rank);
  req.set_world_size(2);
  req.set_path(path);
  req.set_unique_id(uid);
  req.set_async_save(true);
  req.set_barrier_timeout_ms(30000);
  v1::Target* t = req.add_targets();
  t->set_name("w");
  t->set_dtype("F32");
  t->add_global_shape(kRows);
  t->add_global_shape(kCols);
  t->add_offset(rank * 2);
  t->add_offset(0);
  t->add_shape(2);
  t->add_shape(kCols);
  t->set_dest_offset(0);
  req.mutable_shm()->set_arena_token(arena.daemon_token());
  req.mutable_shm()->set_size(arena.size());
  return req;
}

class AsyncSaveTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // The socket path must stay short (Unix socket paths < 108 bytes).
    char tmpl[] = "/tmp/ckptd-async-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    sockdir_ = tmpl;
    root_ = tmp_.Sub("root");
    ASSERT_EQ(::mkdir(root_.c_str(), 0755), 0);
    config_.socket = sockdir_ + "/d.sock";
    config_.roots = {root_};
    config_.save_buffer = 3 * 2 * kCols * 4;  // three ranks' bytes
    config_.testing_delay_persist = absl::Milliseconds(50);
  }
  void TearDown() override {
    ::unlink((config_.socket + ".fd").c_str());
    ::rmdir(sockdir_.c_str());
  }
  ckpt::testing::TempDir tmp_;
  std::string sockdir_, root_;
  DaemonConfig config_;
};

TEST_F(AsyncSaveTest, RanksChangeTheirBytesWhileTheDaemonPersists) {
  Daemon d(config_);
  ASSERT_TRUE(d.Start().ok());
  const std::string path = root_ + "/ck";
  std::vector<absl::StatusOr<v1::SaveResponse>> staged(2, absl::UnknownError("")),
      final(2, absl::UnknownError(""));
  std::atomic<int> done{0};
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      auto arena = ShmArena::FromDaemon(config_.socket, 2 * kCols * 4);
      if (!arena.ok()) {
        staged[r] = arena.status();
        ++done;
        return;
      }
      auto* f = reinterpret_cast<float*>((*arena)->data());
      for (int i = 0; i < 2; ++i) {
        for (int c = 0; c < kCols; ++c) f[i * kCols + c] = Value(r * 2 + i, c);
      }
      staged[r] = d.Save(Me(), Request("j1", r, path, 0, **arena), [] { return false; });
      std::memset((*arena)->data(), 0xFF, 2 * kCols * 4);  // training goes on
      v1::AwaitSaveRequest await;
      await.set_job_id("j1");
      await.set_rank(r);
      await.set_timeout_ms(30000);
      final[r] = d.AwaitSave(Me(), await, nullptr);
      ++done;
    });
  }
  int polls = 0;
  while (done < 2) {  // Status while the ranks save and wait
    v1::StatusResponse st = d.Status(Me());
    EXPECT_LE(st.save_staged_bytes(), config_.save_buffer);
    ++polls;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (auto& t : ranks) t.join();
  EXPECT_GT(polls, 0);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(staged[r].ok()) << staged[r].status();
    EXPECT_FALSE(staged[r]->persisted());
    EXPECT_EQ(staged[r]->bytes_staged(), 2u * 2 * kCols * 4);
    ASSERT_TRUE(final[r].ok()) << final[r].status();
    EXPECT_TRUE(final[r]->persisted());
    EXPECT_EQ(final[r]->bytes_written(), 1u * kRows * kCols * 4);
  }
  v1::StatusResponse st = d.Status(Me());
  ASSERT_EQ(st.saves_size(), 1);
  EXPECT_EQ(st.saves(0).state(), "durable");
  EXPECT_EQ(st.save_staged_bytes(), 0u);
  EXPECT_EQ(st.saves_durable(), 1u);

  // A rank whose bytes alone exceed save_buffer is refused at once.
  auto big = ShmArena::FromDaemon(config_.socket, 4 << 20);
  ASSERT_TRUE(big.ok()) << big.status();
  v1::SaveRequest req = Request("j2", 0, path, 1, **big);
  req.set_world_size(1);
  req.mutable_targets(0)->set_offset(0, 0);
  req.mutable_targets(0)->clear_global_shape();
  req.mutable_targets(0)->add_global_shape(256);
  req.mutable_targets(0)->add_global_shape(kCols);
  req.mutable_targets(0)->set_shape(0, 256);
  auto refused = d.Save(Me(), req, [] { return false; });
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("save_buffer"), std::string::npos);
  d.Stop();

  // The version holds what the ranks had at their calls (read without the daemon).
  ckpt::Layout whole;
  whole.world_size = 1;
  ckpt::TargetTensor t;
  t.name = "w";
  t.dtype = ckpt::DType::kF32;
  t.global_shape = {kRows, kCols};
  t.box.offset = {0, 0};
  t.box.shape = {kRows, kCols};
  whole.ranks = {{0, {t}}};
  auto back = ckpt::LoadOffline(path, whole, {});
  ASSERT_TRUE(back.ok()) << back.status();
  const auto& bytes = back->buffers[0].tensors[0];
  ASSERT_EQ(bytes.size(), 1u * kRows * kCols * 4);
  const auto* f = reinterpret_cast<const float*>(bytes.data());
  int wrong = 0;
  for (int row = 0; row < kRows; ++row) {
    for (int c = 0; c < kCols; ++c) wrong += f[row * kCols + c] != Value(row, c);
  }
  EXPECT_EQ(wrong, 0);
}

}  // namespace
}  // namespace ckptd
