// Hardening of core's file handling (issue 14): checkpoint files opened
// confined beneath their directory (no symlinks, regular files only, a FIFO
// never blocks), file identity with ctime, no unverified bytes in the data
// cache, durable and crash-safe saves, version and lock helpers, bounded
// metadata parsing. Real files in temporary directories.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <random>
#include <sstream>
#include <thread>

#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define CKPT_TSAN 1
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();
#endif
#endif
#ifndef CKPT_TSAN
#define CKPT_TSAN 0
#endif
#include "core/cache/cache.h"
#include "core/format/checkpoint.h"
#include "core/exec/executor.h"
#include "core/io/file.h"
#include "core/io/file_posix.h"
#include "core/tools/offline.h"
#include "core/format/pickle.h"
#include "core/plan/planner.h"
#include "core/format/safetensors.h"
#include "core/write/writer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/files.h"
#include "tests/testing/temp_dir.h"

namespace ckpt {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr int64_t kRows = 64, kCols = 32;

using ckpt::testing::Slurp;
using ckpt::testing::Spit;

std::vector<float> Values(float seed, int64_t n = kRows * kCols) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = seed * 100000.f + static_cast<float>(i);
  return v;
}

TargetTensor Whole(const std::string& name = "w", int64_t rows = kRows) {
  return TargetTensor{name, DType::kF32, {rows, kCols}, Box{{0, 0}, {rows, kCols}}, std::nullopt};
}

// Writes version `uid` of a native checkpoint into `dir`: tensor "w"
// [rows, 32] F32 = Values(seed), rows split over 2 ranks, checksums every
// `block` bytes. As the daemon's Save does it (plan, rank files, metadata).
absl::Status SaveVersion(const std::string& dir, int64_t uid, float seed, int64_t rows = kRows,
                         uint64_t block = 1024) {
  std::vector<float> v = Values(seed, rows * kCols);
  std::vector<RankTargets> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back({r, {TargetTensor{"w", DType::kF32, {rows, kCols},
                                      Box{{r * rows / 2, 0}, {rows / 2, kCols}}, std::nullopt}}});
  }
  auto plan = PlanSave(ranks, 2, uid, block);
  if (!plan.ok()) return plan.status();
  if (absl::Status s = MakeDirs(dir); !s.ok()) return s;
  std::vector<std::pair<std::string, ShardMeta>> written;
  for (int r = 0; r < 2; ++r) {
    auto shards = WriteRankFile(dir, *plan, r, {v.data() + r * (rows / 2) * kCols});
    if (!shards.ok()) return shards.status();
    written.insert(written.end(), shards->begin(), shards->end());
  }
  return FinishSave(dir, *plan, written);
}

// Loads "w" whole from `dir` (offline engine).
absl::StatusOr<std::vector<float>> LoadW(const std::string& dir, bool confine = true,
                                         std::optional<int64_t> uid = std::nullopt,
                                         int64_t rows = kRows) {
  Layout l;
  l.world_size = 1;
  l.ranks = {{0, {Whole("w", rows)}}};
  OfflineLoadOptions o;
  o.confine = confine;
  o.unique_id = uid;
  auto res = LoadOffline(dir, l, o);
  if (!res.ok()) return res.status();
  const auto& b = res->buffers[0].tensors[0];
  std::vector<float> out(b.size() / sizeof(float));
  std::memcpy(out.data(), b.data(), b.size());
  return out;
}

// Runs `f` on another thread; if it has not returned after 10 s (blocked
// opening the FIFO at `fifo`), opens the FIFO for writing so it returns,
// and fails the test. Never hangs.
template <typename F>
auto NoHang(F f, const std::string& fifo) -> decltype(f()) {
  auto fut = std::async(std::launch::async, f);
  if (fut.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    ADD_FAILURE() << "blocked for 10 s opening the FIFO " << fifo;
    const int fd = ::open(fifo.c_str(), O_RDWR | O_NONBLOCK);  // a writer unblocks it
    auto r = fut.get();
    if (fd >= 0) ::close(fd);
    return r;
  }
  return fut.get();
}

// What the daemon opens checkpoints with.
OpenOptions Confine() {
  OpenOptions oo;
  oo.confine = true;
  return oo;
}

// Every test runs with openat2 and with the O_NOFOLLOW walk used where the
// kernel has no openat2.
class Confined : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    internal::SetOpenat2DisabledForTesting(GetParam());
    dir_ = tmp_.Sub("ckpt");
    ASSERT_TRUE(SaveVersion(dir_, 0, 1.f).ok());
  }
  void TearDown() override { internal::SetOpenat2DisabledForTesting(false); }

  // Moves `name` out of the checkpoint and puts a symlink to it in its place.
  void SymlinkOut(const std::string& name) {
    const std::string outside = tmp_.Sub("outside-" + name);
    fs::rename(dir_ + "/" + name, outside);
    fs::create_symlink(outside, dir_ + "/" + name);
  }

  testing::TempDir tmp_;
  std::string dir_;
};

INSTANTIATE_TEST_SUITE_P(Openat2AndWalk, Confined, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "walk" : "openat2"; });

TEST_P(Confined, SymlinkedDataFileOutsideIsRefusedWithItsName) {
  SymlinkOut("1_0.safetensors");
  auto c = OpenCheckpoint(dir_, Confine());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kPermissionDenied) << c.status();
  EXPECT_THAT(std::string(c.status().message()),
              AllOf(HasSubstr(dir_ + "/1_0.safetensors"), HasSubstr("is a symbolic link")));
  // The executor's sources refuse it too (a checkpoint opened without
  // reading its data files, as a multi-node part does).
  OpenOptions oo = Confine();
  oo.check_data_files = false;
  c = OpenCheckpoint(dir_, oo);
  ASSERT_TRUE(c.ok()) << c.status();
  auto plan = PlanLoad(c->metadata, {RankTargets{0, {Whole()}}});
  ASSERT_TRUE(plan.ok());
  std::vector<float> out(kRows * kCols);
  DirectorySource direct(dir_);
  auto st = ExecutePlan(*plan, direct, {{out.data()}});
  EXPECT_THAT(std::string(st.status().message()),
              AllOf(HasSubstr("1_0.safetensors"), HasSubstr("is a symbolic link")));
  HostCache cache(1 << 20);
  std::map<std::string, FileStamp> stamps;
  for (const auto& f : c->data_files) stamps[f] = *StatFile(dir_ + "/" + f);
  CachingSource caching(dir_, &cache, stamps);
  st = ExecutePlan(*plan, caching, {{out.data()}});
  EXPECT_EQ(st.status().code(), absl::StatusCode::kPermissionDenied) << st.status();
  EXPECT_THAT(std::string(st.status().message()), HasSubstr("1_0.safetensors: is a symbolic link"));
  // The offline tools' default (symlink farms: HuggingFace hub caches,
  // Bazel runfiles) follows it.
  EXPECT_FALSE(OpenOptions{}.confine);
  EXPECT_TRUE(OpenCheckpoint(dir_).ok());
  auto w = LoadW(dir_, /*confine=*/false);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(*w, Values(1.f));
}

TEST_P(Confined, SymlinkInsideTheDirectoryIsRefusedToo) {
  fs::rename(dir_ + "/0_0.safetensors", dir_ + "/real.bin");
  fs::create_symlink("real.bin", dir_ + "/0_0.safetensors");
  auto c = OpenCheckpoint(dir_, Confine());
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("0_0.safetensors: is a symbolic link"));
}

TEST_P(Confined, SymlinkedMetadataIsRefused) {
  SymlinkOut("0.metadata");
  auto c = OpenCheckpoint(dir_, Confine());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kPermissionDenied) << c.status();
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("0.metadata: is a symbolic link"));
}

TEST_P(Confined, FifoNamedLikeADataFileIsRefusedAtOnce) {
  const std::string fifo = dir_ + "/1_0.safetensors";
  fs::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  for (bool confine : {true, false}) {
    const auto t0 = Clock::now();
    OpenOptions oo;
    oo.confine = confine;
    auto c = NoHang([&] { return OpenCheckpoint(dir_, oo); }, fifo);
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition) << c.status();
    EXPECT_THAT(std::string(c.status().message()),
                HasSubstr("1_0.safetensors: is a FIFO, not a regular file"));
    EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
  }
  // Through a source: the load fails, naming it.
  OpenOptions oo;
  oo.check_data_files = false;
  auto c = OpenCheckpoint(dir_, oo);
  ASSERT_TRUE(c.ok());
  auto plan = PlanLoad(c->metadata, {RankTargets{0, {Whole()}}});
  ASSERT_TRUE(plan.ok());
  std::vector<float> out(kRows * kCols);
  DirectorySource src(dir_);
  auto st = NoHang([&] { return ExecutePlan(*plan, src, {{out.data()}}); }, fifo);
  EXPECT_THAT(std::string(st.status().message()), HasSubstr("is a FIFO, not a regular file"));
}

TEST_P(Confined, FifoNamedLikeTheMetadataIsRefusedAtOnce) {
  const std::string fifo = dir_ + "/0.metadata";
  fs::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  auto c = NoHang([&] { return OpenCheckpoint(dir_); }, fifo);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr("0.metadata: is a FIFO, not a regular file"));
}

TEST_P(Confined, DirectoryNamedLikeADataFileIsRefused) {
  fs::remove(dir_ + "/1_0.safetensors");
  fs::create_directory(dir_ + "/1_0.safetensors");
  auto c = OpenCheckpoint(dir_, Confine());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition) << c.status();
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr("1_0.safetensors: is a directory, not a regular file"));
}

TEST_P(Confined, NamesWithSymlinkedComponentsOrDotDotAreRefused) {
  fs::create_directory(tmp_.Sub("elsewhere"));
  Spit(tmp_.Sub("elsewhere/x"), "secret");
  fs::create_symlink(tmp_.Sub("elsewhere"), dir_ + "/sub");
  auto d = Directory::Open(dir_, /*confine=*/true);
  ASSERT_TRUE(d.ok());
  auto f = (*d)->OpenFile("sub/x");
  ASSERT_FALSE(f.ok());
  EXPECT_THAT(std::string(f.status().message()),
              HasSubstr("its path component 'sub' is a symbolic link"));
  Spit(tmp_.Sub("outside"), "x");
  f = (*d)->OpenFile("../outside");
  ASSERT_FALSE(f.ok());
  EXPECT_THAT(std::string(f.status().message()),
              HasSubstr("resolves outside the checkpoint directory"));
  // A real subdirectory is fine.
  fs::create_directory(dir_ + "/real");
  Spit(dir_ + "/real/y", "ok");
  f = (*d)->OpenFile("real/y");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->size(), 2u);
  // Stat resolves the same way and never opens a FIFO for reading.
  ASSERT_EQ(::mkfifo((dir_ + "/p").c_str(), 0644), 0);
  EXPECT_TRUE((*d)->Stat("p").ok());
  EXPECT_THAT(std::string((*d)->Stat("sub/x").status().message()),
              HasSubstr("is a symbolic link"));
  EXPECT_EQ((*d)->Stat("missing").status().code(), absl::StatusCode::kNotFound);
}

// --- File identity ---------------------------------------------------------------

TEST(FileStamp, SameSizeRewriteWithMtimeRestoredIsDetected) {
  testing::TempDir tmp;
  const std::string path = tmp.Sub("d.bin");
  Spit(path, std::string(4096, 'a'));
  auto s0 = StatFile(path);
  ASSERT_TRUE(s0.ok());
  HostCache cache(1 << 20);
  std::vector<uint8_t> scratch;
  auto verified = [](const uint8_t*) { return absl::OkStatus(); };
  {
    CachingSource src(tmp.path(), &cache, {{"d.bin", *s0}});
    ASSERT_TRUE(src.Fetch("d.bin", 0, 4096, scratch, verified).ok());
  }
  // ctime has a coarse clock: let it move on before rewriting.
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  {
    const int fd = ::open(path.c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    const std::string b(4096, 'b');
    ASSERT_EQ(::pwrite(fd, b.data(), b.size(), 0), 4096);
    ::close(fd);
  }
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  struct timespec times[2];
  times[0] = st.st_atim;
  times[1].tv_sec = s0->mtime_ns / 1000000000;
  times[1].tv_nsec = s0->mtime_ns % 1000000000;
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
  auto s1 = StatFile(path);
  ASSERT_TRUE(s1.ok());
  EXPECT_EQ(s1->size, s0->size);
  EXPECT_EQ(s1->mtime_ns, s0->mtime_ns);
  EXPECT_EQ(s1->ino, s0->ino);
  EXPECT_NE(s1->ctime_ns, s0->ctime_ns);
  EXPECT_NE(*s1, *s0);
  // The cache keys on it: the rewritten file misses ...
  EXPECT_FALSE(cache.Lookup(path, *s1, 0, 4096).has_value());
  EXPECT_TRUE(cache.Lookup(path, *s0, 0, 4096).has_value());
  // ... and a load planned against the old identity fails instead of being
  // served the old bytes.
  CachingSource src(tmp.path(), &cache, {{"d.bin", *s0}});
  auto v = src.Fetch("d.bin", 0, 4096, scratch, verified);
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(v.status().message()), HasSubstr("d.bin: file changed"));
}

TEST(FileStamp, OpenCheckpointStampsTheFilesItRead) {
  testing::TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  ASSERT_TRUE(SaveVersion(dir, 0, 1.f).ok());
  auto c = OpenCheckpoint(dir);
  ASSERT_TRUE(c.ok());
  ASSERT_EQ(c->file_stamps.size(), 3u);
  for (const std::string f : {"0.metadata", "0_0.safetensors", "1_0.safetensors"}) {
    ASSERT_TRUE(c->file_stamps.count(f)) << f;
    EXPECT_EQ(c->file_stamps.at(f), *StatFile(dir + "/" + f)) << f;
  }
}

// --- The data cache keeps verified bytes only ------------------------------------

// Host destinations copied by the staged path (the executor's Fetch).
class StagedDelivery final : public Delivery {
 public:
  explicit StagedDelivery(std::vector<std::vector<void*>> d) : host_(std::move(d)) {}
  absl::StatusOr<int64_t> Copy(size_t r, const RankPlan& rank, const CopyOp& op,
                               const uint8_t* src) override {
    return host_.Copy(r, rank, op, src);
  }

 private:
  HostDelivery host_;
};

class CacheVerification : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    dir_ = tmp_.Sub("ckpt");
    ASSERT_TRUE(SaveVersion(dir_, 0, 2.f).ok());
  }
  // Loads "w" whole through a CachingSource over `cache` (the piece-wise
  // path, or the staged one when GetParam()).
  absl::StatusOr<LoadStats> Load(HostCache& cache, bool verify, std::vector<float>* out) {
    auto c = OpenCheckpoint(dir_);
    if (!c.ok()) return c.status();
    PlanOptions po;
    po.max_read_bytes = 2048;  // several reads per file
    auto plan = PlanLoad(c->metadata, {RankTargets{0, {Whole()}}}, po);
    if (!plan.ok()) return plan.status();
    out->assign(kRows * kCols, 0.f);
    CachingSource src(dir_, &cache, c->file_stamps);
    ExecuteOptions eo;
    eo.verify_checksums = verify;
    eo.piece_bytes = 256;
    if (GetParam()) {
      StagedDelivery d({{out->data()}});
      return ExecutePlan(*plan, src, d, eo);
    }
    return ExecutePlan(*plan, src, {{out->data()}}, eo);
  }
  testing::TempDir tmp_;
  std::string dir_;
};

INSTANTIATE_TEST_SUITE_P(Paths, CacheVerification, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "staged" : "piecewise"; });

TEST_P(CacheVerification, UnverifiedFillIsNotCachedAndHitsAreNotRehashed) {
  HostCache cache(1 << 24);
  std::vector<float> out;
  const uint64_t total = kRows * kCols * sizeof(float);
  // Without verification: delivered, nothing kept.
  auto st = Load(cache, /*verify=*/false, &out);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(out, Values(2.f));
  EXPECT_EQ(st->bytes_read, total);
  EXPECT_EQ(st->checksums_verified, 0);
  EXPECT_EQ(cache.stats().entries, 0u);
  EXPECT_EQ(cache.stats().bytes, 0u);
  // Verified: kept.
  st = Load(cache, /*verify=*/true, &out);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(out, Values(2.f));
  EXPECT_EQ(st->bytes_read, total);
  EXPECT_GT(st->checksums_verified, 0);
  EXPECT_GT(cache.stats().entries, 0u);
  EXPECT_EQ(cache.stats().bytes, total);
  // Hits (verified when filled) are served as they are, with or without
  // verification asked for: nothing is read or hashed again.
  for (bool verify : {true, false}) {
    st = Load(cache, verify, &out);
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(out, Values(2.f));
    EXPECT_EQ(st->bytes_from_cache, total);
    EXPECT_EQ(st->bytes_read, 0u);
    EXPECT_EQ(st->checksums_verified, 0);
  }
}

TEST_P(CacheVerification, CorruptBytesNeverReachTheCache) {
  // Flip one data byte of rank 1's file (its stamp is taken afterwards, so
  // only the checksum can tell).
  const std::string f = dir_ + "/1_0.safetensors";
  std::string bytes = Slurp(f);
  const uint64_t bad = bytes.size() - 100;
  bytes[bad] ^= 0x5a;
  Spit(f, bytes);
  auto stamp = StatFile(f);
  ASSERT_TRUE(stamp.ok());
  HostCache cache(1 << 24);
  std::vector<float> out;
  auto st = Load(cache, /*verify=*/true, &out);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.status().code(), absl::StatusCode::kDataLoss) << st.status();
  EXPECT_THAT(std::string(st.status().message()), HasSubstr("1_0.safetensors"));
  // (Other reads verified fine and may be cached; not the corrupt one.)
  EXPECT_FALSE(cache.Lookup(f, *stamp, bad, 1).has_value());
  // Unverified, the load delivers what is on disk, but keeps none of it.
  const uint64_t entries = cache.stats().entries;
  st = Load(cache, /*verify=*/false, &out);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_FALSE(cache.Lookup(f, *stamp, bad, 1).has_value());
  EXPECT_EQ(cache.stats().entries, entries);
}

TEST(CachingSourceFetch, WithoutAVerifyFunctionNothingIsKept) {
  testing::TempDir tmp;
  Spit(tmp.Sub("d.bin"), std::string(256, 'x'));
  auto stamp = StatFile(tmp.Sub("d.bin"));
  ASSERT_TRUE(stamp.ok());
  HostCache cache(1 << 20);
  CachingSource src(tmp.path(), &cache, {{"d.bin", *stamp}});
  std::vector<uint8_t> scratch;
  auto v = src.Fetch("d.bin", 0, 256, scratch, nullptr);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_TRUE(v->from_storage);
  EXPECT_EQ(v->data[0], 'x');
  EXPECT_EQ(cache.stats().entries, 0u);
  // A failing verification keeps nothing either.
  v = src.Fetch("d.bin", 0, 256, scratch,
                [](const uint8_t*) { return absl::DataLossError("bad checksum"); });
  EXPECT_FALSE(v.ok());
  EXPECT_EQ(cache.stats().entries, 0u);
}

// --- Saves: durable, atomic, checksums of the written bytes ------------------------

TEST(Save, LeavesNoTemporariesAndChecksumsMatchTheFile) {
  testing::TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  ASSERT_TRUE(SaveVersion(dir, 3, 1.f).ok());
  for (const auto& e : fs::directory_iterator(dir)) {
    EXPECT_THAT(e.path().filename().string(), Not(HasSubstr(".tmp.")));
  }
  auto w = LoadW(dir);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(*w, Values(1.f));
}

TEST(Save, ChecksumsAreOfTheBytesWrittenEvenWhileTheSourceChanges) {
  testing::TempDir tmp;
  const uint64_t n = 24ull << 20;
  std::vector<uint8_t> buf(n, 7);
  std::atomic<bool> stop{false};
  // A "client" still writing its memory while the save runs. It stands for
  // another process writing shared memory, which ThreadSanitizer cannot see:
  // its writes race with the save on purpose, so under TSan this thread's
  // accesses are not recorded.
  std::thread scribbler([&] {
#if CKPT_TSAN
    __tsan_ignore_thread_begin();
#endif
    volatile uint8_t* p = buf.data();
    uint64_t i = 0;
    while (!stop.load(std::memory_order_relaxed)) {
      p[(i * 2654435761u) % n] = static_cast<uint8_t>(i);
      ++i;
    }
#if CKPT_TSAN
    __tsan_ignore_thread_end();
#endif
  });
  auto written = WriteSafetensors(tmp.Sub("x.safetensors"), {{"x", DType::kU8, {int64_t(n)},
                                                               buf.data()}},
                                  {}, 1 << 20);
  stop = true;
  scribbler.join();
  ASSERT_TRUE(written.ok()) << written.status();
  const std::string file = Slurp(tmp.Sub("x.safetensors"));
  ASSERT_EQ(file.size(), (*written)[0].end);
  EXPECT_EQ((*written)[0].xxh3,
            BlockChecksums(file.data() + (*written)[0].begin, n, 1 << 20));
}

TEST(Save, AtomicWriteReplacesASymlinkInsteadOfFollowingIt) {
  testing::TempDir tmp;
  Spit(tmp.Sub("victim"), "precious");
  fs::create_directory(tmp.Sub("d"));
  fs::create_symlink(tmp.Sub("victim"), tmp.Sub("d/0.metadata"));
  ASSERT_TRUE(WriteFileAtomic(tmp.Sub("d/0.metadata"), "new").ok());
  EXPECT_EQ(Slurp(tmp.Sub("victim")), "precious");
  EXPECT_TRUE(fs::is_regular_file(fs::symlink_status(tmp.Sub("d/0.metadata"))));
  EXPECT_EQ(Slurp(tmp.Sub("d/0.metadata")), "new");
}

TEST(Save, AHalfWrittenVersionIsInvisibleAndThePreviousOneLoads) {
  testing::TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  ASSERT_TRUE(SaveVersion(dir, 0, 1.f).ok());
  // Version 1 died after its data files were renamed into place, before its
  // metadata: plus temporaries a killed writer leaves behind.
  std::vector<float> v = Values(9.f);
  std::vector<RankTargets> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back({r, {TargetTensor{"w", DType::kF32, {kRows, kCols},
                                      Box{{r * kRows / 2, 0}, {kRows / 2, kCols}}, std::nullopt}}});
  }
  auto plan = PlanSave(ranks, 2, 1, 1024);
  ASSERT_TRUE(plan.ok());
  ASSERT_TRUE(WriteRankFile(dir, *plan, 0, {v.data()}).ok());
  ASSERT_TRUE(WriteRankFile(dir, *plan, 1, {v.data() + kRows / 2 * kCols}).ok());
  Spit(dir + "/1.metadata.tmp.4242.17", "{\"half\": ");
  Spit(dir + "/0_2.safetensors.tmp.4242.18", std::string(100, '\0'));
  auto versions = ListVersions(dir);
  ASSERT_TRUE(versions.ok());
  EXPECT_THAT(*versions, ElementsAre(0));
  EXPECT_FALSE(*VersionExists(dir, 1));
  auto c = OpenCheckpoint(dir);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->unique_id, 0);
  auto w = LoadW(dir);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(*w, Values(1.f));
}

// A writer SIGKILLed at random points of saving versions 1, 2, ...: every
// version listed afterwards loads byte-exact, the newest by default.
TEST(Save, KilledAtRandomPointsLeavesEveryListedVersionLoadable) {
  std::mt19937 rng(14);
  for (int round = 0; round < 6; ++round) {
    testing::TempDir tmp;
    const std::string dir = tmp.Sub("ckpt");
    constexpr int64_t kBigRows = 8192;  // 1 MiB per version
    ASSERT_TRUE(SaveVersion(dir, 0, 0.f, kBigRows, 64 << 10).ok());
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      for (int64_t uid = 1; uid < 1000; ++uid) {
        if (!SaveVersion(dir, uid, static_cast<float>(uid), kBigRows, 64 << 10).ok()) _exit(3);
      }
      _exit(0);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 60000));
    ::kill(pid, SIGKILL);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    auto versions = ListVersions(dir);
    ASSERT_TRUE(versions.ok());
    ASSERT_FALSE(versions->empty());
    auto c = OpenCheckpoint(dir);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->unique_id, versions->back());
    for (int64_t uid : *versions) {
      auto w = LoadW(dir, true, uid, kBigRows);
      ASSERT_TRUE(w.ok()) << "round " << round << " version " << uid << ": " << w.status();
      ASSERT_EQ(*w, Values(static_cast<float>(uid), kBigRows * kCols)) << "version " << uid;
    }
  }
}

TEST(Save, ExistingVersionIsDetected) {
  testing::TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  EXPECT_FALSE(*VersionExists(dir, 0));  // no directory yet
  ASSERT_TRUE(SaveVersion(dir, 5, 1.f).ok());
  EXPECT_TRUE(*VersionExists(dir, 5));
  EXPECT_FALSE(*VersionExists(dir, 0));
  EXPECT_FALSE(*VersionExists(dir, 55));
  auto d = Directory::Open(dir, true);
  ASSERT_TRUE(d.ok());
  absl::Status s = PrepareSave(**d, 5);
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  EXPECT_THAT(std::string(s.message()), AllOf(HasSubstr(dir), HasSubstr("version 5 already exists")));
  EXPECT_TRUE(PrepareSave(**d, 6).ok());
  // Overwriting retracts the old version first: a save dying midway leaves
  // no version 5 rather than old metadata over new data.
  EXPECT_TRUE(PrepareSave(**d, 5, /*overwrite=*/true).ok());
  EXPECT_FALSE(*VersionExists(dir, 5));
}

TEST(DirLock, ASecondWriterIsRefusedUntilTheFirstLetsGo) {
  testing::TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  ASSERT_TRUE(MakeDirs(dir).ok());
  {
    auto first = LockDirectory(dir);
    ASSERT_TRUE(first.ok()) << first.status();
    auto second = LockDirectory(dir);
    ASSERT_FALSE(second.ok());
    EXPECT_EQ(second.status().code(), absl::StatusCode::kAborted) << second.status();
    EXPECT_THAT(std::string(second.status().message()),
                AllOf(HasSubstr(dir), HasSubstr("another writer holds its lock")));
    const auto t0 = Clock::now();
    second = LockDirectory(dir, /*wait_ms=*/150);
    EXPECT_FALSE(second.ok());
    EXPECT_GE(Clock::now() - t0, std::chrono::milliseconds(140));
    // Writes go through the locked directory.
    ASSERT_TRUE(WriteFileAtomicIn(first->directory(), "f", "x").ok());
    EXPECT_EQ(Slurp(dir + "/f"), "x");
  }
  EXPECT_TRUE(LockDirectory(dir).ok());
  // A waiting locker gets it once the holder lets go.
  auto holder = std::make_unique<DirLock>(*LockDirectory(dir));
  std::thread release([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    holder.reset();
  });
  EXPECT_TRUE(LockDirectory(dir, 5000).ok());
  release.join();
}

// flock works on a read-only descriptor: a lock file others may open is one
// anyone who can read the directory could hold forever.
TEST(DirLock, OnlyItsOwnerMayOpenTheLockFile) {
  testing::TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  ASSERT_TRUE(MakeDirs(dir).ok());
  const std::string lock = dir + "/" + kLockFileName;
  ASSERT_TRUE(LockDirectory(dir).ok());
  struct stat st;
  ASSERT_EQ(::stat(lock.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // One an earlier version left 0644 is closed to others when next taken.
  ASSERT_EQ(::chmod(lock.c_str(), 0644), 0);
  ASSERT_TRUE(LockDirectory(dir).ok());
  ASSERT_EQ(::stat(lock.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

TEST(DirLock, ASymlinkedDirectoryIsRefused) {
  testing::TempDir tmp;
  ASSERT_TRUE(MakeDirs(tmp.Sub("real")).ok());
  fs::create_symlink(tmp.Sub("real"), tmp.Sub("link"));
  auto l = LockDirectory(tmp.Sub("link"));
  ASSERT_FALSE(l.ok());
  EXPECT_EQ(l.status().code(), absl::StatusCode::kPermissionDenied) << l.status();
  EXPECT_THAT(std::string(l.status().message()),
              AllOf(HasSubstr(tmp.Sub("link")), HasSubstr("is a symbolic link")));
}

// --- Bounded parsing -------------------------------------------------------------

TEST(BoundedParsing, MetadataOverTheLimitIsRefusedNamingFileSizeAndLimit) {
  testing::TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  ASSERT_TRUE(SaveVersion(dir, 0, 1.f).ok());
  const uint64_t size = fs::file_size(dir + "/0.metadata");
  OpenOptions oo;
  oo.max_metadata_bytes = 100;
  auto c = OpenCheckpoint(dir, oo);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted) << c.status();
  EXPECT_THAT(std::string(c.status().message()),
              AllOf(HasSubstr(dir + "/0.metadata"), HasSubstr(absl::StrCat(size, " bytes")),
                    HasSubstr("max_metadata_bytes"), HasSubstr("100 bytes")));
  oo.max_metadata_bytes = size;
  EXPECT_TRUE(OpenCheckpoint(dir, oo).ok());
}

std::string HugeMemoPickle(uint32_t index) {
  std::string p = "\x80\x04N";  // PROTO 4, None
  p += 'r';                     // LONG_BINPUT
  for (int i = 0; i < 4; ++i) p += static_cast<char>((index >> (8 * i)) & 0xff);
  p += '.';
  return p;
}

TEST(BoundedParsing, TinyPickleWithAHugeMemoIndexIsRefusedQuickly) {
  const auto t0 = Clock::now();
  auto doc = pickle::ParseBuffer("0.metadata", HugeMemoPickle(1u << 26), pickle::Options{});
  ASSERT_FALSE(doc.ok());
  EXPECT_EQ(doc.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(doc.status().message()),
              AllOf(HasSubstr("0.metadata"), HasSubstr("memo index 67108864")));
  // Stepping up by (just under) the old per-op allowance of 2^20 slots, 128
  // times, would have reached 2^27 slots (2 GiB) from a 1 KiB file.
  std::string stair = "\x80\x04N";
  for (uint32_t k = 1; k <= 128; ++k) {
    stair += 'r';
    const uint32_t idx = k * ((1u << 20) - 1);
    for (int i = 0; i < 4; ++i) stair += static_cast<char>((idx >> (8 * i)) & 0xff);
  }
  stair += '.';
  doc = pickle::ParseBuffer("0.metadata", stair, pickle::Options{});
  ASSERT_FALSE(doc.ok());
  EXPECT_THAT(std::string(doc.status().message()), HasSubstr("memo index"));
  // Small indices within the bytes read are fine.
  doc = pickle::ParseBuffer("0.metadata", HugeMemoPickle(3), pickle::Options{});
  EXPECT_TRUE(doc.ok()) << doc.status();
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(1));
  // Through OpenCheckpoint (a PyTorch DCP .metadata).
  testing::TempDir tmp;
  Spit(tmp.Sub(".metadata"), HugeMemoPickle(1u << 26));
  auto c = OpenCheckpoint(tmp.path());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDataLoss) << c.status();
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("memo index"));
}

}  // namespace
}  // namespace ckpt
