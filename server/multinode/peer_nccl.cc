#include "server/multinode/peer_nccl.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"

namespace ckptd {

std::vector<NcclTransfers::Transfer> NcclTransfers::Schedule(
    int me, const std::vector<int>& reader, const std::vector<std::vector<int>>& needed_by,
    const std::vector<uint64_t>& length) {
  std::vector<Transfer> out;
  for (size_t g = 0; g < reader.size(); ++g) {
    if (reader[g] < 0) continue;
    std::vector<int> to = needed_by[g];
    std::sort(to.begin(), to.end());
    to.erase(std::unique(to.begin(), to.end()), to.end());
    for (int n : to) {
      if (n == reader[g]) continue;
      if (reader[g] == me) out.push_back({static_cast<uint32_t>(g), n, true, length[g]});
      if (n == me) out.push_back({static_cast<uint32_t>(g), reader[g], false, length[g]});
    }
  }
  return out;
}

gpu::PeerLinkSpec NcclTransfers::WithCancel(gpu::PeerLinkSpec spec,
                                            std::shared_ptr<std::atomic<bool>> cancel) {
  spec.cancelled = [cancel] { return cancel->load(); };
  return spec;
}

NcclTransfers::NcclTransfers(gpu::GpuRuntime* gpu, gpu::PeerLinkSpec spec,
                             std::vector<Transfer> transfers, ServedFn served,
                             uint64_t receive_budget)
    : gpu_(gpu), spec_(WithCancel(std::move(spec), cancel_)), transfers_(std::move(transfers)),
      served_(std::move(served)), budget_(receive_budget) {
  for (const Transfer& t : transfers_) {
    if (!t.send) receives_[t.read] = t.length;
  }
}

NcclTransfers::~NcclTransfers() {
  bool done;
  {
    absl::MutexLock lock(&mu_);
    done = done_;
  }
  if (!done) Abort();  // a finished communicator is finalized instead
  if (thread_.joinable()) thread_.join();
}

void NcclTransfers::Start() {
  thread_ = std::thread([this] { Run(); });
}

void NcclTransfers::Run() {
  auto fail = [&](const absl::Status& s) {
    spdlog::warn("NCCL peer transport: {}; the remaining reads go over gRPC", s.ToString());
    absl::MutexLock lock(&mu_);
    failed_ = true;
    status_ = s;
  };
  auto links = gpu_->ConnectPeerLinks(spec_);
  if (!links.ok()) {
    connect_failed_ = true;
    return fail(links.status());
  }
  gpu::PeerLinks* l = links->get();
  {
    absl::MutexLock lock(&mu_);
    links_ = std::move(*links);
    if (stop_) {
      failed_ = true;
      return;
    }
  }
  spdlog::info("NCCL peer transport: node {} of {} connected, {} transfers", spec_.rank,
               spec_.nranks, transfers_.size());
  for (const Transfer& t : transfers_) {
    const absl::Time deadline = absl::Now() + spec_.timeout;
    absl::Status s;
    if (t.send) {
      auto bytes = served_(t.read, deadline);
      if (!bytes.ok()) return fail(bytes.status());
      s = l->Send(t.peer, bytes->view.data, t.length);
      if (s.ok()) {
        s = l->Send(t.peer, reinterpret_cast<const uint8_t*>(&bytes->xxh3), sizeof(uint64_t));
      }
      if (s.ok()) sent_ += t.length;
    } else {
      {
        absl::MutexLock lock(&mu_);
        auto room = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stop_ || buffered_ == 0 || buffered_ + t.length <= budget_;
        };
        mu_.AwaitWithDeadline(absl::Condition(&room), deadline);
        if (stop_) {
          failed_ = true;
          return;
        }
        if (!room()) {
          failed_ = true;
          status_ = absl::DeadlineExceededError(
              "NCCL receive budget stayed full (the executor took no read)");
          return;
        }
      }
      std::shared_ptr<uint8_t> buf = RecvBuffer(t.length);
      uint64_t xxh3 = 0;
      s = l->Recv(t.peer, buf.get(), t.length);
      if (s.ok()) s = l->Recv(t.peer, reinterpret_cast<uint8_t*>(&xxh3), sizeof(xxh3));
      if (s.ok()) {
        received_ += t.length;
        absl::MutexLock lock(&mu_);
        ready_[t.read] = Arrived{std::move(buf), t.length, xxh3};
        buffered_ += t.length;
      }
    }
    if (!s.ok()) return fail(absl::Status(s.code(), absl::StrCat("read ", t.read, ": ", s.message())));
  }
  absl::MutexLock lock(&mu_);
  done_ = true;
}

std::shared_ptr<uint8_t> NcclTransfers::RecvBuffer(uint64_t n) {
  const uint64_t size = std::max<uint64_t>(n, 1);
  if (ckpt::HostAllocator* a = gpu_->host_allocator()) {
    if (uint8_t* p = a->Allocate(size)) {
      return std::shared_ptr<uint8_t>(p, [a, size](uint8_t* q) { a->Free(q, size); });
    }
  }
  return std::shared_ptr<uint8_t>(new uint8_t[size], std::default_delete<uint8_t[]>());
}

std::optional<NcclTransfers::Bytes> NcclTransfers::Take(uint32_t g, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto arrived = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return failed_ || stop_ || ready_.count(g) > 0;
  };
  mu_.AwaitWithDeadline(absl::Condition(&arrived), deadline);
  auto it = ready_.find(g);
  if (it == ready_.end()) return std::nullopt;
  std::shared_ptr<uint8_t> buf = std::move(it->second.bytes);
  const uint64_t xxh3 = it->second.xxh3;
  buffered_ -= it->second.length;
  ready_.erase(it);
  const uint8_t* data = buf.get();
  return Bytes{ckpt::RangeView{data, std::move(buf), false}, xxh3};
}

absl::Status NcclTransfers::Finish(absl::Time deadline) {
  absl::Status s;
  {
    absl::MutexLock lock(&mu_);
    auto over = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_ || failed_; };
    mu_.AwaitWithDeadline(absl::Condition(&over), deadline);
    if (!done_ && !failed_) {
      s = absl::DeadlineExceededError("NCCL transfers did not finish in time");
    } else if (failed_) {
      s = status_;
    }
  }
  if (!s.ok()) Abort();
  if (thread_.joinable()) thread_.join();
  return s;
}

void NcclTransfers::Abort() {
  cancel_->store(true);  // seen by the links' waits, even while connecting
  absl::MutexLock lock(&mu_);
  stop_ = true;
}

bool NcclWanted(gpu::GpuRuntime& gpu) {
  const char* t = std::getenv("CKPTD_PEER_TRANSPORT");
  if (t != nullptr && std::string(t) == "grpc") return false;
  return gpu.nccl_available();
}

std::unique_ptr<NcclTransfers> StartNcclTransfers(gpu::GpuRuntime* gpu,
                                                  const peer::v1::PlanPart& part,
                                                  const std::string& me, int device,
                                                  absl::Duration timeout,
                                                  absl::Duration connect_timeout,
                                                  NcclTransfers::ServedFn served) {
  if (part.nccl_id().empty()) return nullptr;
  std::map<std::string, int> index;
  for (int n = 0; n < part.nodes_size(); ++n) index[part.nodes(n)] = n;
  auto self = index.find(me);
  if (self == index.end()) return nullptr;
  std::vector<int> reader(part.reads_size(), -1);
  std::vector<std::vector<int>> needed_by(part.reads_size());
  std::vector<uint64_t> length(part.reads_size());
  for (int g = 0; g < part.reads_size(); ++g) {
    const peer::v1::ReadMsg& rm = part.reads(g);
    auto r = index.find(rm.reader());
    if (r != index.end()) reader[g] = r->second;
    for (const auto& n : rm.needed_by()) {
      auto it = index.find(n);
      if (it != index.end()) needed_by[g].push_back(it->second);
    }
    length[g] = rm.length();
  }
  auto transfers = NcclTransfers::Schedule(self->second, reader, needed_by, length);
  uint64_t largest = 0;
  for (const auto& t : transfers) largest = std::max(largest, t.length);
  gpu::PeerLinkSpec spec;
  spec.nccl_id = part.nccl_id();
  spec.nranks = part.nodes_size();
  spec.rank = self->second;
  spec.device = device;
  spec.timeout = timeout;
  spec.connect_timeout = connect_timeout;
  // Every node of the communicator must connect, even one without transfers.
  auto t = std::make_unique<NcclTransfers>(gpu, std::move(spec), std::move(transfers),
                                           std::move(served), std::max<uint64_t>(largest, 1ull << 30));
  t->Start();
  return t;
}

}  // namespace ckptd
