// Private to the CUDA build of server/cuda: NCCL, loaded with dlopen at first
// use so that ckptd starts (and serves everything but NCCL links) on a
// machine without libnccl. Types come from nccl.h; no symbol is linked.
#ifndef CKPTD_SERVER_CUDA_NCCL_API_H_
#define CKPTD_SERVER_CUDA_NCCL_API_H_

#include <nccl.h>

#include <string>

#include "absl/status/statusor.h"

namespace ckptd::gpu {

struct NcclApi {
  std::string path;     // the library that was loaded
  int version = 0;      // ncclGetVersion, e.g. 22703
  const char* (*GetErrorString)(ncclResult_t) = nullptr;
  ncclResult_t (*GetUniqueId)(ncclUniqueId*) = nullptr;
  ncclResult_t (*CommInitRankConfig)(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*) = nullptr;
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*) = nullptr;
  ncclResult_t (*CommFinalize)(ncclComm_t) = nullptr;
  ncclResult_t (*CommDestroy)(ncclComm_t) = nullptr;
  ncclResult_t (*CommAbort)(ncclComm_t) = nullptr;
  ncclResult_t (*Send)(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*Recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = nullptr;
};

// Loads NCCL once (thread-safe) and returns it, or why it is unavailable
// (every place tried). Search order: $CKPTD_NCCL_LIBRARY (a file), then
// "libnccl.so.2" through the dynamic loader (system paths, LD_LIBRARY_PATH),
// then pip's nvidia-nccl wheels (nvidia/nccl/lib/libnccl.so.2 under
// $VIRTUAL_ENV, /usr/local/lib/python3*, /usr/lib/python3*, /opt/*/.venv,
// ~/.local).
absl::StatusOr<const NcclApi*> LoadNccl();

}  // namespace ckptd::gpu

#endif  // CKPTD_SERVER_CUDA_NCCL_API_H_
