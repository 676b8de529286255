// GPU test (built with --config=cuda; skips without a device): the daemon's
// CUDA delivery, in process. A bf16/f32 checkpoint saved with 4 ranks is
// resharded into device buffers of 3 ranks (column splits: 2-D copies;
// f32 -> bf16 casts: staged; flat ranges) and must match, byte for byte, the
// offline host load of the same layout. Also: the data cache's memory is
// page-locked, and host and device ranks mix in one job.
#include <cuda_runtime_api.h>

#include <cstring>

#include <gtest/gtest.h>

#include "core/cache.h"
#include "core/checkpoint.h"
#include "core/executor.h"
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

  // Runs the plan with ranks in `device_ranks` on the GPU, the others in
  // host buffers, from `source`; checks every byte against the reference.
  void RunAndCheck(RangeSource& source, const std::vector<bool>& on_device) {
    std::vector<DeviceRank> dev(plan_.ranks.size());
    std::vector<std::vector<std::vector<uint8_t>>> host(plan_.ranks.size());
    std::vector<ckptd::gpu::RankDestination> dests(plan_.ranks.size());
    for (size_t r = 0; r < plan_.ranks.size(); ++r) {
      const RankPlan& rp = plan_.ranks[r];
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
    auto delivery = gpu_->MakeDelivery(std::move(dests));
    ASSERT_TRUE(delivery.ok()) << delivery.status();
    ExecuteOptions eo;
    eo.threads = 3;
    auto stats = ExecutePlan(plan_, source, **delivery, eo);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->bytes_delivered, plan_.bytes_to_deliver());
    for (size_t r = 0; r < plan_.ranks.size(); ++r) {
      const RankPlan& rp = plan_.ranks[r];
      for (size_t t = 0; t < rp.targets.size(); ++t) {
        std::vector<uint8_t> got(rp.targets[t].num_bytes());
        if (on_device[r]) {
          ASSERT_EQ(cudaMemcpy(got.data(), static_cast<uint8_t*>(dev[r].base) + dev[r].offsets[t],
                               got.size(), cudaMemcpyDeviceToHost),
                    cudaSuccess);
        } else {
          got = host[r][t];
        }
        const auto& want = ref_.buffers[r].tensors[t];
        ASSERT_EQ(got.size(), want.size());
        EXPECT_TRUE(got == want) << "rank " << r << " tensor " << rp.targets[t].name << " ("
                                 << DTypeName(rp.targets[t].dtype) << ") differs from the host load";
      }
      if (on_device[r]) cudaFree(dev[r].base);
    }
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

}  // namespace
}  // namespace ckpt::gputest
