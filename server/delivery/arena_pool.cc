#include "server/delivery/arena_pool.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace ckptd {

Arena::~Arena() {
  if (data_ != nullptr) ::munmap(data_, size_);
  ::close(fd_);
}

absl::StatusOr<ArenaLease> ArenaPool::Allocate(uint64_t size, uid_t uid) {
  if (size == 0) return absl::InvalidArgumentError("arena of 0 bytes");
  if (size > kMaxArenaBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("arena of ", size, " bytes: over the limit of ", kMaxArenaBytes));
  }
  const uint64_t want = (size + kGranule - 1) / kGranule * kGranule;
  std::shared_ptr<Arena> arena;
  {
    absl::MutexLock lock(&mu_);
    if (leased_bytes_ + want > max_leased_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("arena of ", want, " bytes: leased arenas would exceed the daemon's limit of ",
                       max_leased_, " bytes"));
    }
    for (auto it = free_.rbegin(); it != free_.rend(); ++it) {
      if ((*it)->size() == want && (*it)->uid() == uid && it->use_count() == 1) {
        arena = *it;
        free_.erase(std::next(it).base());
        free_bytes_ -= want;
        ++reused_;
        break;
      }
    }
    leased_bytes_ += want;  // reserved; undone below on failure
  }
  if (arena == nullptr) {
    auto fail = [&](const std::string& what) {
      const int err = errno;
      absl::MutexLock lock(&mu_);
      leased_bytes_ -= want;
      return absl::ResourceExhaustedError(
          absl::StrCat("arena of ", want, " bytes: ", what, ": ", std::strerror(err)));
    };
    int fd = ::memfd_create("ckptd-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return fail("memfd_create");
    if (::ftruncate(fd, static_cast<off_t>(want)) != 0) {
      ::close(fd);
      return fail("ftruncate");
    }
    // Sealed before any client sees it: a client cannot shrink it under the
    // daemon's mapping (a copy into a truncated page is SIGBUS), nor grow it
    // or change the seals.
    if (::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
      ::close(fd);
      return fail("sealing (F_ADD_SEALS)");
    }
    // Faulted in once, by Prefault after the client has it; every later load
    // into it copies at memory speed.
    void* p = ::mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      return fail("mmap");
    }
    arena.reset(new Arena(fd, static_cast<uint8_t*>(p), want, uid));
  }
  const int dup = ::fcntl(arena->fd(), F_DUPFD_CLOEXEC, 0);
  absl::MutexLock lock(&mu_);
  if (dup < 0) {
    leased_bytes_ -= want;
    free_.push_back(std::move(arena));
    free_bytes_ += want;
    TrimLocked();
    return absl::ResourceExhaustedError(absl::StrCat("dup of an arena fd: ", std::strerror(errno)));
  }
  std::string token = RandomToken();
  while (leased_.count(token) != 0) token = RandomToken();
  leased_[token] = std::move(arena);
  return ArenaLease{token, dup, want};
}

void ArenaPool::Prefault(const std::string& token) {
  std::shared_ptr<Arena> a;
  {
    absl::MutexLock lock(&mu_);
    auto it = leased_.find(token);
    if (it == leased_.end()) return;
    a = it->second;
  }
  if (a->faulted_in_.exchange(true)) return;
  // Page tables as for writes, without writing (the client may be using it).
  if (::madvise(a->data(), a->size(), MADV_POPULATE_WRITE) != 0) {
    volatile const uint8_t* p = a->data();  // older kernels: read every page
    for (uint64_t off = 0; off < a->size(); off += 4096) (void)p[off];
  }
}

void ArenaPool::Release(const std::string& token) {
  absl::MutexLock lock(&mu_);
  auto it = leased_.find(token);
  if (it == leased_.end()) return;
  std::shared_ptr<Arena> a = std::move(it->second);
  leased_.erase(it);
  leased_bytes_ -= a->size();
  free_bytes_ += a->size();
  free_.push_back(std::move(a));
  TrimLocked();
}

void ArenaPool::TrimLocked() {
  while (free_bytes_ > free_budget_ && !free_.empty()) {
    free_bytes_ -= free_.front()->size();
    free_.pop_front();  // unmapped when its last job lets go
  }
}

absl::StatusOr<std::shared_ptr<Arena>> ArenaPool::Find(const std::string& token,
                                                       uid_t caller_uid) const {
  absl::MutexLock lock(&mu_);
  auto it = leased_.find(token);
  if (it == leased_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "shm arena '", token, "' is not leased (allocate it from this daemon and keep the lease open)"));
  }
  if (it->second->uid() != caller_uid) {
    return absl::PermissionDeniedError(absl::StrCat(
        "shm arena '", TokenPrefix(token),
        "' belongs to another user: an arena may only be used by the uid that borrowed it"));
  }
  return it->second;
}

void ArenaPool::DropFree() {
  absl::MutexLock lock(&mu_);
  free_.clear();
  free_bytes_ = 0;
}

uint64_t ArenaPool::leased_bytes() const {
  absl::MutexLock lock(&mu_);
  return leased_bytes_;
}

uint64_t ArenaPool::free_bytes() const {
  absl::MutexLock lock(&mu_);
  return free_bytes_;
}

uint64_t ArenaPool::reused() const {
  absl::MutexLock lock(&mu_);
  return reused_;
}

}  // namespace ckptd
