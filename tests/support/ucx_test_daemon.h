// Test and benchmark helpers for the data plane: an in-process kvpoold (KvpoolServer on
// 127.0.0.1 with a chosen UCX configuration) plus gRPC helpers to register models, create
// sequences, append and read K/V inline, attend inline and read stats.
//
//   TestDaemonOptions o;
//   o.ucx_tls = "posix,sysv,cma";
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<TestDaemon> d, TestDaemon::Start(o));
//   KVPOOL_RETURN_IF_ERROR(d->RegisterModel(ModelShapeSpec{...}));
//   KVPOOL_RETURN_IF_ERROR(d->CreateSequence("m", "s"));
//
// Thread-safe as its stubs are.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "kvpool/v1/attention_service.grpc.pb.h"
#include "kvpool/v1/model_service.grpc.pb.h"
#include "kvpool/v1/read_service.grpc.pb.h"
#include "kvpool/v1/sequence_service.grpc.pb.h"
#include "kvpool/v1/stats_service.grpc.pb.h"
#include "proto/service_stubs.h"
#include "server/server.h"

namespace kvpool::server::testing {

namespace v1 = ::kvpool::v1;

// One UCX transport selection (UCX_TLS) the transport tests run under; `name` names the case.
struct UcxTls {
  const char* name;
  const char* tls;
};
// The loopback selections: shared memory and TCP.
inline constexpr UcxTls kLoopbackTls[] = {{"shm", "posix,sysv,cma"}, {"tcp", "tcp"}};

struct TestDaemonOptions {
  std::string ucx_tls = "posix,sysv,cma";
  std::string ucx_net_devices = "lo";
  std::string transports = "ucx";
  size_t pool_bytes = size_t{256} << 20;
  size_t slab_bytes = size_t{4} << 20;
  int worker_threads = 2;
  size_t staging_bytes = size_t{16} << 20;
  size_t message_bytes = size_t{1} << 20;
  int idle_timeout_ms = 30000;
  int keepalive_ms = 500;
  std::string log_level = "warn";
};

struct ModelShapeSpec {
  std::string model_id = "m";
  int num_layers = 4;
  int q_heads = 4;
  int kv_heads = 2;
  int head_dim = 32;
  v1::RotationKind rotation = v1::ROTATION_KIND_HADAMARD;
  v1::QuantMethod method = v1::QUANT_METHOD_UNIFORM;
  // Small tiers by default so every path runs: block 8, sink 8, recent 16, demotion 8.
  int block_tokens = 8;
  int sink_tokens = 8;
  int recent_tokens = 16;
};

class TestDaemon {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<TestDaemon>> Start(
      const TestDaemonOptions& options);
  ~TestDaemon();

  KvpoolServer* server() { return server_.get(); }
  std::string target() const { return "127.0.0.1:" + std::to_string(server_->port()); }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  // Shuts the daemon down and destroys it (the gRPC channel stays, failing).
  void Kill();

  [[nodiscard]] absl::Status RegisterModel(const ModelShapeSpec& spec);
  [[nodiscard]] absl::Status CreateSequence(const std::string& model_id, const std::string& id);
  // AppendKv inline: every layer's BF16 K/V bytes ([tokens][kv_heads][head_dim] each), in
  // chunks of at most `chunk_tokens`.
  [[nodiscard]] absl::StatusOr<v1::AppendKvResponse> AppendInline(
      const std::string& id, uint32_t token_start, uint32_t tokens, bool end_of_prefill,
      const std::vector<std::string>& k, const std::vector<std::string>& v,
      uint32_t chunk_tokens = 256);
  // ReadKv of every layer in BF16 (original basis).
  [[nodiscard]] absl::Status ReadAll(const std::string& id, std::vector<std::string>* k,
                                     std::vector<std::string>* v);
  [[nodiscard]] absl::StatusOr<v1::AttendResponse> AttendInline(const v1::AttendRequest& request);
  [[nodiscard]] absl::StatusOr<v1::GetStatsResponse> Stats();
  [[nodiscard]] absl::StatusOr<v1::SequenceInfo> Describe(const std::string& id);
  [[nodiscard]] absl::Status Release(const std::string& id);

 private:
  TestDaemon() = default;
  std::unique_ptr<KvpoolServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<ServiceStubs> stubs_;
};

// Deterministic real-like BF16 rows as bytes: `tokens` x `row_values` values.
std::string TestRowBytes(int tokens, size_t row_values, uint64_t seed);

}  // namespace kvpool::server::testing
