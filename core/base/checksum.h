// The checksums ckptd records in checkpoint metadata and verifies on every
// read: XXH3-64 of each kChecksumBlock-byte block of a shard's bytes.
#ifndef CKPTD_CORE_CHECKSUM_H_
#define CKPTD_CORE_CHECKSUM_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ckpt {

// Checksums cover blocks of this many bytes of a shard, so a load that reads
// a shard in pieces can still verify every whole block it reads.
inline constexpr uint64_t kChecksumBlock = 64ull << 20;

// XXH3-64 of a buffer (the checksum recorded in checkpoint metadata).
uint64_t Checksum(const void* data, size_t n);

// XXH3-64 of each `block`-byte block of `data` (the last may be shorter).
std::vector<uint64_t> BlockChecksums(const void* data, size_t n, uint64_t block = kChecksumBlock);

}  // namespace ckpt

#endif  // CKPTD_CORE_CHECKSUM_H_
