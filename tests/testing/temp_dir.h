// Test helper: a fresh directory under $TEST_TMPDIR, removed at destruction.
#ifndef CKPTD_TESTS_TESTING_TEMP_DIR_H_
#define CKPTD_TESTS_TESTING_TEMP_DIR_H_

#include <cstdlib>
#include <filesystem>
#include <string>

namespace ckpt::testing {

class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TEST_TMPDIR");
    std::string tmpl = std::string(base ? base : "/tmp") + "/ckptd-XXXXXX";
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string Sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace ckpt::testing

#endif  // CKPTD_TESTS_TESTING_TEMP_DIR_H_
