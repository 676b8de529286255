// Small helpers shared by the fuzz targets (tests/fuzz/*_fuzz.cc).
#ifndef CKPTD_TESTS_FUZZ_FUZZ_UTIL_H_
#define CKPTD_TESTS_FUZZ_FUZZ_UTIL_H_

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

namespace ckptd_fuzz {

inline std::string Str(const uint8_t* data, size_t size) {
  return std::string(reinterpret_cast<const char*>(data), size);
}

// A property the code under test promises does not hold: print and abort,
// so libFuzzer (or the replay driver) reports the input as a crash.
#define FUZZ_CHECK(cond, detail)                                                   \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      std::fprintf(stderr, "%s:%d: fuzz property violated: %s\n  %s\n", __FILE__, \
                   __LINE__, #cond, std::string(detail).c_str());                  \
      std::abort();                                                                \
    }                                                                              \
  } while (0)

// CKPTD_FUZZ_VERBOSE=1: each target says how far every input got (which
// stage accepted or refused it, and why), to check that seeds reach deep.
inline bool Verbose() {
  static const bool v = [] {
    const char* e = std::getenv("CKPTD_FUZZ_VERBOSE");
    return e != nullptr && *e != '\0' && *e != '0';
  }();
  return v;
}
template <typename S>
void Note(const char* stage, const S& status) {
  if (!Verbose()) return;
  std::string s = status.ToString();
  if (s.size() > 300) s = s.substr(0, 300) + "...";
  std::fprintf(stderr, "  %-24s %s\n", stage, s.c_str());
}

// A private directory for this process ($TEST_TMPDIR, $TMPDIR or /tmp),
// made on first use and removed with its contents when the process exits.
inline const std::string& ScratchDir() {
  static const std::string* dir = [] {
    const char* base = std::getenv("TEST_TMPDIR");
    if (base == nullptr || *base == '\0') base = std::getenv("TMPDIR");
    if (base == nullptr || *base == '\0') base = "/tmp";
    std::string tmpl = std::string(base) + "/ckptd-fuzz-XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) {
      std::perror("ckptd_fuzz: mkdtemp");
      std::abort();
    }
    auto* d = new std::string(tmpl);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(*dir, ec);
    });
    return d;
  }();
  return *dir;
}

}  // namespace ckptd_fuzz

#endif  // CKPTD_TESTS_FUZZ_FUZZ_UTIL_H_
