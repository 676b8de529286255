// safetensors files: strict header parsing and writing.
//
// Layout: u64 little-endian header length N, N bytes of JSON, then the data
// area. The JSON maps tensor names to {"dtype", "shape", "data_offsets":
// [begin, end)} (relative to the data area) plus an optional "__metadata__"
// string map. Parsing checks everything a hostile or torn file could get
// wrong: header length cap, well-formed JSON, known dtypes, sizes that match
// prod(shape) * itemsize without overflow, offsets inside the file, tensors
// that neither overlap nor leave holes, and a data area that ends where the
// file ends. Errors name the file and the tensor.
//
// Reading never loads the data area: callers pread the byte ranges they need.
#ifndef CKPTD_CORE_SAFETENSORS_H_
#define CKPTD_CORE_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/base/box.h"
#include "core/base/checksum.h"
#include "core/base/dtype.h"
#include "core/io/file.h"

namespace ckpt {

// Headers larger than this are refused (the safetensors reference limit).
inline constexpr uint64_t kMaxSafetensorsHeader = 100ull << 20;

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  uint64_t begin = 0;  // absolute file offset of the first byte
  uint64_t end = 0;    // absolute file offset one past the last byte
};

struct SafetensorsHeader {
  uint64_t data_start = 0;  // absolute offset of the data area
  uint64_t file_size = 0;
  std::vector<SafetensorsTensor> tensors;  // in file (offset) order
  std::map<std::string, std::string> metadata;

  // nullptr if absent.
  const SafetensorsTensor* Find(const std::string& name) const;
};

// Reads and validates the header of `file` (two small preads).
absl::StatusOr<SafetensorsHeader> ReadSafetensorsHeader(const RandomAccessFile& file);

// Validates a header JSON given the file's total size; `path` is for errors.
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(const std::string& path,
                                                         const std::string& json,
                                                         uint64_t file_size);

struct TensorToWrite {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  const void* data = nullptr;  // prod(shape) * DTypeSize(dtype) bytes
};

struct WrittenTensor {
  std::string name;
  uint64_t begin = 0;  // absolute file offsets
  uint64_t end = 0;
  // XXH3-64 of each kChecksumBlock-byte block of the tensor's bytes (the
  // last block may be shorter); empty for an empty tensor.
  std::vector<uint64_t> xxh3;
};

// Writes a safetensors file atomically and durably (temp name, fsync,
// rename, directory fsync: AtomicFileWriter). The header is padded with
// spaces so the data area starts on a 4 KiB boundary (page aligned reads).
// Tensors are written in the given order; names must be unique and must not
// be "__metadata__". Each tensor's bytes are copied piece by piece into a
// private staging buffer which is hashed and then written, so the recorded
// checksums are those of exactly the bytes in the file even if `data` is
// being modified meanwhile (a client still writing its shared memory).
absl::StatusOr<std::vector<WrittenTensor>> WriteSafetensors(
    const std::string& path, const std::vector<TensorToWrite>& tensors,
    const std::map<std::string, std::string>& metadata, uint64_t checksum_block = 64ull << 20);
// The same, as file `name` of `dir`.
absl::StatusOr<std::vector<WrittenTensor>> WriteSafetensorsIn(
    std::shared_ptr<const Directory> dir, const std::string& name,
    const std::vector<TensorToWrite>& tensors, const std::map<std::string, std::string>& metadata,
    uint64_t checksum_block = 64ull << 20);


}  // namespace ckpt

#endif  // CKPTD_CORE_SAFETENSORS_H_
