#include "server/sequence_service.h"

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "grpc/support/time.h"
#include "grpcpp/alarm.h"
#include "common/status_macros.h"
#include "server/grpc_reactor_order.h"
#include "server/proto_convert.h"
#include "spdlog/spdlog.h"

namespace kvpool::server {
namespace {

grpc::ServerUnaryReactor* FinishNow(grpc::CallbackServerContext* context,
                                    const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

void CountIngest(ServiceContext* ctx, const Model& m, int tokens) {
  ctx->counters.ingested_tokens += tokens;
  ctx->counters.ingested_bytes +=
      static_cast<uint64_t>(tokens) * m.bf16_token_bytes() * m.num_layers;
}

class AppendKvReactor final : public OrderedReactor<grpc::ServerReadReactor<v1::AppendKvRequest>> {
 public:
  AppendKvReactor(ServiceContext* ctx, grpc::CallbackServerContext* call,
                  v1::AppendKvResponse* response)
      : ctx_(ctx), call_(call), tenant_(TenantOf(call)), response_(response) {
    absl::MutexLock lock(&mu_);
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    AcquireFromGrpc(this);
    absl::Status error;
    {
      absl::MutexLock lock(&mu_);
      // Finished, or failed and the worker is about to answer: read nothing more.
      if (finished_ || !pending_error_.ok()) return;
      if (!ok) {
        if (call_->IsCancelled()) {
          error = absl::CancelledError("AppendKv cancelled");
        } else if (txn_ == nullptr) {
          error = absl::InvalidArgumentError("AppendKv: the stream ended before a header");
        } else {
          half_closed_ = true;  // the worker commits once the queue drains
          if (!worker_running_) error = StartWorkerLocked();
        }
      } else if (txn_ == nullptr) {
        error = Begin();
        if (error.ok()) StartRead(&request_);
      } else if (request_.part_case() != v1::AppendKvRequest::kChunk) {
        error = absl::InvalidArgumentError("AppendKv: only the first message may be a header");
      } else {
        auto chunk = std::make_shared<v1::KvChunk>();
        chunk->Swap(request_.mutable_chunk());
        queued_bytes_ += PayloadBytes(*chunk);
        queue_.push_back(std::move(chunk));
        // Receive the next chunk while this one waits or is staged, unless the queue is full;
        // then the worker has the read resumed when it takes a chunk out.
        if (!QueueFullLocked()) {
          StartRead(&request_);
        } else {
          read_blocked_ = true;
        }
        if (!worker_running_) error = StartWorkerLocked();
      }
      if (error.ok()) return;
      if (worker_running_) {
        // The worker owns the transaction; it rolls back and answers at its next step.
        pending_error_ = error;
        return;
      }
      finished_ = true;
      txn_.reset();  // roll back before answering, so that a retry never finds the lock held
    }
    Finish(ToGrpcStatus(error));
  }

  void OnDone() override {  // an uncommitted transaction rolls back here
    AcquireFromGrpc(this);
    delete this;
  }

 private:
  // Received chunks wait for the worker (one more is being staged and one more may be
  // arriving) until kMaxQueuedChunks wait, or at least kMinQueuedChunks holding
  // kMaxQueuedBytes of payload: a stream holds a bounded amount of memory, and small chunks
  // still queue deep enough to smooth out the scheduling of the receiving and staging threads.
  static constexpr size_t kMinQueuedChunks = 2;
  static constexpr size_t kMaxQueuedChunks = 16;
  static constexpr size_t kMaxQueuedBytes = size_t{4} << 20;

  static size_t PayloadBytes(const v1::KvChunk& c) { return c.k().size() + c.v().size(); }

  bool QueueFullLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return queue_.size() >= kMaxQueuedChunks ||
           (queue_.size() >= kMinQueuedChunks && queued_bytes_ >= kMaxQueuedBytes);
  }

  // Whether a paused read may resume: the queue has drained to half of its bounds, so that
  // each resume receives several chunks.
  bool QueueLowLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return queue_.size() < kMinQueuedChunks ||
           (queue_.size() <= kMaxQueuedChunks / 2 && queued_bytes_ <= kMaxQueuedBytes / 2);
  }

  // Worker side, once a full queue is low again: the read is restarted from a gRPC
  // thread (an alarm due now), never from the worker, because starting a read runs gRPC's
  // receive path (socket reads, the next message's parse) on the calling thread, and that
  // would stall the codec. Until the alarm has run, the worker leaves answering to it.
  // Returns the alarm to set once mu_ is released (gRPC may run the callback inline when it
  // has no executor thread); nothing replaces it before the callback has run.
  grpc::Alarm* PrepareResumeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    read_blocked_ = false;
    resume_pending_ = true;
    resume_alarm_ = std::make_unique<grpc::Alarm>();
    return resume_alarm_.get();
  }

  void OnResumeRead() {
    AcquireFromGrpc(this);
    grpc::Status answer;
    {
      absl::MutexLock lock(&mu_);
      resume_pending_ = false;
      if (!finished_) {
        StartRead(&request_);
        return;
      }
      // The worker finished meanwhile and left the answer to this callback.
      answer = std::move(deferred_answer_);
    }
    Finish(answer);
  }

  absl::Status StartWorkerLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!ctx_->workers->TrySubmit([this] { Work(); })) return BusyError();
    worker_running_ = true;
    return absl::OkStatus();
  }

  // The stream's one worker task: stages queued chunks in order, commits after the half-close
  // when the queue is empty, and answers on any error. While it runs it alone touches txn_.
  // Finish is its last access to `this` (OnDone may delete the reactor right after).
  void Work() {
    for (;;) {
      std::shared_ptr<v1::KvChunk> chunk;
      absl::Status status;
      grpc::Alarm* resume = nullptr;
      {
        absl::MutexLock lock(&mu_);
        if (pending_error_.ok() && call_->IsCancelled()) {
          pending_error_ = absl::CancelledError("AppendKv cancelled");
        }
        if (!pending_error_.ok()) {
          status = pending_error_;
        } else if (!queue_.empty()) {
          chunk = std::move(queue_.front());
          queue_.pop_front();
          queued_bytes_ -= PayloadBytes(*chunk);
          if (read_blocked_ && QueueLowLocked()) resume = PrepareResumeLocked();
        } else if (!half_closed_) {
          worker_running_ = false;  // the next chunk starts a new task
          return;
        }
      }
      if (resume != nullptr) {
        ReleaseToGrpc(this);
        resume->Set(gpr_now(GPR_CLOCK_MONOTONIC), [this](bool) { OnResumeRead(); });
      }
      if (status.ok() && chunk != nullptr) {
        status = Stage(*chunk);
        if (status.ok()) continue;
      } else if (status.ok()) {
        status = Commit();  // half-closed and drained
      }
      {
        absl::MutexLock lock(&mu_);
        finished_ = true;
        worker_running_ = false;
        if (!status.ok()) txn_.reset();  // roll back before answering
        if (resume_pending_) {
          // OnDone must not run (and delete this) before the alarm callback has: it answers.
          deferred_answer_ = ToGrpcStatus(status);
          return;
        }
      }
      Finish(ToGrpcStatus(status));
      return;
    }
  }

  absl::Status Begin() {
    if (request_.part_case() != v1::AppendKvRequest::kHeader) {
      return absl::InvalidArgumentError("AppendKv: the first message must be a header");
    }
    const v1::AppendKvHeader& h = request_.header();
    if (h.sequence_id().empty()) return absl::InvalidArgumentError("sequence_id is empty");
    const int max_tokens = ctx_->config->max_append_tokens;
    if (h.num_tokens() < 1 || h.num_tokens() > static_cast<uint32_t>(max_tokens)) {
      return absl::InvalidArgumentError(
          absl::StrCat("num_tokens must be in [1, ", max_tokens, "], got ", h.num_tokens()));
    }
    if (DTypeSize(h.dtype()) == 0) {
      return absl::InvalidArgumentError("dtype must be DTYPE_BF16, DTYPE_FP16 or DTYPE_FP32");
    }
    if (h.token_start() > static_cast<uint32_t>(INT32_MAX - max_tokens)) {
      return absl::InvalidArgumentError("token_start out of range");
    }
    dtype_ = h.dtype();
    AppendSpec spec;
    spec.token_start = static_cast<int>(h.token_start());
    spec.num_tokens = static_cast<int>(h.num_tokens());
    spec.kind = h.end_of_prefill() ? AppendKind::kFinalPrefill : AppendKind::kPrefill;
    spec.token_ids.assign(h.token_ids().begin(), h.token_ids().end());
    KVPOOL_ASSIGN_OR_RETURN(txn_,
                            ctx_->store->BeginAppend(tenant_, h.sequence_id(), std::move(spec)));
    return absl::OkStatus();
  }

  absl::Status Stage(const v1::KvChunk& c) {
    const Model& m = txn_->model();
    const size_t max_chunk = ctx_->config->max_chunk_bytes;
    if (c.k().size() > max_chunk || c.v().size() > max_chunk) {
      return absl::InvalidArgumentError(absl::StrCat("chunk payload of ",
                                                     std::max(c.k().size(), c.v().size()),
                                                     " bytes exceeds max_chunk_bytes ", max_chunk));
    }
    if (c.layer() < 0 || c.layer() >= m.num_layers) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", c.layer(), " out of range [0, ", m.num_layers, ")"));
    }
    if (c.num_tokens() < 1 || c.token_offset() >= static_cast<uint32_t>(txn_->num_tokens()) ||
        c.num_tokens() > static_cast<uint32_t>(txn_->num_tokens()) - c.token_offset()) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk tokens [", c.token_offset(), ", ",
                       static_cast<uint64_t>(c.token_offset()) + c.num_tokens(),
                       ") do not fit the append's ", txn_->num_tokens(), " tokens"));
    }
    const size_t values = static_cast<size_t>(c.num_tokens()) * m.row_values();
    std::vector<Bf16> k_copy, v_copy;
    KVPOOL_ASSIGN_OR_RETURN(absl::Span<const Bf16> k, Bf16View(c.k(), values, "k", &k_copy));
    KVPOOL_ASSIGN_OR_RETURN(absl::Span<const Bf16> v, Bf16View(c.v(), values, "v", &v_copy));
    return txn_->StageLayer(c.layer(), static_cast<int>(c.token_offset()), k, v);
  }

  // The payload as `values` BF16 words: BF16 bytes of the right size are used where the
  // message holds them (no copy); anything else is converted into `storage`, with
  // DecodeToBf16's checks and errors.
  absl::StatusOr<absl::Span<const Bf16>> Bf16View(const std::string& bytes, size_t values,
                                                  const char* what, std::vector<Bf16>* storage) {
    if (dtype_ == v1::DTYPE_BF16 && bytes.size() == values * sizeof(Bf16) &&
        reinterpret_cast<uintptr_t>(bytes.data()) % alignof(Bf16) == 0) {
      return absl::MakeConstSpan(reinterpret_cast<const Bf16*>(bytes.data()), values);
    }
    KVPOOL_ASSIGN_OR_RETURN(*storage, DecodeToBf16(dtype_, bytes, values, what));
    return absl::MakeConstSpan(*storage);
  }

  absl::Status Commit() {
    if (call_->IsCancelled()) return absl::CancelledError("AppendKv cancelled");
    const std::shared_ptr<const Model> model = txn_->model_ptr();  // outlives the txn
    const int tokens = txn_->num_tokens();
    KVPOOL_ASSIGN_OR_RETURN(AppendResult r, ctx_->store->Commit(std::move(txn_)));
    FillSequenceInfo(r.info, response_->mutable_sequence());
    response_->set_to_history(r.to_history);
    response_->set_to_sink(r.to_sink);
    response_->set_to_recent(r.to_recent);
    for (const PrefixUnitKey& k : r.published) FillPrefixUnit(k, response_->add_published_units());
    CountIngest(ctx_, *model, tokens);
    return absl::OkStatus();
  }

  ServiceContext* const ctx_;
  grpc::CallbackServerContext* const call_;
  const TenantId tenant_;
  v1::AppendKvResponse* const response_;
  v1::AppendKvRequest request_;              // written by gRPC while a read is pending
  v1::DType dtype_ = v1::DTYPE_UNSPECIFIED;  // set by Begin, before any worker runs
  // Reactor callbacks and the worker synchronize on mu_. txn_ is touched by the reactor only
  // while no worker runs (Begin, early failures), else by the worker alone.
  absl::Mutex mu_;
  std::unique_ptr<AppendTxn> txn_;
  std::deque<std::shared_ptr<v1::KvChunk>> queue_ ABSL_GUARDED_BY(mu_);
  bool worker_running_ ABSL_GUARDED_BY(mu_) = false;
  size_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;    // k + v payload bytes in queue_
  bool read_blocked_ ABSL_GUARDED_BY(mu_) = false;  // queue was full: no read pending
  // A read resume is scheduled on resume_alarm_ and has not run yet.
  bool resume_pending_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<grpc::Alarm> resume_alarm_ ABSL_GUARDED_BY(mu_);
  grpc::Status deferred_answer_ ABSL_GUARDED_BY(mu_);  // for OnResumeRead after finished_
  bool half_closed_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status pending_error_ ABSL_GUARDED_BY(mu_);  // for the running worker to answer
};

absl::Status RunDecodeAppend(ServiceContext* ctx, const TenantId& tenant,
                             const v1::AppendDecodeRequest& req, v1::AppendDecodeResponse* resp) {
  if (req.sequence_id().empty()) return absl::InvalidArgumentError("sequence_id is empty");
  const int max_tokens = ctx->config->max_append_tokens;
  if (req.num_tokens() < 1 || req.num_tokens() > static_cast<uint32_t>(max_tokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tokens must be in [1, ", max_tokens, "], got ", req.num_tokens()));
  }
  {
    // The payload's size is checked against the sequence's model before anything is reserved,
    // so a request with too little data never touches the pool. (Checked again after
    // BeginAppend, which holds the sequence.)
    KVPOOL_ASSIGN_OR_RETURN(SequenceInfo info, ctx->store->Describe(tenant, req.sequence_id()));
    KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model,
                            ctx->registry->Get(tenant, info.model_id));
    const size_t values = static_cast<size_t>(req.num_tokens()) * model->row_values() *
                          static_cast<size_t>(model->num_layers);
    KVPOOL_RETURN_IF_ERROR(CheckPayload(req.dtype(), req.k(), values, "k"));
    KVPOOL_RETURN_IF_ERROR(CheckPayload(req.dtype(), req.v(), values, "v"));
  }
  AppendSpec spec;
  spec.token_start = static_cast<int>(std::min<uint32_t>(req.token_start(), INT32_MAX / 2));
  spec.num_tokens = static_cast<int>(req.num_tokens());
  spec.kind = AppendKind::kDecode;
  spec.token_ids.assign(req.token_ids().begin(), req.token_ids().end());
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<AppendTxn> txn,
                          ctx->store->BeginAppend(tenant, req.sequence_id(), std::move(spec)));
  const Model& m = txn->model();
  const size_t per_layer = static_cast<size_t>(req.num_tokens()) * m.row_values();
  const size_t values = per_layer * m.num_layers;
  KVPOOL_ASSIGN_OR_RETURN(std::vector<Bf16> k, DecodeToBf16(req.dtype(), req.k(), values, "k"));
  KVPOOL_ASSIGN_OR_RETURN(std::vector<Bf16> v, DecodeToBf16(req.dtype(), req.v(), values, "v"));
  for (int layer = 0; layer < m.num_layers; ++layer) {
    KVPOOL_RETURN_IF_ERROR(
        txn->StageLayer(layer, 0, absl::MakeConstSpan(k).subspan(layer * per_layer, per_layer),
                        absl::MakeConstSpan(v).subspan(layer * per_layer, per_layer)));
  }
  const int tokens = txn->num_tokens();
  const std::shared_ptr<const Model> model = txn->model_ptr();  // outlives the txn
  KVPOOL_ASSIGN_OR_RETURN(AppendResult r, ctx->store->Commit(std::move(txn)));
  FillSequenceInfo(r.info, resp->mutable_sequence());
  resp->set_demoted_tokens(r.demoted);
  for (const PrefixUnitKey& key : r.published) FillPrefixUnit(key, resp->add_published_units());
  CountIngest(ctx, *model, tokens);
  return absl::OkStatus();
}

}  // namespace

grpc::ServerUnaryReactor* SequenceServiceImpl::CreateSequence(
    grpc::CallbackServerContext* context, const v1::CreateSequenceRequest* request,
    v1::CreateSequenceResponse* response) {
  const TenantId tenant = TenantOf(context);
  auto run = [&]() -> absl::Status {
    KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model,
                            ctx_->registry->Get(tenant, request->model_id()));
    if (request->prefix_token_ids_size() > ctx_->config->max_append_tokens) {
      return absl::InvalidArgumentError("prefix_token_ids is longer than max_append_tokens");
    }
    const std::vector<uint32_t> ids(request->prefix_token_ids().begin(),
                                    request->prefix_token_ids().end());
    KVPOOL_ASSIGN_OR_RETURN(auto created,
                            ctx_->store->Create(tenant, model, request->sequence_id(), ids));
    FillSequenceInfo(created.first, response->mutable_sequence());
    response->set_reused_tokens(created.first.reused_tokens);
    for (const PrefixUnitKey& k : created.second) FillPrefixUnit(k, response->add_reused_units());
    return absl::OkStatus();
  };
  return FinishNow(context, run());
}

grpc::ServerReadReactor<v1::AppendKvRequest>* SequenceServiceImpl::AppendKv(
    grpc::CallbackServerContext* context, v1::AppendKvResponse* response) {
  return new AppendKvReactor(ctx_, context, response);
}

grpc::ServerUnaryReactor* SequenceServiceImpl::AppendDecode(grpc::CallbackServerContext* context,
                                                            const v1::AppendDecodeRequest* request,
                                                            v1::AppendDecodeResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const TenantId tenant = TenantOf(context);
  ServiceContext* ctx = ctx_;
  if (!ctx_->workers->TrySubmit([ctx, tenant, request, response, reactor] {
        reactor->Finish(ToGrpcStatus(RunDecodeAppend(ctx, tenant, *request, response)));
      })) {
    reactor->Finish(ToGrpcStatus(BusyError()));
  }
  return reactor;
}

grpc::ServerUnaryReactor* SequenceServiceImpl::SealSequence(grpc::CallbackServerContext* context,
                                                            const v1::SealSequenceRequest* request,
                                                            v1::SealSequenceResponse* response) {
  absl::StatusOr<SequenceInfo> info = ctx_->store->Seal(TenantOf(context), request->sequence_id());
  if (info.ok()) FillSequenceInfo(*info, response->mutable_sequence());
  return FinishNow(context, info.status());
}

grpc::ServerUnaryReactor* SequenceServiceImpl::ReleaseSequence(
    grpc::CallbackServerContext* context, const v1::ReleaseSequenceRequest* request,
    v1::ReleaseSequenceResponse* response) {
  absl::StatusOr<size_t> freed = ctx_->store->Release(TenantOf(context), request->sequence_id());
  if (freed.ok()) response->set_freed_bytes(*freed);
  return FinishNow(context, freed.status());
}

grpc::ServerUnaryReactor* SequenceServiceImpl::DescribeSequence(
    grpc::CallbackServerContext* context, const v1::DescribeSequenceRequest* request,
    v1::SequenceInfo* response) {
  absl::StatusOr<SequenceInfo> info =
      ctx_->store->Describe(TenantOf(context), request->sequence_id());
  if (info.ok()) FillSequenceInfo(*info, response);
  return FinishNow(context, info.status());
}

grpc::ServerUnaryReactor* SequenceServiceImpl::LookupPrefix(grpc::CallbackServerContext* context,
                                                            const v1::LookupPrefixRequest* request,
                                                            v1::LookupPrefixResponse* response) {
  const TenantId tenant = TenantOf(context);
  auto run = [&]() -> absl::Status {
    KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model,
                            ctx_->registry->Get(tenant, request->model_id()));
    if (request->token_ids_size() > ctx_->config->max_append_tokens) {
      return absl::InvalidArgumentError("token_ids is longer than max_append_tokens");
    }
    const std::vector<uint32_t> ids(request->token_ids().begin(), request->token_ids().end());
    const PrefixContext pctx = SequenceStore::ContextOf(*model);
    const std::vector<PrefixUnitKey> chain = ComputePrefixChain(pctx, ids);
    const std::vector<PrefixMatch> hits = ctx_->index->Match(pctx, chain, /*take_refs=*/false);
    uint32_t matched = 0;
    for (const PrefixMatch& hit : hits) {
      FillPrefixUnit(hit.key, response->add_units());
      matched = hit.key.token_start + hit.key.token_count;
    }
    response->set_matched_tokens(matched);
    response->set_codec_version(model->version_hex);
    return absl::OkStatus();
  };
  return FinishNow(context, run());
}

}  // namespace kvpool::server
