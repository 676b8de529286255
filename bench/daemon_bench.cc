// daemon_bench — cases 3, 5 and 6 of bench/run: the real ckptd daemon binary
// serving 8 local ranks, against the same 8 ranks loading in-process on their
// own; the control plane with 10,000 small tensors; the daemon's peak memory.
//
// Case 3. A ~2.1 GB checkpoint (0.5 GB with --quick), written with core's save
// API as if saved with tensor parallelism 4 (even tensors split along axis 0,
// odd ones along axis 1), synced and held in the page cache, is loaded by 8
// ranks with tensor parallelism 8:
//   (a) daemon, cold data cache: a fresh daemon (later reps: after Evict),
//       checkpoint files in the page cache;
//   (b) daemon, warm restart: a second job on the same checkpoint, served
//       from the daemon's data cache;
//   (c) 8 in-process loaders: 8 processes (this binary, --worker), each
//       opening the checkpoint and planning + executing only its own rank
//       (what `ckptctl load` with a one-rank layout does, minus writing its
//       output), 1 I/O thread each, all started together.
// Every rank's destination is allocated and faulted in before the timed part
// (a training process's tensors exist before it loads; daemon ranks use an
// arena the daemon lends, ShmArena::FromDaemon, which it writes into, zero
// copy; each job's ranks are new clients, as after a restart, and get the
// arenas the previous job's ranks gave back). Figure: bytes delivered to
// the 8 ranks / wall time from "go" to the last rank done. Limits measured
// in this run: memcpy on 2 threads between faulted-in buffers; pread of the
// job's planned byte ranges on 2 threads into faulted-in memory. Bytes read
// from storage: the daemon's Status bytes_read_total delta per job; for (c)
// the sum over the 8 processes. Unique bytes: the job plan's bytes_to_read.
//
// Case 6. While case 3 runs, /proc/<daemon>/status is sampled every 5 ms;
// the table reports VmHWM minus the data cache bytes (Status cache_bytes)
// and minus the ranks' arenas it keeps mapped (Status arena_*_bytes).
//
// Case 5. A checkpoint of 10,000 tensors of 1 KiB (F32 [256]) in one file; one
// rank loads all of them through the daemon. Figure: client-observed Load
// time / 10,000 (median of repeated loads with metadata and data cached; the
// first load is reported too). Reference: the same plan + execute in-process.
//
// Usage: daemon_bench --dir WORKDIR --ckptd PATH [--rows FILE] [--quick] [--keep]
//                     [--cases 3,5]   (case 6 comes with case 3)
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/bench_util.h"
#include "client/ckptd_client.h"
#include "core/format/checkpoint.h"
#include "core/exec/executor.h"
#include "core/io/file.h"

extern char** environ;

namespace ckpt::bench {
namespace {

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "daemon_bench: %s\n", what.c_str());
  std::exit(1);
}

template <typename T>
T Check(absl::StatusOr<T> v, const std::string& what) {
  if (!v.ok()) Die(absl::StrCat(what, ": ", v.status().ToString()));
  return std::move(*v);
}

bool Exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

uint64_t TargetsBytes(const RankTargets& rt) {
  uint64_t n = 0;
  for (const auto& t : rt.tensors) n += t.num_bytes();
  return n;
}

// --- (c) in-process ranks ------------------------------------------------------

TensorSet SetFromArgs(const Args& a) {
  TensorSet s;
  s.count = static_cast<int>(a.Int("count", 0));
  s.rows = a.Int("trows", 0);
  s.cols = a.Int("tcols", 0);
  return s;
}

// Worker process: one rank loading in-process on its own.
int Worker(const Args& a) {
  const TensorSet set = SetFromArgs(a);
  const int tp = static_cast<int>(a.Int("tp", 8));
  const int rank = static_cast<int>(a.Int("rank", 0));
  const std::string dir = a.Get("ckpt");
  const Layout layout = TpLayout(set, tp);
  const RankTargets& rt = layout.ranks[rank];
  Buffer buf(TargetsBytes(rt));
  buf.Touch();
  std::vector<std::vector<void*>> dests(1);
  uint64_t pos = 0;
  for (const auto& t : rt.tensors) {
    dests[0].push_back(buf.data() + pos);
    pos += t.num_bytes();
  }
  { std::ofstream(a.Get("ready")) << "ready\n"; }
  char go = 0;
  if (::read(0, &go, 1) != 1) return 3;
  const double t_start = MonotonicNow();
  Checkpoint c = Check(OpenCheckpoint(dir), "worker open");
  const double t_open = MonotonicNow();
  LoadPlan plan = Check(PlanLoad(c.metadata, {rt}), "worker plan");
  const double t_plan = MonotonicNow();
  DirectorySource source(c.dir);
  ExecuteOptions eo;
  eo.threads = static_cast<int>(a.Int("threads", 1));
  LoadStats st = Check(ExecutePlan(plan, source, dests, eo), "worker load");
  const double t_end = MonotonicNow();
  uint64_t bad = 0;
  if (a.Has("verify")) {
    for (size_t t = 0; t < rt.tensors.size(); ++t) {
      bad += VerifyTarget(rt.tensors[t], SeedOf(rt.tensors[t].name), dests[0][t]);
    }
  }
  std::ofstream out(a.Get("result"));
  out.precision(17);
  out << t_start << " " << t_end << " " << st.bytes_read << " " << st.bytes_delivered << " "
      << (t_open - t_start) << " " << (t_plan - t_open) << " " << (t_end - t_plan) << " "
      << st.read_seconds << " " << st.copy_seconds << " " << bad << "\n";
  return 0;
}

struct JobFigures {
  double wall_s = 0;
  uint64_t delivered = 0;
  uint64_t bytes_read = 0;
  double fault_s = 0;  // destination fault-in (max over ranks), not in wall_s
  std::string detail;
};

JobFigures RunInProcess(const std::string& self, const std::string& work, const std::string& ckpt,
                        const TensorSet& set, int tp, bool verify) {
  int go[2];
  if (::pipe2(go, O_CLOEXEC) != 0) Die("pipe");
  std::vector<pid_t> pids;
  std::vector<std::string> ready, result;
  for (int r = 0; r < tp; ++r) {
    ready.push_back(absl::StrCat(work, "/worker", r, ".ready"));
    result.push_back(absl::StrCat(work, "/worker", r, ".result"));
    ::unlink(ready.back().c_str());
    ::unlink(result.back().c_str());
    std::vector<std::string> argv = {self,
                                     "--worker",
                                     "--ckpt=" + ckpt,
                                     absl::StrCat("--rank=", r),
                                     absl::StrCat("--tp=", tp),
                                     absl::StrCat("--count=", set.count),
                                     absl::StrCat("--trows=", set.rows),
                                     absl::StrCat("--tcols=", set.cols),
                                     "--ready=" + ready.back(),
                                     "--result=" + result.back(),
                                     "--threads=1"};
    if (verify) argv.push_back("--verify");
    std::vector<char*> cargv;
    for (auto& s : argv) cargv.push_back(s.data());
    cargv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, go[0], 0);
    pid_t pid;
    if (posix_spawn(&pid, self.c_str(), &fa, nullptr, cargv.data(), environ) != 0) Die("spawn");
    posix_spawn_file_actions_destroy(&fa);
    pids.push_back(pid);
  }
  ::close(go[0]);
  auto deadline = Clock::now() + std::chrono::seconds(120);
  for (const auto& f : ready) {
    while (!Exists(f)) {
      if (Clock::now() > deadline) Die("in-process workers did not get ready");
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  const double t0 = MonotonicNow();
  std::string bytes(tp, 'g');
  if (::write(go[1], bytes.data(), bytes.size()) != static_cast<ssize_t>(bytes.size())) Die("go");
  for (pid_t p : pids) {
    int st = 0;
    ::waitpid(p, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) Die("an in-process worker failed");
  }
  ::close(go[1]);
  JobFigures f;
  double t_end = t0, open_s = 0, plan_s = 0, exec_s = 0, read_s = 0, copy_s = 0;
  for (int r = 0; r < tp; ++r) {
    std::ifstream in(result[r]);
    double ts, te, o, p, e, rs, cs;
    uint64_t br, bd, bad;
    if (!(in >> ts >> te >> br >> bd >> o >> p >> e >> rs >> cs >> bad)) Die("worker result");
    if (bad != 0) Die(absl::StrCat("in-process rank ", r, " loaded wrong data"));
    t_end = std::max(t_end, te);
    f.bytes_read += br;
    f.delivered += bd;
    open_s = std::max(open_s, o);
    plan_s = std::max(plan_s, p);
    exec_s = std::max(exec_s, e);
    read_s += rs;
    copy_s += cs;
    ::unlink(ready[r].c_str());
    ::unlink(result[r].c_str());
  }
  f.wall_s = t_end - t0;
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "max per rank: open %.3f s, plan %.3f s, execute %.3f s; summed thread-seconds "
                "read+verify %.2f, copy %.2f",
                open_s, plan_s, exec_s, read_s, copy_s);
  f.detail = buf;
  return f;
}

// --- the daemon ------------------------------------------------------------------

struct DaemonProc {
  pid_t pid = -1;
  std::string socket, log;
};

DaemonProc StartDaemon(const std::string& ckptd, const std::string& work) {
  DaemonProc d;
  d.socket = work + "/ckptd.sock";
  d.log = work + "/ckptd.log";
  if (d.socket.size() > 100) Die("socket path too long: " + d.socket);
  std::vector<std::string> argv = {ckptd, "--socket", d.socket, "--root", work,
                                   "--cache-budget", "8GiB"};
  std::vector<char*> cargv;
  for (auto& s : argv) cargv.push_back(s.data());
  cargv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, d.log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  if (posix_spawn(&d.pid, ckptd.c_str(), &fa, nullptr, cargv.data(), environ) != 0) {
    Die("cannot start " + ckptd);
  }
  posix_spawn_file_actions_destroy(&fa);
  { std::ofstream(work + "/ckptd.pid") << d.pid << "\n"; }
  auto deadline = Clock::now() + std::chrono::seconds(30);
  while (!(Exists(d.socket) && Exists(d.socket + ".fd"))) {
    int st;
    if (::waitpid(d.pid, &st, WNOHANG) == d.pid) Die("ckptd exited at start-up; see " + d.log);
    if (Clock::now() > deadline) Die("ckptd did not come up; see " + d.log);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return d;
}

void StopDaemon(DaemonProc& d, const std::string& work) {
  if (d.pid <= 0) return;
  ::kill(d.pid, SIGTERM);
  auto deadline = Clock::now() + std::chrono::seconds(30);
  while (true) {
    int st;
    if (::waitpid(d.pid, &st, WNOHANG) == d.pid) break;
    if (Clock::now() > deadline) {
      ::kill(d.pid, SIGKILL);
      ::waitpid(d.pid, &st, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  d.pid = -1;
  ::unlink((work + "/ckptd.pid").c_str());
}

// Samples the daemon's memory while alive.
class RssSampler {
 public:
  explicit RssSampler(pid_t pid) : pid_(pid), thread_([this] { Loop(); }) {}
  ~RssSampler() { Stop(); }
  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  ProcMem max() const { return max_; }

 private:
  void Loop() {
    while (!stop_) {
      ProcMem m = ReadProcMem(pid_);
      max_.vm_rss = std::max(max_.vm_rss, m.vm_rss);
      max_.vm_hwm = std::max(max_.vm_hwm, m.vm_hwm);
      max_.rss_anon = std::max(max_.rss_anon, m.rss_anon);
      max_.rss_file = std::max(max_.rss_file, m.rss_file);
      max_.rss_shmem = std::max(max_.rss_shmem, m.rss_shmem);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  pid_t pid_;
  std::atomic<bool> stop_{false};
  ProcMem max_;
  std::thread thread_;
};

std::unique_ptr<ckptd::Client> Connect(const std::string& socket) {
  ckptd::Client::Options o;
  o.socket = socket;
  return Check(ckptd::Client::Connect(o), "connect to ckptd");
}

ckptd::v1::StatusResponse DaemonStatus(const std::string& socket) {
  return Check(Connect(socket)->Status(), "Status");
}

// One job: every rank of `layout` as a client thread with its own connection
// and a faulted-in memfd arena; all start Load together.
JobFigures RunDaemonJob(const std::string& socket, pid_t daemon, const std::string& job,
                        const std::string& ckpt, const Layout& layout, bool verify) {
  const int n = static_cast<int>(layout.ranks.size());
  std::mutex mu;
  std::condition_variable cv;
  int ready = 0;
  bool go = false;
  double t0 = 0;
  std::vector<double> t_end(n, 0), fault(n, 0);
  std::vector<absl::StatusOr<ckptd::LoadReport>> reports(n, absl::UnknownError("not run"));
  std::vector<std::unique_ptr<ckptd::ShmArena>> arenas(n);
  std::vector<std::vector<uint64_t>> offsets(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      const RankTargets& rt = layout.ranks[r];
      auto client = Connect(socket);
      // The rank's tensors live in an arena the daemon lends (a restarted
      // rank gets the one its predecessor gave back); mapping and faulting it
      // in is the rank allocating its tensors, before the load.
      const double t_alloc = MonotonicNow();
      arenas[r] = Check(ckptd::ShmArena::FromDaemon(socket, TargetsBytes(rt)), "arena");
      fault[r] = MonotonicNow() - t_alloc + TouchPages(arenas[r]->data(), arenas[r]->size());
      ckptd::LoadSpec spec;
      spec.job_id = job;
      spec.rank = rt.rank;
      spec.world_size = layout.world_size;
      spec.path = ckpt;
      spec.arena = arenas[r].get();
      uint64_t pos = 0;
      for (const TargetTensor& t : rt.tensors) {
        ckptd::TensorSpec ts;
        ts.name = t.name;
        ts.dtype = t.dtype;
        ts.global_shape = t.global_shape;
        ts.box = t.box;
        ts.flat_range = t.flat_range;
        ts.arena_offset = pos;
        offsets[r].push_back(pos);
        pos += t.num_bytes();
        spec.tensors.push_back(std::move(ts));
      }
      {
        std::unique_lock<std::mutex> lock(mu);
        ++ready;
        cv.notify_all();
        cv.wait(lock, [&] { return go; });
      }
      reports[r] = client->Load(spec);
      t_end[r] = MonotonicNow();
    });
  }
  uint64_t faults0 = 0;
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return ready == n; });
    faults0 = MinorFaults(daemon);
    t0 = MonotonicNow();
    go = true;
    cv.notify_all();
  }
  for (auto& t : threads) t.join();
  const uint64_t faults = MinorFaults(daemon) - faults0;
  JobFigures f;
  double end = t0;
  for (int r = 0; r < n; ++r) {
    if (!reports[r].ok()) Die(absl::StrCat("job ", job, " rank ", r, ": ", reports[r].status().ToString()));
    f.delivered += reports[r]->result.bytes_delivered();
    end = std::max(end, t_end[r]);
    f.fault_s = std::max(f.fault_s, fault[r]);
  }
  f.wall_s = end - t0;
  const ckptd::v1::LoadResult& res = reports[0]->result;
  f.bytes_read = res.bytes_read();
  char buf[400];
  std::snprintf(buf, sizeof buf,
                "daemon: list %.3f s, plan %.3f s, thread-seconds read %.3f + copy %.3f, rank 0 "
                "barrier wait %.3f s, rank 0 total %.3f s; from cache %s; daemon page faults %llu",
                res.timings().list_s(), res.timings().plan_s(), res.timings().read_s(),
                res.timings().copy_s(), res.timings().wait_s(), res.timings().total_s(),
                Bytes(res.bytes_from_cache()).c_str(), static_cast<unsigned long long>(faults));
  f.detail = buf;
  if (verify) {
    uint64_t bad = 0;
    for (int r = 0; r < n; ++r) {
      const RankTargets& rt = layout.ranks[r];
      for (size_t t = 0; t < rt.tensors.size(); ++t) {
        bad += VerifyTarget(rt.tensors[t], SeedOf(rt.tensors[t].name),
                            arenas[r]->data() + offsets[r][t]);
      }
    }
    if (bad != 0) Die(absl::StrCat("job ", job, ": ", bad, " wrong elements delivered"));
  }
  return f;
}

Row MakeRow(std::string name, double figure, std::string unit, double limit,
            std::string limit_what, std::string target = "-", std::string met = "-") {
  Row r;
  r.name = std::move(name);
  r.figure = figure;
  r.unit = std::move(unit);
  r.limit = limit;
  r.limit_what = std::move(limit_what);
  r.ratio = limit != 0 ? figure / limit : 0;
  r.target = std::move(target);
  r.met = std::move(met);
  return r;
}

// What copying into a client's memfd segment costs the daemon: the client
// has faulted the segment in through its own mapping; the daemon maps it anew
// (MappedSegment::Map: plain mmap) and copies in, taking a page fault per
// 4 KiB page of its fresh mapping. Measured on 2 threads: into a fresh plain
// mapping, into a fresh MAP_POPULATE mapping (mmap time included), and into a
// mapping whose page tables already exist.
void ShmProbe(uint64_t bytes) {
  bytes = bytes / 8192 * 8192;
  const uint64_t half = bytes / 2;
  int fd = ::memfd_create("ckptd-bench-probe", MFD_CLOEXEC);
  if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) Die("memfd");
  void* a = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (a == MAP_FAILED) Die("mmap");
  TouchPages(static_cast<uint8_t*>(a), bytes);  // the client's pre-fault
  Buffer src(bytes);
  src.Touch();
  auto copy2 = [&](uint8_t* dst) {
    std::thread t([&] { std::memcpy(dst + half, src.data() + half, bytes - half); });
    std::memcpy(dst, src.data(), half);
    t.join();
  };
  auto run = [&](int flags, bool twice) {
    auto t0 = Clock::now();
    void* b = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | flags, fd, 0);
    if (b == MAP_FAILED) Die("mmap");
    if (twice) copy2(static_cast<uint8_t*>(b));
    auto t1 = Clock::now();
    copy2(static_cast<uint8_t*>(b));
    const double s = twice ? SecondsSince(t1) : SecondsSince(t0);
    ::munmap(b, bytes);
    return GB(bytes) / s;
  };
  const uint64_t f0 = MinorFaults(0);
  const double fresh = run(0, false);
  const uint64_t faults = MinorFaults(0) - f0;
  const double populate = run(MAP_POPULATE, false);
  const double mapped = run(0, true);
  std::printf("  delivery probe, %s into a client-faulted memfd on 2 threads: fresh mapping %.2f "
              "GB/s (%llu page faults), fresh MAP_POPULATE mapping %.2f GB/s (mmap included), "
              "page tables already present %.2f GB/s\n",
              Bytes(bytes).c_str(), fresh, static_cast<unsigned long long>(faults), populate,
              mapped);
  ::munmap(a, bytes);
  ::close(fd);
}

// Cases 3 and 6. Starts the daemon (after the in-process ranks ran, so this
// process has no gRPC state when it spawns them) and returns it running.
DaemonProc RunCase3(const std::string& self, const std::string& work, const std::string& ckptd_bin,
                    bool quick, bool keep, std::vector<Row>& rows) {
  // ---------------------------------------------------------------- case 3
  TensorSet set;
  set.count = 8;
  set.rows = quick ? 4096 : 8192;
  set.cols = set.rows;
  const int kRanks = 8;
  const Layout saved = TpLayout(set, 4);
  const Layout load = TpLayout(set, kRanks);
  const std::string ckpt = work + "/daemon-ckpt";
  std::printf("== case 3: 8 local ranks, %d F32 tensors [%lld, %lld] = %s, saved TP4, loaded TP8 "
              "==\n",
              set.count, static_cast<long long>(set.rows), static_cast<long long>(set.cols),
              Bytes(set.bytes()).c_str());
  RemoveTree(ckpt);
  WriteReport wr = Check(WriteCheckpoint(ckpt, saved), "writing the checkpoint");
  std::printf("  wrote %d files, %s in %.1f s, syncfs %.1f s\n", wr.files, Bytes(wr.bytes).c_str(),
              wr.write_s, wr.sync_s);
  uint64_t file_bytes = 0;
  double resident = WarmPageCache(ckpt, &file_bytes);
  std::printf("  page cache: %.1f%% of %s resident\n", 100 * resident, Bytes(file_bytes).c_str());
  Checkpoint c = Check(OpenCheckpoint(ckpt), "open");
  LoadPlan job_plan = Check(PlanLoad(c.metadata, load.ranks), "plan");
  const uint64_t unique = job_plan.bytes_to_read;
  const uint64_t deliver = job_plan.bytes_to_deliver();
  std::printf("  job plan: %zu reads, unique bytes to read %s, to deliver %s\n",
              job_plan.reads.size(), Bytes(unique).c_str(), Bytes(deliver).c_str());

  // Limits, measured again before every repetition below (the host is
  // shared and noisy); the table uses the medians.
  // (Buffers of 512 MiB: large against the caches, small against this VM's
  // host-backed memory; see docs/benchmarks.md.)
  MemcpyProbe memcpy_probe(std::min<uint64_t>(deliver, 512ull << 20));
  const uint64_t pread_size = std::min<uint64_t>(unique, 512ull << 20);
  Buffer pread_dst(pread_size);
  pread_dst.Touch();
  std::vector<double> memcpy2s, pread2s;
  auto measure_limits = [&] {
    memcpy2s.push_back(memcpy_probe.GBps(2, 3));
    pread2s.push_back(PreadPlanGBps(ckpt, job_plan, pread_dst.data(), 2, pread_size));
    return absl::StrCat("[limits now: memcpy 2thr ", static_cast<int>(memcpy2s.back() * 100) / 100.0,
                        " GB/s, pread 2thr ", static_cast<int>(pread2s.back() * 100) / 100.0,
                        " GB/s]");
  };
  measure_limits();
  std::printf("  limits: memcpy %.2f GB/s (2 threads), %.2f GB/s (1 thread); pread of the job's "
              "reads into faulted-in memory %.2f GB/s (2 threads)\n",
              memcpy2s.back(), memcpy_probe.GBps(1, 3), pread2s.back());

  ShmProbe(std::min<uint64_t>(deliver, 512ull << 20));

  // (c) in-process, before any gRPC channel exists in this process.
  const int reps = quick ? 1 : 2;
  std::vector<double> inproc_gbps;
  JobFigures inproc;
  for (int i = 0; i < reps; ++i) {
    const std::string lim = measure_limits();
    inproc = RunInProcess(self, work, ckpt, set, kRanks, /*verify=*/i == 0);
    inproc_gbps.push_back(GB(inproc.delivered) / inproc.wall_s);
    std::printf("  (c) 8 in-process ranks, rep %d: %.3f s, %.2f GB/s, read %s from storage "
                "(%.2fx unique); %s %s\n",
                i, inproc.wall_s, inproc_gbps.back(), Bytes(inproc.bytes_read).c_str(),
                static_cast<double>(inproc.bytes_read) / unique, inproc.detail.c_str(),
                lim.c_str());
  }

  // (a), (b) through the daemon.
  DaemonProc d = StartDaemon(ckptd_bin, work);
  std::printf("  started %s (pid %d), socket %s\n", ckptd_bin.c_str(), d.pid, d.socket.c_str());
  ProcMem idle = ReadProcMem(d.pid);
  RssSampler sampler(d.pid);
  std::vector<double> cold_gbps, warm_gbps;
  uint64_t cold_read = 0, warm_read = 0;
  double fault_s = 0;
  const int dreps = quick ? 2 : 3;
  for (int i = 0; i < dreps; ++i) {
    if (i > 0) Check(Connect(d.socket)->Evict(ckpt), "Evict");
    const std::string lim = measure_limits();
    std::printf("  daemon rep %d %s\n", i, lim.c_str());
    uint64_t before = DaemonStatus(d.socket).bytes_read_total();
    JobFigures cold = RunDaemonJob(d.socket, d.pid, absl::StrCat("bench-cold-", i), ckpt, load, i == 0);
    uint64_t mid = DaemonStatus(d.socket).bytes_read_total();
    JobFigures warm = RunDaemonJob(d.socket, d.pid, absl::StrCat("bench-warm-", i), ckpt, load, i == 0);
    uint64_t after = DaemonStatus(d.socket).bytes_read_total();
    cold_read = std::max(cold_read, mid - before);
    warm_read = std::max(warm_read, after - mid);
    cold_gbps.push_back(GB(cold.delivered) / cold.wall_s);
    warm_gbps.push_back(GB(warm.delivered) / warm.wall_s);
    fault_s = std::max({fault_s, cold.fault_s, warm.fault_s});
    std::printf("  (a) daemon cold, rep %d: %.3f s, %.2f GB/s, read %s from storage; %s\n", i,
                cold.wall_s, cold_gbps.back(), Bytes(mid - before).c_str(), cold.detail.c_str());
    std::printf("  (b) daemon warm, rep %d: %.3f s, %.2f GB/s, read %s from storage; %s\n", i,
                warm.wall_s, warm_gbps.back(), Bytes(after - mid).c_str(), warm.detail.c_str());
  }
  std::printf("  (each daemon rank got its %s arena from the daemon and faulted it in before the job, max %.3f s; not "
              "counted; checkpoint still %.1f%% in the page cache)\n",
              Bytes(deliver / kRanks).c_str(), fault_s, 100 * ResidentFraction(ckpt));
  sampler.Stop();
  const ProcMem peak = ReadProcMem(d.pid);
  const ProcMem sampled = sampler.max();
  const ckptd::v1::StatusResponse st = DaemonStatus(d.socket);
  const uint64_t cache = st.cache_bytes();
  // The ranks' arenas: client memory the daemon keeps mapped (lent, or free
  // for the next client), not the daemon's own.
  const uint64_t arenas = st.arena_leased_bytes() + st.arena_free_bytes();
  std::printf("== case 6: daemon memory during case 3 ==\n"
              "  idle after start: VmRSS %s. Peak: VmHWM %s; sampled peaks RssAnon %s, RssShmem %s "
              "(the ranks' arenas), RssFile %s; data cache now %s, arenas %s (%s free for the "
              "next clients)\n\n",
              Bytes(idle.vm_rss).c_str(), Bytes(peak.vm_hwm).c_str(),
              Bytes(sampled.rss_anon).c_str(), Bytes(sampled.rss_shmem).c_str(),
              Bytes(sampled.rss_file).c_str(), Bytes(cache).c_str(), Bytes(arenas).c_str(),
              Bytes(st.arena_free_bytes()).c_str());

  const double cold = Median(cold_gbps), warm = Median(warm_gbps), inp = Median(inproc_gbps);
  const double memcpy2 = Median(memcpy2s), pread2 = Median(pread2s);
  rows.push_back(MakeRow("3a daemon-cold-8ranks", cold, "GB/s", pread2, "pread->faulted 2thr"));
  {
    Row r = MakeRow("3b daemon-warm-8ranks", warm, "GB/s", memcpy2, "memcpy 2thr", ">=0.50");
    r.met = r.ratio >= 0.5 ? "yes" : "NO";
    rows.push_back(r);
  }
  rows.push_back(MakeRow("3c inprocess-8x1rank", inp, "GB/s", pread2, "pread->faulted 2thr"));
  {
    Row r = MakeRow("3b/3c warm-vs-inprocess", warm, "GB/s", inp, "3c in-process", ">=3.0");
    r.met = r.ratio >= 3.0 ? "yes" : "NO";
    rows.push_back(r);
    // A warm delivery is at best a memcpy of every delivered byte.
    std::printf("  ceiling of 3b/3c on this machine: memcpy 2thr / 3c = %.2f (3b reaches %.2f of "
                "it)\n\n",
                memcpy2 / inp, (warm / inp) / (memcpy2 / inp));
  }
  {
    Row r = MakeRow("3a bytes-read-daemon-cold", GB(cold_read), "GB", GB(unique), "unique bytes",
                    "=1.00");
    r.met = cold_read == unique ? "yes" : "NO";
    rows.push_back(r);
    r = MakeRow("3b bytes-read-daemon-warm", GB(warm_read), "GB", GB(unique), "unique bytes",
                "0 (cache)");
    r.met = warm_read == 0 ? "yes" : "NO";
    rows.push_back(r);
    rows.push_back(MakeRow("3c bytes-read-inprocess", GB(inproc.bytes_read), "GB", GB(unique),
                           "unique bytes"));
  }
  rows.push_back(MakeRow("6 daemon-peak-rss-minus-cache-arenas",
                         static_cast<double>(peak.vm_hwm - std::min(peak.vm_hwm, cache + arenas)) /
                             (1 << 20),
                         "MiB", static_cast<double>(cache) / (1 << 20), "data cache MiB"));
  if (!keep) {
    Check(Connect(d.socket)->Evict(ckpt), "Evict");
    RemoveTree(ckpt);
  }

  return d;
}

int Main(int argc, char** argv) {
  Args args(argc, argv);
  if (args.Has("worker")) return Worker(args);
  const std::string work = args.Get("dir", "/tmp/ckptd-bench");
  const std::string ckptd_bin = args.Get("ckptd");
  const bool quick = args.Has("quick");
  const std::string rows_path = args.Get("rows");
  const bool keep = args.Has("keep");
  char self_buf[4096];
  ssize_t sl = ::readlink("/proc/self/exe", self_buf, sizeof self_buf - 1);
  if (sl <= 0) Die("readlink /proc/self/exe");
  const std::string self(self_buf, static_cast<size_t>(sl));
  if (ckptd_bin.empty()) Die("--ckptd PATH is required");
  std::vector<Row> rows;
  const std::string cases = "," + args.Get("cases", "3,5") + ",";
  DaemonProc d = cases.find(",3,") != std::string::npos
                     ? RunCase3(self, work, ckptd_bin, quick, keep, rows)
                     : StartDaemon(ckptd_bin, work);
  if (cases.find(",5,") == std::string::npos) {
    StopDaemon(d, work);
    AppendRows(rows_path, rows);
    return 0;
  }


  // ---------------------------------------------------------------- case 5
  const int kSmall = 10000;
  const std::string small = work + "/small-ckpt";
  std::printf("== case 5: control plane, one Load of %d tensors of 1 KiB ==\n", kSmall);
  Layout one;
  one.world_size = 1;
  one.ranks.resize(1);
  for (int i = 0; i < kSmall; ++i) {
    TargetTensor t;
    t.name = absl::StrCat("small.", i, ".w");
    t.dtype = DType::kF32;
    t.global_shape = {256};
    t.box = Box{{0}, {256}};
    one.ranks[0].tensors.push_back(std::move(t));
  }
  RemoveTree(small);
  WriteReport swr = Check(WriteCheckpoint(small, one), "writing the small checkpoint");
  WarmPageCache(small, nullptr);
  std::printf("  wrote %s in %d file(s) in %.1f s\n", Bytes(swr.bytes).c_str(), swr.files,
              swr.write_s);
  // In-process reference: plan + execute (metadata already open).
  double ref_us = 0, open_us = 0;
  {
    auto t0 = Clock::now();
    Checkpoint sc = Check(OpenCheckpoint(small), "open small");
    open_us = SecondsSince(t0) * 1e6 / kSmall;
    Buffer dst(TargetsBytes(one.ranks[0]));
    dst.Touch();
    std::vector<std::vector<void*>> dests(1);
    for (int i = 0; i < kSmall; ++i) dests[0].push_back(dst.data() + 1024ull * i);
    std::vector<double> v;
    for (int i = 0; i < 5; ++i) {
      t0 = Clock::now();
      LoadPlan p = Check(PlanLoad(sc.metadata, one.ranks), "plan small");
      DirectorySource src(sc.dir);
      Check(ExecutePlan(p, src, dests), "load small");
      v.push_back(SecondsSince(t0) * 1e6 / kSmall);
    }
    ref_us = Median(v);
  }
  std::vector<double> per;
  double first_us = 0;
  std::string first_detail, last_detail;
  {
    auto client = Connect(d.socket);
    auto arena = Check(ckptd::ShmArena::Create(TargetsBytes(one.ranks[0]), "ckptd-bench"), "arena");
    TouchPages(arena->data(), arena->size());
    ckptd::LoadSpec spec;
    spec.rank = 0;
    spec.world_size = 1;
    spec.path = small;
    spec.arena = arena.get();
    for (int i = 0; i < kSmall; ++i) {
      const TargetTensor& t = one.ranks[0].tensors[i];
      ckptd::TensorSpec ts;
      ts.name = t.name;
      ts.dtype = t.dtype;
      ts.global_shape = t.global_shape;
      ts.box = t.box;
      ts.arena_offset = 1024ull * i;
      spec.tensors.push_back(std::move(ts));
    }
    const int n = quick ? 4 : 8;
    for (int i = 0; i < n; ++i) {
      spec.job_id = absl::StrCat("bench-small-", i);
      auto t0 = Clock::now();
      auto rep = client->Load(spec);
      const double us = SecondsSince(t0) * 1e6 / kSmall;
      if (!rep.ok()) Die("small load: " + rep.status().ToString());
      const auto& tm = rep->result.timings();
      char buf[256];
      std::snprintf(buf, sizeof buf,
                    "daemon total %.1f ms (list %.1f, plan %.1f, read %.1f, copy %.1f ms)",
                    tm.total_s() * 1e3, tm.list_s() * 1e3, tm.plan_s() * 1e3, tm.read_s() * 1e3,
                    tm.copy_s() * 1e3);
      if (i == 0) {
        first_us = us;
        first_detail = buf;
        uint64_t bad = 0;
        for (int k = 0; k < kSmall; ++k) {
          const TargetTensor& t = one.ranks[0].tensors[k];
          bad += VerifyTarget(t, SeedOf(t.name), arena->data() + 1024ull * k);
        }
        if (bad != 0) Die("small load delivered wrong data");
      } else {
        per.push_back(us);
        last_detail = buf;
      }
    }
  }
  const double warm_us = Median(per);
  std::printf("  first load (daemon opens the checkpoint, data from page cache): %.2f us/tensor; "
              "%s\n",
              first_us, first_detail.c_str());
  std::printf("  repeated loads (metadata + data cached), median: %.2f us/tensor; last: %s\n",
              warm_us, last_detail.c_str());
  std::printf("  in-process reference: OpenCheckpoint %.2f us/tensor once; plan + execute %.2f "
              "us/tensor\n\n",
              open_us, ref_us);
  {
    Row r = MakeRow("5 control-plane-10k-cached", warm_us, "us/tensor", ref_us,
                    "in-process plan+exec", "<20 us");
    r.met = warm_us < 20 ? "yes" : "NO";
    rows.push_back(r);
    r = MakeRow("5 control-plane-10k-first", first_us, "us/tensor", ref_us + open_us,
                "in-process open+plan+exec", "<20 us");
    r.met = first_us < 20 ? "yes" : "NO";
    rows.push_back(r);
  }
  StopDaemon(d, work);
  if (!keep) RemoveTree(small);
  AppendRows(rows_path, rows);
  return 0;
}

}  // namespace
}  // namespace ckpt::bench

int main(int argc, char** argv) { return ckpt::bench::Main(argc, argv); }
