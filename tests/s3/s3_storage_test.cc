// The S3 storage (core/io/s3) against a real Ceph S3 gateway started for
// this binary (tests/s3/rgw.sh): requests, errors, credentials, and core's
// own shard-and-load through "s3://" paths.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/format/safetensors.h"
#include "core/io/file.h"
#include "core/io/s3/s3_client.h"
#include "core/io/s3/s3_storage.h"
#include "core/io/s3/s3_url.h"
#include "core/tools/layout.h"
#include "core/tools/offline.h"
#include "core/write/writer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/s3/rgw_fixture.h"
#include "tests/testing/files.h"
#include "tests/testing/temp_dir.h"

namespace ckpt {
namespace {

using ::testing::HasSubstr;
using s3::RequestSlots;
using s3::S3Client;
using s3::S3Settings;

testing::RgwEnvironment* const g_rgw = static_cast<testing::RgwEnvironment*>(
    ::testing::AddGlobalTestEnvironment(new testing::RgwEnvironment()));

const std::string kBucket = testing::Rgw::Bucket();

// A prefix no other test uses.
std::string Fresh(const std::string& what) {
  static int n = 0;
  return absl::StrCat("t", getpid(), "-", ++n, "-", what);
}

s3::Getenv ProcessEnv() {
  return [](const char* name) { return std::getenv(name); };
}

std::unique_ptr<S3Client> Client(S3Settings settings = {}, s3::Getenv env = ProcessEnv()) {
  auto c = S3Client::Create(settings, env);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

s3::S3Storage* Registered() {
  static s3::S3Storage* storage = [] {
    s3::S3StorageOptions o;
    o.part_bytes = 5 << 20;  // multipart above 5 MiB
    auto s = s3::RegisterS3Storage(S3Settings{}, o);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : nullptr;
  }();
  return storage;
}

TEST(S3Client, PutHeadRangedGetAndMissingObjects) {
  auto c = Client();
  ASSERT_NE(c, nullptr);
  const std::string key = Fresh("obj");
  std::string data(100000, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7 + 3);
  ASSERT_TRUE(c->Put(kBucket, key, data.data(), data.size()).ok());
  auto info = c->Head(kBucket, key);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->size, data.size());
  EXPECT_FALSE(info->etag.empty());
  EXPECT_GT(info->mtime_ns, 0);
  std::string got(1000, 'x');
  ASSERT_TRUE(c->GetRange(kBucket, key, 54321, 1000, got.data(), info->etag).ok());
  EXPECT_EQ(got, data.substr(54321, 1000));

  auto missing = c->Head(kBucket, key + "-not-there");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()),
              HasSubstr(absl::StrCat("s3://", kBucket, "/", key, "-not-there")));
  absl::Status get = c->GetRange(kBucket, key + "-not-there", 0, 10, got.data(), "");
  EXPECT_EQ(get.code(), absl::StatusCode::kNotFound) << get;
  // Past the end: the server says 416.
  absl::Status past = c->GetRange(kBucket, key, data.size() + 10, 10, got.data(), "");
  EXPECT_EQ(past.code(), absl::StatusCode::kOutOfRange) << past;
  EXPECT_EQ(c->stats().retries.load(), 0u) << "nothing here is worth a retry";
}

TEST(S3Client, ListingsPageWithContinuationTokensAndGroupByDelimiter) {
  auto c = Client();
  ASSERT_NE(c, nullptr);
  const std::string prefix = Fresh("list");
  for (const char* name : {"a", "b", "c", "d/x", "d/y", "e"}) {
    ASSERT_TRUE(c->Put(kBucket, absl::StrCat(prefix, "/", name), name, 1).ok());
  }
  auto page = c->List(kBucket, prefix + "/", "", "", 2);
  ASSERT_TRUE(page.ok()) << page.status();
  EXPECT_EQ(page->objects.size(), 2u);
  EXPECT_TRUE(page->truncated);
  EXPECT_FALSE(page->next_token.empty());
  auto all = c->ListAll(kBucket, prefix + "/", "/", 100);
  ASSERT_TRUE(all.ok()) << all.status();
  std::vector<std::string> keys;
  for (const auto& o : all->objects) keys.push_back(o.key.substr(prefix.size() + 1));
  EXPECT_THAT(keys, ::testing::ElementsAre("a", "b", "c", "e"));
  EXPECT_THAT(all->common_prefixes, ::testing::ElementsAre(prefix + "/d/"));
  auto capped = c->ListAll(kBucket, prefix + "/", "", 3);
  EXPECT_EQ(capped.status().code(), absl::StatusCode::kResourceExhausted) << capped.status();
}

TEST(S3Client, TheBandwidthCapPacesEveryRequestTogether) {
  auto fast = Client();
  ASSERT_NE(fast, nullptr);
  const std::string key = Fresh("capped");
  std::string data(12 << 20, 'c');
  ASSERT_TRUE(fast->Put(kBucket, key, data.data(), data.size()).ok());
  S3Settings capped;
  capped.max_bytes_per_s = 8 << 20;  // 8 MiB/s
  auto slow = Client(capped);
  ASSERT_NE(slow, nullptr);
  // Two readers of 6 MiB each at once: 12 MiB through one 8 MiB/s cap
  // cannot take less than 1.5 s (less the 50 ms burst).
  std::string a(6 << 20, '\0'), b(6 << 20, '\0');
  const auto t0 = std::chrono::steady_clock::now();
  std::thread other([&] { EXPECT_TRUE(slow->GetRange(kBucket, key, 0, a.size(), a.data(), "").ok()); });
  EXPECT_TRUE(slow->GetRange(kBucket, key, 6 << 20, b.size(), b.data(), "").ok());
  other.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(s, 1.4) << "12 MiB moved in " << s << " s through an 8 MiB/s cap";
  EXPECT_EQ(a + b, data);
}

// A client made with another's bounds (a daemon's root with settings of its
// own) shares its cap and its request slots: one bound for the daemon.
TEST(S3Client, AClientSharingBoundsWaitsForTheOthersRequestSlot) {
  S3Settings one;
  one.max_requests = 1;
  auto first = Client(one);
  ASSERT_NE(first, nullptr);
  S3Settings own;  // would be unbounded on its own
  auto c = S3Client::Create(own, ProcessEnv(), first->bounds());
  ASSERT_TRUE(c.ok()) << c.status();
  std::unique_ptr<S3Client> second = *std::move(c);
  EXPECT_EQ(&second->slots(), &first->slots());
  const std::string key = Fresh("shared-bounds");
  ASSERT_TRUE(first->Put(kBucket, key, "x", 1).ok());
  ASSERT_TRUE(first->bounds().slots->Acquire("the test").ok());  // the daemon's one slot
  std::atomic<bool> done{false};
  std::thread head([&] {
    EXPECT_TRUE(second->Head(kBucket, key).ok());
    done = true;
  });
  absl::SleepFor(absl::Milliseconds(300));
  const bool early = done;
  first->bounds().slots->Release();
  head.join();
  EXPECT_FALSE(early) << "the second client's HEAD went ahead of the shared bound";
  EXPECT_GE(first->slots().waited_s(), 0.25);
}

// s3.max_requests: a waiter is woken by a Release, waits on while the
// holders move bytes, and gives up (UNAVAILABLE, naming what waited and the
// bound) only once none moved for 2 x stall + 1 s.
TEST(S3Client, RequestSlotsWaitWhileHoldersMoveAndGiveUpWhenTheyDoNot) {
  RequestSlots slots(/*max=*/1, /*stall_ns=*/100'000'000);  // bound: 1.2 s
  ASSERT_TRUE(slots.Acquire("a").ok());
  // Woken by the holder's Release.
  absl::Status got = absl::UnknownError("not yet");
  std::thread b([&] { got = slots.Acquire("b"); });
  absl::SleepFor(absl::Milliseconds(200));
  slots.Release();
  b.join();
  EXPECT_TRUE(got.ok()) << got;
  EXPECT_GE(slots.waited_s(), 0.15);
  // b holds the slot now. c waits 1.8 s (past the bound) while b moves bytes.
  std::atomic<bool> done{false};
  std::thread c([&] {
    got = slots.Acquire("s3://bucket/c");
    done = true;
  });
  bool early = false;
  for (int i = 0; i < 18 && !early; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    slots.Moved();
    early = done;
  }
  // b stops moving: c gives up after about 1.2 s.
  const absl::Time stopped = absl::Now();
  c.join();
  const absl::Duration took = absl::Now() - stopped;
  ASSERT_FALSE(early) << "gave up while the holder moved bytes: " << got;
  EXPECT_TRUE(absl::IsUnavailable(got)) << got;
  EXPECT_THAT(std::string(got.message()),
              HasSubstr("s3://bucket/c: no request slot came free (max_requests 1)"));
  EXPECT_GE(took, absl::Milliseconds(1000));
  EXPECT_LE(took, absl::Milliseconds(2500));
  slots.Release();
  EXPECT_TRUE(slots.Acquire("d").ok());  // free again at once
  slots.Release();
  EXPECT_EQ(slots.peak(), 1);
  // Unbounded: never waits, counts the peak.
  RequestSlots open(/*max=*/0, 100'000'000);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(open.Acquire("e").ok());
  EXPECT_EQ(open.peak(), 5);
  EXPECT_EQ(open.waited_s(), 0.0);
}

TEST(S3Client, AWrongSecretIsPermissionDeniedNamingTheObject) {
  S3Settings s;
  std::map<std::string, std::string> env = {
      {"AWS_ENDPOINT_URL", g_rgw->rgw().endpoint()},
      {"AWS_ACCESS_KEY_ID", std::getenv("AWS_ACCESS_KEY_ID")},
      {"AWS_SECRET_ACCESS_KEY", "not-the-secret"}};
  auto c = Client(s, [&env](const char* n) -> const char* {
    auto it = env.find(n);
    return it == env.end() ? nullptr : it->second.c_str();
  });
  ASSERT_NE(c, nullptr);
  auto info = c->Head(kBucket, "anything");
  EXPECT_EQ(info.status().code(), absl::StatusCode::kPermissionDenied) << info.status();
  std::string buf(4, '\0');
  absl::Status get = c->GetRange(kBucket, "some/key", 0, 4, buf.data(), "");
  EXPECT_EQ(get.code(), absl::StatusCode::kPermissionDenied) << get;
  EXPECT_THAT(std::string(get.message()), HasSubstr("s3://ckptd-test/some/key"));
  EXPECT_THAT(std::string(get.message()), HasSubstr("403"));
  EXPECT_THAT(std::string(get.message()), ::testing::Not(HasSubstr("not-the-secret")));
}

TEST(S3Client, CredentialsComeFromTheSharedFileAndRotationsArePickedUp) {
  testing::TempDir tmp;
  const std::string file = tmp.Sub("credentials");
  const std::string key_id = std::getenv("AWS_ACCESS_KEY_ID");
  const std::string secret = std::getenv("AWS_SECRET_ACCESS_KEY");
  testing::Spit(file, absl::StrCat("[default]\naws_access_key_id = nobody\n"
                                   "aws_secret_access_key = nothing\n\n[ci]\n"
                                   "aws_access_key_id = ", key_id, "\n"
                                   "aws_secret_access_key = stale\n"));
  std::map<std::string, std::string> env = {{"AWS_ENDPOINT_URL", g_rgw->rgw().endpoint()},
                                            {"AWS_SHARED_CREDENTIALS_FILE", file},
                                            {"AWS_CONFIG_FILE", tmp.Sub("no-config")},
                                            {"AWS_PROFILE", "ci"}};
  auto c = Client(S3Settings{}, [&env](const char* n) -> const char* {
    auto it = env.find(n);
    return it == env.end() ? nullptr : it->second.c_str();
  });
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->CredentialsSource(), file + " [ci]");
  auto before = c->List(kBucket, "", "", "", 1);
  EXPECT_EQ(before.status().code(), absl::StatusCode::kPermissionDenied) << before.status();
  // The secret rotated in the file: picked up within a second or so.
  testing::Spit(file, absl::StrCat("[ci]\naws_access_key_id = ", key_id,
                                   "\naws_secret_access_key = ", secret, "\n"));
  absl::Status after = absl::UnknownError("not tried");
  for (int i = 0; i < 30 && !after.ok(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    after = c->List(kBucket, "", "", "", 1).status();
  }
  EXPECT_TRUE(after.ok()) << after;
}

TEST(S3Storage, AnObjectReplacedAfterOpeningAbortsItsReads) {
  ASSERT_NE(Registered(), nullptr);
  const std::string dir = absl::StrCat("s3://", kBucket, "/", Fresh("changed"));
  ASSERT_TRUE(WriteFileAtomic(dir + "/f", std::string(4096, 'a')).ok());
  auto f = OpenFile(dir + "/f");
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_TRUE(WriteFileAtomic(dir + "/f", std::string(4096, 'b')).ok());
  std::string buf(16, '\0');
  absl::Status s = (*f)->Read(0, 16, buf.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("changed"));
  EXPECT_NE(buf, std::string(16, 'b')) << "bytes of the new object read as the old one's";
  auto stamp_then = (*f)->Stamp();
  auto stamp_now = StatFile(dir + "/f");
  ASSERT_TRUE(stamp_then.ok() && stamp_now.ok());
  EXPECT_NE(*stamp_then, *stamp_now);
}

// An object opened right after its prefix's listing takes its size, ETag and
// time from it (no HEAD), and its stamp is the one a HEAD gives (the check
// once a load is done compares them: a listing's milliseconds against a
// HEAD's whole seconds must not read as a change); past the listing's reuse,
// or for an object it does not hold, a HEAD.
TEST(S3Storage, AnObjectOpenedRightAfterItsListingNeedsNoHeadAndKeepsItsStamp) {
  ASSERT_NE(Registered(), nullptr);
  s3::S3Storage* st = Registered();
  const std::string dir = absl::StrCat("s3://", kBucket, "/", Fresh("listed"));
  ASSERT_TRUE(WriteFileAtomic(dir + "/a", std::string(5000, 'a')).ok());
  ASSERT_TRUE(WriteFileAtomic(dir + "/b", std::string(3000, 'b')).ok());
  auto d = st->OpenDirectory(dir, /*confine=*/true, /*follow_last=*/true);
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_TRUE((*d)->List().ok());
  const uint64_t heads = st->client().stats().heads.load();
  auto a = (*d)->OpenFile("a");
  auto b = OpenFile(dir + "/b");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(st->client().stats().heads.load(), heads) << "a HEAD despite the listing";
  EXPECT_EQ((*a)->size(), 5000u);
  EXPECT_EQ((*b)->size(), 3000u);
  std::string buf(4, '\0');
  ASSERT_TRUE((*a)->Read(4996, 4, buf.data()).ok());
  EXPECT_EQ(buf, "aaaa");
  auto listed = (*a)->Stamp();
  auto headed = (*d)->Stat("a");  // always a HEAD
  ASSERT_TRUE(listed.ok() && headed.ok());
  EXPECT_EQ(st->client().stats().heads.load(), heads + 1);
  EXPECT_EQ(*listed, *headed) << "mtime " << listed->mtime_ns << " vs " << headed->mtime_ns;
  EXPECT_FALSE(st->Listed(s3::S3Url{kBucket, "no/such/key"}).has_value());
  absl::SleepFor(absl::Milliseconds(s3::S3Storage::kListingReuseMs + 100));
  auto again = (*d)->OpenFile("a");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(st->client().stats().heads.load(), heads + 2) << "a stale listing trusted";
}

TEST(S3Storage, WritesAreAtomicPutsOrMultipartUploadsAndReadBackExactly) {
  ASSERT_NE(Registered(), nullptr);
  const std::string dir = absl::StrCat("s3://", kBucket, "/", Fresh("write"));
  auto d = Directory::Open(dir, /*confine=*/true);
  ASSERT_TRUE(d.ok()) << d.status();
  // 12 MiB + 3 bytes: three parts of 5 MiB; its header patched after the
  // data (WriteAt), as the DCP writer patches zip CRCs.
  std::string data((12 << 20) + 3, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>((i * 131) >> 3);
  const uint64_t puts_before = Registered()->client().stats().puts.load();
  {
    // A writer dropped before Commit uploads nothing.
    auto dropped = AtomicFileWriter::CreateIn(*d, "big.bin");
    ASSERT_TRUE(dropped.ok()) << dropped.status();
    ASSERT_TRUE((*dropped)->Append(data).ok());
  }
  EXPECT_EQ(Registered()->client().stats().puts.load(), puts_before);
  auto w = AtomicFileWriter::CreateIn(*d, "big.bin");
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE((*w)->Append(std::string(8, '\0')).ok());
  ASSERT_TRUE((*w)->Append(data.data() + 8, data.size() - 8).ok());
  ASSERT_TRUE((*w)->WriteAt(0, data.data(), 8).ok());
  auto exists = (*d)->Exists("big.bin");
  ASSERT_TRUE(exists.ok());
  EXPECT_FALSE(*exists) << "an uncommitted file is visible";
  ASSERT_TRUE((*w)->Commit().ok());
  // CreateMultipart + 3 parts + Complete.
  EXPECT_EQ(Registered()->client().stats().puts.load() - puts_before, 5u);
  auto f = (*d)->OpenFile("big.bin");
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ((*f)->size(), data.size());
  std::string back(data.size(), '\0');
  ASSERT_TRUE((*f)->Read(0, back.size(), back.data()).ok());
  EXPECT_TRUE(back == data) << "the uploaded bytes differ";
  auto names = (*d)->List();
  ASSERT_TRUE(names.ok()) << names.status();
  EXPECT_THAT(*names, ::testing::ElementsAre("big.bin"));
  ASSERT_TRUE((*d)->Remove("big.bin").ok());
  EXPECT_EQ((*d)->OpenFile("big.bin").status().code(), absl::StatusCode::kNotFound);
}

TEST(S3Storage, PathsAreCheckedAndUnknownSchemesRefused) {
  ASSERT_NE(Registered(), nullptr);
  for (const char* bad : {"s3://ckptd-test/a/../b", "s3://ckptd-test/a//b", "s3://UPPER/x",
                          "s3://ckptd-test/a/./b", "s3://x"}) {
    auto c = Storage::Default()->Canonical(bad);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  auto ok = Storage::Default()->Canonical("s3://ckptd-test/a/b/");
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, "s3://ckptd-test/a/b");
  auto gs = Storage::Default()->OpenFile("gs://bucket/x");
  EXPECT_EQ(gs.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(gs.status().message()), HasSubstr("no storage for scheme 'gs'"));
  const std::string dir = absl::StrCat("s3://", kBucket, "/", Fresh("kind"));
  ASSERT_TRUE(WriteFileAtomic(dir + "/sub/f", "x").ok());
  EXPECT_EQ(*Storage::Default()->Kind(dir), PathKind::kDirectory);
  EXPECT_EQ(*Storage::Default()->Kind(dir + "/sub/f"), PathKind::kFile);
  EXPECT_EQ(*Storage::Default()->Kind(dir + "/none"), PathKind::kMissing);
}

// w = arange(32) as (4, 8) saved by rows, loaded by columns.
Layout ByRows() {
  Layout l;
  l.world_size = 2;
  l.ranks = {{0, {TargetTensor{"w", DType::kF32, {4, 8}, Box{{0, 0}, {2, 8}}, std::nullopt}}},
             {1, {TargetTensor{"w", DType::kF32, {4, 8}, Box{{2, 0}, {2, 8}}, std::nullopt}}}};
  return l;
}
Layout ByColumns() {
  Layout l;
  l.world_size = 2;
  l.ranks = {{0, {TargetTensor{"w", DType::kF32, {4, 8}, Box{{0, 0}, {4, 4}}, std::nullopt}}},
             {1, {TargetTensor{"w", DType::kF32, {4, 8}, Box{{0, 4}, {4, 4}}, std::nullopt}}}};
  return l;
}

TEST(S3Storage, CoreShardsIntoAndLoadsReshardedFromAPrefix) {
  s3::S3Storage* st = Registered();
  ASSERT_NE(st, nullptr);
  testing::TempDir tmp;
  std::vector<float> w(32);
  for (int i = 0; i < 32; ++i) w[i] = static_cast<float>(i);
  ASSERT_TRUE(MakeDirs(tmp.Sub("src")).ok());
  ASSERT_TRUE(
      WriteSafetensors(tmp.Sub("src/model.safetensors"), {{"w", DType::kF32, {4, 8}, w.data()}}, {})
          .ok());
  const std::string ckpt = absl::StrCat("s3://", kBucket, "/", Fresh("ckpt"));
  absl::Status sharded = ShardCheckpoint(tmp.Sub("src"), ByRows(), ckpt, {});
  ASSERT_TRUE(sharded.ok()) << sharded;
  auto again = ShardCheckpoint(tmp.Sub("src"), ByRows(), ckpt, {});
  EXPECT_EQ(again.code(), absl::StatusCode::kAlreadyExists) << again;

  const uint64_t gets_before = st->client().stats().gets.load();
  auto res = LoadOffline(ckpt, ByColumns(), {});
  ASSERT_TRUE(res.ok()) << res.status();
  for (int r = 0; r < 2; ++r) {
    const float* out = reinterpret_cast<const float*>(res->buffers[r].tensors[0].data());
    for (int i = 0; i < 4; ++i) {
      for (int j = 0; j < 4; ++j) EXPECT_EQ(out[i * 4 + j], w[i * 8 + r * 4 + j]);
    }
  }
  EXPECT_GT(st->client().stats().gets.load(), gets_before);

  // A data object that vanished: the load names it.
  auto d = Directory::Open(ckpt, true);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE((*d)->Remove("1_0.safetensors").ok());
  auto broken = LoadOffline(ckpt, ByColumns(), {});
  ASSERT_FALSE(broken.ok());
  EXPECT_THAT(std::string(broken.status().message()), HasSubstr("1_0.safetensors"));
}

}  // namespace
}  // namespace ckpt
