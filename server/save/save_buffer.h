// The save_buffer: host memory an asynchronous save's ranks hold between
// their answer and the persist (docs/daemon.md, save_buffer). A job charges
// its ranks' bytes once all of them are in (after its barrier: a rank that
// never comes holds none of it), before they are answered, and gives them
// back when the persist thread has written them (the Charge is destroyed).
//
// Owned by the daemon; charged by save jobs' runners, released by the
// persist thread. Thread-safe: `mu_` guards the bytes held and the stop flag.
#ifndef CKPTD_SERVER_SAVE_SAVE_BUFFER_H_
#define CKPTD_SERVER_SAVE_SAVE_BUFFER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace ckptd {

class SaveBuffer {
 public:
  // Bytes of save_buffer held by one rank of an asynchronous save; given back
  // when destroyed. It must not outlive its SaveBuffer.
  class Charge {
   public:
    Charge(const Charge&) = delete;
    Charge& operator=(const Charge&) = delete;
    ~Charge();
    uint64_t bytes() const { return bytes_; }

   private:
    friend class SaveBuffer;
    Charge(SaveBuffer* buffer, uint64_t bytes) : buffer_(buffer), bytes_(bytes) {}
    SaveBuffer* const buffer_;
    const uint64_t bytes_;
  };

  explicit SaveBuffer(uint64_t capacity) : capacity_(capacity) {}

  // RESOURCE_EXHAUSTED naming `who` when `bytes` alone exceed the capacity
  // (no wait would make room).
  absl::Status CheckSize(const std::string& who, uint64_t bytes) const;

  // Reserves room for `bytes`, waiting while the buffer is full (for earlier
  // saves to persist) until `deadline`, the caller leaves (`cancelled`) or
  // Stop. `who` names the rank in errors; *waited_s says how long it waited.
  // RESOURCE_EXHAUSTED when `bytes` alone exceed the capacity.
  absl::StatusOr<std::unique_ptr<Charge>> Reserve(const std::string& who, uint64_t bytes,
                                                  absl::Time deadline,
                                                  const std::function<bool()>& cancelled,
                                                  double* waited_s) ABSL_LOCKS_EXCLUDED(mu_);
  // The daemon is stopping: reservations waiting for room fail (UNAVAILABLE).
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);
  // Bytes held now (Status).
  uint64_t held() const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t capacity() const { return capacity_; }

 private:
  const uint64_t capacity_;
  mutable absl::Mutex mu_;
  uint64_t held_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_SAVE_SAVE_BUFFER_H_
