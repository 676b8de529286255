#include "core/io/s3/s3_url.h"

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace ckpt {
namespace s3 {

std::string S3Url::ToString() const {
  return key.empty() ? absl::StrCat(kScheme, bucket) : absl::StrCat(kScheme, bucket, "/", key);
}

bool IsS3Url(absl::string_view path) { return absl::StartsWith(path, kScheme); }

namespace {
absl::Status Bad(absl::string_view url, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("'", absl::CHexEscape(url), "': ", why));
}

bool ValidBucket(absl::string_view b) {
  if (b.size() < 3 || b.size() > 63) return false;
  for (char c : b) {
    if (!(absl::ascii_islower(c) || absl::ascii_isdigit(c) || c == '.' || c == '-')) return false;
  }
  auto alnum = [](char c) { return absl::ascii_islower(c) || absl::ascii_isdigit(c); };
  return alnum(b.front()) && alnum(b.back());
}
}  // namespace

absl::StatusOr<S3Url> ParseS3Url(absl::string_view url) {
  absl::string_view rest = url;
  if (!absl::ConsumePrefix(&rest, kScheme)) return Bad(url, "not an s3:// URL");
  for (char c : rest) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      return Bad(url, "holds a control byte");
    }
  }
  S3Url out;
  const size_t slash = rest.find('/');
  out.bucket = std::string(rest.substr(0, slash));
  if (!ValidBucket(out.bucket)) {
    return Bad(url, "not a valid bucket name (3-63 of a-z, 0-9, '.', '-')");
  }
  if (slash == absl::string_view::npos) return out;
  absl::string_view key = rest.substr(slash + 1);
  absl::ConsumeSuffix(&key, "/");
  if (key.empty()) return out;
  if (key.size() > kMaxKeyBytes) return Bad(url, "key longer than S3's 1,024 bytes");
  for (absl::string_view seg : absl::StrSplit(key, '/')) {
    if (seg.empty()) return Bad(url, "empty path segment ('//')");
    if (seg == "." || seg == "..") return Bad(url, "'.' or '..' segment");
  }
  out.key = std::string(key);
  return out;
}

std::string UriEncode(absl::string_view s, bool keep_slash) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size());
  for (char ch : s) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if (absl::ascii_isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' ||
        (keep_slash && c == '/')) {
      out.push_back(ch);
    } else {
      out.push_back('%');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  return out;
}

}  // namespace s3
}  // namespace ckpt
