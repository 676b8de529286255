#include "client/ckptd_client.h"

#include <grp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>

#include <grpcpp/grpcpp.h>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "ckptd_version.h"
#include "client/cuda/device_export.h"
#include "core/base/aligned_map.h"
#include "core/base/status_macros.h"
#include "proto/ckpt.grpc.pb.h"
#include "proto/fd_socket.h"

namespace ckptd {
namespace {

// Status payloads: the daemon's own answer (trailing "ckptd-status:
// daemon"), and one a restart ended ("ckptd-retry: restart").
constexpr char kDaemonAnswer[] = "type.googleapis.com/ckptd.DaemonAnswer";
constexpr char kRestart[] = "type.googleapis.com/ckptd.RetryAfterRestart";

std::string Trailing(const grpc::ClientContext& ctx, const std::string& key) {
  const auto& md = ctx.GetServerTrailingMetadata();
  auto it = md.find(key);
  return it == md.end() ? std::string() : std::string(it->second.data(), it->second.size());
}

absl::Status FromGrpc(const grpc::Status& s, absl::string_view what,
                      const grpc::ClientContext* ctx = nullptr) {
  if (s.ok()) return absl::OkStatus();
  std::string msg = s.error_message();
  const bool daemon = ctx != nullptr && Trailing(*ctx, "ckptd-status") == "daemon";
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE && !daemon) {
    msg = absl::StrCat(what, ": daemon unavailable (is ckptd running?): ", msg);
  }
  absl::Status out(static_cast<absl::StatusCode>(s.error_code()), msg);
  if (daemon) out.SetPayload(kDaemonAnswer, absl::Cord("1"));
  if (ctx != nullptr && Trailing(*ctx, "ckptd-retry") == "restart") {
    out.SetPayload(kRestart, absl::Cord("1"));
  }
  return out;
}

// Whether a call that failed with `s` is made again once the daemon is back:
// UNAVAILABLE or CANCELLED that is not the daemon's own answer (the
// transport's, a connection refused, the fd socket gone, a call cut by the
// daemon's shutdown), or the daemon's marked as ended by a restart.
bool Restartable(const absl::Status& s) {
  // CANCELLED that is not the daemon's answer: a daemon shutting down cancelled
  // the call before its handler answered (this client cancels no calls).
  if (!absl::IsUnavailable(s) && !absl::IsCancelled(s)) return false;
  return s.GetPayload(kRestart).has_value() || !s.GetPayload(kDaemonAnswer).has_value();
}

absl::StatusOr<absl::Duration> RetryBudget(const std::optional<absl::Duration>& set) {
  if (set) return std::max(absl::ZeroDuration(), *set);
  const char* env = std::getenv("CKPTD_RETRY_TIMEOUT");
  if (env == nullptr || *env == '\0') return absl::Seconds(60);
  double seconds = 0;
  if (!absl::SimpleAtod(env, &seconds) || !(seconds >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CKPTD_RETRY_TIMEOUT '", env, "' is not a number of seconds >= 0"));
  }
  return absl::Seconds(seconds);
}

std::chrono::system_clock::time_point Deadline(absl::Duration d) {
  return std::chrono::system_clock::now() +
         std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

constexpr uint64_t kAlign = 64;

// The segment the tensors travel in: `given` (tensors at their
// arena_offset), or a new arena `own` with a slot per tensor buffer,
// borrowed from the daemon at `socket` (it keeps it mapped across loads)
// or, when it lends none, made here.
absl::StatusOr<ShmArena*> ArenaFor(const std::vector<TensorSpec>& tensors, ShmArena* given,
                                   const std::string& name, const std::string& socket,
                                   absl::Duration timeout, std::unique_ptr<ShmArena>* own,
                                   std::vector<uint64_t>* offsets) {
  offsets->resize(tensors.size());
  if (given != nullptr) {
    for (size_t i = 0; i < tensors.size(); ++i) (*offsets)[i] = tensors[i].arena_offset;
    return given;
  }
  uint64_t pos = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].buffer == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", tensors[i].name, "' has no buffer and the spec has no arena"));
    }
    (*offsets)[i] = pos;
    pos = (pos + tensors[i].num_bytes() + kAlign - 1) / kAlign * kAlign;
  }
  auto arena = ShmArena::FromDaemon(socket, pos, timeout);
  if (!arena.ok()) arena = ShmArena::Create(pos, name);
  if (!arena.ok()) return arena.status();
  *own = std::move(*arena);
  return own->get();
}

// Names the segment in a request: an arena the daemon lent by its token,
// else the memfd, sent over the fd socket.
absl::Status NameSegment(const ShmArena& arena, const Client::Options& options,
                         v1::ShmDestination* shm) {
  if (!arena.daemon_token().empty()) {
    shm->set_arena_token(arena.daemon_token());
  } else {
    CKPT_ASSIGN_OR_RETURN(std::string token, SendFd(FdSocketPath(options.socket), arena.fd(),
                                                    options.connect_timeout));
    shm->set_fd_token(token);
  }
  shm->set_size(arena.size());
  return absl::OkStatus();
}

void AddTargets(const std::vector<TensorSpec>& tensors, const std::vector<uint64_t>& offsets,
                google::protobuf::RepeatedPtrField<v1::Target>* out) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& t = tensors[i];
    v1::Target* pt = out->Add();
    pt->set_name(t.name);
    pt->set_dtype(std::string(ckpt::DTypeName(t.dtype)));
    for (int64_t d : t.global_shape) pt->add_global_shape(d);
    ckpt::Box box = t.box;
    if (box.shape.empty() && box.offset.empty() && !t.global_shape.empty()) {
      box = ckpt::Box{ckpt::Shape(t.global_shape.size(), 0), t.global_shape};
    }
    for (int64_t d : box.offset) pt->add_offset(d);
    for (int64_t d : box.shape) pt->add_shape(d);
    if (t.flat_range) {
      pt->mutable_flat_range()->set_begin(t.flat_range->begin);
      pt->mutable_flat_range()->set_end(t.flat_range->end);
    }
    if (i < offsets.size()) pt->set_dest_offset(offsets[i]);
  }
}

// The tensors' device memory as the request's cuda_ipc buffers (one handle
// per allocation; the targets' dest_buffer and dest_offset set).
absl::Status AddDeviceBuffers(const std::vector<TensorSpec>& tensors, v1::LoadRequest* req) {
  std::vector<const void*> ptrs;
  std::vector<uint64_t> sizes;
  std::vector<std::string> names;
  for (const TensorSpec& t : tensors) {
    ptrs.push_back(t.device_buffer);
    sizes.push_back(t.num_bytes());
    names.push_back(t.name);
  }
  return AddCudaIpcDestination(ptrs, sizes, names, req);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShmArena>> ShmArena::Create(uint64_t size, const std::string& name) {
  // Sealable, and sealed once sized: the daemon maps only segments that
  // cannot shrink under it (proto/fd_socket.h).
  int fd = ::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return absl::InternalError(absl::StrCat("memfd_create: ", std::strerror(errno)));
  const uint64_t mapped = std::max<uint64_t>(size, 1);
  if (::ftruncate(fd, static_cast<off_t>(mapped)) != 0) {
    int err = errno;
    ::close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("shared memory of ", size, " bytes: ", std::strerror(err)));
  }
  if (absl::Status st = SealSegment(fd); !st.ok()) {
    ::close(fd);
    return st;
  }
  void* p = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    ::close(fd);
    return absl::ResourceExhaustedError(absl::StrCat("mmap of ", size, " bytes: ", std::strerror(err)));
  }
  return std::unique_ptr<ShmArena>(new ShmArena(fd, static_cast<uint8_t*>(p), mapped));
}

absl::StatusOr<std::unique_ptr<ShmArena>> ShmArena::FromDaemon(const std::string& socket,
                                                                uint64_t size,
                                                                absl::Duration timeout) {
  CKPT_ASSIGN_OR_RETURN(ArenaGrant g,
                        RequestArena(FdSocketPath(socket), std::max<uint64_t>(size, 1), timeout));
  void* p = ::mmap(nullptr, g.size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, g.fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    ::close(g.fd);
    ::close(g.lease);
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap of a daemon arena of ", g.size, " bytes: ", std::strerror(err)));
  }
  std::unique_ptr<ShmArena> a(new ShmArena(g.fd, static_cast<uint8_t*>(p), g.size));
  a->lease_ = g.lease;
  a->token_ = std::move(g.token);
  return a;
}

ShmArena::~ShmArena() {
  ::munmap(data_, size_);
  ::close(fd_);
  if (lease_ >= 0) ::close(lease_);  // after unmapping: the daemon may lend it again
}

uint64_t TensorSpec::num_bytes() const {
  int64_t n = flat_range ? flat_range->end - flat_range->begin : ckpt::NumElements(box.shape);
  return static_cast<uint64_t>(n) * ckpt::DTypeSize(dtype);
}

namespace {

// Read-only mappings of the daemon's cache blocks (Transport::kCacheView),
// kept from one load to the next: a block the next load uses again is not
// mapped again (a new mapping costs a page-table entry per 4 KiB on first
// touch, per 2 MiB where the block is on huge pages). Keyed by the block's key (CacheViews.view_keys: random, never
// reused). Only the latest load's are kept (Keep): a block the daemon has
// freed cannot have its pages reclaimed while any process maps it (its
// memfd is sealed against writes, hole punching included), so a mapping of
// a block no load uses any more would hold its memory. A load copying from
// a mapping holds a reference to it: another thread's Keep never unmaps it
// under the copy. Thread-safe.
class ViewMappings {
 public:
  struct Mapping {
    Mapping(uint8_t* d, uint64_t n) : data(d), size(n) {}
    Mapping(const Mapping&) = delete;
    Mapping& operator=(const Mapping&) = delete;
    ~Mapping() { ::munmap(data, size); }
    uint8_t* const data;
    const uint64_t size;
  };
  // The first `size` bytes of the memfd `fd` (the view named `key`), mapped
  // read-only; kept until a later Keep leaves it out and nobody holds it.
  absl::StatusOr<std::shared_ptr<const Mapping>> Map(uint64_t key, int fd, uint64_t size) {
    struct stat st;
    if (::fstat(fd, &st) != 0) return absl::DataLossError("a cache view cannot be stat'ed");
    if (static_cast<uint64_t>(st.st_size) < size) {
      return absl::DataLossError(
          absl::StrCat("a cache view holds ", st.st_size, " bytes, not ", size));
    }
    {
      absl::MutexLock lock(&mu_);
      auto it = maps_.find(key);
      if (it != maps_.end() && it->second->size >= size) return it->second;
    }
    // On a 2 MiB boundary: a block the daemon collapsed into huge pages
    // maps one page-table entry per 2 MiB (cache_huge_pages).
    void* p = ckpt::MapSharedAligned(fd, size, PROT_READ);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("mapping a cache view of ", size, " bytes: ", std::strerror(errno)));
    }
    auto m = std::make_shared<const Mapping>(static_cast<uint8_t*>(p), size);
    absl::MutexLock lock(&mu_);
    maps_[key] = m;
    return m;
  }
  // Drops the mappings of every key but `keys` (those of the load just
  // done); each is unmapped once no load holds it.
  void Keep(const google::protobuf::RepeatedField<uint64_t>& keys) {
    const std::set<uint64_t> keep(keys.begin(), keys.end());
    std::vector<std::shared_ptr<const Mapping>> dropped;  // unmapped outside the lock
    absl::MutexLock lock(&mu_);
    for (auto it = maps_.begin(); it != maps_.end();) {
      if (keep.count(it->first)) {
        ++it;
      } else {
        dropped.push_back(std::move(it->second));
        it = maps_.erase(it);
      }
    }
  }

 private:
  absl::Mutex mu_;
  std::map<uint64_t, std::shared_ptr<const Mapping>> maps_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

struct Client::Rep {
  Options options;
  absl::Duration retry_timeout;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Ckptd::Stub> stub;
  v1::VersionResponse daemon_version;
  ViewMappings views;
};

Client::Client(std::unique_ptr<Rep> rep) : rep_(std::move(rep)) {}
Client::~Client() = default;

const v1::VersionResponse& Client::daemon_version() const { return rep_->daemon_version; }

namespace {

// This client's API level: VERSION's, or $CKPTD_TESTING_API_LEVEL (tests of
// the mismatch error only).
unsigned ClientApiLevel() {
  const char* env = std::getenv("CKPTD_TESTING_API_LEVEL");
  unsigned level = 0;
  if (env != nullptr && *env != '\0' && absl::SimpleAtoi(env, &level) && level > 0) return level;
  return kApiLevel;
}

// PERMISSION_DENIED for a socket this process may not open: its owner,
// group and mode (`st`, when it could be read), and what to do.
absl::Status SocketPermissionDenied(const std::string& path, const struct stat* st) {
  if (st == nullptr) {
    return absl::PermissionDeniedError(absl::StrCat(
        "cannot connect to ckptd at ", path, ": permission denied on a directory above the "
        "socket (uid ", getuid(), " may not search it); ask the admin for access"));
  }
  std::string group = absl::StrCat(st->st_gid);
  std::vector<char> buf(16384);
  struct group gr;
  struct group* found = nullptr;
  if (getgrgid_r(st->st_gid, &gr, buf.data(), buf.size(), &found) == 0 && found != nullptr) {
    group = found->gr_name;
  }
  char mode[8];
  std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st->st_mode & 07777));
  return absl::PermissionDeniedError(absl::StrCat(
      "cannot connect to ckptd at ", path, ": permission denied (the socket is uid ", st->st_uid,
      ", group '", group, "', mode ", mode, "; this process is uid ", getuid(),
      "): join group '", group, "' (`usermod -aG ", group,
      " USER`, then log in again) or ask the admin (docs/security.md)"));
}

// Asks the daemon its version (once per Client) and refuses one older than
// this client. UNIMPLEMENTED: a daemon from before the Version RPC, level 1.
absl::Status CheckDaemonVersion(v1::Ckptd::Stub& stub, const Client::Options& options,
                                v1::VersionResponse* out) {
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(options.connect_timeout));
  const grpc::Status s = stub.Version(&ctx, v1::VersionRequest(), out);
  if (s.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
    out->Clear();
    out->set_version("a ckptd from before the Version RPC");
    out->set_api_level(1);
  } else if (!s.ok()) {
    out->Clear();  // unknown: the calls that follow meet the same problem and report it
    return absl::OkStatus();
  }
  if (out->api_level() == 0) out->set_api_level(1);
  const unsigned mine = ClientApiLevel();
  if (mine <= out->api_level()) return absl::OkStatus();
  const std::string daemon =
      out->release().empty() ? out->version() : absl::StrCat("ckptd ", out->release());
  return absl::FailedPreconditionError(absl::StrCat(
      "ckptd client ", kVersion, " (api ", mine, ") is newer than the daemon at ", options.socket,
      " (", daemon, ", api ", out->api_level(), "); upgrade the daemon"));
}

}  // namespace

absl::Status ProbeUnixSocket(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    const int e = errno;
    if (e == EACCES) return SocketPermissionDenied(path, nullptr);
    return absl::UnavailableError(absl::StrCat("cannot connect to ckptd at ", path, ": ",
                                               std::strerror(e), " (is the daemon running?)"));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot connect to ckptd at ", path, ": not a Unix socket"));
  }
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) return absl::OkStatus();  // gRPC will say
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::OkStatus();
  const int rc = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const int e = errno;
  close(fd);
  if (rc != 0 && (e == ECONNREFUSED || e == ENOENT)) {
    return absl::UnavailableError(absl::StrCat("cannot connect to ckptd at ", path, ": ",
                                               std::strerror(e),
                                               " (a stale socket: is the daemon running?)"));
  }
  if (rc != 0 && (e == EACCES || e == EPERM)) return SocketPermissionDenied(path, &st);
  return absl::OkStatus();
}

namespace {

// One connection: the channel (waiting up to connect_timeout for a daemon
// that is starting) and the version check.
absl::Status OpenChannel(const Client::Options& options, std::shared_ptr<grpc::Channel>* channel,
                         std::unique_ptr<v1::Ckptd::Stub>* stub, v1::VersionResponse* version) {
  if (!options.tcp) {
    // A socket this process may not open fails at once, naming the group to
    // join (gRPC would retry until connect_timeout and say "unavailable").
    absl::Status probe = ProbeUnixSocket(options.socket);
    if (absl::IsPermissionDenied(probe)) return probe;
  }
  const std::string target = options.tcp ? options.socket : "unix:" + options.socket;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(256 << 20);
  args.SetMaxSendMessageSize(256 << 20);
  *channel = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  if (!(*channel)->WaitForConnected(Deadline(options.connect_timeout))) {
    return absl::UnavailableError(absl::StrCat("cannot connect to ckptd at ", options.socket,
                                               " within ",
                                               absl::FormatDuration(options.connect_timeout),
                                               " (is the daemon running?)"));
  }
  *stub = v1::Ckptd::NewStub(*channel);
  return CheckDaemonVersion(**stub, options, version);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const Options& options) {
  auto rep = std::make_unique<Rep>();
  rep->options = options;
  CKPT_ASSIGN_OR_RETURN(rep->retry_timeout, RetryBudget(options.retry_timeout));
  std::unique_ptr<Client> client(new Client(std::move(rep)));
  Rep& r = *client->rep_;
  // A daemon that is not there yet (restarting) is waited for as a call
  // waits for one that went away.
  bool first = true;
  CKPT_RETURN_IF_ERROR(client->Retrying([&] {
    if (!first) return absl::OkStatus();  // Retrying's Reconnect did it
    first = false;
    return OpenChannel(r.options, &r.channel, &r.stub, &r.daemon_version);
  }));
  return client;
}

absl::Status Client::Reconnect() {
  return OpenChannel(rep_->options, &rep_->channel, &rep_->stub, &rep_->daemon_version);
}

absl::Status Client::Retrying(const std::function<absl::Status()>& attempt, int* retries) {
  const absl::Time start = absl::Now();
  std::mt19937_64 rng(std::random_device{}());
  for (int tries = 0;; ++tries) {
    absl::Status s = tries > 0 ? Reconnect() : absl::OkStatus();
    if (s.ok()) s = attempt();
    if (retries != nullptr) *retries = tries;
    if (s.ok() || !Restartable(s)) return s;
    const absl::Duration budget = rep_->retry_timeout;
    const absl::Duration spent = absl::Now() - start;
    if (spent >= budget) {
      if (budget <= absl::ZeroDuration()) return s;
      return absl::Status(s.code(), absl::StrCat(s.message(), " (retried ", tries, " time(s) for ",
                                                  absl::FormatDuration(absl::Trunc(spent, absl::Milliseconds(100))),
                                                  ": ckptd did not come back within retry_timeout ",
                                                  absl::FormatDuration(budget), ")"));
    }
    const double delay = std::min(2.0, 0.05 * static_cast<double>(1ull << std::min(tries, 10)));
    std::uniform_real_distribution<double> jitter(delay / 2, delay);
    absl::SleepFor(std::min(budget - spent, absl::Seconds(jitter(rng))));
  }
}

absl::StatusOr<v1::InspectResponse> Client::Inspect(const std::string& path,
                                                    std::optional<int64_t> unique_id) {
  v1::InspectRequest req;
  req.set_path(path);
  if (unique_id) req.set_unique_id(*unique_id);
  v1::InspectResponse resp;
  CKPT_RETURN_IF_ERROR(Retrying([&] {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(rep_->options.admin_timeout));
    return FromGrpc(rep_->stub->Inspect(&ctx, req, &resp), "Inspect", &ctx);
  }));
  return resp;
}

absl::StatusOr<v1::PrefetchResponse> Client::Prefetch(const std::string& path,
                                                      std::optional<int64_t> unique_id,
                                                      const std::vector<std::string>& tensors) {
  v1::PrefetchRequest req;
  req.set_path(path);
  if (unique_id) req.set_unique_id(*unique_id);
  for (const auto& t : tensors) req.add_tensors(t);
  v1::PrefetchResponse resp;
  CKPT_RETURN_IF_ERROR(Retrying([&] {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(rep_->options.admin_timeout));
    return FromGrpc(rep_->stub->Prefetch(&ctx, req, &resp), "Prefetch", &ctx);
  }));
  return resp;
}

absl::StatusOr<v1::EvictResponse> Client::Evict(const std::string& path) {
  v1::EvictRequest req;
  req.set_path(path);
  v1::EvictResponse resp;
  CKPT_RETURN_IF_ERROR(Retrying([&] {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(rep_->options.admin_timeout));
    return FromGrpc(rep_->stub->Evict(&ctx, req, &resp), "Evict", &ctx);
  }));
  return resp;
}

absl::StatusOr<v1::StatusResponse> Client::Status() {
  v1::StatusRequest req;
  v1::StatusResponse resp;
  CKPT_RETURN_IF_ERROR(Retrying([&] {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(rep_->options.admin_timeout));
    return FromGrpc(rep_->stub->Status(&ctx, req, &resp), "Status", &ctx);
  }));
  return resp;
}

const char* TransportName(Transport t) {
  switch (t) {
    case Transport::kAuto:
      return "auto";
    case Transport::kProcessMemory:
      return "process_memory";
    case Transport::kShm:
      return "shm";
    case Transport::kStream:
      return "stream";
    case Transport::kCudaIpc:
      return "cuda_ipc";
    case Transport::kCacheView:
      return "cache_view";
  }
  return "?";
}

absl::StatusOr<Transport> ParseTransport(const std::string& name) {
  for (Transport t : {Transport::kAuto, Transport::kProcessMemory, Transport::kShm,
                      Transport::kStream, Transport::kCudaIpc, Transport::kCacheView}) {
    if (name == TransportName(t)) return t;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("transport '", name,
                   "' is not one of auto, cache_view, process_memory, shm, stream, cuda_ipc"));
}

namespace {

// Whether every tensor has its own buffer and none overlaps another (tied
// weights sharing memory go through a segment, one slot each).
bool ProcessMemoryFits(const LoadSpec& spec) {
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  for (const TensorSpec& t : spec.tensors) {
    if (t.buffer == nullptr) return false;
    const uintptr_t at = reinterpret_cast<uintptr_t>(t.buffer);
    if (t.num_bytes() > 0) spans.push_back({at, at + t.num_bytes()});
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].first < spans[i - 1].second) return false;
  }
  return true;
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

// Bytes of free memory in blocks of `huge` or more, every zone
// (/proc/buddyinfo: per zone, the free blocks of page << order); 0 where it
// cannot be read.
uint64_t HugeBlocksFree(uint64_t page, uint64_t huge) {
  std::FILE* f = std::fopen("/proc/buddyinfo", "re");
  if (f == nullptr) return 0;
  uint64_t total = 0;
  char line[512];
  while (std::fgets(line, sizeof line, f) != nullptr) {
    // "Node 0, zone   Normal   c0 c1 ... c10"
    const char* p = std::strstr(line, "zone");
    if (p == nullptr) continue;
    p += 4;
    while (*p == ' ') ++p;
    while (*p != '\0' && *p != ' ') ++p;  // the zone's name
    for (int order = 0; *p != '\0' && *p != '\n'; ++order) {
      char* end = nullptr;
      const unsigned long long n = std::strtoull(p, &end, 10);
      if (end == p) break;
      p = end;
      if (order < 40 && (page << order) >= huge) total += n * (page << order);
    }
  }
  std::fclose(f);
  return total;
}

// Faults the buffers' pages in (writable) before the daemon writes them:
// process_vm_writev into pages never touched faults them one by one under
// this process's mmap lock, the daemon's I/O threads queueing on it; one
// madvise per run of pages mincore reports missing maps them at first-touch
// speed (pages already there are left alone: no page-table walk). Fresh
// memory is first advised huge (MADV_HUGEPAGE on the whole 2 MiB pages inside
// the buffer, never past it) where the kernel leaves THP to madvise: a fault
// then maps 2 MiB. Only as many bytes are advised as half the node's free
// memory in blocks of 2 MiB or more: a huge page beyond that would be made by
// compaction, which with THP defrag "madvise" stalls the fault.
// CKPTD_HUGE_PAGES=0 leaves the advice out. Contents are unchanged. Best
// effort.
void Populate(const LoadSpec& spec) {
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const char* env = std::getenv("CKPTD_HUGE_PAGES");
  // Each advised range splits its mapping: a bound against vm.max_map_count.
  int huge_left = 0;
  uint64_t huge_bytes = 0;
  if (env == nullptr || std::string(env) != "0") {
    huge_left = 4096;
    huge_bytes = HugeBlocksFree(page, kHuge) / 2;
  }
  std::vector<unsigned char> resident;
  for (const TensorSpec& t : spec.tensors) {
    if (t.num_bytes() < page) continue;
    const uintptr_t at = reinterpret_cast<uintptr_t>(t.buffer);
    const uintptr_t start = at - at % page, end = at + t.num_bytes();
    const size_t pages = (end - start + page - 1) / page;
    resident.assign(pages, 1);
    if (::mincore(reinterpret_cast<void*>(start), end - start, resident.data()) != 0) {
      std::fill(resident.begin(), resident.end(), 0);  // unknown: populate it all
    }
    for (size_t i = 0; i < pages;) {
      if (resident[i] & 1) {
        ++i;
        continue;
      }
      size_t j = i;
      while (j < pages && !(resident[j] & 1)) ++j;
      const uintptr_t a = start + i * page, b = std::min(end, start + j * page);
      // Never before the buffer's first byte (a run starts at its page).
      const uintptr_t ha = (std::max(a, at) + kHuge - 1) / kHuge * kHuge;
      const uintptr_t hb = std::min<uint64_t>(b, ha + huge_bytes) / kHuge * kHuge;
      if (huge_left > 0 && hb > ha) {
        --huge_left;
        huge_bytes -= hb - ha;
        ::madvise(reinterpret_cast<void*>(ha), hb - ha, MADV_HUGEPAGE);  // a hint
      }
      if (::madvise(reinterpret_cast<void*>(a), b - a, MADV_POPULATE_WRITE) != 0) {
        return;  // EINVAL: an older kernel or a special mapping
      }
      i = j;
    }
  }
}

// The daemon may not write this process (refused before the job registered).
// A spec's job key, or the environment's CKPTD_JOB_KEY.
std::string JobKeyOf(const std::string& key) {
  if (!key.empty()) return key;
  const char* env = std::getenv("CKPTD_JOB_KEY");
  return env != nullptr ? std::string(env) : std::string();
}

bool ProcessMemoryRefused(const absl::Status& s) {
  return absl::IsFailedPrecondition(s) && absl::StrContains(s.message(), "process_memory");
}

// Makes the copies of `views` (LoadEvent.views: one batch of the load's)
// into the spec's buffers, each checked to lie inside its view and inside
// one tensor first. The caller keeps the load's mappings once it is done.
absl::Status CopyViews(const v1::CacheViews& views, const LoadSpec& spec,
                       const std::string& fd_socket, absl::Duration timeout,
                       ViewMappings& mappings) {
  const size_t n = static_cast<size_t>(views.view_bytes_size());
  if (n == 0 || n > kMaxViewFds) {
    return absl::DataLossError(absl::StrCat("Load: the daemon sent ", n, " cache views"));
  }
  std::vector<std::pair<uint64_t, uint64_t>> targets;  // [begin, end) of each buffer
  for (const TensorSpec& t : spec.tensors) {
    const auto at = reinterpret_cast<uintptr_t>(t.buffer);
    if (t.num_bytes() > 0) targets.push_back({at, at + t.num_bytes()});
  }
  std::sort(targets.begin(), targets.end());
  if (views.view_keys_size() != static_cast<int>(n)) {
    return absl::DataLossError("Load: the daemon's cache views carry no keys");
  }
  // [start, start + (count - 1) * stride + length) without overflow, or nullopt.
  auto span_end = [](uint64_t start, uint64_t count, uint64_t stride,
                     uint64_t length) -> std::optional<uint64_t> {
    uint64_t last = 0, end = 0;
    if (count == 0 || length == 0 || __builtin_mul_overflow(count - 1, stride, &last) ||
        __builtin_add_overflow(start, last, &end) || __builtin_add_overflow(end, length, &end)) {
      return std::nullopt;
    }
    return end;
  };
  for (const v1::ViewCopy& c : views.copies()) {
    auto t = std::upper_bound(targets.begin(), targets.end(),
                              std::make_pair(c.address(), ~uint64_t{0}));
    const std::optional<uint64_t> src_end =
        span_end(c.offset(), c.count(), c.src_stride(), c.length());
    const std::optional<uint64_t> dst_end =
        span_end(c.address(), c.count(), c.dst_stride(), c.length());
    const bool in_view = c.view() < n && src_end && *src_end <= views.view_bytes(c.view());
    const bool in_target = t != targets.begin() && dst_end && c.address() >= std::prev(t)->first &&
                           *dst_end <= std::prev(t)->second &&
                           (c.count() == 1 || c.dst_stride() >= c.length());
    if (!in_view || !in_target) {
      return absl::DataLossError(absl::StrCat("Load: a cache view copy (view ", c.view(),
                                              ", offset ", c.offset(), ", ", c.count(), " x ",
                                              c.length(), " bytes) lies outside ",
                                              in_view ? "the tensors" : "its view"));
    }
  }
  CKPT_ASSIGN_OR_RETURN(ViewGrant grant, RequestViews(fd_socket, views.token(), n, timeout));
  absl::Status status;
  // Held for the copies: another load's Keep cannot unmap them meanwhile.
  std::vector<std::shared_ptr<const ViewMappings::Mapping>> src(n);
  for (size_t i = 0; i < n && status.ok(); ++i) {
    auto m = mappings.Map(views.view_keys(i), grant.fds[i], views.view_bytes(i));
    if (m.ok()) {
      src[i] = *std::move(m);
    } else {
      status = m.status();
    }
  }
  for (int fd : grant.fds) ::close(fd);
  for (const v1::ViewCopy& c : views.copies()) {
    if (!status.ok()) break;
    for (uint64_t i = 0; i < c.count(); ++i) {
      std::memcpy(reinterpret_cast<void*>(c.address() + i * c.dst_stride()),
                  src[c.view()]->data + c.offset() + i * c.src_stride(), c.length());
    }
  }
  ::close(grant.lease);  // done: the daemon lets go of the views
  return status;
}

}  // namespace

absl::StatusOr<LoadReport> Client::Load(const LoadSpec& spec,
                                        const std::function<void(const v1::LoadEvent&)>& progress) {
  absl::StatusOr<LoadReport> out = absl::UnknownError("Load: not run");
  int retries = 0;
  absl::Status s = Retrying(
      [&] {
        out = LoadOnce(spec, progress);
        return out.status();
      },
      &retries);
  if (!s.ok()) return s;
  out->retries = retries;
  return out;
}

absl::StatusOr<LoadReport> Client::LoadOnce(
    const LoadSpec& spec, const std::function<void(const v1::LoadEvent&)>& progress) {
  if (spec.transport == Transport::kAuto) {
    if (!rep_->options.tcp && ProcessMemoryFits(spec)) {
      LoadSpec pm = spec;
      pm.transport = Transport::kCacheView;
      absl::StatusOr<LoadReport> r = LoadOnce(pm, progress);
      if (r.ok() || !ProcessMemoryRefused(r.status())) return r;
    }
    LoadSpec shm = spec;
    shm.transport = Transport::kShm;
    return LoadOnce(shm, progress);
  }
  const auto t0 = std::chrono::steady_clock::now();
  v1::LoadRequest req;
  req.set_job_id(spec.job_id);
  req.set_rank(spec.rank);
  req.set_world_size(spec.world_size);
  req.set_path(spec.path);
  if (spec.unique_id) req.set_unique_id(*spec.unique_id);
  for (int r : spec.node_ranks) req.add_node_ranks(r);
  if (spec.barrier_timeout > absl::ZeroDuration()) {
    req.set_barrier_timeout_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(spec.barrier_timeout)));
  }
  req.set_strict(spec.strict);
  req.set_skip_verify(spec.skip_verify);
  req.set_aoa_config(spec.aoa);
  req.set_job_key(JobKeyOf(spec.job_key));

  // Segment layout: tensors with their own buffers get a slot in a private
  // arena; tensors without buffers must already live in spec.arena.
  std::unique_ptr<ShmArena> own;
  ShmArena* arena = spec.arena;
  std::vector<uint64_t> offsets(spec.tensors.size());
  const bool shm = spec.transport == Transport::kShm;
  if (shm) {
    CKPT_ASSIGN_OR_RETURN(arena, ArenaFor(spec.tensors, spec.arena,
                                          absl::StrCat("ckptd-", spec.job_id, "-", spec.rank),
                                          rep_->options.socket, rep_->options.connect_timeout,
                                          &own, &offsets));
  }
  // kProcessMemory: the daemon reads this cookie back from our memory
  // before it writes anything (the connection's pid is this process).
  std::array<uint8_t, 16> cookie{};
  const bool process = spec.transport == Transport::kProcessMemory ||
                       spec.transport == Transport::kCacheView;
  if (process) {
    if (rep_->options.tcp) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Load: transport ", TransportName(spec.transport), " needs the daemon's Unix socket"));
    }
    for (size_t i = 0; i < spec.tensors.size(); ++i) {
      if (spec.tensors[i].buffer == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("Load: tensor '", spec.tensors[i].name,
                                                       "' has no buffer (transport ",
                                                       TransportName(spec.transport), ")"));
      }
      offsets[i] = reinterpret_cast<uintptr_t>(spec.tensors[i].buffer);
    }
    Populate(spec);
    std::random_device rd;
    for (auto& b : cookie) b = static_cast<uint8_t>(rd());
    req.mutable_process_memory()->set_cookie(cookie.data(), cookie.size());
    req.mutable_process_memory()->set_cookie_address(reinterpret_cast<uintptr_t>(cookie.data()));
    req.mutable_process_memory()->set_views(spec.transport == Transport::kCacheView);
    // In batches while the job runs: the copies overlap the daemon's reads.
    req.mutable_process_memory()->set_view_batches(spec.transport == Transport::kCacheView);
  }
  AddTargets(spec.tensors, offsets, req.mutable_targets());
  if (process) {
    // Set above.
  } else if (spec.transport == Transport::kCudaIpc) {
    CKPT_RETURN_IF_ERROR(AddDeviceBuffers(spec.tensors, &req));
  } else if (shm) {
    CKPT_RETURN_IF_ERROR(NameSegment(*arena, rep_->options, req.mutable_shm()));
  } else {
    req.mutable_stream();
  }

  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(rep_->options.call_timeout));
  auto reader = rep_->stub->Load(&ctx, req);
  v1::LoadEvent ev;
  LoadReport report;
  bool have_result = false;
  google::protobuf::RepeatedField<uint64_t> view_keys;  // of every batch
  // The load's mappings are kept for the next load, the others dropped.
  auto keep_views = absl::MakeCleanup([&] {
    if (!view_keys.empty()) rep_->views.Keep(view_keys);
  });
  while (reader->Read(&ev)) {
    if (ev.has_data()) {
      const v1::StreamChunk& c = ev.data();
      if (c.target() >= spec.tensors.size() ||
          c.offset() + c.data().size() > spec.tensors[c.target()].num_bytes() ||
          spec.tensors[c.target()].buffer == nullptr) {
        ctx.TryCancel();
        return absl::DataLossError("Load: the daemon streamed a chunk outside the tensors");
      }
      std::memcpy(static_cast<uint8_t*>(spec.tensors[c.target()].buffer) + c.offset(),
                  c.data().data(), c.data().size());
      continue;
    }
    if (ev.has_views()) {
      if (!process) {
        ctx.TryCancel();
        return absl::DataLossError("Load: the daemon sent cache views this load did not ask for");
      }
      absl::Status copied = CopyViews(ev.views(), spec, FdSocketPath(rep_->options.socket),
                                      rep_->options.connect_timeout, rep_->views);
      view_keys.Add(ev.views().view_keys().begin(), ev.views().view_keys().end());
      if (!copied.ok()) {
        ctx.TryCancel();
        return copied;
      }
      continue;
    }
    if (ev.has_result()) {
      report.result = ev.result();
      have_result = true;
    }
    if (progress) progress(ev);
  }
  const grpc::Status finished = reader->Finish();
  // The daemon sends the result last, after every byte was delivered, and
  // then only ends the call: a connection lost after it (ckptd exiting
  // right after a drained job) loses nothing.
  if (!(have_result && finished.error_code() == grpc::StatusCode::UNAVAILABLE)) {
    CKPT_RETURN_IF_ERROR(FromGrpc(finished, "Load", &ctx));
  }
  if (!have_result) return absl::DataLossError("Load: the daemon ended the stream without a result");
  if (own) {
    for (size_t i = 0; i < spec.tensors.size(); ++i) {
      std::memcpy(spec.tensors[i].buffer, own->data() + offsets[i], spec.tensors[i].num_bytes());
    }
  }
  report.client_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  report.transport = spec.transport;
  if (report.transport == Transport::kCacheView && report.result.bytes_from_views() == 0) {
    report.transport = Transport::kProcessMemory;  // nothing came from the cache (or an older daemon)
  }
  return report;
}

absl::StatusOr<v1::SaveResponse> Client::Save(const SaveSpec& spec) {
  return SaveCall(spec, false);
}

absl::StatusOr<SaveFuture> Client::SaveAsync(const SaveSpec& spec) {
  CKPT_ASSIGN_OR_RETURN(v1::SaveResponse staged, SaveCall(spec, true));
  return SaveFuture(this, spec.job_id, spec.rank, std::move(staged));
}

absl::StatusOr<v1::SaveResponse> Client::SaveCall(const SaveSpec& spec, bool async) {
  // Made again until the daemon answered: the tensors are the caller's still.
  absl::StatusOr<v1::SaveResponse> out = absl::UnknownError("Save: not run");
  CKPT_RETURN_IF_ERROR(Retrying([&] {
    out = SaveOnce(spec, async);
    return out.status();
  }));
  return out;
}

absl::StatusOr<v1::SaveResponse> Client::AwaitSave(const std::string& job_id, int rank,
                                                   absl::Duration timeout) {
  v1::AwaitSaveRequest req;
  req.set_job_id(job_id);
  req.set_rank(rank);
  req.set_timeout_ms(static_cast<uint32_t>(
      std::clamp<int64_t>(absl::ToInt64Milliseconds(timeout), 0, 3'600'000)));
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(timeout + absl::Seconds(30)));
  v1::SaveResponse resp;
  CKPT_RETURN_IF_ERROR(FromGrpc(rep_->stub->AwaitSave(&ctx, req, &resp), "AwaitSave", &ctx));
  return resp;
}

absl::StatusOr<v1::SaveResponse> SaveFuture::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!final_) {
    const absl::Duration slice = std::min(absl::Seconds(10), std::max(absl::ZeroDuration(), deadline - absl::Now()));
    absl::StatusOr<v1::SaveResponse> r = client_->AwaitSave(job_id_, rank_, slice);
    if (r.ok() || !absl::IsDeadlineExceeded(r.status())) {
      final_ = std::move(r);
    } else if (absl::Now() >= deadline) {
      return r.status();
    }
  }
  return *final_;
}

bool SaveFuture::Done() {
  if (final_) return true;
  absl::StatusOr<v1::SaveResponse> r = client_->AwaitSave(job_id_, rank_, absl::ZeroDuration());
  if (!r.ok() && absl::IsDeadlineExceeded(r.status())) return false;
  final_ = std::move(r);
  return true;
}

absl::StatusOr<v1::SaveResponse> Client::SaveOnce(const SaveSpec& spec, bool async) {
  v1::SaveRequest req;
  req.set_async_save(async);
  req.set_job_id(spec.job_id);
  req.set_rank(spec.rank);
  req.set_world_size(spec.world_size);
  req.set_path(spec.path);
  req.set_unique_id(spec.unique_id);
  req.set_next_unique_id(spec.next_unique_id);
  req.set_overwrite(spec.overwrite);
  req.set_job_key(JobKeyOf(spec.job_key));
  for (int r : spec.node_ranks) req.add_node_ranks(r);
  if (spec.barrier_timeout > absl::ZeroDuration()) {
    req.set_barrier_timeout_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(spec.barrier_timeout)));
  }
  size_t on_device = 0;
  for (const TensorSpec& t : spec.tensors) on_device += t.device_buffer != nullptr ? 1 : 0;
  std::unique_ptr<ShmArena> own;
  if (on_device > 0) {
    // Device tensors: the daemon copies them device -> host itself before it
    // answers (SaveRequest.cuda_ipc; daemons built with CUDA).
    if (on_device != spec.tensors.size() || spec.arena != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Save: ", on_device, " of ", spec.tensors.size(),
          " tensors have a device_buffer; a device save needs it on every tensor (and no arena)"));
    }
    v1::LoadRequest device;  // AddDeviceBuffers fills a request's targets and cuda_ipc
    AddTargets(spec.tensors, std::vector<uint64_t>(spec.tensors.size(), 0), device.mutable_targets());
    CKPT_RETURN_IF_ERROR(AddDeviceBuffers(spec.tensors, &device));
    *req.mutable_targets() = device.targets();
    *req.mutable_cuda_ipc() = device.cuda_ipc();
  } else {
    ShmArena* arena = spec.arena;
    std::vector<uint64_t> offsets(spec.tensors.size());
    CKPT_ASSIGN_OR_RETURN(arena, ArenaFor(spec.tensors, spec.arena,
                                          absl::StrCat("ckptd-save-", spec.rank),
                                          rep_->options.socket, rep_->options.connect_timeout,
                                          &own, &offsets));
    if (own) {
      for (size_t i = 0; i < spec.tensors.size(); ++i) {
        std::memcpy(own->data() + offsets[i], spec.tensors[i].buffer, spec.tensors[i].num_bytes());
      }
      // This copy is the save's own (dropped right after the call, never
      // written again): the daemon may keep it instead of copying it.
      req.set_handed_over(async);
    }
    AddTargets(spec.tensors, offsets, req.mutable_targets());
    CKPT_RETURN_IF_ERROR(NameSegment(*arena, rep_->options, req.mutable_shm()));
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(rep_->options.call_timeout));
  v1::SaveResponse resp;
  CKPT_RETURN_IF_ERROR(FromGrpc(rep_->stub->Save(&ctx, req, &resp), "Save", &ctx));
  return resp;
}

absl::StatusOr<LoadReport> LoadStateDict(const std::string& socket, const LoadSpec& spec) {
  Client::Options o;
  o.socket = socket;
  CKPT_ASSIGN_OR_RETURN(auto client, Client::Connect(o));
  return client->Load(spec);
}

}  // namespace ckptd
