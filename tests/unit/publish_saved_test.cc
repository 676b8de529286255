// PublishSaved (server/save/saves.h): a version just persisted goes into the
// data cache read beneath the directory the save locked and wrote, not by
// path (issue 33: it reopened files by path after the lock was released, so
// a directory swapped for a symlink meanwhile published other bytes under
// the saved path).
#include <filesystem>
#include <fstream>
#include <string>

#include "core/cache/cache.h"
#include "core/io/file.h"
#include "gtest/gtest.h"
#include "server/save/saves.h"
#include "tests/testing/temp_dir.h"

namespace ckptd {
namespace {

namespace fs = std::filesystem;

void Write(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

TEST(PublishSaved, ReadsBeneathTheDirectoryItWasGivenNotByPath) {
  ckpt::testing::TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  fs::create_directories(dir);
  Write(dir + "/0_0.safetensors", std::string(4096, 'S'));  // what the save wrote
  auto opened = ckpt::Directory::Open(dir, /*confine=*/true, /*follow_last=*/false);
  ASSERT_TRUE(opened.ok()) << opened.status();
  auto stamp = (*opened)->Stat("0_0.safetensors");
  ASSERT_TRUE(stamp.ok()) << stamp.status();
  // Meanwhile the path comes to name another directory holding other bytes.
  fs::rename(dir, tmp.Sub("moved"));
  fs::create_directories(tmp.Sub("other"));
  Write(tmp.Sub("other/0_0.safetensors"), std::string(4096, 'X'));
  fs::create_directory_symlink(tmp.Sub("other"), dir);

  ckpt::HostCache cache(1 << 20);
  PublishSaved(&cache, **opened, {"0_0.safetensors"});
  auto hit = cache.Lookup(dir + "/0_0.safetensors", *stamp, 0, 4096);
  ASSERT_TRUE(hit.has_value()) << "the saved file was not published";
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(hit->data), 4096), std::string(4096, 'S'));
  // A file changed since it was written is left out.
  Write(tmp.Sub("moved/1_0.safetensors"), "y");
  auto before = (*opened)->Stat("1_0.safetensors");
  ASSERT_TRUE(before.ok());
  ckpt::HostCache other(1 << 20);
  PublishSaved(&other, **opened, {"1_0.safetensors", "missing"});
  EXPECT_TRUE(other.Lookup(dir + "/1_0.safetensors", *before, 0, 1).has_value());
}

}  // namespace
}  // namespace ckptd
