// load_bench — case 2 of bench/run: an offline (in-process) resharding load of
// a checkpoint held in the page cache, against pread of the same bytes.
//
// The checkpoint (~4.3 GB; 0.5 GB with --quick) is written with core's save
// API as if 8 ranks had saved it with tensor parallelism 8 (even tensors split
// along axis 0, odd ones along axis 1), synced to disk and read once so it
// sits in the page cache. It is then loaded for tensor parallelism 4 (every
// rank of the layout, in one process, as `ckptctl load` does): each rank's
// slice of an axis-1 tensor gathers 4 KiB runs from two saved shards.
//
// Figure: destination bytes / wall time of OpenCheckpoint + PlanLoad +
// ExecutePlan (DirectorySource, 2 threads, checksums verified) into
// destinations already faulted in (a training process's tensors exist before
// it loads). Limit: pread of exactly the planned byte ranges, handed to 2
// threads from one queue, into the same faulted-in memory. The two are
// measured alternately. Also reported: the same load through LoadOffline
// (what `ckptctl load` runs), which allocates fresh buffers and so includes
// their fault-in; the fault-in of fresh memory alone; and the checksum cost.
//
// Usage: load_bench --dir WORKDIR [--rows FILE] [--quick] [--reps N] [--keep]

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "core/format/checkpoint.h"
#include "core/exec/executor.h"
#include "core/io/file.h"
#include "core/tools/offline.h"
#include "core/format/safetensors.h"

namespace ckpt::bench {
namespace {

struct EngineRun {
  double open_s = 0, plan_s = 0, exec_s = 0, wall_s = 0;
  LoadStats stats;
};

// Open + plan + execute into `dests` (faulted-in memory).
EngineRun RunEngine(const std::string& dir, const Layout& layout,
                    const std::vector<std::vector<void*>>& dests, bool verify, int threads,
                    DirectIo direct_io = DirectIo::kNever) {
  EngineRun r;
  auto t0 = Clock::now();
  auto c = OpenCheckpoint(dir);
  if (!c.ok()) {
    std::fprintf(stderr, "load_bench: %s\n", c.status().ToString().c_str());
    std::exit(1);
  }
  auto t1 = Clock::now();
  auto plan = PlanLoad(c->metadata, layout.ranks);
  if (!plan.ok()) {
    std::fprintf(stderr, "load_bench: %s\n", plan.status().ToString().c_str());
    std::exit(1);
  }
  auto t2 = Clock::now();
  DirectorySource source(c->dir);
  ExecuteOptions eo;
  eo.threads = threads;
  eo.verify_checksums = verify;
  eo.direct_io = direct_io;
  auto stats = ExecutePlan(*plan, source, dests, eo);
  if (!stats.ok()) {
    std::fprintf(stderr, "load_bench: %s\n", stats.status().ToString().c_str());
    std::exit(1);
  }
  auto t3 = Clock::now();
  r.open_s = Seconds(t0, t1);
  r.plan_s = Seconds(t1, t2);
  r.exec_s = Seconds(t2, t3);
  r.wall_s = Seconds(t0, t3);
  r.stats = *stats;
  return r;
}

// XXH3 throughput over a buffer much larger than the caches (as a cache
// verifies a 64 MiB read) and over one that stays in L2 (as the executor's
// piece-wise reads hash).
void ChecksumProbe() {
  Buffer big(64u << 20);
  big.Touch(0x3c);
  std::vector<double> v;
  uint64_t sink = 0;
  for (int i = 0; i < 5; ++i) {
    std::memset(big.data(), i, big.size());  // just written, as after a pread
    auto t0 = Clock::now();
    sink += Checksum(big.data(), big.size());
    v.push_back(GB(big.size()) / SecondsSince(t0));
  }
  std::vector<double> w;
  for (int i = 0; i < 5; ++i) {
    auto t0 = Clock::now();
    for (int k = 0; k < 256; ++k) sink += Checksum(big.data(), 256u << 10);
    w.push_back(GB(256ull << 18) / SecondsSince(t0));
  }
  std::printf("  XXH3 (1 thread): %.1f GB/s over 64 MiB just written (DRAM), %.1f GB/s over "
              "256 KiB (L2)%s\n",
              Median(v), Median(w), sink == 42 ? " " : "");
}

int Main(int argc, char** argv) {
  Args args(argc, argv);
  const std::string work = args.Get("dir", "/tmp/ckptd-bench");
  const bool quick = args.Has("quick");
  const int reps = static_cast<int>(args.Int("reps", quick ? 2 : 3));
  const int threads = 2;
  TensorSet set;
  set.count = quick ? 8 : 16;
  set.rows = quick ? 4096 : 8192;
  set.cols = set.rows;
  const Layout saved = TpLayout(set, 8);
  const Layout load = TpLayout(set, 4);
  const std::string dir = work + "/offline-ckpt";

  std::printf("== case 2: offline load (in-process), %d F32 tensors [%lld, %lld] = %s, saved "
              "TP8, loaded TP4 ==\n",
              set.count, static_cast<long long>(set.rows), static_cast<long long>(set.cols),
              Bytes(set.bytes()).c_str());
  RemoveTree(dir);
  auto wr = WriteCheckpoint(dir, saved);
  if (!wr.ok()) {
    std::fprintf(stderr, "load_bench: writing the checkpoint: %s\n", wr.status().ToString().c_str());
    return 1;
  }
  std::printf("  wrote %d files, %s in %.1f s (generate + write), syncfs %.1f s\n", wr->files,
              Bytes(wr->bytes).c_str(), wr->write_s, wr->sync_s);
  uint64_t file_bytes = 0;
  const double resident = WarmPageCache(dir, &file_bytes);
  std::printf("  page cache: %.1f%% of %s resident after one read pass\n", 100 * resident,
              Bytes(file_bytes).c_str());

  // The plan once, for the pread limit and the destination sizes.
  auto ckpt = OpenCheckpoint(dir);
  if (!ckpt.ok()) return 1;
  auto plan = PlanLoad(ckpt->metadata, load.ranks);
  if (!plan.ok()) return 1;
  const uint64_t deliver = plan->bytes_to_deliver();
  std::printf("  plan: %zu reads, %s to read, %s to deliver to %d ranks\n", plan->reads.size(),
              Bytes(plan->bytes_to_read).c_str(), Bytes(deliver).c_str(), load.world_size);

  // Destinations: one faulted-in arena, carved per rank and target.
  // (Room for the reads widened to 4 KiB for the O_DIRECT limit too.)
  Buffer arena(std::max(deliver, plan->bytes_to_read + (plan->reads.size() + 1) * 8192));
  const double fault_s = arena.Touch();
  std::vector<std::vector<void*>> dests(load.ranks.size());
  {
    uint64_t pos = 0;
    for (size_t r = 0; r < load.ranks.size(); ++r) {
      for (const TargetTensor& t : load.ranks[r].tensors) {
        dests[r].push_back(arena.data() + pos);
        pos += t.num_bytes();
      }
    }
  }
  std::printf("  fault-in of the %s destination arena (first touch, 1 thread): %.2f s = %.2f GB/s "
              "(not counted below)\n",
              Bytes(arena.size()).c_str(), fault_s, GB(arena.size()) / fault_s);

  std::vector<double> fig, lim;
  EngineRun last;
  for (int i = 0; i < reps; ++i) {
    lim.push_back(PreadPlanGBps(dir, *plan, arena.data(), threads));
    last = RunEngine(dir, load, dests, /*verify=*/true, threads);
    fig.push_back(GB(last.stats.bytes_delivered) / last.wall_s);
    if (i == 0) {
      uint64_t bad = 0;
      for (size_t r = 0; r < load.ranks.size(); ++r) {
        for (size_t t = 0; t < load.ranks[r].tensors.size(); ++t) {
          const TargetTensor& tt = load.ranks[r].tensors[t];
          bad += VerifyTarget(tt, SeedOf(tt.name), dests[r][t]);
        }
      }
      if (bad != 0 || last.stats.bytes_delivered != deliver) {
        std::fprintf(stderr, "load_bench: loaded data is wrong (%llu bad elements)\n",
                     static_cast<unsigned long long>(bad));
        return 1;
      }
      std::printf("  verified every delivered element against the generator\n");
    }
    std::printf("  rep %d: pread limit %.2f GB/s; engine %.2f GB/s (open %.3f s, plan %.3f s, "
                "execute %.3f s; thread-seconds read+verify %.3f, copy %.3f)\n",
                i, lim.back(), fig.back(), last.open_s, last.plan_s, last.exec_s,
                last.stats.read_seconds, last.stats.copy_seconds);
  }
  const double figure = Median(fig), limit = Median(lim);

  // Checksum cost: the same load without verification.
  EngineRun nv = RunEngine(dir, load, dests, /*verify=*/false, threads);
  const double nv_gbps = GB(nv.stats.bytes_delivered) / nv.wall_s;
  std::printf("  without checksum verification: %.2f GB/s (execute %.3f s; thread-seconds read "
              "%.3f, copy %.3f)\n",
              nv_gbps, nv.exec_s, nv.stats.read_seconds, nv.stats.copy_seconds);
  // One thread each, for the scaling picture.
  const double lim1 = PreadPlanGBps(dir, *plan, arena.data(), 1);
  EngineRun one = RunEngine(dir, load, dests, /*verify=*/true, 1);
  const double one_gbps = GB(one.stats.bytes_delivered) / one.wall_s;
  std::printf("  1 thread: pread limit %.2f GB/s, engine %.2f GB/s (ratio %.2f; read+verify "
              "%.3f s, copy %.3f s)\n",
              lim1, one_gbps, one_gbps / lim1, one.stats.read_seconds, one.stats.copy_seconds);

  ChecksumProbe();

  // From storage: the checkpoint dropped from the page cache before every
  // run. Limit: O_DIRECT reads of the planned ranges (the device), 4 MiB
  // requests, as many in flight as the engine's direct reads keep (2 per
  // I/O thread).
  double storage_buffered = 0, storage_direct = 0, storage_limit = 0;
  {
    std::vector<double> lb, fb, fd;
    uint64_t direct_bytes = 0;
    double left = 0;
    const int storage_reps = quick ? 1 : 2;
    for (int i = 0; i < storage_reps; ++i) {
      left = std::max(left, DropPageCache(dir));
      // Two requests in flight per I/O thread, as the engine keeps.
      lb.push_back(DirectPreadPlanGBps(dir, *plan, arena.data(), 2 * threads));
      left = std::max(left, DropPageCache(dir));
      EngineRun b = RunEngine(dir, load, dests, true, threads, DirectIo::kNever);
      fb.push_back(GB(b.stats.bytes_delivered) / b.wall_s);
      left = std::max(left, DropPageCache(dir));
      EngineRun d = RunEngine(dir, load, dests, true, threads, DirectIo::kAuto);
      fd.push_back(GB(d.stats.bytes_delivered) / d.wall_s);
      direct_bytes = d.stats.bytes_read_direct;
    }
    storage_limit = Median(lb);
    storage_buffered = Median(fb);
    storage_direct = Median(fd);
    std::printf("  from storage (page cache dropped before each run, at most %.1f%% left): O_DIRECT "
                "pread of the planned ranges %.2f GB/s; engine through the page cache %.2f GB/s "
                "(ratio %.2f); engine with direct_io=auto %.2f GB/s (ratio %.2f; %s read around "
                "the page cache)\n",
                100 * left, storage_limit, storage_buffered, storage_buffered / storage_limit,
                storage_direct, storage_direct / storage_limit, Bytes(direct_bytes).c_str());
    WarmPageCache(dir, nullptr);
  }

  // What `ckptctl load` runs: LoadOffline, fresh buffers (faulted in during
  // the load). The arena is released first: on this VM guest memory that the
  // host has not backed yet (or took back through free page reporting) costs
  // ~12 us per 4 KiB page on first touch (0.35 GB/s, see docs/benchmarks.md), so
  // LoadOffline gets the pages just freed, which fault in at the ordinary rate.
  const uint64_t arena_bytes = arena.size();
  arena = Buffer();
  dests.clear();
  double e2e_gbps = 0;
  {
    OfflineLoadOptions lo;
    lo.threads = threads;
    const uint64_t f0 = MinorFaults(0);
    auto t0 = Clock::now();
    auto res = LoadOffline(dir, load, lo);
    const double wall = SecondsSince(t0);
    const uint64_t faults = MinorFaults(0) - f0;
    if (!res.ok()) {
      std::fprintf(stderr, "load_bench: LoadOffline: %s\n", res.status().ToString().c_str());
      return 1;
    }
    e2e_gbps = GB(res->stats.bytes_delivered) / wall;
    std::printf("  LoadOffline (fresh std::vector buffers): %.2f GB/s (open %.3f s, plan %.3f s, "
                "load %.3f s incl. allocating + zeroing %s of buffers; %llu page faults)\n",
                e2e_gbps, res->times.open_seconds, res->times.plan_seconds,
                res->times.load_seconds, Bytes(deliver).c_str(),
                static_cast<unsigned long long>(faults));
  }
  {
    Buffer fresh(std::min<uint64_t>(arena_bytes, 1ull << 30));
    const double s = fresh.Touch();
    std::printf("  now: first touch of fresh memory %.2f GB/s; checkpoint %.1f%% resident in the "
                "page cache\n",
                GB(fresh.size()) / s, 100 * ResidentFraction(dir));
  }

  std::vector<Row> rows;
  {
    Row r;
    r.name = "2 offline-load";
    r.figure = figure;
    r.unit = "GB/s";
    r.limit = limit;
    r.limit_what = "pread->faulted 2thr";
    r.ratio = figure / limit;
    r.target = ">=0.70";
    r.met = r.ratio >= 0.70 ? "yes" : "NO";
    rows.push_back(r);
    r.name = "2 offline-load-LoadOffline";
    r.figure = e2e_gbps;
    r.ratio = e2e_gbps / limit;
    r.target = "(fresh buffers)";
    r.met = "-";
    rows.push_back(r);
    r.name = "2 offline-load-storage-buffered";
    r.figure = storage_buffered;
    r.limit = storage_limit;
    r.limit_what = "O_DIRECT pread QD4";
    r.ratio = storage_buffered / storage_limit;
    r.target = "(page cache dropped)";
    rows.push_back(r);
    r.name = "2 offline-load-storage-direct";
    r.figure = storage_direct;
    r.ratio = storage_direct / storage_limit;
    r.target = "(direct_io=auto)";
    rows.push_back(r);
  }
  AppendRows(args.Get("rows"), rows);
  std::printf("  => figure %.2f GB/s, pread limit %.2f GB/s, ratio %.2f (target >= 0.70)\n\n",
              figure, limit, figure / limit);
  if (!args.Has("keep")) RemoveTree(dir);
  return 0;
}

}  // namespace
}  // namespace ckpt::bench

int main(int argc, char** argv) { return ckpt::bench::Main(argc, argv); }
