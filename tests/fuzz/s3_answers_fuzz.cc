// Fuzz target: what an S3 endpoint or the AWS files hand ckptd (issue 36),
// parsed as core/io/s3 parses them: ListObjectsV2 pages, <Error> documents,
// multipart upload answers (expat), the AWS credentials/config INI files,
// s3:// URLs a client sends, and the times in answers.
//
// Properties: nothing crashes or throws; a listing that parses has a key and
// a size on every entry, and a continuation token when truncated; a URL
// that parses has no "." / ".." / empty segment, and its canonical form
// parses back to itself; an INI file's keys are lower-case and trimmed.
#include <cstdint>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_split.h"
#include "core/io/s3/s3_config.h"
#include "core/io/s3/s3_url.h"
#include "core/io/s3/s3_xml.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string in = ckptd_fuzz::Str(data, size);
  namespace s3 = ckpt::s3;

  auto page = s3::ParseListPage(in);
  if (page.ok()) {
    for (const s3::ListedObject& o : page->objects) {
      FUZZ_CHECK(!o.key.empty(), "listed object without a key");
    }
    FUZZ_CHECK(!page->truncated || !page->next_token.empty(), "truncated without a token");
  }
  (void)s3::ParseError(in);
  auto id = s3::ParseUploadId(in);
  if (id.ok()) FUZZ_CHECK(!id->empty(), "empty upload id accepted");
  (void)s3::ParseTimeNs(in);

  auto ini = s3::ParseIni(in);
  if (ini.ok()) {
    for (const auto& [section, keys] : *ini) {
      for (const auto& [k, v] : keys) {
        FUZZ_CHECK(!k.empty() && k == absl::AsciiStrToLower(k), k);
        FUZZ_CHECK(k == std::string(absl::StripAsciiWhitespace(k)), k);
      }
    }
  }

  auto url = s3::ParseS3Url(in);
  if (url.ok()) {
    for (absl::string_view seg : absl::StrSplit(url->key, '/')) {
      FUZZ_CHECK(url->key.empty() || (!seg.empty() && seg != "." && seg != ".."), in);
    }
    auto again = s3::ParseS3Url(url->ToString());
    FUZZ_CHECK(again.ok() && again->ToString() == url->ToString(), url->ToString());
  }
  (void)s3::UriEncode(in, true);
  return 0;
}
