// The daemon's object storage: the S3 storage (core/io/s3) made from the
// config's `s3` section and the AWS variables and files, registered for
// s3:// paths when a root is an s3:// URL; what it reports in Status.
// A build with --define=s3=0 (the GPU bundle: no libcurl to carry) has
// object_storage_none.cc instead, which refuses s3:// roots.
#ifndef CKPTD_SERVER_STORAGE_OBJECT_STORAGE_H_
#define CKPTD_SERVER_STORAGE_OBJECT_STORAGE_H_

#include "absl/status/statusor.h"
#include "config/config.h"
#include "proto/ckpt.pb.h"

namespace ckpt::s3 {
class S3Storage;
}  // namespace ckpt::s3

namespace ckptd {

// Registers the S3 storage when a root of `config` is an s3:// URL (nullptr
// when none is): refuses a root that is no valid URL, bad settings or
// unreadable credentials; logs the endpoint, the region and where the
// credentials come from, and warns about a root the endpoint does not list
// (unreachable, forbidden, a typo).
absl::StatusOr<ckpt::s3::S3Storage*> StartObjectStorage(const DaemonConfig& config);

// Status's object_storage (nothing when `storage` is nullptr).
void DescribeObjectStorage(ckpt::s3::S3Storage* storage, v1::StatusResponse* resp);

}  // namespace ckptd

#endif  // CKPTD_SERVER_STORAGE_OBJECT_STORAGE_H_
