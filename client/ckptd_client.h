// C++ client of the ckptd daemon: what a training program calls at start-up.
//
//   ckptd::Client::Options o{.socket = "/run/ckptd/ckptd.sock"};
//   auto client = ckptd::Client::Connect(o);
//   ckptd::LoadSpec spec{.job_id = "run42", .rank = rank, .world_size = world,
//                        .path = "/data/ckpt/step1000"};
//   spec.tensors.push_back({"w", DType::kBF16, {4096, 4096}, box, {}, my_buffer});
//   auto report = (*client)->Load(spec);   // my_buffer now holds rank's slice
//
// Delivery is through a shared-memory segment (a memfd handed to the daemon
// over its fd socket): the daemon writes the slices straight into it. Give
// the tensors an `arena` offset and `Load` fills them in place (zero copy);
// give plain `buffer`s and they are copied out of the segment once.
// Every call has a deadline; errors are absl::Status with the daemon's code
// and message. A Client is thread-compatible (one per rank/thread).
#ifndef CKPTD_CLIENT_CKPTD_CLIENT_H_
#define CKPTD_CLIENT_CKPTD_CLIENT_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/base/box.h"
#include "core/base/dtype.h"
#include "core/format/metadata.h"
#include "proto/ckpt.pb.h"

namespace ckptd {

// A memfd-backed shared-memory arena a rank's tensors can live in.
//
// Create() makes one in this process (a memfd sealed against shrinking and
// growing, as the daemon requires); the daemon maps it for every load (page
// tables built per job). FromDaemon() borrows one the daemon keeps mapped
// (its arena pool, "ALLOC" in proto/fd_socket.h; sealed the same way, usable
// only by this uid): loads into it skip that set-up, and a
// restarted rank asking for the same size gets a recycled one. Its contents
// start as whatever the last user left (like malloc). The lease ends when
// the arena is destroyed.
class ShmArena {
 public:
  static absl::StatusOr<std::unique_ptr<ShmArena>> Create(uint64_t size,
                                                          const std::string& name = "ckptd");
  // `socket`: the daemon's gRPC Unix socket (the fd socket sits beside it).
  // The arena is mapped and faulted in here before this returns.
  static absl::StatusOr<std::unique_ptr<ShmArena>> FromDaemon(
      const std::string& socket, uint64_t size, absl::Duration timeout = absl::Seconds(10));
  ~ShmArena();
  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  int fd() const { return fd_; }
  // Non-empty for an arena from the daemon: names it in LoadRequest.shm.
  const std::string& daemon_token() const { return token_; }

 private:
  ShmArena(int fd, uint8_t* data, uint64_t size) : fd_(fd), data_(data), size_(size) {}
  int fd_;
  uint8_t* data_;
  uint64_t size_;
  int lease_ = -1;     // FromDaemon: the lease socket
  std::string token_;  // FromDaemon: the arena's token
};

struct TensorSpec {
  std::string name;
  ckpt::DType dtype = ckpt::DType::kF32;
  ckpt::Shape global_shape;
  ckpt::Box box;  // the part this rank owns (defaults to the whole tensor if empty)
  std::optional<ckpt::FlatRange> flat_range;
  // Where the bytes go: a plain buffer (copied out of the segment after the
  // load) or, when `buffer` is null, `arena_offset` inside LoadSpec::arena.
  void* buffer = nullptr;
  uint64_t arena_offset = 0;
  // Transport::kCudaIpc: the tensor's device memory in this process
  // (cudaMalloc'd, or carved from a DeviceArena in client/cuda/
  // device_export.h so a rank exports one handle per device).
  void* device_buffer = nullptr;

  uint64_t num_bytes() const;
};

// How the bytes reach the tensors (docs/grpc-api.md, "Transports"):
//  kAuto (default): kCacheView when every tensor has its own `buffer`,
//    none overlaps another and the daemon is on a Unix socket; kShm when the
//    daemon refuses it (another uid) or otherwise.
//  kCacheView: kProcessMemory, except that bytes the daemon's data cache
//    holds are copied here from read-only mappings of the cache (one copy,
//    made in every rank's process at once; the mappings are kept across
//    loads); LoadReport::transport says kProcessMemory when none came so.
//  kProcessMemory: the daemon writes the buffers themselves with
//    process_vm_writev (one copy, no segment; the kernel allows it when the
//    daemon runs as this process's uid or has CAP_SYS_PTRACE).
//  kShm: a shared segment (spec.arena, or one made here and copied out).
//  kStream: the bytes come back in the gRPC stream (also over TCP).
//  kCudaIpc: the daemon copies straight into device memory (a ckptd and
//    client built with --config=cuda, on a node with GPUs).
enum class Transport { kAuto, kProcessMemory, kShm, kStream, kCudaIpc, kCacheView };
// "auto", "process_memory", "shm", "stream", "cuda_ipc", "cache_view" (as in
// the Python client).
const char* TransportName(Transport t);
absl::StatusOr<Transport> ParseTransport(const std::string& name);

struct LoadSpec {
  std::string job_id;
  int rank = 0;
  int world_size = 1;
  std::string path;
  std::optional<int64_t> unique_id;
  std::vector<TensorSpec> tensors;
  std::vector<int> node_ranks;  // ranks of this job on this daemon; empty: all
  Transport transport = Transport::kAuto;
  ShmArena* arena = nullptr;  // optional: tensors with null buffers live here
  absl::Duration barrier_timeout = absl::ZeroDuration();  // zero: daemon default
  bool strict = false;
  bool skip_verify = false;
  // AOA statements applied while loading (LoadRequest.aoa_config); every
  // rank of the job passes the same text. Empty: none.
  std::string aoa;
  // The job's shared secret (LoadRequest.job_key: 16 to 64 bytes, the same
  // on every rank; jobs spanning several daemons need one). Empty: the
  // environment's CKPTD_JOB_KEY, if set.
  std::string job_key;
};

struct SaveSpec {
  std::string job_id;
  int rank = 0;
  int world_size = 1;
  std::string path;  // output directory inside one of the daemon's roots
  int64_t unique_id = 0;
  // The daemon picks the version instead (unique_id must be 0): one more than
  // the newest in `path`, visible or still persisting, the same for every
  // rank; across daemons the largest any node's directory asks for. The
  // response's unique_id says which.
  bool next_unique_id = false;
  // The rank's shards: `buffer` holds each one's bytes (or arena_offset in
  // `arena` when buffer is null). Or every one's `device_buffer` (a client
  // built with CUDA): the daemon copies them device -> host itself before it
  // answers (docs/saving.md, "CUDA tensors"); a daemon without CUDA refuses.
  std::vector<TensorSpec> tensors;
  std::vector<int> node_ranks;
  ShmArena* arena = nullptr;
  absl::Duration barrier_timeout = absl::ZeroDuration();
  // Replace version unique_id if it exists (else the daemon answers ALREADY_EXISTS).
  bool overwrite = false;
  // As LoadSpec::job_key.
  std::string job_key;
};

class Client;

// OK when something accepts connections on the Unix socket `path`; else an
// error naming the path: missing (UNAVAILABLE), not a socket
// (FAILED_PRECONDITION), a socket nobody listens on (UNAVAILABLE), or one
// this process may not open (PERMISSION_DENIED naming the socket's owner,
// group and mode and the group to join). Answers at once, without gRPC's
// connect timeout.
absl::Status ProbeUnixSocket(const std::string& path);

// The outcome of Client::SaveAsync: the daemon held a copy of the rank's
// bytes when SaveAsync returned (staged(), persisted false); Wait gives the
// final answer once the version is durable, or the error that failed it.
// The Client must outlive it.
class SaveFuture {
 public:
  SaveFuture(Client* client, std::string job_id, int rank, v1::SaveResponse staged)
      : client_(client), job_id_(std::move(job_id)), rank_(rank), staged_(std::move(staged)) {}
  const v1::SaveResponse& staged() const { return staged_; }
  const std::string& job_id() const { return job_id_; }
  // Waits up to `timeout` (DEADLINE_EXCEEDED while still persisting).
  absl::StatusOr<v1::SaveResponse> Wait(absl::Duration timeout = absl::InfiniteDuration());
  // Whether the save has finished (durable or failed), without waiting.
  bool Done();

 private:
  Client* client_;
  std::string job_id_;
  int rank_;
  v1::SaveResponse staged_;
  std::optional<absl::StatusOr<v1::SaveResponse>> final_;
};

struct LoadReport {
  v1::LoadResult result;
  double client_seconds = 0;
  Transport transport = Transport::kShm;  // the one that carried the bytes
  int retries = 0;  // times the call was made again after the daemon went away
};

class Client {
 public:
  struct Options {
    std::string socket = "/run/ckptd/ckptd.sock";  // or "host:port" with tcp = true
    bool tcp = false;
    absl::Duration connect_timeout = absl::Seconds(10);
    absl::Duration call_timeout = absl::Minutes(30);  // Load: barrier + transfer
    absl::Duration admin_timeout = absl::Minutes(10);  // Inspect/Status/Evict/Prefetch
    // A call that fails because the daemon went away or is restarting (gRPC's
    // own UNAVAILABLE, a connection refused, or the daemon's answer marked
    // "ckptd-retry: restart") is made again, the same job, on a new
    // connection, with backoff and jitter (50 ms doubling to 2 s), for at
    // most this long in all; Connect waits for a daemon that is not there
    // yet as long. Unset: $CKPTD_RETRY_TIMEOUT (seconds), else 60 s; zero:
    // never. docs/operations.md, "Upgrades and restarts".
    std::optional<absl::Duration> retry_timeout;
  };

  // Connects and asks the daemon its version once (the Version RPC): a
  // daemon whose API level is below this client's (VERSION) is refused with
  // FAILED_PRECONDITION naming both versions. A daemon from before the
  // Version RPC counts as API level 1. Other errors of that call are left to
  // the calls that follow.
  // Testing only: $CKPTD_TESTING_API_LEVEL replaces this client's API level.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const Options& options);
  ~Client();

  // What the daemon answered at Connect (api_level 0 and empty strings when
  // it could not tell; api_level 1 for a daemon from before the Version RPC).
  const v1::VersionResponse& daemon_version() const;

  absl::StatusOr<v1::InspectResponse> Inspect(const std::string& path,
                                              std::optional<int64_t> unique_id = std::nullopt);
  // Registers this rank, waits for the job's other ranks, and fills every
  // tensor. `progress` sees each event the daemon streams.
  absl::StatusOr<LoadReport> Load(const LoadSpec& spec,
                                  const std::function<void(const v1::LoadEvent&)>& progress = {});
  // Hands this rank's shards to the daemon, which writes the checkpoint once
  // every rank of the job has done so.
  absl::StatusOr<v1::SaveResponse> Save(const SaveSpec& spec);
  // Save with async_save: returns once the daemon holds a copy of this
  // rank's bytes (and the job's other ranks have handed theirs over); the
  // tensors may change from then on. The daemon writes the version in the
  // background; the future's Wait reports when it is durable.
  absl::StatusOr<SaveFuture> SaveAsync(const SaveSpec& spec);
  // AwaitSave: the final answer of asynchronous save `job_id` for `rank`,
  // waiting up to `timeout` (DEADLINE_EXCEEDED while it is still persisting).
  absl::StatusOr<v1::SaveResponse> AwaitSave(const std::string& job_id, int rank,
                                             absl::Duration timeout);
  absl::StatusOr<v1::PrefetchResponse> Prefetch(const std::string& path,
                                                std::optional<int64_t> unique_id = std::nullopt,
                                                const std::vector<std::string>& tensors = {});
  absl::StatusOr<v1::EvictResponse> Evict(const std::string& path);
  absl::StatusOr<v1::StatusResponse> Status();

 private:
  struct Rep;
  explicit Client(std::unique_ptr<Rep> rep);
  // One Save call (async_save as `async`); SaveCall makes it again after a
  // restart (Retrying).
  absl::StatusOr<v1::SaveResponse> SaveCall(const SaveSpec& spec, bool async);
  absl::StatusOr<v1::SaveResponse> SaveOnce(const SaveSpec& spec, bool async);
  absl::StatusOr<LoadReport> LoadOnce(const LoadSpec& spec,
                                      const std::function<void(const v1::LoadEvent&)>& progress);
  // attempt() again while it fails with a restartable status (Options::
  // retry_timeout), after Reconnect; *retries: how many times.
  absl::Status Retrying(const std::function<absl::Status()>& attempt, int* retries = nullptr);
  // A new channel and stub, the daemon's version asked again.
  absl::Status Reconnect();
  std::unique_ptr<Rep> rep_;
};

// One call: connect to `socket`, load `spec`, return the report.
absl::StatusOr<LoadReport> LoadStateDict(const std::string& socket, const LoadSpec& spec);

}  // namespace ckptd

#endif  // CKPTD_CLIENT_CKPTD_CLIENT_H_
