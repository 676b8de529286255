// ckptctl — the admin CLI of ckptd. Offline subcommands run in-process and
// need no daemon.
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "core/plan/aoa.h"
#include "core/plan/planner.h"
#include "core/format/checkpoint.h"
#include "core/tools/convert.h"
#include "core/format/foreign.h"
#include "core/tools/layout.h"
#include "core/tools/cli_help.h"
#include "absl/strings/match.h"
#ifndef CKPTD_NO_S3
#include "core/io/s3/s3_storage.h"
#endif
#include "core/tools/offline.h"
#include "core/base/status_macros.h"
#include "core/write/writer.h"
#include "ckptd_version.h"
#include "client/ckptd_client.h"
#include "core/format/safetensors.h"

#include <thread>
#include <unistd.h>

ABSL_FLAG(bool, json, false, "print the result as one JSON object");
ABSL_FLAG(int64_t, unique_id, -1,
          "checkpoint version: for inspect/load/merge the version to read (default: newest); "
          "for shard the version written (default 0)");
ABSL_FLAG(int64_t, src_unique_id, -1, "shard, convert: version of SRC to read (default: newest)");
ABSL_FLAG(std::string, layout, "", "layout JSON file (shard, load)");
ABSL_FLAG(std::string, out, "", "output directory (shard, load, merge)");
ABSL_FLAG(std::string, prefix, "", "merge: keep keys starting with PREFIX, stripping 'PREFIX.'");
ABSL_FLAG(std::vector<std::string>, skip_postfix, {},
          "merge: drop keys ending with any of these (comma-separated; may repeat)");
ABSL_FLAG(int, shards, 1, "merge: number of output safetensors files");
ABSL_FLAG(int, threads, 2, "I/O and copy threads");
ABSL_FLAG(int, fill_byte, -1,
          "load: fill the destination buffers with this byte (0-255) before loading, so an "
          "element a load failed to write shows (-1: zero-filled)");
ABSL_FLAG(bool, strict, true,
          "load: fail when a requested key is missing from the checkpoint (the default, as "
          "torch's load_state_dict); --strict=false loads the rest and reports the missing keys");
ABSL_FLAG(std::string, aoa, "",
          "load: file of AOA statements (rename, split, concat, transpose, cast, fused "
          "layouts) applied while loading; see docs/aoa.md");
ABSL_FLAG(bool, verify, true, "verify shard checksums recorded in the metadata");
ABSL_FLAG(bool, overwrite, false,
          "shard, convert: replace the version written when --out holds it (else the command "
          "fails, as a daemon's save does)");
ABSL_FLAG(std::string, direct_io, "never",
          "load (offline): never, auto (bypass the page cache for reads not already in it) or "
          "always (O_DIRECT for every piece-wise read)");
ABSL_FLAG(uint64_t, coalesce_gap, 0,
          "load: merge reads of one file whose gap is at most this many bytes");
ABSL_FLAG(std::vector<std::string>, daemon, {},
          "load through the daemon(s) at these sockets instead of in-process; several sockets "
          "spread the layout's ranks over them in contiguous blocks. Also the daemon for "
          "status/prefetch/evict (default /run/ckptd/ckptd.sock)");
ABSL_FLAG(std::string, job_id, "", "load --daemon: job id (default: ckptctl-<pid>)");
ABSL_FLAG(std::vector<std::string>, ranks, {},
          "load --daemon: run only these ranks of the layout in this process (default all)");
ABSL_FLAG(std::string, transport, "auto",
          "load --daemon: auto, cache_view (this process copies what the daemon's cache "
          "holds, the daemon writes the rest), process_memory (the daemon writes this "
          "process's buffers), shm (shared memory) or stream (gRPC)");
ABSL_FLAG(int, barrier_timeout_ms, 0, "load --daemon: barrier deadline (0: daemon default)");
ABSL_FLAG(std::vector<std::string>, tensors, {}, "prefetch: only these tensors");

namespace ckpt {
namespace {

constexpr char kUsage[] = R"(ckptctl — inspect, reshard, merge and convert checkpoints (offline: no daemon
needed), load through running ckptd daemons, and show or steer a daemon

Usage:
  ckptctl inspect CKPT [--json] [--unique_id N]
      Tensors, dtypes, global shapes, shards, files and bytes of a checkpoint
      (native ckptd format, a HuggingFace safetensors directory, PaddlePaddle
      flex_checkpoint or PyTorch DCP).
  ckptctl shard SRC --layout L.json --out DIR [--unique_id N] [--src_unique_id M]
               [--overwrite]
      Cut the tensors of SRC per the layout and write a native checkpoint, as if
      each rank had saved its part (replicas written once). A version DIR already
      holds is refused unless --overwrite.
  ckptctl load CKPT --layout L.json --out DIR [--unique_id N] [--json] [--strict=false]
               [--aoa FILE] [--direct_io never|auto|always] [--fill_byte B]
      Load every rank of the layout (resharding) and write DIR/rank{r}.safetensors,
      then report bytes read, missing and unexpected keys. --aoa applies the AOA
      statements of FILE (renames, splits, transposes, fused qkv, ...) on the way.
      --direct_io reads around the page cache (O_DIRECT): auto for reads whose
      bytes are not in it, always for every read. --fill_byte fills the buffers
      with byte B (0-255) first, so an element a load failed to write shows.
  ckptctl merge CKPT --out DIR [--prefix P] [--skip_postfix S,...] [--shards N]
      Merge a sharded checkpoint into HuggingFace safetensors files plus
      model.safetensors.index.json.
  ckptctl convert SRC --out DST [--unique_id N] [--src_unique_id M] [--overwrite]
      Write SRC (PaddlePaddle flex_checkpoint, PyTorch DCP, HuggingFace or
      native) as a native ckptd checkpoint, shard for shard (version N, default 0;
      one DST holds already is refused unless --overwrite).

Online (through a running ckptd; --daemon SOCKET, default /run/ckptd/ckptd.sock):
  ckptctl load CKPT --layout L.json --out DIR --daemon S1[,S2...] [--ranks R,...]
               [--job_id ID] [--transport auto|cache_view|process_memory|shm|stream] [--json] [--strict=false]
      The same load, as one client per rank (threads of this process), each
      registering with its node's daemon; ranks are spread over the sockets in
      contiguous blocks. Writes DIR/rank{r}.safetensors and the job's report.
      A job spanning several daemons needs a job key: a fresh one when this
      process runs every rank; with --ranks split over processes, give them
      all the same CKPTD_JOB_KEY (16 to 64 bytes).
  ckptctl status [--daemon S] [--json]
      Jobs, asynchronous saves in flight, cache contents and bytes, memory
      budget, totals, uptime.
  ckptctl prefetch CKPT [--daemon S] [--tensors a,b] [--unique_id N]
      Read a checkpoint into the daemon's data cache ahead of a job.
  ckptctl evict CKPT [--daemon S]
      Drop a checkpoint's cached data and metadata from the daemon.

CKPT, SRC, DIR and DST may be s3://bucket/prefix URLs of S3-compatible object storage:
offline, ckptctl reaches the store with the AWS variables and files (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, AWS_PROFILE, ...); online, the daemon does (docs/object-storage.md).
ckptctl --version prints ckptctl's version and the ckptd API level it needs.
Flags may also be written with dashes (--unique-id, --skip-postfix, ...).
Exit status: 0 on success; 1 with a one-line error on stderr on failure;
2 on a usage error.

Reference (every flag, layout files, examples): docs/ckptctl.md)";

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
  so.overwrite = absl::GetFlag(FLAGS_overwrite);
  CKPT_RETURN_IF_ERROR(ShardCheckpoint(src, layout, absl::GetFlag(FLAGS_out), so));
  std::cerr << "wrote " << layout.world_size << " rank files and " << so.unique_id
            << ".metadata to " << absl::GetFlag(FLAGS_out) << "\n";
  return absl::OkStatus();
}

absl::Status LoadViaDaemon(const std::string& dir, const Layout& layout);

absl::Status Load(const std::string& dir) {
  CKPT_RETURN_IF_ERROR(Require(absl::GetFlag(FLAGS_layout), "layout", "load"));
  CKPT_RETURN_IF_ERROR(Require(absl::GetFlag(FLAGS_out), "out", "load"));
  CKPT_ASSIGN_OR_RETURN(Layout layout, ReadLayoutFile(absl::GetFlag(FLAGS_layout)));
  const int fill = absl::GetFlag(FLAGS_fill_byte);
  if (fill < -1 || fill > 255) {
    return absl::InvalidArgumentError(
        absl::StrCat("--fill_byte must be a byte value 0-255 (or -1: off), not ", fill));
  }
  if (!absl::GetFlag(FLAGS_daemon).empty()) return LoadViaDaemon(dir, layout);
  OfflineLoadOptions lo;
  if (fill >= 0) lo.fill_byte = static_cast<uint8_t>(fill);
  lo.unique_id = OptionalUid(absl::GetFlag(FLAGS_unique_id));
  lo.threads = absl::GetFlag(FLAGS_threads);
  lo.verify_checksums = absl::GetFlag(FLAGS_verify);
  lo.plan.coalesce_gap = absl::GetFlag(FLAGS_coalesce_gap);
  CKPT_ASSIGN_OR_RETURN(lo.direct_io, ParseDirectIo(absl::GetFlag(FLAGS_direct_io)));
  if (!absl::GetFlag(FLAGS_aoa).empty()) {
    CKPT_ASSIGN_OR_RETURN(lo.aoa, ReadAoaFile(absl::GetFlag(FLAGS_aoa)));
    lo.aoa_where = absl::GetFlag(FLAGS_aoa);
  }
  CKPT_ASSIGN_OR_RETURN(OfflineLoadResult res, LoadOffline(dir, layout, lo));
  if (absl::GetFlag(FLAGS_strict) && !res.plan.missing_keys.empty()) {
    return absl::NotFoundError(absl::StrCat(dir, ": missing keys: ",
                                            MissingKeysText(res.plan.missing_keys),
                                            " (--strict=false loads the rest and reports them)"));
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
            << " reads (" << res.stats.bytes_read_direct << " around the page cache)\n"
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

absl::Status Convert(const std::string& src) {
  CKPT_RETURN_IF_ERROR(Require(absl::GetFlag(FLAGS_out), "out", "convert"));
  ConvertOptions co;
  co.source_unique_id = OptionalUid(absl::GetFlag(FLAGS_src_unique_id));
  co.unique_id = std::max<int64_t>(0, absl::GetFlag(FLAGS_unique_id));
  co.threads = absl::GetFlag(FLAGS_threads);
  co.overwrite = absl::GetFlag(FLAGS_overwrite);
  CKPT_ASSIGN_OR_RETURN(ConvertReport r, ConvertCheckpoint(src, absl::GetFlag(FLAGS_out), co));
  if (absl::GetFlag(FLAGS_json)) {
    std::cout << nlohmann::json{{"source_format", FormatName(r.source_format)},
                                {"files", r.files_written}, {"tensors", r.tensors},
                                {"bytes", r.bytes}, {"unique_id", co.unique_id},
                                {"skipped_items", r.skipped_items}}.dump()
              << "\n";
  } else {
    std::cout << "converted " << r.tensors << " tensors (" << r.bytes << " bytes) from "
              << FormatName(r.source_format) << " into " << r.files_written << " files and "
              << co.unique_id << ".metadata in " << absl::GetFlag(FLAGS_out) << "\n";
    if (!r.skipped_items.empty()) {
      std::cout << "skipped (not tensors): " << absl::StrJoin(r.skipped_items, ", ") << "\n";
    }
  }
  return absl::OkStatus();
}

std::string DaemonSocket() {
  auto d = absl::GetFlag(FLAGS_daemon);
  return d.empty() ? std::string("/run/ckptd/ckptd.sock") : d.front();
}

absl::StatusOr<std::unique_ptr<ckptd::Client>> ConnectDaemon(const std::string& socket) {
  CKPT_RETURN_IF_ERROR(ckptd::ProbeUnixSocket(socket));
  ckptd::Client::Options o;
  o.socket = socket;
  return ckptd::Client::Connect(o);
}

// `ckptctl status` for a person: a few summary lines and short tables.
std::string HumanBytes(uint64_t b) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 5) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.1f %s", v, kUnits[u]);
  return buf;
}

std::string HumanDuration(double seconds) {
  const int64_t s = static_cast<int64_t>(seconds);
  char buf[32];
  if (s < 60) {
    std::snprintf(buf, sizeof(buf), "%llds", (long long)s);
  } else if (s < 3600) {
    std::snprintf(buf, sizeof(buf), "%lldm%02llds", (long long)(s / 60), (long long)(s % 60));
  } else if (s < 86400) {
    std::snprintf(buf, sizeof(buf), "%lldh%02lldm", (long long)(s / 3600), (long long)(s % 3600 / 60));
  } else {
    std::snprintf(buf, sizeof(buf), "%lldd%02lldh", (long long)(s / 86400), (long long)(s % 86400 / 3600));
  }
  return buf;
}

// 0,1,2,3,7,9,10 -> "0-3,7,9-10".
std::string RankRanges(std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t k = i;
    while (k + 1 < ranks.size() && ranks[k + 1] == ranks[k] + 1) ++k;
    absl::StrAppend(&out, out.empty() ? "" : ",", ranks[i]);
    if (k > i) absl::StrAppend(&out, "-", ranks[k]);
    i = k + 1;
  }
  return out.empty() ? "-" : out;
}

// Columns padded to their widest cell (the last one is not padded).
// A failed command's (or rank's) error as ckptctl reports it.
void PrintError(const absl::Status& s) {
  std::cerr << "ckptctl: error: " << s.message() << " [" << absl::StatusCodeToString(s.code())
            << "]\n";
}

void PrintTable(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& r : rows) {
    for (size_t c = 0; c < r.size(); ++c) {
      if (width.size() <= c) width.push_back(0);
      width[c] = std::max(width[c], r[c].size());
    }
  }
  for (const auto& r : rows) {
    std::string line = " ";
    for (size_t c = 0; c < r.size(); ++c) {
      line += " " + r[c];
      if (c + 1 < r.size()) line += std::string(width[c] - r[c].size() + 2, ' ');
    }
    std::printf("%s\n", line.c_str());
  }
}

void PrintStatus(const ckptd::v1::StatusResponse& s) {
  std::printf("%s, up %s, roots: %s\n", s.version().c_str(), HumanDuration(s.uptime_s()).c_str(),
              absl::StrJoin(s.roots(), ", ").c_str());
  const double lookups = static_cast<double>(s.cache_hits() + s.cache_misses());
  std::vector<std::vector<std::string>> summary = {
      {"memory", absl::StrCat("resident ", HumanBytes(s.resident_bytes())),
       absl::StrCat("cache ", HumanBytes(s.cache_bytes()), " of ", HumanBytes(s.cache_budget_bytes()),
                    " (", s.cache_budget_bytes() ? 100 * s.cache_bytes() / s.cache_budget_bytes() : 0,
                    "%)"),
       absl::StrCat(s.cache_entries(), " cached ranges, metadata of ", s.metadata_cache_entries(),
                    " checkpoints")},
      {"arenas", absl::StrCat("lent ", HumanBytes(s.arena_leased_bytes())),
       absl::StrCat("free ", HumanBytes(s.arena_free_bytes())),
       absl::StrCat(s.arena_reused(), " leases from the free ones")},
      {"cache", absl::StrCat("hits ", s.cache_hits(), ", misses ", s.cache_misses()),
       absl::StrCat("evictions ", s.cache_evictions()),
       lookups > 0 ? absl::StrCat("hit rate ", static_cast<int>(100 * s.cache_hits() / lookups), "%")
                   : std::string("no lookups yet")},
      {"fill", absl::StrCat(s.cache_fills(), " background fills, ", HumanBytes(s.cache_fill_bytes())),
       absl::StrCat(s.cache_fills_failed(), " failed"),
       absl::StrCat(s.cache_laid_out_entries(), " laid-out copies, ",
                    HumanBytes(s.cache_laid_out_bytes()), ", ", s.cache_laid_out_hits(), " served"),
       absl::StrCat("huge pages: ", s.cache_huge_pages().empty() ? "?" : s.cache_huge_pages(),
                    s.cache_huge_pages() == "collapse"
                        ? absl::StrCat(", ", HumanBytes(s.cache_huge_page_bytes()), " collapsed")
                        : std::string())},
      {"loads", absl::StrCat(s.loads_started(), " started, ", s.loads_succeeded(), " ok, ",
                             s.loads_failed(), " failed"),
       absl::StrCat("read ", HumanBytes(s.bytes_read_total()), " from storage"),
       absl::StrCat("delivered ", HumanBytes(s.bytes_delivered_total()))},
      {"saves", absl::StrCat("staged ", HumanBytes(s.save_staged_bytes()), " of ",
                             HumanBytes(s.save_buffer_bytes()), " (save_buffer)"),
       absl::StrCat(s.saves_durable(), " durable, ", s.saves_failed(), " failed"),
       absl::StrCat("persisted ", HumanBytes(s.save_bytes_persisted_total()))},
  };
  if (s.has_object_storage()) {
    const ckptd::v1::ObjectStorageStatus& o = s.object_storage();
    summary.push_back({"s3", absl::StrCat(o.endpoint(), " (", o.region(), ")"),
                       absl::StrCat(o.gets(), " GETs, ", o.lists(), " LISTs, ", o.heads(),
                                    " HEADs, ", o.puts(), " PUTs, ", o.retries(), " retries"),
                       absl::StrCat("in ", HumanBytes(o.bytes_in()), ", out ",
                                    HumanBytes(o.bytes_out()), "; at most ", o.requests_peak(),
                                    " in flight (max_requests ",
                                    o.max_requests() == 0 ? std::string("unbounded")
                                                          : absl::StrCat(o.max_requests()),
                                    ")")});
  }
  std::printf("\n");
  PrintTable(summary);

  std::printf("\njobs: %d%s\n", s.jobs_size(), s.jobs_size() ? "" : " (none waiting or running)");
  if (s.jobs_size() > 0) {
    std::vector<std::vector<std::string>> rows = {
        {"JOB", "STATE", "RANKS HERE", "WAITING FOR", "CHECKPOINT"}};
    for (const auto& j : s.jobs()) {
      const int here = j.registered_ranks_size() + j.waiting_for_size();
      rows.push_back({j.job_id(), j.state(),
                      absl::StrCat(j.registered_ranks_size(), "/", here, " (world ", j.world_size(), ")"),
                      RankRanges({j.waiting_for().begin(), j.waiting_for().end()}), j.path()});
    }
    PrintTable(rows);
  }

  if (s.saves_size() > 0) {
    std::printf("\nasynchronous saves: %d\n", s.saves_size());
    std::vector<std::vector<std::string>> rows = {
        {"JOB", "STATE", "VERSION", "PERSISTED", "AGE", "CHECKPOINT"}};
    for (const auto& v : s.saves()) {
      rows.push_back({v.job_id(), v.error().empty() ? v.state() : v.state() + ": " + v.error(),
                      absl::StrCat(v.unique_id()),
                      absl::StrCat(HumanBytes(v.bytes_persisted()), " of ",
                                   HumanBytes(v.bytes_staged())),
                      HumanDuration(v.age_s()), v.path()});
    }
    PrintTable(rows);
  }

  if (s.peer_address().empty() && s.peers_size() == 0) {
    std::printf("\npeers: none (single node)\n");
  } else {
    int up = 0;
    for (const auto& p : s.peers()) up += p.reachable();
    // A large peer set: only some were pinged (PeerPlane::Health).
    const std::string checked =
        static_cast<uint32_t>(s.peers_size()) < s.peers_known()
            ? absl::StrCat(" checked reachable (of ", s.peers_known(),
                           "; the daemons this one called most recently are checked)")
            : std::string(" reachable");
    std::printf("\npeers: %d of %d%s, this daemon is %s\n", up, s.peers_size(), checked.c_str(),
                s.peer_address().empty() ? "(no peer_listen)" : s.peer_address().c_str());
    std::vector<std::vector<std::string>> rows = {{"PEER", "STATE", "RTT", "ERROR"}};
    for (const auto& p : s.peers()) {
      char rtt[32];
      std::snprintf(rtt, sizeof(rtt), "%.1f ms", p.rtt_ms());
      rows.push_back({p.address(), p.reachable() ? "up" : "DOWN", p.reachable() ? rtt : "-",
                      p.error().empty() ? "-" : p.error()});
    }
    if (s.peers_size() > 0) PrintTable(rows);
  }

  if (s.cached_files_size() > 0) {
    std::vector<const ckptd::v1::CachedFile*> files;
    for (const auto& f : s.cached_files()) files.push_back(&f);
    std::sort(files.begin(), files.end(),
              [](const auto* a, const auto* b) { return a->bytes() > b->bytes(); });
    const size_t shown = std::min<size_t>(files.size(), 10);
    std::printf("\ncached files: %d%s\n", s.cached_files_size(),
                shown < files.size() ? absl::StrCat(" (largest ", shown, " shown)").c_str() : "");
    std::vector<std::vector<std::string>> rows = {{"BYTES", "RANGES", "FILE"}};
    for (size_t i = 0; i < shown; ++i) {
      rows.push_back({HumanBytes(files[i]->bytes()), absl::StrCat(files[i]->entries()),
                      files[i]->path()});
    }
    PrintTable(rows);
  }
}

absl::Status Status() {
  CKPT_ASSIGN_OR_RETURN(auto client, ConnectDaemon(DaemonSocket()));
  CKPT_ASSIGN_OR_RETURN(ckptd::v1::StatusResponse s, client->Status());
  if (absl::GetFlag(FLAGS_json)) {
    nlohmann::json jobs = nlohmann::json::array();
    for (const auto& j : s.jobs()) {
      jobs.push_back({{"job_id", j.job_id()},
                      {"path", j.path()},
                      {"world_size", j.world_size()},
                      {"registered_ranks", std::vector<int>(j.registered_ranks().begin(), j.registered_ranks().end())},
                      {"waiting_for", std::vector<int>(j.waiting_for().begin(), j.waiting_for().end())},
                      {"state", j.state()}});
    }
    nlohmann::json files = nlohmann::json::array();
    for (const auto& f : s.cached_files()) {
      files.push_back({{"path", f.path()}, {"bytes", f.bytes()}, {"entries", f.entries()}});
    }
    std::cout << nlohmann::json{{"version", s.version()},
                                {"api_level", s.api_level()},
                                {"uptime_s", s.uptime_s()},
                                {"jobs", jobs},
                                {"cache", {{"budget_bytes", s.cache_budget_bytes()},
                                           {"bytes", s.cache_bytes()},
                                           {"entries", s.cache_entries()},
                                           {"hits", s.cache_hits()},
                                           {"misses", s.cache_misses()},
                                           {"evictions", s.cache_evictions()},
                                           {"fills", s.cache_fills()},
                                           {"fill_bytes", s.cache_fill_bytes()},
                                           {"fills_failed", s.cache_fills_failed()},
                                           {"laid_out_bytes", s.cache_laid_out_bytes()},
                                           {"laid_out_entries", s.cache_laid_out_entries()},
                                           {"laid_out_hits", s.cache_laid_out_hits()},
                                           {"huge_pages", s.cache_huge_pages()},
                                           {"huge_page_bytes", s.cache_huge_page_bytes()},
                                           {"files", files}}},
                                {"loads", {{"started", s.loads_started()},
                                           {"succeeded", s.loads_succeeded()},
                                           {"failed", s.loads_failed()}}},
                                {"bytes_read_total", s.bytes_read_total()},
                                {"bytes_delivered_total", s.bytes_delivered_total()},
                                {"metadata_cache_entries", s.metadata_cache_entries()},
                                {"resident_bytes", s.resident_bytes()},
                                {"arenas", {{"leased_bytes", s.arena_leased_bytes()},
                                            {"free_bytes", s.arena_free_bytes()},
                                            {"reused", s.arena_reused()}}},
                                {"peer_address", s.peer_address()},
                                {"peers_known", s.peers_known()},
                                {"peers", [&] {
                                   nlohmann::json ps = nlohmann::json::array();
                                   for (const auto& p : s.peers()) {
                                     ps.push_back({{"address", p.address()},
                                                   {"reachable", p.reachable()},
                                                   {"error", p.error()},
                                                   {"rtt_ms", p.rtt_ms()}});
                                   }
                                   return ps;
                                 }()},
                                {"roots", std::vector<std::string>(s.roots().begin(), s.roots().end())},
                                {"object_storage", [&]() -> nlohmann::json {
                                   if (!s.has_object_storage()) return nullptr;
                                   const auto& o = s.object_storage();
                                   return {{"endpoint", o.endpoint()}, {"region", o.region()},
                                           {"credentials", o.credentials()},
                                           {"heads", o.heads()}, {"gets", o.gets()},
                                           {"lists", o.lists()}, {"puts", o.puts()},
                                           {"deletes", o.deletes()}, {"retries", o.retries()},
                                           {"bytes_in", o.bytes_in()}, {"bytes_out", o.bytes_out()},
                                           {"max_requests", o.max_requests()},
                                           {"requests_peak", o.requests_peak()},
                                           {"request_wait_seconds", o.request_wait_seconds()}};
                                 }()}}
                     .dump(1)
              << "\n";
    return absl::OkStatus();
  }
  PrintStatus(s);
  return absl::OkStatus();
}

absl::Status Prefetch(const std::string& path) {
  CKPT_ASSIGN_OR_RETURN(auto client, ConnectDaemon(DaemonSocket()));
  CKPT_ASSIGN_OR_RETURN(auto r, client->Prefetch(path, OptionalUid(absl::GetFlag(FLAGS_unique_id)),
                                                 absl::GetFlag(FLAGS_tensors)));
  if (absl::GetFlag(FLAGS_json)) {
    std::cout << nlohmann::json{{"bytes_read", r.bytes_read()}, {"bytes_cached", r.bytes_cached()},
                                {"seconds", r.seconds()}}.dump() << "\n";
  } else {
    std::cout << "prefetched " << path << ": read " << r.bytes_read() << " bytes, "
              << r.bytes_cached() << " bytes now cached (" << r.seconds() << " s)\n";
  }
  return absl::OkStatus();
}

absl::Status Evict(const std::string& path) {
  CKPT_ASSIGN_OR_RETURN(auto client, ConnectDaemon(DaemonSocket()));
  CKPT_ASSIGN_OR_RETURN(auto r, client->Evict(path));
  if (absl::GetFlag(FLAGS_json)) {
    std::cout << nlohmann::json{{"bytes_freed", r.bytes_freed()}, {"entries_freed", r.entries_freed()}}.dump() << "\n";
  } else {
    std::cout << "evicted " << path << ": freed " << r.bytes_freed() << " bytes in "
              << r.entries_freed() << " entries\n";
  }
  return absl::OkStatus();
}

// Load through the daemon(s): one client (thread) per rank.
absl::Status LoadViaDaemon(const std::string& dir, const Layout& layout) {
  const std::vector<std::string> sockets = absl::GetFlag(FLAGS_daemon);
  const std::string out = absl::GetFlag(FLAGS_out);
  std::string job = absl::GetFlag(FLAGS_job_id);
  if (job.empty()) job = absl::StrCat("ckptctl-", ::getpid());
  const std::string transport = absl::GetFlag(FLAGS_transport);
  if (transport != "auto" && transport != "cache_view" && transport != "process_memory" &&
      transport != "shm" && transport != "stream") {
    return absl::InvalidArgumentError(
        "--transport must be auto, cache_view, process_memory, shm or stream");
  }
  std::string aoa;  // AOA statements: every rank sends them
  if (!absl::GetFlag(FLAGS_aoa).empty()) {
    CKPT_ASSIGN_OR_RETURN(aoa, ReadAoaFile(absl::GetFlag(FLAGS_aoa)));
  }
  std::vector<int> ranks;
  if (absl::GetFlag(FLAGS_ranks).empty()) {
    for (int r = 0; r < layout.world_size; ++r) ranks.push_back(r);
  } else {
    for (const std::string& r : absl::GetFlag(FLAGS_ranks)) {
      int v;
      if (!absl::SimpleAtoi(r, &v) || v < 0 || v >= layout.world_size) {
        return absl::InvalidArgumentError(absl::StrCat("--ranks: '", r, "' is not a rank of the layout"));
      }
      ranks.push_back(v);
    }
  }
  // The job key (LoadRequest.job_key): $CKPTD_JOB_KEY, else, when this
  // process runs every rank of the world, a fresh one (ranks split over
  // several ckptctl processes with --ranks share CKPTD_JOB_KEY).
  std::string job_key;
  const char* env_key = std::getenv("CKPTD_JOB_KEY");
  if ((env_key == nullptr || *env_key == '\0') &&
      static_cast<int>(ranks.size()) == layout.world_size) {
    uint8_t raw[16];
    if (::getrandom(raw, sizeof(raw), 0) == static_cast<ssize_t>(sizeof(raw))) {
      job_key = absl::BytesToHexString(
          absl::string_view(reinterpret_cast<const char*>(raw), sizeof(raw)));
    }
  }
  // Ranks in contiguous blocks over the daemons: block b holds ranks
  // [b*per, (b+1)*per).
  const int n_daemons = static_cast<int>(sockets.size());
  const int per = (layout.world_size + n_daemons - 1) / n_daemons;
  auto daemon_of = [&](int rank) { return std::min(rank / per, n_daemons - 1); };
  CKPT_RETURN_IF_ERROR(MakeDirs(out));
  struct RankRun {
    int rank;
    std::vector<std::vector<uint8_t>> buffers;
    absl::StatusOr<ckptd::LoadReport> report = absl::UnknownError("not run");
  };
  std::vector<RankRun> runs(ranks.size());
  std::vector<std::thread> threads;
  const bool show_progress = ::isatty(2) && !absl::GetFlag(FLAGS_json);
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < ranks.size(); ++i) {
    runs[i].rank = ranks[i];
    threads.emplace_back([&, i] {
      RankRun& run = runs[i];
      const RankTargets& rt = layout.ranks[run.rank];
      ckptd::LoadSpec spec;
      spec.job_id = job;
      spec.rank = run.rank;
      spec.world_size = layout.world_size;
      spec.path = dir;
      spec.unique_id = OptionalUid(absl::GetFlag(FLAGS_unique_id));
      spec.strict = absl::GetFlag(FLAGS_strict);
      spec.skip_verify = !absl::GetFlag(FLAGS_verify);
      spec.aoa = aoa;
      spec.job_key = job_key;  // empty: the client takes $CKPTD_JOB_KEY
      spec.transport = *ckptd::ParseTransport(transport);  // checked above
      if (absl::GetFlag(FLAGS_barrier_timeout_ms) > 0) {
        spec.barrier_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_barrier_timeout_ms));
      }
      const int d = daemon_of(run.rank);
      for (int r = 0; r < layout.world_size; ++r) {
        if (daemon_of(r) == d) spec.node_ranks.push_back(r);
      }
      run.buffers.resize(rt.tensors.size());
      for (size_t t = 0; t < rt.tensors.size(); ++t) {
        const TargetTensor& tt = rt.tensors[t];
        run.buffers[t].resize(tt.num_bytes(),
                              static_cast<uint8_t>(std::max(absl::GetFlag(FLAGS_fill_byte), 0)));
        spec.tensors.push_back({tt.name, tt.dtype, tt.global_shape, tt.box, tt.flat_range,
                                run.buffers[t].data(), 0});
      }
      ckptd::Client::Options o;
      o.socket = sockets[d];
      auto client = ckptd::Client::Connect(o);
      if (!client.ok()) {
        run.report = client.status();
        return;
      }
      run.report = (*client)->Load(spec, [&](const ckptd::v1::LoadEvent& ev) {
        if (show_progress && run.rank == ranks.front() && ev.has_progress()) {
          std::fprintf(stderr, "\r[rank %d] %s %llu/%llu bytes      ", run.rank,
                       ev.progress().c_str(), (unsigned long long)ev.bytes_done(),
                       (unsigned long long)ev.bytes_total());
        }
      });
    });
  }
  for (auto& t : threads) t.join();
  if (show_progress) std::fprintf(stderr, "\n");
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Every failed rank's error (each may name a different cause or peer);
  // the first is the command's.
  auto RankError = [](const RankRun& run) {
    return absl::Status(run.report.status().code(),
                        absl::StrCat("rank ", run.rank, ": ", run.report.status().message()));
  };
  const RankRun* first_failed = nullptr;
  for (const RankRun& run : runs) {
    if (run.report.ok()) continue;
    if (first_failed == nullptr) {
      first_failed = &run;
      continue;
    }
    PrintError(RankError(run));
  }
  if (first_failed != nullptr) return RankError(*first_failed);
  // Outputs: rank{r}.safetensors, written only after every rank succeeded.
  std::set<std::string> missing;
  std::set<std::string> unexpected;
  uint64_t delivered = 0, verified = 0;
  std::map<int, uint64_t> read_per_daemon, cache_per_daemon, peers_per_daemon, reads_per_daemon;
  double list_s = 0, plan_s = 0, read_s = 0, copy_s = 0, wait_s = 0;
  nlohmann::json per_rank = nlohmann::json::array();
  for (const RankRun& run : runs) {
    const RankTargets& rt = layout.ranks[run.rank];
    const auto& res = run.report->result;
    std::set<std::string> rank_missing(res.missing_keys().begin(), res.missing_keys().end());
    missing.insert(rank_missing.begin(), rank_missing.end());
    unexpected.insert(res.unexpected_keys().begin(), res.unexpected_keys().end());
    std::vector<TensorToWrite> tw;
    for (size_t t = 0; t < rt.tensors.size(); ++t) {
      const TargetTensor& tt = rt.tensors[t];
      if (rank_missing.count(tt.name)) continue;
      tw.push_back({tt.name, tt.dtype, tt.flat_range ? Shape{tt.num_elements()} : tt.box.shape,
                    run.buffers[t].data()});
    }
    CKPT_RETURN_IF_ERROR(
        WriteSafetensors(JoinPath(out, absl::StrCat("rank", run.rank, ".safetensors")), tw, {})
            .status());
    delivered += res.bytes_delivered();
    verified = std::max<uint64_t>(verified, res.checksums_verified());
    const int d = daemon_of(run.rank);
    read_per_daemon[d] = std::max<uint64_t>(read_per_daemon[d], res.bytes_read());
    reads_per_daemon[d] = std::max<uint64_t>(reads_per_daemon[d], res.reads());
    cache_per_daemon[d] = std::max<uint64_t>(cache_per_daemon[d], res.bytes_from_cache());
    peers_per_daemon[d] = std::max<uint64_t>(peers_per_daemon[d], res.bytes_from_peers());
    list_s = std::max(list_s, res.timings().list_s());
    plan_s = std::max(plan_s, res.timings().plan_s());
    read_s = std::max(read_s, res.timings().read_s());
    copy_s = std::max(copy_s, res.timings().copy_s());
    wait_s = std::max(wait_s, res.timings().wait_s());
    per_rank.push_back({{"rank", run.rank},
                        {"daemon", sockets[d]},
                        {"bytes_delivered", res.bytes_delivered()},
                        {"missing_keys", std::vector<std::string>(rank_missing.begin(), rank_missing.end())},
                        {"total_s", res.timings().total_s()},
                        {"bytes_from_peers", res.bytes_from_peers()},
                        {"bytes_to_peers", res.bytes_to_peers()},
                        {"transport", ckptd::TransportName(run.report->transport)},
                        {"client_s", run.report->client_seconds}});
  }
  // The transport the ranks used ("auto" picks per rank; they agree on one node).
  std::string used_transport = transport;
  if (!runs.empty()) used_transport = ckptd::TransportName(runs[0].report->transport);
  uint64_t bytes_read = 0, bytes_cache = 0, bytes_peers = 0;
  nlohmann::json per_daemon = nlohmann::json::array();
  for (const auto& [d, b] : read_per_daemon) {
    bytes_peers += peers_per_daemon[d];
    per_daemon.push_back({{"daemon", sockets[d]},
                          {"bytes_read", b},
                          {"bytes_from_cache", cache_per_daemon[d]},
                          {"bytes_from_peers", peers_per_daemon[d]}});
  }
  for (const auto& [d, b] : read_per_daemon) bytes_read += b;
  for (const auto& [d, b] : cache_per_daemon) bytes_cache += b;
  uint64_t reads = 0;
  for (const auto& [d, n] : reads_per_daemon) reads += n;
  if (absl::GetFlag(FLAGS_json)) {
    std::cout << nlohmann::json{{"checkpoint", dir},
                                {"job_id", job},
                                {"via", "daemon"},
                                {"transport", used_transport},
                                {"bytes_read", bytes_read},
                                {"bytes_from_cache", bytes_cache},
                                {"bytes_from_peers", bytes_peers},
                                {"daemons", per_daemon},
                                {"bytes_delivered", delivered},
                                {"checksums_verified", verified},
                                {"reads", reads},
                                {"missing_keys", missing},
                                {"unexpected_keys", unexpected},
                                {"timings", {{"list_s", list_s}, {"plan_s", plan_s},
                                             {"read_s", read_s}, {"copy_s", copy_s},
                                             {"wait_s", wait_s}, {"wall_s", wall}}},
                                {"ranks", per_rank}}
                     .dump()
              << "\n";
    return absl::OkStatus();
  }
  std::cout << "loaded " << runs.size() << " ranks of job " << job << " from " << dir
            << " through " << sockets.size() << " daemon(s)\n"
            << "bytes read:      " << bytes_read << " from storage, " << bytes_cache
            << " from the daemon cache, in " << reads << " reads\n"
            << "bytes delivered: " << delivered << "\n"
            << "checksums:       " << verified << " shards verified\n"
            << "missing keys:    " << absl::StrJoin(missing, ", ") << "\n"
            << "unexpected keys: " << absl::StrJoin(unexpected, ", ") << "\n"
            << "timings (s):     list " << list_s << ", plan " << plan_s << ", read " << read_s
            << ", copy " << copy_s << ", wall " << wall << "\n";
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
  {
    absl::FlagsUsageConfig usage;  // --version: VERSION's version and API level
    usage.version_string = [] {
      return absl::StrCat("ckptctl ", ckptd::kVersion, " (ckptd api level ", ckptd::kApiLevel,
                          ")\n");
    };
    absl::SetFlagsUsageConfig(usage);
  }
  std::vector<std::string> norm = ckpt::NormalizeArgs(argc, argv);
  bool full = false;
  if (ckpt::AsksForHelp(std::vector<std::string>(norm.begin() + 1, norm.end()), &full)) {
    ckpt::PrintHelp(std::cout, ckpt::kUsage, {"client/ckptctl.cc"}, full);
    return 0;
  }
  std::vector<char*> nargv;
  for (auto& s : norm) nargv.push_back(s.data());
  std::vector<char*> args = absl::ParseCommandLine(static_cast<int>(nargv.size()), nargv.data());
  if (args.size() < 2) {
    std::cerr << ckpt::kUsage << "\n";
    return 2;
  }
  const std::string cmd = args[1];
  static const char* const kCommands[] = {"status", "inspect", "shard",   "load",
                                          "merge",  "convert", "prefetch", "evict"};
  if (std::find(std::begin(kCommands), std::end(kCommands), cmd) == std::end(kCommands)) {
    std::cerr << "ckptctl: error: unknown command '" << cmd
              << "'; the commands are: " << absl::StrJoin(kCommands, ", ")
              << " (ckptctl --help)\n";
    return 2;
  }
  // Offline commands read and write s3:// paths themselves (credentials and
  // endpoint from the AWS variables and files, as the AWS CLI finds them).
  bool names_s3 = absl::StartsWith(absl::GetFlag(FLAGS_out), "s3://");
  for (size_t i = 2; i < args.size(); ++i) names_s3 = names_s3 || absl::StartsWith(args[i], "s3://");
  if (names_s3) {
#ifndef CKPTD_NO_S3
    if (auto st = ckpt::s3::RegisterS3Storage(ckpt::s3::S3Settings{}); !st.ok()) {
      ckpt::PrintError(st.status());
      return 1;
    }
#else
    ckpt::PrintError(absl::UnimplementedError(
        "this ckptctl was built without object storage (--define=s3=0)"));
    return 1;
#endif
  }
  absl::Status s;
  if (cmd == "status") {
    if (args.size() != 2) {
      std::cerr << "ckptctl: error: status takes no arguments (see --help)\n";
      return 2;
    }
    s = ckpt::Status();
  } else {
    if (args.size() != 3) {
      std::cerr << "ckptctl: error: " << cmd << " takes exactly one checkpoint path (see --help)\n";
      return 2;
    }
    const std::string path = args[2];
    if (cmd == "inspect") {
      s = ckpt::Inspect(path);
    } else if (cmd == "shard") {
      s = ckpt::Shard(path);
    } else if (cmd == "load") {
      s = ckpt::Load(path);
    } else if (cmd == "merge") {
      s = ckpt::Merge(path);
    } else if (cmd == "convert") {
      s = ckpt::Convert(path);
    } else if (cmd == "prefetch") {
      s = ckpt::Prefetch(path);
    } else if (cmd == "evict") {
      s = ckpt::Evict(path);
    } else {
      std::cerr << "ckptctl: error: unknown command '" << cmd << "' (see --help)\n";
      return 2;
    }
  }
  if (!s.ok()) {
    ckpt::PrintError(s);
    return 1;
  }
  return 0;
}
