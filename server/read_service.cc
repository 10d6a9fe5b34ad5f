#include "server/read_service.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "proto/status.h"
#include "server/grpc_reactor_order.h"
#include "server/proto_convert.h"
#include "server/read_cursor.h"
#include "server/read_snapshot.h"
#include "server/read_ticket.h"
#include "server/scaleout/ownership_check.h"

namespace kvpool::server {
namespace {

// Payload bytes aimed for in one streamed message: well under any gRPC limit.
size_t TargetMessageBytes(const ServerConfig& cfg) {
  return std::min<size_t>(size_t{1} << 20, cfg.max_chunk_bytes);
}

template <typename Response>
class ErrorReactor final : public OrderedReactor<grpc::ServerWriteReactor<Response>> {
 public:
  explicit ErrorReactor(const absl::Status& s) { this->Finish(ToGrpcStatus(s)); }
  void OnDone() override {
    AcquireFromGrpc(this);
    delete this;
  }
};

// Between a read's messages: whether to stop because the caller went away (`write_ok` false:
// the stream is broken) or its deadline passed; if so, counts the `layers_left` unread layers.
bool StopIfCancelled(bool write_ok, CallCancellation* cancel, size_t layers_left) {
  if (!write_ok) cancel->Stop();
  if (!cancel->Cancelled()) return false;
  cancel->Skip(layers_left);
  return true;
}

// The ticket of a read whose largest message takes `message_bytes` (and `work_bytes` more while
// it is produced): refused before any work when one message could not be sent, or over a cap.
absl::StatusOr<std::shared_ptr<ReadTicket>> AdmitRead(ServiceContext* ctx,
                                                      grpc::CallbackServerContext* call,
                                                      const TenantId& tenant, const char* what,
                                                      size_t message_bytes, size_t work_bytes,
                                                      const std::shared_ptr<CallCancellation>& c) {
  const size_t limit = ctx->config->max_message_bytes;
  if (message_bytes > limit) {
    return WithReason(absl::ResourceExhaustedError(
                          absl::StrCat(what, ": one message of this model's rows or blocks takes ",
                                       message_bytes, " bytes, over max_message_bytes ", limit)),
                      ErrorReason::kLimit,
                      {{"limit", "max_message_bytes"},
                       {"value", absl::StrCat(limit)},
                       {"needed", absl::StrCat(message_bytes)}});
  }
  return ReadTicket::Open(ctx->admission, call, tenant, what, message_bytes + work_bytes, c);
}

// Encoded bytes of one message besides its payload (tags, lengths, ids, a header).
constexpr size_t kMessageOverhead = 4096;

std::vector<int> RequestedLayers(const google::protobuf::RepeatedField<int32_t>& layers) {
  return std::vector<int>(layers.begin(), layers.end());
}

// ---------------------------------------------------------------------------------------------
// ReadBlocks: header, then per layer the sink rows, the history blocks, the recent rows.

class ReadBlocksReactor final
    : public OrderedReactor<grpc::ServerWriteReactor<v1::ReadBlocksResponse>> {
 public:
  ReadBlocksReactor(ServiceContext* ctx, std::shared_ptr<CallCancellation> cancel,
                    std::shared_ptr<ReadTicket> ticket, std::unique_ptr<SequenceSnapshot> snap,
                    const ReadStarts& starts)
      : ctx_(ctx),
        cancel_(std::move(cancel)),
        ticket_(std::move(ticket)),
        snap_(std::move(snap)),
        target_(TargetMessageBytes(*ctx->config)),
        // Per phase, the first unit sent: a sink row, a history block, a recent row (relative
        // to the recent tier).
        starts_{starts.sink_token, starts.history_block,
                starts.recent_token - snap_->sink() - snap_->history()},
        pos_(starts_[0]) {
    const Model& m = snap_->model();
    v1::ReadBlocksHeader* h = message_.mutable_header();
    h->set_sequence_id(snap_->sequence_id());
    h->set_model_id(m.id);
    h->set_codec_version(m.version_hex);
    FillBlockLayout(m, h->mutable_block_layout());
    h->set_sink_tokens(snap_->sink());
    h->set_history_tokens(snap_->history());
    h->set_recent_tokens(snap_->recent());
    for (const auto& l : snap_->layers()) h->add_layers(l.layer);
    h->set_sequence_incarnation(snap_->incarnation());
    h->set_sink_token_start(starts.sink_token);
    h->set_history_block_start(starts.history_block);
    h->set_recent_token_start(starts.recent_token);
    Write();
  }

  // The largest message: a batch of rows or of blocks of about `target` bytes, at least one.
  static size_t MessageBytes(const Model& m, size_t target) {
    return std::max({target, 2 * m.row_values() * sizeof(Bf16), m.block_bytes}) + kMessageOverhead;
  }

  void OnWriteDone(bool ok) override {
    AcquireFromGrpc(this);
    if (ok) ticket_->EndWrite();
    if (StopIfCancelled(ok, cancel_.get(), snap_->layers().size() - layer_)) {
      snap_.reset();
      return Finish(ToGrpcStatus(cancel_->status()));
    }
    message_.Clear();
    if (!Next()) {
      snap_.reset();
      return Finish(ToGrpcStatus(error_));
    }
    Write();
  }

  void OnDone() override {
    AcquireFromGrpc(this);
    ticket_->Close();
    delete this;
  }

 private:
  // Fills message_ with the next piece; false when everything was sent or reading failed
  // (then error_ says why).
  bool Next() {
    const Model& m = snap_->model();
    const size_t row_bytes = m.row_values() * sizeof(Bf16);
    const int rows_per_message = std::max<int>(1, static_cast<int>(target_ / (2 * row_bytes)));
    const int blocks_per_message = std::max<int>(1, static_cast<int>(target_ / m.block_bytes));
    const int sink_units = m.codec.quant.sink_tokens > 0 ? 1 : 0;
    while (layer_ < snap_->layers().size()) {
      const int layer_id = snap_->layers()[layer_].layer;
      if (phase_ == 0 || phase_ == 2) {
        const bool recent = phase_ == 2;
        const int count = recent ? snap_->recent() : snap_->sink();
        if (pos_ < count) {
          const int n = std::min(rows_per_message, count - pos_);
          std::vector<Bf16> k(n * m.row_values()), v(n * m.row_values());
          error_ = snap_->CopyBf16Rows(ctx_->backend, layer_, recent, pos_, n, absl::MakeSpan(k),
                                       absl::MakeSpan(v));
          if (!error_.ok()) return false;
          v1::Bf16Rows* rows = message_.mutable_rows();
          rows->set_layer(layer_id);
          rows->set_tier(recent ? v1::BF16_TIER_RECENT : v1::BF16_TIER_SINK);
          rows->set_token_start((recent ? snap_->sink() + snap_->history() : 0) + pos_);
          rows->set_num_tokens(n);
          rows->set_k(reinterpret_cast<const char*>(k.data()), n * row_bytes);
          rows->set_v(reinterpret_cast<const char*>(v.data()), n * row_bytes);
          pos_ += n;
          return true;
        }
      } else {
        const int bt = m.block_tokens();
        const int blocks = (snap_->history() + bt - 1) / bt;
        if (pos_ < blocks) {
          const int n = std::min(blocks_per_message, blocks - pos_);
          v1::KvBlockBatch* batch = message_.mutable_blocks();
          for (int b = pos_; b < pos_ + n; ++b) {
            v1::KvBlock* block = batch->add_blocks();
            block->set_layer(layer_id);
            block->set_block_index(b);
            block->set_valid_tokens(std::min(bt, snap_->history() - b * bt));
            std::string* data = block->mutable_data();
            data->resize(m.block_bytes);
            error_ = ctx_->backend->CopyFromPool(data->data(), snap_->HistoryBlock(layer_, b),
                                                 m.block_bytes);
            if (!error_.ok()) return false;
            // Verified on the copy that leaves: no second read of pool memory.
            error_ = snap_->CheckHistoryCopy(layer_, b, reinterpret_cast<uint8_t*>(data->data()));
            if (!error_.ok()) return false;
            const size_t unit = static_cast<size_t>(b + sink_units);
            if (unit < snap_->prefix_chain().size()) {
              block->set_prefix_hash(PrefixHashHex(snap_->prefix_chain()[unit].hash));
            }
          }
          pos_ += n;
          return true;
        }
      }
      if (++phase_ == 3) {
        phase_ = 0;
        ++layer_;
      }
      pos_ = starts_[phase_];
    }
    return false;
  }

  // Writes message_, unless the call expired meanwhile.
  void Write() {
    if (!ticket_->BeginWrite()) {
      snap_.reset();
      return Finish(ToGrpcStatus(cancel_->status()));
    }
    StartWrite(&message_);
  }

  ServiceContext* const ctx_;
  const std::shared_ptr<CallCancellation> cancel_;
  const std::shared_ptr<ReadTicket> ticket_;
  std::unique_ptr<SequenceSnapshot> snap_;
  const size_t target_;
  const int starts_[3];
  v1::ReadBlocksResponse message_;
  size_t layer_ = 0;
  int phase_ = 0;  // 0 sink rows, 1 history blocks, 2 recent rows
  int pos_;
  absl::Status error_;
};

// ---------------------------------------------------------------------------------------------
// ReadKv: dequantized rows in the original basis, by layer then token.

class ReadKvReactor final : public OrderedReactor<grpc::ServerWriteReactor<v1::ReadKvResponse>> {
 public:
  ReadKvReactor(ServiceContext* ctx, std::shared_ptr<CallCancellation> cancel,
                std::shared_ptr<ReadTicket> ticket, std::unique_ptr<SequenceSnapshot> snap,
                int start, int count, v1::DType dtype)
      : ctx_(ctx),
        cancel_(std::move(cancel)),
        ticket_(std::move(ticket)),
        snap_(std::move(snap)),
        start_(start),
        end_(start + count),
        dtype_(dtype) {
    const Model& m = snap_->model();
    tokens_per_message_ = TokensPerMessage(m, dtype_, TargetMessageBytes(*ctx->config));
    pos_ = start_;
    v1::ReadKvHeader* h = message_.mutable_header();
    h->set_sequence_id(snap_->sequence_id());
    h->set_model_id(m.id);
    h->set_codec_version(m.version_hex);
    v1::ModelShape* shape = h->mutable_shape();
    shape->set_num_layers(m.num_layers);
    shape->set_q_heads(m.q_heads);
    shape->set_kv_heads(m.kv_heads);
    shape->set_head_dim(m.head_dim);
    h->set_dtype(dtype_);
    h->set_token_start(start_);
    h->set_num_tokens(count);
    for (const auto& l : snap_->layers()) h->add_layers(l.layer);
    Write();
  }

  static int TokensPerMessage(const Model& m, v1::DType dtype, size_t target) {
    return std::max<int>(1, static_cast<int>(target / (2 * m.row_values() * DTypeSize(dtype))));
  }
  // The largest message of `tokens` rows, and what producing it holds besides (FP32 K and V,
  // read and unrotated).
  static size_t MessageBytes(const Model& m, v1::DType dtype, int tokens) {
    return static_cast<size_t>(tokens) * 2 * m.row_values() * DTypeSize(dtype) + kMessageOverhead;
  }
  static size_t WorkBytes(const Model& m, int tokens) {
    return static_cast<size_t>(tokens) * 4 * m.row_values() * sizeof(float);
  }

  void OnWriteDone(bool ok) override {
    AcquireFromGrpc(this);
    if (ok) ticket_->EndWrite();
    const size_t layers_left = start_ == end_ ? 0 : snap_->layers().size() - layer_;
    if (StopIfCancelled(ok, cancel_.get(), layers_left)) {
      snap_.reset();
      return Finish(ToGrpcStatus(cancel_->status()));
    }
    if (layer_ >= snap_->layers().size() || start_ == end_) {
      snap_.reset();
      return Finish(grpc::Status::OK);
    }
    // Admitted already: the continuation is never refused.
    ctx_->workers->Submit([this] {
      absl::Status s = Produce();
      if (!s.ok()) return Finish(ToGrpcStatus(s));
      Write();
    });
  }

  void OnDone() override {
    AcquireFromGrpc(this);
    ticket_->Close();
    delete this;
  }

 private:
  absl::Status Produce() {
    const Model& m = snap_->model();
    const int n = std::min(tokens_per_message_, end_ - pos_);
    const size_t values = static_cast<size_t>(n) * m.row_values();
    std::vector<float> k(values), v(values), ko(values), vo(values);
    KVPOOL_RETURN_IF_ERROR(
        snap_->ReadRotated(ctx_->backend, layer_, pos_, n, absl::MakeSpan(k), absl::MakeSpan(v)));
    const int layer_id = snap_->layers()[layer_].layer;
    const RotationSet& rot = m.codec.rotations;
    KVPOOL_RETURN_IF_ERROR(rot.Unrotate(layer_id, KvTensor::kKey, k, absl::MakeSpan(ko)));
    if (m.codec.v_prerotated) {
      vo = v;  // the engine sent V in the rotated basis: return it in that basis
    } else {
      KVPOOL_RETURN_IF_ERROR(rot.Unrotate(layer_id, KvTensor::kValue, v, absl::MakeSpan(vo)));
    }
    message_.Clear();
    v1::KvRows* rows = message_.mutable_rows();
    rows->set_layer(layer_id);
    rows->set_token_start(pos_);
    rows->set_num_tokens(n);
    if (dtype_ == v1::DTYPE_FP32) {
      rows->set_k(reinterpret_cast<const char*>(ko.data()), values * sizeof(float));
      rows->set_v(reinterpret_cast<const char*>(vo.data()), values * sizeof(float));
    } else {
      std::vector<Bf16> kb(values), vb(values);
      for (size_t i = 0; i < values; ++i) {
        kb[i] = Bf16::FromFloat(ko[i]);
        vb[i] = Bf16::FromFloat(vo[i]);
      }
      rows->set_k(reinterpret_cast<const char*>(kb.data()), values * sizeof(Bf16));
      rows->set_v(reinterpret_cast<const char*>(vb.data()), values * sizeof(Bf16));
    }
    pos_ += n;
    if (pos_ == end_) {
      pos_ = start_;
      ++layer_;
    }
    return absl::OkStatus();
  }

  // Writes message_, unless the call expired meanwhile.
  void Write() {
    if (!ticket_->BeginWrite()) {
      snap_.reset();
      return Finish(ToGrpcStatus(cancel_->status()));
    }
    StartWrite(&message_);
  }

  ServiceContext* const ctx_;
  const std::shared_ptr<CallCancellation> cancel_;
  const std::shared_ptr<ReadTicket> ticket_;
  std::unique_ptr<SequenceSnapshot> snap_;
  const int start_;
  const int end_;
  const v1::DType dtype_;
  int tokens_per_message_ = 1;
  v1::ReadKvResponse message_;
  size_t layer_ = 0;
  int pos_ = 0;
};

}  // namespace

grpc::ServerWriteReactor<v1::ReadBlocksResponse>* ReadServiceImpl::ReadBlocks(
    grpc::CallbackServerContext* context, const v1::ReadBlocksRequest* request) {
  const TenantId tenant = TenantOf(*ctx_, context);
  if (absl::Status owner = CheckOwnership(*ctx_, context, tenant, {request->sequence_id()});
      !owner.ok()) {
    return new ErrorReactor<v1::ReadBlocksResponse>(owner);
  }
  const std::vector<int> layers = RequestedLayers(request->layers());
  // The cursor is checked against the snapshot the answer comes from.
  absl::StatusOr<ReadSnapshot> read =
      SnapshotForRead(*ctx_->store, tenant, request->sequence_id(), layers,
                      request->has_since() ? &request->since() : nullptr);
  if (!read.ok()) return new ErrorReactor<v1::ReadBlocksResponse>(read.status());
  std::shared_ptr<CallCancellation> cancel = CancellationOf(context, &ctx_->counters.cancellation);
  absl::StatusOr<std::shared_ptr<ReadTicket>> ticket = AdmitRead(
      ctx_, context, tenant, "ReadBlocks",
      ReadBlocksReactor::MessageBytes(read->snap->model(), TargetMessageBytes(*ctx_->config)), 0,
      cancel);
  if (!ticket.ok()) return new ErrorReactor<v1::ReadBlocksResponse>(ticket.status());
  return new ReadBlocksReactor(ctx_, std::move(cancel), *std::move(ticket), std::move(read->snap),
                               read->starts);
}

grpc::ServerWriteReactor<v1::ReadKvResponse>* ReadServiceImpl::ReadKv(
    grpc::CallbackServerContext* context, const v1::ReadKvRequest* request) {
  const TenantId tenant = TenantOf(*ctx_, context);
  if (absl::Status owner = CheckOwnership(*ctx_, context, tenant, {request->sequence_id()});
      !owner.ok()) {
    return new ErrorReactor<v1::ReadKvResponse>(owner);
  }
  v1::DType dtype = request->dtype();
  if (dtype == v1::DTYPE_UNSPECIFIED) dtype = v1::DTYPE_BF16;
  if (dtype != v1::DTYPE_BF16 && dtype != v1::DTYPE_FP32) {
    return new ErrorReactor<v1::ReadKvResponse>(
        absl::InvalidArgumentError("ReadKv dtype must be DTYPE_BF16 or DTYPE_FP32"));
  }
  const std::vector<int> layers = RequestedLayers(request->layers());
  auto snap = ctx_->store->Snapshot(tenant, request->sequence_id(), layers);
  if (!snap.ok()) return new ErrorReactor<v1::ReadKvResponse>(snap.status());
  const int total = (*snap)->total();
  const uint64_t start = request->token_start();
  const uint64_t count = request->num_tokens() == 0 && start <= static_cast<uint64_t>(total)
                             ? total - start
                             : request->num_tokens();
  if (start + count > static_cast<uint64_t>(total)) {
    return new ErrorReactor<v1::ReadKvResponse>(
        absl::OutOfRangeError(absl::StrCat("tokens [", start, ", ", start + count,
                                           ") are outside the sequence's ", total, " tokens")));
  }
  const Model& m = (*snap)->model();
  const int tokens =
      std::min<int>(static_cast<int>(std::max<uint64_t>(count, 1)),
                    ReadKvReactor::TokensPerMessage(m, dtype, TargetMessageBytes(*ctx_->config)));
  std::shared_ptr<CallCancellation> cancel = CancellationOf(context, &ctx_->counters.cancellation);
  absl::StatusOr<std::shared_ptr<ReadTicket>> ticket =
      AdmitRead(ctx_, context, tenant, "ReadKv", ReadKvReactor::MessageBytes(m, dtype, tokens),
                ReadKvReactor::WorkBytes(m, tokens), cancel);
  if (!ticket.ok()) return new ErrorReactor<v1::ReadKvResponse>(ticket.status());
  return new ReadKvReactor(ctx_, std::move(cancel), *std::move(ticket), *std::move(snap),
                           static_cast<int>(start), static_cast<int>(count), dtype);
}

}  // namespace kvpool::server
