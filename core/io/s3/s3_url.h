// `s3://bucket/key` locations: parsing and the checks that make a key safe
// to use as a checkpoint path (no "." or ".." segments, no empty segments,
// no control bytes), so prefix checks on the string mean what they say.
#ifndef CKPTD_CORE_IO_S3_S3_URL_H_
#define CKPTD_CORE_IO_S3_S3_URL_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ckpt {
namespace s3 {

inline constexpr absl::string_view kScheme = "s3://";
// S3's limit on a key's length in bytes.
inline constexpr size_t kMaxKeyBytes = 1024;

struct S3Url {
  std::string bucket;
  // The key (an object) or prefix (a "directory"), without a leading or
  // trailing '/'; empty for the bucket's top.
  std::string key;
  // "s3://bucket/key" (the canonical form).
  std::string ToString() const;
  // The key prefix of the objects beneath this one as a directory: "key/",
  // or "" for the bucket's top.
  std::string DirPrefix() const { return key.empty() ? std::string() : key + "/"; }
};

bool IsS3Url(absl::string_view path);

// Parses "s3://bucket[/key]". A trailing '/' is dropped; "//" anywhere, "."
// or ".." segments, NUL or control bytes, a bucket name S3 would refuse
// (3-63 of [a-z0-9.-], starting and ending with a letter or digit) or a key
// over 1,024 bytes are INVALID_ARGUMENT errors naming the URL.
absl::StatusOr<S3Url> ParseS3Url(absl::string_view url);

// Percent-encodes `s` as S3's signature V4 wants it: every byte but
// A-Z a-z 0-9 - _ . ~ is %XX (uppercase); '/' too unless `keep_slash`.
std::string UriEncode(absl::string_view s, bool keep_slash);

}  // namespace s3
}  // namespace ckpt

#endif  // CKPTD_CORE_IO_S3_S3_URL_H_
