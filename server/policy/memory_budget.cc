#include "server/policy/memory_budget.h"

#include <algorithm>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace ckptd {
namespace {

constexpr uint64_t kGiB = 1ull << 30;
constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kMinBudget = 64 * kMiB;
// cgroup v1 writes "no limit" as 2^63 rounded down to a page; anything this
// large is no limit.
constexpr uint64_t kNoLimit = 1ull << 62;

// Up to 64 KiB of a /proc or /sys file (they report a size of 0 or 4096 to
// stat, so a size-checked reader such as ckpt::ReadSmallFile cannot be used).
std::optional<std::string> ReadKernelFile(const std::string& path) {
  std::ifstream f(path);
  if (!f) return std::nullopt;
  std::string s(64 << 10, '\0');
  f.read(s.data(), static_cast<std::streamsize>(s.size()));
  s.resize(static_cast<size_t>(f.gcount()));
  return s;
}

// The first line of a one-value kernel file, trimmed.
std::optional<std::string> ReadSmall(const std::string& path) {
  std::optional<std::string> s = ReadKernelFile(path);
  if (!s) return std::nullopt;
  return std::string(absl::StripAsciiWhitespace(s->substr(0, s->find('\n'))));
}

// The limit in `file` under `dir` and each of dir's ancestors up to `top`:
// the smallest.
std::optional<MemoryLimit> SmallestUpwards(const std::string& top, std::string path,
                                           const std::string& file) {
  std::optional<MemoryLimit> best;
  while (true) {
    const std::string where = absl::StrCat(top, path == "/" ? "" : path, "/", file);
    uint64_t v = 0;
    if (auto text = ReadSmall(where); text && *text != "max" && absl::SimpleAtoi(*text, &v) &&
                                      v < kNoLimit && (!best || v < best->bytes)) {
      best = MemoryLimit{v, where};
    }
    if (path.empty() || path == "/") break;
    const size_t slash = path.rfind('/');
    path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
  }
  return best;
}

std::string Gib(uint64_t b) {
  if (b % kGiB == 0) return absl::StrCat(b / kGiB, " GiB");
  if (b % kMiB == 0) return absl::StrCat(b / kMiB, " MiB");
  return absl::StrCat(b, " bytes");
}

}  // namespace

std::optional<MemoryLimit> CgroupMemoryLimit(const std::string& proc_self_cgroup,
                                             const std::string& sysfs_root) {
  std::optional<MemoryLimit> best;
  auto consider = [&](std::optional<MemoryLimit> l) {
    if (l && (!best || l->bytes < best->bytes)) best = std::move(l);
  };
  for (absl::string_view line : absl::StrSplit(proc_self_cgroup, '\n', absl::SkipEmpty())) {
    // "hierarchy-id:controllers:path"; the path may itself hold ':'.
    std::vector<std::string> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3 || f[2].empty() || f[2][0] != '/') continue;
    if (f[0] == "0" && f[1].empty()) {  // cgroup v2
      consider(SmallestUpwards(sysfs_root, f[2], "memory.max"));
    } else {
      for (absl::string_view c : absl::StrSplit(f[1], ',')) {
        if (c == "memory") {
          consider(SmallestUpwards(sysfs_root + "/memory", f[2], "memory.limit_in_bytes"));
        }
      }
    }
  }
  return best;
}

std::optional<MemoryLimit> PhysicalMemory(const std::string& meminfo) {
  for (absl::string_view line : absl::StrSplit(meminfo, '\n')) {
    if (!absl::ConsumePrefix(&line, "MemTotal:")) continue;
    line = absl::StripAsciiWhitespace(line);
    if (!absl::ConsumeSuffix(&line, "kB")) return std::nullopt;
    uint64_t kb = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &kb) || kb == 0) return std::nullopt;
    return MemoryLimit{kb * 1024, "MemTotal in /proc/meminfo"};
  }
  return std::nullopt;
}

std::optional<MemoryLimit> ProcessMemoryLimit() {
  auto slurp = [](const char* path) { return ReadKernelFile(path).value_or(""); };
  std::optional<MemoryLimit> cg = CgroupMemoryLimit(slurp("/proc/self/cgroup"), "/sys/fs/cgroup");
  std::optional<MemoryLimit> ram = PhysicalMemory(slurp("/proc/meminfo"));
  if (cg && (!ram || cg->bytes <= ram->bytes)) return cg;
  return ram;
}

uint64_t WorkingRoom(uint64_t limit) { return std::min<uint64_t>(kGiB, limit / 8); }

absl::Status FitMemoryBudgets(DaemonConfig* config, const MemoryLimit& limit,
                              std::vector<std::string>* notes) {
  struct Budget {
    const char* key;
    uint64_t* value;
    bool set;
  };
  Budget budgets[] = {
      {"cache_budget", &config->cache_budget, config->set_keys.count("cache_budget") > 0},
      {"arena_limit", &config->arena_limit, config->set_keys.count("arena_limit") > 0},
      {"save_buffer", &config->save_buffer, config->set_keys.count("save_buffer") > 0},
      {"limits.max_stream_bytes", &config->limits.max_stream_bytes,
       config->set_keys.count("limits.max_stream_bytes") > 0},
  };
  const uint64_t room = WorkingRoom(limit.bytes);
  uint64_t fixed = room, scalable = 0;
  for (const Budget& b : budgets) (b.set ? fixed : scalable) += *b.value;
  auto refuse = [&](absl::string_view why) {
    std::vector<std::string> parts;
    uint64_t total = room;
    for (const Budget& b : budgets) {
      parts.push_back(absl::StrCat(b.key, " ", Gib(*b.value), b.set ? " (set)" : " (default)"));
      total += *b.value;
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "the memory budgets do not fit the memory this daemon may use: ",
        absl::StrJoin(parts, " + "), " + ", Gib(room), " working room = ", Gib(total), " > ",
        Gib(limit.bytes), " (", limit.source, ")", why,
        "; lower the keys marked (set) in the config, or give the daemon more memory"));
  };
  if (fixed + scalable <= limit.bytes) return absl::OkStatus();
  if (fixed >= limit.bytes || scalable == 0) return refuse("");
  // arena_limit (a cap on what clients may lease, its default 64 GiB) gives
  // way first when that is enough.
  const uint64_t excess = fixed + scalable - limit.bytes;
  auto note_fitted = [&](absl::string_view key, uint64_t fitted, uint64_t from) {
    notes->push_back(absl::StrCat(key, " not set: ", Gib(fitted), " instead of its default ",
                                  Gib(from), " to fit ", Gib(limit.bytes), " (", limit.source,
                                  ")"));
  };
  if (!budgets[1].set && config->arena_limit >= excess + kMinBudget + kMiB) {
    const uint64_t fitted = (config->arena_limit - excess) & ~(kMiB - 1);
    note_fitted("arena_limit", fitted, config->arena_limit);
    config->arena_limit = fitted;
    scalable = 0;
  }
  // Otherwise every defaulted budget is scaled down alike to what is left.
  const long double factor =
      static_cast<long double>(limit.bytes - fixed) / static_cast<long double>(scalable);
  for (Budget& b : budgets) {
    if (b.set || scalable == 0) continue;
    const uint64_t fitted = static_cast<uint64_t>(static_cast<long double>(*b.value) * factor) &
                            ~(kMiB - 1);  // whole MiB
    if (fitted < kMinBudget) {
      return refuse(absl::StrCat(", and ", b.key, " would be left with less than ", Gib(kMinBudget)));
    }
    note_fitted(b.key, fitted, *b.value);
    *b.value = fitted;
  }
  if (!config->set_keys.count("arena_pool") && config->arena_pool > config->arena_limit) {
    notes->push_back(absl::StrCat("arena_pool not set: ", Gib(config->arena_limit),
                                  " (arena_limit) instead of its default ",
                                  Gib(config->arena_pool)));
    config->arena_pool = config->arena_limit;
  }
  return absl::OkStatus();
}

}  // namespace ckptd
