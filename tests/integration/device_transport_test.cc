// The GPU transports (NCCL, CUDA IPC) behind TransportService, through a real kvpoold: a daemon
// whose pool is in host memory hosts neither, so offers of them fall back to what it has, their
// calls answer UNAVAILABLE (with the reason) and nothing changes; a GPU daemon
// (KVPOOL_TEST_DEVICE=cuda:N) refuses malformed offers before joining anything, answers
// NOT_FOUND for sessions it does not have, and rolls a device push back on a bad header or chunk.
// NCCL channels themselves are exercised on the two-GPU machine (tests/gpu/), CUDA IPC pushes
// end to end by integration_cuda_ipc_test.
#include <memory>
#include <string>

#include "grpcpp/grpcpp.h"
#include "kvpool/v1/transport_service.grpc.pb.h"
#include "tests/integration/integration_util.h"

namespace kvpool::integration {
namespace {

class DeviceTransportTest : public DaemonTest {
 protected:
  std::unique_ptr<v1::TransportService::Stub> Stub() {
    return v1::TransportService::NewStub(
        grpc::CreateChannel(daemon().target(), grpc::InsecureChannelCredentials()));
  }

  static v1::TransportOffer NcclOffer(std::string id, v1::NcclChannelUse use) {
    v1::TransportOffer o;
    o.set_kind(v1::TRANSPORT_KIND_NCCL);
    o.mutable_nccl()->set_unique_id(std::move(id));
    o.mutable_nccl()->set_timeout_ms(1000);
    o.mutable_nccl()->set_use(use);
    return o;
  }

  grpc::Status Negotiate(v1::TransportService::Stub& stub, const v1::NegotiateRequest& req,
                         v1::NegotiateResponse* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return stub.Negotiate(&ctx, req, resp);
  }

  // A PushKv stream of `messages`; its status.
  grpc::Status Push(v1::TransportService::Stub& stub,
                    const std::vector<v1::DevicePushRequest>& messages) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::AppendKvResponse resp;
    auto w = stub.PushKv(&ctx, &resp);
    for (const v1::DevicePushRequest& m : messages) {
      if (!w->Write(m)) break;
    }
    w->WritesDone();
    return w->Finish();
  }

  static v1::DevicePushRequest Header(uint64_t session, const std::string& sequence,
                                      v1::DType dtype = v1::DTYPE_BF16) {
    v1::DevicePushRequest r;
    r.mutable_header()->set_session_id(session);
    v1::AppendKvHeader* h = r.mutable_header()->mutable_append();
    h->set_sequence_id(sequence);
    h->set_num_tokens(8);
    h->set_dtype(dtype);
    return r;
  }
};

TEST_F(DeviceTransportTest, EveryCallIsUnavailableOffTheGpu) {
  if (TestingOnGpu()) GTEST_SKIP() << "the daemon runs on a GPU";
  const absl::StatusOr<std::string> before = PoolFingerprint(client());
  ASSERT_TRUE(before.ok()) << before.status();
  auto stub = Stub();
  {  // NCCL and CUDA IPC offers fall through to what the daemon hosts.
    v1::NegotiateRequest req;
    *req.add_offers() = NcclOffer(std::string(128, '\x01'), v1::NCCL_CHANNEL_USE_ATTENTION);
    req.add_offers()->set_kind(v1::TRANSPORT_KIND_CUDA_IPC);
    v1::NegotiateResponse resp;
    const grpc::Status s = Negotiate(*stub, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.kind(), v1::TRANSPORT_KIND_GRPC_INLINE);
  }
  {
    grpc::ClientContext ctx;
    v1::SetAttentionPlanRequest req;
    req.set_session_id(1);
    req.set_model_id("m");
    req.add_sequence_ids("s");
    v1::SetAttentionPlanResponse resp;
    const grpc::Status s = stub->SetAttentionPlan(&ctx, req, &resp);
    // The shared-memory transport takes plans on every backend: an unknown session.
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  }
  {
    grpc::ClientContext ctx;
    v1::DropAttentionPlanRequest req;
    req.set_session_id(1);
    req.set_plan_id(1);
    v1::DropAttentionPlanResponse resp;
    EXPECT_EQ(stub->DropAttentionPlan(&ctx, req, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    const grpc::Status s = Push(*stub, {Header(1, "s")});
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_NE(s.error_message().find("--device=cuda"), std::string::npos) << s.error_message();
  }
  {
    grpc::ClientContext ctx;
    v1::CloseSessionRequest req;
    req.set_session_id(1);
    v1::CloseSessionResponse resp;
    EXPECT_EQ(stub->CloseSession(&ctx, req, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext ctx;
    v1::WatchSessionRequest req;
    req.set_session_id(1);
    auto reader = stub->WatchSession(&ctx, req);
    v1::WatchSessionResponse resp;
    EXPECT_FALSE(reader->Read(&resp));
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::NOT_FOUND);
  }
  // The daemon serves on, unchanged.
  const absl::StatusOr<std::string> after = PoolFingerprint(client());
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(*before, *after);
}

TEST_F(DeviceTransportTest, UnknownSessionsAndBadOffersOnAGpuDaemon) {
  if (!TestingOnGpu()) GTEST_SKIP() << "needs KVPOOL_TEST_DEVICE=cuda:N";
  auto stub = Stub();
  {
    grpc::ClientContext ctx;
    v1::SetAttentionPlanRequest req;
    req.set_session_id(424242);
    req.set_model_id("m");
    req.add_sequence_ids("s");
    v1::SetAttentionPlanResponse resp;
    EXPECT_EQ(stub->SetAttentionPlan(&ctx, req, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext ctx;
    v1::CloseSessionRequest req;
    req.set_session_id(424242);
    v1::CloseSessionResponse resp;
    EXPECT_EQ(stub->CloseSession(&ctx, req, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  EXPECT_EQ(Push(*stub, {Header(424242, "s")}).error_code(), grpc::StatusCode::NOT_FOUND);
  // Malformed NCCL offers: INVALID_ARGUMENT before anything joins, and no session is left.
  for (const v1::TransportOffer& bad :
       {NcclOffer("short", v1::NCCL_CHANNEL_USE_ATTENTION),
        NcclOffer(std::string(128, '\x01'), v1::NCCL_CHANNEL_USE_UNSPECIFIED)}) {
    v1::NegotiateRequest req;
    *req.add_offers() = bad;
    v1::NegotiateResponse resp;
    EXPECT_EQ(Negotiate(*stub, req, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  absl::StatusOr<v1::GetStatsResponse> stats = client().GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->transport().sessions(), 0u);
}

// A CUDA IPC session's pushes are ingests like any other: a bad header or a chunk naming a
// buffer the daemon cannot map fails the push precisely and leaves the pool as it was.
TEST_F(DeviceTransportTest, ACudaIpcPushWithBadInputRollsBack) {
  if (!TestingOnGpu()) GTEST_SKIP() << "needs KVPOOL_TEST_DEVICE=cuda:N";
  ASSERT_TRUE(RegisterDataFree(client(), "ipc", Shape{}, v1::ROTATION_KIND_IDENTITY, 0).ok());
  ASSERT_TRUE(client().CreateSequence("ipc", "ipc-s").ok());
  auto stub = Stub();
  v1::NegotiateRequest req;
  req.add_offers()->set_kind(v1::TRANSPORT_KIND_CUDA_IPC);
  v1::NegotiateResponse resp;
  ASSERT_TRUE(Negotiate(*stub, req, &resp).ok());
  ASSERT_EQ(resp.kind(), v1::TRANSPORT_KIND_CUDA_IPC);
  const uint64_t session = resp.cuda_ipc().session_id();
  const absl::StatusOr<std::string> before = PoolFingerprint(client());
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(Push(*stub, {Header(session, "ipc-s", v1::DTYPE_FP32)}).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  v1::DevicePushRequest chunk;
  chunk.mutable_chunk()->set_layer(0);
  chunk.mutable_chunk()->set_num_tokens(8);
  chunk.mutable_chunk()->mutable_k()->set_handle(std::string(64, '\x07'));
  chunk.mutable_chunk()->mutable_v()->set_handle(std::string(64, '\x07'));
  EXPECT_EQ(Push(*stub, {Header(session, "ipc-s"), chunk}).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  chunk.mutable_chunk()->set_layer(9);  // outside the model: refused before any mapping
  EXPECT_EQ(Push(*stub, {Header(session, "ipc-s"), chunk}).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  const absl::StatusOr<std::string> after = PoolFingerprint(client());
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(*before, *after);
  grpc::ClientContext ctx;
  v1::CloseSessionRequest close;
  close.set_session_id(session);
  v1::CloseSessionResponse closed;
  EXPECT_TRUE(stub->CloseSession(&ctx, close, &closed).ok());
  EXPECT_EQ(Push(*stub, {Header(session, "ipc-s")}).error_code(), grpc::StatusCode::NOT_FOUND);
}

}  // namespace
}  // namespace kvpool::integration
