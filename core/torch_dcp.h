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
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/file.h"
#include "core/metadata.h"
#include "core/pickle.h"

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
// Data files are opened through `dir` (OpenFileAt); the stamp of each goes
// to `stamps` when given.
absl::StatusOr<CheckpointMetadata> TorchDcpToModel(
    const pickle::Document& doc, const Directory& dir, std::vector<std::string>* skipped,
    std::map<std::string, FileStamp>* stamps = nullptr);

}  // namespace ckpt

#endif  // CKPTD_CORE_TORCH_DCP_H_
