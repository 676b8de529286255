// Reads a load leaves to its clients (file views): a rank whose client copies
// cached bytes itself from views of the data cache (process_memory with views)
// and also reads files (ProcessMemoryDestination.file_views) is given, for a
// planned read the cache does not hold, the checkpoint file's descriptor and
// the runs it needs, and reads them with pread straight into its tensors:
// one copy of every byte (page cache -> tensor) instead of two (page cache ->
// cache block -> tensor), made in the ranks' processes in parallel. The
// daemon reads none of those bytes during the job; its cache filler reads
// them afterwards (CachingSource::Deferred), so the next load is warm.
//
// A read qualifies only where the daemon has nothing to do with its bytes:
// no stored checksum to verify (or every rank asked skip_verify), every copy
// from it a plain byte copy (no cast, no transposition) into a rank that
// reads files, no byte of it needed by two ranks (a replica is read once, by
// the daemon), and room in every such rank's view limits. The others run
// through the executor as before. Single-node jobs only.
#ifndef CKPTD_SERVER_LOAD_FILE_VIEWS_H_
#define CKPTD_SERVER_LOAD_FILE_VIEWS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "core/cache/cache.h"
#include "core/plan/planner.h"
#include "server/delivery/destination.h"

namespace ckptd {

struct ClientFileReads {
  ckpt::LoadPlan rest;               // the reads (and copies) the daemon still makes
  std::vector<uint64_t> rank_bytes;  // per plan rank: bytes its client reads from files
  uint64_t reads = 0;                // planned reads left to the clients
  uint64_t read_bytes = 0;           // their length
  uint64_t bytes = 0;                // bytes the clients read, all ranks together
};

// Leaves the qualifying reads of `plan` to the clients (recorded in their
// destinations' views); nullopt when none qualifies (run `plan` as it is).
// `ranks[i]` is plan rank i's destination, `parts[i]` its delivery (the
// client's target addresses), `skip[i]` whether it takes no bytes (a strict
// rank that failed alone). Errors are a read's (a file changed since the plan).
absl::StatusOr<std::optional<ClientFileReads>> LeaveReadsToClients(
    const ckpt::LoadPlan& plan, ckpt::CachingSource& storage,
    const std::vector<Destination*>& ranks, const std::vector<RankDelivery>& parts,
    const std::vector<bool>& skip, bool verify);

}  // namespace ckptd

#endif  // CKPTD_SERVER_LOAD_FILE_VIEWS_H_
