#include "core/io/s3/s3_xml.h"

#include <expat.h>

#include <functional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"

namespace ckpt {
namespace s3 {
namespace {

// Bounds on what one document may make us hold.
constexpr size_t kMaxDepth = 16;
constexpr size_t kMaxText = 64 << 10;
constexpr size_t kMaxEntries = 100000;

// A SAX walk that hands each leaf element's text to `on_leaf` with the
// names of the elements above it (namespaces ignored: local names only).
class Walker {
 public:
  using Leaf = std::function<void(const std::vector<std::string>& path, const std::string& text)>;
  using Open = std::function<void(const std::vector<std::string>& path)>;
  Walker(Leaf on_leaf, Open on_open) : on_leaf_(std::move(on_leaf)), on_open_(std::move(on_open)) {}

  absl::Status Run(absl::string_view xml) {
    if (xml.size() > kMaxXmlBytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("XML answer of ", xml.size(), " bytes, over ", kMaxXmlBytes));
    }
    XML_Parser p = XML_ParserCreate(nullptr);
    if (p == nullptr) return absl::ResourceExhaustedError("cannot create an XML parser");
    parser_ = p;
    XML_SetUserData(p, this);
    XML_SetElementHandler(p, &Walker::Start, &Walker::End);
    XML_SetCharacterDataHandler(p, &Walker::Chars);
    // No DTDs, no entities beyond XML's own: an entity-expansion bomb is an
    // error, not memory.
    XML_SetEntityDeclHandler(p, &Walker::EntityDecl);
    const XML_Status st = XML_Parse(p, xml.data(), static_cast<int>(xml.size()), XML_TRUE);
    absl::Status out;
    if (!error_.ok()) {
      out = error_;
    } else if (st != XML_STATUS_OK) {
      out = absl::DataLossError(absl::StrCat("malformed XML answer: ",
                                             XML_ErrorString(XML_GetErrorCode(p)), " at line ",
                                             XML_GetCurrentLineNumber(p)));
    }
    XML_ParserFree(p);
    return out;
  }

 private:
  static absl::string_view Local(const char* name) {
    absl::string_view n(name);
    const size_t colon = n.rfind(':');
    return colon == absl::string_view::npos ? n : n.substr(colon + 1);
  }
  static void Start(void* self_v, const char* name, const char** /*attrs*/) {
    auto* self = static_cast<Walker*>(self_v);
    if (!self->error_.ok()) return;
    if (self->path_.size() >= kMaxDepth) return self->StopCurrent("XML answer nested too deep");
    if (++self->elements_ > kMaxEntries * 8) return self->StopCurrent("XML answer too large");
    self->path_.emplace_back(Local(name));
    self->text_.clear();
    self->leaf_ = true;
    if (self->on_open_) self->on_open_(self->path_);
  }
  static void End(void* self_v, const char* /*name*/) {
    auto* self = static_cast<Walker*>(self_v);
    if (!self->error_.ok() || self->path_.empty()) return;
    if (self->leaf_) self->on_leaf_(self->path_, self->text_);
    self->leaf_ = false;
    self->text_.clear();
    self->path_.pop_back();
  }
  static void Chars(void* self_v, const char* s, int len) {
    auto* self = static_cast<Walker*>(self_v);
    if (!self->error_.ok() || !self->leaf_) return;
    if (self->text_.size() + len > kMaxText) return self->StopCurrent("XML text too long");
    self->text_.append(s, len);
  }
  static void EntityDecl(void* self_v, const XML_Char*, int, const XML_Char*, int, const XML_Char*,
                         const XML_Char*, const XML_Char*, const XML_Char*) {
    static_cast<Walker*>(self_v)->StopCurrent("XML answer declares entities");
  }
  void StopCurrent(absl::string_view why) {
    if (error_.ok()) error_ = absl::DataLossError(why);
    XML_StopParser(parser_, XML_FALSE);
  }

  Leaf on_leaf_;
  Open on_open_;
  std::vector<std::string> path_;
  std::string text_;
  bool leaf_ = false;
  size_t elements_ = 0;
  XML_Parser parser_ = nullptr;
  absl::Status error_;
};

}  // namespace

absl::StatusOr<ListPage> ParseListPage(absl::string_view xml) {
  ListPage page;
  bool root_ok = false;
  Walker w(
      [&](const std::vector<std::string>& path, const std::string& text) {
        if (path.size() == 2) {
          if (path[1] == "IsTruncated") page.truncated = text == "true";
          if (path[1] == "NextContinuationToken") page.next_token = text;
        } else if (path.size() == 3 && path[1] == "Contents" && !page.objects.empty()) {
          ListedObject& o = page.objects.back();
          if (path[2] == "Key") o.key = text;
          if (path[2] == "Size" && !absl::SimpleAtoi(text, &o.size)) o.size = UINT64_MAX;
          if (path[2] == "ETag") o.etag = std::string(absl::StripSuffix(absl::StripPrefix(text, "\""), "\""));
          if (path[2] == "LastModified") o.last_modified = text;
        } else if (path.size() == 3 && path[1] == "CommonPrefixes" && path[2] == "Prefix") {
          if (page.common_prefixes.size() < kMaxEntries) page.common_prefixes.push_back(text);
        }
      },
      [&](const std::vector<std::string>& path) {
        if (path.size() == 1) root_ok = path[0] == "ListBucketResult";
        if (path.size() == 2 && path[1] == "Contents" && page.objects.size() < kMaxEntries) {
          page.objects.emplace_back();
        }
      });
  absl::Status s = w.Run(xml);
  if (!s.ok()) return s;
  if (!root_ok) return absl::DataLossError("answer to a listing is not a ListBucketResult");
  for (const ListedObject& o : page.objects) {
    if (o.key.empty() || o.size == UINT64_MAX) {
      return absl::DataLossError("listing holds an entry without a key or a valid size");
    }
  }
  if (page.truncated && page.next_token.empty()) {
    return absl::DataLossError("truncated listing without a NextContinuationToken");
  }
  return page;
}

ErrorDoc ParseError(absl::string_view xml) {
  ErrorDoc e;
  Walker w(
      [&](const std::vector<std::string>& path, const std::string& text) {
        if (path.size() == 2 && path[0] == "Error") {
          if (path[1] == "Code") e.code = text.substr(0, 128);
          if (path[1] == "Message") e.message = text.substr(0, 512);
        }
      },
      nullptr);
  if (!w.Run(xml).ok()) return ErrorDoc();
  return e;
}

absl::StatusOr<std::string> ParseUploadId(absl::string_view xml) {
  std::string id;
  Walker w(
      [&](const std::vector<std::string>& path, const std::string& text) {
        if (path.size() == 2 && path[0] == "InitiateMultipartUploadResult" &&
            path[1] == "UploadId") {
          id = text;
        }
      },
      nullptr);
  absl::Status s = w.Run(xml);
  if (!s.ok()) return s;
  if (id.empty()) return absl::DataLossError("multipart upload answer without an UploadId");
  return id;
}

int64_t ParseTimeNs(absl::string_view s) {
  absl::Time t;
  std::string err;
  if (absl::ParseTime("%Y-%m-%d%ET%H:%M:%E*SZ", std::string(s), &t, &err) ||
      absl::ParseTime("%a, %d %b %Y %H:%M:%S GMT", std::string(s), &t, &err)) {
    return absl::ToUnixNanos(t);
  }
  return 0;
}

}  // namespace s3
}  // namespace ckpt
