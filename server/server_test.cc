// End-to-end tests of kvpoold's gRPC services on an in-process server (real gRPC over loopback).
#include "server/server.h"

#include <cmath>
#include <cstring>
#include <thread>

#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/attention.h"
#include "kernels/rotation_file.h"
#include "kvpool/v1/attention_service.grpc.pb.h"
#include "kvpool/v1/model_service.grpc.pb.h"
#include "kvpool/v1/read_service.grpc.pb.h"
#include "kvpool/v1/sequence_service.grpc.pb.h"
#include "kvpool/v1/stats_service.grpc.pb.h"
#include "proto/service_stubs.h"
#include "proto/status.h"
#include "server/model_registry.h"
#include "server/server_test_util.h"
#include "tests/support/api_requests.h"
#include "tests/support/test_data.h"

namespace kvpool::server {
namespace {

namespace v1 = ::kvpool::v1;
using ::kvpool::testing::AppendChunkMessage;
using ::kvpool::testing::AppendHeaderMessage;
using testing::TestRows;

constexpr int kLayers = 2, kHq = 4, kHkv = 2, kD = 32;
constexpr size_t kRow = kHkv * kD;

class ServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerConfig cfg;
    cfg.listen = "127.0.0.1:0";
    cfg.pool_bytes = 64 << 20;
    cfg.slab_bytes = 256 << 10;
    cfg.worker_threads = 2;
    cfg.max_message_bytes = 1 << 20;
    cfg.max_chunk_bytes = 256 << 10;
    auto s = KvpoolServer::Start(cfg);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(server_->port()),
                                   grpc::InsecureChannelCredentials());
    stubs_ = std::make_unique<ServiceStubs>(channel_);
  }

  grpc::Status RegisterDataFree(const std::string& id, v1::RotationKind kind,
                                v1::QuantMethod method) {
    grpc::ClientContext ctx;
    v1::RegisterModelResponse resp;
    auto w = stubs_->models->RegisterModel(&ctx, &resp);
    v1::RegisterModelRequest req;
    v1::ModelSpec* spec = req.mutable_spec();
    spec->set_model_id(id);
    spec->mutable_shape()->set_num_layers(kLayers);
    spec->mutable_shape()->set_q_heads(kHq);
    spec->mutable_shape()->set_kv_heads(kHkv);
    spec->mutable_shape()->set_head_dim(kD);
    spec->mutable_data_free()->set_kind(kind);
    v1::QuantConfig* q = spec->mutable_quant();
    q->set_method(method);
    q->set_block_tokens(8);
    q->set_sink_tokens(8);
    q->set_recent_tokens(16);
    q->set_demotion_batch(8);
    w->Write(req);
    w->WritesDone();
    return w->Finish();
  }

  grpc::Status Create(const std::string& model, const std::string& id,
                      std::vector<uint32_t> prefix = {},
                      v1::CreateSequenceResponse* out = nullptr) {
    grpc::ClientContext ctx;
    v1::CreateSequenceRequest req;
    req.set_model_id(model);
    req.set_sequence_id(id);
    for (uint32_t t : prefix) req.add_prefix_token_ids(t);
    v1::CreateSequenceResponse resp;
    grpc::Status s = stubs_->sequences->CreateSequence(&ctx, req, &resp);
    if (out != nullptr) *out = resp;
    return s;
  }

  // Streams K/V ([layer][tokens][row] BF16) in chunks of `chunk` tokens per layer.
  grpc::Status Append(const std::string& id, int start, int tokens,
                      const std::vector<std::vector<Bf16>>& k,
                      const std::vector<std::vector<Bf16>>& v, bool final, int chunk = 7,
                      std::vector<uint32_t> ids = {}, v1::AppendKvResponse* out = nullptr,
                      int skip_layer = -1) {
    grpc::ClientContext ctx;
    v1::AppendKvResponse resp;
    auto w = stubs_->sequences->AppendKv(&ctx, &resp);
    v1::AppendKvRequest req = AppendHeaderMessage(id, start, tokens, v1::DTYPE_BF16, final);
    for (uint32_t t : ids) req.mutable_header()->add_token_ids(t);
    bool ok = w->Write(req);
    auto rows = [](const std::vector<Bf16>& layer, int off, int n) {
      return std::string(reinterpret_cast<const char*>(layer.data() + off * kRow), n * kRow * 2);
    };
    for (int layer = 0; layer < static_cast<int>(k.size()) && ok; ++layer) {
      if (layer == skip_layer) continue;
      for (int off = 0; off < tokens && ok; off += chunk) {
        const int n = std::min(chunk, tokens - off);
        ok = w->Write(
            AppendChunkMessage(layer, off, n, rows(k[layer], off, n), rows(v[layer], off, n)));
      }
    }
    w->WritesDone();
    grpc::Status s = w->Finish();
    if (out != nullptr) *out = resp;
    return s;
  }

  // One decode step of sequence `id` at `token_start`: Gaussian FP32 K (V the same) of every
  // layer, seeded by `seed`.
  grpc::Status DecodeStep(const std::string& id, uint32_t token_start, int seed,
                          v1::AppendDecodeResponse* resp) {
    grpc::ClientContext ctx;
    v1::AppendDecodeRequest req;
    req.set_sequence_id(id);
    req.set_token_start(token_start);
    req.set_num_tokens(1);
    req.set_dtype(v1::DTYPE_FP32);
    std::vector<float> k = kvpool::testing::GaussianValues(kLayers * kRow, seed);
    req.set_k(reinterpret_cast<const char*>(k.data()), k.size() * 4);
    req.set_v(reinterpret_cast<const char*>(k.data()), k.size() * 4);
    return stubs_->sequences->AppendDecode(&ctx, req, resp);
  }

  uint64_t UsedBytes() {
    grpc::ClientContext ctx;
    v1::GetStatsResponse resp;
    EXPECT_TRUE(stubs_->stats->GetStats(&ctx, v1::GetStatsRequest(), &resp).ok());
    return resp.pool().used_bytes();
  }

  // Reads K/V of every layer back in the original basis.
  grpc::Status ReadAll(const std::string& id, v1::DType dtype, std::vector<std::string>* k,
                       std::vector<std::string>* v) {
    grpc::ClientContext ctx;
    v1::ReadKvRequest req;
    req.set_sequence_id(id);
    req.set_dtype(dtype);
    auto r = stubs_->reads->ReadKv(&ctx, req);
    v1::ReadKvResponse msg;
    k->assign(kLayers, "");
    v->assign(kLayers, "");
    while (r->Read(&msg)) {
      if (msg.has_rows()) {
        (*k)[msg.rows().layer()] += msg.rows().k();
        (*v)[msg.rows().layer()] += msg.rows().v();
      }
    }
    return r->Finish();
  }

  std::unique_ptr<KvpoolServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<ServiceStubs> stubs_;
};

struct Kv {
  std::vector<std::vector<Bf16>> k, v;
  Kv(int tokens, uint64_t seed) {
    for (int l = 0; l < kLayers; ++l) {
      k.push_back(TestRows(tokens, kRow, seed + 2 * l));
      v.push_back(TestRows(tokens, kRow, seed + 2 * l + 1));
    }
  }
  std::string Bytes(const std::vector<Bf16>& x) const {
    return std::string(reinterpret_cast<const char*>(x.data()), x.size() * 2);
  }
};

TEST_F(ServerTest, HealthServes) {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext ctx;
  grpc::health::v1::HealthCheckRequest req;
  req.set_service("kvpool.v1.SequenceService");
  grpc::health::v1::HealthCheckResponse resp;
  ASSERT_TRUE(health->Check(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST_F(ServerTest, IdentityBypassRoundTripIsBitExact) {
  ASSERT_TRUE(RegisterDataFree("m", v1::ROTATION_KIND_IDENTITY, v1::QUANT_METHOD_BYPASS).ok());
  ASSERT_TRUE(Create("m", "s").ok());
  Kv kv(100, 1);
  v1::AppendKvResponse resp;
  grpc::Status s = Append("s", 0, 100, kv.k, kv.v, /*final=*/true, 7, {}, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.sequence().total_tokens(), 100u);
  EXPECT_EQ(resp.to_sink(), 8u);
  EXPECT_EQ(resp.to_recent(), 16u);
  EXPECT_EQ(resp.to_history(), 76u);
  std::vector<std::string> k, v;
  ASSERT_TRUE(ReadAll("s", v1::DTYPE_BF16, &k, &v).ok());
  for (int l = 0; l < kLayers; ++l) {
    EXPECT_EQ(k[l], kv.Bytes(kv.k[l])) << "layer " << l;
    EXPECT_EQ(v[l], kv.Bytes(kv.v[l])) << "layer " << l;
  }
  // Attention-ready read: header, then sink rows, blocks, recent rows per layer.
  grpc::ClientContext ctx;
  v1::ReadBlocksRequest req;
  req.set_sequence_id("s");
  auto r = stubs_->reads->ReadBlocks(&ctx, req);
  v1::ReadBlocksResponse msg;
  ASSERT_TRUE(r->Read(&msg));
  ASSERT_TRUE(msg.has_header());
  EXPECT_EQ(msg.header().history_tokens(), 76u);
  EXPECT_EQ(msg.header().block_layout().bits(), 16);
  int blocks = 0, rows = 0;
  while (r->Read(&msg)) {
    blocks += msg.blocks().blocks_size();
    if (msg.has_rows()) rows += msg.rows().num_tokens();
  }
  ASSERT_TRUE(r->Finish().ok());
  EXPECT_EQ(blocks, kLayers * 10);
  EXPECT_EQ(rows, kLayers * 24);
}

TEST_F(ServerTest, RemoteAttentionMatchesDenseAttention) {
  for (auto [kind, method] :
       {std::make_pair(v1::ROTATION_KIND_IDENTITY, v1::QUANT_METHOD_BYPASS),
        std::make_pair(v1::ROTATION_KIND_HADAMARD, v1::QUANT_METHOD_UNIFORM)}) {
    const std::string model = "m" + std::to_string(kind);
    ASSERT_TRUE(RegisterDataFree(model, kind, method).ok());
    v1::AttendRequest req;
    req.set_model_id(model);
    req.set_layer(1);
    std::vector<std::vector<float>> qs;
    for (int b = 0; b < 3; ++b) {
      const std::string id = model + "-s" + std::to_string(b);
      ASSERT_TRUE(Create(model, id).ok());
      Kv kv(40 + 13 * b, 10 * b);
      ASSERT_TRUE(Append(id, 0, 40 + 13 * b, kv.k, kv.v, true).ok());
      std::vector<float> q = kvpool::testing::GaussianValues(kHq * kD, 99 + b);
      v1::SequenceQuery* sq = req.add_queries();
      sq->set_sequence_id(id);
      sq->set_q(reinterpret_cast<const char*>(q.data()), q.size() * 4);
      qs.push_back(q);
    }
    grpc::ClientContext ctx;
    v1::AttendResponse resp;
    grpc::Status s = stubs_->attention->Attend(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(resp.results_size(), 3);
    for (int b = 0; b < 3; ++b) {
      // Dense attention over what the daemon stores (dequantized, original basis).
      std::vector<std::string> k, v;
      ASSERT_TRUE(ReadAll(resp.results(b).sequence_id(), v1::DTYPE_FP32, &k, &v).ok());
      const int n = static_cast<int>(k[1].size() / (kRow * 4));
      EXPECT_EQ(static_cast<int>(resp.results(b).attended_tokens()), n);
      std::vector<float> kf(n * kRow), vf(n * kRow);
      std::memcpy(kf.data(), k[1].data(), k[1].size());
      std::memcpy(vf.data(), v[1].data(), v[1].size());
      const AttentionOutput want = DenseAttentionReference({kHq, kHkv, kD}, qs[b], kf, vf, n);
      std::vector<float> out(kHq * kD);
      ASSERT_EQ(resp.results(b).out().size(), out.size() * 4);
      std::memcpy(out.data(), resp.results(b).out().data(), out.size() * 4);
      // Bypass: the same BF16 values; quantized: the rows are re-rotated in fp32 (tolerance).
      const float tol = method == v1::QUANT_METHOD_BYPASS ? 1e-4f : 2e-3f;
      for (size_t i = 0; i < out.size(); ++i) {
        EXPECT_NEAR(out[i], want.out[i], tol * (1 + std::fabs(want.out[i]))) << i;
      }
      for (int h = 0; h < kHq; ++h) {
        EXPECT_NEAR(resp.results(b).lse(h), want.lse[h], tol * (1 + std::fabs(want.lse[h]))) << h;
      }
    }
  }
}

TEST_F(ServerTest, BadRequestsGetPreciseCodesAndLeaveThePoolUnchanged) {
  ASSERT_TRUE(RegisterDataFree("m", v1::ROTATION_KIND_HADAMARD, v1::QUANT_METHOD_UNIFORM).ok());
  ASSERT_TRUE(Create("m", "s").ok());
  Kv kv(30, 1);
  ASSERT_TRUE(Append("s", 0, 30, kv.k, kv.v, false).ok());
  const uint64_t used = UsedBytes();
  ASSERT_GT(used, 0u);
  using grpc::StatusCode;
  // Unknown ids.
  EXPECT_EQ(Append("nope", 0, 30, kv.k, kv.v, false).error_code(), StatusCode::NOT_FOUND);
  EXPECT_EQ(Create("nope", "x").error_code(), StatusCode::NOT_FOUND);
  EXPECT_EQ(Create("m", "s").error_code(), StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(Create("m", "bad id!").error_code(), StatusCode::INVALID_ARGUMENT);
  // Wrong position, missing layer, NaN.
  EXPECT_EQ(Append("s", 5, 30, kv.k, kv.v, false).error_code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(Append("s", 30, 30, kv.k, kv.v, false, 7, {}, nullptr, /*skip_layer=*/1).error_code(),
            StatusCode::INVALID_ARGUMENT);
  Kv bad = kv;
  bad.k[1][200] = Bf16::FromFloat(std::nanf(""));
  EXPECT_EQ(Append("s", 30, 30, bad.k, bad.v, false).error_code(), StatusCode::INVALID_ARGUMENT);
  bad = kv;
  bad.v[0][5] = Bf16::FromFloat(INFINITY);
  EXPECT_EQ(Append("s", 30, 30, bad.k, bad.v, false).error_code(), StatusCode::INVALID_ARGUMENT);
  // Too many token ids, a message over the limit, pool too small.
  EXPECT_EQ(Append("s", 30, 30, kv.k, kv.v, false, 7, {1, 2, 3}).error_code(),
            StatusCode::INVALID_ARGUMENT);
  Kv huge(9000, 3);  // 9000 x 64 x 2 bytes per chunk > 1 MiB message limit
  EXPECT_EQ(Append("s", 30, 9000, huge.k, huge.v, false, 9000).error_code(),
            StatusCode::RESOURCE_EXHAUSTED);
  // gRPC itself failed that call: the daemon's rollback can trail the client's status by a
  // moment, during which a new append is ABORTED (retryable). Wait it out.
  for (int i = 0; i < 200; ++i) {
    grpc::Status s = Append("s", 30, 30, kv.k, kv.v, false, 7, {}, nullptr, /*skip_layer=*/0);
    if (s.error_code() != StatusCode::ABORTED) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  {
    grpc::ClientContext ctx;
    v1::AppendKvResponse resp;
    auto w = stubs_->sequences->AppendKv(&ctx, &resp);
    v1::AppendKvRequest req;
    req.mutable_header()->set_sequence_id("s");
    req.mutable_header()->set_token_start(30);
    req.mutable_header()->set_num_tokens(1 << 20);
    req.mutable_header()->set_dtype(v1::DTYPE_BF16);
    w->Write(req);
    w->WritesDone();
    EXPECT_EQ(w->Finish().error_code(), StatusCode::RESOURCE_EXHAUSTED);
  }
  {  // Wrong dtype and a chunk whose size does not match its token count.
    grpc::ClientContext ctx;
    v1::AppendKvResponse resp;
    auto w = stubs_->sequences->AppendKv(&ctx, &resp);
    v1::AppendKvRequest req;
    req.mutable_header()->set_sequence_id("s");
    req.mutable_header()->set_token_start(30);
    req.mutable_header()->set_num_tokens(4);
    w->Write(req);
    w->WritesDone();
    EXPECT_EQ(w->Finish().error_code(), StatusCode::INVALID_ARGUMENT);
  }
  {
    grpc::ClientContext ctx;
    v1::AppendKvResponse resp;
    auto w = stubs_->sequences->AppendKv(&ctx, &resp);
    v1::AppendKvRequest req;
    req.mutable_header()->set_sequence_id("s");
    req.mutable_header()->set_token_start(30);
    req.mutable_header()->set_num_tokens(4);
    req.mutable_header()->set_dtype(v1::DTYPE_FP32);
    w->Write(req);
    v1::AppendKvRequest c;
    c.mutable_chunk()->set_layer(0);
    c.mutable_chunk()->set_num_tokens(4);
    c.mutable_chunk()->set_k(std::string(4 * kRow * 2, '\0'));  // BF16-sized, header says FP32
    c.mutable_chunk()->set_v(std::string(4 * kRow * 2, '\0'));
    w->Write(c);
    w->WritesDone();
    EXPECT_EQ(w->Finish().error_code(), StatusCode::INVALID_ARGUMENT);
  }
  // Decode before the end of prefill; attention with a wrong shape or layer.
  {
    grpc::ClientContext ctx;
    v1::AppendDecodeRequest req;
    req.set_sequence_id("s");
    req.set_token_start(30);
    req.set_num_tokens(1);
    req.set_dtype(v1::DTYPE_BF16);
    req.set_k(std::string(kLayers * kRow * 2, '\0'));
    req.set_v(std::string(kLayers * kRow * 2, '\0'));
    v1::AppendDecodeResponse resp;
    EXPECT_EQ(stubs_->sequences->AppendDecode(&ctx, req, &resp).error_code(),
              StatusCode::FAILED_PRECONDITION);
  }
  for (int layer : {0, 5}) {
    grpc::ClientContext ctx;
    v1::AttendRequest req;
    req.set_model_id("m");
    req.set_layer(layer);
    v1::SequenceQuery* q = req.add_queries();
    q->set_sequence_id("s");
    q->set_q(std::string(layer == 0 ? 12 : kHq * kD * 4, '\0'));
    v1::AttendResponse resp;
    EXPECT_EQ(stubs_->attention->Attend(&ctx, req, &resp).error_code(),
              StatusCode::INVALID_ARGUMENT);
  }
  {
    grpc::ClientContext ctx;
    v1::AttendRequest req;
    req.set_model_id("m");
    req.set_layer(0);
    v1::SequenceQuery* q = req.add_queries();
    q->set_sequence_id("ghost");
    q->set_q(std::string(kHq * kD * 4, '\0'));
    v1::AttendResponse resp;
    EXPECT_EQ(stubs_->attention->Attend(&ctx, req, &resp).error_code(), StatusCode::NOT_FOUND);
  }
  {  // Reads past the end.
    grpc::ClientContext ctx;
    v1::ReadKvRequest req;
    req.set_sequence_id("s");
    req.set_token_start(10);
    req.set_num_tokens(100);
    auto r = stubs_->reads->ReadKv(&ctx, req);
    v1::ReadKvResponse msg;
    while (r->Read(&msg)) {
    }
    EXPECT_EQ(r->Finish().error_code(), StatusCode::OUT_OF_RANGE);
  }
  // Server paths are off without --model_dir.
  {
    grpc::ClientContext ctx;
    v1::RegisterModelResponse resp;
    auto w = stubs_->models->RegisterModel(&ctx, &resp);
    v1::RegisterModelRequest req;
    req.mutable_spec()->set_model_id("f");
    req.mutable_spec()->set_server_path("../../etc/passwd");
    req.mutable_spec()->mutable_shape()->set_q_heads(4);
    req.mutable_spec()->mutable_shape()->set_kv_heads(2);
    w->Write(req);
    w->WritesDone();
    EXPECT_EQ(w->Finish().error_code(), StatusCode::FAILED_PRECONDITION);
  }
  EXPECT_EQ(UsedBytes(), used);
  // And the sequence still accepts the right append.
  ASSERT_TRUE(Append("s", 30, 30, kv.k, kv.v, true).ok());
}

TEST_F(ServerTest, UploadedRotationFileRegistersAndDescribes) {
  auto codec = DataFreeCodec(RotationKind::kRandomizedHadamard, 1234, kLayers, kD, QuantConfig{});
  ASSERT_TRUE(codec.ok());
  codec->model_id = "up";
  const std::string file = SerializeRotationFile(*codec);
  grpc::ClientContext ctx;
  v1::RegisterModelResponse resp;
  auto w = stubs_->models->RegisterModel(&ctx, &resp);
  v1::RegisterModelRequest req;
  req.mutable_spec()->set_model_id("up");
  req.mutable_spec()->mutable_shape()->set_q_heads(kHq);
  req.mutable_spec()->mutable_shape()->set_kv_heads(kHkv);
  req.mutable_spec()->set_upload_size(file.size());
  ASSERT_TRUE(w->Write(req));
  for (size_t off = 0; off < file.size(); off += 1000) {
    v1::RegisterModelRequest c;
    c.set_rotation_file_chunk(file.substr(off, 1000));
    ASSERT_TRUE(w->Write(c));
  }
  w->WritesDone();
  grpc::Status s = w->Finish();
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.model().codec_version(), CodecVersionHex(*codec));
  EXPECT_EQ(resp.model().shape().num_layers(), kLayers);
  EXPECT_EQ(resp.model().rotation_kind(), v1::ROTATION_KIND_RANDOMIZED_HADAMARD);

  grpc::ClientContext dctx;
  v1::DescribeModelRequest dreq;
  dreq.set_model_id("up");
  dreq.set_include_rotation(true);
  auto r = stubs_->models->DescribeModel(&dctx, dreq);
  v1::DescribeModelResponse msg;
  ASSERT_TRUE(r->Read(&msg));
  EXPECT_EQ(msg.model().block_layout().block_bytes(),
            BlockLayout::ForModel(QuantConfig{}, kHkv, kD).block_bytes());
  int layers = 0;
  while (r->Read(&msg)) {
    ASSERT_TRUE(msg.has_rotation());
    const std::vector<float> want = codec->rotations.Matrix(layers, KvTensor::kKey);
    ASSERT_EQ(msg.rotation().k_matrix().size(), want.size() * 4);
    EXPECT_EQ(std::memcmp(msg.rotation().k_matrix().data(), want.data(), want.size() * 4), 0);
    ++layers;
  }
  ASSERT_TRUE(r->Finish().ok());
  EXPECT_EQ(layers, kLayers);
  // Same id, same content: idempotent. Truncated upload: rejected.
  grpc::ClientContext ctx2;
  auto w2 = stubs_->models->RegisterModel(&ctx2, &resp);
  req.mutable_spec()->set_upload_size(file.size() + 5);
  w2->Write(req);
  v1::RegisterModelRequest c;
  c.set_rotation_file_chunk(file);
  w2->Write(c);
  w2->WritesDone();
  EXPECT_EQ(w2->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(ServerTest, PrefixLookupAndReuse) {
  ASSERT_TRUE(RegisterDataFree("m", v1::ROTATION_KIND_HADAMARD, v1::QUANT_METHOD_UNIFORM).ok());
  ASSERT_TRUE(RegisterDataFree("m2", v1::ROTATION_KIND_HADAMARD, v1::QUANT_METHOD_UNIFORM).ok());
  std::vector<uint32_t> ids(50);
  for (int i = 0; i < 50; ++i) ids[i] = 1000 + i;
  ASSERT_TRUE(Create("m", "a").ok());
  Kv kv(50, 4);
  v1::AppendKvResponse ar;
  ASSERT_TRUE(Append("a", 0, 50, kv.k, kv.v, false, 7, ids, &ar).ok());
  EXPECT_EQ(ar.published_units_size(), 6);  // sink + 5 whole blocks of 8
  for (const char* model : {"m", "m2"}) {
    grpc::ClientContext ctx;
    v1::LookupPrefixRequest req;
    req.set_model_id(model);
    for (uint32_t t : ids) req.add_token_ids(t);
    v1::LookupPrefixResponse resp;
    ASSERT_TRUE(stubs_->sequences->LookupPrefix(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.matched_tokens(), std::string(model) == "m" ? 48u : 0u);
  }
  v1::CreateSequenceResponse cr;
  ASSERT_TRUE(Create("m", "b", ids, &cr).ok());
  EXPECT_EQ(cr.reused_tokens(), 48u);
  EXPECT_EQ(cr.reused_units_size(), 6);
  EXPECT_EQ(cr.sequence().shared_bytes(), cr.sequence().pool_bytes());
  // The reused prefix reads back the same as the original.
  std::vector<std::string> ka, va, kb, vb;
  ASSERT_TRUE(ReadAll("a", v1::DTYPE_BF16, &ka, &va).ok());
  ASSERT_TRUE(ReadAll("b", v1::DTYPE_BF16, &kb, &vb).ok());
  for (int l = 0; l < kLayers; ++l) EXPECT_EQ(ka[l].substr(0, kb[l].size()), kb[l]);
}

TEST_F(ServerTest, DecodeAppendsAndDeleteModel) {
  ASSERT_TRUE(RegisterDataFree("m", v1::ROTATION_KIND_IDENTITY, v1::QUANT_METHOD_BYPASS).ok());
  ASSERT_TRUE(Create("m", "s").ok());
  Kv kv(20, 1);
  ASSERT_TRUE(Append("s", 0, 20, kv.k, kv.v, true).ok());
  uint32_t demoted = 0;
  for (int step = 0; step < 12; ++step) {
    v1::AppendDecodeResponse resp;
    grpc::Status s = DecodeStep("s", 20 + step, step, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    demoted += resp.demoted_tokens();
    EXPECT_EQ(resp.sequence().total_tokens(), 21u + step);
  }
  EXPECT_EQ(demoted, 8u);  // recent 12 grows to 23; the 12th step demotes 8
  {
    grpc::ClientContext ctx;
    v1::DeleteModelRequest req;
    req.set_model_id("m");
    v1::DeleteModelResponse resp;
    EXPECT_EQ(stubs_->models->DeleteModel(&ctx, req, &resp).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }
  grpc::ClientContext ctx;
  v1::DeleteModelRequest req;
  req.set_model_id("m");
  req.set_force(true);
  v1::DeleteModelResponse resp;
  ASSERT_TRUE(stubs_->models->DeleteModel(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.released_sequences(), 1u);
  EXPECT_EQ(UsedBytes(), 0u);
}

TEST_F(ServerTest, SixteenConcurrentClientsKeepExactAccounting) {
  ASSERT_TRUE(RegisterDataFree("m", v1::ROTATION_KIND_HADAMARD, v1::QUANT_METHOD_UNIFORM).ok());
  std::vector<std::thread> clients;
  std::atomic<int> errors{0};
  for (int c = 0; c < 16; ++c) {
    clients.emplace_back([&, c] {
      for (int round = 0; round < 3; ++round) {
        const std::string id = "c" + std::to_string(c) + "-" + std::to_string(round);
        Kv kv(30 + c, c * 7 + round);
        if (!Create("m", id).ok()) ++errors;
        grpc::Status s = Append(id, 0, 30 + c, kv.k, kv.v, true, 11);
        if (!s.ok()) {
          ++errors;
          ADD_FAILURE() << s.error_message();
        }
        if (round < 2) {
          grpc::ClientContext ctx;
          v1::ReleaseSequenceRequest req;
          req.set_sequence_id(id);
          v1::ReleaseSequenceResponse resp;
          if (!stubs_->sequences->ReleaseSequence(&ctx, req, &resp).ok()) ++errors;
        }
      }
    });
  }
  for (auto& t : clients) t.join();
  EXPECT_EQ(errors.load(), 0);
  grpc::ClientContext ctx;
  v1::GetStatsRequest req;
  req.set_include_sequences(true);
  v1::GetStatsResponse resp;
  ASSERT_TRUE(stubs_->stats->GetStats(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.sequences_size(), 16);
  uint64_t sum = 0;
  for (const auto& s : resp.sequences()) sum += s.pool_bytes();
  EXPECT_EQ(sum, resp.pool().used_bytes());
  ASSERT_EQ(resp.models_size(), 1);
  EXPECT_EQ(resp.models(0).pool_bytes(), resp.pool().used_bytes());
  EXPECT_GT(resp.service().ingested_bytes(), 0u);
}

// Quotas over the wire: RESOURCE_EXHAUSTED with reason QUOTA for a model, a sequence and pool
// bytes (streamed append and decode append), nothing changed, and the caller's usage row in
// GetStats. (Every caller is the default tenant until identities exist.)
TEST_F(ServerTest, QuotasRefuseWithReasonAndGetStatsShowsTheTenantsRow) {
  auto quota = [](uint64_t pool_bytes) {
    v1::TenantQuota q;
    q.set_pool_bytes(pool_bytes);
    q.set_sequences(2);
    q.set_models(1);
    q.set_compute_weight(3);
    return q;
  };
  ASSERT_TRUE(server_->tenant_policy()->SetTenantQuotas({{kDefaultTenant, quota(0)}}).ok());
  ASSERT_TRUE(RegisterDataFree("m", v1::ROTATION_KIND_HADAMARD, v1::QUANT_METHOD_UNIFORM).ok());
  absl::Status s = FromGrpcStatus(
      RegisterDataFree("m2", v1::ROTATION_KIND_HADAMARD, v1::QUANT_METHOD_UNIFORM), "register");
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_EQ(ReasonOf(s), ErrorReason::kQuota) << s;
  ASSERT_TRUE(Create("m", "s1").ok());
  ASSERT_TRUE(Create("m", "s2").ok());
  s = FromGrpcStatus(Create("m", "s3"), "create");
  EXPECT_EQ(ReasonOf(s), ErrorReason::kQuota) << s;
  EXPECT_NE(s.message().find("quota 2, usage 2, request 1"), absl::string_view::npos) << s;

  Kv kv(40, 1);  // sink 8, INT2 history 16, recent 16
  ASSERT_TRUE(Append("s1", 0, 40, kv.k, kv.v, true).ok());
  const uint64_t used = UsedBytes();
  ASSERT_TRUE(server_->tenant_policy()->SetTenantQuotas({{kDefaultTenant, quota(used)}}).ok());
  s = FromGrpcStatus(Append("s2", 0, 20, kv.k, kv.v, true), "append");
  EXPECT_EQ(ReasonOf(s), ErrorReason::kQuota) << s;
  EXPECT_EQ(UsedBytes(), used);
  // Decode steps go on until one needs a page.
  int length = 40;
  bool refused = false;
  for (int step = 0; step < 24 && !refused; ++step) {
    v1::AppendDecodeResponse resp;
    absl::Status d = FromGrpcStatus(DecodeStep("s1", length, step, &resp), "decode");
    refused = !d.ok();
    if (refused) {
      EXPECT_EQ(ReasonOf(d), ErrorReason::kQuota) << d;
    } else {
      ++length;
    }
  }
  EXPECT_TRUE(refused);
  EXPECT_EQ(UsedBytes(), used);

  grpc::ClientContext ctx;
  v1::GetStatsResponse resp;
  ASSERT_TRUE(stubs_->stats->GetStats(&ctx, v1::GetStatsRequest(), &resp).ok());
  EXPECT_EQ(resp.quota_bytes(), used);
  ASSERT_EQ(resp.tenants_size(), 1);
  const v1::TenantUsage& row = resp.tenants(0);
  EXPECT_EQ(row.tenant(), kDefaultTenant);
  EXPECT_EQ(row.pool_bytes(), resp.pool().used_bytes());
  EXPECT_EQ(row.bf16_bytes() + row.int2_bytes(), row.pool_bytes());
  EXPECT_GT(row.int2_bytes(), 0u);
  EXPECT_EQ(row.sequences(), 2u);
  EXPECT_EQ(row.models(), 1u);
  EXPECT_EQ(row.quota().pool_bytes(), used);
  EXPECT_EQ(row.quota().sequences(), 2u);
  EXPECT_EQ(row.quota().compute_weight(), 3u);
  EXPECT_EQ(row.rejected_models(), 1u);
  EXPECT_EQ(row.rejected_sequences(), 1u);
  EXPECT_EQ(row.rejected_pool_bytes(), 2u);
  EXPECT_GT(row.served_tasks(), 0u);
  EXPECT_EQ(row.queued_tasks(), 0u);
}

}  // namespace
}  // namespace kvpool::server
