// PyTorch DCP saves' names (SaveRequest.format "pytorch-dcp"; saves_dcp.cc
// writes them): shared by the save checks and the DCP writer.
#ifndef CKPTD_SERVER_SAVE_DCP_H_
#define CKPTD_SERVER_SAVE_DCP_H_

#include <string>

#include "absl/strings/str_cat.h"

namespace ckptd {

// SaveRequest.format of a PyTorch DCP checkpoint (ckptd.torch.DaemonStorageWriter).
inline constexpr char kDcpFormat[] = "pytorch-dcp";
// Names the save job whose DCP data files a directory holds until its commit:
// the commit must come from that job, so two saves racing into one directory
// fail instead of committing one's metadata over the other's files.
inline constexpr char kDcpPending[] = ".ckptd-dcp-pending";

// ALREADY_EXISTS text for a DCP save into a directory holding a committed one.
inline std::string DcpCheckpointExists(const std::string& dir) {
  return absl::StrCat(dir, " already holds a PyTorch DCP checkpoint (.metadata); save elsewhere "
                      "or set overwrite");
}

}  // namespace ckptd

#endif  // CKPTD_SERVER_SAVE_DCP_H_
