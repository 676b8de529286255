#include "core/base/checksum.h"

#include <algorithm>

#include "core/base/xxh3.h"

namespace ckpt {

uint64_t Checksum(const void* data, size_t n) { return XXH3_64bits(data, n); }

std::vector<uint64_t> BlockChecksums(const void* data, size_t n, uint64_t block) {
  std::vector<uint64_t> out;
  const uint8_t* p = static_cast<const uint8_t*>(data);
  for (size_t off = 0; off < n; off += block) {
    out.push_back(Checksum(p + off, std::min<uint64_t>(block, n - off)));
  }
  return out;
}

}  // namespace ckpt
