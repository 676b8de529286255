// Integration tests: the real ckptd binary, real client processes (ckptctl)
// and the C++ client library over the daemon's Unix socket.
#include <fcntl.h>
#include <sys/mman.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cstring>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "absl/cleanup/cleanup.h"
#include "client/ckptd_client.h"
#include "core/tools/layout.h"
#include "core/tools/offline.h"
#include "core/format/safetensors.h"
#include "core/write/writer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/ckpt.grpc.pb.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/fixtures.h"
#include "tests/testing/temp_dir.h"

namespace ckpt {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;
using testing::Await;
using testing::DaemonProcess;
using testing::Runfile;
using testing::Spawn;
using testing::WaitExit;

class DaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = tmp_.Sub("root");
    ASSERT_TRUE(MakeDirs(root_ + "/src").ok());
    WriteSource(1);
    ckpt_ = root_ + "/ckpt";
    ASSERT_TRUE(ShardCheckpoint(root_ + "/src", MakeLayout(4, 0, true), ckpt_, {}).ok());
    load_layout_ = MakeLayout(8, 1, false);
    layout_file_ = tmp_.Sub("load8.json");
    std::ofstream(layout_file_) << LayoutToJson(load_layout_);
  }

  // Writes the source model (ModelData(seed)) and keeps its full tensors
  // in full_: the oracle the loads are checked against element by element.
  void WriteSource(uint64_t seed) {
    full_ = ModelData(seed);
    ASSERT_TRUE(WriteModel(root_ + "/src", seed).ok());
  }

  // Runs one ckptctl process per rank; returns their exit codes.
  std::vector<int> RunRanks(const DaemonProcess& d, const std::string& job, const std::string& out,
                            std::vector<int> ranks = {0, 1, 2, 3, 4, 5, 6, 7},
                            std::vector<std::string> extra = {}) {
    std::vector<pid_t> pids;
    for (int r : ranks) {
      std::vector<std::string> argv = {Runfile("client/ckptctl"), "load", ckpt_, "--layout",
                                       layout_file_, "--out", out, "--daemon", d.socket(),
                                       "--ranks", std::to_string(r), "--job-id", job, "--json",
                                       // Poisoned buffers: an element never written shows.
                                       "--fill_byte=165"};
      argv.insert(argv.end(), extra.begin(), extra.end());
      pids.push_back(Spawn(argv, tmp_.Sub("ckptctl-" + job + ".log")));
    }
    std::vector<int> codes;
    for (pid_t p : pids) codes.push_back(WaitExit(p));
    return codes;
  }

  std::unique_ptr<ckptd::Client> Connect(const DaemonProcess& d) {
    ckptd::Client::Options o;
    o.socket = d.socket();
    auto c = ckptd::Client::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return std::move(*c);
  }

  testing::TempDir tmp_;
  std::string root_, ckpt_, layout_file_;
  Layout load_layout_;
  FullModel full_;
};

TEST_F(DaemonTest, EightRanksByteExactReadOnceThenCacheHit) {
  DaemonProcess d(root_);
  ASSERT_TRUE(d.Ready()) << Slurp(d.log());
  EXPECT_THAT(RunRanks(d, "job1", tmp_.Sub("out1")), ::testing::Each(0))
      << Slurp(tmp_.Sub("ckptctl-job1.log")) << Slurp(d.log());
  ASSERT_TRUE(LayoutMatchesOracle(tmp_.Sub("out1"), load_layout_, full_));
  auto client = Connect(d);
  auto st = client->Status();
  ASSERT_TRUE(st.ok());
  // Each needed byte read from storage once for the 8 ranks.
  auto ck = OpenCheckpoint(ckpt_);
  ASSERT_TRUE(ck.ok());
  auto plan = PlanLoad(ck->metadata, load_layout_.ranks);
  ASSERT_TRUE(plan.ok());
  uint64_t unique = 0;
  for (const auto& [n, t] : ck->metadata.tensors) {
    for (const auto& s : t.shards) unique += s.nbytes;
  }
  EXPECT_EQ(plan->bytes_to_read, unique);  // the 8-rank layout needs every byte
  EXPECT_EQ(st->bytes_read_total(), unique);
  EXPECT_EQ(st->loads_succeeded(), 8u);

  // A second job on the same checkpoint: everything from the cache.
  EXPECT_THAT(RunRanks(d, "job2", tmp_.Sub("out2")), ::testing::Each(0));
  ASSERT_TRUE(LayoutMatchesOracle(tmp_.Sub("out2"), load_layout_, full_));
  st = client->Status();
  EXPECT_EQ(st->bytes_read_total(), unique);  // nothing more from storage
  EXPECT_GT(st->cache_hits(), 0u);
  EXPECT_EQ(st->cache_bytes(), unique);
  EXPECT_EQ(d.Stop(), 0) << Slurp(d.log());
  EXPECT_THAT(Slurp(d.log()), HasSubstr("load job=job2"));
}

TEST_F(DaemonTest, DirectIoLoadsAreByteExact) {
  // Every cache miss read around the page cache (O_DIRECT where the file
  // system has it), into the data cache and the ranks.
  DaemonProcess d(root_, {"--direct-io", "always"});
  ASSERT_TRUE(d.Ready()) << Slurp(d.log());
  EXPECT_THAT(RunRanks(d, "dio", tmp_.Sub("dio")), ::testing::Each(0))
      << Slurp(tmp_.Sub("ckptctl-dio.log")) << Slurp(d.log());
  ASSERT_TRUE(LayoutMatchesOracle(tmp_.Sub("dio"), load_layout_, full_));
  // And from the cache it filled.
  EXPECT_THAT(RunRanks(d, "dio2", tmp_.Sub("dio2")), ::testing::Each(0));
  ASSERT_TRUE(LayoutMatchesOracle(tmp_.Sub("dio2"), load_layout_, full_));
}

TEST_F(DaemonTest, EvictionAndInvalidationOnFileChange) {
  DaemonProcess d(root_);
  ASSERT_TRUE(d.Ready()) << Slurp(d.log());
  auto client = Connect(d);
  auto pre = client->Prefetch(ckpt_);
  ASSERT_TRUE(pre.ok()) << pre.status();
  EXPECT_GT(pre->bytes_read(), 0u);
  EXPECT_EQ(pre->bytes_cached(), pre->bytes_read());
  auto ev = client->Evict(ckpt_);
  ASSERT_TRUE(ev.ok());
  EXPECT_EQ(ev->bytes_freed(), pre->bytes_read());
  EXPECT_EQ(client->Status()->cache_bytes(), 0u);

  EXPECT_THAT(RunRanks(d, "a", tmp_.Sub("a")), ::testing::Each(0));
  ASSERT_TRUE(LayoutMatchesOracle(tmp_.Sub("a"), load_layout_, full_));
  const uint64_t read_a = client->Status()->bytes_read_total();
  // Rewrite the checkpoint in place with new values: same names, same uid.
  WriteSource(2);
  ShardOptions again;
  again.overwrite = true;
  ASSERT_TRUE(ShardCheckpoint(root_ + "/src", MakeLayout(4, 0, true), ckpt_, again).ok());
  EXPECT_THAT(RunRanks(d, "b", tmp_.Sub("b")), ::testing::Each(0)) << Slurp(d.log());
  // The new values everywhere (no stale bytes from the first load's cache).
  ASSERT_TRUE(LayoutMatchesOracle(tmp_.Sub("b"), load_layout_, full_));
  EXPECT_GT(client->Status()->bytes_read_total(), read_a);  // re-read from storage
}

TEST_F(DaemonTest, MissingRankGetsBarrierError) {
  DaemonProcess d(root_, {"--barrier-timeout", "700ms"});
  ASSERT_TRUE(d.Ready()) << Slurp(d.log());
  auto codes = RunRanks(d, "partial", tmp_.Sub("p"), {0, 1, 2, 3, 4, 5, 6});
  EXPECT_THAT(codes, ::testing::Each(1));
  std::string log = Slurp(tmp_.Sub("ckptctl-partial.log"));
  EXPECT_THAT(log, HasSubstr("ranks 7 never registered"));
  EXPECT_THAT(log, HasSubstr("DEADLINE_EXCEEDED"));
  EXPECT_FALSE(fs::exists(tmp_.Sub("p/rank0.safetensors")));
}

TEST_F(DaemonTest, KilledClientLeavesDaemonServing) {
  DaemonProcess d(root_);
  ASSERT_TRUE(d.Ready()) << Slurp(d.log());
  // Rank 0 of a 8-rank job registers and waits; kill it.
  pid_t p = Spawn({Runfile("client/ckptctl"), "load", ckpt_, "--layout", layout_file_, "--out",
                   tmp_.Sub("k"), "--daemon", d.socket(), "--ranks", "0", "--job-id", "killed"},
                  tmp_.Sub("killed.log"));
  auto client = Connect(d);
  auto jobs_are = [&](int n) {
    auto st = client->Status();
    return st.ok() && st->jobs_size() == n;
  };
  ASSERT_TRUE(Await([&] { return jobs_are(1); }, "rank 0 of job 'killed' to register"))
      << Slurp(tmp_.Sub("killed.log")) << Slurp(d.log());
  ::kill(p, SIGKILL);
  WaitExit(p);
  // The daemon drops the dead rank and keeps serving a full job.
  ASSERT_TRUE(Await([&] { return jobs_are(0); }, "the daemon to drop the killed rank's job"))
      << Slurp(d.log());
  EXPECT_THAT(RunRanks(d, "after", tmp_.Sub("after")), ::testing::Each(0));
  EXPECT_TRUE(LayoutMatchesOracle(tmp_.Sub("after"), load_layout_, full_));
  EXPECT_TRUE(d.Alive());
}

class BadRequests : public DaemonTest {
 protected:
  absl::Status LoadOne(ckptd::LoadSpec spec, const DaemonProcess& d) {
    auto client = Connect(d);
    auto r = client->Load(spec);
    return r.status();
  }
  ckptd::LoadSpec Spec(std::vector<float>& buf, int64_t rows = 2) {
    ckptd::LoadSpec spec;
    spec.job_id = "bad-" + std::to_string(counter_++);
    spec.path = ckpt_;
    ckptd::TensorSpec t;
    t.name = "layers.0.w";
    t.dtype = DType::kF32;
    t.global_shape = {256, 512};
    t.box = Box{{0, 0}, {rows, 512}};
    buf.assign(rows * 512, 0.0f);
    std::memset(buf.data(), kPoison, buf.size() * sizeof(float));  // a gap shows
    t.buffer = buf.data();
    spec.tensors.push_back(t);
    return spec;
  }
  // The oracle for Spec's target: rows 0 to rows-1 of the full layers.0.w.
  ::testing::AssertionResult HoldsSpecRows(const void* p, int64_t rows = 2) {
    TargetTensor t = T("layers.0.w", DType::kF32, {256, 512}, {0, 0}, {rows, 512});
    return MatchesOracle(static_cast<const uint8_t*>(p), rows * 512 * sizeof(float), t, full_);
  }
  int counter_ = 0;
};

// Transport::kAuto (the default) on the daemon's uid: the daemon writes the
// plain buffer itself (process_vm_writev), or, for cached reads of 64 KiB
// or more, this process copies them from read-only views of the cache
// (kCacheView): the same bytes the stream and shm transports deliver, every
// element written (poisoned buffers); a buffer shared by two tensors (tied
// weights) goes over shm instead.
TEST_F(BadRequests, AutoWritesPlainBuffersInPlace) {
  DaemonProcess d(root_);
  ASSERT_TRUE(d.Ready()) << Slurp(d.log());
  auto client = Connect(d);
  std::vector<float> via_stream, via_shm, in_place;
  auto s = Spec(via_stream);
  s.transport = ckptd::Transport::kStream;
  ASSERT_TRUE(client->Load(s).ok());
  s = Spec(via_shm);
  s.transport = ckptd::Transport::kShm;
  ASSERT_TRUE(client->Load(s).ok());
  s = Spec(in_place);
  std::fill(in_place.begin(), in_place.end(), std::nanf(""));
  // The first load's 4 KiB are in the cache now (the next load of a
  // checkpoint waits for its background fill), but too few to view.
  auto r = client->Load(s);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->transport, ckptd::Transport::kProcessMemory);
  EXPECT_EQ(r->result.bytes_delivered(), in_place.size() * sizeof(float));
  EXPECT_EQ(r->result.bytes_from_views(), 0u);
  EXPECT_TRUE(HoldsSpecRows(via_stream.data())) << "stream";
  EXPECT_TRUE(HoldsSpecRows(via_shm.data())) << "shm";
  EXPECT_TRUE(HoldsSpecRows(in_place.data())) << "process memory";
  // 64 rows (128 KiB), cached by a first load: copied from the cache's views.
  std::vector<float> rows64;
  auto big = Spec(rows64, 64);
  big.transport = ckptd::Transport::kStream;
  ASSERT_TRUE(client->Load(big).ok());
  std::fill(rows64.begin(), rows64.end(), std::nanf(""));
  big.transport = ckptd::Transport::kAuto;
  big.job_id += "-views";
  r = client->Load(big);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->transport, ckptd::Transport::kCacheView);
  EXPECT_EQ(r->result.bytes_from_views(), rows64.size() * sizeof(float));
  EXPECT_TRUE(HoldsSpecRows(rows64.data(), 64)) << "cache views";
  // Tied: two tensors in one buffer.
  s = Spec(in_place);
  s.tensors.push_back(s.tensors[0]);
  s.tensors[1].name = "layers.1.w";
  s.job_id += "-tied";
  r = client->Load(s);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->transport, ckptd::Transport::kShm);
  s.transport = ckptd::Transport::kProcessMemory;
  s.job_id += "-forced";
  EXPECT_EQ(client->Load(s).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(d.Alive());
}

// AnonHugePages (KiB) of the mappings that hold [lo, hi) of this process.
int64_t HugeKib(uintptr_t lo, uintptr_t hi) {
  std::ifstream f("/proc/self/smaps");
  std::string line;
  int64_t total = 0;
  bool inside = false;
  while (std::getline(f, line)) {
    unsigned long s = 0, e = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &s, &e) == 2 && line.find(':') > line.find(' ')) {
      inside = s < hi && e > lo;
    } else if (inside && line.rfind("AnonHugePages:", 0) == 0) {
      total += std::strtoll(line.c_str() + 14, nullptr, 10);
    }
  }
  return total;
}

// Fresh memory in a destination is advised huge before it is faulted in
// (where THP is left to madvise), only the whole 2 MiB pages inside the
// buffer; CKPTD_HUGE_PAGES=0 and memory already there keep 4 KiB pages; the
// loads are exact either way.
TEST_F(DaemonTest, FreshBuffersGetHugePages) {
  std::ifstream mode_file("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string mode((std::istreambuf_iterator<char>(mode_file)), {});
  if (mode.find("[madvise]") == std::string::npos) GTEST_SKIP() << "THP: " << mode;
  const std::string big = tmp_.Sub("big");
  constexpr int64_t kRows = 1024, kCols = 2048;  // 8 MiB of f32
  std::vector<float> full(kRows * kCols);
  for (size_t i = 0; i < full.size(); ++i) full[i] = static_cast<float>(i % 1000003);
  ASSERT_TRUE(MakeDirs(big + "/m").ok());
  ASSERT_TRUE(WriteSafetensors(big + "/m/model.safetensors",
                               {{"w", DType::kF32, {kRows, kCols}, full.data()}}, {})
                  .ok());
  DaemonProcess d(big);
  ASSERT_TRUE(d.Ready()) << Slurp(d.log());
  auto client = Connect(d);
  const size_t bytes = full.size() * sizeof(float), huge = size_t{2} << 20;
  auto load = [&](const std::string& job, bool touch) -> int64_t {
    void* m = ::mmap(nullptr, bytes + 2 * huge, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    EXPECT_NE(m, MAP_FAILED);
    if (m == MAP_FAILED) return -1;
    const uintptr_t at = (reinterpret_cast<uintptr_t>(m) + huge - 1) / huge * huge + 4096;
    auto* buf = reinterpret_cast<float*>(at);
    if (touch) std::memset(buf, kPoison, bytes);
    ckptd::LoadSpec spec;
    spec.job_id = job;
    spec.path = big + "/m";
    spec.transport = ckptd::Transport::kProcessMemory;
    ckptd::TensorSpec t;
    t.name = "w";
    t.dtype = DType::kF32;
    t.global_shape = {kRows, kCols};
    t.box = Box{{0, 0}, {kRows, kCols}};
    t.buffer = buf;
    spec.tensors.push_back(t);
    auto r = client->Load(spec);
    EXPECT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(std::memcmp(buf, full.data(), bytes), 0) << job;
    const int64_t kib = HugeKib(at, at + bytes);
    ::munmap(m, bytes + 2 * huge);
    return kib;
  };
  // 8 MiB from 4 KiB past a boundary: 3 whole 2 MiB pages inside.
  EXPECT_EQ(load("huge-fresh", false), 3 * 2048);
  EXPECT_EQ(load("huge-touched", true), 0);
  ::setenv("CKPTD_HUGE_PAGES", "0", 1);
  EXPECT_EQ(load("huge-off", false), 0);
  ::unsetenv("CKPTD_HUGE_PAGES");
}

TEST_F(BadRequests, EachGetsTheRightCodeAndMessage) {
  DaemonProcess d(root_);
  ASSERT_TRUE(d.Ready()) << Slurp(d.log());
  std::vector<float> buf;
  // A good request works (and loads the right rows).
  ASSERT_TRUE(LoadOne(Spec(buf), d).ok());
  EXPECT_TRUE(HoldsSpecRows(buf.data()));

  auto s = Spec(buf);
  s.tensors[0].name = "nope";
  s.strict = true;
  absl::Status st = LoadOne(s, d);
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("nope"));

  s = Spec(buf);
  s.tensors[0].box = Box{{255, 0}, {2, 512}};
  st = LoadOne(s, d);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("tensor 'layers.0.w': box (2,512)@(255,0) lies outside"));

  s = Spec(buf);
  s.tensors[0].dtype = DType::kI8;
  st = LoadOne(s, d);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("cannot be converted to the requested I8"));

  s = Spec(buf);
  s.tensors[0].global_shape = {256, 511};
  s.tensors[0].box = Box{{0, 0}, {2, 511}};
  st = LoadOne(s, d);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("requested global shape [256,511]"));

  s = Spec(buf);
  s.path = "/etc";
  st = LoadOne(s, d);
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("outside the checkpoint roots"));
  // A path that does not exist outside the roots gets the same answer (a
  // NOT_FOUND would tell any client what exists there); inside, NOT_FOUND.
  for (const std::string p : {"/etc/no-such-ckptd-dir", "/no-such-top/x", "/etc/../etc/nope"}) {
    s.path = p;
    st = LoadOne(s, d);
    EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << p << ": " << st;
  }
  s.path = root_ + "/no-such-checkpoint";
  st = LoadOne(s, d);
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
  s.path = root_ + "/a/../no-such-checkpoint";  // a ".." after what does not exist
  st = LoadOne(s, d);
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;

  // A segment too small for the declared tensors.
  auto arena = ckptd::ShmArena::Create(1024);
  ASSERT_TRUE(arena.ok());
  s = Spec(buf);
  s.tensors[0].buffer = nullptr;
  s.arena = arena->get();
  st = LoadOne(s, d);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("segment too small"));

  s = Spec(buf);
  s.rank = 3;
  s.world_size = 2;
  st = LoadOne(s, d);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("rank 3"));
  EXPECT_TRUE(d.Alive());
}

TEST_F(BadRequests, DaemonLendsArenasReusesThemAndChecksTokens) {
  const std::string config = tmp_.Sub("arenas.yaml");
  std::ofstream(config) << "roots: [" << root_ << "]\narena_limit: 8MiB\narena_pool: 4MiB\n";
  DaemonProcess d(root_, {"--config", config});
  ASSERT_TRUE(d.Ready()) << Slurp(d.log());
  auto client = Connect(d);
  // Leases end asynchronously (the daemon sees the socket close).
  auto leased_becomes = [&](uint64_t n) {
    return Await(
        [&] {
          auto st = client->Status();
          return st.ok() && st->arena_leased_bytes() == n;
        },
        "the daemon's leased arena bytes to become " + std::to_string(n));
  };
  // A plain buffer over shm: the client stages it through a borrowed arena.
  std::vector<float> want;
  auto staged = Spec(want);
  staged.transport = ckptd::Transport::kShm;
  ASSERT_TRUE(LoadOne(staged, d).ok());
  EXPECT_TRUE(HoldsSpecRows(want.data()));
  EXPECT_TRUE(leased_becomes(0));
  EXPECT_EQ(client->Status()->arena_free_bytes(), 2u << 20);

  // A lent arena: rounded up to 2 MiB, loads land at their offsets, and its
  // token serves any number of loads while the lease is open.
  auto arena = ckptd::ShmArena::FromDaemon(d.socket(), 5000);
  ASSERT_TRUE(arena.ok()) << arena.status();
  EXPECT_EQ((*arena)->size(), 2u << 20);
  EXPECT_FALSE((*arena)->daemon_token().empty());
  EXPECT_EQ(client->Status()->arena_leased_bytes(), 2u << 20);
  const uint64_t reused = client->Status()->arena_reused();
  EXPECT_GE(reused, 1u);  // the staging arena of the first load
  for (int round = 0; round < 2; ++round) {
    std::memset((*arena)->data(), 0xee, (*arena)->size());
    std::vector<float> unused;
    auto s = Spec(unused);
    s.tensors[0].buffer = nullptr;
    s.tensors[0].arena_offset = 4096;
    s.arena = arena->get();
    ASSERT_TRUE(LoadOne(s, d).ok());
    EXPECT_EQ(std::memcmp((*arena)->data() + 4096, want.data(), want.size() * 4), 0);
    EXPECT_EQ((*arena)->data()[4095], 0xee);  // nothing outside the target
    EXPECT_EQ((*arena)->data()[4096 + want.size() * 4], 0xee);
  }

  // Over the daemon's lease limit: refused, naming the limit.
  auto big = ckptd::ShmArena::FromDaemon(d.socket(), 7u << 20);
  ASSERT_FALSE(big.ok());
  EXPECT_THAT(std::string(big.status().message()), HasSubstr("exceed the daemon's limit"));

  // Giving it back puts it in the pool; the next client of that size gets it.
  arena->reset();
  EXPECT_TRUE(leased_becomes(0));
  EXPECT_EQ(client->Status()->arena_free_bytes(), 2u << 20);
  auto again = ckptd::ShmArena::FromDaemon(d.socket(), 2u << 20);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(client->Status()->arena_reused(), reused + 1);
  // A 6 MiB arena given back does not fit the 4 MiB pool: dropped.
  again->reset();
  auto six = ckptd::ShmArena::FromDaemon(d.socket(), 6u << 20);
  ASSERT_TRUE(six.ok()) << six.status();
  six->reset();
  EXPECT_TRUE(leased_becomes(0));
  EXPECT_LE(client->Status()->arena_free_bytes(), 4u << 20);

  // A token the daemon did not lend (or whose lease ended).
  auto channel = grpc::CreateChannel("unix:" + d.socket(), grpc::InsecureChannelCredentials());
  auto stub = ckptd::v1::Ckptd::NewStub(channel);
  ckptd::v1::LoadRequest req;
  req.set_job_id("bad-token");
  req.set_world_size(1);
  req.set_path(ckpt_);
  req.mutable_shm()->set_arena_token(std::string(32, 'a'));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto reader = stub->Load(&ctx, req);
  ckptd::v1::LoadEvent ev;
  while (reader->Read(&ev)) {
  }
  grpc::Status gs = reader->Finish();
  EXPECT_EQ(gs.error_code(), grpc::StatusCode::NOT_FOUND) << gs.error_message();
  EXPECT_THAT(gs.error_message(), HasSubstr("is not leased"));
  EXPECT_TRUE(d.Alive());
}

// Restarts that jobs survive (issue 38), through the C++ client (ckptctl's
// ranks): half of an 8-rank job registers, the daemon is restarted (SIGTERM,
// a new process on the same socket), the other half comes; every rank's
// call is made again on the new daemon and the job loads exact.
TEST_F(DaemonTest, RanksWaitingAtTheBarrierLoadFromTheRestartedDaemon) {
  const char* before = std::getenv("CKPTD_RETRY_TIMEOUT");
  const std::string saved = before ? before : "";
  ::setenv("CKPTD_RETRY_TIMEOUT", "60", 1);  // the clients' default (the BUILD sets 0)
  auto restore = absl::MakeCleanup([&] { ::setenv("CKPTD_RETRY_TIMEOUT", saved.c_str(), 1); });
  DaemonProcess old(root_);
  ASSERT_TRUE(old.Ready()) << Slurp(old.log());
  std::vector<pid_t> pids;
  auto rank = [&](int r, const std::string& socket) {
    return Spawn({Runfile("client/ckptctl"), "load", ckpt_, "--layout", layout_file_, "--out",
                  tmp_.Sub("out-restart"), "--daemon", socket, "--ranks", std::to_string(r),
                  "--job-id", "restart", "--fill_byte=165", "--barrier_timeout_ms=60000"},
                 tmp_.Sub("ckptctl-restart-" + std::to_string(r) + ".log"));
  };
  for (int r = 0; r < 4; ++r) pids.push_back(rank(r, old.socket()));
  auto client = Connect(old);
  bool registered = false;
  for (int i = 0; i < 400 && !registered; ++i) {
    auto st = client->Status();
    if (!st.ok()) continue;
    for (const auto& j : st->jobs()) {
      registered = registered || (j.job_id() == "restart" && j.registered_ranks_size() == 4);
    }
    if (!registered) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  ASSERT_TRUE(registered) << Slurp(old.log());
  client.reset();
  EXPECT_EQ(old.Stop(), 0);
  EXPECT_THAT(Slurp(old.log()), HasSubstr("failed 1 job(s) still waiting for ranks"));
  DaemonProcess restarted(root_, {}, old.socket());
  ASSERT_TRUE(restarted.Ready()) << Slurp(restarted.log());
  for (int r = 4; r < 8; ++r) pids.push_back(rank(r, old.socket()));
  for (size_t i = 0; i < pids.size(); ++i) {
    EXPECT_EQ(WaitExit(pids[i]), 0) << "rank " << i << ": "
                                    << Slurp(tmp_.Sub("ckptctl-restart-" + std::to_string(i) + ".log"));
  }
  ASSERT_TRUE(LayoutMatchesOracle(tmp_.Sub("out-restart"), load_layout_, full_));
  EXPECT_THAT(Slurp(restarted.log()), HasSubstr("load job=restart path="));
  EXPECT_EQ(restarted.Stop(), 0);
}

TEST(DaemonClient, NotRunningIsAClearError) {
  ckptd::Client::Options o;
  o.socket = "/tmp/ckptd-no-such-daemon.sock";
  o.connect_timeout = absl::Milliseconds(200);
  auto c = ckptd::Client::Connect(o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("is the daemon running?"));
}

TEST(DaemonConfig, CheckConfigAndBadStartup) {
  testing::TempDir tmp;
  std::ofstream(tmp.Sub("good.yaml")) << "roots: [/tmp]\ncache_budget: 1GiB\nbarrier_timeout: 5s\n";
  std::ofstream(tmp.Sub("bad.yaml")) << "roots: [/tmp]\ncache_bugdet: 1GiB\n";
  EXPECT_EQ(WaitExit(Spawn({Runfile("server/ckptd"), "--check-config", tmp.Sub("good.yaml")},
                           tmp.Sub("g.log"))),
            0);
  EXPECT_EQ(WaitExit(Spawn({Runfile("server/ckptd"), "--check-config", tmp.Sub("bad.yaml")},
                           tmp.Sub("b.log"))),
            1);
  EXPECT_THAT(Slurp(tmp.Sub("b.log")), HasSubstr("unknown key 'cache_bugdet'"));
  std::ofstream(tmp.Sub("dio.yaml")) << "roots: [/tmp]\ndirect_io: sometimes\n";
  EXPECT_EQ(WaitExit(Spawn({Runfile("server/ckptd"), "--check-config", tmp.Sub("dio.yaml")},
                           tmp.Sub("d.log"))),
            1);
  EXPECT_THAT(Slurp(tmp.Sub("d.log")), HasSubstr("key 'direct_io': must be never, auto or always"));
  EXPECT_EQ(WaitExit(Spawn({Runfile("server/ckptd"), "--socket", "/tmp/x.sock"}, tmp.Sub("n.log"))),
            1);
  EXPECT_THAT(Slurp(tmp.Sub("n.log")), HasSubstr("'roots' is empty"));
}

}  // namespace
}  // namespace ckpt

namespace ckpt {
namespace {

// Rank r's SaveSpec for the 4-rank layout `save`, its shards' bytes in cut[r].
ckptd::SaveSpec SaveSpecOf(const Layout& save, int r,
                           std::vector<std::vector<std::vector<uint8_t>>>& cut,
                           const std::string& job, const std::string& path, int64_t uid) {
  ckptd::SaveSpec spec;
  spec.job_id = job;
  spec.rank = r;
  spec.world_size = 4;
  spec.path = path;
  spec.unique_id = uid;
  for (size_t t = 0; t < save.ranks[r].tensors.size(); ++t) {
    const TargetTensor& tt = save.ranks[r].tensors[t];
    spec.tensors.push_back({tt.name, tt.dtype, tt.global_shape, tt.box, tt.flat_range,
                            cut[r][t].data(), 0});
  }
  return spec;
}

// The checkpoint in `path`, read back whole (one rank owning every tensor)
// and checked element by element against the full tensors.
void ExpectWholeMatchesOracle(const std::string& path, const FullModel& full) {
  Layout whole;
  whole.world_size = 1;
  whole.ranks = {{0, {}}};
  for (const Model& m : Tensors()) {
    whole.ranks[0].tensors.push_back(T(m.name, m.dtype, m.shape, Shape(m.shape.size(), 0), m.shape));
  }
  OfflineLoadOptions lo;
  lo.fill_byte = kPoison;
  auto back = LoadOffline(path, whole, lo);
  ASSERT_TRUE(back.ok()) << back.status();
  for (size_t t = 0; t < Tensors().size(); ++t) {
    const auto& got = back->buffers[0].tensors[t];
    EXPECT_TRUE(MatchesOracle(got.data(), got.size(), whole.ranks[0].tensors[t], full));
  }
}

// Each rank's shard bytes, cut from the full tensors in memory (oracle).
std::vector<std::vector<std::vector<uint8_t>>> CutShards(const Layout& save,
                                                         const FullModel& full) {
  std::vector<std::vector<std::vector<uint8_t>>> cut(save.ranks.size());
  for (size_t r = 0; r < save.ranks.size(); ++r) {
    for (const TargetTensor& tt : save.ranks[r].tensors) cut[r].push_back(OracleBytes(tt, full));
  }
  return cut;
}

// Four ranks save through the daemon (replicated bias written once), then
// load back with another layout.
TEST_F(DaemonTest, SaveThroughDaemonThenLoad) {
  DaemonProcess d(root_);
  ASSERT_TRUE(d.Ready()) << Slurp(d.log());
  Layout save = MakeLayout(4, 0, true);
  auto cut = CutShards(save, full_);
  std::vector<std::thread> threads;
  std::vector<absl::StatusOr<ckptd::v1::SaveResponse>> results(4, absl::UnknownError(""));
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back([&, r] {
      ckptd::SaveSpec spec = SaveSpecOf(save, r, cut, "save1", root_ + "/saved", 7);
      ckptd::Client::Options o;
      o.socket = d.socket();
      auto c = ckptd::Client::Connect(o);
      results[r] = c.ok() ? (*c)->Save(spec) : c.status();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 4; ++r) ASSERT_TRUE(results[r].ok()) << results[r].status();
  EXPECT_EQ(results[0]->metadata_file(), "7.metadata");
  // The replicated bias is stored once.
  auto ck = OpenCheckpoint(root_ + "/saved");
  ASSERT_TRUE(ck.ok()) << ck.status();
  EXPECT_EQ(ck->metadata.tensors.at("layers.0.bias").shards.size(), 1u);
  EXPECT_EQ(*ck->unique_id, 7);
  ExpectWholeMatchesOracle(root_ + "/saved", full_);
  // Saving outside the roots is refused.
  ckptd::SaveSpec bad;
  bad.job_id = "save2";
  bad.path = "/etc/ckptd-nope";
  auto c = Connect(d);
  auto r = c->Save(bad);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied) << r.status();
}

// Client::SaveAsync: four ranks hand their bytes over and overwrite them at
// once; the future's Wait reports the version durable, and it holds the
// bytes as they were at the call (checked against the oracle).
TEST_F(DaemonTest, SaveAsyncThenChangeTheBuffers) {
  DaemonProcess d(root_, {"--testing-delay-persist-ms", "100"});
  ASSERT_TRUE(d.Ready()) << Slurp(d.log());
  Layout save = MakeLayout(4, 0, true);
  auto cut = CutShards(save, full_);
  std::vector<std::thread> threads;
  std::vector<absl::StatusOr<ckptd::v1::SaveResponse>> staged(4, absl::UnknownError(""));
  std::vector<absl::StatusOr<ckptd::v1::SaveResponse>> final(4, absl::UnknownError(""));
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back([&, r] {
      ckptd::SaveSpec spec = SaveSpecOf(save, r, cut, "async1", root_ + "/saved-async", 3);
      ckptd::Client::Options o;
      o.socket = d.socket();
      auto c = ckptd::Client::Connect(o);
      if (!c.ok()) {
        staged[r] = c.status();
        return;
      }
      auto f = (*c)->SaveAsync(spec);
      if (!f.ok()) {
        staged[r] = f.status();
        return;
      }
      staged[r] = f->staged();
      for (auto& buf : cut[r]) std::fill(buf.begin(), buf.end(), uint8_t{0xAB});  // training goes on
      final[r] = f->Wait(absl::Seconds(60));
      if (final[r].ok() && !f->Done()) final[r] = absl::InternalError("Done() false after Wait");
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(staged[r].ok()) << staged[r].status();
    EXPECT_FALSE(staged[r]->persisted());
    ASSERT_TRUE(final[r].ok()) << final[r].status();
    EXPECT_TRUE(final[r]->persisted());
    EXPECT_GT(final[r]->persist_s(), 0.1);
  }
  EXPECT_EQ(final[0]->metadata_file(), "3.metadata");
  ExpectWholeMatchesOracle(root_ + "/saved-async", full_);
}

}  // namespace
}  // namespace ckpt
