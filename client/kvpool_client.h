// KvpoolClient: the C++ client of kvpoold's kvpool.v1 gRPC API.
//
// A synchronous call per RPC (register, list, describe and delete models; create, append,
// seal, release, describe and look up sequences; read blocks or BF16; attend; stats; health),
// plus AppendStream, a streaming API for layer-wise push: a prefill worker opens one stream
// per prefill chunk and writes each layer as soon as it is computed; the stream splits every
// layer into messages of at most ClientOptions::chunk_bytes of K+V payload, well under gRPC's
// message limit. Requests and responses are the kvpool.v1 protobuf messages
// (proto/kvpool/v1/*.proto documents every field).
//
// Errors are absl::Status values carrying the server's gRPC status code unchanged
// (INVALID_ARGUMENT, NOT_FOUND, ...) and its message, prefixed with the RPC's name. A server
// that cannot be reached gives UNAVAILABLE; a call running past its deadline gives
// DEADLINE_EXCEEDED.
//
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<KvpoolClient> client,
//                           KvpoolClient::Connect("127.0.0.1:50051"));
//   v1::ModelSpec spec;                                    // a data-free Hadamard model
//   spec.set_model_id("llama-70b");
//   spec.mutable_shape()->set_num_layers(80); ...
//   spec.mutable_data_free()->set_kind(v1::ROTATION_KIND_HADAMARD);
//   KVPOOL_ASSIGN_OR_RETURN(v1::RegisterModelResponse reg, client->RegisterModel(spec));
//
//   v1::AppendKvHeader header;                             // push a prefill, layer by layer
//   header.set_sequence_id("req-1"); header.set_num_tokens(4096);
//   header.set_dtype(v1::DTYPE_BF16); header.set_end_of_prefill(true);
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<AppendStream> stream, client->OpenAppend(header));
//   for (int layer = 0; layer < 80; ++layer)
//     KVPOOL_RETURN_IF_ERROR(stream->WriteLayer(layer, 0, 4096, k_bytes[layer], v_bytes[layer]));
//   KVPOOL_ASSIGN_OR_RETURN(v1::AppendKvResponse done, stream->Finish());
//
// Thread-safety: KvpoolClient is thread-safe (one client may serve many threads; each call
// has its own context). An AppendStream is used by one thread at a time.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/client_channel.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "kvpool/v1/attention_service.grpc.pb.h"
#include "kvpool/v1/model_service.grpc.pb.h"
#include "kvpool/v1/read_service.grpc.pb.h"
#include "kvpool/v1/sequence_service.grpc.pb.h"
#include "kvpool/v1/stats_service.grpc.pb.h"
#include "proto/service_stubs.h"
#include "proto/status.h"

namespace kvpool::client {

namespace v1 = ::kvpool::v1;

struct ClientOptions {
  // Deadline of every call (streams included), from its start.
  absl::Duration deadline = absl::Seconds(300);
  // Largest K+V payload of one AppendKv message (a rotation-file chunk is half of it). The
  // server accepts at most GetStats().limits().max_chunk_bytes for k (and for v) and
  // max_message_bytes for a whole message (FitToServerLimits adapts to them). 256 KiB stays far
  // below the defaults and measured fastest on loopback: the daemon stages one message while
  // the next one is already arriving.
  size_t chunk_bytes = size_t{256} << 10;
  // Largest message the client accepts (server-streamed reads send about 1 MiB each).
  int max_receive_message_bytes = 64 << 20;
  // Wait for the channel to connect instead of failing fast with UNAVAILABLE.
  bool wait_for_ready = false;
  // TLS and the bearer token (client_channel.h); default: plaintext, no token.
  ChannelSecurity security;
  // Metadata added to every call (e.g. the scale-out placement, client/routing_client.h).
  std::vector<std::pair<std::string, std::string>> call_metadata;
  // Sent as "x-request-id" on every call, so the daemon's log lines of the call carry it
  // (printable ASCII without spaces, at most 128 bytes; the daemon replaces any other). Empty:
  // the daemon makes one. WithRequestId gives a client with another id on the same channel.
  std::string request_id;
};

// The call metadata key of request ids, and the absl::Status payload holding the id the daemon
// answered for a failed call.
inline constexpr char kRequestIdKey[] = "x-request-id";
inline constexpr char kRequestIdPayloadUrl[] = "kvpool/request-id";

// The request id the daemon answered for the failed call `status` came from (its log lines of
// that call carry it); nullopt when it sent none (e.g. it was not reached).
std::optional<std::string> RequestIdOf(const absl::Status& status);

// The server's gRPC status as an absl::Status (proto/status.h): the same code, the message
// prefixed with the RPC ("AppendKv: ..."). OK stays OK.
using ::kvpool::FromGrpcStatus;

// One piece of a layer's token range: tokens [offset, offset + count) relative to the start.
struct TokenChunk {
  uint32_t offset = 0;
  uint32_t count = 0;
};
// Splits `num_tokens` tokens into consecutive chunks whose payload (`token_bytes` per token,
// K and V together) is at most `max_bytes`; every chunk has at least one token even when one
// token is larger than `max_bytes`. Empty for num_tokens == 0.
std::vector<TokenChunk> PlanTokenChunks(uint32_t num_tokens, size_t token_bytes, size_t max_bytes);

// K and V of one layer for a token range, [num_tokens][kv_heads][head_dim] of the append's
// dtype each. The bytes are not owned.
struct LayerKv {
  int layer = 0;
  absl::string_view k;
  absl::string_view v;
};

// A client-streaming AppendKv in progress. Created by KvpoolClient::OpenAppend with the header
// already sent; states: open (Write* allowed) -> finished (Finish called, or a write failed:
// then every further call returns the server's error). Destroying an open stream cancels it,
// and the server rolls the append back.
class AppendStream {
 public:
  ~AppendStream();
  AppendStream(const AppendStream&) = delete;
  AppendStream& operator=(const AppendStream&) = delete;

  // Sends K and V of `layer` for header tokens [token_offset, token_offset + num_tokens), split
  // into messages of at most ClientOptions::chunk_bytes. `k` and `v` must have the same size, a
  // multiple of num_tokens (InvalidArgument otherwise, nothing sent). When the server has
  // already failed the call, returns its status (the stream is then finished).
  [[nodiscard]] absl::Status WriteLayer(int layer, uint32_t token_offset, uint32_t num_tokens,
                                        absl::string_view k, absl::string_view v);
  // Sends one message as it is (no splitting, no checks): for tests of server validation.
  [[nodiscard]] absl::Status WriteRaw(const v1::AppendKvRequest& request);
  // Half-closes and waits for the server's answer: the committed append, or why not.
  [[nodiscard]] absl::StatusOr<v1::AppendKvResponse> Finish();
  // Cancels the call; the server rolls the append back. Finish then returns CANCELLED.
  void Cancel();

  // Payload bytes (k + v) and messages sent so far.
  uint64_t bytes_sent() const { return bytes_sent_; }
  uint64_t messages_sent() const { return messages_sent_; }

 private:
  friend class KvpoolClient;
  AppendStream() = default;
  absl::Status Fail();

  // Writes one serialized AppendKvRequest; false when the call has failed.
  bool WriteSerialized(grpc::ByteBuffer* message);

  size_t chunk_bytes_ = 0;
  std::unique_ptr<grpc::ClientContext> context_;
  // Messages go out pre-serialized: a chunk's K and V bytes are copied once, straight into
  // the outgoing buffer (no copy into a protobuf message first).
  grpc::ByteBuffer response_bytes_;
  v1::AppendKvResponse response_;
  std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer_;
  absl::Status final_status_;
  bool finished_ = false;
  uint64_t bytes_sent_ = 0;
  uint64_t messages_sent_ = 0;
};

// DescribeModel's answer: the model and, when requested, its effective rotation per layer.
struct ModelDescription {
  v1::ModelInfo info;
  std::vector<v1::RotationLayer> rotation;  // layer order; empty unless requested
};

// ReadBlocks' answer, gathered per layer: attention-ready storage in the rotated basis. An
// incremental read (request.since) holds only what it sent: sink rows from the header's
// sink_token_start, blocks from history_block_start, recent rows from recent_token_start.
struct LayerBlocks {
  int layer = 0;
  std::vector<v1::KvBlock> blocks;  // history blocks in block_index order
  std::string sink_k, sink_v;       // BF16 [sink rows sent][kv_heads][head_dim]
  std::string recent_k, recent_v;   // BF16 [recent rows sent][kv_heads][head_dim]
};
struct BlocksRead {
  v1::ReadBlocksHeader header;
  std::vector<LayerBlocks> layers;  // header.layers() order
};

// ReadKv's answer, gathered per layer: dequantized K and V in the original basis.
struct LayerRows {
  int layer = 0;
  std::string k, v;  // [num_tokens][kv_heads][head_dim] of header.dtype()
};
struct KvRead {
  v1::ReadKvHeader header;
  std::vector<LayerRows> layers;  // header.layers() order
};

class KvpoolClient {
 public:
  using ServingStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;

  // Creates a client for `target` ("host:port"). Does not contact the server (the first call
  // connects); InvalidArgument for an empty target.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<KvpoolClient>> Connect(
      const std::string& target, const ClientOptions& options = {});

  const std::string& target() const { return target_; }
  const ClientOptions& options() const { return options_; }
  // The channel and stubs, for callers that need the raw API (e.g. deliberately malformed
  // requests in tests).
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  v1::ModelService::Stub* models() const { return stubs_->models.get(); }
  v1::SequenceService::Stub* sequences() const { return stubs_->sequences.get(); }
  v1::ReadService::Stub* reads() const { return stubs_->reads.get(); }
  v1::AttentionService::Stub* attention() const { return stubs_->attention.get(); }
  v1::StatsService::Stub* stats() const { return stubs_->stats.get(); }
  // A context with the client's deadline, wait-for-ready setting and call metadata.
  std::unique_ptr<grpc::ClientContext> NewContext() const;
  // A client on the same channel (no new connection) whose calls carry `call_metadata` instead.
  std::unique_ptr<KvpoolClient> WithCallMetadata(
      std::vector<std::pair<std::string, std::string>> call_metadata) const;
  // A client on the same channel whose calls carry the request id `request_id`.
  std::unique_ptr<KvpoolClient> WithRequestId(std::string request_id) const;

  // Asks the server for its limits (GetStats) and lowers the AppendKv and rotation-file chunk
  // size so that every message fits them: k and v each at most limits.max_chunk_bytes, the
  // whole message well under limits.max_message_bytes. Thread-safe; streams opened later use
  // the new size. Returns GetStats' error, if any.
  [[nodiscard]] absl::Status FitToServerLimits();
  // The K+V payload bytes of one AppendKv message streams use now.
  size_t chunk_bytes() const { return chunk_bytes_.load(); }

  // --- health (grpc.health.v1) ---
  // The serving status of `service` ("" = the whole server).
  [[nodiscard]] absl::StatusOr<ServingStatus> Health(const std::string& service = "") const;
  // Polls Health until SERVING or `timeout` passes (DeadlineExceeded, with the last error).
  [[nodiscard]] absl::Status WaitForServing(absl::Duration timeout) const;

  // --- ModelService ---
  // Registers a model. With a non-empty `rotation_file`, its bytes are uploaded in chunks and
  // spec.upload_size is set to its size (the spec's rotation source is replaced); otherwise
  // the spec names a server path or a data-free rotation.
  [[nodiscard]] absl::StatusOr<v1::RegisterModelResponse> RegisterModel(
      v1::ModelSpec spec, absl::string_view rotation_file = {}) const;
  [[nodiscard]] absl::StatusOr<std::vector<v1::ModelInfo>> ListModels() const;
  [[nodiscard]] absl::StatusOr<ModelDescription> DescribeModel(const std::string& model_id,
                                                               bool include_rotation) const;
  [[nodiscard]] absl::StatusOr<v1::DeleteModelResponse> DeleteModel(const std::string& model_id,
                                                                    bool force) const;

  // --- SequenceService ---
  [[nodiscard]] absl::StatusOr<v1::CreateSequenceResponse> CreateSequence(
      const v1::CreateSequenceRequest& request) const;
  // Convenience: an empty sequence `sequence_id` of `model_id`.
  [[nodiscard]] absl::StatusOr<v1::CreateSequenceResponse> CreateSequence(
      const std::string& model_id, const std::string& sequence_id) const;
  // Opens an AppendKv stream and sends `header`.
  [[nodiscard]] absl::StatusOr<std::unique_ptr<AppendStream>> OpenAppend(
      const v1::AppendKvHeader& header) const;
  // One whole append: opens a stream, writes every layer of `layers` (each covering all
  // header.num_tokens() tokens) in order, finishes.
  [[nodiscard]] absl::StatusOr<v1::AppendKvResponse> AppendKv(
      const v1::AppendKvHeader& header, absl::Span<const LayerKv> layers) const;
  [[nodiscard]] absl::StatusOr<v1::AppendDecodeResponse> AppendDecode(
      const v1::AppendDecodeRequest& request) const;
  [[nodiscard]] absl::StatusOr<v1::SequenceInfo> SealSequence(const std::string& sequence_id) const;
  [[nodiscard]] absl::StatusOr<v1::ReleaseSequenceResponse> ReleaseSequence(
      const std::string& sequence_id) const;
  [[nodiscard]] absl::StatusOr<v1::SequenceInfo> DescribeSequence(
      const std::string& sequence_id) const;
  [[nodiscard]] absl::StatusOr<v1::LookupPrefixResponse> LookupPrefix(
      const std::string& model_id, absl::Span<const uint32_t> token_ids) const;

  // --- ReadService ---
  // Reads and gathers the stream; DataLoss when the stream is not in the documented order.
  [[nodiscard]] absl::StatusOr<BlocksRead> ReadBlocks(const v1::ReadBlocksRequest& request) const;
  [[nodiscard]] absl::StatusOr<KvRead> ReadKv(const v1::ReadKvRequest& request) const;

  // --- AttentionService ---
  [[nodiscard]] absl::StatusOr<v1::AttendResponse> Attend(const v1::AttendRequest& request) const;

  // --- StatsService ---
  [[nodiscard]] absl::StatusOr<v1::GetStatsResponse> GetStats(bool include_sequences = false) const;

  // --- AdminService (admin role) ---
  // Begins the daemon's drain (as SIGTERM); the serving state after the call.
  [[nodiscard]] absl::StatusOr<v1::DrainResponse> Drain() const;
  // Re-reads the daemon's tenants file (as SIGHUP); the number of tenants now in force.
  [[nodiscard]] absl::StatusOr<v1::ReloadTenantsResponse> ReloadTenants() const;

 private:
  KvpoolClient() = default;

  std::string target_;
  ClientOptions options_;
  std::atomic<size_t> chunk_bytes_{0};
  std::shared_ptr<grpc::Channel> channel_;
  // Shared with the clients WithCallMetadata makes (stubs are thread-safe).
  std::shared_ptr<grpc::health::v1::Health::Stub> health_;
  std::shared_ptr<ServiceStubs> stubs_;
  // SequenceService.AppendKv as a client-streaming method of pre-serialized messages.
  std::shared_ptr<grpc::internal::RpcMethod> append_kv_;
};

}  // namespace kvpool::client
