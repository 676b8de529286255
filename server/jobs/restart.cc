#include "server/jobs/restart.h"

#include "absl/strings/cord.h"

namespace ckptd {
namespace {
constexpr char kRetryPayload[] = "type.googleapis.com/ckptd.RetryAfterRestart";
}  // namespace

absl::Status RetryAfterRestart(absl::Status s) {
  if (!s.ok()) s.SetPayload(kRetryPayload, absl::Cord("restart"));
  return s;
}

bool IsRetryAfterRestart(const absl::Status& s) {
  return s.GetPayload(kRetryPayload).has_value();
}

}  // namespace ckptd
