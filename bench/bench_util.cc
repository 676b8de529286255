#include "bench/bench_util.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <iterator>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/io/file.h"
#include "core/base/status_macros.h"
#include "core/write/writer.h"

namespace ckpt::bench {

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}
double SecondsSince(Clock::time_point a) { return Seconds(a, Clock::now()); }

double MonotonicNow() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double GB(uint64_t bytes) { return static_cast<double>(bytes) / 1e9; }

std::string Bytes(uint64_t b) {
  char buf[48];
  const double d = static_cast<double>(b);
  if (b >= (uint64_t{1} << 30)) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", d / (1u << 30));
  } else if (b >= (uint64_t{1} << 20)) {
    std::snprintf(buf, sizeof buf, "%.1f MiB", d / (1u << 20));
  } else if (b >= 1024) {
    std::snprintf(buf, sizeof buf, "%.1f KiB", d / 1024);
  } else {
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(b));
  }
  return buf;
}

// --- Buffer ------------------------------------------------------------------

Buffer::Buffer(uint64_t size) : size_(size) {
  if (size == 0) return;
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::fprintf(stderr, "bench: mmap of %llu bytes: %s\n", static_cast<unsigned long long>(size),
                 std::strerror(errno));
    std::exit(1);
  }
  data_ = static_cast<uint8_t*>(p);
}

Buffer::~Buffer() {
  if (data_ != nullptr) ::munmap(data_, size_);
}

Buffer::Buffer(Buffer&& o) noexcept : data_(o.data_), size_(o.size_) {
  o.data_ = nullptr;
  o.size_ = 0;
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    if (data_ != nullptr) ::munmap(data_, size_);
    data_ = o.data_;
    size_ = o.size_;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

double Buffer::Touch(uint8_t value) { return TouchPages(data_, size_, value); }

double TouchPages(uint8_t* p, uint64_t n, uint8_t value) {
  auto t0 = Clock::now();
  for (uint64_t i = 0; i < n; i += 4096) p[i] = value;
  if (n > 0) p[n - 1] = value;
  return SecondsSince(t0);
}

// --- limits ------------------------------------------------------------------

MemcpyProbe::MemcpyProbe(uint64_t bytes) : src_(bytes / 8192 * 8192), dst_(bytes / 8192 * 8192) {
  src_.Touch(0x11);
  dst_.Touch(0x22);
}

double MemcpyProbe::GBps(int threads, int reps) {
  threads = std::max(1, threads);
  const uint64_t part = src_.size() / threads / 4096 * 4096;
  std::vector<double> gbps;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    std::vector<std::thread> ts;
    for (int t = 1; t < threads; ++t) {
      ts.emplace_back([&, t] { std::memcpy(dst_.data() + t * part, src_.data() + t * part, part); });
    }
    std::memcpy(dst_.data(), src_.data(), part);
    for (auto& t : ts) t.join();
    gbps.push_back(GB(part * threads) / SecondsSince(t0));
  }
  return Median(gbps);
}

double MemcpyLimitGBps(uint64_t bytes, int threads, int reps) {
  return MemcpyProbe(bytes).GBps(threads, reps);
}

namespace {

// The plan's files opened with `flags` (exits on failure).
std::vector<int> OpenPlanFiles(const std::string& dir, const LoadPlan& plan, int flags) {
  std::vector<int> fds;
  for (const std::string& f : plan.files) {
    int fd = ::open(JoinPath(dir, f).c_str(), O_RDONLY | O_CLOEXEC | flags);
    if (fd < 0) {
      std::fprintf(stderr, "bench: open %s: %s\n", f.c_str(), std::strerror(errno));
      std::exit(1);
    }
    fds.push_back(fd);
  }
  return fds;
}

// Calls read_one(i) for every read of `plan`, handed to `threads` threads
// (this one included) from one queue as in the executor; wall seconds.
double TimeEachRead(const LoadPlan& plan, int threads,
                    const std::function<void(size_t)>& read_one) {
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i; (i = next.fetch_add(1)) < plan.reads.size();) read_one(i);
  };
  auto t0 = Clock::now();
  std::vector<std::thread> ts;
  for (int t = 1; t < threads; ++t) ts.emplace_back(worker);
  worker();
  for (auto& t : ts) t.join();
  return SecondsSince(t0);
}

}  // namespace

double PreadPlanGBps(const std::string& dir, const LoadPlan& plan, uint8_t* dst, int threads,
                     uint64_t dst_size) {
  std::vector<int> fds = OpenPlanFiles(dir, plan, 0);
  std::vector<uint64_t> at(plan.reads.size());
  uint64_t pos = 0;
  uint64_t wrap = 0;
  for (size_t i = 0; i < plan.reads.size(); ++i) {
    if (dst_size != 0 && wrap + plan.reads[i].length > dst_size) wrap = 0;
    at[i] = dst_size != 0 ? wrap : pos;
    pos += plan.reads[i].length;
    wrap = (wrap + plan.reads[i].length + 4095) / 4096 * 4096;
  }
  const double s = TimeEachRead(plan, threads, [&](size_t i) {
    const ReadRange& r = plan.reads[i];
    uint64_t done = 0;
    while (done < r.length) {
      ssize_t n = ::pread(fds[r.file], dst + at[i] + done, r.length - done,
                          static_cast<off_t>(r.offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        std::fprintf(stderr, "bench: pread failed: %s\n", std::strerror(errno));
        std::exit(1);
      }
      done += static_cast<uint64_t>(n);
    }
  });
  for (int fd : fds) ::close(fd);
  return GB(pos) / s;
}

double DirectPreadPlanGBps(const std::string& dir, const LoadPlan& plan, uint8_t* dst,
                           int threads) {
  constexpr uint64_t kAlign = 4096, kRequest = 4u << 20;
  std::vector<int> fds = OpenPlanFiles(dir, plan, O_DIRECT);
  std::vector<uint64_t> at(plan.reads.size());
  uint64_t pos = 0;
  for (size_t i = 0; i < plan.reads.size(); ++i) {
    at[i] = pos;
    const uint64_t b = plan.reads[i].offset / kAlign * kAlign;
    const uint64_t e = (plan.reads[i].offset + plan.reads[i].length + kAlign - 1) / kAlign * kAlign;
    pos += e - b;
  }
  const double s = TimeEachRead(plan, threads, [&](size_t i) {
    const ReadRange& r = plan.reads[i];
    const uint64_t b = r.offset / kAlign * kAlign;
    const uint64_t e = (r.offset + r.length + kAlign - 1) / kAlign * kAlign;
    for (uint64_t o = b; o < e;) {
      ssize_t n = ::pread(fds[r.file], dst + at[i] + (o - b), std::min(kRequest, e - o),
                          static_cast<off_t>(o));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        std::fprintf(stderr, "bench: pread (O_DIRECT) failed: %s\n", std::strerror(errno));
        std::exit(1);
      }
      if (n == 0) break;  // end of file inside the last page
      o += static_cast<uint64_t>(n);
    }
  });
  for (int fd : fds) ::close(fd);
  return GB(plan.bytes_to_read) / s;
}

double DropPageCache(const std::string& dir) {
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    int fd = ::open(e.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
  return ResidentFraction(dir);
}

namespace {

double Residency(const std::string& dir, bool read_first, uint64_t* bytes) {
  uint64_t total = 0, pages = 0, resident = 0;
  std::vector<uint8_t> buf(read_first ? (16u << 20) : 0);
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    int fd = ::open(e.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    struct stat st;
    ::fstat(fd, &st);
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    for (uint64_t off = 0; read_first && off < size;) {
      ssize_t n = ::pread(fd, buf.data(), buf.size(), static_cast<off_t>(off));
      if (n <= 0) break;
      off += static_cast<uint64_t>(n);
    }
    total += size;
    if (size > 0) {
      void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
      if (p != MAP_FAILED) {
        const uint64_t np = (size + 4095) / 4096;
        std::vector<unsigned char> vec(np);
        if (::mincore(p, size, vec.data()) == 0) {
          for (unsigned char c : vec) resident += c & 1;
        }
        pages += np;
        ::munmap(p, size);
      }
    }
    ::close(fd);
  }
  if (bytes) *bytes = total;
  return pages ? static_cast<double>(resident) / static_cast<double>(pages) : 1.0;
}

}  // namespace

double WarmPageCache(const std::string& dir, uint64_t* bytes) { return Residency(dir, true, bytes); }
double ResidentFraction(const std::string& dir) { return Residency(dir, false, nullptr); }

// --- checkpoints ---------------------------------------------------------------

std::string TensorSet::name(int i) const { return absl::StrCat(prefix, ".", i, ".w"); }

Layout TpLayout(const TensorSet& set, int tp) {
  Layout l;
  l.world_size = tp;
  for (int r = 0; r < tp; ++r) {
    RankTargets rt;
    rt.rank = r;
    for (int i = 0; i < set.count; ++i) {
      TargetTensor t;
      t.name = set.name(i);
      t.dtype = DType::kF32;
      t.global_shape = {set.rows, set.cols};
      t.box = Box{{0, 0}, {set.rows, set.cols}};
      const int a = set.axis(i);
      const int64_t n = t.global_shape[a] / tp;
      t.box.offset[a] = r * n;
      t.box.shape[a] = n;
      rt.tensors.push_back(std::move(t));
    }
    l.ranks.push_back(std::move(rt));
  }
  return l;
}

uint32_t SeedOf(const std::string& name) {
  // The first run of digits in the name.
  uint32_t v = 0;
  size_t i = 0;
  while (i < name.size() && (name[i] < '0' || name[i] > '9')) ++i;
  while (i < name.size() && name[i] >= '0' && name[i] <= '9') v = v * 10 + (name[i++] - '0');
  return v;
}

namespace {

// Calls row(g0, len, out_index) for each innermost row of the target box:
// g0 = global flat index of its first element, out_index = its position in
// the target's buffer (elements).
template <typename F>
void ForEachRow(const TargetTensor& t, F row) {
  const size_t rank = t.box.rank();
  if (rank == 0) {
    row(0, 1, 0);
    return;
  }
  for (int64_t d : t.box.shape) {
    if (d == 0) return;
  }
  const int64_t len = t.box.shape[rank - 1];
  std::vector<int64_t> idx(rank, 0);
  uint64_t out = 0;
  while (true) {
    int64_t g = 0;
    for (size_t d = 0; d < rank; ++d) g = g * t.global_shape[d] + t.box.offset[d] + idx[d];
    row(static_cast<uint64_t>(g), len, out);
    out += static_cast<uint64_t>(len);
    size_t a = rank - 1;
    while (true) {
      if (a == 0) return;
      --a;
      if (++idx[a] < t.box.shape[a]) break;
      idx[a] = 0;
    }
  }
}

}  // namespace

void FillTarget(const TargetTensor& t, uint32_t seed, void* dst) {
  uint32_t* p = static_cast<uint32_t*>(dst);
  ForEachRow(t, [&](uint64_t g0, int64_t len, uint64_t out) {
    uint32_t* q = p + out;
    for (int64_t j = 0; j < len; ++j) q[j] = Pattern(seed, g0 + j);
  });
}

uint64_t VerifyTarget(const TargetTensor& t, uint32_t seed, const void* data) {
  const uint32_t* p = static_cast<const uint32_t*>(data);
  uint64_t bad = 0;
  ForEachRow(t, [&](uint64_t g0, int64_t len, uint64_t out) {
    const uint32_t* q = p + out;
    for (int64_t j = 0; j < len; ++j) bad += q[j] != Pattern(seed, g0 + j);
  });
  return bad;
}

absl::StatusOr<WriteReport> WriteCheckpoint(const std::string& dir, const Layout& layout) {
  WriteReport rep;
  auto t0 = Clock::now();
  CKPT_RETURN_IF_ERROR(MakeDirs(dir));
  CKPT_ASSIGN_OR_RETURN(SavePlan save, PlanSave(layout.ranks, layout.world_size, 0));
  std::vector<std::pair<std::string, ShardMeta>> shards;
  for (int r = 0; r < layout.world_size; ++r) {
    const auto& writes = save.writes[r];
    std::vector<std::vector<uint32_t>> bufs(writes.size());
    std::vector<const void*> data;
    for (size_t i = 0; i < writes.size(); ++i) {
      bufs[i].resize(static_cast<size_t>(writes[i].num_elements()));
      FillTarget(writes[i], SeedOf(writes[i].name), bufs[i].data());
      data.push_back(bufs[i].data());
      rep.bytes += writes[i].num_bytes();
    }
    CKPT_ASSIGN_OR_RETURN(auto written, WriteRankFile(dir, save, r, data));
    shards.insert(shards.end(), written.begin(), written.end());
    ++rep.files;
  }
  CKPT_RETURN_IF_ERROR(FinishSave(dir, save, shards));
  rep.write_s = SecondsSince(t0);
  t0 = Clock::now();
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::syncfs(fd);
    ::close(fd);
  }
  rep.sync_s = SecondsSince(t0);
  return rep;
}

void RemoveTree(const std::string& dir) {
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

// --- /proc -------------------------------------------------------------------

ProcMem ReadProcMem(pid_t pid) {
  ProcMem m;
  std::ifstream in(pid == 0 ? std::string("/proc/self/status")
                            : absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    uint64_t* field = nullptr;
    if (line.rfind("VmHWM:", 0) == 0) field = &m.vm_hwm;
    else if (line.rfind("VmRSS:", 0) == 0) field = &m.vm_rss;
    else if (line.rfind("RssAnon:", 0) == 0) field = &m.rss_anon;
    else if (line.rfind("RssFile:", 0) == 0) field = &m.rss_file;
    else if (line.rfind("RssShmem:", 0) == 0) field = &m.rss_shmem;
    if (field == nullptr) continue;
    std::istringstream ss(line.substr(line.find(':') + 1));
    uint64_t kb = 0;
    ss >> kb;
    *field = kb * 1024;
  }
  return m;
}

uint64_t MinorFaults(pid_t pid) {
  std::ifstream in(pid == 0 ? std::string("/proc/self/stat") : absl::StrCat("/proc/", pid, "/stat"));
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // Fields after the ")" that ends the command name: state(3) ppid pgrp
  // session tty_nr tpgid flags minflt(10).
  size_t p = all.rfind(')');
  if (p == std::string::npos) return 0;
  std::istringstream ss(all.substr(p + 1));
  std::string field;
  for (int i = 3; i <= 10 && ss >> field; ++i) {
    if (i == 10) return std::strtoull(field.c_str(), nullptr, 10);
  }
  return 0;
}

bool ResetPeakRss() {
  int fd = ::open("/proc/self/clear_refs", O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  bool ok = ::write(fd, "5", 1) == 1;
  ::close(fd);
  return ok;
}

// --- rows ----------------------------------------------------------------------

void AppendRows(const std::string& path, const std::vector<Row>& rows) {
  if (path.empty()) return;
  FILE* f = std::fopen(path.c_str(), "a");
  if (f == nullptr) {
    std::perror(("bench: " + path).c_str());
    std::exit(1);
  }
  for (const Row& r : rows) {
    std::fprintf(f, "%s\t%.6g\t%s\t%.6g\t%s\t%.6g\t%s\t%s\n", r.name.c_str(), r.figure,
                 r.unit.c_str(), r.limit, r.limit_what.c_str(), r.ratio, r.target.c_str(),
                 r.met.c_str());
  }
  std::fclose(f);
}

Args::Args(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0) {
      kv.push_back({"", a});
      continue;
    }
    a = a.substr(2);
    size_t eq = a.find('=');
    if (eq != std::string::npos) {
      kv.push_back({a.substr(0, eq), a.substr(eq + 1)});
    } else if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
      kv.push_back({a, argv[++i]});
    } else {
      kv.push_back({a, "true"});
    }
  }
}

bool Args::Has(const std::string& name) const {
  for (const auto& [k, v] : kv) {
    if (k == name) return v != "false" && v != "0";
  }
  return false;
}

std::string Args::Get(const std::string& name, const std::string& def) const {
  for (const auto& [k, v] : kv) {
    if (k == name) return v;
  }
  return def;
}

int64_t Args::Int(const std::string& name, int64_t def) const {
  std::string v = Get(name);
  return v.empty() ? def : std::atoll(v.c_str());
}

}  // namespace ckpt::bench
