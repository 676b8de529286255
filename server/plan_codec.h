// Conversions between core's plan types and the peer protocol's messages.
#ifndef CKPTD_SERVER_PLAN_CODEC_H_
#define CKPTD_SERVER_PLAN_CODEC_H_

#include "absl/status/statusor.h"
#include "core/planner.h"
#include "proto/peer.pb.h"

namespace ckptd {

void ToMsg(const ckpt::TargetTensor& t, peer::v1::TargetMsg* m);
absl::StatusOr<ckpt::TargetTensor> FromMsg(const peer::v1::TargetMsg& m);

void ToMsg(const ckpt::RankPlan& r, peer::v1::RankPlanMsg* m);
absl::StatusOr<ckpt::RankPlan> FromMsg(const peer::v1::RankPlanMsg& m);

void ToMsg(const ckpt::ReadRange& r, peer::v1::ReadMsg* m);
ckpt::ReadRange FromMsg(const peer::v1::ReadMsg& m);

}  // namespace ckptd

#endif  // CKPTD_SERVER_PLAN_CODEC_H_
