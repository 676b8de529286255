// The XML documents an S3 server answers with (ListObjectsV2, errors,
// multipart uploads), parsed with expat. Untrusted input: bounded, never
// crashes (fuzzed: tests/fuzz/s3_xml_fuzz.cc).
#ifndef CKPTD_CORE_IO_S3_S3_XML_H_
#define CKPTD_CORE_IO_S3_S3_XML_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ckpt {
namespace s3 {

// Documents larger than this are refused before parsing (a ListObjectsV2
// page of 1,000 keys of 1,024 bytes is about 1.3 MB).
inline constexpr size_t kMaxXmlBytes = 8 << 20;

struct ListedObject {
  std::string key;
  uint64_t size = 0;
  std::string etag;           // as sent, quotes removed
  std::string last_modified;  // ISO 8601
};

struct ListPage {
  std::vector<ListedObject> objects;
  std::vector<std::string> common_prefixes;
  bool truncated = false;
  std::string next_token;  // NextContinuationToken
};

// ListBucketResult (ListObjectsV2).
absl::StatusOr<ListPage> ParseListPage(absl::string_view xml);

struct ErrorDoc {
  std::string code;     // "NoSuchKey", "SlowDown", ...
  std::string message;
};
// <Error><Code>..</Code><Message>..</Message></Error>; empty fields when
// the body is not such a document.
ErrorDoc ParseError(absl::string_view xml);

// InitiateMultipartUploadResult's UploadId.
absl::StatusOr<std::string> ParseUploadId(absl::string_view xml);

// Seconds since the epoch of an ISO 8601 time ("2026-12-05T15:38:47.108Z")
// or an HTTP date ("Sat, 05 Dec 2026 15:38:47 GMT"), with nanoseconds; 0
// when neither.
int64_t ParseTimeNs(absl::string_view s);

}  // namespace s3
}  // namespace ckpt

#endif  // CKPTD_CORE_IO_S3_S3_XML_H_
