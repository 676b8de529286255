// Test helper: runs the real ckptd binary as a child process on a socket in
// a fresh /tmp directory (Unix socket paths must stay under 108 bytes), and
// runs other binaries (ckptctl) as child processes.
#ifndef CKPTD_TESTS_INTEGRATION_DAEMON_PROCESS_H_
#define CKPTD_TESTS_INTEGRATION_DAEMON_PROCESS_H_

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <vector>

extern char** environ;

namespace ckpt::testing {

inline std::string Runfile(const std::string& rel) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* ws = std::getenv("TEST_WORKSPACE");
  if (srcdir && ws) return std::string(srcdir) + "/" + ws + "/" + rel;
  return rel;
}

// Starts `argv` with stdout/stderr to `log` (if not empty); returns the pid.
inline pid_t Spawn(const std::vector<std::string>& argv, const std::string& log = "") {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  if (!log.empty()) {
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
  }
  pid_t pid = -1;
  if (posix_spawn(&pid, args[0], &fa, nullptr, args.data(), environ) != 0) pid = -1;
  posix_spawn_file_actions_destroy(&fa);
  return pid;
}

// Waits for `pid`; returns its exit code (128 + signal if killed), or -1 on timeout.
inline int WaitExit(pid_t pid, std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    int st = 0;
    pid_t r = waitpid(pid, &st, WNOHANG);
    if (r == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return -1;
}

// Polls `done` every 10 ms until it holds or `timeout` passes; on expiry
// the failure names `what` and the time waited (use with ASSERT_TRUE).
template <typename Cond>
::testing::AssertionResult Await(Cond done, const std::string& what,
                                 std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= end) {
      return ::testing::AssertionFailure()
             << "timed out after " << timeout.count() << " ms waiting for " << what;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return ::testing::AssertionSuccess();
}

class DaemonProcess {
 public:
  // `socket`: another daemon's (a restart on its path; destroy this one
  // first, the other's directory holds it), else one in a fresh directory.
  explicit DaemonProcess(const std::string& root, std::vector<std::string> extra = {},
                         const std::string& socket = "") {
    char tmpl[] = "/tmp/ckptd-it-XXXXXX";
    dir_ = mkdtemp(tmpl);
    socket_ = socket.empty() ? dir_ + "/ckptd.sock" : socket;
    log_ = dir_ + "/ckptd.log";
    port_file_ = dir_ + "/ports.json";
    std::vector<std::string> argv = {Runfile("server/ckptd"), "--socket", socket_, "--root", root,
                                     "--port-file", port_file_};
    argv.insert(argv.end(), extra.begin(), extra.end());
    pid_ = Spawn(argv, log_);
    for (int i = 0; i < 1000 && !Ready(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // A daemon that did not exit 0 on SIGTERM (crashed, hung, failed to
  // drain) fails the test, unless the test killed it on purpose.
  ~DaemonProcess() {
    const bool running = pid_ > 0;
    const int rc = Stop();
    if (running && rc != 0) {
      std::ifstream in(log_);
      std::stringstream tail;
      tail << in.rdbuf();
      const std::string t = tail.str();
      ADD_FAILURE() << "ckptd exited " << rc << " at teardown (expected 0); its log ends:\n"
                    << t.substr(t.size() > 3000 ? t.size() - 3000 : 0);
    }
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  bool Ready() const {
    struct stat st;
    return ::stat((socket_ + ".fd").c_str(), &st) == 0 && ::stat(socket_.c_str(), &st) == 0;
  }
  // SIGTERM and wait; returns the exit code.
  int Stop() {
    if (pid_ <= 0) return exit_code_;
    ::kill(pid_, SIGTERM);
    exit_code_ = WaitExit(pid_, std::chrono::seconds(30));
    pid_ = -1;
    return exit_code_;
  }
  // SIGKILL: the daemon dies without draining.
  void Kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    exit_code_ = WaitExit(pid_, std::chrono::seconds(30));
    pid_ = -1;
  }
  // The port the daemon reports for `key` ("tcp", "peer", "metrics": its
  // listeners with port 0 get one from the kernel) in its port file, written
  // once every listener is up; -1 if it is not there within `timeout` or the
  // daemon exited first (the caller prints log()).
  int ReportedPort(const std::string& key,
                   std::chrono::milliseconds timeout = std::chrono::seconds(20)) const {
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < end) {
      std::ifstream in(port_file_);  // written atomically (rename): whole or absent
      if (in) {
        std::stringstream text;
        text << in.rdbuf();
        const std::string t = text.str();
        const std::string k = "\"" + key + "\":";
        const size_t at = t.find(k);
        return at == std::string::npos ? -1 : std::atoi(t.c_str() + at + k.size());
      }
      if (!Alive()) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }
  bool Alive() const { return pid_ > 0 && ::kill(pid_, 0) == 0 && waitpid(pid_, nullptr, WNOHANG) == 0; }
  pid_t pid() const { return pid_; }
  const std::string& socket() const { return socket_; }
  const std::string& log() const { return log_; }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_, socket_, log_, port_file_;
  pid_t pid_ = -1;
  int exit_code_ = -1;
};

}  // namespace ckpt::testing

#endif  // CKPTD_TESTS_INTEGRATION_DAEMON_PROCESS_H_
