// Fuzz target: the multi-node plan part a daemon receives from its job's
// coordinator (Peer.Join's reply, proto/peer.proto) and decodes with
// server/plan_codec.h: the input is a serialized ckptd.peer.v1.PlanPart;
// FromMsg runs on every rank, every rank's targets and every read.
//
// Properties: what FromMsg accepts survives ToMsg -> FromMsg unchanged
// (compared through deterministic serialization); a decoded rank's copies
// name existing targets and carry valid axis permutations.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "core/planner.h"
#include "proto/peer.pb.h"
#include "server/plan_codec.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using ckptd::peer::v1::PlanPart;

template <typename Msg>
std::string Bytes(const Msg& m) {
  std::string s;
  google::protobuf::io::StringOutputStream out(&s);
  google::protobuf::io::CodedOutputStream coded(&out);
  coded.SetSerializationDeterministic(true);
  m.SerializeToCodedStream(&coded);
  coded.Trim();
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  PlanPart part;
  const bool parsed = part.ParseFromArray(data, static_cast<int>(size));
  ckptd_fuzz::Note("ParseFromArray", parsed ? absl::OkStatus() : absl::DataLossError("no"));
  if (!parsed) return 0;

  for (const auto& rm : part.ranks()) {
    for (const auto& tm : rm.targets()) {
      auto t = ckptd::FromMsg(tm);
      if (t.ok()) (void)ckpt::ValidateTarget(rm.rank(), *t);
    }
    auto r = ckptd::FromMsg(rm);
    ckptd_fuzz::Note("FromMsg(RankPlanMsg)", r.status());
    if (!r.ok()) continue;
    for (const ckpt::CopyOp& c : r->copies) {
      FUZZ_CHECK(c.target < r->targets.size(), absl::StrCat("copy names target ", c.target));
      if (!c.src.perm.empty()) {
        std::vector<bool> seen(c.src.box.rank(), false);
        FUZZ_CHECK(c.src.perm.size() == c.src.box.rank(), "perm rank");
        for (int a : c.src.perm) {
          FUZZ_CHECK(a >= 0 && static_cast<size_t>(a) < seen.size() && !seen[a], "perm axis");
          seen[a] = true;
        }
      }
    }
    ckptd::peer::v1::RankPlanMsg m1, m2;
    ckptd::ToMsg(*r, &m1);
    auto r2 = ckptd::FromMsg(m1);
    FUZZ_CHECK(r2.ok(), r2.status().ToString());
    ckptd::ToMsg(*r2, &m2);
    FUZZ_CHECK(Bytes(m1) == Bytes(m2), "RankPlanMsg round trip differs");
  }
  for (const auto& read : part.reads()) {
    ckpt::ReadRange r = ckptd::FromMsg(read);
    ckptd::peer::v1::ReadMsg m1, m2;
    ckptd::ToMsg(r, &m1);
    ckptd::ToMsg(ckptd::FromMsg(m1), &m2);
    FUZZ_CHECK(Bytes(m1) == Bytes(m2), "ReadMsg round trip differs");
  }
  return 0;
}
