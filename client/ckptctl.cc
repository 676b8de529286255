// ckptctl — the admin CLI of ckptd. Offline subcommands run in-process and
// need no daemon.
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/checkpoint.h"
#include "core/layout.h"
#include "core/offline.h"
#include "core/status_macros.h"
#include "core/writer.h"

ABSL_FLAG(bool, json, false, "print the result as one JSON object");
ABSL_FLAG(int64_t, unique_id, -1,
          "checkpoint version: for inspect/load/merge the version to read (default: newest); "
          "for shard the version written (default 0)");
ABSL_FLAG(int64_t, src_unique_id, -1, "shard: version of SRC to read (default: newest)");
ABSL_FLAG(std::string, layout, "", "layout JSON file (shard, load)");
ABSL_FLAG(std::string, out, "", "output directory (shard, load, merge)");
ABSL_FLAG(std::string, prefix, "", "merge: keep keys starting with PREFIX, stripping 'PREFIX.'");
ABSL_FLAG(std::vector<std::string>, skip_postfix, {},
          "merge: drop keys ending with any of these (comma-separated; may repeat)");
ABSL_FLAG(int, shards, 1, "merge: number of output safetensors files");
ABSL_FLAG(int, threads, 2, "I/O and copy threads");
ABSL_FLAG(bool, strict, false, "load: fail when a requested key is missing from the checkpoint");
ABSL_FLAG(bool, verify, true, "verify shard checksums recorded in the metadata");
ABSL_FLAG(uint64_t, coalesce_gap, 0,
          "load: merge reads of one file whose gap is at most this many bytes");

namespace ckpt {
namespace {

constexpr char kUsage[] = R"(ckptctl — inspect, reshard and convert checkpoints (offline; no daemon needed)

Usage:
  ckptctl inspect CKPT [--json] [--unique_id N]
      Tensors, dtypes, global shapes, shards, files and bytes of a checkpoint
      (native ckptd format or a HuggingFace safetensors directory).
  ckptctl shard SRC --layout L.json --out DIR [--unique_id N] [--src_unique_id M]
      Cut the tensors of SRC per the layout and write a native checkpoint, as if
      each rank had saved its part (replicas written once).
  ckptctl load CKPT --layout L.json --out DIR [--unique_id N] [--json] [--strict]
      Load every rank of the layout (resharding) and write DIR/rank{r}.safetensors,
      then report bytes read, missing and unexpected keys.
  ckptctl merge CKPT --out DIR [--prefix P] [--skip_postfix S,...] [--shards N]
      Merge a sharded checkpoint into HuggingFace safetensors files plus
      model.safetensors.index.json.

Flags may also be written with dashes (--unique-id, --skip-postfix, ...).
Exit status: 0 on success; 1 with a one-line error on stderr otherwise.)";

std::optional<int64_t> OptionalUid(int64_t v) {
  return v >= 0 ? std::optional<int64_t>(v) : std::nullopt;
}

absl::Status Inspect(const std::string& dir) {
  OpenOptions oo;
  oo.unique_id = OptionalUid(absl::GetFlag(FLAGS_unique_id));
  CKPT_ASSIGN_OR_RETURN(Checkpoint c, OpenCheckpoint(dir, oo));
  uint64_t total = 0;
  std::map<std::string, uint64_t> file_bytes;
  nlohmann::json tensors = nlohmann::json::object();
  for (const auto& [name, t] : c.metadata.tensors) {
    uint64_t bytes = 0;
    nlohmann::json shards = nlohmann::json::array();
    for (const ShardMeta& s : t.shards) {
      if (s.replica_id == 0) bytes += s.nbytes;
      file_bytes[s.file] += s.nbytes;
      nlohmann::json js = {{"file", s.file},       {"offset", s.box.offset},
                           {"shape", s.box.shape}, {"dtype", std::string(DTypeName(s.dtype))},
                           {"replica_id", s.replica_id}, {"data_offset", s.data_offset},
                           {"nbytes", s.nbytes}};
      if (s.flat_range) js["flat_range"] = {s.flat_range->begin, s.flat_range->end};
      shards.push_back(std::move(js));
    }
    total += bytes;
    tensors[name] = {{"dtype", std::string(DTypeName(t.dtype))},
                     {"global_shape", t.global_shape},
                     {"bytes", bytes},
                     {"shards", std::move(shards)}};
  }
  if (absl::GetFlag(FLAGS_json)) {
    nlohmann::json j = {{"path", c.dir},
                        {"format", FormatName(c.format)},
                        {"versions", c.versions},
                        {"files", file_bytes},
                        {"total_bytes", total},
                        {"tensors", tensors}};
    if (c.unique_id) j["unique_id"] = *c.unique_id;
    std::cout << j.dump(1) << "\n";
    return absl::OkStatus();
  }
  std::cout << "checkpoint: " << c.dir << "\n"
            << "format:     " << FormatName(c.format) << "\n";
  if (c.unique_id) {
    std::cout << "unique_id:  " << *c.unique_id << " (versions: " << absl::StrJoin(c.versions, ", ")
              << ")\n";
  }
  std::cout << "tensors:    " << c.metadata.tensors.size() << ", " << total << " bytes in "
            << c.data_files.size() << " files\n\n";
  std::printf("%-48s %-8s %-20s %6s %14s\n", "NAME", "DTYPE", "GLOBAL SHAPE", "SHARDS", "BYTES");
  for (const auto& [name, t] : c.metadata.tensors) {
    std::printf("%-48s %-8s %-20s %6zu %14llu\n", name.c_str(),
                std::string(DTypeName(t.dtype)).c_str(), ShapeString(t.global_shape).c_str(),
                t.shards.size(), static_cast<unsigned long long>(tensors[name]["bytes"].get<uint64_t>()));
  }
  std::cout << "\nFILES\n";
  for (const auto& [f, b] : file_bytes) std::printf("  %-40s %14llu\n", f.c_str(), static_cast<unsigned long long>(b));
  return absl::OkStatus();
}

absl::Status Require(const std::string& value, const char* flag, const char* cmd) {
  if (value.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(cmd, ": --", flag, " is required"));
  }
  return absl::OkStatus();
}

absl::Status Shard(const std::string& src) {
  CKPT_RETURN_IF_ERROR(Require(absl::GetFlag(FLAGS_layout), "layout", "shard"));
  CKPT_RETURN_IF_ERROR(Require(absl::GetFlag(FLAGS_out), "out", "shard"));
  CKPT_ASSIGN_OR_RETURN(Layout layout, ReadLayoutFile(absl::GetFlag(FLAGS_layout)));
  ShardOptions so;
  so.source_unique_id = OptionalUid(absl::GetFlag(FLAGS_src_unique_id));
  so.unique_id = std::max<int64_t>(0, absl::GetFlag(FLAGS_unique_id));
  so.threads = absl::GetFlag(FLAGS_threads);
  CKPT_RETURN_IF_ERROR(ShardCheckpoint(src, layout, absl::GetFlag(FLAGS_out), so));
  std::cerr << "wrote " << layout.world_size << " rank files and " << so.unique_id
            << ".metadata to " << absl::GetFlag(FLAGS_out) << "\n";
  return absl::OkStatus();
}

absl::Status Load(const std::string& dir) {
  CKPT_RETURN_IF_ERROR(Require(absl::GetFlag(FLAGS_layout), "layout", "load"));
  CKPT_RETURN_IF_ERROR(Require(absl::GetFlag(FLAGS_out), "out", "load"));
  CKPT_ASSIGN_OR_RETURN(Layout layout, ReadLayoutFile(absl::GetFlag(FLAGS_layout)));
  OfflineLoadOptions lo;
  lo.unique_id = OptionalUid(absl::GetFlag(FLAGS_unique_id));
  lo.threads = absl::GetFlag(FLAGS_threads);
  lo.verify_checksums = absl::GetFlag(FLAGS_verify);
  lo.plan.coalesce_gap = absl::GetFlag(FLAGS_coalesce_gap);
  CKPT_ASSIGN_OR_RETURN(OfflineLoadResult res, LoadOffline(dir, layout, lo));
  if (absl::GetFlag(FLAGS_strict) && !res.plan.missing_keys.empty()) {
    return absl::NotFoundError(absl::StrCat(dir, ": missing keys: ",
                                            absl::StrJoin(res.plan.missing_keys, ", ")));
  }
  auto t0 = std::chrono::steady_clock::now();
  CKPT_RETURN_IF_ERROR(WriteRankOutputs(res, absl::GetFlag(FLAGS_out)));
  res.times.write_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (absl::GetFlag(FLAGS_json)) {
    std::cout << LoadReportJson(res) << "\n";
    return absl::OkStatus();
  }
  std::cout << "loaded " << res.plan.ranks.size() << " ranks from " << dir << " ("
            << FormatName(res.checkpoint.format) << ")\n"
            << "bytes read:      " << res.stats.bytes_read << " in " << res.plan.reads.size()
            << " reads\n"
            << "bytes delivered: " << res.stats.bytes_delivered << "\n"
            << "checksums:       " << res.stats.checksums_verified << " shards verified\n"
            << "missing keys:    " << absl::StrJoin(res.plan.missing_keys, ", ") << "\n"
            << "unexpected keys: " << absl::StrJoin(res.plan.unexpected_keys, ", ") << "\n"
            << "timings (s):     open " << res.times.open_seconds << ", plan "
            << res.times.plan_seconds << ", read+copy " << res.times.load_seconds << ", write "
            << res.times.write_seconds << "\n";
  for (const auto& [from, to] : res.plan.renamed_keys) {
    std::cout << "renamed:         " << from << " <- " << to << "\n";
  }
  return absl::OkStatus();
}

absl::Status Merge(const std::string& dir) {
  CKPT_RETURN_IF_ERROR(Require(absl::GetFlag(FLAGS_out), "out", "merge"));
  OpenOptions oo;
  oo.unique_id = OptionalUid(absl::GetFlag(FLAGS_unique_id));
  CKPT_ASSIGN_OR_RETURN(Checkpoint c, OpenCheckpoint(dir, oo));
  MergeOptions mo;
  mo.prefix = absl::GetFlag(FLAGS_prefix);
  mo.skip_postfix = absl::GetFlag(FLAGS_skip_postfix);
  mo.shards = absl::GetFlag(FLAGS_shards);
  mo.threads = absl::GetFlag(FLAGS_threads);
  CKPT_ASSIGN_OR_RETURN(MergeReport r, MergeToHuggingFace(c, absl::GetFlag(FLAGS_out), mo));
  if (absl::GetFlag(FLAGS_json)) {
    std::cout << nlohmann::json{{"files", r.files}, {"total_size", r.total_size},
                                {"tensors", r.tensors}}.dump()
              << "\n";
  } else {
    std::cout << "merged " << r.tensors << " tensors (" << r.total_size << " bytes) into "
              << r.files.size() << " files in " << absl::GetFlag(FLAGS_out) << "\n";
  }
  return absl::OkStatus();
}

// absl flags use underscores; accept dashes too, and let a repeated
// --skip-postfix accumulate instead of overriding.
std::vector<std::string> NormalizeArgs(int argc, char** argv) {
  std::vector<std::string> out;
  std::vector<std::string> skips;
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (i > 0 && a.rfind("--", 0) == 0) {
      size_t eq = a.find('=');
      std::string name = a.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
      for (char& ch : name) {
        if (ch == '-') ch = '_';
      }
      std::string value = eq == std::string::npos ? "" : a.substr(eq + 1);
      if (name == "skip_postfix") {
        if (eq == std::string::npos && i + 1 < argc) value = argv[++i];
        skips.push_back(value);
        continue;
      }
      a = "--" + name + (eq == std::string::npos ? "" : "=" + value);
    }
    out.push_back(a);
  }
  if (!skips.empty()) out.push_back("--skip_postfix=" + absl::StrJoin(skips, ","));
  return out;
}

}  // namespace
}  // namespace ckpt

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(ckpt::kUsage);
  std::vector<std::string> norm = ckpt::NormalizeArgs(argc, argv);
  std::vector<char*> nargv;
  for (auto& s : norm) nargv.push_back(s.data());
  std::vector<char*> args = absl::ParseCommandLine(static_cast<int>(nargv.size()), nargv.data());
  if (args.size() < 2) {
    std::cerr << ckpt::kUsage << "\n";
    return 2;
  }
  const std::string cmd = args[1];
  if (args.size() != 3) {
    std::cerr << "ckptctl: error: " << cmd << " takes exactly one checkpoint path (see --help)\n";
    return 2;
  }
  const std::string path = args[2];
  absl::Status s;
  if (cmd == "inspect") {
    s = ckpt::Inspect(path);
  } else if (cmd == "shard") {
    s = ckpt::Shard(path);
  } else if (cmd == "load") {
    s = ckpt::Load(path);
  } else if (cmd == "merge") {
    s = ckpt::Merge(path);
  } else {
    std::cerr << "ckptctl: error: unknown command '" << cmd << "' (see --help)\n";
    return 2;
  }
  if (!s.ok()) {
    std::cerr << "ckptctl: error: " << s.message() << " [" << absl::StatusCodeToString(s.code())
              << "]\n";
    return 1;
  }
  return 0;
}
