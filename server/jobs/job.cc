#include "server/jobs/job.h"

#include "absl/strings/str_cat.h"
#include "core/base/dtype.h"
#include "core/base/status_macros.h"

namespace ckptd {

using ckpt::Box;
using ckpt::TargetTensor;

namespace {
ckpt::Shape ToShape(const google::protobuf::RepeatedField<int64_t>& r) {
  return ckpt::Shape(r.begin(), r.end());
}
}  // namespace

absl::Status CheckJobKey(const std::string& who, const std::string& key) {
  if (key.empty() || (key.size() >= kMinJobKeyBytes && key.size() <= kMaxJobKeyBytes)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(who, ": job_key must be ", kMinJobKeyBytes,
                                                 " to ", kMaxJobKeyBytes, " bytes, not ",
                                                 key.size()));
}

absl::StatusOr<std::shared_ptr<RankSlot>> NewRankSlot(
    absl::string_view verb, const std::string& job_id, int rank, int world_size,
    const google::protobuf::RepeatedField<int32_t>& node_ranks,
    const google::protobuf::RepeatedPtrField<v1::Target>& targets) {
  const std::string who = absl::StrCat("job '", job_id, "' rank ", rank);
  if (job_id.empty()) return absl::InvalidArgumentError(absl::StrCat(verb, ": job_id is empty"));
  if (world_size < 1 || world_size > (1 << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": world_size ", world_size,
                                                   " is not in [1, 2^20]"));
  }
  if (rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": rank is outside world_size ", world_size));
  }
  for (int r : node_ranks) {
    if (r < 0 || r >= world_size) {
      return absl::InvalidArgumentError(absl::StrCat(who, ": node_ranks entry ", r,
                                                     " is outside world_size ", world_size));
    }
  }
  auto slot = std::make_shared<RankSlot>();
  slot->targets.rank = rank;
  for (const v1::Target& t : targets) {
    TargetTensor tt;
    tt.name = t.name();
    auto dt = ckpt::ParseDType(t.dtype());
    if (!dt.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, " tensor '", t.name(), "': ", dt.status().message()));
    }
    tt.dtype = *dt;
    tt.global_shape = ToShape(t.global_shape());
    tt.box = Box{ToShape(t.offset()), ToShape(t.shape())};
    if (t.has_flat_range()) tt.flat_range = ckpt::FlatRange{t.flat_range().begin(), t.flat_range().end()};
    CKPT_RETURN_IF_ERROR(ckpt::Annotate(ckpt::ValidateTarget(rank, tt),
                                        absl::StrCat("job '", job_id, "'")));
    slot->targets.tensors.push_back(std::move(tt));
  }
  return slot;
}


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
