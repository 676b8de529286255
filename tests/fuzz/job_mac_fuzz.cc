// Fuzz target: the job-key proofs of the peer plane (issue 33). The input is
// a serialized ckptd.peer.v1.JoinRequest, what a coordinator receives from
// any member of the peer set, read the way the coordinator and a joiner
// check proofs (server/multinode/job_mac.h):
//  - the coordinator's check of the join's job_mac against the job key its
//    own ranks sent (JoinMac of the request's job id and node), with a key
//    and with none (a job without a key);
//  - a joiner's check of a coordinator's proof (PlanMac), with the request's
//    path standing for the coordinator's address and its job_mac for the
//    PlanPart.coordinator_mac it got;
//  - CheckJobKey (server/jobs/job.h) of the request's job_mac bytes as the
//    job_key a client sent.
//
// Properties: a proof is accepted exactly when its bytes equal the MAC made
// with the key (never for a truncated, extended or empty MAC under a key;
// only the empty proof without a key); a join's MAC never passes as a plan's
// for the same fields (the domains differ); MACs are 32 bytes and a function
// of key and fields alone; CheckJobKey accepts exactly empty or 16-64 bytes,
// naming the caller and the size otherwise.
#include <cstdint>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "proto/peer.pb.h"
#include "server/jobs/job.h"
#include "server/multinode/job_mac.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

// The key of the seeds whose proofs are valid (tests/fuzz/make_corpus.py).
constexpr char kKey[] = "fuzz-job-key-0123456789abcdef";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ckptd::peer::v1::JoinRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  const std::string& got = req.job_mac();

  // The coordinator's check, with the job's key.
  const std::string join = ckptd::JoinMac(kKey, req.job_id(), req.node());
  FUZZ_CHECK(join.size() == 32, absl::StrCat("a MAC of ", join.size(), " bytes"));
  FUZZ_CHECK(join == ckptd::JoinMac(kKey, req.job_id(), req.node()), "MAC not deterministic");
  FUZZ_CHECK(ckptd::MacMatches(got, join) == (got == join), "join proof accepted wrongly");
  if (!got.empty() && got != join) {
    FUZZ_CHECK(!ckptd::MacMatches(got.substr(0, got.size() - 1), join), "a truncated proof");
  }
  FUZZ_CHECK(!ckptd::MacMatches("", join), "an empty proof passed under a key");
  // A job without a key: only an empty proof.
  FUZZ_CHECK(ckptd::JoinMac("", req.job_id(), req.node()).empty(), "a MAC without a key");
  FUZZ_CHECK(ckptd::MacMatches(got, ckptd::JoinMac("", req.job_id(), req.node())) == got.empty(),
             "a keyless job's check");

  // A joiner's check of the coordinator's proof (path as the coordinator).
  const std::string plan = ckptd::PlanMac(kKey, req.job_id(), req.path(), req.node());
  FUZZ_CHECK(plan.size() == 32, "a plan MAC's size");
  FUZZ_CHECK(ckptd::MacMatches(got, plan) == (got == plan), "plan proof accepted wrongly");
  FUZZ_CHECK(!ckptd::MacMatches(join, plan), "a join MAC passed as a plan MAC");

  // The same bytes as a client's job_key.
  const absl::Status key = ckptd::CheckJobKey("rank 3", got);
  const bool fits = got.empty() || (got.size() >= 16 && got.size() <= 64);
  FUZZ_CHECK(key.ok() == fits, absl::StrCat("CheckJobKey of ", got.size(), " bytes"));
  if (!key.ok()) {
    FUZZ_CHECK(key.code() == absl::StatusCode::kInvalidArgument &&
                   absl::StrContains(key.message(), "rank 3") &&
                   absl::StrContains(key.message(), absl::StrCat("not ", got.size())),
               std::string(key.message()));
  }
  return 0;
}
