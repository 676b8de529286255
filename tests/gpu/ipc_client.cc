// One rank of a cuda_ipc job (a separate process, as a training rank is):
// allocates its tensors in a DeviceArena, loads its slices of the checkpoint
// through the daemon straight into device memory, then loads the same
// slices through shared memory (the host path) and compares every byte.
//
//   ipc_client SOCKET CKPT WORLD RANK JOB [DEVICE]
// Exit 0: byte-exact; 1: mismatch or error; 77: no GPU (skipped).
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstring>

#include "client/ckptd_client.h"
#include "client/cuda/device_export.h"
#include "tests/gpu/gpu_testlib.h"

int main(int argc, char** argv) {
  using namespace ckpt;
  if (argc < 6) {
    std::fprintf(stderr, "usage: ipc_client SOCKET CKPT WORLD RANK JOB [DEVICE]\n");
    return 2;
  }
  const std::string socket = argv[1], path = argv[2], job = argv[5];
  const int world = std::atoi(argv[3]), rank = std::atoi(argv[4]);
  const int device = argc > 6 ? std::atoi(argv[6]) : 0;
  std::string why;
  if (!gputest::HaveGpu(&why)) {
    std::printf("SKIP: %s\n", why.c_str());
    return 77;
  }
  const Layout layout = gputest::LoadLayout(world);  // (not a reference into a temporary)
  const RankTargets& rt = layout.ranks[rank];
  uint64_t total = 0;
  for (const auto& t : rt.tensors) total += (t.num_bytes() + 255) / 256 * 256;
  auto arena = ckptd::DeviceArena::Create(device, total);
  if (!arena.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, arena.status().ToString().c_str());
    return 1;
  }
  ckptd::LoadSpec dev_spec, host_spec;
  std::vector<std::vector<uint8_t>> host(rt.tensors.size());
  for (size_t i = 0; i < rt.tensors.size(); ++i) {
    const TargetTensor& t = rt.tensors[i];
    ckptd::TensorSpec ts{t.name, t.dtype, t.global_shape, t.box, t.flat_range};
    ts.device_buffer = (*arena)->Allocate(t.num_bytes());
    dev_spec.tensors.push_back(ts);
    host[i].resize(t.num_bytes());
    ts.device_buffer = nullptr;
    ts.buffer = host[i].data();
    host_spec.tensors.push_back(ts);
  }
  // Garbage first, so a slice the daemon never wrote cannot pass.
  cudaMemset((*arena)->data(), 0xEE, total);
  for (ckptd::LoadSpec* s : {&dev_spec, &host_spec}) {
    s->rank = rank;
    s->world_size = world;
    s->path = path;
    s->barrier_timeout = absl::Seconds(60);
  }
  dev_spec.job_id = job + "-cuda-ipc";
  dev_spec.transport = ckptd::Transport::kCudaIpc;
  host_spec.job_id = job + "-shm";
  ckptd::Client::Options o;
  o.socket = socket;
  auto client = ckptd::Client::Connect(o);
  if (!client.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, client.status().ToString().c_str());
    return 1;
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto rep = (*client)->Load(dev_spec);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!rep.ok()) {
    std::fprintf(stderr, "rank %d: cuda_ipc load: %s\n", rank, rep.status().ToString().c_str());
    return 1;
  }
  // The daemon closed this job's IPC mappings before it said done (this
  // process may free the memory now): no other job runs on this daemon.
  if (auto st = (*client)->Status(); !st.ok() ||
                                      st->gpu().find("open IPC handles 0") == std::string::npos) {
    std::fprintf(stderr, "rank %d: IPC handles still open after the load returned: %s\n", rank,
                 st.ok() ? st->gpu().c_str() : st.status().ToString().c_str());
    return 1;
  }
  auto hrep = (*client)->Load(host_spec);
  if (!hrep.ok()) {
    std::fprintf(stderr, "rank %d: shm load: %s\n", rank, hrep.status().ToString().c_str());
    return 1;
  }
  int bad = 0;
  for (size_t i = 0; i < rt.tensors.size(); ++i) {
    std::vector<uint8_t> got(host[i].size());
    cudaMemcpy(got.data(), dev_spec.tensors[i].device_buffer, got.size(), cudaMemcpyDeviceToHost);
    if (got != host[i]) {
      size_t k = 0;
      while (k < got.size() && got[k] == host[i][k]) ++k;
      std::fprintf(stderr, "rank %d: tensor %s differs at byte %zu of %zu\n", rank,
                   rt.tensors[i].name.c_str(), k, got.size());
      ++bad;
    }
  }
  if (!rep->result.missing_keys().empty()) {
    std::fprintf(stderr, "rank %d: missing keys\n", rank);
    ++bad;
  }
  // A device save of the same tensors (the daemon copies them device ->
  // host itself), then loaded back through shared memory: byte-exact.
  {
    ckptd::SaveSpec save;
    save.job_id = job + "-device-save";
    save.rank = rank;
    save.world_size = world;
    save.path = path.substr(0, path.rfind('/')) + "/resaved-" + job;
    save.unique_id = 1;
    save.barrier_timeout = absl::Seconds(60);
    for (const auto& t : dev_spec.tensors) {
      ckptd::TensorSpec ts = t;
      ts.buffer = nullptr;
      save.tensors.push_back(ts);
    }
    auto saved = (*client)->Save(save);
    if (!saved.ok()) {
      std::fprintf(stderr, "rank %d: device save: %s\n", rank, saved.status().ToString().c_str());
      return 1;
    }
    ckptd::LoadSpec back = host_spec;
    back.job_id = job + "-device-save-back";
    back.path = save.path;
    std::vector<std::vector<uint8_t>> again(rt.tensors.size());
    for (size_t i = 0; i < rt.tensors.size(); ++i) {
      again[i].assign(host[i].size(), 0xEE);
      back.tensors[i].buffer = again[i].data();
    }
    auto brep = (*client)->Load(back);
    if (!brep.ok()) {
      std::fprintf(stderr, "rank %d: load of the device save: %s\n", rank,
                   brep.status().ToString().c_str());
      return 1;
    }
    for (size_t i = 0; i < rt.tensors.size(); ++i) {
      if (again[i] != host[i]) {
        std::fprintf(stderr, "rank %d: tensor %s of the device save differs\n", rank,
                     rt.tensors[i].name.c_str());
        ++bad;
      }
    }
  }
  std::printf("rank %d: %zu tensors, %llu bytes into device memory over cuda_ipc in %.3fs, %s\n",
              rank, rt.tensors.size(),
              static_cast<unsigned long long>(rep->result.bytes_delivered()), secs,
              bad ? "MISMATCH" : "byte-exact vs the shm load");
  return bad ? 1 : 0;
}
