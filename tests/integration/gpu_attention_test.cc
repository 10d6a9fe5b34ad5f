// kvpool.v1.GpuAttentionService through a real kvpoold: a daemon whose pool is in host memory
// answers every call UNAVAILABLE (with the reason) and keeps serving; a GPU daemon
// (KVPOOL_TEST_DEVICE=cuda:N) answers NOT_FOUND for channels it does not have. The NCCL channel
// itself is exercised on the two-GPU machine (tests/gpu/gpu_attention_bench.cc).
#include <memory>
#include <string>

#include "grpcpp/grpcpp.h"
#include "kvpool/v1/gpu_attention_service.grpc.pb.h"
#include "tests/integration/integration_util.h"

namespace kvpool::integration {
namespace {

class GpuAttentionServiceTest : public DaemonTest {
 protected:
  std::unique_ptr<v1::GpuAttentionService::Stub> Stub() {
    return v1::GpuAttentionService::NewStub(
        grpc::CreateChannel(daemon().target(), grpc::InsecureChannelCredentials()));
  }
};

TEST_F(GpuAttentionServiceTest, EveryCallIsUnavailableOffTheGpu) {
  if (TestingOnGpu()) GTEST_SKIP() << "the daemon runs on a GPU";
  auto stub = Stub();
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::OpenAttentionChannelRequest req;
    req.set_nccl_unique_id(std::string(128, '\x01'));
    req.set_timeout_ms(1000);
    auto reader = stub->OpenAttentionChannel(&ctx, req);
    v1::OpenAttentionChannelResponse resp;
    EXPECT_FALSE(reader->Read(&resp));  // no channel id: the stream ends at once
    const grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
    EXPECT_NE(s.error_message().find("--device=cuda"), std::string::npos) << s.error_message();
  }
  {
    grpc::ClientContext ctx;
    v1::SetAttentionPlanRequest req;
    req.set_channel_id(1);
    req.set_model_id("m");
    req.add_sequence_ids("s");
    v1::SetAttentionPlanResponse resp;
    EXPECT_EQ(stub->SetAttentionPlan(&ctx, req, &resp).error_code(), grpc::StatusCode::UNAVAILABLE);
  }
  {
    grpc::ClientContext ctx;
    v1::DropAttentionPlanRequest req;
    req.set_channel_id(1);
    req.set_plan_id(1);
    v1::DropAttentionPlanResponse resp;
    EXPECT_EQ(stub->DropAttentionPlan(&ctx, req, &resp).error_code(),
              grpc::StatusCode::UNAVAILABLE);
  }
  {
    grpc::ClientContext ctx;
    v1::CloseAttentionChannelRequest req;
    req.set_channel_id(1);
    v1::CloseAttentionChannelResponse resp;
    EXPECT_EQ(stub->CloseAttentionChannel(&ctx, req, &resp).error_code(),
              grpc::StatusCode::UNAVAILABLE);
  }
  // The daemon serves on.
  EXPECT_TRUE(client().GetStats().ok());
}

TEST_F(GpuAttentionServiceTest, UnknownChannelsAreNotFoundOnAGpuDaemon) {
  if (!TestingOnGpu()) GTEST_SKIP() << "needs KVPOOL_TEST_DEVICE=cuda:N";
  auto stub = Stub();
  {
    grpc::ClientContext ctx;
    v1::SetAttentionPlanRequest req;
    req.set_channel_id(424242);
    req.set_model_id("m");
    req.add_sequence_ids("s");
    v1::SetAttentionPlanResponse resp;
    EXPECT_EQ(stub->SetAttentionPlan(&ctx, req, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext ctx;
    v1::CloseAttentionChannelRequest req;
    req.set_channel_id(424242);
    v1::CloseAttentionChannelResponse resp;
    EXPECT_EQ(stub->CloseAttentionChannel(&ctx, req, &resp).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  {  // a malformed id: INVALID_ARGUMENT from the join, and no channel is left behind
    grpc::ClientContext ctx;
    v1::OpenAttentionChannelRequest req;
    req.set_nccl_unique_id("short");
    auto reader = stub->OpenAttentionChannel(&ctx, req);
    v1::OpenAttentionChannelResponse resp;
    EXPECT_FALSE(reader->Read(&resp));
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
}

}  // namespace
}  // namespace kvpool::integration
