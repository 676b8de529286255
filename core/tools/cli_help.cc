#include "core/tools/cli_help.h"

#include <algorithm>
#include <utility>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"

namespace ckpt {

bool AsksForHelp(const std::vector<std::string>& args, bool* full) {
  for (const std::string& a : args) {
    if (a == "--") break;
    if (a == "--help" || a == "-h" || a == "-help") {
      *full = false;
      return true;
    }
    if (a == "--helpfull" || a == "-helpfull") {
      *full = true;
      return true;
    }
  }
  return false;
}

void PrintHelp(std::ostream& out, absl::string_view usage,
               const std::vector<std::string>& own_files, bool full) {
  out << usage;
  if (!absl::EndsWith(usage, "\n")) out << "\n";
  std::vector<std::pair<std::string, const absl::CommandLineFlag*>> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    bool own = false;
    for (const std::string& f : own_files) own = own || absl::EndsWith(flag->Filename(), f);
    if (own || full) flags.emplace_back(std::string(name), flag);
  }
  std::sort(flags.begin(), flags.end());
  out << "\nFlags" << (full ? " (all)" : " (--helpfull: Abseil's too)") << ":\n";
  for (const auto& [name, flag] : flags) {
    const std::string def = flag->DefaultValue();
    out << "  --" << name << "=" << (def.empty() ? "\"\"" : def) << "\n      " << flag->Help()
        << "\n";
  }
}

}  // namespace ckpt
