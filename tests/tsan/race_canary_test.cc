// Proves the --config=tsan setup can fail: a data race on a counter that one
// thread updates under an absl::Mutex and the other without must be reported
// (TSan's exit code 66 and a "data race" report naming the function), and the
// same program with both threads under the mutex must run clean (so the
// annotations of tests/tsan/absl_tsan_shim.cc make the mutex visible). Tagged
// manual: tests/run.sh runs it in the TSan stage, where it means something.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

extern char** environ;

namespace {

absl::Mutex mu;
long counter = 0;

__attribute__((noinline)) void RacyIncrement(bool lock) {
  for (int i = 0; i < 100000; ++i) {
    if (lock) {
      absl::MutexLock l(&mu);
      ++counter;
    } else {
      ++counter;
    }
  }
}

// Both threads start their loops only once both exist: a thread that ran to
// its end before the other began could hand its TSan slot to the other, whose
// accesses then look ordered after its own and race with nothing (seen once on
// a loaded CI machine).
std::atomic<int> started{0};

void Together() {
  started.fetch_add(1);
  while (started.load() < 2) std::this_thread::yield();
}

int Child(bool both_locked) {
  std::thread a([] {
    Together();
    RacyIncrement(true);
  });
  std::thread b([both_locked] {
    Together();
    RacyIncrement(both_locked);
  });
  a.join();
  b.join();
  std::printf("counter %ld\n", counter);
  return 0;
}

struct Outcome {
  int exit_code = -1;
  std::string stderr_text;
};

Outcome RunChild(const char* mode) {
  char out[] = "/tmp/race_canary.XXXXXX";
  const int fd = mkstemp(out);
  EXPECT_GE(fd, 0);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fd, 2);
  std::string self = "/proc/self/exe";
  char* argv[] = {self.data(), const_cast<char*>(mode), nullptr};
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, "/proc/self/exe", &fa, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  close(fd);
  Outcome o;
  EXPECT_EQ(rc, 0) << std::strerror(rc);
  int status = 0;
  if (rc == 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status)) {
    o.exit_code = WEXITSTATUS(status);
  }
  std::ifstream in(out);
  std::stringstream ss;
  ss << in.rdbuf();
  o.stderr_text = ss.str();
  unlink(out);
  return o;
}

bool UnderTsan() {
#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
  return true;
#endif
#endif
  return false;
}

TEST(TsanCanary, GuardedCounterIsClean) {
  const Outcome o = RunChild("--child=locked");
  EXPECT_EQ(o.exit_code, 0) << o.stderr_text;
  EXPECT_EQ(o.stderr_text.find("ThreadSanitizer"), std::string::npos) << o.stderr_text;
}

TEST(TsanCanary, UnguardedCounterIsReported) {
  ASSERT_TRUE(UnderTsan()) << "build with --config=tsan: this test checks ThreadSanitizer itself";
  const Outcome o = RunChild("--child=racy");
  EXPECT_EQ(o.exit_code, 66) << o.stderr_text;
  EXPECT_NE(o.stderr_text.find("WARNING: ThreadSanitizer: data race"), std::string::npos)
      << o.stderr_text;
  EXPECT_NE(o.stderr_text.find("RacyIncrement"), std::string::npos) << o.stderr_text;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "--child=locked") == 0) return Child(true);
  if (argc == 2 && std::strcmp(argv[1], "--child=racy") == 0) return Child(false);
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
