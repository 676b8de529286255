// planner_bench — case 4 of bench/run: ckpt::PlanLoad for 100,000 shards and
// 1,024 ranks; wall time and peak memory.
//
// Metadata (built in memory, no files): 3,125 BF16 tensors of [4096, 4096]
// (1 MiB per shard), each saved as 32 row shards by 32 ranks (FSDP-like, one
// file per saving rank, one checksum per shard): 100,000 shards.
// Loading job: 1,024 ranks = pipeline 16 x data parallel 8 x tensor
// parallel 8. Stage p holds tensors [p*T/16, (p+1)*T/16); each of its ranks
// wants its 1/8 tensor-parallel slice of every tensor of the stage; the 8
// data-parallel replicas want the same slices. Two variants:
//   mixed:     even tensors split along axis 0 (column-parallel), odd along
//              axis 1 (row-parallel), as in Megatron: an axis-1 slice crosses
//              all 32 saved row shards, in 128 strided rows each;
//   same-axis: every tensor split along axis 0 (each slice covers 4 shards).
// Figure: PlanLoad wall time; peak memory = VmHWM during PlanLoad minus RSS
// before it (VmHWM reset with /proc/self/clear_refs). Each variant runs in
// its own process (this binary, --variant) so peaks do not mix.
//
// Usage: planner_bench [--rows FILE] [--variant mixed|same-axis]
#include <malloc.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/bench_util.h"
#include "core/format/metadata.h"
#include "core/plan/planner.h"

extern char** environ;

namespace ckpt::bench {
namespace {

constexpr int kTensors = 3125;
constexpr int kShardsPerTensor = 32;
constexpr int64_t kDim = 4096;
constexpr int kPP = 16, kDP = 8, kTP = 8;

CheckpointMetadata BuildMetadata() {
  CheckpointMetadata m;
  m.unique_id = 0;
  std::vector<uint64_t> file_pos(kShardsPerTensor, 4096);
  const int64_t rows = kDim / kShardsPerTensor;
  for (int t = 0; t < kTensors; ++t) {
    TensorMeta tm;
    tm.dtype = DType::kBF16;
    tm.global_shape = {kDim, kDim};
    for (int s = 0; s < kShardsPerTensor; ++s) {
      ShardMeta sm;
      sm.file = absl::StrCat(s, "_0.safetensors");
      sm.box = Box{{s * rows, 0}, {rows, kDim}};
      sm.dtype = DType::kBF16;
      sm.nbytes = static_cast<uint64_t>(rows * kDim * 2);
      sm.data_offset = file_pos[s];
      file_pos[s] += sm.nbytes;
      sm.xxh3 = {0x1234567890abcdefull ^ (uint64_t(t) << 8) ^ uint64_t(s)};
      tm.shards.push_back(std::move(sm));
    }
    m.tensors[absl::StrCat("model.layers.", t, ".w")] = std::move(tm);
  }
  return m;
}

std::vector<RankTargets> BuildRanks(bool mixed, int dp_count = kDP) {
  std::vector<RankTargets> ranks;
  const int per_stage = (kTensors + kPP - 1) / kPP;
  for (int pp = 0; pp < kPP; ++pp) {
    for (int dp = 0; dp < dp_count; ++dp) {
      for (int tp = 0; tp < kTP; ++tp) {
        RankTargets rt;
        rt.rank = (pp * kDP + dp) * kTP + tp;
        for (int t = pp * per_stage; t < std::min(kTensors, (pp + 1) * per_stage); ++t) {
          TargetTensor tt;
          tt.name = absl::StrCat("model.layers.", t, ".w");
          tt.dtype = DType::kBF16;
          tt.global_shape = {kDim, kDim};
          const int axis = mixed ? t % 2 : 0;
          tt.box = Box{{0, 0}, {kDim, kDim}};
          tt.box.offset[axis] = tp * (kDim / kTP);
          tt.box.shape[axis] = kDim / kTP;
          rt.tensors.push_back(std::move(tt));
        }
        ranks.push_back(std::move(rt));
      }
    }
  }
  return ranks;
}

int RunVariant(const std::string& variant, const std::string& rows_path) {
  const bool mixed = variant == "mixed";
  CheckpointMetadata meta = BuildMetadata();
  std::vector<RankTargets> ranks = BuildRanks(mixed);
  size_t targets = 0;
  for (const auto& r : ranks) targets += r.tensors.size();
  malloc_trim(0);
  const ProcMem before = ReadProcMem(0);
  const bool reset = ResetPeakRss();
  auto t0 = Clock::now();
  auto plan = PlanLoad(meta, ranks);
  const double secs = SecondsSince(t0);
  const ProcMem after = ReadProcMem(0);
  if (!plan.ok()) {
    std::fprintf(stderr, "planner_bench: %s\n", plan.status().ToString().c_str());
    return 1;
  }
  size_t copies = 0;
  for (const auto& r : plan->ranks) copies += r.copies.size();
  const uint64_t peak = after.vm_hwm > before.vm_rss ? after.vm_hwm - before.vm_rss : 0;
  const uint64_t held = after.vm_rss > before.vm_rss ? after.vm_rss - before.vm_rss : 0;
  std::printf("  %-9s: %d shards, %zu ranks, %zu targets -> %zu copies, %zu reads; PlanLoad %.2f s, "
              "peak +%s (%s held by the plan)%s\n",
              variant.c_str(), kTensors * kShardsPerTensor, ranks.size(), targets, copies,
              plan->reads.size(), secs, Bytes(peak).c_str(), Bytes(held).c_str(),
              reset ? "" : " [VmHWM could not be reset: peak includes set-up]");
  std::fflush(stdout);
  std::vector<Row> rows;
  Row r;
  r.name = "4 planner-" + variant + "-time";
  r.figure = secs;
  r.unit = "s";
  r.limit = 2.0;
  r.limit_what = "the target; no hw limit";
  r.ratio = secs / 2.0;
  r.target = "<2 s";
  r.met = secs < 2.0 ? "yes" : "NO";
  rows.push_back(r);
  r.name = "4 planner-" + variant + "-peak-mem";
  r.figure = static_cast<double>(peak) / (1 << 20);
  r.unit = "MiB";
  r.limit = 1024;
  r.limit_what = "the target; no hw limit";
  r.ratio = r.figure / 1024;
  r.target = "<1 GiB";
  r.met = peak < (1ull << 30) ? "yes" : "NO";
  rows.push_back(r);
  AppendRows(rows_path, rows);
  if (!mixed) return 0;

  // What-if for the analysis: the 8 data-parallel replicas of a slice want
  // identical copies; a planner that plans each distinct target set once
  // would plan only the 128 ranks with dp = 0.
  plan = absl::InternalError("freed");
  malloc_trim(0);
  std::vector<RankTargets> distinct = BuildRanks(mixed, 1);
  const ProcMem before2 = ReadProcMem(0);
  ResetPeakRss();
  t0 = Clock::now();
  auto plan2 = PlanLoad(meta, distinct);
  const double secs2 = SecondsSince(t0);
  const ProcMem after2 = ReadProcMem(0);
  if (!plan2.ok()) return 1;
  std::printf("  what-if (not ckptd code): the %zu distinct target sets only (one per data-parallel "
              "group): PlanLoad %.2f s, peak +%s\n",
              distinct.size(), secs2,
              Bytes(after2.vm_hwm > before2.vm_rss ? after2.vm_hwm - before2.vm_rss : 0).c_str());
  return 0;
}

int Main(int argc, char** argv) {
  Args args(argc, argv);
  const std::string rows = args.Get("rows");
  const std::string variant = args.Get("variant");
  if (!variant.empty()) return RunVariant(variant, rows);
  std::printf("== case 4: planner, %d tensors x %d row shards = %d shards, %d ranks (PP%d x DP%d x "
              "TP%d) ==\n",
              kTensors, kShardsPerTensor, kTensors * kShardsPerTensor, kPP * kDP * kTP, kPP, kDP,
              kTP);
  std::fflush(stdout);
  char self[4096];
  ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return 1;
  self[n] = 0;
  for (const char* v : {"same-axis", "mixed"}) {
    std::vector<std::string> argv_s = {self, std::string("--variant=") + v};
    if (!rows.empty()) argv_s.push_back("--rows=" + rows);
    std::vector<char*> cargv;
    for (auto& s : argv_s) cargv.push_back(s.data());
    cargv.push_back(nullptr);
    pid_t pid;
    if (posix_spawn(&pid, self, nullptr, nullptr, cargv.data(), environ) != 0) return 1;
    int st = 0;
    ::waitpid(pid, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      std::fprintf(stderr, "planner_bench: variant %s failed\n", v);
      return 1;
    }
  }
  std::printf("\n");
  return 0;
}

}  // namespace
}  // namespace ckpt::bench

int main(int argc, char** argv) { return ckpt::bench::Main(argc, argv); }
