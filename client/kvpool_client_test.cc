// Client-side pieces without a daemon: chunk planning, status mapping, and AppendStream /
// RegisterModel against an in-process fake SequenceService / ModelService that records every
// message it receives.
#include "client/kvpool_client.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace kvpool::client {
namespace {

#define KV_EXPECT_OK(expr)                                    \
  do {                                                        \
    const ::absl::Status kv_expect_status_ = (expr);          \
    EXPECT_TRUE(kv_expect_status_.ok()) << kv_expect_status_; \
  } while (false)

TEST(PlanTokenChunksTest, CoversTheRangeWithinTheLimit) {
  for (uint32_t tokens : {1u, 7u, 100u, 4096u}) {
    for (size_t token_bytes : {size_t{1}, size_t{4096}, size_t{1} << 20}) {
      for (size_t max_bytes : {size_t{1}, size_t{4096}, size_t{1} << 20}) {
        const std::vector<TokenChunk> chunks = PlanTokenChunks(tokens, token_bytes, max_bytes);
        uint32_t next = 0;
        for (const TokenChunk& c : chunks) {
          EXPECT_EQ(c.offset, next);
          EXPECT_GE(c.count, 1u);
          // Within the limit unless a single token is already larger.
          if (token_bytes <= max_bytes) {
            EXPECT_LE(c.count * token_bytes, max_bytes);
          } else {
            EXPECT_EQ(c.count, 1u);
          }
          next += c.count;
        }
        EXPECT_EQ(next, tokens);
      }
    }
  }
  EXPECT_TRUE(PlanTokenChunks(0, 16, 1024).empty());
  // Fewest chunks: 4096 tokens of 4 KiB in 1 MiB messages are 16 chunks of 256 tokens.
  EXPECT_EQ(PlanTokenChunks(4096, 4096, 1 << 20).size(), 16u);
}

TEST(FromGrpcStatusTest, KeepsTheCodeAndPrefixesTheRpc) {
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK, "X").ok());
  const std::vector<grpc::StatusCode> codes = {
      grpc::INVALID_ARGUMENT,  grpc::NOT_FOUND,          grpc::ALREADY_EXISTS,
      grpc::PERMISSION_DENIED, grpc::RESOURCE_EXHAUSTED, grpc::FAILED_PRECONDITION,
      grpc::ABORTED,           grpc::OUT_OF_RANGE,       grpc::UNAVAILABLE,
      grpc::DEADLINE_EXCEEDED, grpc::CANCELLED,          grpc::INTERNAL};
  for (grpc::StatusCode code : codes) {
    const absl::Status s = FromGrpcStatus(grpc::Status(code, "why"), "AppendKv");
    EXPECT_EQ(static_cast<int>(s.code()), static_cast<int>(code));
    EXPECT_EQ(s.message(), "AppendKv: why");
  }
}

// Records AppendKv streams and RegisterModel uploads; fails a stream on request.
class FakeServices final : public v1::SequenceService::Service,
                           public v1::ModelService::Service,
                           public v1::StatsService::Service {
 public:
  grpc::Status GetStats(grpc::ServerContext* /*context*/, const v1::GetStatsRequest* /*request*/,
                        v1::GetStatsResponse* response) override {
    response->mutable_limits()->set_max_chunk_bytes(1000);
    response->mutable_limits()->set_max_message_bytes(8192);
    return grpc::Status::OK;
  }

  grpc::Status AppendKv(grpc::ServerContext* /*context*/,
                        grpc::ServerReader<v1::AppendKvRequest>* reader,
                        v1::AppendKvResponse* response) override {
    v1::AppendKvRequest request;
    std::vector<v1::AppendKvRequest> got;
    while (reader->Read(&request)) {
      got.push_back(request);
      if (request.has_chunk() && request.chunk().layer() == fail_layer_) {
        return grpc::Status(grpc::INVALID_ARGUMENT, "layer rejected");
      }
    }
    absl::MutexLock lock(&mu_);
    appends_.push_back(got);
    response->set_to_history(static_cast<uint32_t>(got.size()));
    return grpc::Status::OK;
  }

  grpc::Status RegisterModel(grpc::ServerContext* /*context*/,
                             grpc::ServerReader<v1::RegisterModelRequest>* reader,
                             v1::RegisterModelResponse* response) override {
    v1::RegisterModelRequest request;
    std::string file;
    v1::ModelSpec spec;
    int chunks = 0;
    while (reader->Read(&request)) {
      if (request.has_spec()) spec = request.spec();
      if (request.part_case() == v1::RegisterModelRequest::kRotationFileChunk) {
        file += request.rotation_file_chunk();
        ++chunks;
      }
    }
    absl::MutexLock lock(&mu_);
    uploaded_ = file;
    upload_chunks_ = chunks;
    response->mutable_model()->set_model_id(spec.model_id());
    response->mutable_model()->mutable_shape()->set_num_layers(
        static_cast<int>(spec.upload_size()));
    return grpc::Status::OK;
  }

  void set_fail_layer(int layer) { fail_layer_ = layer; }
  std::vector<std::vector<v1::AppendKvRequest>> appends() {
    absl::MutexLock lock(&mu_);
    return appends_;
  }
  std::string uploaded() {
    absl::MutexLock lock(&mu_);
    return uploaded_;
  }
  int upload_chunks() {
    absl::MutexLock lock(&mu_);
    return upload_chunks_;
  }

 private:
  int fail_layer_ = -1;
  absl::Mutex mu_;
  std::vector<std::vector<v1::AppendKvRequest>> appends_;
  std::string uploaded_;
  int upload_chunks_ = 0;
};

class ClientAgainstFakeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(static_cast<v1::SequenceService::Service*>(&fake_));
    builder.RegisterService(static_cast<v1::ModelService::Service*>(&fake_));
    builder.RegisterService(static_cast<v1::StatsService::Service*>(&fake_));
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ClientOptions options;
    options.chunk_bytes = 4096;  // small, to force many chunks
    options.deadline = absl::Seconds(120);
    auto client = KvpoolClient::Connect("127.0.0.1:" + std::to_string(port), options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }
  void TearDown() override { server_->Shutdown(); }

  FakeServices fake_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<KvpoolClient> client_;
};

TEST_F(ClientAgainstFakeTest, AppendStreamSplitsLayersIntoOrderedChunksUnderTheLimit) {
  const uint32_t tokens = 100;
  const size_t row = 96;  // bytes of one token's k (or v)
  std::string k(tokens * row, '\0'), v(tokens * row, '\0');
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<char>(i % 251);
    v[i] = static_cast<char>(i % 241);
  }
  v1::AppendKvHeader header;
  header.set_sequence_id("s");
  header.set_num_tokens(tokens);
  header.set_dtype(v1::DTYPE_BF16);
  auto stream = client_->OpenAppend(header);
  ASSERT_TRUE(stream.ok()) << stream.status();
  for (int layer : {1, 0}) {  // any layer order
    ASSERT_TRUE((*stream)->WriteLayer(layer, 0, tokens, k, v).ok());
  }
  auto done = (*stream)->Finish();
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ((*stream)->bytes_sent(), 2 * 2 * k.size());

  const auto appends = fake_.appends();
  ASSERT_EQ(appends.size(), 1u);
  const auto& msgs = appends[0];
  ASSERT_TRUE(msgs[0].has_header());
  EXPECT_EQ(msgs[0].header().sequence_id(), "s");
  std::string got_k[2], got_v[2];
  uint32_t next[2] = {0, 0};
  for (size_t i = 1; i < msgs.size(); ++i) {
    ASSERT_TRUE(msgs[i].has_chunk());
    const v1::KvChunk& c = msgs[i].chunk();
    EXPECT_LE(c.k().size() + c.v().size(), 4096u);
    EXPECT_EQ(c.token_offset(), next[c.layer()]);
    EXPECT_EQ(c.k().size(), c.num_tokens() * row);
    next[c.layer()] += c.num_tokens();
    got_k[c.layer()] += c.k();
    got_v[c.layer()] += c.v();
  }
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(next[l], tokens);
    EXPECT_EQ(got_k[l], k);
    EXPECT_EQ(got_v[l], v);
  }
}

TEST_F(ClientAgainstFakeTest, AppendStreamReportsTheServersError) {
  fake_.set_fail_layer(2);
  v1::AppendKvHeader header;
  header.set_sequence_id("s");
  header.set_num_tokens(8);
  const std::string kv(8 * 64, 'x');
  const LayerKv layers[] = {{0, kv, kv}, {1, kv, kv}, {2, kv, kv}, {3, kv, kv}};
  const absl::StatusOr<v1::AppendKvResponse> r = client_->AppendKv(header, layers);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("layer rejected"), absl::string_view::npos) << r.status();
}

TEST_F(ClientAgainstFakeTest, AppendStreamChecksSizesBeforeSending) {
  v1::AppendKvHeader header;
  header.set_sequence_id("s");
  header.set_num_tokens(3);
  auto stream = client_->OpenAppend(header);
  ASSERT_TRUE(stream.ok());
  EXPECT_EQ((*stream)->WriteLayer(0, 0, 3, std::string(10, 'k'), std::string(10, 'v')).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*stream)->WriteLayer(0, 0, 3, std::string(12, 'k'), std::string(9, 'v')).code(),
            absl::StatusCode::kInvalidArgument);
  (*stream)->Cancel();
  EXPECT_FALSE((*stream)->Finish().ok());
}

TEST_F(ClientAgainstFakeTest, RegisterModelUploadsTheFileInChunks) {
  std::string file(10000, '\0');
  for (size_t i = 0; i < file.size(); ++i) file[i] = static_cast<char>(i * 13);
  v1::ModelSpec spec;
  spec.set_model_id("m");
  auto r = client_->RegisterModel(spec, file);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->model().model_id(), "m");
  EXPECT_EQ(r->model().shape().num_layers(), 10000) << "upload_size was set to the file size";
  EXPECT_EQ(fake_.uploaded(), file);
  EXPECT_EQ(fake_.upload_chunks(), 5);  // 4 x 2048 + 1808: half a K+V payload each
}

TEST_F(ClientAgainstFakeTest, FitToServerLimitsShrinksChunksBelowTheServersLimits) {
  EXPECT_EQ(client_->chunk_bytes(), 4096u);
  KV_EXPECT_OK(client_->FitToServerLimits());
  EXPECT_EQ(client_->chunk_bytes(), 2000u);  // k and v at most max_chunk_bytes = 1000 each
  v1::AppendKvHeader header;
  header.set_sequence_id("s");
  header.set_num_tokens(50);
  const std::string kv(50 * 64, 'x');
  const LayerKv layers[] = {{0, kv, kv}};
  ASSERT_TRUE(client_->AppendKv(header, layers).ok());
  const auto appends = fake_.appends();
  ASSERT_FALSE(appends.empty());
  int chunks = 0;
  for (const v1::AppendKvRequest& m : appends.back()) {
    if (!m.has_chunk()) continue;
    EXPECT_LE(m.chunk().k().size(), 1000u);
    ++chunks;
  }
  EXPECT_EQ(chunks, 4);  // 50 tokens of 64 bytes: 15 + 15 + 15 + 5
}

TEST(KvpoolClientTest, UnreachableServerIsUnavailable) {
  ClientOptions options;
  options.deadline = absl::Seconds(30);
  // Port 1 on loopback: nothing listens there.
  auto client = KvpoolClient::Connect("127.0.0.1:1", options);
  ASSERT_TRUE(client.ok());
  EXPECT_EQ((*client)->GetStats().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ((*client)->WaitForServing(absl::Milliseconds(300)).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(KvpoolClient::Connect("").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvpool::client
