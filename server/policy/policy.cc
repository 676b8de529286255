#include "server/policy/policy.h"

#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "core/base/dtype.h"
#include "core/io/file.h"
#include "server/delivery/target_ranges.h"

namespace ckptd {

Policy::Policy(const DaemonConfig& config)
    : roots_(config.roots),
      access_(config.access),
      admin_uids_(config.admin_uids),
      limits_(config.limits),
      socket_(config.socket) {}

const std::string* Policy::RootOf(const std::string& real, std::string* real_root) const {
  const std::string* best = nullptr;
  std::string best_real;
  for (const std::string& root : roots_) {
    auto canonical = ckpt::Storage::Default()->Canonical(root);
    std::string r = canonical.ok() ? *std::move(canonical) : root;
    const bool under = real == r || absl::StartsWith(real, r == "/" ? r : r + "/");
    if (under && (best == nullptr || r.size() > best_real.size())) {
      best = &root;
      best_real = std::move(r);
    }
  }
  if (real_root != nullptr) *real_root = std::move(best_real);
  return best;
}

absl::StatusOr<std::string> Policy::ResolvePath(const std::string& path) const {
  if (path.empty()) return absl::InvalidArgumentError("checkpoint path is empty");
  // A relative path names a checkpoint under the first root, so a multi-node
  // job can name node-local directories that live at different places.
  const std::string full = Absolute(path);
  auto canonical = ckpt::Storage::Default()->Canonical(full);
  if (!canonical.ok()) {
    // A path that does not exist outside the roots is as refused as one
    // that does: NOT_FOUND there would tell any client what exists.
    if (absl::IsNotFound(canonical.status()) && !WouldBeInsideRoots(full)) {
      return absl::PermissionDeniedError(absl::StrCat(
          path, " is outside the checkpoint roots this daemon serves (",
          absl::StrJoin(roots_, ", "), ")"));
    }
    // Named as the caller named it ("<path>: <why>").
    absl::string_view why = canonical.status().message();
    if (absl::StartsWith(why, full + ": ")) why.remove_prefix(full.size() + 2);
    return absl::Status(absl::IsNotFound(canonical.status()) ? absl::StatusCode::kNotFound
                                                              : absl::StatusCode::kInvalidArgument,
                        absl::StrCat(path, ": ", why));
  }
  std::string real = *std::move(canonical);
  if (RootOf(real, nullptr) != nullptr) return real;
  return absl::PermissionDeniedError(absl::StrCat(
      path, " (", real, ") is outside the checkpoint roots this daemon serves (",
      absl::StrJoin(roots_, ", "), ")"));
}

std::string Policy::Absolute(const std::string& path) const {
  const bool absolute = (!path.empty() && path[0] == '/') || !ckpt::PathScheme(path).empty();
  return absolute ? path : ckpt::JoinPath(roots_.front(), path);
}

bool Policy::WouldBeInsideRoots(const std::string& full) const {
  // The nearest ancestor that exists, resolved, and the rest of the path
  // after it: where `full` would be. A ".." in the rest could lead anywhere.
  std::string head = full, tail;
  while (head.size() > 1) {
    const size_t slash = head.rfind('/');
    if (slash == std::string::npos) return false;
    const std::string part = head.substr(slash + 1);
    if (part == "..") return false;
    if (!part.empty() && part != ".") tail = tail.empty() ? part : part + "/" + tail;
    head = slash == 0 ? "/" : head.substr(0, slash);
    auto resolved = ckpt::Storage::Default()->Canonical(head);
    if (resolved.ok()) {
      return RootOf(tail.empty() ? *resolved : ckpt::JoinPath(*resolved, tail), nullptr) != nullptr;
    }
  }
  return false;
}

bool Policy::IsAdmin(const Caller& caller) const {
  if (caller.via == Caller::Via::kSelf) return true;
  if (caller.via != Caller::Via::kUnix) return false;  // TCP callers are never admins
  if (caller.uid == ::geteuid()) return true;
  return std::find(admin_uids_.begin(), admin_uids_.end(), caller.uid) !=
         admin_uids_.end();
}

namespace {
bool Contains(const std::vector<uint32_t>& v, uint32_t x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}
bool AnyGroup(const Caller& c, const std::vector<uint32_t>& gids) {
  for (uint32_t g : gids) {
    if (c.InGroup(g)) return true;
  }
  return false;
}
// The mode bits that apply to `c` for a file with `st` (owner, group, other).
uint32_t ModeFor(const Caller& c, const ckpt::FileStamp& st) {
  if (st.uid == c.uid) return (st.mode >> 6) & 7;
  if (c.InGroup(st.gid)) return (st.mode >> 3) & 7;
  return st.mode & 7;
}
}  // namespace

absl::Status Policy::CheckAccess(const Caller& caller, const std::string& resolved,
                                 Access access) const {
  if (caller.via == Caller::Via::kSelf) return absl::OkStatus();
  const char* verb = access == Access::kRead ? "read" : "write";
  // The configured root holding `resolved` (ResolvePath checked there is one).
  std::string root;
  const std::string* configured = RootOf(resolved, &root);
  if (configured == nullptr) {
    return absl::PermissionDeniedError(
        absl::StrCat(resolved, " is outside the checkpoint roots this daemon serves"));
  }
  const RootAccess* rule = nullptr;
  for (const RootAccess& a : access_) {
    if (a.root == *configured) rule = &a;
  }
  bool allowed = false;
  if (caller.uid == 0 && caller.via == Caller::Via::kUnix) {
    allowed = true;  // root may always
  } else if (rule != nullptr) {
    allowed = Contains(rule->save_uids, caller.uid) || AnyGroup(caller, rule->save_gids);
    if (access == Access::kRead) {
      allowed = allowed || Contains(rule->read_uids, caller.uid) || AnyGroup(caller, rule->read_gids);
    }
  } else {
    // Default rule: the daemon's own uid reads and saves; members of the
    // socket file's group read.
    allowed = caller.via == Caller::Via::kUnix && caller.uid == ::geteuid();
    struct stat sock;
    if (!allowed && access == Access::kRead && caller.via == Caller::Via::kUnix &&
        !socket_.empty() && ::stat(socket_.c_str(), &sock) == 0) {
      allowed = caller.InGroup(sock.st_gid);
    }
  }
  if (!allowed) {
    return absl::PermissionDeniedError(absl::StrCat(
        caller.Describe(), " may not ", verb, " checkpoints under ", root,
        rule != nullptr ? " (its 'access' entry does not list this uid or its groups)"
                        : " (default rule: only the daemon's uid, root and, for reading, the "
                          "socket's group; add an 'access' entry for this root)"));
  }
  if (caller.uid == 0 && caller.via == Caller::Via::kUnix) return absl::OkStatus();
  // The file system's own answer for this uid: the directory's mode bits
  // (reading needs r-x on the checkpoint directory, saving w-x on the
  // directory that receives the files).
  // (Object stores have no mode bits: their roots' rules above decide.)
  if (!ckpt::PathScheme(resolved).empty()) return absl::OkStatus();
  auto st = ckpt::Storage::Default()->Stat(resolved);
  if (st.ok() && st->has_owner) {
    const uint32_t need = access == Access::kRead ? 5 : 3;
    if ((ModeFor(caller, *st) & need) != need) {
      return absl::PermissionDeniedError(absl::StrCat(caller.Describe(), " may not ", verb, " ",
                                                      resolved, " (its mode bits do not allow it)"));
    }
  }
  return absl::OkStatus();
}

Policy::Reservation::~Reservation() { policy_->Release(uid_, bytes_, stream_); }

void Policy::Release(uid_t uid, uint64_t bytes, uint64_t stream) {
  absl::MutexLock lock(&mu_);
  auto it = usage_.find(uid);
  if (it != usage_.end()) {
    it->second.ranks -= 1;
    it->second.bytes -= bytes;
    if (it->second.ranks == 0) usage_.erase(it);
  }
  stream_bytes_ -= stream;
}

absl::StatusOr<std::unique_ptr<Policy::Reservation>> Policy::Reserve(const Caller& caller,
                                                                      const std::string& who,
                                                                      uint64_t bytes,
                                                                      uint64_t stream_bytes) {
  const Limits& l = limits_;
  absl::MutexLock lock(&mu_);
  UidUsage& u = usage_[caller.uid];
  auto refuse = [&](absl::Status s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (u.ranks == 0) usage_.erase(caller.uid);
    return s;
  };
  if (u.ranks + 1 > l.max_ranks_per_uid) {
    return refuse(absl::ResourceExhaustedError(absl::StrCat(
        who, ": ", caller.Describe(), " already has ", u.ranks,
        " Load/Save calls waiting or running (limits.max_ranks_per_uid ", l.max_ranks_per_uid, ")")));
  }
  if (u.bytes + bytes > l.max_uid_bytes) {
    return refuse(absl::ResourceExhaustedError(absl::StrCat(
        who, ": ", bytes, " destination bytes on top of the ", u.bytes, " that ", caller.Describe(),
        " has in flight exceed limits.max_uid_bytes ", l.max_uid_bytes)));
  }
  if (stream_bytes_ + stream_bytes > l.max_stream_bytes) {
    return refuse(absl::ResourceExhaustedError(absl::StrCat(
        who, ": streaming ", stream_bytes, " bytes on top of the ", stream_bytes_,
        " in flight would exceed limits.max_stream_bytes ", l.max_stream_bytes,
        " (use a shared-memory destination for large loads)")));
  }
  u.ranks += 1;
  u.bytes += bytes;
  stream_bytes_ += stream_bytes;
  return std::make_unique<Reservation>(this, caller.uid, bytes, stream_bytes);
}

absl::StatusOr<uint64_t> Policy::CheckRequestLimits(
    const std::string& who, const google::protobuf::RepeatedPtrField<v1::Target>& targets,
    int world_size, int node_ranks, uint32_t barrier_timeout_ms, Mapped mapped) const {
  const Limits& l = limits_;
  if (static_cast<uint64_t>(targets.size()) > l.max_targets_per_request) {
    return absl::ResourceExhaustedError(absl::StrCat(who, ": ", targets.size(),
                                                     " targets exceed limits.max_targets_per_request ",
                                                     l.max_targets_per_request));
  }
  if (absl::Milliseconds(barrier_timeout_ms) > l.max_barrier_timeout) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": barrier_timeout_ms ", barrier_timeout_ms, " is above limits.max_barrier_timeout ",
        absl::FormatDuration(l.max_barrier_timeout)));
  }
  const uint64_t ranks_here = node_ranks > 0 ? node_ranks : std::max(world_size, 0);
  if (ranks_here > l.max_ranks_per_job) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": ", ranks_here, node_ranks > 0 ? " node_ranks" : " ranks (world_size, no node_ranks)",
        " on this daemon exceed limits.max_ranks_per_job ", l.max_ranks_per_job));
  }
  // Destination bytes from the shapes alone (nothing allocated yet).
  uint64_t declared = 0, total = 0;  // total: of the targets not mapped
  // [begin, end) of the mapped targets, for their pages.
  std::vector<std::pair<uint64_t, uint64_t>> in_segment;
  for (const v1::Target& t : targets) {
    uint64_t n = 1;
    bool overflow = false;
    if (t.has_flat_range()) {  // a range of the flattened box
      n = t.flat_range().end() > t.flat_range().begin()
              ? static_cast<uint64_t>(t.flat_range().end()) -
                    static_cast<uint64_t>(t.flat_range().begin())
              : 0;
    } else {
      for (int64_t d : t.shape()) {
        if (d < 0) break;  // ValidateTarget names it
        if (d != 0 && n > (UINT64_MAX >> 4) / static_cast<uint64_t>(d)) overflow = true;
        n = overflow ? 0 : n * static_cast<uint64_t>(d);
      }
    }
    auto dt = ckpt::ParseDType(t.dtype());
    const uint64_t item = dt.ok() ? ckpt::DTypeSize(*dt) : 1;
    if (overflow || (n != 0 && n > (UINT64_MAX >> 4) / item)) {
      return absl::ResourceExhaustedError(
          absl::StrCat(who, " tensor '", t.name(), "': its box has more bytes than fit in 60 bits"));
    }
    const uint64_t bytes = n * item;
    const bool is_mapped = mapped == Mapped::kAll || (mapped == Mapped::kHostOnly && t.dest_host());
    if (is_mapped) {
      // An end past 2^64 is refused by the destination's range check.
      if (bytes > 0 && t.dest_offset() <= UINT64_MAX - bytes) {
        in_segment.emplace_back(t.dest_offset(), t.dest_offset() + bytes);
      }
    } else {
      total += bytes;
    }
    declared += bytes;
    if (declared > l.max_request_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          who, ": the targets need ", declared, "+ destination bytes (tensor '", t.name(),
          "' among them), above limits.max_request_bytes ", l.max_request_bytes));
    }
  }
  if (in_segment.empty()) return total;
  // The pages the mapped targets touch (what MappedSegment::Map faults in),
  // each counted once.
  uint64_t pages = 0, span = 0;
  for (const auto& [first, last] : PageRuns(in_segment, 4096)) pages += last - first;
  for (const auto& [begin, end] : in_segment) span = std::max(span, end);
  constexpr uint64_t kSlack = uint64_t{1} << 30;
  if (span - std::min(span, 8 * pages) > kSlack) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": the targets span ", span, " bytes of their segment but fill only ", pages,
        " (in 4 KiB pages); a segment more than 8x plus 1 GiB larger than its targets is refused "
        "(pack the targets closer)"));
  }
  total += pages;
  if (total > l.max_request_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        who, ": the targets need ", total, " destination bytes (whole 4 KiB pages where mapped), "
        "above limits.max_request_bytes ", l.max_request_bytes));
  }
  return total;
}

}  // namespace ckptd
