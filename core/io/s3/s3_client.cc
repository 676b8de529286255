#include "core/io/s3/s3_client.h"

#include <curl/curl.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "core/io/s3/s3_url.h"

namespace ckpt {
namespace s3 {

// Error bodies and XML answers are kept up to this many bytes.
constexpr size_t kMaxErrorBody = 64 << 10;
// Bodies above kBigBody bytes are received kBigBodyBuffer bytes at a time.
constexpr uint64_t kBigBody = 1 << 20;
constexpr long kBigBodyBuffer = 256 << 10;

struct S3Client::Call {
  Call(const char* verb, std::string bucket, std::string key, std::atomic<uint64_t>* counter)
      : verb(verb), bucket(std::move(bucket)), key(std::move(key)), counter(counter) {}

  const char* verb = "GET";
  std::string bucket, key;
  std::vector<std::pair<std::string, std::string>> query;  // in sorted order
  std::vector<std::string> headers;
  std::atomic<uint64_t>* counter = nullptr;
  RateLimiter* limiter = nullptr;  // paces the bodies both ways
  RequestSlots* slots = nullptr;   // bounds the requests in flight
  // A body to send.
  const uint8_t* upload = nullptr;
  uint64_t upload_n = 0;
  uint64_t upload_at = 0;
  // Where a successful answer's body goes: `dst` (exactly `dst_n` bytes
  // expected), else `body` (up to `body_cap` bytes).
  uint8_t* dst = nullptr;
  uint64_t dst_n = 0;
  size_t body_cap = kMaxXmlBytes;
  // The answer.
  long status = 0;
  std::string body;
  uint64_t received = 0;
  bool overflow = false;
  std::string etag, last_modified;
  uint64_t content_length = UINT64_MAX;

  std::string what;  // what errors name, when not the object
  // Stall detection (OnProgress): bytes moved so far, and when the last moved.
  int64_t stall_ns = 0;
  uint64_t moved = 0;
  int64_t moved_at_ns = 0;
  bool stalled = false;

  std::string What() const { return what.empty() ? S3Url{bucket, key}.ToString() : what; }
  bool Success() const { return status >= 200 && status < 300; }
  void ResetAnswer() {
    status = 0;
    body.clear();
    received = 0;
    overflow = false;
    etag.clear();
    last_modified.clear();
    content_length = UINT64_MAX;
    upload_at = 0;
    moved = 0;
    moved_at_ns = 0;
    stalled = false;
  }
};

namespace {

std::once_flag g_curl_init;

size_t OnHeader(char* data, size_t size, size_t count, void* user) {
  auto* call = static_cast<S3Client::Call*>(user);
  const size_t n = size * count;
  absl::string_view line(data, n);
  line = absl::StripTrailingAsciiWhitespace(line);
  if (absl::StartsWith(line, "HTTP/")) {
    // A new status line (after a 100 Continue, say): the answer starts over.
    const size_t sp = line.find(' ');
    long code = 0;
    if (sp != absl::string_view::npos) {
      (void)absl::SimpleAtoi(line.substr(sp + 1, 3), &code);
    }
    call->status = code;
    call->etag.clear();
    call->last_modified.clear();
    call->content_length = UINT64_MAX;
    return n;
  }
  const size_t colon = line.find(':');
  if (colon == absl::string_view::npos) return n;
  const std::string name = absl::AsciiStrToLower(line.substr(0, colon));
  absl::string_view value = absl::StripAsciiWhitespace(line.substr(colon + 1));
  if (name == "etag") {
    call->etag = std::string(absl::StripSuffix(absl::StripPrefix(value, "\""), "\""));
  } else if (name == "last-modified") {
    call->last_modified = std::string(value);
  } else if (name == "content-length") {
    uint64_t v;
    if (absl::SimpleAtoi(value, &v)) call->content_length = v;
  }
  return n;
}

size_t OnBody(char* data, size_t size, size_t count, void* user) {
  auto* call = static_cast<S3Client::Call*>(user);
  const size_t n = size * count;
  if (call->limiter != nullptr) call->limiter->Acquire(n);
  if (call->Success() && call->dst != nullptr) {
    // Never a byte past the buffer the caller gave: more than asked for
    // aborts the transfer.
    if (call->received + n > call->dst_n) {
      call->overflow = true;
      return 0;
    }
    std::memcpy(call->dst + call->received, data, n);
  } else {
    const size_t cap = call->Success() ? call->body_cap : kMaxErrorBody;
    if (call->body.size() + n > cap) {
      call->overflow = true;
      return 0;
    }
    call->body.append(data, n);
  }
  call->received += n;
  return n;
}

size_t OnUpload(char* buf, size_t size, size_t count, void* user) {
  auto* call = static_cast<S3Client::Call*>(user);
  const uint64_t left = call->upload_n - call->upload_at;
  const size_t n = static_cast<size_t>(std::min<uint64_t>(left, size * count));
  if (call->limiter != nullptr && n > 0) call->limiter->Acquire(n);
  if (n > 0) std::memcpy(buf, call->upload + call->upload_at, n);
  call->upload_at += n;
  return n;
}

// Cuts a transfer that moved no byte either way for the stall timeout (a
// server or proxy that stops mid-body); libcurl calls this at least once a
// second, also while nothing arrives.
int OnProgress(void* user, curl_off_t, curl_off_t dlnow, curl_off_t, curl_off_t ulnow) {
  auto* call = static_cast<S3Client::Call*>(user);
  const int64_t now = absl::GetCurrentTimeNanos();
  const uint64_t moved = static_cast<uint64_t>(dlnow) + static_cast<uint64_t>(ulnow);
  if (moved != call->moved || call->moved_at_ns == 0) {
    if (moved != call->moved && call->slots != nullptr) call->slots->Moved();
    call->moved = moved;
    call->moved_at_ns = now;
    return 0;
  }
  if (now - call->moved_at_ns > call->stall_ns) {
    call->stalled = true;
    return 1;  // CURLE_ABORTED_BY_CALLBACK
  }
  return 0;
}

bool RetryableHttp(long status) {
  return status == 500 || status == 502 || status == 503 || status == 504 || status == 429 ||
         status == 408;
}

absl::StatusCode CodeFor(long status) {
  switch (status) {
    case 404: return absl::StatusCode::kNotFound;
    case 401:
    case 403: return absl::StatusCode::kPermissionDenied;
    case 409:
    case 412: return absl::StatusCode::kAborted;
    case 416: return absl::StatusCode::kOutOfRange;
    case 400: return absl::StatusCode::kInvalidArgument;
    default: return RetryableHttp(status) ? absl::StatusCode::kUnavailable
                                          : absl::StatusCode::kInternal;
  }
}

std::string HostOf(const std::string& url) {
  absl::string_view rest = url;
  const size_t scheme = rest.find("://");
  return std::string(rest.substr(scheme + 3));
}

// A transfer that moves no byte this long is cut (and waiters for a
// request slot count in it).
int64_t StallNs(const S3Settings& s) { return std::max<int64_t>(1, s.stall_timeout_ms) * 1000000; }

}  // namespace

absl::StatusOr<std::unique_ptr<S3Client>> S3Client::Create(const S3Settings& settings,
                                                           const Getenv& env, Bounds shared) {
  std::call_once(g_curl_init, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  auto endpoint = ResolveEndpoint(settings, env);
  if (!endpoint.ok()) return endpoint.status();
  if (shared.limiter == nullptr) {
    shared.limiter = std::make_shared<RateLimiter>(settings.max_bytes_per_s);
  }
  if (shared.slots == nullptr) {
    shared.slots = std::make_shared<RequestSlots>(settings.max_requests, StallNs(settings));
  }
  auto client = std::unique_ptr<S3Client>(
      new S3Client(settings, *std::move(endpoint), env, std::move(shared)));
  // Credentials that cannot be read are an error now, not at the first load.
  auto creds = client->credentials_.Get();
  if (!creds.ok()) return creds.status();
  return client;
}

S3Client::S3Client(S3Settings settings, Endpoint endpoint, Getenv env, Bounds bounds)
    : settings_(std::move(settings)),
      endpoint_(std::move(endpoint)),
      credentials_(settings_, std::move(env)),
      bounds_(std::move(bounds)) {}

S3Client::~S3Client() {
  absl::MutexLock lock(&mu_);
  for (void* h : idle_) curl_easy_cleanup(static_cast<CURL*>(h));
}

std::string S3Client::CredentialsSource() {
  auto c = credentials_.Get();
  return c.ok() ? c->source : std::string(c.status().message());
}

void* S3Client::TakeHandle() {
  {
    absl::MutexLock lock(&mu_);
    if (!idle_.empty()) {
      void* h = idle_.back();
      idle_.pop_back();
      return h;
    }
  }
  return curl_easy_init();
}

void S3Client::ReturnHandle(void* h) {
  absl::MutexLock lock(&mu_);
  if (idle_.size() < 64) {
    idle_.push_back(h);
  } else {
    curl_easy_cleanup(static_cast<CURL*>(h));
  }
}

absl::Status S3Client::PerformOnce(Call& call, void* handle) {
  CURL* h = static_cast<CURL*>(handle);
  curl_easy_reset(h);  // options only: the connection stays open for reuse
  auto creds = credentials_.Get();
  if (!creds.ok()) return creds.status();
  std::string url;
  const std::string key = UriEncode(call.key, /*keep_slash=*/true);
  if (endpoint_.path_style || call.bucket.find('.') != std::string::npos) {
    url = absl::StrCat(endpoint_.url, "/", call.bucket, key.empty() ? "" : "/", key);
  } else {
    const size_t scheme = endpoint_.url.find("://");
    url = absl::StrCat(endpoint_.url.substr(0, scheme + 3), call.bucket, ".",
                       HostOf(endpoint_.url), "/", key);
  }
  if (!call.query.empty()) {
    std::vector<std::string> parts;
    for (const auto& [k, v] : call.query) {
      parts.push_back(absl::StrCat(UriEncode(k, false), "=", UriEncode(v, false)));
    }
    absl::StrAppend(&url, "?", absl::StrJoin(parts, "&"));
  }
  curl_slist* headers = nullptr;
  auto add = [&](const std::string& hdr) { headers = curl_slist_append(headers, hdr.c_str()); };
  add("x-amz-content-sha256: UNSIGNED-PAYLOAD");
  // (Not "Expect:" to turn 100-continue off: libcurl signs the empty header
  // and then does not send it, and every upload is SignatureDoesNotMatch.)
  for (const std::string& hdr : call.headers) add(hdr);
  std::string userpwd;
  if (!creds->anonymous()) {
    if (!creds->session_token.empty()) add("x-amz-security-token: " + creds->session_token);
    const std::string sigv4 = absl::StrCat("aws:amz:", endpoint_.region, ":s3");
    curl_easy_setopt(h, CURLOPT_AWS_SIGV4, sigv4.c_str());
    userpwd = absl::StrCat(creds->access_key, ":", creds->secret_key);
    curl_easy_setopt(h, CURLOPT_USERPWD, userpwd.c_str());
  }
  curl_easy_setopt(h, CURLOPT_URL, url.c_str());
  curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(h, CURLOPT_FOLLOWLOCATION, 0L);
  curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(settings_.connect_timeout_ms));
  curl_easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
  curl_easy_setopt(h, CURLOPT_XFERINFOFUNCTION, &OnProgress);
  curl_easy_setopt(h, CURLOPT_XFERINFODATA, &call);
  curl_easy_setopt(h, CURLOPT_TCP_NODELAY, 1L);
  curl_easy_setopt(h, CURLOPT_EXPECT_100_TIMEOUT_MS, 200L);
  if (!endpoint_.ca_file.empty()) curl_easy_setopt(h, CURLOPT_CAINFO, endpoint_.ca_file.c_str());
  curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, &OnHeader);
  curl_easy_setopt(h, CURLOPT_HEADERDATA, &call);
  curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, &OnBody);
  curl_easy_setopt(h, CURLOPT_WRITEDATA, &call);
  // Bodies into a caller's buffer (data reads, megabytes) come in 256 KiB
  // receives and callbacks, not libcurl's default 16 KiB: a sixteenth of the
  // syscalls and callbacks per byte (the curl tool uses 100 KiB).
  curl_easy_setopt(h, CURLOPT_BUFFERSIZE, call.dst != nullptr && call.dst_n > kBigBody
                                              ? kBigBodyBuffer
                                              : static_cast<long>(CURL_MAX_WRITE_SIZE));
  const absl::string_view verb = call.verb;
  if (verb == "HEAD") {
    curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
  } else if (verb == "PUT") {
    curl_easy_setopt(h, CURLOPT_UPLOAD, 1L);
    curl_easy_setopt(h, CURLOPT_READFUNCTION, &OnUpload);
    curl_easy_setopt(h, CURLOPT_READDATA, &call);
    curl_easy_setopt(h, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(call.upload_n));
  } else if (verb == "POST") {
    curl_easy_setopt(h, CURLOPT_POST, 1L);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, reinterpret_cast<const char*>(call.upload));
    curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(call.upload_n));
  } else if (verb != "GET") {
    curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, call.verb);
  }
  char errbuf[CURL_ERROR_SIZE] = {0};
  curl_easy_setopt(h, CURLOPT_ERRORBUFFER, errbuf);
  call.ResetAnswer();
  const CURLcode rc = curl_easy_perform(h);
  curl_slist_free_all(headers);
  if (call.counter != nullptr) call.counter->fetch_add(1, std::memory_order_relaxed);
  if (rc == CURLE_ABORTED_BY_CALLBACK && call.stalled) {
    return absl::UnavailableError(absl::StrCat(call.What(), ": ", call.verb, " ", endpoint_.url,
                                               ": stalled: no byte moved for ",
                                               settings_.stall_timeout_ms, " ms"));
  }
  if (rc != CURLE_OK && !(rc == CURLE_WRITE_ERROR && call.overflow)) {
    return absl::UnavailableError(absl::StrCat(
        call.What(), ": ", call.verb, " ", endpoint_.url, ": ",
        errbuf[0] != 0 ? errbuf : curl_easy_strerror(rc)));
  }
  return absl::OkStatus();
}

void RateLimiter::Acquire(uint64_t n) {
  if (rate_ == 0 || n == 0) return;
  constexpr int64_t kBurstNs = 50'000'000;
  int64_t wait_ns = 0;
  {
    absl::MutexLock lock(&mu_);
    const int64_t now = absl::GetCurrentTimeNanos();
    const int64_t start = std::max(next_ns_, now - kBurstNs);
    next_ns_ = start + static_cast<int64_t>(static_cast<double>(n) * 1e9 / rate_);
    wait_ns = next_ns_ - kBurstNs - now;
  }
  if (wait_ns > 0) std::this_thread::sleep_for(std::chrono::nanoseconds(wait_ns));
}

absl::Status RequestSlots::Acquire(const std::string& what) {
  absl::MutexLock lock(&mu_);
  if (max_ > 0 && in_flight_ >= max_) {
    const int64_t since = absl::GetCurrentTimeNanos();
    auto free = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_ < max_; };
    // Woken by a Release; between them, every 100 ms to see whether the
    // holders still move bytes.
    while (!mu_.AwaitWithTimeout(absl::Condition(&free), absl::Milliseconds(100))) {
      // A holder that stalls is cut after stall_timeout (noticed within a
      // second) and frees its slot: waiting twice that, plus a second, since
      // the last byte any holder moved means something is wedged.
      // (Counted from this wait's start when nothing moved since.)
      const int64_t now = absl::GetCurrentTimeNanos();
      const int64_t bound = 2 * stall_ns_ + 1'000'000'000;
      if (now - std::max(moved_ns_.load(std::memory_order_relaxed), since) > bound) {
        waited_ns_ += now - since;
        return absl::UnavailableError(absl::StrCat(
            what, ": no request slot came free (max_requests ", max_, "): the ", in_flight_,
            " requests in flight moved no byte for ", bound / 1000000, " ms"));
      }
    }
    waited_ns_ += absl::GetCurrentTimeNanos() - since;
  }
  peak_ = std::max(peak_, ++in_flight_);
  return absl::OkStatus();
}

void RequestSlots::Release() {
  Moved();  // a request that ends is progress too
  absl::MutexLock lock(&mu_);
  --in_flight_;
}

int RequestSlots::peak() const {
  absl::MutexLock lock(&mu_);
  return peak_;
}

double RequestSlots::waited_s() const {
  absl::MutexLock lock(&mu_);
  return static_cast<double>(waited_ns_) / 1e9;
}

absl::Status S3Client::Perform(Call& call) {
  call.limiter = bounds_.limiter.get();
  call.slots = bounds_.slots.get();
  call.stall_ns = StallNs(settings_);
  void* h = TakeHandle();
  if (h == nullptr) return absl::ResourceExhaustedError("cannot create a libcurl handle");
  std::mt19937_64 rng(std::random_device{}());
  absl::Status last;
  const int attempts = std::max(1, settings_.max_attempts);
  int made = 0;  // attempts made
  for (int attempt = 1; attempt <= attempts; ++attempt) {
    made = attempt;
    // A slot per attempt: a request waiting out its backoff holds none.
    if (absl::Status slot = bounds_.slots->Acquire(call.What()); !slot.ok()) {
      ReturnHandle(h);
      return slot;
    }
    absl::Status s = PerformOnce(call, h);
    bounds_.slots->Release();
    bool retry = false;
    if (!s.ok()) {
      retry = absl::IsUnavailable(s);
      // A broken transfer may leave the connection in any state.
      curl_easy_cleanup(static_cast<CURL*>(h));
      h = curl_easy_init();
      if (h == nullptr) return s;
    } else if (call.Success()) {
      if (call.overflow) {
        s = absl::DataLossError(absl::StrCat(call.What(), ": the server sent more than the ",
                                             call.dst != nullptr ? call.dst_n : call.body_cap,
                                             " bytes asked for"));
      } else if (call.dst != nullptr && call.received != call.dst_n) {
        s = absl::DataLossError(absl::StrCat(call.What(), ": truncated answer: ", call.received,
                                             " of ", call.dst_n, " bytes"));
        retry = true;
      } else {
        stats_.bytes_in.fetch_add(call.received, std::memory_order_relaxed);
        stats_.bytes_out.fetch_add(call.upload_n, std::memory_order_relaxed);
        ReturnHandle(h);
        return absl::OkStatus();
      }
    } else {
      const ErrorDoc err = ParseError(call.body);
      retry = RetryableHttp(call.status) || err.code == "SlowDown";
      std::string said = err.code.empty() ? std::string() : absl::StrCat(" ", err.code);
      if (!err.message.empty()) absl::StrAppend(&said, ": ", err.message);
      if (call.status == 412) said += " (the object changed: its ETag is no longer the one opened)";
      s = absl::Status(CodeFor(call.status), absl::StrCat(call.What(), ": ", call.verb,
                                                          " answered HTTP ", call.status, said));
    }
    last = s;
    if (!retry || attempt == attempts) break;
    stats_.retries.fetch_add(1, std::memory_order_relaxed);
    const double base = std::min(2000.0, 50.0 * (1 << std::min(attempt - 1, 10)));
    std::uniform_real_distribution<double> jitter(0.5, 1.0);
    std::this_thread::sleep_for(std::chrono::microseconds(
        static_cast<int64_t>(base * jitter(rng) * 1000)));
  }
  ReturnHandle(h);
  if (absl::IsUnavailable(last) || absl::IsDataLoss(last)) {
    return absl::Status(last.code(), absl::StrCat(last.message(), " (after ", made,
                                                  made == 1 ? " attempt)" : " attempts)"));
  }
  return last;
}

absl::StatusOr<ObjectInfo> S3Client::Head(const std::string& bucket, const std::string& key) {
  Call c("HEAD", bucket, key, &stats_.heads);
  absl::Status s = Perform(c);
  if (!s.ok()) {
    if (absl::IsNotFound(s)) return absl::NotFoundError(absl::StrCat(c.What(), ": no such object"));
    return s;
  }
  if (c.content_length == UINT64_MAX) {
    return absl::DataLossError(absl::StrCat(c.What(), ": HEAD answered without a Content-Length"));
  }
  ObjectInfo info;
  info.size = c.content_length;
  info.etag = c.etag;
  info.mtime_ns = ParseTimeNs(c.last_modified);
  return info;
}

absl::Status S3Client::GetRange(const std::string& bucket, const std::string& key,
                                uint64_t offset, uint64_t n, void* dst,
                                const std::string& if_match) {
  if (n == 0) return absl::OkStatus();
  Call c("GET", bucket, key, &stats_.gets);
  c.headers.push_back(absl::StrCat("Range: bytes=", offset, "-", offset + n - 1));
  if (!if_match.empty()) c.headers.push_back(absl::StrCat("If-Match: \"", if_match, "\""));
  c.dst = static_cast<uint8_t*>(dst);
  c.dst_n = n;
  absl::Status s = Perform(c);
  if (absl::IsOutOfRange(s)) {
    return absl::OutOfRangeError(absl::StrCat(c.What(), ": truncated: read of ", n,
                                              " bytes at offset ", offset, " past the end"));
  }
  return s;
}

absl::StatusOr<ListPage> S3Client::List(const std::string& bucket, const std::string& prefix,
                                        const std::string& delimiter, const std::string& token,
                                        int max_keys) {
  Call c("GET", bucket, std::string(), &stats_.lists);
  c.what = absl::StrCat(S3Url{bucket, std::string(absl::StripSuffix(prefix, "/"))}.ToString(),
                        " (listing)");
  // Sorted by name, as the signature wants them.
  if (!token.empty()) c.query.emplace_back("continuation-token", token);
  if (!delimiter.empty()) c.query.emplace_back("delimiter", delimiter);
  c.query.emplace_back("list-type", "2");
  c.query.emplace_back("max-keys", absl::StrCat(max_keys));
  c.query.emplace_back("prefix", prefix);
  absl::Status s = Perform(c);
  if (!s.ok()) return s;
  auto page = ParseListPage(c.body);
  if (!page.ok()) {
    return absl::Status(page.status().code(),
                        absl::StrCat(S3Url{bucket, prefix}.ToString(), ": listing: ",
                                     page.status().message()));
  }
  return page;
}

absl::StatusOr<ListPage> S3Client::ListAll(const std::string& bucket, const std::string& prefix,
                                           const std::string& delimiter, size_t max_entries) {
  ListPage all;
  std::string token;
  while (true) {
    auto page = List(bucket, prefix, delimiter, token, 1000);
    if (!page.ok()) return page.status();
    for (auto& o : page->objects) all.objects.push_back(std::move(o));
    for (auto& p : page->common_prefixes) all.common_prefixes.push_back(std::move(p));
    if (all.objects.size() + all.common_prefixes.size() > max_entries) {
      return absl::ResourceExhaustedError(
          absl::StrCat(S3Url{bucket, prefix}.ToString(), ": more than ", max_entries,
                       " entries under this prefix"));
    }
    if (!page->truncated) break;
    if (page->next_token == token) {
      return absl::DataLossError(absl::StrCat(S3Url{bucket, prefix}.ToString(),
                                              ": listing repeats its continuation token"));
    }
    token = page->next_token;
  }
  return all;
}

absl::Status S3Client::Put(const std::string& bucket, const std::string& key, const void* data,
                           uint64_t n) {
  Call c("PUT", bucket, key, &stats_.puts);
  c.upload = static_cast<const uint8_t*>(data);
  c.upload_n = n;
  return Perform(c);
}

absl::StatusOr<std::string> S3Client::CreateMultipart(const std::string& bucket,
                                                      const std::string& key) {
  Call c("POST", bucket, key, &stats_.puts);
  c.query.emplace_back("uploads", "");
  static const uint8_t kEmpty[1] = {0};
  c.upload = kEmpty;
  c.upload_n = 0;
  absl::Status s = Perform(c);
  if (!s.ok()) return s;
  auto id = ParseUploadId(c.body);
  if (!id.ok()) return absl::Status(id.status().code(), absl::StrCat(c.What(), ": ", id.status().message()));
  return id;
}

absl::StatusOr<std::string> S3Client::UploadPart(const std::string& bucket,
                                                 const std::string& key,
                                                 const std::string& upload_id, int part_number,
                                                 const void* data, uint64_t n) {
  Call c("PUT", bucket, key, &stats_.puts);
  c.query.emplace_back("partNumber", absl::StrCat(part_number));
  c.query.emplace_back("uploadId", upload_id);
  c.upload = static_cast<const uint8_t*>(data);
  c.upload_n = n;
  absl::Status s = Perform(c);
  if (!s.ok()) return s;
  if (c.etag.empty()) {
    return absl::DataLossError(absl::StrCat(c.What(), ": part ", part_number,
                                            " uploaded without an ETag in the answer"));
  }
  return c.etag;
}

absl::Status S3Client::CompleteMultipart(const std::string& bucket, const std::string& key,
                                         const std::string& upload_id,
                                         const std::vector<std::string>& part_etags) {
  std::string doc = "<CompleteMultipartUpload>";
  for (size_t i = 0; i < part_etags.size(); ++i) {
    absl::StrAppend(&doc, "<Part><PartNumber>", i + 1, "</PartNumber><ETag>\"", part_etags[i],
                    "\"</ETag></Part>");
  }
  doc += "</CompleteMultipartUpload>";
  Call c("POST", bucket, key, &stats_.puts);
  c.query.emplace_back("uploadId", upload_id);
  c.upload = reinterpret_cast<const uint8_t*>(doc.data());
  c.upload_n = doc.size();
  absl::Status s = Perform(c);
  if (!s.ok()) return s;
  // A 200 whose body is an <Error> is a failed completion (S3 says so).
  const ErrorDoc err = ParseError(c.body);
  if (!err.code.empty()) {
    return absl::InternalError(absl::StrCat(c.What(), ": completing the upload: ", err.code, ": ",
                                            err.message));
  }
  return absl::OkStatus();
}

absl::Status S3Client::AbortMultipart(const std::string& bucket, const std::string& key,
                                      const std::string& upload_id) {
  Call c("DELETE", bucket, key, &stats_.deletes);
  c.query.emplace_back("uploadId", upload_id);
  absl::Status s = Perform(c);
  return absl::IsNotFound(s) ? absl::OkStatus() : s;
}

absl::Status S3Client::Delete(const std::string& bucket, const std::string& key) {
  Call c("DELETE", bucket, key, &stats_.deletes);
  absl::Status s = Perform(c);
  return absl::IsNotFound(s) ? absl::OkStatus() : s;
}

}  // namespace s3
}  // namespace ckpt
