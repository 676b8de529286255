// The one check of where a rank's targets land in a destination, for every
// kind of destination (a shared-memory segment, a cuda_ipc buffer, a
// process's address space): each target inside the region, no two
// overlapping. Checked before anything is mapped, opened or written.
// Stateless; thread-safe.
#ifndef CKPTD_SERVER_DELIVERY_TARGET_RANGES_H_
#define CKPTD_SERVER_DELIVERY_TARGET_RANGES_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ckptd {

// One target's bytes in its region: [begin, begin + bytes).
struct TargetRange {
  absl::string_view name;  // the tensor, for messages (owned by the caller)
  uint64_t begin = 0;
  uint64_t bytes = 0;
};

// Where the targets go.
struct TargetRegion {
  // As messages name it: "segment", "cuda_ipc buffer 2", "process's memory".
  std::string name;
  // In "(<noun> too small)": "segment", "buffer".
  std::string noun;
  // Bytes it holds; nullopt: an address space, where a target must not start
  // at address 0 nor wrap past the top, and overlaps are named by address.
  std::optional<uint64_t> size;
};

// INVALID_ARGUMENT naming `who`, the tensor and the bytes when a target
// falls outside `region` or two targets overlap; else the end of the last
// target's bytes (0 when every target is empty). Empty targets never
// overlap.
absl::StatusOr<uint64_t> CheckTargetRanges(const std::string& who, const TargetRegion& region,
                                           const std::vector<TargetRange>& targets);

// The pages a destination's targets touch: `ranges` ([begin, end) bytes, in
// any order; empty ones touch nothing) rounded out to multiples of `page`
// and merged where they touch or overlap, as sorted [begin, end) runs. What
// the daemon faults in when it maps a segment (MappedSegment::Map) and what
// a request is charged for it (Policy::CheckRequestLimits: the runs'
// lengths summed). An end within a page of 2^64 rounds down to the last
// whole page (a range inside that last partial page touches none).
std::vector<std::pair<uint64_t, uint64_t>> PageRuns(
    std::vector<std::pair<uint64_t, uint64_t>> ranges, uint64_t page);

}  // namespace ckptd

#endif  // CKPTD_SERVER_DELIVERY_TARGET_RANGES_H_
