#include "server/storage/object_storage.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/io/s3/s3_storage.h"
#include "core/io/s3/s3_url.h"

namespace ckptd {
namespace {

// The S3 settings of `c` (core's form).
ckpt::s3::S3Settings S3SettingsOf(const S3Config& c) {
  ckpt::s3::S3Settings s;
  s.endpoint = c.endpoint;
  s.region = c.region;
  s.profile = c.profile;
  s.addressing = c.addressing == "path"      ? ckpt::s3::Addressing::kPath
                 : c.addressing == "virtual" ? ckpt::s3::Addressing::kVirtual
                                             : ckpt::s3::Addressing::kAuto;
  s.ca_file = c.ca_file;
  s.connect_timeout_ms = absl::ToInt64Milliseconds(c.connect_timeout);
  s.stall_timeout_ms = absl::ToInt64Milliseconds(c.stall_timeout);
  s.max_attempts = static_cast<int>(c.max_attempts);
  s.max_bytes_per_s = c.max_bandwidth;
  s.max_requests = static_cast<int>(c.max_requests);
  return s;
}

}  // namespace

absl::StatusOr<ckpt::s3::S3Storage*> StartObjectStorage(const DaemonConfig& config) {
  std::vector<ckpt::s3::S3Url> roots;
  for (const std::string& root : config.roots) {
    if (!IsObjectStorageUrl(root)) continue;
    auto url = ckpt::s3::ParseS3Url(root);
    if (!url.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("config: root ", url.status().message()));
    }
    roots.push_back(*std::move(url));
  }
  if (roots.empty()) return nullptr;
  ckpt::s3::S3StorageOptions options;
  options.part_bytes = config.s3.part_size;
  options.spool_dir = config.s3.spool_dir;
  // Roots with settings of their own: what an entry leaves empty comes from
  // the section.
  std::vector<std::pair<std::string, ckpt::s3::S3Settings>> own;
  for (const S3RootConfig& r : config.s3.roots) {
    S3Config merged = config.s3;
    const S3Config& e = r.settings;
    if (!e.endpoint.empty()) merged.endpoint = e.endpoint;
    if (!e.region.empty()) merged.region = e.region;
    if (!e.profile.empty()) merged.profile = e.profile;
    if (e.addressing != "auto") merged.addressing = e.addressing;
    if (!e.ca_file.empty()) merged.ca_file = e.ca_file;
    own.emplace_back(r.root, S3SettingsOf(merged));
  }
  auto storage = ckpt::s3::RegisterS3Storage(S3SettingsOf(config.s3), options, own);
  if (!storage.ok()) {
    return absl::Status(storage.status().code(),
                        absl::StrCat("object storage (s3 roots): ", storage.status().message()));
  }
  for (const ckpt::s3::S3Url& root : roots) {
    ckpt::s3::S3Client& client = (*storage)->ClientFor(root);
    spdlog::info("root {}: endpoint {} region {} ({} addressing), credentials from {}",
                 root.ToString(), client.endpoint().url, client.endpoint().region,
                 client.endpoint().path_style ? "path-style" : "virtual-hosted",
                 client.CredentialsSource());
    auto page = client.List(root.bucket, root.DirPrefix(), "/", "", 1);
    if (!page.ok()) {
      spdlog::warn("root {}: {}; requests under it fail until the endpoint lists it",
                   root.ToString(), std::string(page.status().message()));
    }
  }
  return *storage;
}

void DescribeObjectStorage(ckpt::s3::S3Storage* storage, v1::StatusResponse* resp) {
  if (storage == nullptr) return;
  ckpt::s3::S3Client& c = storage->client();
  v1::ObjectStorageStatus* o = resp->mutable_object_storage();
  o->set_endpoint(c.endpoint().url);
  o->set_region(c.endpoint().region);
  o->set_credentials(c.CredentialsSource());
  // One request bound for the daemon (every root's client shares it).
  o->set_max_requests(static_cast<uint32_t>(std::max(0, c.slots().max())));
  o->set_requests_peak(static_cast<uint32_t>(c.slots().peak()));
  o->set_request_wait_seconds(c.slots().waited_s());
  // Requests of every client (the default one and the roots' own), summed.
  storage->ForEachClient([o](ckpt::s3::S3Client& each) {
    const ckpt::s3::ClientStats& st = each.stats();
    o->set_heads(o->heads() + st.heads.load());
    o->set_gets(o->gets() + st.gets.load());
    o->set_lists(o->lists() + st.lists.load());
    o->set_puts(o->puts() + st.puts.load());
    o->set_deletes(o->deletes() + st.deletes.load());
    o->set_retries(o->retries() + st.retries.load());
    o->set_bytes_in(o->bytes_in() + st.bytes_in.load());
    o->set_bytes_out(o->bytes_out() + st.bytes_out.load());
  });
}

}  // namespace ckptd
