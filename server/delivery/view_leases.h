// The daemon's side of cache views (core/cache/cache_view.h) on the fd socket:
// a load's views are offered under a fresh token to the uid whose load it
// is; the client takes their fds once ("VIEWS <token>"), copies, and closes
// the connection; the Load call waits for that (or its deadline, or the
// client leaving) before it lets go of the views and answers.
#ifndef CKPTD_SERVER_DELIVERY_VIEW_LEASES_H_
#define CKPTD_SERVER_DELIVERY_VIEW_LEASES_H_

#include <sys/types.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/delivery/fd_channel.h"

namespace ckptd {

class ViewLeases final : public ViewHandler {
 public:
  // Offers `fds` (not owned; valid until Withdraw) to `uid`; returns the
  // token. `who` names the load in errors.
  std::string Offer(uid_t uid, std::vector<int> fds, std::string who);
  // Waits until the client took the views and closed its connection (OK),
  // `deadline` passed (DEADLINE_EXCEEDED) or `cancelled()` (CANCELLED).
  absl::Status AwaitDone(const std::string& token, absl::Time deadline,
                         const std::function<bool()>& cancelled);
  // Forgets `token`: its fds are no longer handed out (call before they
  // are closed).
  void Withdraw(const std::string& token);
  size_t offered() const;

  // ViewHandler (the fd socket's thread):
  absl::StatusOr<std::vector<int>> Take(const std::string& token, uid_t uid) override;
  void Done(const std::string& token, bool copied = true) override;

 private:
  struct Offered {
    uid_t uid = 0;
    std::vector<int> fds;
    std::string who;
    bool taken = false;
    bool done = false;
    bool sent = true;  // false: the views could not be sent to the client
  };
  mutable absl::Mutex mu_;
  std::map<std::string, Offered> offers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_DELIVERY_VIEW_LEASES_H_
