// Policy: who may do what with which checkpoint, and how much of the daemon
// one request and one uid may hold (docs/security.md, "Who may do what" and
// "Limits").
//
// Owns the checkpoint roots and their access rules, the admin uids, the
// request limits and the per-uid quotas of Load/Save calls in flight. Every
// RPC handler of the daemon asks it first, before anything is allocated for
// a request: CheckRequestLimits (the request's shape), ResolvePath +
// CheckAccess (the caller's right to the checkpoint), then Reserve (the
// caller's share, held by the returned Reservation for the call's life).
//
// Thread-safe: the quotas are under the policy's own mutex (ABSL_GUARDED_BY); everything
// else is read-only after construction. Knows nothing of jobs or gRPC.
#ifndef CKPTD_SERVER_POLICY_POLICY_H_
#define CKPTD_SERVER_POLICY_POLICY_H_

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "config/config.h"
#include "proto/ckpt.pb.h"
#include "server/api/caller.h"

namespace ckptd {

class Policy {
 public:
  // Takes the roots, access rules, admin uids, limits and socket (whose
  // group may read under the default rule) from `config`.
  explicit Policy(const DaemonConfig& config);

  enum class Access { kRead, kSave };

  // The daemon itself, its own uid and the configured admin uids over the
  // Unix socket (never a TCP caller).
  bool IsAdmin(const Caller& caller) const;
  // realpath(path) inside one of the roots (a relative path names a
  // checkpoint under the first root), else PERMISSION_DENIED; NOT_FOUND when
  // it does not exist inside them (outside, a path that does not exist is
  // PERMISSION_DENIED too: the answer tells nothing of what exists there).
  absl::StatusOr<std::string> ResolvePath(const std::string& path) const;
  // `path` as ResolvePath starts from: absolute paths and URLs
  // (s3://bucket/prefix) as they are, a relative path under the first root.
  std::string Absolute(const std::string& path) const;
  // Whether `caller` may read (or save into) `resolved`, a path ResolvePath
  // returned: the root's access rule, then the directory's mode bits.
  absl::Status CheckAccess(const Caller& caller, const std::string& resolved, Access access) const;
  // Which of a request's targets the daemon maps into its own address space
  // at their dest_offset (a client's shared-memory segment).
  enum class Mapped {
    kNone,      // stream, process_memory: nothing of the client's is mapped
    kAll,       // shm: every target, in the segment
    kHostOnly,  // cuda_ipc: the dest_host targets, in the host segment
  };
  // A request's shape against the limits, before anything is allocated for
  // it; returns the bytes the request is charged (per request, per uid,
  // save_buffer): what the daemon maps or copies for it, not what the
  // request declares. A mapped target costs the pages it touches (the
  // daemon populates only those); the rest their bytes. Mapped targets that
  // span far more of their segment than the pages they touch (more than 8x
  // plus 1 GiB: a sparse segment) are INVALID_ARGUMENT naming both sizes.
  absl::StatusOr<uint64_t> CheckRequestLimits(
      const std::string& who, const google::protobuf::RepeatedPtrField<v1::Target>& targets,
      int world_size, int node_ranks, uint32_t barrier_timeout_ms, Mapped mapped) const;

  // A Load/Save call's share of its uid's quotas; given back when destroyed.
  // Must not outlive the Policy.
  class Reservation {
   public:
    Reservation(Policy* policy, uid_t uid, uint64_t bytes, uint64_t stream)
        : policy_(policy), uid_(uid), bytes_(bytes), stream_(stream) {}
    Reservation(const Reservation&) = delete;
    Reservation& operator=(const Reservation&) = delete;
    ~Reservation();

   private:
    Policy* policy_;
    uid_t uid_;
    uint64_t bytes_, stream_;
  };
  // Reserves one call of `caller` holding `bytes` destination bytes, of
  // which `stream_bytes` are buffered by the daemon (stream destinations);
  // RESOURCE_EXHAUSTED naming the limit when over one.
  absl::StatusOr<std::unique_ptr<Reservation>> Reserve(const Caller& caller, const std::string& who,
                                                       uint64_t bytes, uint64_t stream_bytes)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // What one uid holds right now (limits.*_per_uid).
  struct UidUsage {
    uint64_t ranks = 0;  // Load/Save calls in flight
    uint64_t bytes = 0;  // their destination bytes
  };
  // Whether `full`, which does not exist, would lie inside a root: its
  // nearest existing ancestor resolved, plus the rest (no "..").
  bool WouldBeInsideRoots(const std::string& full) const;
  // The configured root (the deepest, when roots nest) holding `real`, a
  // resolved path, and its own resolved form in *real_root; null if none.
  const std::string* RootOf(const std::string& real, std::string* real_root) const;
  void Release(uid_t uid, uint64_t bytes, uint64_t stream) ABSL_LOCKS_EXCLUDED(mu_);

  const std::vector<std::string> roots_;
  const std::vector<RootAccess> access_;
  const std::vector<uint32_t> admin_uids_;
  const Limits limits_;
  const std::string socket_;

  absl::Mutex mu_;
  std::map<uid_t, UidUsage> usage_ ABSL_GUARDED_BY(mu_);
  uint64_t stream_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // stream buffers reserved, all clients
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_POLICY_POLICY_H_
