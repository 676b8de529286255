// Object storage in a build without it (--define=s3=0: the GPU bundle, which
// does not carry libcurl and its libraries): s3:// roots are refused at start.
#include "absl/strings/str_cat.h"
#include "server/storage/object_storage.h"

namespace ckptd {

absl::StatusOr<ckpt::s3::S3Storage*> StartObjectStorage(const DaemonConfig& config) {
  for (const std::string& root : config.roots) {
    if (IsObjectStorageUrl(root)) {
      return absl::UnimplementedError(absl::StrCat(
          "config: root ", root, ": this ckptd was built without object storage "
          "(--define=s3=0); build it without that define to serve s3:// roots"));
    }
  }
  return nullptr;
}

void DescribeObjectStorage(ckpt::s3::S3Storage*, v1::StatusResponse*) {}

}  // namespace ckptd
