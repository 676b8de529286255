// GPU benchmark (built with --config=cuda; skips without a device): GB/s of
// the daemon's delivery path, pinned host cache -> device memory, against a
// plain cudaMemcpy of the same bytes from pinned memory, measured in the
// same run, alternately (medians of 5). The delivery path is what a load
// runs: ExecutePlan over a warm data cache (page-locked by the GPU runtime's
// allocator) into device buffers through gpu::GpuRuntime::MakeDelivery
// (cudaMemcpyAsync / cudaMemcpy2DAsync on a stream per I/O thread).
//
// Cases: rows (each rank's box is whole rows: linear copies), cols (column
// halves: 2-D copies of 16 KiB rows), bf16->f32 (cast through pinned
// staging; informational). Target: rows and cols >= 0.8 of cudaMemcpy.
//   gpu_bench [--gib N] [--json FILE]      (GPU_BENCH_GIB also sets N)
// Exit 0: targets met (or skipped without a GPU); 1: below target.
#include <cuda_runtime_api.h>
#include <stdlib.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/cache/cache.h"
#include "core/format/checkpoint.h"
#include "core/exec/executor.h"
#include "core/write/writer.h"
#include "server/cuda/gpu.h"
#include "tests/gpu/gpu_testlib.h"

namespace ckpt::gputest {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

#define CHECK_OK(expr)                                                            \
  do {                                                                            \
    auto _s = (expr);                                                             \
    if (!_s.ok()) {                                                               \
      std::fprintf(stderr, "%s: %s\n", #expr, std::string(_s.message()).c_str()); \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

// Tensor `name` ([rows, cols] of `dt`) as saved by 4 ranks split along dim 0.
void Save(const std::string& name, DType dt, int64_t rows, int64_t cols,
          std::vector<RankTargets>* ranks) {
  for (int r = 0; r < 4; ++r) {
    if (ranks->size() <= static_cast<size_t>(r)) ranks->push_back(RankTargets{r, {}});
    (*ranks)[r].tensors.push_back(
        TargetTensor{name, dt, {rows, cols}, Box{{r * rows / 4, 0}, {rows / 4, cols}}, std::nullopt});
  }
}

struct Case {
  std::string name;
  std::vector<RankTargets> load;
  bool gated;
};

int Main(int argc, char** argv) {
  std::string why;
  if (!HaveGpu(&why)) {
    std::printf("SKIP: %s\n", why.c_str());
    return 0;
  }
  double gib = 2;
  if (const char* e = std::getenv("GPU_BENCH_GIB")) gib = std::atof(e);
  std::string json;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--gib") gib = std::atof(argv[i + 1]);
    if (std::string(argv[i]) == "--json") json = argv[i + 1];
  }
  cudaSetDevice(0);
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  // The checkpoint (about 1.5x `gib`) goes to /dev/shm where it fits with
  // room to spare (else /tmp); neither with room: say so, do not fill it.
  const uint64_t need = static_cast<uint64_t>(gib * 1.5 * (1ull << 30)) + (256ull << 20);
  auto free_bytes = [](const char* d) -> uint64_t {
    struct statvfs v;
    if (access(d, W_OK) != 0 || statvfs(d, &v) != 0) return 0;
    return static_cast<uint64_t>(v.f_bavail) * v.f_frsize;
  };
  std::string base = free_bytes("/dev/shm") >= need ? "/dev/shm" : "/tmp";
  if (free_bytes(base.c_str()) < need) {
    std::fprintf(stderr, "gpu_bench: needs %.1f GiB free in /dev/shm or /tmp (have %.1f, %.1f GiB); "
                 "pass a smaller --gib\n", need / double(1ull << 30),
                 free_bytes("/dev/shm") / double(1ull << 30), free_bytes("/tmp") / double(1ull << 30));
    return 1;
  }
  std::string dir = base + "/ckptd-gpu-bench-" + std::to_string(getpid());
  CHECK_OK(MakeDirs(dir));

  // W: F32 [rows, 8192] of `gib` GiB; Wb: BF16 [rows / 4, 8192].
  const int64_t cols = 8192;
  const int64_t rows = std::max<int64_t>(64, static_cast<int64_t>(gib * (1ull << 30)) / (cols * 4) / 64 * 64);
  const int64_t brows = rows / 4;
  std::vector<uint8_t> w(rows * cols * 4), wb(brows * cols * 2);
  for (size_t i = 0; i < w.size() / 4; ++i) {
    float f = static_cast<float>(i % 65536) * 0.5f;
    std::memcpy(&w[4 * i], &f, 4);
  }
  for (size_t i = 0; i < wb.size(); ++i) wb[i] = static_cast<uint8_t>(i * 7) & 0x3f;
  std::vector<RankTargets> save_ranks;
  std::vector<std::pair<std::string, ShardMeta>> written;
  Save("W", DType::kF32, rows, cols, &save_ranks);
  Save("Wb", DType::kBF16, brows, cols, &save_ranks);
  const double tw = Now();
  auto sp = PlanSave(save_ranks, 4, 0);
  CHECK_OK(sp.status());
  for (int r = 0; r < 4; ++r) {
    std::vector<const void*> data;
    for (const TargetTensor& t : sp->writes[r]) {
      const bool f32 = t.name == "W";
      const uint8_t* b = f32 ? w.data() : wb.data();
      data.push_back(b + t.box.offset[0] * cols * (f32 ? 4 : 2));
    }
    auto shards = WriteRankFile(dir, *sp, r, data);
    CHECK_OK(shards.status());
    written.insert(written.end(), shards->begin(), shards->end());
  }
  CHECK_OK(FinishSave(dir, *sp, written));
  std::printf("checkpoint: %s, W f32 [%lld, %lld] (%.2f GiB) + Wb bf16 [%lld, %lld], written in %.1fs\n",
              dir.c_str(), static_cast<long long>(rows), static_cast<long long>(cols),
              w.size() / double(1ull << 30), static_cast<long long>(brows),
              static_cast<long long>(cols), Now() - tw);
  w.clear();
  w.shrink_to_fit();

  auto ck = OpenCheckpoint(dir);
  CHECK_OK(ck.status());
  std::map<std::string, FileStamp> stamps;
  for (const auto& f : ck->data_files) stamps[f] = *StatFile(dir + "/" + f);
  auto gpu = ckptd::gpu::CreateGpuRuntime({});
  HostCache cache(static_cast<uint64_t>(gib * 1.5 * (1ull << 30)) + (1ull << 30),
                  gpu->host_allocator());

  std::vector<Case> cases(3);
  cases[0].name = "rows (linear copies)";
  cases[1].name = "cols (2-D, 16 KiB rows)";
  cases[2].name = "bf16->f32 cast (staged)";
  cases[0].gated = cases[1].gated = true;
  cases[2].gated = false;
  for (int r = 0; r < 4; ++r) {
    cases[0].load.push_back(RankTargets{
        r, {TargetTensor{"W", DType::kF32, {rows, cols}, Box{{r * rows / 4, 0}, {rows / 4, cols}}, std::nullopt}}});
  }
  for (int r = 0; r < 2; ++r) {
    cases[1].load.push_back(RankTargets{
        r, {TargetTensor{"W", DType::kF32, {rows, cols}, Box{{0, r * cols / 2}, {rows, cols / 2}}, std::nullopt}}});
    cases[2].load.push_back(RankTargets{
        r, {TargetTensor{"Wb", DType::kF32, {brows, cols}, Box{{0, r * cols / 2}, {brows, cols / 2}}, std::nullopt}}});
  }

  int failed = 0;
  std::string json_out = "[";
  std::printf("device 0: %s\n%-26s %10s %10s %8s %s\n", prop.name, "case", "GB/s", "memcpy", "ratio",
              "target");
  for (const Case& c : cases) {
    PlanOptions po;
    auto plan = PlanLoad(ck->metadata, c.load, po);
    CHECK_OK(plan.status());
    const uint64_t bytes = plan->bytes_to_deliver();
    std::vector<void*> dev(c.load.size());
    std::vector<ckptd::gpu::RankDestination> dests(c.load.size());
    for (size_t r = 0; r < c.load.size(); ++r) {
      const uint64_t n = plan->ranks[r].targets[0].num_bytes();
      if (cudaMalloc(&dev[r], n) != cudaSuccess) return 1;
      dests[r].device =
          ckptd::gpu::WrapDevicePointers({{0, static_cast<uint8_t*>(dev[r]), n}});
      dests[r].device_targets.push_back({0, 0});
    }
    void* pinned = nullptr;
    void* dst = nullptr;
    if (cudaMallocHost(&pinned, bytes) != cudaSuccess || cudaMalloc(&dst, bytes) != cudaSuccess) {
      std::fprintf(stderr, "out of memory for the baseline\n");
      return 1;
    }
    std::memset(pinned, 1, bytes);
    ExecuteOptions eo;
    eo.threads = 4;
    eo.verify_checksums = false;
    {  // warm the cache (reads from storage, not timed); only verified
       // bytes are kept in the cache, so this pass checks the checksums
      ExecuteOptions warm = eo;
      warm.verify_checksums = true;
      auto d = gpu->MakeDelivery(dests);
      CachingSource src(dir, &cache, stamps);
      CHECK_OK(ExecutePlan(*plan, src, **d, warm).status());
    }
    std::vector<double> path_gbps, memcpy_gbps;
    for (int it = 0; it < 5; ++it) {
      auto d = gpu->MakeDelivery(dests);
      CachingSource src(dir, &cache, stamps);
      double t0 = Now();
      auto st = ExecutePlan(*plan, src, **d, eo);
      double t1 = Now();
      CHECK_OK(st.status());
      if (st->bytes_read != 0) {
        // A figure that includes storage reads is not the delivery path's.
        std::fprintf(stderr, "gpu_bench: %llu bytes not from the cache (it should hold them)\n",
                     static_cast<unsigned long long>(st->bytes_read));
        return 1;
      }
      path_gbps.push_back(bytes / (t1 - t0) / 1e9);
      t0 = Now();
      cudaMemcpy(dst, pinned, bytes, cudaMemcpyHostToDevice);
      cudaDeviceSynchronize();
      t1 = Now();
      memcpy_gbps.push_back(bytes / (t1 - t0) / 1e9);
    }
    const double p = Median(path_gbps), m = Median(memcpy_gbps), ratio = p / m;
    const bool ok = !c.gated || ratio >= 0.8;
    failed += ok ? 0 : 1;
    std::printf("%-26s %10.2f %10.2f %8.2f %s\n", c.name.c_str(), p, m, ratio,
                c.gated ? (ok ? ">= 0.8 ok" : "< 0.8 BELOW TARGET") : "(info)");
    json_out += std::string(json_out.size() > 1 ? "," : "") + "{\"case\": \"" + c.name +
                "\", \"bytes\": " + std::to_string(bytes) + ", \"figure_gbps\": " +
                std::to_string(p) + ", \"limit_gbps\": " + std::to_string(m) +
                ", \"ratio\": " + std::to_string(ratio) + "}";
    cudaFreeHost(pinned);
    cudaFree(dst);
    for (void* d : dev) cudaFree(d);
  }
  json_out += "]";
  std::printf("pinned cache bytes: %llu; %s\n",
              static_cast<unsigned long long>(gpu->pinned_bytes()), gpu->Describe().c_str());
  if (!json.empty()) std::ofstream(json) << json_out << "\n";
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return failed ? 1 : 0;
}

}  // namespace
}  // namespace ckpt::gputest

int main(int argc, char** argv) { return ckpt::gputest::Main(argc, argv); }
