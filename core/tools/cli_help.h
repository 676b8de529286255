// --help and --helpfull for ckptd and ckptctl: the program's usage, then its
// flags (name, default, description), printed to standard output; the
// program then exits 0 (Abseil's own --help exits 1 and lists only the flags
// of a file named like the program).
#ifndef CKPTD_CORE_TOOLS_CLI_HELP_H_
#define CKPTD_CORE_TOOLS_CLI_HELP_H_

#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace ckpt {

// Whether args (argv without the program) ask for help: "--help", "-h",
// "--helpfull" (*full set for the last).
bool AsksForHelp(const std::vector<std::string>& args, bool* full);

// Writes `usage` and the flags defined in files whose path ends with one of
// `own_files` (every flag, Abseil's included, when `full`), sorted by name,
// each as "--name=DEFAULT  help".
void PrintHelp(std::ostream& out, absl::string_view usage,
               const std::vector<std::string>& own_files, bool full);

}  // namespace ckpt

#endif  // CKPTD_CORE_TOOLS_CLI_HELP_H_
