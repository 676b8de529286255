// scale_plan — the coordinator's planning of a multi-node load at 8 to
// 4,096 nodes, in one process (issue 34): ckptd::PlanJobParts, exactly what a
// coordinator runs once every node has joined, on simulated joins.
//
// Checkpoint (metadata only, no files): 32 F32 tensors of [2048, 1024]
// (8 MiB, 256 MiB in all) saved by 4 ranks as row shards of 2 MiB, on shared
// storage (every node can read every file); reads cut at 2 MiB.
// Jobs: N nodes x 8 ranks. Layouts:
//   tp-pp-dp  tensor parallel 8 inside a node, P = min(16, N) pipeline
//             stages (node n is stage n % P; stage s holds the tensors
//             t % P == s), the rest data parallel (every node of a stage
//             needs the same bytes): how a 1,000+ node job is laid out;
//   split     every rank a slice of every tensor (even tensors on dim 0, odd
//             on dim 1), as the daemons harness (bench/scale.py) runs it;
//             up to N x 8 = 1,024 ranks.
// Figures per N: wall time of PlanJobParts (joins decoded, plan, balance,
// parts cut), the parts serialized (what gRPC sends), their total and
// largest size, and the same with whole tables (every read and node in
// every part: what parts held before, and still do for NCCL jobs) up to
// 1,024 nodes.
//
// Usage: scale_plan [--nodes 8,64,512,1024,4096] [--layout tp-pp-dp|split]
//                   [--whole-up-to 1024] [--rows FILE] [--max-plan-s S]
// --rows appends bench/run's rows: the plan time at the largest N against
// --max-plan-s (default 2), and the parts' bytes per node at the largest N
// against the smallest (linear in N: at most 1.5).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "config/config.h"
#include "core/format/metadata.h"
#include "core/plan/planner.h"
#include "server/multinode/job_plan.h"
#include "server/multinode/plan_codec.h"

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kTensors = 32;
constexpr int64_t kRows = 2048, kCols = 1024;
constexpr int kSavers = 4;
constexpr int kRanksPerNode = 8;

ckpt::CheckpointMetadata Metadata() {
  ckpt::CheckpointMetadata m;
  std::vector<uint64_t> pos(kSavers, 4096);
  const int64_t rows = kRows / kSavers;
  for (int t = 0; t < kTensors; ++t) {
    ckpt::TensorMeta tm;
    tm.dtype = ckpt::DType::kF32;
    tm.global_shape = {kRows, kCols};
    for (int s = 0; s < kSavers; ++s) {
      ckpt::ShardMeta sm;
      sm.file = absl::StrCat(s, "_0.safetensors");
      sm.box = ckpt::Box{{s * rows, 0}, {rows, kCols}};
      sm.dtype = ckpt::DType::kF32;
      sm.nbytes = static_cast<uint64_t>(rows * kCols * 4);
      sm.data_offset = pos[s];
      pos[s] += sm.nbytes;
      tm.shards.push_back(sm);
    }
    m.tensors[absl::StrCat("layer", t / 2, t % 2 ? ".w2" : ".w1")] = tm;
  }
  return m;
}

ckpt::TargetTensor Slice(const std::string& name, int dim, int64_t parts, int64_t k) {
  ckpt::TargetTensor t;
  t.name = name;
  t.dtype = ckpt::DType::kF32;
  t.global_shape = {kRows, kCols};
  const int64_t len = (dim == 0 ? kRows : kCols) / parts;
  t.box = dim == 0 ? ckpt::Box{{k * len, 0}, {len, kCols}} : ckpt::Box{{0, k * len}, {kRows, len}};
  return t;
}

// The joins of N nodes for `layout`.
std::vector<ckptd::peer::v1::JoinRequest> Joins(const ckpt::CheckpointMetadata& m, int nodes,
                                                const std::string& layout) {
  std::vector<std::string> names;
  for (const auto& [n, t] : m.tensors) names.push_back(n);
  const int stages = std::min(16, nodes);
  std::vector<ckptd::peer::v1::JoinRequest> joins(nodes);
  for (int n = 0; n < nodes; ++n) {
    auto& j = joins[n];
    j.set_job_id("scale");
    j.set_node(absl::StrCat("10.", n / 250, ".", n % 250, ".1:7071"));
    j.set_world_size(nodes * kRanksPerNode);
    for (int s = 0; s < kSavers; ++s) j.add_readable()->set_name(absl::StrCat(s, "_0.safetensors"));
    for (int k = 0; k < kRanksPerNode; ++k) {
      auto* r = j.add_ranks();
      r->set_rank(n * kRanksPerNode + k);
      for (int t = 0; t < kTensors; ++t) {
        ckpt::TargetTensor tt;
        if (layout == "split") {
          tt = Slice(names[t], t % 2, int64_t{nodes} * kRanksPerNode, n * kRanksPerNode + k);
        } else {
          if (t % stages != n % stages) continue;
          tt = Slice(names[t], t % 2, kRanksPerNode, k);
        }
        ckptd::ToMsg(tt, r->add_targets());
      }
    }
  }
  return joins;
}

struct Row {
  double plan_s = 0, serialize_s = 0;
  size_t reads = 0;
  uint64_t total = 0, largest = 0;
};

Row Run(const ckpt::CheckpointMetadata& m, const std::vector<ckptd::peer::v1::JoinRequest>& joins,
        bool whole) {
  ckptd::JobPlanInput in;
  in.job_id = "scale";
  in.metadata = &m;
  for (const auto& j : joins) {
    in.nodes.push_back(j.node());
    in.joins.push_back(&j);
  }
  in.coordinator = in.nodes.front();
  in.max_read_bytes = 2 << 20;
  in.min_reader_bytes = ckptd::DaemonConfig().peer_reader_min_bytes;  // the default's readers
  in.whole_tables = whole;
  const auto t0 = Clock::now();
  auto parts = ckptd::PlanJobParts(in);
  const auto t1 = Clock::now();
  if (!parts.ok()) {
    std::fprintf(stderr, "scale_plan: %s\n", parts.status().ToString().c_str());
    std::exit(1);
  }
  Row row;
  row.reads = parts->reads;
  std::string wire;
  for (const auto& [n, p] : parts->parts) {
    wire.clear();
    p.SerializeToString(&wire);
    row.total += wire.size();
    row.largest = std::max<uint64_t>(row.largest, wire.size());
  }
  row.plan_s = std::chrono::duration<double>(t1 - t0).count();
  row.serialize_s = std::chrono::duration<double>(Clock::now() - t1).count();
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  ckpt::bench::Args args(argc, argv);
  const std::string nodes_arg = args.Get("nodes", "8,64,512,1024,4096");
  const std::string layout = args.Get("layout", "tp-pp-dp");
  const int whole_up_to = static_cast<int>(args.Int("whole-up-to", 1024));
  const std::string rows_path = args.Get("rows");
  const double max_plan_s = std::atof(args.Get("max-plan-s", "2").c_str());
  if (layout != "tp-pp-dp" && layout != "split") {
    std::fprintf(stderr, "scale_plan: --layout is tp-pp-dp or split\n");
    return 2;
  }
  const ckpt::CheckpointMetadata m = Metadata();
  std::printf("layout %s, 8 ranks per node, 256 MiB checkpoint saved by 4 ranks, 2 MiB reads\n",
              layout.c_str());
  std::printf("%6s %7s %6s %9s %8s %12s %10s %9s %14s %14s\n", "nodes", "ranks", "reads",
              "plan_s", "ser_s", "parts_bytes", "per_node", "largest", "whole_bytes",
              "whole_plan_s");
  std::vector<std::pair<int, Row>> done;
  for (const auto& piece : absl::StrSplit(nodes_arg, ',')) {
    int n = 0;
    if (!absl::SimpleAtoi(piece, &n) || n < 2 || n > 8192) {
      std::fprintf(stderr, "scale_plan: --nodes: '%s' is not a node count in [2, 8192]\n",
                   std::string(piece).c_str());
      return 2;
    }
    if (layout == "split" && n * kRanksPerNode > kCols) {
      std::fprintf(stderr, "scale_plan: split layout goes up to %lld nodes\n",
                   static_cast<long long>(kCols / kRanksPerNode));
      return 2;
    }
    const auto joins = Joins(m, n, layout);
    const Row r = Run(m, joins, false);
    std::string whole_bytes = "-", whole_s = "-";
    if (n <= whole_up_to) {
      const Row w = Run(m, joins, true);
      whole_bytes = absl::StrCat(w.total);
      whole_s = absl::StrFormat("%.3f", w.plan_s);
    }
    std::printf("%6d %7d %6zu %9.3f %8.3f %12llu %10llu %9llu %14s %14s\n", n,
                n * kRanksPerNode, r.reads, r.plan_s, r.serialize_s,
                static_cast<unsigned long long>(r.total),
                static_cast<unsigned long long>(r.total / n),
                static_cast<unsigned long long>(r.largest), whole_bytes.c_str(), whole_s.c_str());
    std::fflush(stdout);
    done.push_back({n, r});
  }
  if (!rows_path.empty() && !done.empty()) {
    const auto& [n_max, big] = done.back();
    const auto& [n_min, small] = done.front();
    std::vector<ckpt::bench::Row> rows;
    ckpt::bench::Row t;
    t.name = absl::StrCat("9 scale: coordinator plan, ", n_max, " nodes x 8 (", layout, ")");
    t.figure = big.plan_s;
    t.unit = "s";
    t.limit = max_plan_s;
    t.limit_what = "the target; no hw limit";
    t.ratio = big.plan_s / max_plan_s;
    t.target = absl::StrCat("<", max_plan_s, " s");
    t.met = big.plan_s < max_plan_s ? "yes" : "NO";
    rows.push_back(t);
    if (n_max > n_min) {
      ckpt::bench::Row b;
      b.name = absl::StrCat("9 scale: plan part bytes per node, ", n_max, " vs ", n_min, " nodes (",
                            layout, ")");
      b.figure = static_cast<double>(big.total) / n_max;
      b.unit = "B";
      b.limit = static_cast<double>(small.total) / n_min;
      b.limit_what = absl::StrCat("per node at ", n_min, " nodes");
      b.ratio = b.figure / b.limit;
      b.target = "<=1.5";
      b.met = b.ratio <= 1.5 ? "yes" : "NO";
      rows.push_back(b);
    }
    ckpt::bench::AppendRows(rows_path, rows);
  }
  return 0;
}
