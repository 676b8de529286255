// Multi-node jobs: 3-4 real daemons on loopback (own sockets, own peer
// ports, own "local disks"), 8-12 ranks spread over them as separate
// ckptctl processes.
#include <algorithm>
#include <csignal>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <set>
#include <thread>
#include <tuple>

#include "client/ckptd_client.h"
#include "core/tools/offline.h"
#include "core/format/safetensors.h"
#include "core/write/writer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/certs.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/fixtures.h"
#include "tests/integration/ports.h"
#include "tests/testing/temp_dir.h"

namespace ckpt {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
namespace fs = std::filesystem;
using testing::Await;
using testing::DaemonProcess;
using testing::Runfile;
using testing::Spawn;
using testing::WaitExit;

using testing::FreePort;

// Every case runs twice: plaintext on loopback, and with mutual TLS
// (certificates made at test time, tests/integration/certs.h).
// The job key every rank process (ckptctl) and this test's own clients
// send (CKPTD_JOB_KEY, read by the C++ client): a job spanning several
// daemons needs one.
constexpr char kJobKey[] = "multinode-test-job-key-1234567890";

class MultiNode : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    ::setenv("CKPTD_JOB_KEY", kJobKey, 1);
    if (GetParam()) {
      const std::string certs = tmp_.Sub("certs");
      ASSERT_TRUE(MakeDirs(certs).ok());
      ASSERT_TRUE(testing::MakeCa(certs, "ca")) << Slurp(certs + "/openssl.log");
      tls_ = testing::MakeLeaf(certs, "ca", "node", "IP:127.0.0.1");
      ASSERT_FALSE(tls_.cert.empty()) << Slurp(certs + "/openssl.log");
    }
    ASSERT_TRUE(WriteModel(tmp_.Sub("src"), 11).ok());
    full_ = ModelData(11);
  }

  // Saves the model over `world` ranks into full/, then gives node n a
  // "local disk" node<n>/ckpt with the metadata and only the data files of
  // ranks 2n and 2n+1. Returns the nodes' roots.
  std::vector<std::string> NodeLocalCheckpoint(int nodes, int world, bool flatten) {
    EXPECT_TRUE(ShardCheckpoint(tmp_.Sub("src"), MakeLayout(world, 0, flatten), tmp_.Sub("full"), {}).ok());
    std::vector<std::string> roots;
    for (int n = 0; n < nodes; ++n) {
      std::string dir = tmp_.Sub("node" + std::to_string(n) + "/ckpt");
      EXPECT_TRUE(MakeDirs(dir).ok());
      fs::copy_file(tmp_.Sub("full/0.metadata"), dir + "/0.metadata");
      for (int r = 2 * n; r < 2 * n + 2; ++r) {
        const std::string f = std::to_string(r) + "_0.safetensors";
        fs::copy_file(tmp_.Sub("full/" + f), dir + "/" + f);
      }
      roots.push_back(tmp_.Sub("node" + std::to_string(n)));
    }
    return roots;
  }

  // Starts `n` daemons; `roots[i]` is node i's root. Every node's peers
  // list names every node, so all addresses are chosen before the first
  // starts. Plaintext: Unix sockets (unix:/tmp/..., nothing to race for).
  // Mutual TLS identifies nodes by the IP their certificate names, so those
  // runs need TCP: free ports, and if one was taken meanwhile (a node says
  // "cannot listen for peers"), every node again on new ports.
  void StartNodes(const std::vector<std::string>& roots, std::vector<std::string> extra = {}) {
    for (int attempt = 0;; ++attempt) {
      nodes_.clear();
      addrs_.clear();
      for (size_t i = 0; i < roots.size(); ++i) {
        addrs_.push_back(GetParam() ? "127.0.0.1:" + std::to_string(FreePort())
                                    : "unix:" + SocketDir() + "/node" + std::to_string(i) + ".peer");
      }
      std::string peers;
      for (const std::string& a : addrs_) peers += (peers.empty() ? "" : ",") + a;
      bool port_taken = false;
      for (size_t i = 0; i < roots.size() && !port_taken; ++i) {
        port_taken = !StartNode(i, roots[i], peers, extra, /*may_retry=*/GetParam() && attempt < 3);
      }
      if (!port_taken) return;
    }
  }
  // A fresh /tmp directory for the peer sockets (a Unix socket path must
  // stay under 108 bytes: not under TEST_TMPDIR).
  const std::string& SocketDir() {
    if (socket_dir_.empty()) {
      char tmpl[] = "/tmp/ckptd-mn-XXXXXX";
      socket_dir_ = ::mkdtemp(tmpl);
    }
    return socket_dir_;
  }
  void TearDown() override {
    nodes_.clear();
    if (!socket_dir_.empty()) fs::remove_all(socket_dir_);
  }
  std::string AllAddrs() const {
    std::string peers;
    for (const std::string& a : addrs_) peers += (peers.empty() ? "" : ",") + a;
    return peers;
  }
  // False only when `may_retry` and the node could not listen on its port
  // (taken since FreePort chose it): the caller starts over.
  bool StartNode(size_t i, const std::string& root, const std::string& peers,
                 std::vector<std::string> extra, bool may_retry = false) {
    std::vector<std::string> args = {"--peer-listen", addrs_[i],
                                     "--peers", peers, "--peer-timeout", "4s",
                                     "--io-request-size", "64KiB"};
    if (GetParam()) {
      args.insert(args.end(), {"--peer-tls-cert", tls_.cert, "--peer-tls-key", tls_.key,
                               "--peer-tls-ca", tls_.ca});
    }
    args.insert(args.end(), extra.begin(), extra.end());
    if (nodes_.size() <= i) nodes_.resize(i + 1);
    nodes_[i] = std::make_unique<DaemonProcess>(root, args);
    if (may_retry && !nodes_[i]->Ready() &&
        Slurp(nodes_[i]->log()).find("cannot listen for peers on") != std::string::npos) {
      nodes_[i]->Stop();  // exited already: nothing to wait for
      return false;
    }
    EXPECT_TRUE(nodes_[i]->Ready()) << Slurp(nodes_[i]->log());
    return true;
  }

  std::string Sockets() const {
    std::string s;
    for (const auto& n : nodes_) s += (s.empty() ? "" : ",") + n->socket();
    return s;
  }

  // Starts one ckptctl process per rank of `job`, all through their node's
  // daemon, with `extra` arguments (their output in <job>.log): their pids.
  std::vector<pid_t> SpawnJob(const std::string& path, const std::string& layout_file, int world,
                              const std::string& job, const std::string& out,
                              const std::vector<std::string>& extra = {}) {
    std::vector<pid_t> pids;
    for (int r = 0; r < world; ++r) {
      std::vector<std::string> argv = {Runfile("client/ckptctl"), "load", path, "--layout",
                                       layout_file, "--out", out, "--daemon", Sockets(),
                                       "--ranks", std::to_string(r), "--job-id", job};
      argv.insert(argv.end(), extra.begin(), extra.end());
      pids.push_back(Spawn(argv, tmp_.Sub(job + ".log")));
    }
    return pids;
  }

  // SpawnJob, then every rank's exit code. Poisoned buffers: an element never
  // written shows.
  std::vector<int> RunJob(const std::string& path, const std::string& layout_file, int world,
                          const std::string& job, const std::string& out) {
    const std::vector<pid_t> pids =
        SpawnJob(path, layout_file, world, job, out, {"--json", "--fill_byte=165"});
    std::vector<int> codes;
    for (pid_t p : pids) codes.push_back(WaitExit(p));
    return codes;
  }

  std::string WriteLayout(const Layout& l, const std::string& name) {
    std::string f = tmp_.Sub(name);
    std::ofstream(f) << LayoutToJson(l);
    return f;
  }

  // The bytes the ranks of node `node` (ranks node * per_node ...) copy
  // from data files the node does not hold (NodeLocalCheckpoint: ranks 2n,
  // 2n+1's files): for each distinct target box of its ranks, the elements
  // of every replica-0 shard in another node's file that the box holds.
  static uint64_t NeededFromPeers(const CheckpointMetadata& m, const Layout& load, int node,
                                  int per_node) {
    std::set<std::string> local;
    for (int r = 2 * node; r < 2 * node + 2; ++r) local.insert(std::to_string(r) + "_0.safetensors");
    std::set<std::tuple<std::string, Shape, Shape>> seen;  // (tensor, box) once per node
    uint64_t bytes = 0;
    for (int r = node * per_node; r < (node + 1) * per_node; ++r) {
      for (const TargetTensor& t : load.ranks[r].tensors) {
        if (!seen.insert({t.name, t.box.offset, t.box.shape}).second) continue;
        for (const ShardMeta& s : m.tensors.at(t.name).shards) {
          if (s.replica_id != 0 || local.count(s.file)) continue;
          auto region = Intersect(s.box, t.box);
          if (!region) continue;
          bytes += static_cast<uint64_t>(CountRegion(s.layout(), t.layout(), *region)) *
                   DTypeSize(s.dtype);
        }
      }
    }
    return bytes;
  }

  // The `what=<N>B` figure of node `node`'s log line for job `job`.
  uint64_t LoggedBytes(size_t node, const std::string& job, const std::string& what) {
    const std::string log = Slurp(nodes_[node]->log());
    const std::string line_start = "load job=" + job + " ";
    const size_t at = log.find(line_start);
    if (at == std::string::npos) {
      ADD_FAILURE() << "no '" << line_start << "' line in node " << node << "'s log";
      return 0;
    }
    const size_t eol = log.find('\n', at);
    const std::string line = log.substr(at, eol - at);
    const size_t k = line.find(" " + what + "=");
    if (k == std::string::npos) {
      ADD_FAILURE() << "no " << what << " in " << line;
      return 0;
    }
    return std::stoull(line.substr(k + what.size() + 2));
  }

  uint64_t BytesRead(size_t node) {
    ckptd::Client::Options o;
    o.socket = nodes_[node]->socket();
    auto c = ckptd::Client::Connect(o);
    EXPECT_TRUE(c.ok());
    return (*c)->Status()->bytes_read_total();
  }

  // Rank r of `layout` saves its shards (the oracle's bytes) through node
  // r / per_node, with that node's ranks as node_ranks, one thread per rank;
  // uid -1: the daemons pick the version.
  std::vector<absl::StatusOr<ckptd::v1::SaveResponse>> SaveJob(const Layout& layout, int per_node,
                                                               const std::string& path,
                                                               const std::string& job, int64_t uid) {
    const int world = layout.world_size;
    std::vector<absl::StatusOr<ckptd::v1::SaveResponse>> out(world, absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        const int node = r / per_node;
        ckptd::Client::Options o;
        o.socket = nodes_[node]->socket();
        auto c = ckptd::Client::Connect(o);
        if (!c.ok()) {
          out[r] = c.status();
          return;
        }
        std::vector<std::vector<uint8_t>> bytes;
        ckptd::SaveSpec spec;
        spec.job_id = job;
        spec.rank = r;
        spec.world_size = world;
        spec.path = path;
        spec.unique_id = std::max<int64_t>(uid, 0);
        spec.next_unique_id = uid < 0;
        spec.barrier_timeout = absl::Seconds(20);
        for (int k = node * per_node; k < std::min(world, (node + 1) * per_node); ++k) {
          spec.node_ranks.push_back(k);
        }
        for (const TargetTensor& t : layout.ranks[r].tensors) bytes.push_back(OracleBytes(t, full_));
        for (size_t i = 0; i < layout.ranks[r].tensors.size(); ++i) {
          const TargetTensor& t = layout.ranks[r].tensors[i];
          ckptd::TensorSpec ts;
          ts.name = t.name;
          ts.dtype = t.dtype;
          ts.global_shape = t.global_shape;
          ts.box = t.box;
          ts.flat_range = t.flat_range;
          ts.buffer = bytes[i].data();
          spec.tensors.push_back(ts);
        }
        out[r] = (*c)->Save(spec);
      });
    }
    for (auto& t : threads) t.join();
    return out;
  }

  testing::TempDir tmp_;
  testing::CertFiles tls_;
  FullModel full_;  // the model's full tensors: the oracle
  std::vector<std::string> addrs_;  // node i's peer address
  std::string socket_dir_;
  std::vector<std::unique_ptr<DaemonProcess>> nodes_;
};

// (a) Node-local disks: each node holds only its own ranks' data files.
TEST_P(MultiNode, NodeLocalFilesReshardedByteExactReadOnce) {
  const int kNodes = 4, kWorld = 8;
  const std::vector<std::string> roots = NodeLocalCheckpoint(kNodes, kWorld, true);
  StartNodes(roots);
  Layout load = MakeLayout(kWorld, 1, false);
  std::string lf = WriteLayout(load, "load8.json");
  // "ckpt" is relative: each daemon resolves it under its own root.
  EXPECT_THAT(RunJob("ckpt", lf, kWorld, "local", tmp_.Sub("out-local")), ::testing::Each(0))
      << Slurp(tmp_.Sub("local.log")) << Slurp(nodes_[0]->log());
  ASSERT_TRUE(LayoutMatchesOracle(tmp_.Sub("out-local"), load, full_));
  // Every needed byte read from storage once in the whole job.
  auto ck = OpenCheckpoint(tmp_.Sub("full"));
  ASSERT_TRUE(ck.ok());
  uint64_t unique = 0;
  for (const auto& [n, t] : ck->metadata.tensors) {
    for (const auto& s : t.shards) unique += s.nbytes;
  }
  uint64_t total = 0;
  for (int n = 0; n < kNodes; ++n) total += BytesRead(n);
  EXPECT_EQ(total, unique);
  EXPECT_THAT(Slurp(nodes_[0]->log()), HasSubstr("coordinator job=local nodes=4 ranks=8"));
  // Between the daemons only the bytes each node's ranks copy (issue 34):
  // every node's ranks need a quarter of every row, three quarters of the
  // rows live on other nodes; shipping whole reads moved 4x this.
  uint64_t needed = 0, moved = 0;
  for (int n = 0; n < kNodes; ++n) {
    needed += NeededFromPeers(ck->metadata, load, n, 2);
    moved += LoggedBytes(n, "local", "from_peers");
    // A first load: nothing from the data cache (a read fetched by spans
    // is not a cache hit either).
    EXPECT_EQ(LoggedBytes(n, "local", "cache"), 0u) << "node " << n;
  }
  std::cout << "bytes between daemons " << moved << ", needed " << needed << " ("
            << static_cast<double>(moved) / static_cast<double>(std::max<uint64_t>(needed, 1))
            << "x)\n";
  EXPECT_GT(needed, 0u);
  EXPECT_GE(moved, needed);
  EXPECT_LE(static_cast<double>(moved), 1.05 * static_cast<double>(needed))
      << "moved " << moved << " needed " << needed;
  EXPECT_THAT(Slurp(nodes_[0]->log()), HasSubstr("from 3 peers in 3 FetchReads streams"));
  // One stream per peer here; with a stream per 4 KiB (a test knob; 64 MiB
  // otherwise) and 4 I/O threads, each peer's reads spread over up to 4
  // streams driven at once: still byte-exact.
  StartNodes(roots, {"--testing_peer_lane_bytes", "4096", "--io_threads", "4"});
  EXPECT_THAT(Slurp(nodes_[0]->log()), ::testing::Not(HasSubstr("FetchReads streams")));
  EXPECT_THAT(RunJob("ckpt", lf, kWorld, "lanes", tmp_.Sub("out-lanes")), ::testing::Each(0))
      << Slurp(tmp_.Sub("lanes.log")) << Slurp(nodes_[0]->log());
  ASSERT_TRUE(LayoutMatchesOracle(tmp_.Sub("out-lanes"), load, full_));
  for (int n = 0; n < kNodes; ++n) {
    EXPECT_THAT(Slurp(nodes_[n]->log()),
                ::testing::ContainsRegex("from 3 peers in ([4-9]|1[0-2]) FetchReads streams"))
        << "node " << n;
  }
}

// A job spanning several daemons whose ranks sent no job key is refused
// before any daemon contacts another, naming what to set; a daemon set to
// allow unkeyed jobs runs it.
TEST_P(MultiNode, AJobWithoutAKeyIsRefusedUnlessUnkeyedJobsAreAllowed) {
  ::unsetenv("CKPTD_JOB_KEY");
  const std::vector<std::string> roots = NodeLocalCheckpoint(2, 4, false);
  StartNodes(roots);
  const Layout load = MakeLayout(4, 1, false);
  const std::string lf = WriteLayout(load, "load4.json");
  EXPECT_THAT(RunJob("ckpt", lf, 4, "unkeyed", tmp_.Sub("out-unkeyed")),
              ::testing::Each(::testing::Ne(0)));
  const std::string log = Slurp(tmp_.Sub("unkeyed.log"));
  EXPECT_THAT(log, HasSubstr("but its ranks sent no job_key"));
  EXPECT_THAT(log, HasSubstr("CKPTD_JOB_KEY"));
  EXPECT_THAT(Slurp(nodes_[0]->log()), Not(HasSubstr("coordinator job=unkeyed")));
  StartNodes(roots, {"--peer_unkeyed_jobs"});
  EXPECT_THAT(RunJob("ckpt", lf, 4, "allowed", tmp_.Sub("out-allowed")), ::testing::Each(0))
      << Slurp(tmp_.Sub("allowed.log"));
  ASSERT_TRUE(LayoutMatchesOracle(tmp_.Sub("out-allowed"), load, full_));
}

// (b) Shared storage: every node sees every file; reading is split by bytes.
TEST_P(MultiNode, SharedDirectoryReadingSplitEvenly) {
  const int kNodes = 3, kWorld = 12;
  ASSERT_TRUE(ShardCheckpoint(tmp_.Sub("src"), MakeLayout(4, 0, false), tmp_.Sub("shared/ckpt"), {}).ok());
  // Every node may read the reads all nodes need (the checkpoint is small:
  // by default one node would read them all, below).
  StartNodes({tmp_.Sub("shared"), tmp_.Sub("shared"), tmp_.Sub("shared")},
             {"--peer_reader_min_bytes", "0"});
  Layout load = MakeLayout(kWorld, 1, false);  // every node needs a slice of every read
  std::string lf = WriteLayout(load, "load12.json");
  EXPECT_THAT(RunJob(tmp_.Sub("shared/ckpt"), lf, kWorld, "shared", tmp_.Sub("out-shared")),
              ::testing::Each(0))
      << Slurp(tmp_.Sub("shared.log"));
  ASSERT_TRUE(LayoutMatchesOracle(tmp_.Sub("out-shared"), load, full_));
  std::vector<uint64_t> per_node;
  uint64_t total = 0;
  for (int n = 0; n < kNodes; ++n) {
    per_node.push_back(BytesRead(n));
    total += per_node.back();
  }
  auto ck = OpenCheckpoint(tmp_.Sub("shared/ckpt"));
  uint64_t unique = 0;
  for (const auto& [n, t] : ck->metadata.tensors) {
    for (const auto& s : t.shards) unique += s.nbytes;
  }
  EXPECT_EQ(total, unique);
  const double even = static_cast<double>(total) / kNodes;
  for (int n = 0; n < kNodes; ++n) {
    EXPECT_NEAR(per_node[n], even, 0.10 * even) << "node " << n;
  }

  // The default (peer_reader_min_bytes 64 MiB): a checkpoint this small has
  // one reader for the reads every node needs (the first of the job's nodes
  // in address order), which the others fetch from it.
  StartNodes({tmp_.Sub("shared"), tmp_.Sub("shared"), tmp_.Sub("shared")});
  EXPECT_THAT(RunJob(tmp_.Sub("shared/ckpt"), lf, kWorld, "shared-few", tmp_.Sub("out-few")),
              ::testing::Each(0))
      << Slurp(tmp_.Sub("shared-few.log"));
  ASSERT_TRUE(LayoutMatchesOracle(tmp_.Sub("out-few"), load, full_));
  std::vector<uint64_t> few;
  for (int n = 0; n < kNodes; ++n) few.push_back(BytesRead(n));
  std::sort(few.begin(), few.end());
  EXPECT_THAT(few, ::testing::ElementsAre(0u, 0u, unique));
  EXPECT_THAT(Slurp(nodes_[0]->log()), ::testing::HasSubstr("shared readers=1"));
}

// (c) A peer killed mid-load: every rank gets a clear error within the
// deadline; a retry with the peer back succeeds.
TEST_P(MultiNode, PeerKilledMidLoadThenRetrySucceeds) {
  const int kNodes = 3, kWorld = 6;
  const std::vector<std::string> roots = NodeLocalCheckpoint(kNodes, kWorld, false);
  // Every node pauses 1.5 s between receiving its plan part and executing
  // it: node 2 is killed inside that window, after the plan went out.
  StartNodes(roots, {"--testing-delay-part-ms", "1500"});
  Layout load = MakeLayout(kWorld, 1, false);
  std::string lf = WriteLayout(load, "load6.json");
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<pid_t> pids = SpawnJob("ckpt", lf, kWorld, "killed", tmp_.Sub("out-killed"));
  // Wait for the coordinator to log the plan (it plans once every node has
  // joined, and each node's Join is answered with its part as soon as the
  // plan is made), then kill node 2.
  ASSERT_TRUE(Await(
      [&] { return Slurp(nodes_[0]->log()).find("coordinator job=killed") != std::string::npos; },
      "the coordinator (node 0) to log the plan of job 'killed'"))
      << Slurp(tmp_.Sub("killed.log")) << Slurp(nodes_[0]->log());
  // Node 2 logs when its Join reply (its part of the plan) has arrived;
  // it is killed only then, inside its 1.5 s pause before executing it.
  ASSERT_TRUE(Await(
      [&] {
        return Slurp(nodes_[2]->log()).find("multi-node job=killed: plan part received") !=
               std::string::npos;
      },
      "node 2 to log that it received its part of job 'killed'"))
      << Slurp(nodes_[2]->log());
  const std::string peers = AllAddrs();
  nodes_[2]->Kill();  // SIGKILL: no draining
  std::vector<int> codes;
  for (pid_t p : pids) codes.push_back(WaitExit(p, std::chrono::seconds(30)));
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_THAT(codes, ::testing::Each(::testing::Ne(0)));
  EXPECT_LT(took, 15.0);  // peer_timeout 4s, plus slack
  const std::string log = Slurp(tmp_.Sub("killed.log"));
  EXPECT_THAT(log, HasSubstr(addrs_[2]));  // names the dead peer
  EXPECT_FALSE(fs::exists(tmp_.Sub("out-killed/rank0.safetensors")));
  // Bring node 2 back and retry.
  StartNode(2, roots[2], peers, {});
  EXPECT_THAT(RunJob("ckpt", lf, kWorld, "retry", tmp_.Sub("out-retry")), ::testing::Each(0))
      << Slurp(tmp_.Sub("retry.log"));
  ASSERT_TRUE(LayoutMatchesOracle(tmp_.Sub("out-retry"), load, full_));
}

// A peer that stops answering once the plan is out (SIGSTOP: its
// connections stay open, nothing moves): every rank of the other nodes fails
// within peer_timeout and some slack, naming it (the FetchReads stream from it
// waits at most peer_timeout for each chunk); once it runs again its own
// ranks fail too, and the nodes serve the next job.
TEST_P(MultiNode, PeerStoppedMidLoadFailsTheOthersWithinPeerTimeout) {
  const int kNodes = 3, kWorld = 6;
  const std::vector<std::string> roots = NodeLocalCheckpoint(kNodes, kWorld, false);
  StartNodes(roots, {"--testing-delay-part-ms", "1500"});
  Layout load = MakeLayout(kWorld, 1, false);
  std::string lf = WriteLayout(load, "load6.json");
  const std::vector<pid_t> pids = SpawnJob("ckpt", lf, kWorld, "stopped", tmp_.Sub("out-stopped"));
  ASSERT_TRUE(Await(
      [&] {
        return Slurp(nodes_[2]->log()).find("multi-node job=stopped: plan part received") !=
               std::string::npos;
      },
      "node 2 to log that it received its part of job 'stopped'"))
      << Slurp(nodes_[2]->log());
  ASSERT_EQ(::kill(nodes_[2]->pid(), SIGSTOP), 0);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<int> codes;
  for (int r = 0; r < 4; ++r) codes.push_back(WaitExit(pids[r], std::chrono::seconds(30)));
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_EQ(::kill(nodes_[2]->pid(), SIGCONT), 0);
  EXPECT_THAT(codes, ::testing::Each(::testing::Ne(0)));
  EXPECT_LT(took, 15.0);  // peer_timeout 4s, plus slack
  EXPECT_THAT(Slurp(tmp_.Sub("stopped.log")), HasSubstr(addrs_[2]));  // names the stopped peer
  for (int r = 4; r < kWorld; ++r) EXPECT_NE(WaitExit(pids[r], std::chrono::seconds(30)), 0);
  EXPECT_FALSE(fs::exists(tmp_.Sub("out-stopped/rank0.safetensors")));
  EXPECT_THAT(RunJob("ckpt", lf, kWorld, "after", tmp_.Sub("out-after")), ::testing::Each(0))
      << Slurp(tmp_.Sub("after.log"));
  ASSERT_TRUE(LayoutMatchesOracle(tmp_.Sub("out-after"), load, full_));
}

// (e) A save across 3 daemons into node-local directories: every node
// writes only its own ranks' files, each node commits the version's
// metadata once all of them prepared, and the version loads back
// resharded by another number of ranks, byte-exact.
TEST_P(MultiNode, SaveAcrossNodesNodeLocalThenLoadResharded) {
  const int kNodes = 3, kWorld = 6;
  std::vector<std::string> roots;
  for (int n = 0; n < kNodes; ++n) {
    roots.push_back(tmp_.Sub("snode" + std::to_string(n)));
    ASSERT_TRUE(MakeDirs(roots.back()).ok());
  }
  StartNodes(roots);
  const Layout save = MakeLayout(kWorld, 0, true);
  auto saved = SaveJob(save, 2, "saved", "msave", 7);
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(saved[r].ok()) << "rank " << r << ": " << saved[r].status() << Slurp(nodes_[0]->log());
    EXPECT_TRUE(saved[r]->persisted());
    EXPECT_EQ(saved[r]->metadata_file(), "7.metadata");
  }
  EXPECT_THAT(Slurp(nodes_[0]->log()), HasSubstr("coordinator save job=msave nodes=3 ranks=6"));
  uint64_t written = 0;
  for (int n = 0; n < kNodes; ++n) {
    const std::string dir = roots[n] + "/saved";
    EXPECT_TRUE(fs::exists(dir + "/7.metadata")) << "node " << n;
    for (const auto& e : fs::directory_iterator(dir)) {
      const std::string f = e.path().filename().string();
      if (f == "7.metadata" || f == ".ckptd.lock") continue;
      // Only this node's ranks' data files (ranks 2n, 2n+1), no leftovers.
      EXPECT_TRUE(f == std::to_string(2 * n) + "_7.safetensors" ||
                  f == std::to_string(2 * n + 1) + "_7.safetensors")
          << "node " << n << " holds " << f;
      written += fs::file_size(e.path());
    }
    EXPECT_EQ(Slurp(dir + "/7.metadata"), Slurp(roots[0] + "/saved/7.metadata")) << "node " << n;
  }
  EXPECT_GT(written, 0u);
  // Loaded back by 3 ranks (one per daemon: every node's files are needed)
  // split on another dim.
  Layout load = MakeLayout(3, 1, false);
  std::string lf = WriteLayout(load, "sload3.json");
  EXPECT_THAT(RunJob("saved", lf, 3, "msave-load", tmp_.Sub("out-msave")), ::testing::Each(0))
      << Slurp(tmp_.Sub("msave-load.log")) << Slurp(nodes_[0]->log());
  ASSERT_TRUE(LayoutMatchesOracle(tmp_.Sub("out-msave"), load, full_));
  // The same version again: refused on every node (it exists), nothing changed.
  auto again = SaveJob(save, 2, "saved", "msave-again", 7);
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_FALSE(again[r].ok()) << "rank " << r;
    EXPECT_THAT(std::string(again[r].status().message()), HasSubstr("already exists")) << "rank " << r;
  }
  // The daemons pick the version: node 1's copy of the directory is ahead
  // (version 9 there only), so the coordinator (node 0, at 7) takes node
  // 1's proposal, 10, and every rank and every node gets the same one.
  { std::ofstream(roots[1] + "/saved/9.metadata") << "{}"; }
  auto picked = SaveJob(save, 2, "saved", "msave-picked", -1);
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(picked[r].ok()) << "rank " << r << ": " << picked[r].status() << Slurp(nodes_[0]->log());
    EXPECT_EQ(picked[r]->unique_id(), 10) << "rank " << r;
    EXPECT_EQ(picked[r]->metadata_file(), "10.metadata") << "rank " << r;
  }
  for (int n = 0; n < kNodes; ++n) {
    EXPECT_EQ(Slurp(roots[n] + "/saved/10.metadata"), Slurp(roots[0] + "/saved/10.metadata"))
        << "node " << n;
    EXPECT_TRUE(fs::exists(roots[n] + "/saved/" + std::to_string(2 * n) + "_10.safetensors"));
  }
}

// (f) A node killed in the middle of a save: every rank of the surviving
// nodes gets an error naming it, no node shows the version, and the
// version saved before still loads.
TEST_P(MultiNode, SaveNodeKilledMidSaveNoVersionAppears) {
  const int kNodes = 3, kWorld = 6;
  std::vector<std::string> roots;
  for (int n = 0; n < kNodes; ++n) {
    roots.push_back(tmp_.Sub("knode" + std::to_string(n)));
    ASSERT_TRUE(MakeDirs(roots.back()).ok());
  }
  StartNodes(roots);
  const Layout save = MakeLayout(kWorld, 0, false);
  auto first = SaveJob(save, 2, "ck", "ksave1", 1);
  for (int r = 0; r < kWorld; ++r) ASSERT_TRUE(first[r].ok()) << first[r].status();
  // Every node pauses 1.5 s between its plan part and writing: node 2 is
  // killed inside that window.
  const std::string peers = AllAddrs();
  for (int n = 0; n < kNodes; ++n) {
    nodes_[n].reset();
    StartNode(n, roots[n], peers, {"--testing-delay-part-ms", "1500"});
  }
  std::vector<absl::StatusOr<ckptd::v1::SaveResponse>> second;
  std::thread saver([&] { second = SaveJob(save, 2, "ck", "ksave2", 2); });
  const bool seen = Await(
      [&] {
        return Slurp(nodes_[2]->log()).find("multi-node save job=ksave2: plan part received") !=
               std::string::npos;
      },
      "node 2 to log that it received its part of save job 'ksave2'");
  nodes_[2]->Kill();  // SIGKILL: no draining
  saver.join();
  ASSERT_TRUE(seen) << Slurp(nodes_[2]->log());
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_FALSE(second[r].ok()) << "rank " << r;
    if (r < 4) {  // ranks of the surviving nodes: the error names the lost one
      EXPECT_THAT(std::string(second[r].status().message()), HasSubstr(addrs_[2])) << "rank " << r;
    }
  }
  for (int n = 0; n < kNodes; ++n) {
    EXPECT_FALSE(fs::exists(roots[n] + "/ck/2.metadata")) << "node " << n;
  }
  // Node 2 back: version 1 loads byte-exact; version 2 does not exist.
  StartNode(2, roots[2], peers, {});
  Layout load = MakeLayout(kWorld, 1, false);
  std::string lf = WriteLayout(load, "kload6.json");
  EXPECT_THAT(RunJob("ck", lf, kWorld, "kload", tmp_.Sub("out-kload")), ::testing::Each(0))
      << Slurp(tmp_.Sub("kload.log"));
  ASSERT_TRUE(LayoutMatchesOracle(tmp_.Sub("out-kload"), load, full_));
}

// (d) AOA statements in a multi-node job: planned once by the coordinator
// (each node receives copies from transposed virtual shards); nodes that
// send different statements are refused, naming the difference.
TEST_P(MultiNode, AoaTransposeAcrossNodes) {
  const int kNodes = 4, kWorld = 8;
  const std::vector<std::string> roots = NodeLocalCheckpoint(kNodes, kWorld, false);
  StartNodes(roots);
  const std::string aoa = tmp_.Sub("t.aoa");
  std::ofstream(aoa) << "layers.0.w^T -> layers.0.wt\n";
  Layout load;
  load.world_size = kWorld;
  for (int r = 0; r < kWorld; ++r) {
    RankTargets rt{r, {}};
    Box b = Split({512, 256}, 0, kWorld, r);  // rows of the transposed [512, 256]
    rt.tensors.push_back(T("layers.0.wt", DType::kF32, {512, 256}, b.offset, b.shape));
    Box e = Split({512, 256}, 1, kWorld, r);
    rt.tensors.push_back(T("embed", DType::kBF16, {512, 256}, e.offset, e.shape));
    load.ranks.push_back(rt);
  }
  const std::string lf = WriteLayout(load, "load-aoa.json");
  auto run = [&](const std::string& job, const std::string& out,
                 const std::vector<std::string>& aoa_of_rank) {
    std::vector<pid_t> pids;
    for (int r = 0; r < kWorld; ++r) {
      pids.push_back(Spawn({Runfile("client/ckptctl"), "load", "ckpt", "--layout", lf, "--out",
                            out, "--daemon", Sockets(), "--ranks", std::to_string(r), "--job-id",
                            job, "--aoa", aoa_of_rank[r], "--fill_byte=165"},
                           tmp_.Sub(job + ".log")));
    }
    std::vector<int> codes;
    for (pid_t p : pids) codes.push_back(WaitExit(p, std::chrono::seconds(30)));
    return codes;
  };
  EXPECT_THAT(run("aoa", tmp_.Sub("out-aoa"), std::vector<std::string>(kWorld, aoa)),
              ::testing::Each(0))
      << Slurp(tmp_.Sub("aoa.log")) << Slurp(nodes_[0]->log());
  // The oracle: wt[i][j] is w[j][i] of the [256, 512] layers.0.w; embed as is.
  auto transposed = [](const std::string& name, const Shape& g) {
    if (name == "layers.0.wt") return SourceElement{"layers.0.w", g[1] * 512 + g[0]};
    return SameElement(name, g);
  };
  ASSERT_TRUE(LayoutMatchesOracle(tmp_.Sub("out-aoa"), load, full_, transposed));
  // Node 0 (the coordinator's) sends other statements than nodes 1-3.
  const std::string other = tmp_.Sub("u.aoa");
  std::ofstream(other) << "layers.0.w^T -> layers.0.wt\nlayers.1.w -> layers.1.renamed\n";
  std::vector<std::string> mixed(kWorld, other);
  mixed[0] = mixed[1] = aoa;
  EXPECT_THAT(run("aoa-mixed", tmp_.Sub("out-mixed"), mixed), ::testing::Each(::testing::Ne(0)));
  EXPECT_THAT(Slurp(tmp_.Sub("aoa-mixed.log")), HasSubstr("aoa_config (the AOA statements differ)"));
}

// (e) strict across nodes: one load path for single- and multi-node jobs
// (issue 32). Every rank asking strict fails when the checkpoint misses one
// of its keys, naming the key and the rank, on every node; ranks of the
// same job that do not ask strict still load (missing keys reported), and
// the node's reads for its peers are still made.
TEST_P(MultiNode, StrictFailsEveryRankMissingAKeyOnEveryNode) {
  const int kNodes = 3, kWorld = 6;
  const std::vector<std::string> roots = NodeLocalCheckpoint(kNodes, kWorld, false);
  StartNodes(roots);
  Layout load = MakeLayout(kWorld, 1, false);
  const Layout complete = load;
  for (RankTargets& rt : load.ranks) {
    rt.tensors.push_back(T("layers.9.no_such_weight", DType::kF32, {6, 4},
                           {static_cast<int64_t>(rt.rank), 0}, {1, 4}));
  }
  const std::string lf = WriteLayout(load, "load-strict.json");
  auto run = [&](const std::string& job, const std::set<int>& strict) {
    std::vector<pid_t> pids;
    for (int r = 0; r < kWorld; ++r) {
      std::vector<std::string> argv = {Runfile("client/ckptctl"), "load", "ckpt", "--layout", lf,
                                       "--out", tmp_.Sub("out-" + job), "--daemon", Sockets(),
                                       "--ranks", std::to_string(r), "--job-id", job,
                                       "--fill_byte=165"};
      argv.push_back(strict.count(r) ? "--strict" : "--strict=false");
      pids.push_back(Spawn(argv, tmp_.Sub(job + "-rank" + std::to_string(r) + ".log")));
    }
    std::vector<int> codes;
    for (pid_t p : pids) codes.push_back(WaitExit(p, std::chrono::seconds(30)));
    return codes;
  };
  // Every rank strict: every rank, on every node, fails naming the key.
  EXPECT_THAT(run("all-strict", {0, 1, 2, 3, 4, 5}), ::testing::Each(::testing::Ne(0)));
  for (int r = 0; r < kWorld; ++r) {
    const std::string log = Slurp(tmp_.Sub("all-strict-rank" + std::to_string(r) + ".log"));
    EXPECT_THAT(log, HasSubstr("rank " + std::to_string(r) + ": "));
    EXPECT_THAT(log, HasSubstr("has no tensor(s) layers.9.no_such_weight")) << "rank " << r;
  }
  // Strict ranks 0, 3 and 4 (nodes 0, 1 and 2) fail; the others load.
  const std::vector<int> codes = run("some-strict", {0, 3, 4});
  for (int r = 0; r < kWorld; ++r) {
    const std::string log = Slurp(tmp_.Sub("some-strict-rank" + std::to_string(r) + ".log"));
    if (r == 0 || r == 3 || r == 4) {
      EXPECT_NE(codes[r], 0) << log;
      EXPECT_THAT(log, HasSubstr("has no tensor(s) layers.9.no_such_weight")) << "rank " << r;
    } else {
      EXPECT_EQ(codes[r], 0) << log << Slurp(nodes_[0]->log());
      EXPECT_THAT(log, HasSubstr("layers.9.no_such_weight")) << "rank " << r;  // missing keys
    }
  }
  // The ranks that loaded got every byte of the tensors the checkpoint has.
  Layout loaded;
  loaded.world_size = kWorld;
  for (int r : {1, 2, 5}) loaded.ranks.push_back(complete.ranks[r]);
  EXPECT_TRUE(LayoutMatchesOracle(tmp_.Sub("out-some-strict"), loaded, full_));
}

INSTANTIATE_TEST_SUITE_P(Peers, MultiNode, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return p.param ? "MutualTls" : "Plaintext";
                         });

}  // namespace
}  // namespace ckpt
