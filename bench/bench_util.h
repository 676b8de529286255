// Helpers shared by the benchmarks in bench/: timing, pre-faulted buffers,
// the machine limits measured in the same run (memcpy, pread of cached files),
// deterministic test checkpoints written with core's save API, verification
// of loaded bytes, /proc figures, and the rows every benchmark appends to the
// suite's table (bench/run prints and converts them).
#ifndef CKPTD_BENCH_BENCH_UTIL_H_
#define CKPTD_BENCH_BENCH_UTIL_H_

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/tools/layout.h"
#include "core/plan/planner.h"

namespace ckpt::bench {

using Clock = std::chrono::steady_clock;  // CLOCK_MONOTONIC: comparable across processes

double Seconds(Clock::time_point a, Clock::time_point b);
double SecondsSince(Clock::time_point a);
double MonotonicNow();  // seconds on CLOCK_MONOTONIC (same clock as Clock)
double Median(std::vector<double> v);
double GB(uint64_t bytes);  // 10^9 bytes
std::string Bytes(uint64_t bytes);  // "1.50 GiB", "512.0 MiB", "4 KiB"

// An anonymous page-aligned mapping. Touch() writes every page (fault-in)
// and returns the seconds it took.
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(uint64_t size);
  ~Buffer();
  Buffer(Buffer&& o) noexcept;
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  double Touch(uint8_t value = 0x5a);

 private:
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

// Writes every page of [p, p + n) once; returns seconds.
double TouchPages(uint8_t* p, uint64_t n, uint8_t value = 0x5a);

// --- machine limits ----------------------------------------------------------

// memcpy GB/s between two already faulted-in buffers of `bytes` each, on
// `threads` threads (each copying its own 1/threads part), median of `reps`.
// The probe keeps its buffers so it can be measured again between cases.
class MemcpyProbe {
 public:
  explicit MemcpyProbe(uint64_t bytes);
  double GBps(int threads, int reps);

 private:
  Buffer src_, dst_;
};
double MemcpyLimitGBps(uint64_t bytes, int threads, int reps);

// GB/s of pread of the plan's reads (files in `dir`) into `dst` (faulted in
// already), the reads handed to `threads` threads from one queue as in the
// executor. One run. `dst_size` 0: dst holds plan.bytes_to_read bytes;
// otherwise reads wrap around inside dst_size bytes (> the longest read).
double PreadPlanGBps(const std::string& dir, const LoadPlan& plan, uint8_t* dst, int threads,
                     uint64_t dst_size = 0);
// The same with O_DIRECT (the storage device's limit, page cache bypassed):
// each read widened to 4 KiB boundaries and issued in 4 MiB requests into
// `dst` (page-aligned, holding the widened reads). GB/s of planned bytes.
double DirectPreadPlanGBps(const std::string& dir, const LoadPlan& plan, uint8_t* dst,
                           int threads);
// Drops `dir`'s files from the page cache (fdatasync + POSIX_FADV_DONTNEED;
// no root needed); returns the fraction still resident.
double DropPageCache(const std::string& dir);

// Reads every file of `dir` once (into the page cache) and returns the
// fraction of their pages resident afterwards (mincore).
double WarmPageCache(const std::string& dir, uint64_t* bytes);
// The fraction of the pages of `dir`'s files resident in the page cache now.
// (This VM runs DAMON "pageout" of page-cache regions idle for 60 s: the
// benchmarks check residency after their loads too.)
double ResidentFraction(const std::string& dir);

// --- test checkpoints --------------------------------------------------------

// A set of 2-D F32 tensors "layers.{i}.w" of shape [rows, cols]; tensor i is
// column-parallel (split along axis 0) when i is even and row-parallel (split
// along axis 1) when odd, as in Megatron-style tensor parallelism.
struct TensorSet {
  int count = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  std::string prefix = "layers";
  uint64_t bytes() const { return uint64_t(count) * rows * cols * 4; }
  std::string name(int i) const;
  int axis(int i) const { return i % 2; }
};

// Tensor parallelism of degree `tp` over all tensors of `set`: rank r holds
// the r-th 1/tp slice of each tensor along its axis.
Layout TpLayout(const TensorSet& set, int tp);

// Element value at global flat index g of tensor `tensor` (every element is
// distinct within a tensor, tensors differ by seed).
inline uint32_t Pattern(uint32_t tensor, uint64_t g) {
  return static_cast<uint32_t>(g * 2654435761u) + tensor * 0x9E3779B9u;
}

// Fills / checks the buffer of a target (F32, not flattened) of tensor index
// `tensor_seed` with Pattern. Verify returns the number of wrong elements.
void FillTarget(const TargetTensor& t, uint32_t tensor_seed, void* dst);
uint64_t VerifyTarget(const TargetTensor& t, uint32_t tensor_seed, const void* data);
// Seed of a tensor name made by TensorSet / SmallTensorSet ("...{i}..." -> i).
uint32_t SeedOf(const std::string& name);

struct WriteReport {
  uint64_t bytes = 0;
  int files = 0;
  double write_s = 0;  // generate + write (page cache)
  double sync_s = 0;   // syncfs: dirty pages to disk, so writeback does not disturb timing
};

// Writes a native checkpoint (uid 0) into `dir` as if each rank of `layout`
// had saved its part (core's PlanSave / WriteRankFile / FinishSave, the same
// path ShardCheckpoint takes), with Pattern data, then syncs it to disk.
absl::StatusOr<WriteReport> WriteCheckpoint(const std::string& dir, const Layout& layout);

// Removes `dir` recursively (ignores errors).
void RemoveTree(const std::string& dir);

// --- /proc -------------------------------------------------------------------

struct ProcMem {
  uint64_t vm_hwm = 0, vm_rss = 0, rss_anon = 0, rss_file = 0, rss_shmem = 0;  // bytes
};
ProcMem ReadProcMem(pid_t pid);  // pid 0: this process
// Minor and major page faults of a process so far (/proc/<pid>/stat); pid 0: self.
uint64_t MinorFaults(pid_t pid);
// Resets this process's VmHWM to its current RSS (/proc/self/clear_refs 5).
bool ResetPeakRss();

// --- the suite's table -------------------------------------------------------

// One row of bench/run's table. Columns: case, figure + unit, the limit or
// reference measured in the same run (+ what it is), ratio = figure / limit,
// target, met ("yes", "NO", or "-" when no target applies).
struct Row {
  std::string name;
  double figure = 0;
  std::string unit;
  double limit = 0;
  std::string limit_what;
  double ratio = 0;
  std::string target = "-";
  std::string met = "-";
};

// Appends rows (tab-separated, one per line) to `path`; no-op if empty.
void AppendRows(const std::string& path, const std::vector<Row>& rows);

// Simple flag parsing: "--name=value" or "--name value".
struct Args {
  Args(int argc, char** argv);
  bool Has(const std::string& name) const;
  std::string Get(const std::string& name, const std::string& def = "") const;
  int64_t Int(const std::string& name, int64_t def) const;
  std::vector<std::pair<std::string, std::string>> kv;
};

}  // namespace ckpt::bench

#endif  // CKPTD_BENCH_BENCH_UTIL_H_
