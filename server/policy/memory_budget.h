// The daemon's memory budgets against the memory it may use (issue 21,
// "Operations"): at start-up the budgets that make up most of its memory
// (cache_budget, arena_limit, save_buffer, limits.max_stream_bytes, plus
// working room) must fit the memory limit of its cgroup (and the machine's memory). Keys
// the operator set are checked as they are, and start-up is refused naming
// them; keys left at their defaults shrink to fit.
#ifndef CKPTD_SERVER_POLICY_MEMORY_BUDGET_H_
#define CKPTD_SERVER_POLICY_MEMORY_BUDGET_H_

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "config/config.h"

namespace ckptd {

struct MemoryLimit {
  uint64_t bytes = 0;
  std::string source;  // where it comes from, for messages and the log
};

// The smallest memory limit of the cgroup named in `proc_self_cgroup` (the
// text of /proc/self/cgroup) and of its ancestors, read under `sysfs_root`
// (/sys/fs/cgroup): cgroup v2 `memory.max`, cgroup v1
// `memory/<path>/memory.limit_in_bytes` ("max", or v1's 2^63 - page, means
// none). nullopt when no limit is set or nothing could be read.
std::optional<MemoryLimit> CgroupMemoryLimit(const std::string& proc_self_cgroup,
                                             const std::string& sysfs_root);

// MemTotal from the text of /proc/meminfo.
std::optional<MemoryLimit> PhysicalMemory(const std::string& meminfo);

// The smaller of this process's cgroup limit and the machine's memory.
std::optional<MemoryLimit> ProcessMemoryLimit();

// Memory the daemon needs besides its budgets (threads, gRPC, metadata):
// 1 GiB, or an eighth of the limit when that is less.
uint64_t WorkingRoom(uint64_t limit);

// Checks cache_budget + arena_limit + save_buffer + limits.max_stream_bytes + WorkingRoom
// against `limit`. `set_keys` are the keys the operator set (config.set_keys);
// those are never changed: if they alone do not fit, FAILED_PRECONDITION
// naming each budget, its value and whether it was set, the total and the
// limit with its source. Budgets left at their defaults give way: arena_limit
// alone when lowering it is enough, else all of them scaled down alike (each
// to at least 64 MiB; otherwise the same error); arena_pool follows
// arena_limit. `notes` gets one line per change.
absl::Status FitMemoryBudgets(DaemonConfig* config, const MemoryLimit& limit,
                              std::vector<std::string>* notes);

}  // namespace ckptd

#endif  // CKPTD_SERVER_POLICY_MEMORY_BUDGET_H_
