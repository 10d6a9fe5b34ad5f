// CUDA IPC end to end with two processes on one GPU: this test process is the prefill worker, its
// K/V in its own GPU memory; kvpoold --device=cuda:0 (a second process, on the same GPU)
// negotiates a CUDA IPC session (TransportService), maps the worker's exported buffers and stores
// the rows. With an identity rotation and the quantizer bypassed the daemon returns exactly what
// was sent, so the same K/V pushed over CUDA IPC and over inline gRPC read back bit for bit
// alike. A chunk naming bytes outside its buffer fails precisely, changes nothing, and the
// sequence takes the next push. With a tenants file, a session belongs to the tenant that
// negotiated it: another tenant naming it gets NOT_FOUND, changes nothing and is counted.
//
// Needs a GPU (skips without one): bash tests/gpu/run.sh daemon (or all) on the GPU machine.
#include <cuda_runtime.h>
#include <stdlib.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/transport/gpu_push.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "kvpool/v1/transport_service.grpc.pb.h"
#include "server/auth/token_hash.h"
#include "tests/integration/integration_util.h"

namespace kvpool::integration {
namespace {

constexpr Shape kShape{2, 8, 2, 64};
constexpr int kTokens = 300;

size_t RowBytes() { return static_cast<size_t>(kShape.kv_heads) * kShape.head_dim * sizeof(Bf16); }

class CudaIpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      (void)cudaGetLastError();
      GTEST_SKIP() << "needs a GPU";
    }
    absl::StatusOr<std::unique_ptr<LocalDaemon>> d = StartDaemon(DaemonFlags());
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    absl::StatusOr<std::unique_ptr<KvpoolClient>> c =
        KvpoolClient::Connect(daemon_->target(), ClientOptionsOf());
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
    v1::QuantConfig bypass;
    bypass.set_method(v1::QUANT_METHOD_BYPASS);
    ASSERT_TRUE(
        RegisterDataFree(*client_, "exact", kShape, v1::ROTATION_KIND_IDENTITY, 0, bypass).ok());
    kv_ = MakeSequenceKv(kShape, kTokens, 5);
    // One allocation holds every layer's K, then every layer's V (its base is exported).
    layer_bytes_ = kTokens * RowBytes();
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&device_, 2 * kShape.num_layers * layer_bytes_), cudaSuccess);
    for (int l = 0; l < kShape.num_layers; ++l) {
      ASSERT_EQ(cudaMemcpy(K(l), kv_.k[l].data(), layer_bytes_, cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(V(l), kv_.v[l].data(), layer_bytes_, cudaMemcpyHostToDevice),
                cudaSuccess);
    }
  }

  void TearDown() override {
    if (device_ != nullptr) cudaFree(device_);
    if (daemon_ != nullptr) {
      EXPECT_TRUE(daemon_->Stop().ok());
    }
  }

  // The daemon's flags and how client_ connects (the tenancy test adds a tenants file).
  virtual std::vector<std::string> DaemonFlags() { return {"--device=cuda:0"}; }
  virtual client::ClientOptions ClientOptionsOf() { return {}; }

  uint8_t* K(int layer) const { return static_cast<uint8_t*>(device_) + layer * layer_bytes_; }
  uint8_t* V(int layer) const { return K(kShape.num_layers + layer); }

  // The sequence's rows as ReadKv returns them (BF16, every layer), compared with what was sent.
  void ExpectStoredExactly(const std::string& id) {
    v1::ReadKvRequest all;
    all.set_sequence_id(id);
    absl::StatusOr<client::KvRead> read = client_->ReadKv(all);
    ASSERT_TRUE(read.ok()) << read.status();
    ASSERT_EQ(read->header.num_tokens(), static_cast<uint32_t>(kTokens));
    ASSERT_EQ(read->layers.size(), static_cast<size_t>(kShape.num_layers));
    for (int l = 0; l < kShape.num_layers; ++l) {
      EXPECT_TRUE(read->layers[l].k == AsBytes(kv_.k[l])) << id << " layer " << l << " keys";
      EXPECT_TRUE(read->layers[l].v == AsBytes(kv_.v[l])) << id << " layer " << l << " values";
    }
  }

  // Pushes every layer of kv_ into sequence `id` over a CUDA IPC session of a GpuPushClient
  // (chunks of `chunk_tokens`, 0: whole layers).
  absl::StatusOr<v1::AppendKvResponse> PushAll(const std::string& id, uint32_t chunk_tokens) {
    KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<client::GpuPushClient> gpu,
                            client::GpuPushClient::Create(client_->channel(), 0));
    KVPOOL_RETURN_IF_ERROR(gpu->RegisterBuffer(device_, 2 * kShape.num_layers * layer_bytes_));
    std::vector<client::GpuLayerRows> layers;
    for (int l = 0; l < kShape.num_layers; ++l) layers.push_back({K(l), V(l)});
    const client::GpuPushSpec spec{id,         0,           kTokens, /*end_of_prefill=*/true,
                                   RowBytes(), chunk_tokens};
    return gpu->PushIpc(spec, layers);
  }

  std::unique_ptr<LocalDaemon> daemon_;
  std::unique_ptr<KvpoolClient> client_;
  SequenceKv kv_;
  size_t layer_bytes_ = 0;
  void* device_ = nullptr;
};

TEST_F(CudaIpcTest, PushedRowsAreStoredBitForBitAsOverGrpc) {
  ASSERT_TRUE(client_->CreateSequence("exact", "ipc").ok());
  absl::StatusOr<v1::AppendKvResponse> pushed = PushAll("ipc", /*chunk_tokens=*/64);
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_EQ(pushed->sequence().total_tokens(), static_cast<uint32_t>(kTokens));

  ASSERT_TRUE(CreateAndAppend(*client_, "exact", "inline", kv_, /*end_of_prefill=*/true).ok());
  ExpectStoredExactly("ipc");
  ExpectStoredExactly("inline");

  absl::StatusOr<v1::GetStatsResponse> stats = client_->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->transport().open_pushes(), 0u);
  EXPECT_GE(stats->transport().pushes_committed(), 1u);
}

TEST_F(CudaIpcTest, ABufferRangeOutsideItsAllocationChangesNothing) {
  auto stub = v1::TransportService::NewStub(
      grpc::CreateChannel(daemon_->target(), grpc::InsecureChannelCredentials()));
  v1::NegotiateRequest offer;
  offer.add_offers()->set_kind(v1::TRANSPORT_KIND_CUDA_IPC);
  v1::NegotiateResponse session;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->Negotiate(&ctx, offer, &session).ok());
  }
  ASSERT_EQ(session.kind(), v1::TRANSPORT_KIND_CUDA_IPC);
  cudaIpcMemHandle_t handle;
  ASSERT_EQ(cudaIpcGetMemHandle(&handle, device_), cudaSuccess);
  const std::string h(reinterpret_cast<const char*>(&handle), sizeof(handle));
  ASSERT_TRUE(client_->CreateSequence("exact", "edge").ok());
  const absl::StatusOr<std::string> before = PoolFingerprint(*client_);
  ASSERT_TRUE(before.ok()) << before.status();

  // Layer 0's K from its place in the buffer, its V from past the allocation's end.
  v1::DevicePushRequest header;
  header.mutable_header()->set_session_id(session.cuda_ipc().session_id());
  v1::AppendKvHeader* a = header.mutable_header()->mutable_append();
  a->set_sequence_id("edge");
  a->set_num_tokens(kTokens);
  a->set_dtype(v1::DTYPE_BF16);
  a->set_end_of_prefill(true);
  v1::DevicePushRequest chunk;
  v1::DevicePushChunk* c = chunk.mutable_chunk();
  c->set_layer(0);
  c->set_num_tokens(kTokens);
  c->mutable_k()->set_handle(h);
  c->mutable_k()->set_offset(0);
  c->mutable_v()->set_handle(h);
  c->mutable_v()->set_offset(2 * kShape.num_layers * layer_bytes_ - layer_bytes_ / 2 / 16 * 16);
  {
    grpc::ClientContext ctx;
    v1::AppendKvResponse resp;
    auto w = stub->PushKv(&ctx, &resp);
    w->Write(header);
    w->Write(chunk);
    w->WritesDone();
    const grpc::Status s = w->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  }
  const absl::StatusOr<std::string> after = PoolFingerprint(*client_);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(*before, *after);

  // The sequence is free again: the whole push goes through.
  absl::StatusOr<v1::AppendKvResponse> pushed = PushAll("edge", /*chunk_tokens=*/0);
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  ExpectStoredExactly("edge");
}

constexpr char kTokenA[] = "cuda-ipc-tenant-a-1b2c3d4e5f60";
constexpr char kTokenB[] = "cuda-ipc-tenant-b-7a8b9c0d1e2f";

// The same daemon with a tenants file of two token tenants; client_ is tenant A.
class CudaIpcTenancyTest : public CudaIpcTest {
 protected:
  std::vector<std::string> DaemonFlags() override {
    char tmpl[] = "/tmp/kvpool-cuda-ipc-tenancy-XXXXXX";
    EXPECT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    std::ofstream(dir_ + "/tenants.txtpb")
        << absl::StrCat("tenant { name: \"team-a\" role: ROLE_TENANT token_sha256: \"",
                        server::HexOf(server::Sha256Of(kTokenA)), "\" }\n",
                        "tenant { name: \"team-b\" role: ROLE_TENANT token_sha256: \"",
                        server::HexOf(server::Sha256Of(kTokenB)), "\" }\n");
    return {"--device=cuda:0", "--tenants_file=" + dir_ + "/tenants.txtpb"};
  }
  client::ClientOptions ClientOptionsOf() override { return Token(kTokenA); }
  void TearDown() override {
    CudaIpcTest::TearDown();
    if (!dir_.empty()) (void)std::system(("rm -rf " + dir_).c_str());
  }

  static client::ClientOptions Token(const char* token) {
    client::ClientOptions o;
    o.security.token = token;
    return o;
  }

  // A raw PushKv of every layer of kv_ into `sequence_id` over session `session`, the rows
  // named in this process's exported buffer.
  grpc::Status RawPush(v1::TransportService::Stub* stub, uint64_t session,
                       const std::string& sequence_id) {
    cudaIpcMemHandle_t handle;
    EXPECT_EQ(cudaIpcGetMemHandle(&handle, device_), cudaSuccess);
    const std::string h(reinterpret_cast<const char*>(&handle), sizeof(handle));
    v1::DevicePushRequest header;
    header.mutable_header()->set_session_id(session);
    v1::AppendKvHeader* a = header.mutable_header()->mutable_append();
    a->set_sequence_id(sequence_id);
    a->set_num_tokens(kTokens);
    a->set_dtype(v1::DTYPE_BF16);
    a->set_end_of_prefill(true);
    grpc::ClientContext ctx;
    v1::AppendKvResponse resp;
    auto w = stub->PushKv(&ctx, &resp);
    bool open = w->Write(header);
    for (int l = 0; l < kShape.num_layers && open; ++l) {
      v1::DevicePushRequest chunk;
      v1::DevicePushChunk* c = chunk.mutable_chunk();
      c->set_layer(l);
      c->set_num_tokens(kTokens);
      c->mutable_k()->set_handle(h);
      c->mutable_k()->set_offset(K(l) - static_cast<uint8_t*>(device_));
      c->mutable_v()->set_handle(h);
      c->mutable_v()->set_offset(V(l) - static_cast<uint8_t*>(device_));
      open = w->Write(chunk);
    }
    w->WritesDone();
    return w->Finish();
  }

  std::string dir_;
};

grpc::Status Close(v1::TransportService::Stub* stub, uint64_t session) {
  grpc::ClientContext ctx;
  v1::CloseSessionRequest r;
  r.set_session_id(session);
  v1::CloseSessionResponse out;
  return stub->CloseSession(&ctx, r, &out);
}

// Holds a watch until its first message, then lets it go; NOT_FOUND when it never held.
grpc::Status Watch(v1::TransportService::Stub* stub, uint64_t session) {
  grpc::ClientContext ctx;
  v1::WatchSessionRequest r;
  r.set_session_id(session);
  auto reader = stub->WatchSession(&ctx, r);
  v1::WatchSessionResponse out;
  while (reader->Read(&out)) ctx.TryCancel();
  return reader->Finish();
}

uint64_t ForeignSessionAttempts(const KvpoolClient& c) {
  absl::StatusOr<v1::GetStatsResponse> stats = c.GetStats();
  EXPECT_TRUE(stats.ok()) << stats.status();
  return stats.ok() ? stats->security().foreign_session_attempts() : 0;
}

TEST_F(CudaIpcTenancyTest, SessionsAreBoundToTheNegotiatingTenant) {
  absl::StatusOr<std::unique_ptr<KvpoolClient>> b =
      KvpoolClient::Connect(daemon_->target(), Token(kTokenB));
  ASSERT_TRUE(b.ok()) << b.status();
  v1::QuantConfig bypass;
  bypass.set_method(v1::QUANT_METHOD_BYPASS);
  ASSERT_TRUE(RegisterDataFree(**b, "exact", kShape, v1::ROTATION_KIND_IDENTITY, 0, bypass).ok());
  ASSERT_TRUE(client_->CreateSequence("exact", "ipc-a").ok());
  ASSERT_TRUE(client_->CreateSequence("exact", "ipc-a2").ok());
  ASSERT_TRUE((*b)->CreateSequence("exact", "ipc-b").ok());

  // Own tenant: A's push over its own session is stored bit for bit.
  absl::StatusOr<v1::AppendKvResponse> pushed = PushAll("ipc-a", /*chunk_tokens=*/64);
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  ExpectStoredExactly("ipc-a");

  auto stub_a = v1::TransportService::NewStub(client_->channel());
  auto stub_b = v1::TransportService::NewStub((*b)->channel());
  v1::NegotiateRequest offer;
  offer.add_offers()->set_kind(v1::TRANSPORT_KIND_CUDA_IPC);
  v1::NegotiateResponse negotiated;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_a->Negotiate(&ctx, offer, &negotiated).ok());
  }
  ASSERT_EQ(negotiated.kind(), v1::TRANSPORT_KIND_CUDA_IPC);
  const uint64_t session = negotiated.cuda_ipc().session_id();
  const uint64_t nobodys = session ^ 0x5a5a5a5a00000000ull;
  const absl::StatusOr<std::string> a_before = PoolFingerprint(*client_);
  const absl::StatusOr<std::string> b_before = PoolFingerprint(**b);
  ASSERT_TRUE(a_before.ok() && b_before.ok());
  const uint64_t attempts = ForeignSessionAttempts(*client_);

  // B naming A's session gets what a session that does not exist gets, and each attempt counts
  // (a session that does not exist is no attempt on anyone's).
  const grpc::Status missing = RawPush(stub_b.get(), nobodys, "ipc-b");
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::NOT_FOUND) << missing.error_message();
  EXPECT_EQ(Close(stub_b.get(), nobodys).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(ForeignSessionAttempts(*client_), attempts);
  EXPECT_EQ(RawPush(stub_b.get(), session, "ipc-b").error_code(), missing.error_code());
  EXPECT_EQ(Close(stub_b.get(), session).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Watch(stub_b.get(), session).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(ForeignSessionAttempts(*client_), attempts + 3);

  // A's session naming B's sequence finds nothing, exactly as a sequence that does not exist.
  const grpc::Status no_sequence = RawPush(stub_a.get(), session, "ipc-missing");
  EXPECT_EQ(no_sequence.error_code(), grpc::StatusCode::NOT_FOUND) << no_sequence.error_message();
  EXPECT_EQ(RawPush(stub_a.get(), session, "ipc-b").error_code(), no_sequence.error_code());
  EXPECT_EQ(ForeignSessionAttempts(*client_), attempts + 3);

  // Nothing of either tenant changed.
  EXPECT_EQ(PoolFingerprint(*client_).value_or(""), *a_before);
  EXPECT_EQ(PoolFingerprint(**b).value_or(""), *b_before);
  absl::StatusOr<v1::SequenceInfo> b_seq = (*b)->DescribeSequence("ipc-b");
  ASSERT_TRUE(b_seq.ok()) << b_seq.status();
  EXPECT_EQ(b_seq->total_tokens(), 0u);

  // A's session is intact: it carries A's push, and A closes it.
  const grpc::Status own = RawPush(stub_a.get(), session, "ipc-a2");
  EXPECT_TRUE(own.ok()) << own.error_message();
  ExpectStoredExactly("ipc-a2");
  EXPECT_TRUE(Close(stub_a.get(), session).ok());
  EXPECT_EQ(Close(stub_a.get(), session).error_code(), grpc::StatusCode::NOT_FOUND);
}

}  // namespace
}  // namespace kvpool::integration
