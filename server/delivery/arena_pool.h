// Shared-memory arenas the daemon hands out and keeps mapped.
//
// A client that asks the daemon for its destination arena (fd socket
// "ALLOC", see fd_channel.h) gets a memfd the daemon has already mapped and
// faulted in. Loads into it cost the daemon no mmap, no page-table set-up and
// no munmap per job (for 8 ranks x 64 MiB that set-up is as long as the copy
// itself). When the client closes its lease (or dies), the arena goes back
// to a pool and is handed to the next client of the same user asking for the
// same size (a restarted rank), still mapped. Free arenas are kept up to a
// byte budget, least recently freed dropped first. Arenas are sealed
// (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) before a client gets one, and
// their tokens work only for the uid that borrowed them. A recycled arena holds
// the bytes of its last load (like memory from malloc): the daemon overwrites
// every target byte of a successful load.
//
// Thread-safe.
#ifndef CKPTD_SERVER_DELIVERY_ARENA_POOL_H_
#define CKPTD_SERVER_DELIVERY_ARENA_POOL_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "proto/fd_socket.h"
#include "server/delivery/fd_channel.h"

namespace ckptd {

// One arena: a memfd mapped read-write into the daemon.
class Arena {
 public:
  ~Arena();
  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  int fd() const { return fd_; }
  uid_t uid() const { return uid_; }

 private:
  friend class ArenaPool;
  Arena(int fd, uint8_t* data, uint64_t size, uid_t uid)
      : fd_(fd), data_(data), size_(size), uid_(uid) {}
  int fd_;
  uint8_t* data_;
  uint64_t size_;
  uid_t uid_;
  std::atomic<bool> faulted_in_{false};  // the daemon's page tables are built
};

class ArenaPool final : public ArenaHandler {
 public:
  // Sizes are rounded up to this (so restarted ranks find their arena).
  static constexpr uint64_t kGranule = 2ull << 20;

  // `free_budget`: bytes of free arenas kept mapped; `max_leased`: bytes all
  // leased arenas may hold together.
  ArenaPool(uint64_t free_budget, uint64_t max_leased)
      : free_budget_(free_budget), max_leased_(max_leased) {}

  // ArenaHandler (called by the fd socket's thread).
  absl::StatusOr<ArenaLease> Allocate(uint64_t size, uid_t uid) override;
  void Prefault(const std::string& token) override;
  void Release(const std::string& token) override;

  // The leased arena named by `token`, if `caller_uid` borrowed it; the
  // caller's reference keeps it mapped and out of the pool until dropped.
  // NOT_FOUND if unknown, PERMISSION_DENIED if another uid borrowed it.
  absl::StatusOr<std::shared_ptr<Arena>> Find(const std::string& token, uid_t caller_uid) const;

  // Drops every free arena (Evict).
  void DropFree();

  uint64_t leased_bytes() const;
  uint64_t free_bytes() const;
  uint64_t reused() const;  // allocations served from the pool

 private:
  void TrimLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint64_t free_budget_;
  const uint64_t max_leased_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Arena>> leased_ ABSL_GUARDED_BY(mu_);
  // Free arenas, most recently freed last. An arena whose last job still
  // holds it (use_count > 1) is not handed out until that job lets go.
  std::list<std::shared_ptr<Arena>> free_ ABSL_GUARDED_BY(mu_);
  uint64_t leased_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t free_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reused_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_DELIVERY_ARENA_POOL_H_
