#include "server/delivery/target_ranges.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ckptd {

absl::StatusOr<uint64_t> CheckTargetRanges(const std::string& who, const TargetRegion& region,
                                           const std::vector<TargetRange>& targets) {
  uint64_t end = 0;
  std::vector<size_t> order;  // non-empty targets
  for (size_t i = 0; i < targets.size(); ++i) {
    const TargetRange& t = targets[i];
    if (region.size.has_value()) {
      const uint64_t size = *region.size;
      if (t.begin > size || t.bytes > size - t.begin) {
        return absl::InvalidArgumentError(absl::StrCat(
            who, " tensor '", t.name, "' needs bytes [", t.begin, ", ", t.begin + t.bytes,
            ") of the ", region.name, " but the ", region.name, " is ", size, " bytes (",
            region.noun, " too small)"));
      }
    } else if (t.bytes > 0 &&
               (t.begin == 0 || t.begin > std::numeric_limits<uint64_t>::max() - t.bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(who, " tensor '", t.name, "': ",
                                                     region.name, " address ", t.begin,
                                                     " cannot hold ", t.bytes, " bytes"));
    }
    if (t.bytes > 0) order.push_back(i);
    end = std::max(end, t.begin + t.bytes);
  }
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::make_pair(targets[a].begin, a) < std::make_pair(targets[b].begin, b);
  });
  for (size_t k = 1; k < order.size(); ++k) {
    const TargetRange& prev = targets[order[k - 1]];
    const TargetRange& t = targets[order[k]];
    if (t.begin < prev.begin + prev.bytes) {
      const std::string at = region.size.has_value()
                                 ? absl::StrCat("byte ", t.begin)
                                 : absl::StrFormat("address 0x%x", t.begin);
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": two targets overlap in the ", region.name, " at ", at, ": tensor '", prev.name,
          "' [", prev.begin, ", ", prev.begin + prev.bytes, ") and tensor '", t.name, "' [",
          t.begin, ", ", t.begin + t.bytes, ")"));
    }
  }
  return end;
}

std::vector<std::pair<uint64_t, uint64_t>> PageRuns(
    std::vector<std::pair<uint64_t, uint64_t>> ranges, uint64_t page) {
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<uint64_t, uint64_t>> runs;
  for (const auto& [begin, end] : ranges) {
    if (end <= begin) continue;
    const uint64_t first = begin / page * page;
    const uint64_t last = end > UINT64_MAX - (page - 1) ? UINT64_MAX / page * page
                                                        : (end + page - 1) / page * page;
    if (last <= first) continue;  // within the last partial page below 2^64
    if (!runs.empty() && first <= runs.back().second) {
      runs.back().second = std::max(runs.back().second, last);
    } else {
      runs.emplace_back(first, last);
    }
  }
  return runs;
}

}  // namespace ckptd
