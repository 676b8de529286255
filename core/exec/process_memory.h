// Delivery into the private memory of another process (cross-memory attach).
//
// A training process's tensors live in its own memory. Instead of writing a
// shared segment that the process then copies out (two copies of every
// byte), the loader writes the tensors themselves with process_vm_writev(2),
// as MPI libraries do for large intra-node messages: one copy, no segment.
// The kernel allows it where ptrace would be allowed (same uid, or
// CAP_SYS_PTRACE); the process names the addresses, so a wrong address can
// only fail the write (EFAULT), never touch memory of the writer.
//
//   ProcessMemory::Options o{.pid = pid, .who = "rank 3 (pid 4242)"};
//   auto mem = ProcessMemory::Open(o);           // pidfd, liveness
//   mem->Write(local_iov, remote_iov, n);        // all bytes or an error
//
// ProcessDelivery wraps another Delivery: ranks given a RemoteTarget list
// get their copies written into that process; the others go to `inner`.
#ifndef CKPTD_CORE_PROCESS_MEMORY_H_
#define CKPTD_CORE_PROCESS_MEMORY_H_

#include <sys/types.h>
#include <sys/uio.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/exec/executor.h"

namespace ckpt {

// The memory of one live process, written by address.
class ProcessMemory final : public RemoteMemory {
 public:
  struct Options {
    pid_t pid = 0;
    std::string who;  // names the process in errors, e.g. "job 'j' rank 3 (pid 42)"
  };
  // Opens a pidfd on `pid` (so a process that exits is noticed before any
  // write, and its pid cannot be mistaken for a later process's).
  static absl::StatusOr<std::unique_ptr<ProcessMemory>> Open(const Options& options);
  ~ProcessMemory() override;

  // Reads `n` bytes at `address` of the process (process_vm_readv), e.g.
  // to check a cookie the process placed there. PERMISSION_DENIED when the
  // kernel does not let this process access it (another uid).
  absl::Status Read(uint64_t address, void* out, size_t n) const;
  // Writes nothing, and succeeds, once the process has exited or `stop`
  // (StopWhen) says its client left: a rank that left must not fail its
  // job's other ranks, even when it unmapped its tensors first. Any other
  // failure is an error.
  absl::Status Write(const struct iovec* local, const struct iovec* remote, size_t n) override;
  // After `stop` returns true (the client cancelled or left), Write writes
  // nothing more and succeeds. Call before the writes start.
  void StopWhen(std::function<bool()> stop) { stop_ = std::move(stop); }
  pid_t pid() const { return options_.pid; }
  const std::string& who() const { return options_.who; }
  // Whether the process is still running (its pidfd not yet readable).
  bool Alive() const;

 private:
  ProcessMemory(Options options, int pidfd) : options_(std::move(options)), pidfd_(pidfd) {}
  bool Stopped() const { return !Alive() || (stop_ && stop_()); }
  const Options options_;
  const int pidfd_;
  std::function<bool()> stop_;
};

// Where one target of a rank is, in a process's memory.
struct RemoteTarget {
  uint64_t address = 0;
};
struct RemoteRank {
  std::shared_ptr<RemoteMemory> memory;  // null: this rank goes to `inner`
  std::vector<RemoteTarget> targets;     // one per RankPlan target
};

// Copies of ranks with a RemoteRank go into their process (by runs; the
// executor batches them per piece); other ranks' copies go to `inner`.
class ProcessDelivery final : public Delivery {
 public:
  ProcessDelivery(std::unique_ptr<Delivery> inner, std::vector<RemoteRank> ranks)
      : inner_(std::move(inner)), ranks_(std::move(ranks)) {}
  absl::StatusOr<int64_t> Copy(size_t rank_index, const RankPlan& rank, const CopyOp& op,
                               const uint8_t* src) override;
  absl::Status Flush() override { return inner_->Flush(); }
  uint8_t* HostDestination(size_t rank_index, uint32_t target) override;
  RemoteMemory* RemoteDestination(size_t rank_index, uint32_t target,
                                  uint64_t* address) override;

 private:
  bool IsRemote(size_t rank_index) const {
    return rank_index < ranks_.size() && ranks_[rank_index].memory != nullptr;
  }
  std::unique_ptr<Delivery> inner_;
  std::vector<RemoteRank> ranks_;
};

// Copies `op` (its source bytes at `src`) into `target`, held at `address`
// of `memory`, through a bounded local bounce buffer: any layout, any cast,
// a permuted source included. Returns the elements written.
absl::StatusOr<int64_t> CopyToRemote(const CopyOp& op, const uint8_t* src,
                                     const TargetTensor& target, RemoteMemory& memory,
                                     uint64_t address);

}  // namespace ckpt

#endif  // CKPTD_CORE_PROCESS_MEMORY_H_
