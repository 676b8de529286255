// Private to the CUDA build of server/cuda: the NCCL links' entry points.
#ifndef CKPTD_SERVER_CUDA_CUDA_INTERNAL_H_
#define CKPTD_SERVER_CUDA_CUDA_INTERNAL_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/cuda/peer_link.h"

namespace ckptd::gpu {

absl::StatusOr<std::string> NcclUniqueId();
absl::StatusOr<std::unique_ptr<PeerLinks>> ConnectNccl(const PeerLinkSpec& spec);

}  // namespace ckptd::gpu

#endif  // CKPTD_SERVER_CUDA_CUDA_INTERNAL_H_
