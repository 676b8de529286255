// copy_bench — ckpt::CopyRegion against the machine's memcpy, measured in the
// same run.
//
// Each case copies one region of a row-major tensor from a source shard into a
// destination shard whose box differs (a real reshard), on one thread. The
// "limit" of a case is memcpy of the same number of destination bytes between
// the same two buffers. Both buffers are allocated page-aligned and faulted in
// (written) before anything is timed, so no page fault is counted as copy time.
// Each measurement is repeated; the table reports medians, with the copy and
// its memcpy limit measured alternately so that host noise hits both alike.
//
// GB/s = 10^9 bytes of destination written per second. For the BF16 -> F32
// cast the destination (F32) bytes are counted and the limit is memcpy of that
// many bytes.
//
// Then short rows into another process's memory (ckpt::ProcessMemory::Write,
// process_vm_writev, with this process as the other: the path a load takes
// to a rank that reads no cache view): 4 MiB in rows of 64, 512 and 2048
// bytes, 4 KiB apart in the source, back to back in the destination, against
// the same call with one iovec per row (what it made before it gathered short
// rows) and memcpy of the 4 MiB.
//
// Usage: copy_bench [--json=FILE] [--reps=N] [--quick] [--rows=FILE]
//   --quick: 5 runs per case instead of 15; --rows: append the cases to the
//   suite's table (bench/run), with the target (>= 0.85 of memcpy for runs of
//   4 KiB and more) marked.
#include <immintrin.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "core/base/box.h"
#include "core/exec/copy.h"
#include "core/exec/process_memory.h"
#include "core/base/dtype.h"

namespace ckpt {
namespace {

constexpr size_t kSrcBytes = size_t{512} << 20;  // largest source shard
constexpr size_t kDstBytes = size_t{256} << 20;  // largest destination shard

struct Case {
  std::string name;
  std::string what;  // one-line description for the table
  StoredLayout src;
  StoredLayout dst;
  Box region;
};

struct Result {
  std::string name;
  std::string what;
  uint64_t dst_bytes = 0;
  int64_t runs = 0;
  uint64_t run_bytes = 0;
  double figure_gbps = 0;
  double limit_gbps = 0;
  double nt_gbps = 0;  // streaming-store copy of the same bytes (see StreamCopy)
  double ratio = 0;
  bool verified = false;
};

// Page-aligned, faulted-in buffer (every page written before any timing).
uint8_t* AllocTouched(size_t n) {
  void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::perror("copy_bench: mmap");
    std::exit(1);
  }
  std::memset(p, 0x5a, n);
  return static_cast<uint8_t*>(p);
}

double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Source element value at flat index i of the source box (F32 cases: the
// index as a float-sized integer pattern; BF16 case: low 16 bits).
void FillSource(uint8_t* src, const StoredLayout& s) {
  const int64_t n = s.num_elements();
  if (DTypeSize(s.dtype) == 4) {
    uint32_t* p = reinterpret_cast<uint32_t*>(src);
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<uint32_t>(i * 2654435761u);
  } else {
    uint16_t* p = reinterpret_cast<uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<uint16_t>(i * 40503u);
  }
}

// Checks every destination element of `region` against its source element.
bool Verify(const Case& c, const uint8_t* src, const uint8_t* dst) {
  const Box& r = c.region;
  if (r.rank() != 2) return false;
  const int64_t scols = c.src.box.shape[1], dcols = c.dst.box.shape[1];
  for (int64_t i = 0; i < r.shape[0]; ++i) {
    const int64_t gi = r.offset[0] + i;
    const int64_t srow = (gi - c.src.box.offset[0]) * scols;
    const int64_t drow = (gi - c.dst.box.offset[0]) * dcols;
    for (int64_t j = 0; j < r.shape[1]; ++j) {
      const int64_t gj = r.offset[1] + j;
      const int64_t sf = srow + gj - c.src.box.offset[1];
      const int64_t df = drow + gj - c.dst.box.offset[1];
      uint32_t want, got;
      if (c.src.dtype == c.dst.dtype) {
        std::memcpy(&want, src + 4 * sf, 4);
      } else {  // BF16 -> F32: the bf16 bits become the high half
        uint16_t b;
        std::memcpy(&b, src + 2 * sf, 2);
        want = static_cast<uint32_t>(b) << 16;
      }
      std::memcpy(&got, dst + 4 * df, 4);
      if (want != got) return false;
    }
  }
  return true;
}

// Runs of the region as CopyRegion walks them after folding and merging:
// the number of contiguous pieces and their length in destination bytes.
void CountRuns(const Case& c, int64_t* runs, uint64_t* run_bytes) {
  // For the 2-D cases here: whole rows in both boxes fold into one run;
  // otherwise one run per row of the region.
  const Box& r = c.region;
  const bool whole_rows = r.shape[1] == c.src.box.shape[1] && r.shape[1] == c.dst.box.shape[1];
  const uint64_t elem = DTypeSize(c.dst.dtype);
  if (whole_rows) {
    *runs = 1;
    *run_bytes = static_cast<uint64_t>(NumElements(r.shape)) * elem;
  } else {
    *runs = r.shape[0];
    *run_bytes = static_cast<uint64_t>(r.shape[1]) * elem;
  }
}

Case Make(std::string name, std::string what, DType sdt, Shape gshape, Box dst_box, DType ddt) {
  Case c;
  c.name = std::move(name);
  c.what = std::move(what);
  c.src = StoredLayout::Whole(Box{Shape(gshape.size(), 0), gshape}, sdt);
  c.dst = StoredLayout::Whole(dst_box, ddt);
  c.region = *Intersect(c.src.box, c.dst.box);
  return c;
}

std::vector<Case> Cases() {
  std::vector<Case> cs;
  // Source: a whole 256 MiB F32 tensor. Destination: its lower row half
  // (128 MiB). Rows are whole in both, so the copy folds into one memcpy.
  cs.push_back(Make("rows-half-1-run", "F32 [8192,8192] -> rows [4096:8192), 1 run of 128 MiB",
                    DType::kF32, {8192, 8192}, Box{{4096, 0}, {4096, 8192}}, DType::kF32));
  // (a) Large runs: destination is a column half (tensor-parallel split of
  // the last axis): one 16 KiB run per row.
  cs.push_back(Make("cols-half-16KiB-runs", "F32 [8192,8192] -> cols [4096:8192), 16 KiB runs",
                    DType::kF32, {8192, 8192}, Box{{0, 4096}, {8192, 4096}}, DType::kF32));
  // (a') The same split at 256 MiB of destination: glibc's memcpy of one
  // buffer this large switches to non-temporal stores, while each 32 KiB run
  // stays below that threshold.
  cs.push_back(Make("cols-half-32KiB-256MiB", "F32 [8192,16384] -> cols [8192:16384), 32 KiB runs",
                    DType::kF32, {8192, 16384}, Box{{0, 8192}, {8192, 8192}}, DType::kF32));
  // (b) 4 KiB runs.
  cs.push_back(Make("cols-half-4KiB-runs", "F32 [32768,2048] -> cols [1024:2048), 4 KiB runs",
                    DType::kF32, {32768, 2048}, Box{{0, 1024}, {32768, 1024}}, DType::kF32));
  // (c) 64-byte runs.
  cs.push_back(Make("cols-half-64B-runs", "F32 [2097152,32] -> cols [16:32), 64 B runs",
                    DType::kF32, {2097152, 32}, Box{{0, 16}, {2097152, 16}}, DType::kF32));
  // (d) BF16 -> F32 cast of a large region (one run): 64 MiB of BF16 read,
  // 128 MiB of F32 written.
  cs.push_back(Make("cast-bf16-f32", "BF16 [8192,8192] -> F32 rows [0:4096), 1 run, cast",
                    DType::kBF16, {8192, 8192}, Box{{0, 0}, {4096, 8192}}, DType::kF32));
  return cs;
}

// A copy with non-temporal (streaming) stores: what glibc's memcpy does for
// very large sizes (above its non-temporal threshold, ~192 MiB here), and
// what a copy of a destination much larger than the caches can reach. AVX2
// when the CPU has it (SSE2 otherwise), source prefetched a few KiB ahead.
// `n` a multiple of 128, both pointers 32-aligned.
__attribute__((target("avx2"))) void StreamCopyAvx2(void* dst, const void* src, size_t n) {
  __m256i* d = static_cast<__m256i*>(dst);
  const __m256i* s = static_cast<const __m256i*>(src);
  for (size_t i = 0; i < n / 32; i += 4) {
    __builtin_prefetch(reinterpret_cast<const char*>(s + i) + 4096);
    __m256i a = _mm256_load_si256(s + i), b = _mm256_load_si256(s + i + 1);
    __m256i e = _mm256_load_si256(s + i + 2), f = _mm256_load_si256(s + i + 3);
    _mm256_stream_si256(d + i, a);
    _mm256_stream_si256(d + i + 1, b);
    _mm256_stream_si256(d + i + 2, e);
    _mm256_stream_si256(d + i + 3, f);
  }
  _mm_sfence();
}

void StreamCopy(void* dst, const void* src, size_t n) {
  if (__builtin_cpu_supports("avx2")) return StreamCopyAvx2(dst, src, n);
  __m128i* d = static_cast<__m128i*>(dst);
  const __m128i* s = static_cast<const __m128i*>(src);
  for (size_t i = 0; i < n / 16; i += 4) {
    __m128i a = _mm_load_si128(s + i), b = _mm_load_si128(s + i + 1);
    __m128i e = _mm_load_si128(s + i + 2), f = _mm_load_si128(s + i + 3);
    _mm_stream_si128(d + i, a);
    _mm_stream_si128(d + i + 1, b);
    _mm_stream_si128(d + i + 2, e);
    _mm_stream_si128(d + i + 3, f);
  }
  _mm_sfence();
}

Result RunCase(const Case& c, uint8_t* src, uint8_t* dst, int reps) {
  Result res;
  res.name = c.name;
  res.what = c.what;
  res.dst_bytes = c.dst.num_bytes();
  CountRuns(c, &res.runs, &res.run_bytes);
  if (static_cast<uint64_t>(c.src.num_bytes()) > kSrcBytes || res.dst_bytes > kDstBytes) {
    std::fprintf(stderr, "copy_bench: case %s does not fit the buffers\n", c.name.c_str());
    std::exit(1);
  }
  const int64_t want = NumElements(c.region.shape);
  FillSource(src, c.src);
  std::memset(dst, 0, res.dst_bytes);

  // Warm-up (also the correctness check).
  int64_t n = CopyRegion(c.src, src, c.dst, dst, c.region);
  if (n != want) {
    std::fprintf(stderr, "copy_bench: case %s copied %lld elements, expected %lld\n",
                 c.name.c_str(), static_cast<long long>(n), static_cast<long long>(want));
    std::exit(1);
  }
  res.verified = Verify(c, src, dst);
  if (!res.verified) {
    std::fprintf(stderr, "copy_bench: case %s: destination does not match the source\n",
                 c.name.c_str());
    std::exit(1);
  }

  std::vector<double> figure, limit, nt;
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    std::memcpy(dst, src, res.dst_bytes);
    auto t1 = std::chrono::steady_clock::now();
    n = CopyRegion(c.src, src, c.dst, dst, c.region);
    auto t2 = std::chrono::steady_clock::now();
    StreamCopy(dst, src, res.dst_bytes);
    auto t3 = std::chrono::steady_clock::now();
    if (n != want) std::exit(1);
    limit.push_back(static_cast<double>(res.dst_bytes) / Seconds(t0, t1) / 1e9);
    figure.push_back(static_cast<double>(res.dst_bytes) / Seconds(t1, t2) / 1e9);
    nt.push_back(static_cast<double>(res.dst_bytes) / Seconds(t2, t3) / 1e9);
  }
  res.nt_gbps = Median(nt);
  res.figure_gbps = Median(figure);
  res.limit_gbps = Median(limit);
  res.ratio = res.figure_gbps / res.limit_gbps;
  return res;
}

// 4 MiB of `row`-byte rows, 4 KiB apart at `src`, into `dst` back to back
// through ProcessMemory::Write and through one process_vm_writev iovec per
// row (IOV_MAX a call); GB/s of each and of memcpy, medians of `reps`.
struct PvmResult {
  size_t row = 0;
  double gathered = 0, per_row = 0, memcpy_gbps = 0;
};

PvmResult RunPvm(size_t row, uint8_t* src, uint8_t* dst, int reps) {
  constexpr size_t kBytes = 4 << 20, kStride = 4096;
  const size_t rows = kBytes / row;
  PvmResult r;
  r.row = row;
  auto self = ProcessMemory::Open({::getpid(), "copy_bench"});
  if (!self.ok()) {
    std::fprintf(stderr, "copy_bench: %s\n", self.status().ToString().c_str());
    std::exit(1);
  }
  std::vector<iovec> local(rows), remote(rows);
  for (size_t i = 0; i < rows; ++i) {
    local[i] = {src + i * kStride, row};
    remote[i] = {dst + i * row, row};
  }
  std::vector<double> g, p, m;
  for (int k = 0; k < reps; ++k) {
    std::memset(dst, 0, kBytes);
    auto t0 = std::chrono::steady_clock::now();
    absl::Status st = (*self)->Write(local.data(), remote.data(), rows);
    auto t1 = std::chrono::steady_clock::now();
    for (size_t i = 0; st.ok() && i < rows; ++i) {
      if (std::memcmp(dst + i * row, src + i * kStride, row) != 0) {
        st = absl::InternalError("a row did not land");
      }
    }
    if (!st.ok()) {
      std::fprintf(stderr, "copy_bench: ProcessMemory::Write: %s\n", st.ToString().c_str());
      std::exit(1);
    }
    auto t2 = std::chrono::steady_clock::now();
    for (size_t at = 0; at < rows; at += 1024) {
      const size_t n = std::min<size_t>(1024, rows - at);
      iovec to{dst + at * row, n * row};
      if (::process_vm_writev(::getpid(), local.data() + at, n, &to, 1, 0) !=
          static_cast<ssize_t>(n * row)) {
        std::perror("copy_bench: process_vm_writev");
        std::exit(1);
      }
    }
    auto t3 = std::chrono::steady_clock::now();
    std::memcpy(dst, src + kBytes, kBytes);
    auto t4 = std::chrono::steady_clock::now();
    g.push_back(kBytes / Seconds(t0, t1) / 1e9);
    p.push_back(kBytes / Seconds(t2, t3) / 1e9);
    m.push_back(kBytes / Seconds(t3, t4) / 1e9);
  }
  r.gathered = Median(g);
  r.per_row = Median(p);
  r.memcpy_gbps = Median(m);
  return r;
}

std::string HumanBytes(uint64_t b) {
  char buf[32];
  if (b >= (uint64_t{1} << 20) && b % (uint64_t{1} << 20) == 0) {
    std::snprintf(buf, sizeof buf, "%llu MiB", static_cast<unsigned long long>(b >> 20));
  } else if (b >= 1024 && b % 1024 == 0) {
    std::snprintf(buf, sizeof buf, "%llu KiB", static_cast<unsigned long long>(b >> 10));
  } else {
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(b));
  }
  return buf;
}

bool WriteJson(const std::string& path, const std::vector<Result>& results) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    std::perror(("copy_bench: " + path).c_str());
    return false;
  }
  std::fprintf(f, "[\n");
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    std::fprintf(f,
                 "  {\"case\": \"%s\", \"figure_gbps\": %.3f, \"limit_gbps\": %.3f, "
                 "\"ratio\": %.3f}%s\n",
                 r.name.c_str(), r.figure_gbps, r.limit_gbps, r.ratio,
                 i + 1 < results.size() ? "," : "");
  }
  std::fprintf(f, "]\n");
  return std::fclose(f) == 0;
}

int Main(int argc, char** argv) {
  std::string json_path, rows_path;
  int reps = 15;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--json=", 0) == 0) {
      json_path = a.substr(7);
    } else if (a == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else if (a.rfind("--reps=", 0) == 0) {
      reps = std::max(1, std::atoi(a.c_str() + 7));
    } else if (a == "--quick") {
      reps = 5;
    } else if (a.rfind("--rows=", 0) == 0) {
      rows_path = a.substr(7);
    } else {
      std::fprintf(stderr, "usage: copy_bench [--json=FILE] [--reps=N] [--quick] [--rows=FILE]\n");
      return 2;
    }
  }

  auto t0 = std::chrono::steady_clock::now();
  uint8_t* src = AllocTouched(kSrcBytes);
  uint8_t* dst = AllocTouched(kDstBytes);
  double fault_s = Seconds(t0, std::chrono::steady_clock::now());

  std::vector<Result> results;
  for (const Case& c : Cases()) results.push_back(RunCase(c, src, dst, reps));

  std::printf("copy_bench: ckpt::CopyRegion vs memcpy, 1 thread, median of %d runs each\n", reps);
  std::printf("  GB/s = 1e9 destination bytes written per second; limit = memcpy of the same\n"
              "  destination bytes between the same buffers (already faulted in), measured\n"
              "  alternately with the copy; ratio = figure / limit. Cast case: the F32\n"
              "  destination bytes are counted and compared with memcpy of that many bytes.\n"
              "  (faulting in the %zu MiB of buffers first took %.2f s, not counted)\n\n",
              (kSrcBytes + kDstBytes) >> 20, fault_s);
  std::printf("%-24s %8s %8s %9s %12s %11s %6s %10s %9s\n", "case", "dst", "runs", "run",
              "figure GB/s", "limit GB/s", "ratio", "NT GB/s", "ratio NT");
  for (const Result& r : results) {
    std::printf("%-24s %8s %8lld %9s %12.2f %11.2f %6.2f %10.2f %9.2f\n", r.name.c_str(),
                HumanBytes(r.dst_bytes).c_str(), static_cast<long long>(r.runs),
                HumanBytes(r.run_bytes).c_str(), r.figure_gbps, r.limit_gbps, r.ratio, r.nt_gbps,
                r.figure_gbps / r.nt_gbps);
  }
  std::printf("  (NT: a copy of the same bytes with non-temporal stores, measured in the same "
              "loop; not the target's limit, shown for the analysis)\n");
  std::printf("\n");
  for (const Result& r : results) std::printf("  %-24s %s\n", r.name.c_str(), r.what.c_str());

  std::vector<PvmResult> pvm;
  for (size_t row : {size_t{64}, size_t{512}, size_t{2048}}) pvm.push_back(RunPvm(row, src, dst, reps));
  std::printf("\nprocess_vm_writev into another process (this one): 4 MiB in rows 4 KiB apart "
              "in the source,\nback to back in the destination; median of %d runs each\n", reps);
  std::printf("%-10s %16s %18s %12s %8s %8s\n", "row", "ProcessMemory", "iovec per row",
              "memcpy", "ratio", "x before");
  for (const PvmResult& r : pvm) {
    std::printf("%-10s %11.2f GB/s %13.2f GB/s %7.2f GB/s %8.2f %8.1f\n",
                HumanBytes(r.row).c_str(), r.gathered, r.per_row, r.memcpy_gbps,
                r.gathered / r.memcpy_gbps, r.gathered / r.per_row);
  }
  std::printf("  (ProcessMemory gathers rows under 2 KiB into one buffer before the call; "
              "ratio: of memcpy of the 4 MiB)\n");

  std::vector<bench::Row> rows;
  for (const PvmResult& r : pvm) {
    bench::Row row;
    row.name = "1 process_vm_writev-rows-" + std::to_string(r.row) + "B";
    row.figure = r.gathered;
    row.unit = "GB/s";
    row.limit = r.memcpy_gbps;
    row.limit_what = "memcpy 1thr";
    row.ratio = r.gathered / r.memcpy_gbps;
    rows.push_back(row);
  }
  for (const Result& r : results) {
    bench::Row row;
    row.name = "1 copy-" + r.name;
    row.figure = r.figure_gbps;
    row.unit = "GB/s";
    row.limit = r.limit_gbps;
    row.limit_what = "memcpy 1thr";
    row.ratio = r.ratio;
    if (r.run_bytes >= 4096) {
      row.target = ">=0.85";
      row.met = r.ratio >= 0.85 ? "yes" : "NO";
    }
    rows.push_back(row);
  }
  bench::AppendRows(rows_path, rows);

  ::munmap(src, kSrcBytes);
  ::munmap(dst, kDstBytes);
  if (!json_path.empty()) {
    if (!WriteJson(json_path, results)) return 1;
    std::printf("\nwrote %s\n", json_path.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace ckpt

int main(int argc, char** argv) { return ckpt::Main(argc, argv); }
