// ProbeShmemHugePages (core/cache/cache.h): what the kernel's THP settings
// say about huge pages for shared memory.
#include "core/cache/cache.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"

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

namespace {
constexpr uint64_t kHugePage = 2 << 20;
#ifdef MADV_COLLAPSE
constexpr int kMadvCollapse = MADV_COLLAPSE;
#else
constexpr int kMadvCollapse = 25;  // Linux 6.1
#endif
}  // namespace

int CollapseRange(void* p, uint64_t n) { return ::madvise(p, n, kMadvCollapse); }

std::string ProbeShmemCollapse() {
  const int fd = ::memfd_create("ckptd-collapse-probe", MFD_CLOEXEC);
  if (fd < 0) return absl::StrCat("memfd_create: ", std::strerror(errno));
  std::string why;
  void* p = MAP_FAILED;
  if (::ftruncate(fd, kHugePage) != 0) {
    why = absl::StrCat("ftruncate: ", std::strerror(errno));
  } else if ((p = MapSharedAligned(fd, kHugePage, PROT_READ | PROT_WRITE)) == MAP_FAILED) {
    why = absl::StrCat("mmap: ", std::strerror(errno));
  } else {
    std::memset(p, 1, kHugePage);  // present pages (a hole is not collapsed)
    // No huge page free just now (EAGAIN, ENOMEM) still says the kernel
    // knows the request.
    if (CollapseRange(p, kHugePage) != 0 && errno != EAGAIN && errno != ENOMEM) {
      why = absl::StrCat("MADV_COLLAPSE: ", std::strerror(errno));
    }
    ::munmap(p, kHugePage);
  }
  ::close(fd);
  return why;
}

}  // namespace ckpt
