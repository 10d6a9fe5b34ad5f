#include "tests/support/ucx_test_daemon.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "proto/service_stubs.h"
#include "proto/status.h"
#include "server/server_test_util.h"
#include "spdlog/spdlog.h"
#include "tests/support/api_requests.h"

namespace kvpool::server::testing {

namespace {

void Deadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
}

}  // namespace

absl::StatusOr<std::unique_ptr<TestDaemon>> TestDaemon::Start(const TestDaemonOptions& o) {
  ServerConfig cfg;
  cfg.listen = "127.0.0.1:0";
  cfg.pool_bytes = o.pool_bytes;
  cfg.slab_bytes = o.slab_bytes;
  cfg.worker_threads = o.worker_threads;
  cfg.log_level = o.log_level;
  cfg.transports = o.transports;
  cfg.ucx_tls = o.ucx_tls;
  cfg.ucx_net_devices = o.ucx_net_devices;
  cfg.transport_staging_bytes = o.staging_bytes;
  cfg.transport_message_bytes = o.message_bytes;
  cfg.stream_idle_timeout_ms = o.idle_timeout_ms;
  cfg.transport_keepalive_ms = o.keepalive_ms;
  spdlog::set_level(spdlog::level::from_str(o.log_level));
  auto d = std::unique_ptr<TestDaemon>(new TestDaemon());
  absl::StatusOr<std::unique_ptr<KvpoolServer>> s = KvpoolServer::Start(cfg);
  if (!s.ok()) return s.status();
  d->server_ = *std::move(s);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  d->channel_ = grpc::CreateCustomChannel(d->target(), grpc::InsecureChannelCredentials(), args);
  d->stubs_ = std::make_unique<ServiceStubs>(d->channel_);
  return d;
}

TestDaemon::~TestDaemon() { Kill(); }

void TestDaemon::Kill() {
  if (server_ == nullptr) return;
  server_->Shutdown(std::chrono::milliseconds(0));
  server_->Wait();
  server_.reset();
}

absl::Status TestDaemon::RegisterModel(const ModelShapeSpec& spec) {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  v1::RegisterModelResponse resp;
  auto w = stubs_->models->RegisterModel(&ctx, &resp);
  v1::RegisterModelRequest req;
  *req.mutable_spec() =
      kvpool::testing::DataFreeModelSpec(spec.model_id, spec, spec.rotation, /*seed=*/0);
  v1::QuantConfig* q = req.mutable_spec()->mutable_quant();
  q->set_method(spec.method);
  q->set_block_tokens(spec.block_tokens);
  q->set_sink_tokens(spec.sink_tokens);
  q->set_recent_tokens(spec.recent_tokens);
  q->set_demotion_batch(std::min(spec.block_tokens, 16));
  w->Write(req);
  w->WritesDone();
  return FromGrpcStatus(w->Finish(), "RegisterModel");
}

absl::Status TestDaemon::CreateSequence(const std::string& model_id, const std::string& id) {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  v1::CreateSequenceRequest req;
  req.set_model_id(model_id);
  req.set_sequence_id(id);
  v1::CreateSequenceResponse resp;
  return FromGrpcStatus(stubs_->sequences->CreateSequence(&ctx, req, &resp), "CreateSequence");
}

absl::StatusOr<v1::AppendKvResponse> TestDaemon::AppendInline(
    const std::string& id, uint32_t token_start, uint32_t tokens, bool end_of_prefill,
    const std::vector<std::string>& k, const std::vector<std::string>& v, uint32_t chunk_tokens) {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  v1::AppendKvResponse resp;
  auto w = stubs_->sequences->AppendKv(&ctx, &resp);
  bool ok = w->Write(kvpool::testing::AppendHeaderMessage(id, token_start, tokens, v1::DTYPE_BF16,
                                                          end_of_prefill));
  for (size_t layer = 0; layer < k.size() && ok; ++layer) {
    const size_t token_bytes = k[layer].size() / tokens;
    for (uint32_t off = 0; off < tokens && ok; off += chunk_tokens) {
      const uint32_t n = std::min(chunk_tokens, tokens - off);
      ok = w->Write(kvpool::testing::AppendChunkMessage(
          static_cast<int>(layer), off, n, k[layer].substr(off * token_bytes, n * token_bytes),
          v[layer].substr(off * token_bytes, n * token_bytes)));
    }
  }
  w->WritesDone();
  absl::Status s = FromGrpcStatus(w->Finish(), "AppendKv");
  if (!s.ok()) return s;
  return resp;
}

absl::Status TestDaemon::ReadAll(const std::string& id, std::vector<std::string>* k,
                                 std::vector<std::string>* v) {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  v1::ReadKvRequest req;
  req.set_sequence_id(id);
  req.set_dtype(v1::DTYPE_BF16);
  auto r = stubs_->reads->ReadKv(&ctx, req);
  v1::ReadKvResponse msg;
  k->clear();
  v->clear();
  while (r->Read(&msg)) {
    if (!msg.has_rows()) continue;
    const size_t layer = static_cast<size_t>(msg.rows().layer());
    if (k->size() <= layer) {
      k->resize(layer + 1);
      v->resize(layer + 1);
    }
    (*k)[layer] += msg.rows().k();
    (*v)[layer] += msg.rows().v();
  }
  return FromGrpcStatus(r->Finish(), "ReadKv");
}

absl::StatusOr<v1::AttendResponse> TestDaemon::AttendInline(const v1::AttendRequest& request) {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  v1::AttendResponse resp;
  absl::Status s = FromGrpcStatus(stubs_->attention->Attend(&ctx, request, &resp), "Attend");
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::GetStatsResponse> TestDaemon::Stats() {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  v1::GetStatsResponse resp;
  absl::Status s =
      FromGrpcStatus(stubs_->stats->GetStats(&ctx, v1::GetStatsRequest(), &resp), "GetStats");
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::SequenceInfo> TestDaemon::Describe(const std::string& id) {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  v1::DescribeSequenceRequest req;
  req.set_sequence_id(id);
  v1::SequenceInfo resp;
  absl::Status s =
      FromGrpcStatus(stubs_->sequences->DescribeSequence(&ctx, req, &resp), "DescribeSequence");
  if (!s.ok()) return s;
  return resp;
}

absl::Status TestDaemon::Release(const std::string& id) {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  v1::ReleaseSequenceRequest req;
  req.set_sequence_id(id);
  v1::ReleaseSequenceResponse resp;
  return FromGrpcStatus(stubs_->sequences->ReleaseSequence(&ctx, req, &resp), "ReleaseSequence");
}

std::string TestRowBytes(int tokens, size_t row_values, uint64_t seed) {
  std::vector<Bf16> rows = TestRows(tokens, row_values, seed);
  return std::string(reinterpret_cast<const char*>(rows.data()), rows.size() * sizeof(Bf16));
}

}  // namespace kvpool::server::testing
