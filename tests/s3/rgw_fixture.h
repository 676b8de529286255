// Test helper: a throwaway Ceph S3 gateway (tests/s3/rgw.sh) for one test
// binary, started once, its AWS_* variables put into this process's
// environment, stopped at exit. A gateway that does not start fails the test
// (deploy/install-deps.sh installs radosgw): never a silent skip.
#ifndef CKPTD_TESTS_S3_RGW_FIXTURE_H_
#define CKPTD_TESTS_S3_RGW_FIXTURE_H_

#include <stdio.h>
#include <stdlib.h>

#include <cstring>
#include <string>

#include "gtest/gtest.h"

namespace ckpt::testing {

class Rgw {
 public:
  // Starts the gateway; false (with `error`) when it did not.
  bool Start(std::string* error) {
    char tmpl[] = "/tmp/ckptd-rgw-XXXXXX";  // short: Ceph's admin sockets are unix sockets
    if (mkdtemp(tmpl) == nullptr) {
      *error = "mkdtemp failed";
      return false;
    }
    dir_ = tmpl;
    const std::string cmd = Script() + " start " + dir_ + " 2>&1";
    FILE* p = popen(cmd.c_str(), "r");
    if (p == nullptr) {
      *error = "popen failed";
      return false;
    }
    std::string out;
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
    const int rc = pclose(p);
    if (rc != 0) {
      *error = "tests/s3/rgw.sh start failed: " + out;
      return false;
    }
    size_t at = 0;
    while (at < out.size()) {
      size_t nl = out.find('\n', at);
      if (nl == std::string::npos) nl = out.size();
      std::string line = out.substr(at, nl - at);
      at = nl + 1;
      if (line.rfind("export ", 0) != 0) continue;
      const size_t eq = line.find('=');
      if (eq == std::string::npos) continue;
      setenv(line.substr(7, eq - 7).c_str(), line.substr(eq + 1).c_str(), 1);
    }
    endpoint_ = getenv("AWS_ENDPOINT_URL") ? getenv("AWS_ENDPOINT_URL") : "";
    if (endpoint_.empty()) {
      *error = "tests/s3/rgw.sh printed no AWS_ENDPOINT_URL: " + out;
      return false;
    }
    return true;
  }
  void Stop() {
    if (dir_.empty()) return;
    const std::string cmd = Script() + " stop " + dir_ + " >/dev/null 2>&1";
    (void)system(cmd.c_str());
    dir_.clear();
  }
  const std::string& endpoint() const { return endpoint_; }
  const std::string& dir() const { return dir_; }
  static std::string Bucket() { return "ckptd-test"; }

 private:
  static std::string Script() {
    const char* src = getenv("TEST_SRCDIR");
    const char* ws = getenv("TEST_WORKSPACE");
    if (src != nullptr && ws != nullptr) {
      return std::string("bash ") + src + "/" + ws + "/tests/s3/rgw.sh";
    }
    return "bash tests/s3/rgw.sh";
  }
  std::string dir_;
  std::string endpoint_;
};

// A gtest environment holding one gateway for the whole binary.
class RgwEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    std::string error;
    ASSERT_TRUE(rgw_.Start(&error)) << error;
  }
  void TearDown() override { rgw_.Stop(); }
  Rgw& rgw() { return rgw_; }

 private:
  Rgw rgw_;
};

}  // namespace ckpt::testing

#endif  // CKPTD_TESTS_S3_RGW_FIXTURE_H_
