// GPU test (built with --config=cuda; skips without a device): the real
// ckptd daemon and 2 and 4 real client processes (ipc_client) on one GPU.
// Each client loads its resharded bf16/f32 slices straight into its own
// device memory over cuda_ipc and checks them byte for byte against the
// shared-memory load of the same slices. Also: the daemon closes the IPC
// handles of a job when it ends and when a client dies while waiting.
//
// Run from the repository root by tests/gpu/run.sh (it sets TEST_SRCDIR to
// this binary's runfiles so the daemon and client binaries are found).
#include <signal.h>

#include <fstream>
#include <thread>


#include <gtest/gtest.h>

#include "client/ckptd_client.h"
#include "tests/gpu/gpu_testlib.h"
#include "tests/integration/daemon_process.h"
#include "tests/testing/temp_dir.h"

namespace ckpt::gputest {
namespace {

using testing::DaemonProcess;
using testing::Runfile;
using testing::Spawn;
using testing::WaitExit;

class GpuIpc : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!HaveGpu(&why)) GTEST_SKIP() << "SKIP: " << why << " [needs: gpu]";
    root_ = tmp_.Sub("root");
    ckpt_ = root_ + "/ckpt";
    ASSERT_TRUE(MakeCheckpoint(tmp_.Sub("src"), ckpt_).ok());
    daemon_ = std::make_unique<DaemonProcess>(root_);
    ASSERT_TRUE(daemon_->Ready()) << "daemon did not start; log " << daemon_->log();
  }

  std::string Gpu() {
    ckptd::Client::Options o;
    o.socket = daemon_->socket();
    auto c = ckptd::Client::Connect(o);
    if (!c.ok()) return c.status().ToString();
    auto s = (*c)->Status();
    return s.ok() ? s->gpu() : s.status().ToString();
  }

  pid_t StartClient(int world, int rank, const std::string& job) {
    return Spawn({Runfile("tests/gpu/ipc_client"), daemon_->socket(), ckpt_,
                  std::to_string(world), std::to_string(rank), job},
                 tmp_.Sub(job + "-rank" + std::to_string(rank) + ".log"));
  }

  void RunJob(int world, const std::string& job) {
    std::vector<pid_t> pids;
    for (int r = 0; r < world; ++r) pids.push_back(StartClient(world, r, job));
    for (int r = 0; r < world; ++r) {
      const int rc = WaitExit(pids[r], std::chrono::seconds(120));
      std::ifstream log(tmp_.Sub(job + "-rank" + std::to_string(r) + ".log"));
      std::string text((std::istreambuf_iterator<char>(log)), {});
      std::printf("%s", text.c_str());
      EXPECT_EQ(rc, 0) << "rank " << r << " of " << job << ":\n" << text;
    }
  }

  testing::TempDir tmp_;
  std::string root_, ckpt_;
  std::unique_ptr<DaemonProcess> daemon_;
};

TEST_F(GpuIpc, TwoClientProcessesOnOneGpuByteExact) {
  RunJob(2, "two");
  EXPECT_NE(Gpu().find("open IPC handles 0"), std::string::npos) << Gpu();
}

TEST_F(GpuIpc, FourClientProcessesThenAgainFromTheCache) {
  RunJob(4, "four");
  RunJob(4, "four-again");  // served from the (pinned) data cache
  EXPECT_NE(Gpu().find("open IPC handles 0"), std::string::npos) << Gpu();
}

TEST_F(GpuIpc, HandlesCloseWhenAClientDiesWhileWaiting) {
  // Rank 0 of a 2-rank job comes alone: its buffer is opened and waits.
  pid_t p = StartClient(2, 0, "lonely");
  std::string g;
  for (int i = 0; i < 100; ++i) {
    g = Gpu();
    if (g.find("open IPC handles 1") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_NE(g.find("open IPC handles 1"), std::string::npos) << g;
  ::kill(p, SIGKILL);
  WaitExit(p);
  for (int i = 0; i < 100; ++i) {
    g = Gpu();
    if (g.find("open IPC handles 0") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_NE(g.find("open IPC handles 0"), std::string::npos) << g;
}

}  // namespace
}  // namespace ckpt::gputest
