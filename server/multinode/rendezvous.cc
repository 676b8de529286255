#include "server/multinode/rendezvous.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/base/xxh3.h"
#include "server/await.h"

namespace ckptd {

std::vector<std::string> RendezvousRing(const std::string& job_id,
                                        std::vector<std::string> members) {
  std::sort(members.begin(), members.end());
  members.erase(std::unique(members.begin(), members.end()), members.end());
  if (members.size() <= 1) return members;
  // XXH3 is the same function on every build (std::hash is not).
  const size_t first = XXH3_64bits(job_id.data(), job_id.size()) % members.size();
  std::rotate(members.begin(), members.begin() + static_cast<std::ptrdiff_t>(first), members.end());
  return members;
}

void Rendezvous::PurgeLocked() {
  const absl::Time now = absl::Now();
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    it = it->second.expires <= now ? jobs_.erase(it) : std::next(it);
  }
}

absl::Status Rendezvous::Announce(const std::string& job_id, const std::string& node,
                                  const std::string& mac) {
  if (job_id.empty() || job_id.size() > limits_.max_job_id_bytes || node.empty() ||
      node.size() > limits_.max_node_bytes || mac.size() > 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "announcement of a coordinator: job id of ", job_id.size(), " bytes, node of ",
        node.size(), " bytes, mac of ", mac.size(), " bytes (at most ", limits_.max_job_id_bytes,
        ", ", limits_.max_node_bytes, " and 64, not empty)"));
  }
  absl::MutexLock lock(&mu_);
  PurgeLocked();
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    if (jobs_.size() >= limits_.max_jobs) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "this daemon keeps the coordinators of ", jobs_.size(), " jobs already (at most ",
          limits_.max_jobs, ")"));
    }
    it = jobs_.emplace(job_id, Entry{}).first;
  }
  Entry& e = it->second;
  e.expires = absl::Now() + keep_;
  for (Coordinator& c : e.coordinators) {
    if (c.node == node) {
      c.mac = mac;  // the same node again (a new job of the same id)
      return absl::OkStatus();
    }
  }
  if (e.coordinators.size() >= limits_.max_coordinators_per_job) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "job '", job_id, "' has ", e.coordinators.size(), " coordinators announced already"));
  }
  e.coordinators.push_back({node, mac});
  return absl::OkStatus();
}

absl::StatusOr<std::vector<Rendezvous::Coordinator>> Rendezvous::Await(
    const std::string& job_id, absl::Time deadline, const std::function<bool()>& cancelled) {
  absl::MutexLock lock(&mu_);
  auto announced = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = jobs_.find(job_id);
    return it != jobs_.end() && !it->second.coordinators.empty();
  };
  if (!AwaitOrCancel(&mu_, absl::Condition(&announced), deadline, cancelled)) {
    if (cancelled && cancelled()) return absl::CancelledError("the caller went away");
    return absl::DeadlineExceededError(
        absl::StrCat("no coordinator of job '", job_id, "' was announced here"));
  }
  return jobs_.at(job_id).coordinators;
}

size_t Rendezvous::size() const {
  absl::MutexLock lock(&mu_);
  return jobs_.size();
}

}  // namespace ckptd
