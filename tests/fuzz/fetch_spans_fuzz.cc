// Fuzz target: the spans a peer asks for in a fetch (issue 34), what a node
// serving a multi-node job's reads receives from any member of the peer set
// and checks with FetchSpansOf (server/multinode/plan_codec.h) before it
// sends a byte. The input: 8 bytes, the read's length (little-endian, taken
// modulo 2^40), then a serialized ckptd.peer.v1.FetchReadRequest (its
// `spans` or packed `span_runs`).
//
// Properties: a refusal is INVALID_ARGUMENT naming `spans[i]`, `span_runs[i]`
// or the form; what is accepted expands (as SendRead walks it) to at most
// kMaxFetchSpans spans, each non-empty, inside the read, ascending and
// disjoint, the same spans the request lists; PackSpans of them expands to
// them again.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/plan/planner.h"
#include "proto/peer.pb.h"
#include "server/multinode/plan_codec.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

std::vector<ckpt::ReadSpan> Expand(const std::vector<ckpt::SpanRun>& runs) {
  std::vector<ckpt::ReadSpan> out;
  for (const ckpt::SpanRun& r : runs) {
    for (uint64_t i = 0; i < r.count; ++i) {
      out.push_back({r.begin + i * r.stride, r.begin + i * r.stride + r.length});
    }
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8) return 0;
  uint64_t length = 0;
  std::memcpy(&length, data, 8);
  length %= uint64_t{1} << 40;
  ckptd::peer::v1::FetchReadRequest req;
  if (!req.ParseFromArray(data + 8, static_cast<int>(size - 8))) return 0;

  absl::StatusOr<std::vector<ckpt::SpanRun>> runs = ckptd::FetchSpansOf(req, length);
  if (!runs.ok()) {
    FUZZ_CHECK(runs.status().code() == absl::StatusCode::kInvalidArgument,
               absl::StrCat("refused with ", runs.status().ToString()));
    const std::string m(runs.status().message());
    FUZZ_CHECK(absl::StrContains(m, "spans") || absl::StrContains(m, "span_runs"),
               absl::StrCat("a refusal that names nothing: ", m));
    return 0;
  }
  FUZZ_CHECK(req.spans_size() == 0 || req.span_runs_size() == 0, "both forms accepted");
  uint64_t total = 0;
  for (const ckpt::SpanRun& r : *runs) {
    FUZZ_CHECK(r.count >= 1 && r.length >= 1, "an empty run accepted");
    total += r.count;
    FUZZ_CHECK(total <= ckptd::kMaxFetchSpans, absl::StrCat(total, " spans accepted"));
  }
  const std::vector<ckpt::ReadSpan> spans = Expand(*runs);
  uint64_t end = 0;
  for (const ckpt::ReadSpan& s : spans) {
    FUZZ_CHECK(s.begin >= end && s.end > s.begin && s.end <= length,
               absl::StrCat("span [", s.begin, ", ", s.end, ") accepted after ", end,
                            " in a read of ", length));
    end = s.end;
  }
  // The same spans the request lists.
  std::vector<ckpt::ReadSpan> listed;
  for (const auto& r : req.spans()) {
    listed.push_back({static_cast<uint64_t>(r.begin()), static_cast<uint64_t>(r.end())});
  }
  for (int i = 0; i + 3 < req.span_runs_size(); i += 4) {
    for (uint64_t k = 0; k < req.span_runs(i + 3); ++k) {
      const uint64_t b = req.span_runs(i) + k * req.span_runs(i + 2);
      listed.push_back({b, b + req.span_runs(i + 1)});
    }
  }
  FUZZ_CHECK(listed == spans, "the spans served are not the ones asked for");
  FUZZ_CHECK(Expand(ckpt::PackSpans(spans)) == spans, "PackSpans changed the spans");
  return 0;
}
