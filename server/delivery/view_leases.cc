#include "server/delivery/view_leases.h"

#include <fcntl.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "proto/fd_socket.h"
#include "server/await.h"

namespace ckptd {

std::string ViewLeases::Offer(uid_t uid, std::vector<int> fds, std::string who) {
  absl::MutexLock lock(&mu_);
  std::string token;
  do {
    token = RandomToken();
  } while (offers_.count(token) != 0);
  offers_[token] = Offered{uid, std::move(fds), std::move(who)};
  return token;
}

absl::Status ViewLeases::AwaitDone(const std::string& token, absl::Time deadline,
                                   const std::function<bool()>& cancelled) {
  absl::MutexLock lock(&mu_);
  auto it = offers_.find(token);
  if (it == offers_.end()) return absl::InternalError("cache views withdrawn before use");
  Offered& o = it->second;
  if (AwaitOrCancel(&mu_, absl::Condition(&o.done), deadline, cancelled)) {
    return o.sent ? absl::OkStatus()
                  : absl::UnavailableError(
                        absl::StrCat(o.who, ": the cache views could not be sent to the client"));
  }
  if (cancelled && cancelled()) {
    return absl::CancelledError(absl::StrCat(o.who, ": client went away while copying"));
  }
  return absl::DeadlineExceededError(absl::StrCat(
      o.who, o.taken ? ": the client took its cache views but did not finish copying in time"
                     : ": the client did not take its cache views in time (fd socket VIEWS)"));
}

void ViewLeases::Withdraw(const std::string& token) {
  absl::MutexLock lock(&mu_);
  offers_.erase(token);
}

size_t ViewLeases::offered() const {
  absl::MutexLock lock(&mu_);
  return offers_.size();
}

absl::StatusOr<std::vector<int>> ViewLeases::Take(const std::string& token, uid_t uid) {
  absl::MutexLock lock(&mu_);
  auto it = offers_.find(token);
  if (it == offers_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("no cache views under token ", TokenPrefix(token), "... (expired or unknown)"));
  }
  Offered& o = it->second;
  if (o.uid != uid) {
    return absl::PermissionDeniedError(absl::StrCat("cache views ", TokenPrefix(token),
                                                    "... belong to another uid"));
  }
  if (o.taken) {
    return absl::InvalidArgumentError(
        absl::StrCat("cache views ", TokenPrefix(token), "... were already taken"));
  }
  // Copies of the descriptors, made while the offer stands (Withdraw comes
  // before the views are let go), for the receiver to send and close.
  std::vector<int> out;
  for (int fd : o.fds) {
    const int d = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (d < 0) {
      for (int f : out) ::close(f);
      return absl::ResourceExhaustedError("cannot duplicate the cache views' descriptors");
    }
    out.push_back(d);
  }
  o.taken = true;
  return out;
}

void ViewLeases::Done(const std::string& token, bool copied) {
  absl::MutexLock lock(&mu_);
  auto it = offers_.find(token);
  if (it == offers_.end()) return;
  it->second.done = true;
  it->second.sent = copied;
}

}  // namespace ckptd
