#include "server/save/save_buffer.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/await.h"
#include "server/jobs/restart.h"

namespace ckptd {

SaveBuffer::Charge::~Charge() {
  absl::MutexLock lock(&buffer_->mu_);
  buffer_->held_ -= bytes_;
}

absl::Status SaveBuffer::CheckSize(const std::string& who, uint64_t bytes) const {
  if (bytes <= capacity_) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      who, ": ", bytes, " bytes to stage exceed save_buffer (", capacity_,
      " bytes); raise save_buffer or save without async_save"));
}

absl::StatusOr<std::unique_ptr<SaveBuffer::Charge>> SaveBuffer::Reserve(
    const std::string& who, uint64_t bytes, absl::Time deadline,
    const std::function<bool()>& cancelled, double* waited_s) {
  if (absl::Status s = CheckSize(who, bytes); !s.ok()) return s;
  const absl::Time t0 = absl::Now();
  absl::MutexLock lock(&mu_);
  auto fits = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return held_ + bytes <= capacity_; };
  auto fits_or_stopping = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return fits() || stopping_;
  };
  AwaitOrCancel(&mu_, absl::Condition(&fits_or_stopping), deadline, cancelled);
  if (!fits()) {
    if (stopping_) {
      return RetryAfterRestart(absl::UnavailableError(absl::StrCat(
          who, ": the daemon is stopping (the client retries once it is back)")));
    }
    if (cancelled && cancelled()) {
      return absl::CancelledError(absl::StrCat(who, ": the client left while waiting for save_buffer"));
    }
    return absl::DeadlineExceededError(absl::StrCat(
        who, ": save_buffer stayed full (", held_, " of ", capacity_,
        " bytes held by saves still persisting, ", bytes, " needed) for ",
        absl::FormatDuration(absl::Now() - t0)));
  }
  held_ += bytes;
  *waited_s = absl::ToDoubleSeconds(absl::Now() - t0);
  return std::unique_ptr<Charge>(new Charge(this, bytes));
}

void SaveBuffer::Stop() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
}

uint64_t SaveBuffer::held() const {
  absl::MutexLock lock(&mu_);
  return held_;
}

}  // namespace ckptd
