// AOA through the real daemon: LoadRequest.aoa_config (C++ client
// LoadSpec::aoa). An HF-style checkpoint of separate q/k/v ([out, in]) is
// loaded into a fused, transposed qkv sharded over 4 ranks (4 client threads,
// one job); values exact, q/k/v bytes read once for the job. Ranks that
// disagree on the config, and a bad config, fail with INVALID_ARGUMENT
// naming the problem.
#include <cstring>
#include <numeric>
#include <thread>
#include <vector>

#include "client/ckptd_client.h"
#include "core/base/box.h"
#include "core/base/dtype.h"
#include "core/format/safetensors.h"
#include "core/write/writer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/fixtures.h"
#include "tests/testing/temp_dir.h"

namespace ckpt {
namespace {

using ::testing::HasSubstr;
using testing::DaemonProcess;

constexpr int64_t kH = 8, kG = 2, kD = 16, kIn = 64;

// q[o][i] = base + o * kIn + i.
std::vector<float> Matrix(int64_t rows, float base) {
  std::vector<float> m(rows * kIn);
  std::iota(m.begin(), m.end(), base);
  return m;
}

class AoaDaemon : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = tmp_.path();
    ASSERT_TRUE(MakeDirs(root_ + "/hf").ok());
    q_ = Matrix(kH * kD, 0);
    k_ = Matrix(kG * kD, 1e5);
    v_ = Matrix(kG * kD, 2e5);
    std::vector<TensorToWrite> tw = {
        {"q_proj", DType::kF32, {kH * kD, kIn}, q_.data()},
        {"k_proj", DType::kF32, {kG * kD, kIn}, k_.data()},
        {"v_proj", DType::kF32, {kG * kD, kIn}, v_.data()},
    };
    ASSERT_TRUE(WriteSafetensors(root_ + "/hf/model.safetensors", tw, {}).ok());
  }

  // qkv[i][c] of the fused [in, (H + 2G) * d] tensor.
  float Fused(int64_t i, int64_t c) const {
    const int64_t block = (kH / kG + 2) * kD, g = c / block, w = c % block;
    const int64_t qh = kH / kG * kD;
    if (w < qh) return q_[(g * qh + w) * kIn + i];
    if (w < qh + kD) return k_[(g * kD + w - qh) * kIn + i];
    return v_[(g * kD + w - qh - kD) * kIn + i];
  }

  // Runs one load job of 4 ranks; rank r owns columns slab r of qkv.
  std::vector<absl::StatusOr<ckptd::LoadReport>> Run(const std::string& job,
                                                      const std::vector<std::string>& aoa,
                                                      std::vector<std::vector<float>>* out) {
    const int64_t cols = (kH + 2 * kG) * kD, per = cols / 4;
    out->assign(4, std::vector<float>(kIn * per, -1));
    std::vector<absl::StatusOr<ckptd::LoadReport>> res(4, absl::UnknownError(""));
    std::vector<std::thread> threads;
    for (int r = 0; r < 4; ++r) {
      threads.emplace_back([&, r] {
        ckptd::LoadSpec spec;
        spec.job_id = job;
        spec.rank = r;
        spec.world_size = 4;
        spec.path = root_ + "/hf";
        spec.aoa = aoa[r];
        spec.barrier_timeout = absl::Seconds(20);
        spec.tensors.push_back({"layers.0.qkv", DType::kF32, {kIn, cols},
                                Box{{0, r * per}, {kIn, per}}, std::nullopt, (*out)[r].data(), 0});
        ckptd::Client::Options o;
        o.socket = daemon_->socket();
        auto c = ckptd::Client::Connect(o);
        res[r] = c.ok() ? (*c)->Load(spec) : absl::StatusOr<ckptd::LoadReport>(c.status());
      });
    }
    for (auto& t : threads) t.join();
    return res;
  }

  testing::TempDir tmp_;
  std::string root_;
  std::vector<float> q_, k_, v_;
  std::unique_ptr<DaemonProcess> daemon_;
};

TEST_F(AoaDaemon, FusedQkvOverFourRanksExactAndReadOnce) {
  daemon_ = std::make_unique<DaemonProcess>(root_);
  ASSERT_TRUE(daemon_->Ready()) << Slurp(daemon_->log());
  const std::string aoa =
      "# HF q/k/v -> fused qkv, Paddle layout\n"
      "q_proj^T, k_proj^T, v_proj^T -> layers.0.qkv, fused_qkv, num_heads=8, "
      "num_key_value_groups=2\n";
  std::vector<std::vector<float>> out;
  auto res = Run("aoa1", {aoa, aoa, aoa, aoa}, &out);
  const int64_t per = (kH + 2 * kG) * kD / 4;
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(res[r].ok()) << "rank " << r << ": " << res[r].status();
    const auto& lr = res[r]->result;
    EXPECT_EQ(lr.missing_keys_size(), 0);
    EXPECT_EQ(lr.unexpected_keys_size(), 0);
    EXPECT_EQ(lr.bytes_delivered(), static_cast<uint64_t>(kIn * per * 4));
    // q, k and v read once for the whole job.
    EXPECT_EQ(lr.bytes_read() + lr.bytes_from_cache(),
              static_cast<uint64_t>((kH + 2 * kG) * kD * kIn * 4));
    for (int64_t i = 0; i < kIn; ++i) {
      for (int64_t c = 0; c < per; ++c) {
        ASSERT_EQ(out[r][i * per + c], Fused(i, r * per + c)) << "rank " << r << " at " << i << "," << c;
      }
    }
  }
}

TEST_F(AoaDaemon, BadOrDisagreeingConfigsAreRefused) {
  daemon_ = std::make_unique<DaemonProcess>(root_);
  ASSERT_TRUE(daemon_->Ready()) << Slurp(daemon_->log());
  const std::string good = "q_proj^T, k_proj^T, v_proj^T -> layers.0.qkv, fused_qkv, num_heads=8, num_key_value_groups=2";
  std::vector<std::vector<float>> out;
  auto res = Run("aoa2", {good, good, good, "q_proj -> layers.0.qkv"}, &out);
  for (int r = 0; r < 4; ++r) {
    ASSERT_FALSE(res[r].ok()) << r;
    EXPECT_EQ(res[r].status().code(), absl::StatusCode::kInvalidArgument) << res[r].status();
    EXPECT_THAT(std::string(res[r].status().message()), HasSubstr("send different aoa_config"));
  }
  const std::string bad = "q_proj, k_proj -> layers.0.qkv";
  res = Run("aoa3", {bad, bad, bad, bad}, &out);
  for (int r = 0; r < 4; ++r) {
    ASSERT_FALSE(res[r].ok()) << r;
    EXPECT_EQ(res[r].status().code(), absl::StatusCode::kInvalidArgument) << res[r].status();
    EXPECT_THAT(std::string(res[r].status().message()),
                HasSubstr("aoa_config:1: concatenating several sources needs axis=N"));
  }
}

}  // namespace
}  // namespace ckpt
