// Checkpoints written by other frameworks: PaddlePaddle flex_checkpoint
// ({rank}_{uid}.distcp + pickled {uid}.metadata) and PyTorch DCP
// (.metadata + __{rank}_{n}.distcp), read without Python and without running
// anything a file names.
//
// A pickled metadata file is parsed once with the union of the metadata
// allow-lists; the class of its root record decides the format (Paddle's
// Metadata or torch's), not the file name. The converters (paddle_format.h,
// torch_dcp.h) then locate every shard's raw bytes (absolute file offsets)
// so the planner and executor read them with pread like native shards.
#ifndef CKPTD_CORE_FOREIGN_H_
#define CKPTD_CORE_FOREIGN_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/io/file.h"
#include "core/format/metadata.h"
#include "core/format/pickle.h"

namespace ckpt {

// Tags of allow-listed globals (pickle::AllowedGlobal::tag).
enum ForeignTag : int {
  kTagNone = 0,
  // Paddle metadata records (flex_checkpoint.dcp.metadata and the older
  // distributed.checkpoint.metadata).
  kTagPdMetadata = 1,
  kTagPdLocalTensorMetadata,
  kTagPdLocalTensorIndex,
  // torch DCP metadata records (1.13 _shard.checkpoint and 2.x checkpoint).
  kTagTMetadata = 20,
  kTagTTensorStorageMetadata,
  kTagTBytesStorageMetadata,
  kTagTChunkStorageMetadata,
  kTagTTensorProperties,
  kTagTMetadataIndex,
  kTagTStorageInfo,
  kTagTStorageMeta,
  kTagTInert,  // enum classes, layouts, paths: kept as records, ignored
  // numpy (Paddle data files).
  kTagNpReconstruct = 40,
  kTagNpNdarray,
  kTagNpDtype,
  kTagNpFrombuffer,
  kTagNpScalar,
  // torch.save data.pkl.
  kTagTorchRebuildV2 = 60,
  kTagTorchRebuildV3,
  kTagTorchUntypedStorage,
  // torch dtypes: kTagTorchDtype + DType; kTagTorchDtypeUnsupported for the rest.
  kTagTorchDtype = 1000,
  kTagTorchDtypeUnsupported = 1999,
  // Typed storages (torch.FloatStorage, ...): kTagTorchStorage + DType.
  kTagTorchStorage = 2000,
};

// Allow-lists.
const pickle::Options& MetadataPickleOptions();    // Paddle + torch metadata
const pickle::Options& NumpyPickleOptions();       // Paddle .distcp data files
const pickle::Options& TorchTensorPickleOptions(); // torch.save's data.pkl

// The torch class ("FloatStorage", ...) torch.save names for a tensor of
// dtype `d`; nullptr for dtypes torch has no legacy storage class for
// (unsigned 16/32/64-bit, float8).
const char* TorchStorageName(DType d);

// Whether the first bytes of a file are a pickle (PROTO opcode 0x80).
bool LooksPickled(absl::string_view head);


// Accepting a file dtype for a metadata dtype: equal, or the same size when
// the file stores a 16-bit float as uint16/int16 (numpy has no bfloat16) or
// an 8-bit float as uint8/int8.
bool StoredDTypeCompatible(DType metadata, DType file);

// The two dictionaries of a pickled checkpoint Metadata (Paddle's or
// torch's): its root must be the record `tag` (`format` names it in the
// error: "Paddle's Metadata"), with the fields state_dict_metadata and
// `storage_field` (storage_metadata / storage_data), both dicts.
struct MetadataDicts {
  const pickle::Object* root = nullptr;                 // the Metadata record
  const std::vector<pickle::Value>* tensors = nullptr;  // state_dict_metadata's items
  const std::vector<pickle::Value>* storage = nullptr;  // `storage_field`'s items
};
absl::StatusOr<MetadataDicts> MetadataDictsOf(const pickle::Document& doc, ForeignTag tag,
                                              absl::string_view format,
                                              absl::string_view storage_field);

}  // namespace ckpt

#endif  // CKPTD_CORE_FOREIGN_H_
