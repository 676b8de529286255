#include "server/jobs/job.h"

namespace ckptd {

void Job::FailLocked(const absl::Status& status) {
  for (auto& [r, slot] : slots) {
    absl::MutexLock lock(&slot->mu);
    if (!slot->done) {
      slot->status = status;
      slot->done = true;
    }
  }
  state = State::kFinished;
}

std::vector<std::shared_ptr<RankSlot>> SlotsOf(const Job& job) {
  absl::MutexLock lock(&job.mu);
  std::vector<std::shared_ptr<RankSlot>> slots;
  slots.reserve(job.slots.size());
  for (const auto& [r, s] : job.slots) slots.push_back(s);
  return slots;
}

}  // namespace ckptd
