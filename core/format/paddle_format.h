// PaddlePaddle flex_checkpoint directories: pickled `{uid}.metadata` and
// `{rank}_{uid}.distcp` data files (pickled numpy arrays, or safetensors when
// saved with safetensors=True).
//
// Metadata: Metadata{state_dict_metadata: name -> [LocalTensorMetadata],
// storage_metadata: LocalTensorIndex -> file, flat_mapping}, from
// paddle.distributed.flex_checkpoint.dcp.metadata or the older
// paddle.distributed.checkpoint.metadata (whose records hold fewer fields:
// no global_shape, flattening or replica ids). Each storage entry becomes one
// shard: box (global_offset, local_shape), dtype from the metadata (bf16 is
// stored as uint16 in the data files), flattened range, replica id.
//
// Data files: a pickled dict {key: ndarray, "StructuredToParameterName@@":
// ..., "UnpackBigParamInfor@@": ...}. Arrays are numpy's protocol-4 form
// (_reconstruct + BUILD with the raw bytes) or protocol-5 form (_frombuffer
// of an in-band buffer); the bytes are located by file offset, never read.
// Big params split by old paddle.save (`key@@.0`, `key@@.1`, ... listed in
// UnpackBigParamInfor@@) become flattened pieces of the same box.
// Protocol-2 arrays (bytes pickled as latin-1 text) and Fortran-order arrays
// cannot be read in place and are refused (UNIMPLEMENTED).
#ifndef CKPTD_CORE_PADDLE_FORMAT_H_
#define CKPTD_CORE_PADDLE_FORMAT_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/io/file.h"
#include "core/format/metadata.h"
#include "core/format/pickle.h"

namespace ckpt {

// The metadata model of a parsed Paddle metadata pickle. Every shard's `file`
// is set; data_offset is 0 until LocatePaddleData fills it.
absl::StatusOr<CheckpointMetadata> PaddleMetadataToModel(const pickle::Document& doc);

// One array of a data file: where its raw bytes are.
struct PaddleArray {
  uint64_t offset = 0;  // absolute file offset
  uint64_t nbytes = 0;
  DType dtype = DType::kU8;  // as stored (bf16 arrays are U16)
  Shape shape;
};

// Arrays of one data file by key. A split big param maps its key to its
// pieces, in order (each a 1-D piece of the flattened array).
struct PaddleDataIndex {
  bool safetensors = false;
  std::map<std::string, std::vector<PaddleArray>> arrays;
};

// Reads the index of a data file: a pickle (parsed, payloads skipped) or a
// safetensors file (header only).
absl::StatusOr<PaddleDataIndex> ReadPaddleDataFile(const RandomAccessFile& file);

// Fills every shard's data_offset from the data files in `dir` (each read
// once, opened through `dir`: see Directory::OpenFile), checking sizes and dtypes;
// split params become several shards. The stamp of each data file read goes
// to `stamps` when given.
absl::Status LocatePaddleData(const Directory& dir, CheckpointMetadata* metadata,
                              std::map<std::string, FileStamp>* stamps = nullptr);

}  // namespace ckpt

#endif  // CKPTD_CORE_PADDLE_FORMAT_H_
