// ckptd — the per-node checkpoint daemon.
//
//   ckptd --socket /run/ckptd/ckptd.sock --root /data/checkpoints
//   ckptd --config /etc/ckptd/ckptd.yaml
//   ckptd --check-config /etc/ckptd/ckptd.yaml
//
// The command line is server/flags.h; the daemon's life (listeners, signals,
// the drain) server/lifecycle.h.
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>

#include "absl/synchronization/mutex.h"
#include "config/config.h"
#include "server/flags.h"
#include "server/lifecycle.h"

int main(int argc, char** argv) {
  // Debian's Abseil checks every Mutex acquisition against a global lock
  // graph (it is built without NDEBUG): 15% of the daemons' CPU in a
  // 32-node job (bench/scale.py). Off unless CKPTD_MUTEX_DEADLOCK_CHECK=1,
  // which the test suite sets (.bazelrc) to keep the check where it finds
  // bugs.
  const char* check = std::getenv("CKPTD_MUTEX_DEADLOCK_CHECK");
  if (check == nullptr || std::strcmp(check, "1") != 0) {
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  }
  if (absl::Status s = ckptd::ParseDaemonFlags(argc, argv); !s.ok()) {
    return ckptd::Fail(std::string(s.message()));
  }
  if (std::optional<std::string> file = ckptd::CheckConfigFile()) {
    absl::Status s = ckptd::CheckConfig(*file);
    return s.ok() ? 0 : ckptd::Fail(std::string(s.message()));
  }
  absl::StatusOr<ckptd::StartupConfig> startup = ckptd::ConfigFromFlags();
  if (!startup.ok()) return ckptd::Fail(std::string(startup.status().message()));
  if (ckptd::PrintConfigRequested()) {
    std::cout << ckptd::ConfigToYaml(startup->config);
    return 0;
  }
  return ckptd::RunDaemon(std::move(startup->config), startup->budget_notes);
}
