// PyTorch Distributed Checkpoint (DCP) directories: a pickled `.metadata`
// plus data files (`__{rank}_{n}.distcp`) written by FileSystemWriter.
//
// Metadata{state_dict_metadata: fqn -> TensorStorageMetadata{properties,
// size, chunks: [ChunkStorageMetadata{offsets, sizes}]} or
// BytesStorageMetadata, storage_data: MetadataIndex{fqn, offset} ->
// _StorageInfo{relative_path, offset, length}}, from
// torch.distributed._shard.checkpoint.metadata (torch 1.13) or
// torch.distributed.checkpoint.metadata (2.x). Each tensor chunk becomes one
// shard. Its storage item, bytes [offset, offset + length) of
// relative_path, is a whole torch.save zip: the central directory gives
// archive/data.pkl (a protocol-2 pickle of _rebuild_tensor_v2/_v3 with a
// persistent-id storage) and archive/data/<key> (raw little-endian bytes,
// stored uncompressed). The shard's data_offset points at the tensor's first
// element inside that entry (storage offset honoured); tensors whose strides
// are not row-major contiguous are refused (UNIMPLEMENTED), as are items with
// transform_descriptors. Bytes items (non-tensor values) are skipped and
// reported.
#ifndef CKPTD_CORE_TORCH_DCP_H_
#define CKPTD_CORE_TORCH_DCP_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/io/file.h"
#include "core/format/metadata.h"
#include "core/format/pickle.h"

namespace ckpt {

// One member of a zip archive (stored entries only are usable).
struct ZipEntry {
  std::string name;
  uint16_t method = 0;        // 0: stored
  uint64_t size = 0;          // uncompressed size
  uint64_t compressed = 0;
  uint64_t header_offset = 0;  // local header, relative to the archive start
};

// Reads the central directory (zip64 aware) of the archive held in bytes
// [begin, begin + length) of `file`.
absl::StatusOr<std::vector<ZipEntry>> ReadZipDirectory(const RandomAccessFile& file,
                                                       uint64_t begin, uint64_t length);

// Absolute offset of the data of a stored entry (reads its local header).
absl::StatusOr<uint64_t> ZipEntryDataOffset(const RandomAccessFile& file, uint64_t begin,
                                            uint64_t length, const ZipEntry& entry);

// A tensor saved by torch.save, located in a file.
struct TorchSavedTensor {
  DType dtype = DType::kF32;
  Shape size;
  Shape stride;
  int64_t storage_offset = 0;  // elements
  uint64_t data_offset = 0;    // absolute offset of element 0 of the tensor
  uint64_t nbytes = 0;         // numel * itemsize
};

// Reads the torch.save archive in bytes [begin, begin + length) of `file`
// holding one tensor.
absl::StatusOr<TorchSavedTensor> ReadTorchSaveTensor(const RandomAccessFile& file,
                                                     uint64_t begin, uint64_t length);

// Converts a parsed DCP metadata pickle into the metadata model, locating
// every chunk's bytes in the data files of `dir`. Names of skipped non-tensor
// items go to `skipped`.
// Data files are opened through `dir` (Directory::OpenFile); the stamp of each goes
// to `stamps` when given.
absl::StatusOr<CheckpointMetadata> TorchDcpToModel(
    const pickle::Document& doc, const Directory& dir, std::vector<std::string>* skipped,
    std::map<std::string, FileStamp>* stamps = nullptr);

// --- Writing DCP data files (ckptd.torch.DaemonStorageWriter) -------------

// One item of a DCP data file.
struct DcpItemToWrite {
  std::string name;           // for errors
  DType dtype = DType::kF32;  // tensor items
  Shape shape;                // tensor items: row-major contiguous at `data`
  const void* data = nullptr;
  uint64_t nbytes = 0;
  bool raw = false;  // a bytes entry: its bytes (already torch.save'd) as they are
};

// Where an item landed: bytes [offset, offset + length) of the file, what
// DCP's _StorageInfo records.
struct DcpItemWritten {
  uint64_t offset = 0;
  uint64_t length = 0;
};

// Writes data file `name` of `dir` as torch's FileSystemWriter lays one out:
// the items one after another, each tensor as a whole torch.save archive (a
// zip of archive/data.pkl, archive/data/0 and archive/version, stored, the
// data entry zip64 and 64-byte aligned, as torch.load and ReadTorchSaveTensor
// read), each raw item as is. Every item starts 64-byte aligned. Bytes are
// copied into a private staging buffer, then CRC-32'd and written, so the
// archive is consistent even if `data` changes meanwhile. Temp name, fsync,
// rename, directory fsync. INVALID_ARGUMENT for a dtype torch cannot store
// (unsigned 16/32/64-bit, float8) or a size that does not match the shape.
absl::StatusOr<std::vector<DcpItemWritten>> WriteDcpDataFile(
    std::shared_ptr<const Directory> dir, const std::string& name,
    const std::vector<DcpItemToWrite>& items);

// data.pkl of a torch.save archive holding one contiguous tensor of `dtype`
// and `shape` whose storage is the archive's data/0 (exposed for tests).
absl::StatusOr<std::string> TorchTensorPickle(DType dtype, const Shape& shape);

}  // namespace ckpt

#endif  // CKPTD_CORE_TORCH_DCP_H_
