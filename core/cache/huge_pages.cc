// ProbeShmemHugePages (core/cache/cache.h): what the kernel's THP settings
// say about huge pages for shared memory.
#include "core/cache/cache.h"

#include <fstream>
#include <string>

namespace ckpt {

namespace {
// The selected value of a sysfs THP setting ("always [advise] never" ->
// "advise"); empty when the file is missing or unreadable.
std::string SelectedSetting(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return "";
  const size_t a = line.find('['), b = line.find(']');
  return a != std::string::npos && b != std::string::npos && b > a ? line.substr(a + 1, b - a - 1)
                                                                   : "";
}
}  // namespace

ShmemHugePages ProbeShmemHugePages() {
  const std::string base = "/sys/kernel/mm/transparent_hugepage/";
  std::string setting = SelectedSetting(base + "hugepages-2048kB/shmem_enabled");
  if (setting.empty() || setting == "inherit") setting = SelectedSetting(base + "shmem_enabled");
  ShmemHugePages out;
  out.setting = setting.empty() ? "unknown" : setting;
  out.honoured = setting == "always" || setting == "within_size" || setting == "advise" ||
                 setting == "force";
  return out;
}

}  // namespace ckpt
