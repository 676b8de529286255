// The checkpoint storage interface (core/io/file.h): the POSIX
// implementation's answers, and faults injected through a wrapper installed
// as Storage::Default(), which core's loads and saves must turn into clear
// errors without a half-written version.
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/io/file.h"
#include "core/tools/layout.h"
#include "core/tools/offline.h"
#include "core/format/safetensors.h"
#include "core/write/writer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/files.h"
#include "tests/testing/temp_dir.h"

namespace ckpt {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

std::string Base(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// What the faulty storage does and saw. Thread-safe (loads read in threads).
struct Faults {
  absl::Mutex mu;
  std::string fail_read_of;    // reads of a file with this base name fail (EIO)
  std::string fail_commit_of;  // commits of files ending so fail (ENOSPC)
  std::map<std::string, int> opened ABSL_GUARDED_BY(mu);  // base name -> opens
  int commits ABSL_GUARDED_BY(mu) = 0;

  void Opened(const std::string& path) {
    absl::MutexLock l(&mu);
    ++opened[Base(path)];
  }
};

class FaultyFile final : public RandomAccessFile {
 public:
  FaultyFile(std::unique_ptr<RandomAccessFile> inner, Faults* faults)
      : inner_(std::move(inner)), faults_(faults) {}
  const std::string& path() const override { return inner_->path(); }
  uint64_t size() const override { return inner_->size(); }
  absl::Status Read(uint64_t offset, uint64_t n, void* dst) const override {
    if (Base(path()) == faults_->fail_read_of) {
      return absl::DataLossError(absl::StrCat(path(), ": pread at ", offset,
                                              ": Input/output error (injected)"));
    }
    return inner_->Read(offset, n, dst);
  }
  absl::StatusOr<FileStamp> Stamp() const override { return inner_->Stamp(); }

 private:
  std::unique_ptr<RandomAccessFile> inner_;
  Faults* faults_;
};

class FaultyWriter final : public AtomicFileWriter {
 public:
  FaultyWriter(std::unique_ptr<AtomicFileWriter> inner, Faults* faults)
      : inner_(std::move(inner)), faults_(faults) {}
  absl::Status Append(const void* data, size_t n) override { return inner_->Append(data, n); }
  absl::Status WriteAt(uint64_t offset, const void* data, size_t n) override {
    return inner_->WriteAt(offset, data, n);
  }
  uint64_t bytes_written() const override { return inner_->bytes_written(); }
  const std::string& path() const override { return inner_->path(); }
  absl::Status Commit(bool sync) override {
    {
      absl::MutexLock l(&faults_->mu);
      ++faults_->commits;
    }
    if (!faults_->fail_commit_of.empty() && absl::EndsWith(path(), faults_->fail_commit_of)) {
      return absl::ResourceExhaustedError(
          absl::StrCat(path(), ": fsync: No space left on device (injected)"));
    }
    return inner_->Commit(sync);
  }

 private:
  std::unique_ptr<AtomicFileWriter> inner_;
  Faults* faults_;
};

class FaultyDirectory final : public Directory {
 public:
  FaultyDirectory(std::shared_ptr<const Directory> inner, Faults* faults)
      : Directory(inner->path(), inner->confine()), inner_(std::move(inner)), faults_(faults) {}
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenFile(
      const std::string& name) const override {
    auto f = inner_->OpenFile(name);
    if (!f.ok()) return f.status();
    faults_->Opened(name);
    return std::unique_ptr<RandomAccessFile>(new FaultyFile(*std::move(f), faults_));
  }
  absl::StatusOr<FileStamp> Stat(const std::string& name) const override {
    return inner_->Stat(name);
  }
  absl::StatusOr<bool> Exists(const std::string& name) const override {
    return inner_->Exists(name);
  }
  absl::StatusOr<std::vector<std::string>> List() const override { return inner_->List(); }
  absl::Status Sync() const override { return inner_->Sync(); }
  absl::Status Remove(const std::string& name) const override { return inner_->Remove(name); }
  absl::StatusOr<std::unique_ptr<AtomicFileWriter>> NewAtomicFile(
      std::shared_ptr<const Directory> self, const std::string& name) const override {
    auto w = inner_->NewAtomicFile(inner_, name);
    if (!w.ok()) return w.status();
    return std::unique_ptr<AtomicFileWriter>(new FaultyWriter(*std::move(w), faults_));
  }

 private:
  std::shared_ptr<const Directory> inner_;
  Faults* faults_;
};

class FaultyStorage final : public Storage {
 public:
  explicit FaultyStorage(Faults* faults) : faults_(faults) {}
  absl::StatusOr<std::shared_ptr<const Directory>> OpenDirectory(const std::string& path,
                                                                 bool confine,
                                                                 bool follow_last) override {
    auto d = posix_->OpenDirectory(path, confine, follow_last);
    if (!d.ok()) return d.status();
    return std::shared_ptr<const Directory>(new FaultyDirectory(*std::move(d), faults_));
  }
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenFile(const std::string& path) override {
    auto f = posix_->OpenFile(path);
    if (!f.ok()) return f.status();
    faults_->Opened(path);
    return std::unique_ptr<RandomAccessFile>(new FaultyFile(*std::move(f), faults_));
  }
  absl::StatusOr<FileStamp> Stat(const std::string& path) override { return posix_->Stat(path); }
  absl::StatusOr<PathKind> Kind(const std::string& path) override { return posix_->Kind(path); }
  absl::StatusOr<std::string> Canonical(const std::string& path) override {
    return posix_->Canonical(path);
  }
  absl::Status CreateDirectories(const std::string& path) override {
    return posix_->CreateDirectories(path);
  }
  absl::StatusOr<DirLock> LockDirectory(const std::string& dir, int64_t wait_ms) override {
    auto lock = posix_->LockDirectory(dir, wait_ms);
    if (!lock.ok()) return lock.status();
    // Writes through the locked directory go through the faults too.
    auto faulty = std::make_shared<FaultyDirectory>(lock->directory(), faults_);
    return DirLock(std::move(faulty), std::make_unique<HeldLock>(*std::move(lock)));
  }

 private:
  struct HeldLock : DirLock::Held {
    explicit HeldLock(DirLock l) : lock(std::move(l)) {}
    DirLock lock;
  };
  Storage* const posix_ = Storage::Posix();
  Faults* faults_;
};

// Installs `storage` as Storage::Default() for the scope.
class ScopedStorage {
 public:
  explicit ScopedStorage(Storage* s) : before_(internal::SetDefaultStorageForTesting(s)) {}
  ~ScopedStorage() { internal::SetDefaultStorageForTesting(before_); }

 private:
  Storage* before_;
};

TargetTensor Target(const std::string& name, Shape global, Shape offset, Shape shape) {
  return TargetTensor{name, DType::kF32, std::move(global), Box{std::move(offset), std::move(shape)},
                      std::nullopt};
}

// A native checkpoint of w = arange(32) as (4, 8), saved by 2 ranks (rows),
// written with the real POSIX storage; the layout that loads it by columns.
Layout SavedByRows() {
  Layout l;
  l.world_size = 2;
  l.ranks = {{0, {Target("w", {4, 8}, {0, 0}, {2, 8})}},
             {1, {Target("w", {4, 8}, {2, 0}, {2, 8})}}};
  return l;
}
Layout LoadedByColumns() {
  Layout l;
  l.world_size = 2;
  l.ranks = {{0, {Target("w", {4, 8}, {0, 0}, {4, 4})}},
             {1, {Target("w", {4, 8}, {0, 4}, {4, 4})}}};
  return l;
}
std::string MakeSource(const testing::TempDir& tmp) {
  std::vector<float> w(32);
  for (int i = 0; i < 32; ++i) w[i] = static_cast<float>(i);
  const std::string src = tmp.Sub("src");
  EXPECT_TRUE(MakeDirs(src).ok());
  EXPECT_TRUE(WriteSafetensors(src + "/model.safetensors", {{"w", DType::kF32, {4, 8}, w.data()}},
                               {})
                  .ok());
  return src;
}

std::set<std::string> Names(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

TEST(Storage, EveryFileOfAnOfflineLoadIsOpenedThroughTheInstalledStorage) {
  testing::TempDir tmp;
  ASSERT_TRUE(ShardCheckpoint(MakeSource(tmp), SavedByRows(), tmp.Sub("ckpt"), {}).ok());
  Faults faults;
  FaultyStorage storage(&faults);
  {
    ScopedStorage installed(&storage);
    ASSERT_EQ(Storage::Default(), &storage);
    auto res = LoadOffline(tmp.Sub("ckpt"), LoadedByColumns(), {});
    ASSERT_TRUE(res.ok()) << res.status();
    const float* out = reinterpret_cast<const float*>(res->buffers[1].tensors[0].data());
    EXPECT_EQ(out[0], 4.f);   // w[0][4]
    EXPECT_EQ(out[15], 31.f);  // w[3][7]
  }
  EXPECT_EQ(Storage::Default(), internal::SchemeRouter());
  absl::MutexLock l(&faults.mu);
  // The metadata and both data files (every file the load needs).
  EXPECT_GE(faults.opened["0.metadata"], 1) << "metadata not read through the storage";
  EXPECT_GE(faults.opened["0_0.safetensors"], 1);
  EXPECT_GE(faults.opened["1_0.safetensors"], 1);
}

TEST(Storage, AReadFaultFailsTheLoadNamingTheFile) {
  testing::TempDir tmp;
  ASSERT_TRUE(ShardCheckpoint(MakeSource(tmp), SavedByRows(), tmp.Sub("ckpt"), {}).ok());
  Faults faults;
  faults.fail_read_of = "1_0.safetensors";
  FaultyStorage storage(&faults);
  ScopedStorage installed(&storage);
  auto res = LoadOffline(tmp.Sub("ckpt"), LoadedByColumns(), {});
  ASSERT_FALSE(res.ok()) << "a load through a failing read must not succeed";
  EXPECT_EQ(res.status().code(), absl::StatusCode::kDataLoss) << res.status();
  EXPECT_THAT(std::string(res.status().message()), HasSubstr("1_0.safetensors"));
}

TEST(Storage, ACommitFaultLeavesNoVersionAndNoTemporaries) {
  testing::TempDir tmp;
  const std::string src = MakeSource(tmp);
  Faults faults;
  faults.fail_commit_of = "1_0.safetensors";
  FaultyStorage storage(&faults);
  absl::Status s;
  {
    ScopedStorage installed(&storage);
    s = ShardCheckpoint(src, SavedByRows(), tmp.Sub("out"), {});
  }
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("1_0.safetensors"));
  {
    absl::MutexLock l(&faults.mu);
    EXPECT_GE(faults.commits, 1) << "the save's writes did not go through the storage";
  }
  // No metadata (the version does not exist) and no temporary left behind.
  for (const std::string& n : Names(tmp.Sub("out"))) {
    EXPECT_FALSE(absl::EndsWith(n, ".metadata")) << n;
    EXPECT_FALSE(absl::StrContains(n, ".tmp.")) << n;
    EXPECT_NE(n, "1_0.safetensors");
  }
  // The same save without the fault then succeeds and loads.
  ASSERT_TRUE(ShardCheckpoint(src, SavedByRows(), tmp.Sub("out"), {}).ok());
  EXPECT_TRUE(LoadOffline(tmp.Sub("out"), LoadedByColumns(), {}).ok());
}

TEST(PosixStorage, KindsPathsDirectoriesAndRemoval) {
  testing::TempDir tmp;
  Storage* posix = Storage::Posix();
  EXPECT_EQ(*posix->Kind(tmp.Sub("nothing")), PathKind::kMissing);
  EXPECT_EQ(*posix->Kind(tmp.path()), PathKind::kDirectory);
  ASSERT_TRUE(posix->CreateDirectories(tmp.Sub("a/b/c")).ok());
  EXPECT_EQ(*posix->Kind(tmp.Sub("a/b/c")), PathKind::kDirectory);
  testing::Spit(tmp.Sub("a/f"), "x");
  EXPECT_EQ(*posix->Kind(tmp.Sub("a/f")), PathKind::kFile);
  fs::create_symlink(tmp.Sub("a/b"), tmp.Sub("link"));
  EXPECT_EQ(*posix->Kind(tmp.Sub("link")), PathKind::kSymlink);
  // A file where a directory must be.
  auto bad = posix->CreateDirectories(tmp.Sub("a/f/g"));
  EXPECT_FALSE(bad.ok());
  // Canonical resolves symlinks; a missing path is NOT_FOUND naming it.
  auto c = posix->Canonical(tmp.Sub("link/c"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(*c, fs::canonical(tmp.Sub("a/b/c")).string());
  auto missing = posix->Canonical(tmp.Sub("nope"));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr(tmp.Sub("nope")));
  // Stat carries the identity and, on POSIX, the owner and mode bits.
  auto st = posix->Stat(tmp.Sub("a/f"));
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->size, 1u);
  EXPECT_TRUE(st->has_owner);
  EXPECT_EQ(st->uid, ::geteuid());
  // Remove: a missing name is fine, a path is refused, a file goes.
  auto d = posix->OpenDirectory(tmp.Sub("a"), /*confine=*/true, /*follow_last=*/false);
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE((*d)->Remove("not-there").ok());
  EXPECT_EQ((*d)->Remove("b/c").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*d)->Remove("f").ok());
  EXPECT_FALSE(*(*d)->Exists("f"));
}

}  // namespace
}  // namespace ckpt
