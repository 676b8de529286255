// Regression driver for the fuzz targets in the normal (non-fuzzing) build:
// runs LLVMFuzzerTestOneInput once over every input named on the command
// line, so `bazel test` exercises the checked-in corpora with any compiler.
//
//   replay BINARY_ARGS...   each argument is a file (one input) or a
//                           directory (every regular file below it, sorted)
//
// Arguments starting with '-' are skipped (libFuzzer flags such as -runs=,
// so the same command line works for both builds). A crash, sanitizer report
// or hang in the target is the test's failure; an unreadable input is too
// (exit 1). Prints the number of inputs run and their total size.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) __attribute__((weak));

namespace {

bool ReadWhole(const std::string& path, std::vector<uint8_t>* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  out->assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return !in.bad();
}

// The inputs `arg` names: itself, or the regular files below it.
bool Expand(const std::string& arg, std::vector<std::string>* paths) {
  std::error_code ec;
  const auto st = std::filesystem::status(arg, ec);
  if (ec) {
    std::fprintf(stderr, "replay: %s: %s\n", arg.c_str(), ec.message().c_str());
    return false;
  }
  if (!std::filesystem::is_directory(st)) {
    paths->push_back(arg);
    return true;
  }
  std::vector<std::string> found;
  for (std::filesystem::recursive_directory_iterator it(arg, ec), end; !ec && it != end;
       it.increment(ec)) {
    if (it->is_regular_file(ec)) found.push_back(it->path().string());
  }
  if (ec) {
    std::fprintf(stderr, "replay: %s: %s\n", arg.c_str(), ec.message().c_str());
    return false;
  }
  std::sort(found.begin(), found.end());
  paths->insert(paths->end(), found.begin(), found.end());
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (LLVMFuzzerInitialize != nullptr) LLVMFuzzerInitialize(&argc, &argv);
  std::vector<std::string> paths;
  bool ok = true;
  for (int i = 1; i < argc; ++i) {
    if (argv[i][0] == '-') continue;
    ok = Expand(argv[i], &paths) && ok;
  }
  const auto start = std::chrono::steady_clock::now();
  size_t ran = 0;
  uint64_t bytes = 0;
  std::vector<uint8_t> data;
  const char* v = std::getenv("CKPTD_FUZZ_VERBOSE");
  const bool verbose = v != nullptr && *v != '\0' && *v != '0';
  for (const std::string& p : paths) {
    if (!ReadWhole(p, &data)) {
      std::fprintf(stderr, "replay: cannot read %s\n", p.c_str());
      ok = false;
      continue;
    }
    // A copy of exactly `size` bytes, so reads past the end are caught by
    // the sanitizers (as under libFuzzer) rather than landing in slack.
    std::unique_ptr<uint8_t[]> copy(new uint8_t[data.size() == 0 ? 1 : data.size()]);
    if (!data.empty()) std::memcpy(copy.get(), data.data(), data.size());
    if (verbose) std::fprintf(stderr, "%s (%zu bytes)\n", p.c_str(), data.size());
    LLVMFuzzerTestOneInput(copy.get(), data.size());
    ++ran;
    bytes += data.size();
  }
  const double s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("replay: ran %zu inputs (%llu bytes) in %.3f s\n", ran,
              static_cast<unsigned long long>(bytes), s);
  if (ran == 0) {
    std::fprintf(stderr, "replay: no inputs\n");
    return 1;
  }
  return ok ? 0 : 1;
}
