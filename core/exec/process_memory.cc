#include "core/exec/process_memory.h"

#include <errno.h>
#include <poll.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/base/box.h"
#include "core/exec/copy.h"
#include "core/base/dtype.h"
#include "core/base/status_macros.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

namespace ckpt {
namespace {

// process_vm_{read,write}v take at most IOV_MAX (1024) entries a side.
constexpr size_t kMaxIov = 1024;

absl::Status Errno(int err, const std::string& who, const std::string& what) {
  const std::string msg = absl::StrCat(who, ": ", what, ": ", std::strerror(err));
  switch (err) {
    case EPERM:
    case EACCES:
      return absl::PermissionDeniedError(
          absl::StrCat(msg, " (the kernel lets a process write another's memory only where it "
                            "could ptrace it: same uid, or CAP_SYS_PTRACE)"));
    case ESRCH:
      return absl::UnavailableError(absl::StrCat(msg, " (the process exited)"));
    case EFAULT:
      return absl::InvalidArgumentError(
          absl::StrCat(msg, " (an address is not mapped, or not writable, in that process)"));
    default:
      return absl::InternalError(msg);
  }
}

// Calls fn(part) for boxes that tile `box` in row-major order, each of at
// most `max_elements` elements (at least one element).
void ForEachPart(const Box& box, int64_t max_elements, const std::function<void(const Box&)>& fn) {
  const size_t rank = box.rank();
  for (size_t a = 0; a < rank; ++a) {
    if (box.shape[a] == 0) return;
  }
  if (NumElements(box.shape) <= max_elements) {
    fn(box);
    return;
  }
  // The outermost axis `a` whose inner axes fit: chunks of axis a, every
  // index of the axes before it.
  size_t a = rank - 1;
  int64_t inner = 1;
  while (a > 0 && inner * box.shape[a] <= max_elements) inner *= box.shape[a--];
  const int64_t step = std::max<int64_t>(1, max_elements / inner);
  Box part = box;
  for (size_t k = 0; k < a; ++k) part.shape[k] = 1;
  std::vector<int64_t> idx(a, 0);
  while (true) {
    for (size_t k = 0; k < a; ++k) part.offset[k] = box.offset[k] + idx[k];
    for (int64_t i = 0; i < box.shape[a]; i += step) {
      part.offset[a] = box.offset[a] + i;
      part.shape[a] = std::min(step, box.shape[a] - i);
      fn(part);
    }
    size_t k = a;
    while (k > 0 && ++idx[k - 1] == box.shape[k - 1]) idx[--k] = 0;
    if (k == 0) return;
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<ProcessMemory>> ProcessMemory::Open(const Options& options) {
  if (options.pid <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(options.who, ": no process id"));
  }
  const int fd = static_cast<int>(::syscall(SYS_pidfd_open, options.pid, 0));
  if (fd < 0) {
    const int err = errno;
    if (err == ENOSYS) {
      return absl::FailedPreconditionError(absl::StrCat(
          options.who, ": this kernel has no pidfd_open (Linux 5.3 or newer is needed to write "
                       "a process's memory safely)"));
    }
    return Errno(err, options.who, "pidfd_open");
  }
  return std::unique_ptr<ProcessMemory>(new ProcessMemory(options, fd));
}

ProcessMemory::~ProcessMemory() { ::close(pidfd_); }

bool ProcessMemory::Alive() const {
  pollfd p{pidfd_, POLLIN, 0};
  return ::poll(&p, 1, 0) == 0;
}

absl::Status ProcessMemory::Read(uint64_t address, void* out, size_t n) const {
  if (!Alive()) return Errno(ESRCH, options_.who, "process_vm_readv");
  iovec local{out, n};
  iovec remote{reinterpret_cast<void*>(static_cast<uintptr_t>(address)), n};
  const ssize_t got = ::process_vm_readv(options_.pid, &local, 1, &remote, 1, 0);
  if (got < 0) return Errno(errno, options_.who, "process_vm_readv");
  if (static_cast<size_t>(got) != n) return Errno(EFAULT, options_.who, "process_vm_readv");
  // The pid named our process while its pidfd said it ran: a pid is reused
  // only after its process was reaped.
  if (!Alive()) return Errno(ESRCH, options_.who, "process_vm_readv");
  return absl::OkStatus();
}

absl::Status ProcessMemory::Write(const iovec* local, const iovec* remote, size_t n) {
  // Remote runs that follow each other go as one iovec: the kernel pins the
  // other process's pages once per remote iovec (a column slice's rows land
  // back to back in the rank's tensor: one pin per page, not per row).
  // Local runs shorter than kGatherRun (a column slice's rows, strided in
  // what was read) are gathered into one buffer first, up to kGatherBytes a
  // call: the kernel's cost per iovec is many times a short copy's (4 MiB in
  // rows of 64 bytes: 14-20 ms as iovecs, 3-4 ms gathered; even at 2 KiB).
  constexpr size_t kGatherRun = 2048;
  constexpr size_t kGatherBytes = 256 << 10;
  thread_local std::vector<uint8_t> gathered;
  std::vector<iovec> to;
  for (size_t at = 0; at < n;) {
    const bool gather = local[at].iov_len < kGatherRun;
    size_t k = 0, want = 0;
    to.clear();
    for (; at + k < n && k < kMaxIov; ++k) {
      const size_t i = at + k;
      if ((local[i].iov_len < kGatherRun) != gather ||
          (gather && k > 0 && want + local[i].iov_len > kGatherBytes)) {
        break;
      }
      want += local[i].iov_len;
      if (!to.empty() &&
          static_cast<const uint8_t*>(to.back().iov_base) + to.back().iov_len == remote[i].iov_base) {
        to.back().iov_len += remote[i].iov_len;
      } else {
        to.push_back(remote[i]);
      }
    }
    const iovec* from = local + at;
    size_t nfrom = k;
    iovec one;
    if (gather && k > 1) {
      if (gathered.size() < want) gathered.resize(kGatherBytes);
      uint8_t* p = gathered.data();
      for (size_t i = at; i < at + k; ++i) {
        std::memcpy(p, local[i].iov_base, local[i].iov_len);
        p += local[i].iov_len;
      }
      one = {gathered.data(), want};
      from = &one;
      nfrom = 1;
    }
    // A process that exited gets nothing more (its pid may name another
    // process soon); like a client that left, it does not fail the others'
    // load: its bytes have nowhere to go (see header).
    if (Stopped()) return absl::OkStatus();
    ssize_t put;
    do {
      put = ::process_vm_writev(options_.pid, from, nfrom, to.data(), to.size(), 0);
    } while (put < 0 && errno == EINTR);
    const int err = put < 0 ? errno : 0;  // before Stopped() calls anything
    if (put < 0 && err == ESRCH) return absl::OkStatus();
    if ((put < 0 || static_cast<size_t>(put) != want) && Stopped()) return absl::OkStatus();
    if (put < 0) return Errno(err, options_.who, "process_vm_writev");
    if (static_cast<size_t>(put) != want) {
      // Transfers stop at the first iovec that faults: name it.
      size_t done = static_cast<size_t>(put), i = at;
      while (i < at + k && done >= remote[i].iov_len) done -= remote[i++].iov_len;
      const uint64_t addr = i < at + k ? reinterpret_cast<uintptr_t>(remote[i].iov_base) + done : 0;
      return Errno(EFAULT, options_.who,
                   absl::StrFormat("process_vm_writev stopped at address 0x%x after %d of %d bytes",
                                   addr, put, want));
    }
    at += k;
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> CopyToRemote(const CopyOp& op, const uint8_t* src,
                                     const TargetTensor& target, RemoteMemory& memory,
                                     uint64_t address) {
  const StoredLayout dst = target.layout();
  const uint64_t dsz = DTypeSize(target.dtype);
  // The bounce buffer holds one part of the region in the target's dtype.
  constexpr int64_t kBounceBytes = 8 << 20;
  const std::vector<Box> held = HeldBoxes(op.src);
  std::vector<uint8_t> bounce;
  std::vector<CopyRun> runs;
  std::vector<iovec> local, remote;
  int64_t elements = 0;
  absl::Status status;
  ForEachPart(op.region, std::max<int64_t>(1, kBounceBytes / static_cast<int64_t>(dsz)),
              [&](const Box& part) {
                if (!status.ok()) return;
                const StoredLayout b = StoredLayout::Whole(part, target.dtype);
                bounce.resize(static_cast<size_t>(b.num_bytes()));
                CopyRegion(op.src, src, b, bounce.data(), part);
                // Only elements the source holds were filled: write those.
                local.clear();
                remote.clear();
                for (const Box& h : held) {
                  std::optional<Box> r = Intersect(h, part);
                  if (!r) continue;
                  runs.clear();
                  if (!AppendCopyRuns(b, dst, *r, std::numeric_limits<size_t>::max(), &runs)) {
                    status = absl::InternalError(absl::StrCat(
                        "tensor '", target.name, "': no runs for a copy into another process"));
                    return;
                  }
                  for (const CopyRun& run : runs) {
                    local.push_back({bounce.data() + run.src * dsz, run.len * dsz});
                    remote.push_back({reinterpret_cast<void*>(static_cast<uintptr_t>(
                                          address + run.dst * dsz)),
                                      run.len * dsz});
                    elements += run.len;
                  }
                }
                if (!local.empty()) status = memory.Write(local.data(), remote.data(), local.size());
              });
  CKPT_RETURN_IF_ERROR(status);
  return elements;
}

absl::StatusOr<int64_t> ProcessDelivery::Copy(size_t rank_index, const RankPlan& rank,
                                              const CopyOp& op, const uint8_t* src) {
  if (!IsRemote(rank_index)) return inner_->Copy(rank_index, rank, op, src);
  const RemoteRank& r = ranks_[rank_index];
  if (op.target >= r.targets.size()) {
    return absl::InternalError(absl::StrCat("rank ", rank.rank, ": copy into target ", op.target,
                                            " of ", r.targets.size()));
  }
  return CopyToRemote(op, src, rank.targets[op.target], *r.memory, r.targets[op.target].address);
}

uint8_t* ProcessDelivery::HostDestination(size_t rank_index, uint32_t target) {
  return IsRemote(rank_index) ? nullptr : inner_->HostDestination(rank_index, target);
}

RemoteMemory* ProcessDelivery::RemoteDestination(size_t rank_index, uint32_t target,
                                                 uint64_t* address) {
  if (!IsRemote(rank_index)) return inner_->RemoteDestination(rank_index, target, address);
  const RemoteRank& r = ranks_[rank_index];
  if (target >= r.targets.size()) return nullptr;
  *address = r.targets[target].address;
  return r.memory.get();
}

}  // namespace ckpt
