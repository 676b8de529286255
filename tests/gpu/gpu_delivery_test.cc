// GPU test (built with --config=cuda; skips without a device): the daemon's
// CUDA delivery, in process. A bf16/f32 checkpoint saved with 4 ranks is
// resharded into device buffers of 3 ranks (column splits: 2-D copies;
// f32 -> bf16 casts: staged; flat ranges) and must match, byte for byte, the
// offline host load of the same layout. Also: the data cache's memory is
// page-locked, and host and device ranks mix in one job.
#include <cuda_runtime_api.h>

#include <cstring>
#include <map>

#include <gtest/gtest.h>

#include "core/cache/cache.h"
#include "core/format/checkpoint.h"
#include "core/exec/executor.h"
#include "server/cuda/gpu.h"
#include "tests/gpu/gpu_testlib.h"
#include "tests/testing/temp_dir.h"

namespace ckpt::gputest {
namespace {

struct DeviceRank {
  void* base = nullptr;
  uint64_t size = 0;
  std::vector<uint64_t> offsets;
};

DeviceRank AllocRank(const RankPlan& rp) {
  DeviceRank d;
  for (const auto& t : rp.targets) {
    d.offsets.push_back(d.size);
    d.size = (d.size + t.num_bytes() + 255) / 256 * 256;
  }
  EXPECT_EQ(cudaMalloc(&d.base, std::max<uint64_t>(d.size, 256)), cudaSuccess);
  EXPECT_EQ(cudaMemset(d.base, 0xEE, std::max<uint64_t>(d.size, 256)), cudaSuccess);
  return d;
}

// Runs `plan` with ranks in `on_device` on the GPU (each rank's tensors in
// one cudaMalloc, after garbage), the others in host buffers, from
// `source`; checks every byte against `ref` (the offline host load).
void CheckDelivery(ckptd::gpu::GpuRuntime& gpu, const LoadPlan& plan, const OfflineLoadResult& ref,
                   RangeSource& source, const std::vector<bool>& on_device, int threads = 3) {
  std::vector<DeviceRank> dev(plan.ranks.size());
  std::vector<std::vector<std::vector<uint8_t>>> host(plan.ranks.size());
  std::vector<ckptd::gpu::RankDestination> dests(plan.ranks.size());
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    const RankPlan& rp = plan.ranks[r];
    if (on_device[r]) {
      dev[r] = AllocRank(rp);
      dests[r].device = ckptd::gpu::WrapDevicePointers(
          {{0, static_cast<uint8_t*>(dev[r].base), dev[r].size}});
      for (uint64_t off : dev[r].offsets) dests[r].device_targets.push_back({0, off});
    } else {
      for (const auto& t : rp.targets) {
        host[r].emplace_back(t.num_bytes());
        dests[r].host.push_back(host[r].back().data());
      }
    }
  }
  auto delivery = gpu.MakeDelivery(std::move(dests));
  ASSERT_TRUE(delivery.ok()) << delivery.status();
  ExecuteOptions eo;
  eo.threads = threads;
  auto stats = ExecutePlan(plan, source, **delivery, eo);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->bytes_delivered, plan.bytes_to_deliver());
  delivery->reset();  // waits for the streams
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    const RankPlan& rp = plan.ranks[r];
    for (size_t t = 0; t < rp.targets.size(); ++t) {
      std::vector<uint8_t> got(rp.targets[t].num_bytes());
      if (on_device[r]) {
        ASSERT_EQ(cudaMemcpy(got.data(), static_cast<uint8_t*>(dev[r].base) + dev[r].offsets[t],
                             got.size(), cudaMemcpyDeviceToHost),
                  cudaSuccess);
      } else {
        got = host[r][t];
      }
      const auto& want = ref.buffers[r].tensors[t];
      ASSERT_EQ(got.size(), want.size());
      if (got != want) {
        size_t k = 0;
        while (k < got.size() && got[k] == want[k]) ++k;
        ADD_FAILURE() << "rank " << r << " tensor " << rp.targets[t].name << " ("
                      << DTypeName(rp.targets[t].dtype) << ", " << got.size()
                      << " bytes) differs from the host load at byte " << k;
      }
    }
    if (on_device[r]) cudaFree(dev[r].base);
  }
}

class GpuDelivery : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!HaveGpu(&why)) GTEST_SKIP() << "SKIP: " << why << " [needs: gpu]";
    ckpt_ = tmp_.Sub("ckpt");
    ASSERT_TRUE(MakeCheckpoint(tmp_.Sub("src"), ckpt_).ok());
    layout_ = LoadLayout(3);
    auto ref = LoadOffline(ckpt_, layout_, {});
    ASSERT_TRUE(ref.ok()) << ref.status();
    ref_ = std::move(*ref);
    auto c = OpenCheckpoint(ckpt_);
    ASSERT_TRUE(c.ok()) << c.status();
    auto plan = PlanLoad(c->metadata, layout_.ranks);
    ASSERT_TRUE(plan.ok()) << plan.status();
    plan_ = std::move(*plan);
    gpu_ = ckptd::gpu::CreateGpuRuntime({});
    ASSERT_GT(gpu_->device_count(), 0);
  }

  void RunAndCheck(RangeSource& source, const std::vector<bool>& on_device) {
    CheckDelivery(*gpu_, plan_, ref_, source, on_device);
  }

  testing::TempDir tmp_;
  std::string ckpt_;
  Layout layout_;
  OfflineLoadResult ref_;
  LoadPlan plan_;
  std::unique_ptr<ckptd::gpu::GpuRuntime> gpu_;
};

TEST_F(GpuDelivery, ReshardIntoDeviceBuffersIsByteExact) {
  DirectorySource source(ckpt_);  // pageable scratch memory
  RunAndCheck(source, {true, true, true});
}

TEST_F(GpuDelivery, FromPinnedCacheColdAndWarm) {
  HostCache cache(1ull << 30, gpu_->host_allocator());
  ASSERT_NE(gpu_->host_allocator(), nullptr);
  auto c = OpenCheckpoint(ckpt_);
  ASSERT_TRUE(c.ok());
  std::map<std::string, FileStamp> stamps;
  for (const auto& f : c->data_files) stamps[f] = *StatFile(ckpt_ + "/" + f);
  CachingSource cold(ckpt_, &cache, stamps);
  RunAndCheck(cold, {true, true, true});
  EXPECT_GT(gpu_->pinned_bytes(), 0u);
  CachingSource warm(ckpt_, &cache, stamps);
  RunAndCheck(warm, {true, true, true});
  EXPECT_GT(cache.stats().hits, 0u);
}

TEST_F(GpuDelivery, HostAndDeviceRanksInOneJob) {
  DirectorySource source(ckpt_);
  RunAndCheck(source, {false, true, false});
}

TEST_F(GpuDelivery, CacheMemoryIsPageLocked) {
  ckpt::HostAllocator* a = gpu_->host_allocator();
  ASSERT_NE(a, nullptr);
  uint8_t* p = a->Allocate(8 << 20);
  ASSERT_NE(p, nullptr);
  cudaPointerAttributes attr;
  ASSERT_EQ(cudaPointerGetAttributes(&attr, p + 4096), cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeHost) << "cache chunk is not registered with CUDA";
  a->Free(p, 8 << 20);
}

// NCCL is loaded with dlopen at first use (no libnccl link dependency):
// found on this machine (system, LD_LIBRARY_PATH or pip's nvidia-nccl), it
// makes a unique id. A GPU machine without NCCL fails this test, by design:
// set CKPTD_NCCL_LIBRARY to run it.
TEST_F(GpuDelivery, NcclLoadsAtFirstUseAndMakesAnId) {
  ASSERT_TRUE(gpu_->nccl_available()) << "NCCL not found (see the daemon's log line)";
  auto id = gpu_->NewNcclId();
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(id->size(), 128u);
}

// --- shapes that take every copy path (issue 18) ----------------------------
//
// Each case writes its own model (saved with one split), loads it with
// another into device memory and compares every byte with the offline host
// load of the same layout.

Layout Splits(const std::vector<ModelTensor>& model, int world, size_t dim,
              const std::map<std::string, DType>& cast = {}) {
  Layout l;
  l.world_size = world;
  for (int r = 0; r < world; ++r) {
    RankTargets rt{r, {}};
    for (const auto& m : model) {
      auto it = cast.find(m.name);
      rt.tensors.push_back(Target(m, it == cast.end() ? m.dtype : it->second,
                                  Split(m.shape, dim, world, r)));
    }
    l.ranks.push_back(rt);
  }
  return l;
}

class GpuCopyPaths : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!HaveGpu(&why)) GTEST_SKIP() << "SKIP: " << why << " [needs: gpu]";
  }

  void Run(const std::vector<ModelTensor>& model, const Layout& save, const Layout& load,
           ckptd::gpu::GpuOptions go = {}, int threads = 3) {
    const std::string src = tmp_.Sub("src"), out = tmp_.Sub("ckpt");
    ASSERT_TRUE(MakeCheckpointOf(model, save, src, out).ok());
    auto ref = LoadOffline(out, load, {});
    ASSERT_TRUE(ref.ok()) << ref.status();
    auto c = OpenCheckpoint(out);
    ASSERT_TRUE(c.ok()) << c.status();
    auto plan = PlanLoad(c->metadata, load.ranks);
    ASSERT_TRUE(plan.ok()) << plan.status();
    auto gpu = ckptd::gpu::CreateGpuRuntime(go);
    ASSERT_GT(gpu->device_count(), 0);
    DirectorySource source(out);
    CheckDelivery(*gpu, *plan, *ref, source, std::vector<bool>(plan->ranks.size(), true), threads);
  }

  testing::TempDir tmp_;
};

// Saved split on dim 1, loaded split on dim 0: every source row lands in a
// strided destination (cudaMemcpy2DAsync with a destination pitch).
TEST_F(GpuCopyPaths, SavedOnDim1LoadedOnDim0IntoStridedDestinations) {
  const std::vector<ModelTensor> model = {{"w", DType::kF32, {512, 4096}},
                                          {"wb", DType::kBF16, {256, 2048}}};
  Run(model, Splits(model, 4, 1), Splits(model, 2, 0));
}

// A cast whose converted bytes (48 MiB) exceed one lane's 32 MiB of
// staging: the staging is waited for and reused mid-block.
TEST_F(GpuCopyPaths, CastLargerThanTheStaging) {
  const std::vector<ModelTensor> model = {{"big", DType::kF32, {6144, 4096}}};
  Run(model, Splits(model, 2, 0), Splits(model, 1, 0, {{"big", DType::kBF16}}));
}

// Narrow rows (16 B) gathered on the host into contiguous destinations, 64
// MiB through one lane (threads = 1): the gather path reuses the staging.
TEST_F(GpuCopyPaths, GatheredNarrowRowsLargerThanTheStaging) {
  const std::vector<ModelTensor> model = {{"narrow", DType::kF32, {1 << 20, 16}}};
  Run(model, Splits(model, 2, 1), Splits(model, 4, 1), {}, /*threads=*/1);
}

// Narrow rows (32 B) into a strided destination (pitch 128 B): 2-D copies
// of tiny rows, no gather.
TEST_F(GpuCopyPaths, NarrowRowsIntoStridedDestinations) {
  const std::vector<ModelTensor> model = {{"n", DType::kBF16, {65536, 64}}};
  Run(model, Splits(model, 4, 1), Splits(model, 1, 0));
}

// Destination rows wider than the pitch limit (set to 4 KiB here; an H200's
// is 2 GiB): direct and staged copies go row by row.
TEST_F(GpuCopyPaths, RowsWiderThanThePitchLimit) {
  const std::vector<ModelTensor> model = {{"w", DType::kF32, {256, 4096}},
                                          {"wc", DType::kF32, {256, 4096}}};
  ckptd::gpu::GpuOptions go;
  go.max_pitch = 4096;
  Run(model, Splits(model, 2, 1), Splits(model, 1, 0, {{"wc", DType::kBF16}}), go);
}

}  // namespace
}  // namespace ckpt::gputest
