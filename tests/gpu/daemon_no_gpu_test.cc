// The daemon's cuda_ipc destination where no GPU can be used: a real ckptd
// process receives Load requests with device destinations. Bad requests are
// refused with INVALID_ARGUMENT (checked before anything CUDA), and a good
// one with UNIMPLEMENTED "built without CUDA" (default build) or
// FAILED_PRECONDITION "no CUDA device" (--config=cuda on a machine without a
// GPU). Also: Status reports the GPU state, and the C++ client refuses
// Transport::kCudaIpc cleanly when built without CUDA.
#include <filesystem>
#include <fstream>
#include <string>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "client/ckptd_client.h"
#include "client/cuda/device_export.h"
#include "proto/ckpt.grpc.pb.h"
#include "tests/integration/daemon_process.h"
#include "tests/testing/temp_dir.h"

namespace ckpt::testing {
namespace {

class DaemonNoGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = tmp_.path() + "/root";
    std::filesystem::create_directories(root_ + "/ckpt");
    daemon_ = std::make_unique<DaemonProcess>(root_);
    ASSERT_TRUE(daemon_->Ready()) << Slurp(daemon_->log());
    channel_ = grpc::CreateChannel("unix:" + daemon_->socket(), grpc::InsecureChannelCredentials());
    stub_ = ckptd::v1::Ckptd::NewStub(channel_);
    grpc::ClientContext ctx;
    ckptd::v1::StatusRequest req;
    ASSERT_TRUE(stub_->Status(&ctx, req, &status_).ok());
  }

  static std::string Slurp(const std::string& path) {
    std::ifstream f(path);
    return std::string(std::istreambuf_iterator<char>(f), {});
  }

  // One rank, one F32 [4, 8] target into a cuda_ipc buffer.
  ckptd::v1::LoadRequest Request() {
    ckptd::v1::LoadRequest r;
    r.set_job_id("gpu-job");
    r.set_rank(0);
    r.set_world_size(1);
    r.set_path(root_ + "/ckpt");
    r.set_barrier_timeout_ms(2000);
    ckptd::v1::Target* t = r.add_targets();
    t->set_name("w");
    t->set_dtype("F32");
    for (int64_t d : {4, 8}) {
      t->add_global_shape(d);
      t->add_shape(d);
      t->add_offset(0);
    }
    t->set_dest_buffer(0);
    t->set_dest_offset(256);
    ckptd::v1::CudaBuffer* b = r.mutable_cuda_ipc()->add_buffers();
    b->set_ipc_handle(std::string(64, '\x01'));
    b->set_device(0);
    b->set_size(1024);
    return r;
  }

  // How a well-formed cuda_ipc request is refused here: this daemon was
  // built without CUDA, sees no device, or (a GPU) cannot open the fake handle.
  grpc::StatusCode RefusalOfAGoodRequest() const {
    if (status_.gpu() == "built without CUDA") return grpc::StatusCode::UNIMPLEMENTED;
    if (status_.gpu().find("no CUDA device") != std::string::npos) {
      return grpc::StatusCode::FAILED_PRECONDITION;
    }
    return grpc::StatusCode::INVALID_ARGUMENT;
  }

  grpc::Status Load(const ckptd::v1::LoadRequest& r) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    auto reader = stub_->Load(&ctx, r);
    ckptd::v1::LoadEvent ev;
    while (reader->Read(&ev)) {
    }
    return reader->Finish();
  }

  TempDir tmp_;
  std::string root_;
  std::unique_ptr<DaemonProcess> daemon_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<ckptd::v1::Ckptd::Stub> stub_;
  ckptd::v1::StatusResponse status_;
};

TEST_F(DaemonNoGpu, StatusReportsTheGpuState) {
  EXPECT_FALSE(status_.gpu().empty());
  if (!ckptd::ClientBuiltWithCuda()) {
    EXPECT_EQ(status_.gpu(), "built without CUDA");
  }
  EXPECT_EQ(status_.cache_pinned_bytes(), 0u);  // nothing cached yet, nothing pinned
}

TEST_F(DaemonNoGpu, GoodRequestIsRefusedWithoutAGpu) {
  grpc::Status s = Load(Request());
  EXPECT_EQ(s.error_code(), RefusalOfAGoodRequest()) << s.error_message();
  if (status_.gpu() == "built without CUDA") {
    EXPECT_NE(s.error_message().find("built without CUDA"), std::string::npos) << s.error_message();
  }
}

TEST_F(DaemonNoGpu, BadDeviceTargetsAreInvalidArgument) {
  auto expect_invalid = [&](const ckptd::v1::LoadRequest& r, const std::string& words) {
    grpc::Status s = Load(r);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_NE(s.error_message().find(words), std::string::npos) << s.error_message();
  };
  auto r = Request();
  r.mutable_cuda_ipc()->mutable_buffers(0)->set_ipc_handle("short");
  expect_invalid(r, "64");
  r = Request();
  r.mutable_targets(0)->set_dest_buffer(3);
  expect_invalid(r, "dest_buffer 3");
  r = Request();
  r.mutable_targets(0)->set_dest_offset(1000);  // 128 bytes from 1000 > 1024
  expect_invalid(r, "buffer too small");
  r = Request();
  *r.add_targets() = r.targets(0);
  r.mutable_targets(1)->set_name("v");
  r.mutable_targets(1)->set_dest_offset(300);
  expect_invalid(r, "overlap");
  r = Request();
  r.mutable_cuda_ipc()->clear_buffers();
  expect_invalid(r, "no buffers");
  // A host-memory target needs the request's host segment.
  r = Request();
  *r.add_targets() = r.targets(0);
  r.mutable_targets(1)->set_name("step");
  r.mutable_targets(1)->set_dest_host(true);
  expect_invalid(r, "tensor 'step' is marked dest_host but the cuda_ipc destination has no host");
}

// A save whose tensors are in device memory (SaveRequest.cuda_ipc): refused
// where the daemon cannot read them, before the job registers (the client
// then saves through shared memory with the same job id), and no version
// appears.
TEST_F(DaemonNoGpu, DeviceSaveIsRefusedWithoutAGpuAndWritesNothing) {
  const ckptd::v1::LoadRequest l = Request();
  ckptd::v1::SaveRequest r;
  r.set_job_id("gpu-save");
  r.set_rank(0);
  r.set_world_size(1);
  r.set_path(root_ + "/saved");
  r.set_unique_id(1);
  r.set_barrier_timeout_ms(2000);
  *r.mutable_targets() = l.targets();
  *r.mutable_cuda_ipc() = l.cuda_ipc();
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  ckptd::v1::SaveResponse resp;
  grpc::Status s = stub_->Save(&ctx, r, &resp);
  EXPECT_EQ(s.error_code(), RefusalOfAGoodRequest()) << s.error_message();
  EXPECT_NE(s.error_message().find("job 'gpu-save' rank 0"), std::string::npos)
      << s.error_message();
  EXPECT_FALSE(std::filesystem::exists(root_ + "/saved/1.metadata"));
  // The job id is free again: a second refusal, not "job already running".
  grpc::ClientContext ctx2;
  ctx2.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  grpc::Status again = stub_->Save(&ctx2, r, &resp);
  EXPECT_EQ(again.error_code(), s.error_code()) << again.error_message();
}

TEST_F(DaemonNoGpu, ClientWithoutCudaRefusesCudaIpc) {
  if (ckptd::ClientBuiltWithCuda()) GTEST_SKIP() << "client built with CUDA [needs: client built without CUDA]";
  ckptd::Client::Options o;
  o.socket = daemon_->socket();
  auto c = ckptd::Client::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  ckptd::LoadSpec spec;
  spec.job_id = "gpu-client";
  spec.path = root_ + "/ckpt";
  spec.transport = ckptd::Transport::kCudaIpc;
  float dummy[4];
  ckptd::TensorSpec t;
  t.name = "w";
  t.global_shape = {4};
  t.device_buffer = dummy;
  spec.tensors.push_back(t);
  auto r = (*c)->Load(spec);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnimplemented) << r.status();
  // A device save likewise; one mixing device and host tensors is refused
  // before anything is sent.
  ckptd::SaveSpec save;
  save.job_id = "gpu-client-save";
  save.path = root_ + "/resaved";
  save.unique_id = 1;
  save.tensors.push_back(t);
  auto s = (*c)->Save(save);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnimplemented) << s.status();
  ckptd::TensorSpec host = t;
  host.name = "b";
  host.device_buffer = nullptr;
  host.buffer = dummy;
  save.tensors.push_back(host);
  s = (*c)->Save(save);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
  EXPECT_NE(s.status().message().find("1 of 2 tensors have a device_buffer"), std::string::npos)
      << s.status();
  EXPECT_FALSE(std::filesystem::exists(root_ + "/resaved/1.metadata"));
}

}  // namespace
}  // namespace ckpt::testing
