#include "client/kvpool_client.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "google/protobuf/io/coded_stream.h"
#include "proto/dtype.h"

namespace kvpool::client {
namespace {

std::chrono::system_clock::time_point DeadlineAfter(absl::Duration d) {
  return std::chrono::system_clock::now() + absl::ToChronoMilliseconds(d);
}

absl::Status StreamOrderError(absl::string_view rpc, absl::string_view what) {
  return absl::DataLossError(absl::StrCat(rpc, ": unexpected stream order: ", what));
}

constexpr char kAppendKvMethod[] = "/kvpool.v1.SequenceService/AppendKv";

// A protobuf message as one outgoing buffer.
grpc::ByteBuffer SerializeMessage(const google::protobuf::MessageLite& message) {
  const size_t size = message.ByteSizeLong();
  grpc_slice slice = grpc_slice_malloc(size);
  message.SerializeWithCachedSizesToArray(GRPC_SLICE_START_PTR(slice));
  grpc::Slice owned(slice, grpc::Slice::STEAL_REF);
  return grpc::ByteBuffer(&owned, 1);
}

// AppendKvRequest{chunk: KvChunk{layer, token_offset, num_tokens, k, v}} in protobuf's wire
// format, written directly into one outgoing buffer: K and V are copied once.
grpc::ByteBuffer SerializeChunk(int layer, uint32_t token_offset, uint32_t num_tokens,
                                absl::string_view k, absl::string_view v) {
  using google::protobuf::io::CodedOutputStream;
  constexpr uint32_t kLengthDelimited = 2;
  auto tag = [](int field) { return (static_cast<uint32_t>(field) << 3) | kLengthDelimited; };
  auto field_size = [&](int field, size_t bytes) {
    return CodedOutputStream::VarintSize32(tag(field)) + CodedOutputStream::VarintSize64(bytes) +
           bytes;
  };
  v1::KvChunk head;  // the small fields; K and V follow (field order is free on the wire)
  head.set_layer(layer);
  head.set_token_offset(token_offset);
  head.set_num_tokens(num_tokens);
  const size_t head_bytes = head.ByteSizeLong();
  const size_t chunk_bytes = head_bytes + field_size(v1::KvChunk::kKFieldNumber, k.size()) +
                             field_size(v1::KvChunk::kVFieldNumber, v.size());
  const size_t total = field_size(v1::AppendKvRequest::kChunkFieldNumber, chunk_bytes);
  grpc_slice slice = grpc_slice_malloc(total);
  uint8_t* p = GRPC_SLICE_START_PTR(slice);
  auto put_field = [&](int field, size_t bytes) {
    p = CodedOutputStream::WriteVarint32ToArray(tag(field), p);
    p = CodedOutputStream::WriteVarint64ToArray(bytes, p);
  };
  put_field(v1::AppendKvRequest::kChunkFieldNumber, chunk_bytes);
  p = head.SerializeWithCachedSizesToArray(p);
  put_field(v1::KvChunk::kKFieldNumber, k.size());
  if (!k.empty()) std::memcpy(p, k.data(), k.size());
  p += k.size();
  put_field(v1::KvChunk::kVFieldNumber, v.size());
  if (!v.empty()) std::memcpy(p, v.data(), v.size());
  grpc::Slice owned(slice, grpc::Slice::STEAL_REF);
  return grpc::ByteBuffer(&owned, 1);
}

// A failed call's status (FromGrpcStatus) with the request id the server answered (it sends
// one in the trailing metadata of a failure and in the initial metadata of every call).
absl::Status CallFailure(const grpc::Status& status, const grpc::ClientContext& context,
                         absl::string_view rpc) {
  absl::Status failure = FromGrpcStatus(status, rpc);
  for (const auto* metadata :
       {&context.GetServerTrailingMetadata(), &context.GetServerInitialMetadata()}) {
    const auto it = metadata->find(kRequestIdKey);
    if (it != metadata->end()) {
      failure.SetPayload(kRequestIdPayloadUrl,
                         absl::Cord(absl::string_view(it->second.data(), it->second.size())));
      break;
    }
  }
  return failure;
}

}  // namespace

std::vector<TokenChunk> PlanTokenChunks(uint32_t num_tokens, size_t token_bytes, size_t max_bytes) {
  std::vector<TokenChunk> chunks;
  if (num_tokens == 0) return chunks;
  const size_t per_chunk =
      token_bytes == 0 ? num_tokens : std::max<size_t>(1, max_bytes / token_bytes);
  for (uint64_t offset = 0; offset < num_tokens; offset += per_chunk) {
    const uint64_t count = std::min<uint64_t>(per_chunk, num_tokens - offset);
    chunks.push_back({static_cast<uint32_t>(offset), static_cast<uint32_t>(count)});
  }
  return chunks;
}

std::optional<std::string> RequestIdOf(const absl::Status& status) {
  const auto id = status.GetPayload(kRequestIdPayloadUrl);
  if (!id.has_value()) return std::nullopt;
  return std::string(*id);
}

// ---------------------------------------------------------------------------------------------
// AppendStream

AppendStream::~AppendStream() {
  if (!finished_) Cancel();
}

absl::Status AppendStream::Fail() {
  // A failed write means the server has finished the call: collect its status.
  if (!finished_) {
    final_status_ = CallFailure(writer_->Finish(), *context_, "AppendKv");
    if (final_status_.ok()) {
      final_status_ = absl::InternalError("AppendKv: the server ended the stream early");
    }
    finished_ = true;
  }
  return final_status_;
}

bool AppendStream::WriteSerialized(grpc::ByteBuffer* message) { return writer_->Write(*message); }

absl::Status AppendStream::WriteLayer(int layer, uint32_t token_offset, uint32_t num_tokens,
                                      absl::string_view k, absl::string_view v) {
  if (finished_) {
    return final_status_.ok() ? absl::FailedPreconditionError("AppendKv: stream already finished")
                              : final_status_;
  }
  if (num_tokens == 0 || k.size() != v.size() || k.size() % num_tokens != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("AppendKv: layer ", layer, ": k (", k.size(), " bytes) and v (", v.size(),
                     " bytes) must be equal non-empty multiples of num_tokens (", num_tokens, ")"));
  }
  const size_t row_bytes = k.size() / num_tokens;
  for (const TokenChunk& c : PlanTokenChunks(num_tokens, 2 * row_bytes, chunk_bytes_)) {
    const size_t bytes = c.count * row_bytes;
    grpc::ByteBuffer message = SerializeChunk(layer, token_offset + c.offset, c.count,
                                              k.substr(c.offset * row_bytes, bytes),
                                              v.substr(c.offset * row_bytes, bytes));
    if (!WriteSerialized(&message)) return Fail();
    bytes_sent_ += 2 * bytes;
    ++messages_sent_;
  }
  return absl::OkStatus();
}

absl::Status AppendStream::WriteRaw(const v1::AppendKvRequest& request) {
  if (finished_) {
    return final_status_.ok() ? absl::FailedPreconditionError("AppendKv: stream already finished")
                              : final_status_;
  }
  grpc::ByteBuffer message = SerializeMessage(request);
  if (!WriteSerialized(&message)) return Fail();
  ++messages_sent_;
  return absl::OkStatus();
}

absl::StatusOr<v1::AppendKvResponse> AppendStream::Finish() {
  if (!finished_) {
    writer_->WritesDone();
    final_status_ = CallFailure(writer_->Finish(), *context_, "AppendKv");
    if (final_status_.ok() &&
        !grpc::SerializationTraits<v1::AppendKvResponse>::Deserialize(&response_bytes_, &response_)
             .ok()) {
      final_status_ = absl::DataLossError("AppendKv: the response does not parse");
    }
    finished_ = true;
  }
  if (!final_status_.ok()) return final_status_;
  return response_;
}

void AppendStream::Cancel() {
  if (finished_) return;
  context_->TryCancel();
  final_status_ = CallFailure(writer_->Finish(), *context_, "AppendKv");
  if (final_status_.ok()) final_status_ = absl::CancelledError("AppendKv: cancelled");
  finished_ = true;
}

// ---------------------------------------------------------------------------------------------
// KvpoolClient

absl::StatusOr<std::unique_ptr<KvpoolClient>> KvpoolClient::Connect(const std::string& target,
                                                                    const ClientOptions& options) {
  if (target.empty()) return absl::InvalidArgumentError("empty target (expected host:port)");
  if (options.chunk_bytes < 64) return absl::InvalidArgumentError("chunk_bytes must be >= 64");
  auto client = std::unique_ptr<KvpoolClient>(new KvpoolClient());
  client->target_ = target;
  client->options_ = options;
  client->chunk_bytes_ = options.chunk_bytes;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  args.SetMaxSendMessageSize(-1);  // the server enforces its own limit, with a clear status
  // Each client gets its own connection (no sharing of subchannels between clients).
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      OpenChannel(target, options.security, args);
  if (!channel.ok()) return channel.status();
  client->channel_ = *std::move(channel);
  client->health_ = grpc::health::v1::Health::NewStub(client->channel_);
  client->stubs_ = std::make_unique<ServiceStubs>(client->channel_);
  client->append_kv_ = std::make_unique<grpc::internal::RpcMethod>(
      kAppendKvMethod, grpc::internal::RpcMethod::CLIENT_STREAMING, client->channel_);
  return client;
}

// One unary call on `context`; a failure becomes an absl::Status naming the RPC.
template <typename Stub, typename Request, typename Response>
absl::StatusOr<Response> CallUnary(
    Stub& stub, grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
    std::unique_ptr<grpc::ClientContext> context, const Request& request, absl::string_view rpc) {
  Response response;
  const grpc::Status s = (stub.*method)(context.get(), request, &response);
  if (!s.ok()) return CallFailure(s, *context, rpc);
  return response;
}

std::unique_ptr<grpc::ClientContext> KvpoolClient::NewContext() const {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(DeadlineAfter(options_.deadline));
  context->set_wait_for_ready(options_.wait_for_ready);
  for (const auto& [key, value] : options_.call_metadata) context->AddMetadata(key, value);
  if (!options_.request_id.empty()) context->AddMetadata(kRequestIdKey, options_.request_id);
  return context;
}

std::unique_ptr<KvpoolClient> KvpoolClient::WithCallMetadata(
    std::vector<std::pair<std::string, std::string>> call_metadata) const {
  auto client = std::unique_ptr<KvpoolClient>(new KvpoolClient());
  client->target_ = target_;
  client->options_ = options_;
  client->options_.call_metadata = std::move(call_metadata);
  client->chunk_bytes_ = chunk_bytes_.load();
  client->channel_ = channel_;
  // The same stubs: registering a channel's methods again would cost more than the call.
  client->health_ = health_;
  client->stubs_ = stubs_;
  client->append_kv_ = append_kv_;
  return client;
}

std::unique_ptr<KvpoolClient> KvpoolClient::WithRequestId(std::string request_id) const {
  std::unique_ptr<KvpoolClient> client = WithCallMetadata(options_.call_metadata);
  client->options_.request_id = std::move(request_id);
  return client;
}

absl::Status KvpoolClient::FitToServerLimits() {
  absl::StatusOr<v1::GetStatsResponse> stats = GetStats();
  if (!stats.ok()) return stats.status();
  const v1::ServerLimits& l = stats->limits();
  size_t fit = chunk_bytes_.load();
  // k and v are equal halves of a chunk's payload; leave room for the message's other fields.
  if (l.max_chunk_bytes() > 0) fit = std::min<size_t>(fit, 2 * l.max_chunk_bytes());
  if (l.max_message_bytes() > 0) {
    fit = std::min<size_t>(
        fit, l.max_message_bytes() - std::min<size_t>(l.max_message_bytes() / 2, size_t{4096}));
  }
  chunk_bytes_ = std::max<size_t>(fit, 64);
  return absl::OkStatus();
}

absl::StatusOr<KvpoolClient::ServingStatus> KvpoolClient::Health(const std::string& service) const {
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  auto context = NewContext();
  const grpc::Status s = health_->Check(context.get(), request, &response);
  if (!s.ok()) return CallFailure(s, *context, "Health");
  return response.status();
}

absl::Status KvpoolClient::WaitForServing(absl::Duration timeout) const {
  const absl::Time give_up = absl::Now() + timeout;
  absl::Status last = absl::UnavailableError("not tried");
  while (true) {
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
    grpc::ClientContext context;
    const absl::Duration left = give_up - absl::Now();
    context.set_deadline(
        DeadlineAfter(std::max(absl::Milliseconds(50), std::min(left, absl::Seconds(2)))));
    context.set_wait_for_ready(true);
    const grpc::Status s = health_->Check(&context, request, &response);
    if (s.ok() && response.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
      return absl::OkStatus();
    }
    last = s.ok()
               ? absl::UnavailableError(absl::StrCat(
                     "Health: status ",
                     grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status())))
               : FromGrpcStatus(s, "Health");
    if (absl::Now() >= give_up) {
      return absl::DeadlineExceededError(absl::StrCat(target_, " not SERVING after ",
                                                      absl::FormatDuration(timeout),
                                                      " (last: ", last.ToString(), ")"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

absl::StatusOr<v1::RegisterModelResponse> KvpoolClient::RegisterModel(
    v1::ModelSpec spec, absl::string_view rotation_file) const {
  if (!rotation_file.empty()) spec.set_upload_size(rotation_file.size());
  auto context = NewContext();
  v1::RegisterModelResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::RegisterModelRequest>> writer =
      stubs_->models->RegisterModel(context.get(), &response);
  v1::RegisterModelRequest request;
  *request.mutable_spec() = std::move(spec);
  bool ok = writer->Write(request);
  // A rotation-file chunk is bounded like one of k or v: half a K+V payload.
  const size_t chunk = std::max<size_t>(chunk_bytes_.load() / 2, 64);
  for (size_t at = 0; ok && at < rotation_file.size(); at += chunk) {
    const size_t n = std::min(chunk, rotation_file.size() - at);
    request.set_rotation_file_chunk(rotation_file.data() + at, n);
    ok = writer->Write(request);
  }
  if (ok) writer->WritesDone();
  const grpc::Status s = writer->Finish();
  if (!s.ok()) return CallFailure(s, *context, "RegisterModel");
  return response;
}

absl::StatusOr<std::vector<v1::ModelInfo>> KvpoolClient::ListModels() const {
  auto context = NewContext();
  v1::ListModelsResponse response;
  const grpc::Status s =
      stubs_->models->ListModels(context.get(), v1::ListModelsRequest(), &response);
  if (!s.ok()) return CallFailure(s, *context, "ListModels");
  return std::vector<v1::ModelInfo>(response.models().begin(), response.models().end());
}

absl::StatusOr<ModelDescription> KvpoolClient::DescribeModel(const std::string& model_id,
                                                             bool include_rotation) const {
  v1::DescribeModelRequest request;
  request.set_model_id(model_id);
  request.set_include_rotation(include_rotation);
  auto context = NewContext();
  std::unique_ptr<grpc::ClientReader<v1::DescribeModelResponse>> reader =
      stubs_->models->DescribeModel(context.get(), request);
  ModelDescription out;
  bool have_model = false;
  v1::DescribeModelResponse message;
  absl::Status order;
  while (reader->Read(&message)) {
    if (!order.ok()) continue;  // drain
    if (message.has_model()) {
      if (have_model) order = StreamOrderError("DescribeModel", "a second model message");
      out.info = message.model();
      have_model = true;
    } else if (message.has_rotation()) {
      if (!have_model || message.rotation().layer() != static_cast<int>(out.rotation.size())) {
        order = StreamOrderError("DescribeModel", "rotation layers out of order");
      }
      out.rotation.push_back(message.rotation());
    }
  }
  const grpc::Status s = reader->Finish();
  if (!s.ok()) return CallFailure(s, *context, "DescribeModel");
  if (!order.ok()) return order;
  if (!have_model) return StreamOrderError("DescribeModel", "no model message");
  return out;
}

absl::StatusOr<v1::DeleteModelResponse> KvpoolClient::DeleteModel(const std::string& model_id,
                                                                  bool force) const {
  v1::DeleteModelRequest request;
  request.set_model_id(model_id);
  request.set_force(force);
  return CallUnary(*stubs_->models, &v1::ModelService::Stub::DeleteModel, NewContext(), request,
                   "DeleteModel");
}

absl::StatusOr<v1::CreateSequenceResponse> KvpoolClient::CreateSequence(
    const v1::CreateSequenceRequest& request) const {
  return CallUnary(*stubs_->sequences, &v1::SequenceService::Stub::CreateSequence, NewContext(),
                   request, "CreateSequence");
}

absl::StatusOr<v1::CreateSequenceResponse> KvpoolClient::CreateSequence(
    const std::string& model_id, const std::string& sequence_id) const {
  v1::CreateSequenceRequest request;
  request.set_model_id(model_id);
  request.set_sequence_id(sequence_id);
  return CreateSequence(request);
}

absl::StatusOr<std::unique_ptr<AppendStream>> KvpoolClient::OpenAppend(
    const v1::AppendKvHeader& header) const {
  auto stream = std::unique_ptr<AppendStream>(new AppendStream());
  stream->chunk_bytes_ = chunk_bytes_.load();
  stream->context_ = NewContext();
  stream->writer_.reset(grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(
      channel_.get(), *append_kv_, stream->context_.get(), &stream->response_bytes_));
  v1::AppendKvRequest request;
  *request.mutable_header() = header;
  grpc::ByteBuffer message = SerializeMessage(request);
  if (!stream->WriteSerialized(&message)) return stream->Fail();
  ++stream->messages_sent_;
  return stream;
}

absl::StatusOr<v1::AppendKvResponse> KvpoolClient::AppendKv(
    const v1::AppendKvHeader& header, absl::Span<const LayerKv> layers) const {
  absl::StatusOr<std::unique_ptr<AppendStream>> stream = OpenAppend(header);
  if (!stream.ok()) return stream.status();
  for (const LayerKv& l : layers) {
    absl::Status s = (*stream)->WriteLayer(l.layer, 0, header.num_tokens(), l.k, l.v);
    if (!s.ok()) {
      (*stream)->Cancel();
      return s;
    }
  }
  return (*stream)->Finish();
}

absl::StatusOr<v1::AppendDecodeResponse> KvpoolClient::AppendDecode(
    const v1::AppendDecodeRequest& request) const {
  return CallUnary(*stubs_->sequences, &v1::SequenceService::Stub::AppendDecode, NewContext(),
                   request, "AppendDecode");
}

absl::StatusOr<v1::SequenceInfo> KvpoolClient::SealSequence(const std::string& sequence_id) const {
  v1::SealSequenceRequest request;
  request.set_sequence_id(sequence_id);
  KVPOOL_ASSIGN_OR_RETURN(v1::SealSequenceResponse response,
                          CallUnary(*stubs_->sequences, &v1::SequenceService::Stub::SealSequence,
                                    NewContext(), request, "SealSequence"));
  return response.sequence();
}

absl::StatusOr<v1::ReleaseSequenceResponse> KvpoolClient::ReleaseSequence(
    const std::string& sequence_id) const {
  v1::ReleaseSequenceRequest request;
  request.set_sequence_id(sequence_id);
  return CallUnary(*stubs_->sequences, &v1::SequenceService::Stub::ReleaseSequence, NewContext(),
                   request, "ReleaseSequence");
}

absl::StatusOr<v1::SequenceInfo> KvpoolClient::DescribeSequence(
    const std::string& sequence_id) const {
  v1::DescribeSequenceRequest request;
  request.set_sequence_id(sequence_id);
  return CallUnary(*stubs_->sequences, &v1::SequenceService::Stub::DescribeSequence, NewContext(),
                   request, "DescribeSequence");
}

absl::StatusOr<v1::LookupPrefixResponse> KvpoolClient::LookupPrefix(
    const std::string& model_id, absl::Span<const uint32_t> token_ids) const {
  v1::LookupPrefixRequest request;
  request.set_model_id(model_id);
  request.mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
  return CallUnary(*stubs_->sequences, &v1::SequenceService::Stub::LookupPrefix, NewContext(),
                   request, "LookupPrefix");
}

absl::StatusOr<BlocksRead> KvpoolClient::ReadBlocks(const v1::ReadBlocksRequest& request) const {
  constexpr absl::string_view kRpc = "ReadBlocks";
  auto context = NewContext();
  std::unique_ptr<grpc::ClientReader<v1::ReadBlocksResponse>> reader =
      stubs_->reads->ReadBlocks(context.get(), request);
  BlocksRead out;
  bool have_header = false;
  size_t row_bytes = 0;
  uint64_t sink_start = 0, block_start = 0, recent_start = 0;  // from the header
  int current = -1;                                            // index into out.layers
  absl::Status order;
  v1::ReadBlocksResponse message;

  // Moves `current` forward to the entry for `layer` (layers without data are skipped).
  auto seek = [&](int layer) -> bool {
    if (current >= 0 && out.layers[current].layer == layer) return true;
    for (size_t i = current + 1; i < out.layers.size(); ++i) {
      if (out.layers[i].layer == layer) {
        current = static_cast<int>(i);
        return true;
      }
    }
    return false;
  };

  while (reader->Read(&message)) {
    if (!order.ok()) continue;  // drain the stream, report the first problem
    if (message.has_header()) {
      if (have_header) {
        order = StreamOrderError(kRpc, "a second header");
        continue;
      }
      out.header = message.header();
      have_header = true;
      row_bytes = static_cast<size_t>(out.header.block_layout().kv_heads()) *
                  out.header.block_layout().head_dim() * 2;
      // An incremental read's starts; a daemon that predates them sends zeros, which reads
      // as a full read (the recent rows of a full read start after the history).
      const v1::ReadBlocksHeader& h = out.header;
      const uint32_t bt = h.block_layout().tokens();
      sink_start = h.sink_token_start();
      block_start = h.history_block_start();
      recent_start = std::max<uint64_t>(h.recent_token_start(),
                                        uint64_t{h.sink_tokens()} + h.history_tokens());
      if (bt == 0 || sink_start > h.sink_tokens() ||
          block_start > (uint64_t{h.history_tokens()} + bt - 1) / bt ||
          recent_start > uint64_t{h.sink_tokens()} + h.history_tokens() + h.recent_tokens()) {
        order = StreamOrderError(kRpc, "a header whose starts lie past its tiers");
        continue;
      }
      for (int layer : out.header.layers())
        out.layers.push_back(LayerBlocks{layer, {}, {}, {}, {}, {}});
      continue;
    }
    if (!have_header) {
      order = StreamOrderError(kRpc, "data before the header");
      continue;
    }
    if (message.has_rows()) {
      const v1::Bf16Rows& rows = message.rows();
      if (!seek(rows.layer())) {
        order = StreamOrderError(kRpc, absl::StrCat("rows of unexpected layer ", rows.layer()));
        continue;
      }
      LayerBlocks& l = out.layers[current];
      const bool recent = rows.tier() == v1::BF16_TIER_RECENT;
      std::string& k = recent ? l.recent_k : l.sink_k;
      std::string& v = recent ? l.recent_v : l.sink_v;
      const uint64_t have_tokens = row_bytes == 0 ? 0 : k.size() / row_bytes;
      const uint64_t expect_start = (recent ? recent_start : sink_start) + have_tokens;
      if (rows.token_start() != expect_start || rows.k().size() != rows.num_tokens() * row_bytes ||
          rows.v().size() != rows.num_tokens() * row_bytes) {
        order = StreamOrderError(
            kRpc, absl::StrCat("rows of layer ", rows.layer(), " at token ", rows.token_start()));
        continue;
      }
      k += rows.k();
      v += rows.v();
    } else if (message.has_blocks()) {
      for (const v1::KvBlock& b : message.blocks().blocks()) {
        if (!seek(b.layer())) {
          order = StreamOrderError(kRpc, absl::StrCat("block of unexpected layer ", b.layer()));
          break;
        }
        LayerBlocks& l = out.layers[current];
        if (b.block_index() != block_start + l.blocks.size() ||
            b.data().size() != out.header.block_layout().block_bytes()) {
          order = StreamOrderError(
              kRpc, absl::StrCat("block ", b.block_index(), " of layer ", b.layer()));
          break;
        }
        l.blocks.push_back(b);
      }
    }
  }
  const grpc::Status s = reader->Finish();
  if (!s.ok()) return CallFailure(s, *context, kRpc);
  if (!order.ok()) return order;
  if (!have_header) return StreamOrderError(kRpc, "no header");
  const uint32_t bt = out.header.block_layout().tokens();
  const size_t blocks = bt == 0 ? 0 : (out.header.history_tokens() + bt - 1) / bt - block_start;
  const uint64_t total =
      uint64_t{out.header.sink_tokens()} + out.header.history_tokens() + out.header.recent_tokens();
  for (const LayerBlocks& l : out.layers) {
    if (l.sink_k.size() != (out.header.sink_tokens() - sink_start) * row_bytes ||
        l.recent_k.size() != (total - recent_start) * row_bytes || l.blocks.size() != blocks) {
      return StreamOrderError(kRpc, absl::StrCat("layer ", l.layer, " is incomplete"));
    }
  }
  return out;
}

absl::StatusOr<KvRead> KvpoolClient::ReadKv(const v1::ReadKvRequest& request) const {
  constexpr absl::string_view kRpc = "ReadKv";
  auto context = NewContext();
  std::unique_ptr<grpc::ClientReader<v1::ReadKvResponse>> reader =
      stubs_->reads->ReadKv(context.get(), request);
  KvRead out;
  bool have_header = false;
  size_t row_bytes = 0;
  int current = -1;
  absl::Status order;
  v1::ReadKvResponse message;
  while (reader->Read(&message)) {
    if (!order.ok()) continue;
    if (message.has_header()) {
      if (have_header) {
        order = StreamOrderError(kRpc, "a second header");
        continue;
      }
      out.header = message.header();
      have_header = true;
      row_bytes = static_cast<size_t>(out.header.shape().kv_heads()) *
                  out.header.shape().head_dim() * DTypeSize(out.header.dtype());
      for (int layer : out.header.layers()) out.layers.push_back(LayerRows{layer, {}, {}});
      if (row_bytes == 0) order = StreamOrderError(kRpc, "header with an empty row shape");
      continue;
    }
    if (!have_header || !message.has_rows()) {
      order = StreamOrderError(kRpc, "data before the header");
      continue;
    }
    const v1::KvRows& rows = message.rows();
    // Rows of one layer arrive in token order; a new layer starts at header.token_start.
    if (current < 0 || out.layers[current].layer != rows.layer() ||
        out.layers[current].k.size() == out.header.num_tokens() * row_bytes) {
      ++current;
    }
    if (current >= static_cast<int>(out.layers.size()) ||
        out.layers[current].layer != rows.layer()) {
      order = StreamOrderError(kRpc, absl::StrCat("rows of unexpected layer ", rows.layer()));
      continue;
    }
    LayerRows& l = out.layers[current];
    if (rows.token_start() != out.header.token_start() + l.k.size() / row_bytes ||
        rows.k().size() != rows.num_tokens() * row_bytes ||
        rows.v().size() != rows.num_tokens() * row_bytes) {
      order = StreamOrderError(
          kRpc, absl::StrCat("rows of layer ", rows.layer(), " at token ", rows.token_start()));
      continue;
    }
    l.k += rows.k();
    l.v += rows.v();
  }
  const grpc::Status s = reader->Finish();
  if (!s.ok()) return CallFailure(s, *context, kRpc);
  if (!order.ok()) return order;
  if (!have_header) return StreamOrderError(kRpc, "no header");
  for (const LayerRows& l : out.layers) {
    if (l.k.size() != out.header.num_tokens() * row_bytes) {
      return StreamOrderError(kRpc, absl::StrCat("layer ", l.layer, " is incomplete"));
    }
  }
  return out;
}

absl::StatusOr<v1::AttendResponse> KvpoolClient::Attend(const v1::AttendRequest& request) const {
  return CallUnary(*stubs_->attention, &v1::AttentionService::Stub::Attend, NewContext(), request,
                   "Attend");
}

absl::StatusOr<v1::GetStatsResponse> KvpoolClient::GetStats(bool include_sequences) const {
  v1::GetStatsRequest request;
  request.set_include_sequences(include_sequences);
  return CallUnary(*stubs_->stats, &v1::StatsService::Stub::GetStats, NewContext(), request,
                   "GetStats");
}

absl::StatusOr<v1::DrainResponse> KvpoolClient::Drain() const {
  return CallUnary(*stubs_->admin, &v1::AdminService::Stub::Drain, NewContext(), v1::DrainRequest(),
                   "Drain");
}

absl::StatusOr<v1::ReloadTenantsResponse> KvpoolClient::ReloadTenants() const {
  return CallUnary(*stubs_->admin, &v1::AdminService::Stub::ReloadTenants, NewContext(),
                   v1::ReloadTenantsRequest(), "ReloadTenants");
}

}  // namespace kvpool::client
