// The daemon's command line (main.cc): the absl flags (dashed names such as
// --check-config accepted as well as underscores), --version, the usage
// text, and the DaemonConfig they make: the YAML config file (--config),
// then every flag that overrides one of its keys, validated and with the
// budgets fitted to memory_limit.
//
// Called once, from main, before any thread starts.
#ifndef CKPTD_SERVER_FLAGS_H_
#define CKPTD_SERVER_FLAGS_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "config/config.h"

namespace ckptd {

// Parses argv; an error names the unexpected argument.
absl::Status ParseDaemonFlags(int argc, char** argv);

// --check-config FILE, when given.
std::optional<std::string> CheckConfigFile();
// Validates `file` as a start would (its TLS files must be readable PEM),
// prints what the memory limit would change, then "FILE: OK".
absl::Status CheckConfig(const std::string& file);

// --print-config: print the effective config and exit.
bool PrintConfigRequested();

struct StartupConfig {
  DaemonConfig config;
  // What fitting the budgets to memory_limit changed (logged at start).
  std::vector<std::string> budget_notes;
};
// The effective config: --config's file, the flags over it, validated.
absl::StatusOr<StartupConfig> ConfigFromFlags();

}  // namespace ckptd

#endif  // CKPTD_SERVER_FLAGS_H_
