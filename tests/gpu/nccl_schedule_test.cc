// CPU test of the NCCL peer transport's orchestration (server/peer_nccl):
// the global transfer order, and several nodes moving reads over fake
// rendezvous links (a send blocks until the matching receive, as with NCCL)
// while each node's "executor" takes its reads in order. A failing link must
// make Take return nullopt (gRPC fallback), never hang.
#include "server/multinode/peer_nccl.h"

#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include <gtest/gtest.h>

namespace ckptd {
namespace {

// Rendezvous channels between in-process nodes.
class Fabric {
 public:
  explicit Fabric(int fail_after = -1, bool connect_barrier = false)
      : fail_after_(fail_after), connect_barrier_(connect_barrier) {}

  // As creating an NCCL communicator: every node of the job must connect
  // (with connect_barrier), else it fails after spec.connect_timeout.
  absl::Status Connect(const gpu::PeerLinkSpec& spec) {
    if (!connect_barrier_) return absl::OkStatus();
    std::unique_lock<std::mutex> l(mu_);
    ++connected_;
    cv_.notify_all();
    const auto timeout = std::chrono::milliseconds(absl::ToInt64Milliseconds(spec.connect_timeout));
    if (!cv_.wait_for(l, timeout, [&] { return connected_ >= spec.nranks || Cancelled(spec); }) ||
        connected_ < spec.nranks) {
      return absl::DeadlineExceededError("NCCL connect did not finish");
    }
    return absl::OkStatus();
  }

  absl::Status Send(int from, int to, const uint8_t* d, uint64_t n, const gpu::PeerLinkSpec& spec) {
    std::unique_lock<std::mutex> l(mu_);
    if (fail_after_ >= 0 && sends_++ >= fail_after_) return absl::UnavailableError("link broke");
    auto& q = ch_[{from, to}];
    q.push_back(std::vector<uint8_t>(d, d + n));
    const uint64_t ticket = ++posted_[{from, to}];
    cv_.notify_all();
    // Rendezvous: wait until the receiver took it.
    bool ok = cv_.wait_for(l, Timeout(spec), [&] {
      return taken_[{from, to}] >= ticket || Cancelled(spec);
    });
    if (!ok || taken_[{from, to}] < ticket) return absl::DeadlineExceededError("send timed out");
    return absl::OkStatus();
  }

  absl::Status Recv(int from, int to, uint8_t* d, uint64_t n, const gpu::PeerLinkSpec& spec) {
    std::unique_lock<std::mutex> l(mu_);
    auto& q = ch_[{from, to}];
    bool ok = cv_.wait_for(l, Timeout(spec), [&] { return !q.empty() || Cancelled(spec); });
    if (!ok || q.empty()) return absl::DeadlineExceededError("receive timed out");
    if (q.front().size() != n) return absl::DataLossError("size mismatch");
    std::memcpy(d, q.front().data(), n);
    q.pop_front();
    ++taken_[{from, to}];
    cv_.notify_all();
    return absl::OkStatus();
  }

 private:
  static std::chrono::milliseconds Timeout(const gpu::PeerLinkSpec& spec) {
    return std::chrono::milliseconds(absl::ToInt64Milliseconds(spec.timeout));
  }
  static bool Cancelled(const gpu::PeerLinkSpec& spec) { return spec.cancelled && spec.cancelled(); }

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::pair<int, int>, std::deque<std::vector<uint8_t>>> ch_;
  std::map<std::pair<int, int>, uint64_t> posted_, taken_;
  int fail_after_;
  int sends_ = 0;
  bool connect_barrier_;
  int connected_ = 0;
};

class FakeLinks final : public gpu::PeerLinks {
 public:
  FakeLinks(Fabric* f, gpu::PeerLinkSpec spec) : f_(f), spec_(std::move(spec)) {}
  absl::Status Send(int peer, const uint8_t* d, uint64_t n) override {
    return f_->Send(spec_.rank, peer, d, n, spec_);
  }
  absl::Status Recv(int peer, uint8_t* d, uint64_t n) override {
    return f_->Recv(peer, spec_.rank, d, n, spec_);
  }

 private:
  Fabric* f_;
  gpu::PeerLinkSpec spec_;
};

class FakeGpu final : public gpu::GpuRuntime {
 public:
  explicit FakeGpu(Fabric* f) : f_(f) {}
  bool compiled_with_cuda() const override { return true; }
  int device_count() const override { return 1; }
  std::string Describe() const override { return "fake"; }
  ckpt::HostAllocator* host_allocator() override { return nullptr; }
  uint64_t pinned_bytes() const override { return 0; }
  absl::StatusOr<std::shared_ptr<const gpu::DeviceBuffers>> OpenIpc(
      const std::vector<gpu::IpcBuffer>&, const std::string&) override {
    return absl::UnimplementedError("fake");
  }
  absl::StatusOr<std::unique_ptr<ckpt::Delivery>> MakeDelivery(
      std::vector<gpu::RankDestination>) override {
    return absl::UnimplementedError("fake");
  }
  absl::Status CopyToHost(const gpu::DeviceBuffers&, const std::vector<DeviceToHost>&,
                          const std::string&) override {
    return absl::UnimplementedError("fake");
  }
  bool nccl_available() const override { return true; }
  absl::StatusOr<std::string> NewNcclId() override { return std::string(128, 'x'); }
  absl::StatusOr<std::unique_ptr<gpu::PeerLinks>> ConnectPeerLinks(
      const gpu::PeerLinkSpec& spec) override {
    if (absl::Status s = f_->Connect(spec); !s.ok()) return s;
    return std::unique_ptr<gpu::PeerLinks>(new FakeLinks(f_, spec));
  }

 private:
  Fabric* f_;
};

uint8_t Byte(uint32_t g, uint64_t i) { return static_cast<uint8_t>(g * 31 + i * 7); }
uint64_t Digest(uint32_t g) { return 0x9e3779b97f4a7c15ull * (g + 1); }

TEST(NcclSchedule, GlobalOrderPerNode) {
  // read 0: node 0 -> 1, 2; read 1: node 2 -> 0; read 2: node 1 -> nobody else.
  std::vector<int> reader = {0, 2, 1};
  std::vector<std::vector<int>> needed = {{2, 1, 0}, {0}, {1}};
  std::vector<uint64_t> len = {10, 20, 30};
  auto t0 = NcclTransfers::Schedule(0, reader, needed, len);
  ASSERT_EQ(t0.size(), 3u);
  EXPECT_TRUE(t0[0].send && t0[0].read == 0 && t0[0].peer == 1);
  EXPECT_TRUE(t0[1].send && t0[1].read == 0 && t0[1].peer == 2);
  EXPECT_TRUE(!t0[2].send && t0[2].read == 1 && t0[2].peer == 2 && t0[2].length == 20);
  auto t1 = NcclTransfers::Schedule(1, reader, needed, len);
  ASSERT_EQ(t1.size(), 1u);
  EXPECT_TRUE(!t1[0].send && t1[0].read == 0 && t1[0].peer == 0);
  auto t2 = NcclTransfers::Schedule(2, reader, needed, len);
  ASSERT_EQ(t2.size(), 2u);
  EXPECT_TRUE(!t2[0].send && t2[0].read == 0);
  EXPECT_TRUE(t2[1].send && t2[1].read == 1 && t2[1].peer == 0);
}

// Runs `nodes` in-process nodes over `fabric`; returns per node the number of
// remote reads that arrived over the links (the rest fell back).
std::vector<int> RunJob(int nodes, int reads, Fabric* fabric, uint32_t seed, bool expect_all) {
  std::mt19937 rng(seed);
  std::vector<int> reader(reads);
  std::vector<std::vector<int>> needed(reads);
  std::vector<uint64_t> len(reads);
  for (int g = 0; g < reads; ++g) {
    reader[g] = rng() % nodes;
    for (int n = 0; n < nodes; ++n) {
      if (rng() % 2 || n == reader[g]) needed[g].push_back(n);
    }
    len[g] = 1 + rng() % 5000;
  }
  FakeGpu gpu(fabric);
  std::vector<int> via_links(nodes, 0);
  std::vector<std::thread> node_threads;
  std::mutex out_mu;
  for (int me = 0; me < nodes; ++me) {
    node_threads.emplace_back([&, me] {
      // This node's "executor": its reads (read here, or needed here) in order.
      std::vector<uint32_t> mine;
      for (int g = 0; g < reads; ++g) {
        bool need = std::count(needed[g].begin(), needed[g].end(), me) > 0;
        if (reader[g] == me || need) mine.push_back(g);
      }
      std::mutex mu;
      std::condition_variable cv;
      std::map<uint32_t, std::shared_ptr<std::vector<uint8_t>>> published;
      auto served = [&](uint32_t g, absl::Time deadline) -> absl::StatusOr<NcclTransfers::Bytes> {
        std::unique_lock<std::mutex> l(mu);
        cv.wait_for(l, std::chrono::milliseconds(absl::ToInt64Milliseconds(deadline - absl::Now())),
                    [&] { return published.count(g) > 0; });
        if (!published.count(g)) return absl::DeadlineExceededError("not read");
        auto b = published[g];
        return NcclTransfers::Bytes{ckpt::RangeView{b->data(), b, true}, Digest(g)};
      };
      gpu::PeerLinkSpec spec;
      spec.nccl_id = std::string(128, 'x');
      spec.nranks = nodes;
      spec.rank = me;
      spec.timeout = absl::Seconds(expect_all ? 20 : 2);
      auto t = std::make_unique<NcclTransfers>(
          &gpu, spec, NcclTransfers::Schedule(me, reader, needed, len), served, 8000);
      t->Start();
      std::atomic<size_t> next{0};
      std::atomic<int> arrived{0};
      auto worker = [&] {
        while (true) {
          size_t i = next.fetch_add(1);
          if (i >= mine.size()) return;
          const uint32_t g = mine[i];
          if (reader[g] == me) {
            auto b = std::make_shared<std::vector<uint8_t>>(len[g]);
            for (uint64_t k = 0; k < len[g]; ++k) (*b)[k] = Byte(g, k);
            std::lock_guard<std::mutex> l(mu);
            published[g] = b;
            cv.notify_all();
            continue;
          }
          ASSERT_TRUE(t->Receives(g));
          auto v = t->Take(g, absl::Now() + absl::Seconds(expect_all ? 20 : 3));
          if (!v) {
            EXPECT_FALSE(expect_all) << "node " << me << " read " << g;
            continue;  // would fall back to gRPC
          }
          for (uint64_t k = 0; k < len[g]; ++k) ASSERT_EQ(v->view.data[k], Byte(g, k));
          ASSERT_EQ(v->xxh3, Digest(g)) << "the sender's checksum travels with read " << g;
          ++arrived;
        }
      };
      std::thread w2(worker);
      worker();
      w2.join();
      absl::Status fin = t->Finish(absl::Now() + absl::Seconds(expect_all ? 20 : 3));
      if (expect_all) {
        EXPECT_TRUE(fin.ok()) << fin;
      }
      std::lock_guard<std::mutex> l(out_mu);
      via_links[me] = arrived.load();
    });
  }
  for (auto& th : node_threads) th.join();
  return via_links;
}

TEST(NcclTransfers, EveryReadArrivesInOrderWithoutDeadlock) {
  for (uint32_t seed = 1; seed <= 5; ++seed) {
    Fabric fabric;
    RunJob(3, 40, &fabric, seed, /*expect_all=*/true);
  }
  Fabric fabric4;
  RunJob(4, 60, &fabric4, 99, /*expect_all=*/true);
}

TEST(NcclTransfers, BrokenLinkFallsBackInsteadOfHanging) {
  Fabric fabric(/*fail_after=*/3);
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<int> via = RunJob(3, 30, &fabric, 5, /*expect_all=*/false);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
  // The fabric breaks after 3 sends: no more than 3 reads can have come over
  // the links; every other remote read went to the gRPC fallback.
  int arrived = 0;
  for (int n : via) arrived += n;
  EXPECT_LE(arrived, 3);
}

}  // namespace
}  // namespace ckptd

namespace ckptd {
namespace {

// A node that never opens its links (its daemon is stuck, or NCCL cannot
// reach it): the others give up after the connect timeout, not the 60 s
// transfer timeout, and every read falls back to gRPC.
TEST(NcclTransfers, NodeThatNeverConnectsFallsBackWithinConnectTimeout) {
  Fabric fabric(/*fail_after=*/-1, /*connect_barrier=*/true);
  FakeGpu gpu(&fabric);
  gpu::PeerLinkSpec spec;
  spec.nccl_id = std::string(128, 'x');
  spec.nranks = 2;
  spec.rank = 0;
  spec.timeout = absl::Seconds(60);
  spec.connect_timeout = absl::Milliseconds(500);
  // Read 0 is read by node 1 (which never connects) and needed by node 0.
  auto t = std::make_unique<NcclTransfers>(
      &gpu, spec, NcclTransfers::Schedule(0, {1}, {{0, 1}}, {100}),
      [](uint32_t, absl::Time) -> absl::StatusOr<NcclTransfers::Bytes> {
        return absl::InternalError("node 0 serves nothing");
      },
      1 << 20);
  ASSERT_TRUE(t->Receives(0));
  const auto t0 = std::chrono::steady_clock::now();
  t->Start();
  auto v = t->Take(0, absl::Now() + absl::Seconds(60));
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_FALSE(v.has_value());
  EXPECT_TRUE(t->connect_failed());
  EXPECT_GE(took, 0.4);
  EXPECT_LT(took, 5.0);  // the connect timeout, not the transfer timeout
}

}  // namespace
}  // namespace ckptd
