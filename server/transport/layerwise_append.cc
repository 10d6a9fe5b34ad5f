#include "server/transport/layerwise_append.h"

#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/status_macros.h"

namespace kvpool::server {

absl::StatusOr<std::shared_ptr<LayerwiseAppend>> LayerwiseAppend::Begin(
    ServiceContext* ctx, const TenantId& tenant, const std::string& sequence_id, AppendSpec spec) {
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<AppendTxn> txn,
                          ctx->store->BeginAppend(tenant, sequence_id, std::move(spec)));
  return std::shared_ptr<LayerwiseAppend>(new LayerwiseAppend(ctx, std::move(txn), sequence_id));
}

LayerwiseAppend::LayerwiseAppend(ServiceContext* ctx, std::unique_ptr<AppendTxn> txn,
                                 std::string sequence_id)
    : ctx_(ctx),
      model_(txn->model_ptr()),
      num_tokens_(txn->num_tokens()),
      sequence_id_(std::move(sequence_id)),
      txn_(std::move(txn)),
      layers_(model_->num_layers) {}

LayerwiseAppend::~LayerwiseAppend() = default;

void LayerwiseAppend::Stage(int layer, int offset, int count, const Bf16* k, const Bf16* v,
                            ChunkDone done) {
  Queue(layer, Chunk{offset, count, k, v, std::move(done), false, nullptr});
}

void LayerwiseAppend::StageDevice(int layer, int offset, int count, const Bf16* k, const Bf16* v,
                                  std::function<absl::Status()> ready, ChunkDone done) {
  Queue(layer, Chunk{offset, count, k, v, std::move(done), true, std::move(ready)});
}

void LayerwiseAppend::Queue(int layer, Chunk chunk) {
  const int offset = chunk.offset;
  const int count = chunk.count;
  Deferred d;
  {
    absl::MutexLock lock(&mu_);
    if (!status_.ok() || committed_) {
      d.failed.emplace_back(
          std::move(chunk),
          status_.ok() ? absl::FailedPreconditionError("push already committed") : status_);
    } else if (layer < 0 || layer >= model_->num_layers) {
      d.failed.emplace_back(std::move(chunk), absl::OkStatus());
      FailLocked(absl::InvalidArgumentError(
                     absl::StrCat("layer ", layer, " out of range [0, ", model_->num_layers, ")")),
                 &d);
    } else if (count < 1 || offset > num_tokens_ - count ||
               Overlaps(layers_[layer], offset, count)) {
      d.failed.emplace_back(std::move(chunk), absl::OkStatus());
      FailLocked(absl::InvalidArgumentError(
                     absl::StrCat("layer ", layer, " chunk [", offset, ", ",
                                  int64_t{offset} + count, ") does not fit the push's ",
                                  num_tokens_, " tokens (", layers_[layer].next, " staged)")),
                 &d);
    } else {
      layers_[layer].waiting.emplace(offset, std::move(chunk));
      ScheduleLocked(layer, &d);
    }
    for (auto& [c, s] : d.failed) {
      if (s.ok()) s = status_;
    }
  }
  Finish(std::move(d));
}

bool LayerwiseAppend::Overlaps(const LayerQueue& q, int offset, int count) {
  if (offset < q.next + (q.running ? q.running_count : 0)) return true;
  auto it = q.waiting.lower_bound(offset);
  if (it != q.waiting.end() && it->first < offset + count) return true;
  if (it != q.waiting.begin() && std::prev(it)->first + std::prev(it)->second.count > offset) {
    return true;
  }
  return false;
}

void LayerwiseAppend::ScheduleLocked(int layer, Deferred* d) {
  LayerQueue& q = layers_[layer];
  if (q.running || q.waiting.empty() || q.waiting.begin()->first != q.next) return;
  Chunk c = std::move(q.waiting.begin()->second);
  q.waiting.erase(q.waiting.begin());
  q.running = true;
  q.running_count = c.count;
  ++running_;
  d->run.emplace_back(layer, std::move(c));
}

void LayerwiseAppend::FailLocked(absl::Status why, Deferred* d) {
  if (status_.ok()) status_ = std::move(why);
  for (LayerQueue& q : layers_) {
    for (auto& [offset, c] : q.waiting) d->failed.emplace_back(std::move(c), status_);
    q.waiting.clear();
  }
  DropIfIdleLocked(d);
}

void LayerwiseAppend::DropIfIdleLocked(Deferred* d) {
  if (running_ > 0 || committed_ || txn_ == nullptr) return;
  d->drop = std::move(txn_);
  for (auto& fn : on_rolled_back_) d->rolled_back.push_back(std::move(fn));
  on_rolled_back_.clear();
}

void LayerwiseAppend::RollBack(Deferred* d) {
  d->drop.reset();
  std::vector<std::function<void()>> callbacks = std::move(d->rolled_back);
  d->rolled_back.clear();
  for (auto& fn : callbacks) fn();
}

void LayerwiseAppend::Finish(Deferred d) {
  RollBack(&d);  // roll back before telling anyone
  for (auto& [c, s] : d.failed) {
    if (c.done) c.done(s, false);
  }
  for (auto& [layer, c] : d.run) {
    ctx_->workers->Submit([self = shared_from_this(), layer = layer, c = std::move(c)]() mutable {
      self->RunChunk(layer, std::move(c));
    });
  }
}

void LayerwiseAppend::RunChunk(int layer, Chunk chunk) {
  AppendTxn* txn = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (status_.ok()) txn = txn_.get();
  }
  absl::Status s;
  if (txn != nullptr && chunk.ready) s = chunk.ready();
  if (txn != nullptr && s.ok()) {
    if (chunk.device) {
      s = txn->StageDeviceLayer(layer, chunk.offset, chunk.count, chunk.k, chunk.v);
    } else {
      const size_t values = static_cast<size_t>(chunk.count) * model_->row_values();
      s = txn->StageLayer(layer, chunk.offset, absl::MakeConstSpan(chunk.k, values),
                          absl::MakeConstSpan(chunk.v, values));
    }
  }
  Deferred d;
  bool layer_complete = false;
  {
    absl::MutexLock lock(&mu_);
    --running_;
    LayerQueue& q = layers_[layer];
    q.running = false;
    if (txn == nullptr) {
      s = status_;
    } else if (s.ok()) {
      q.next += chunk.count;
      layer_complete = q.next == num_tokens_;
      if (layer_complete) ++complete_layers_;
    } else {
      FailLocked(s, &d);
    }
    if (status_.ok()) {
      ScheduleLocked(layer, &d);
    } else {
      DropIfIdleLocked(&d);
    }
  }
  RollBack(&d);  // a failed push is rolled back before its last chunk reports
  if (chunk.done) chunk.done(s, layer_complete);
  Finish(std::move(d));
}

bool LayerwiseAppend::Complete() const {
  absl::MutexLock lock(&mu_);
  return status_.ok() && running_ == 0 && complete_layers_ == model_->num_layers;
}

absl::StatusOr<AppendResult> LayerwiseAppend::Commit() {
  std::unique_ptr<AppendTxn> txn;
  {
    absl::MutexLock lock(&mu_);
    if (!status_.ok()) return status_;
    if (committed_) return absl::FailedPreconditionError("push already committed");
    if (running_ > 0 || complete_layers_ < model_->num_layers) {
      return absl::FailedPreconditionError(
          absl::StrCat("push of ", sequence_id_, " is incomplete: ", complete_layers_, " of ",
                       model_->num_layers, " layers stored"));
    }
    committed_ = true;
    txn = std::move(txn_);
  }
  absl::StatusOr<AppendResult> r = ctx_->store->Commit(std::move(txn));
  if (!r.ok()) {
    absl::MutexLock lock(&mu_);
    status_ = r.status();
    return r.status();
  }
  ctx_->counters.ingested_tokens += num_tokens_;
  ctx_->counters.ingested_bytes +=
      static_cast<uint64_t>(num_tokens_) * model_->bf16_token_bytes() * model_->num_layers;
  return r;
}

void LayerwiseAppend::Abort(absl::Status why, std::function<void()> rolled_back) {
  Deferred d;
  {
    absl::MutexLock lock(&mu_);
    if (rolled_back) {
      if (committed_ || txn_ == nullptr) {
        d.rolled_back.push_back(std::move(rolled_back));
      } else {
        on_rolled_back_.push_back(std::move(rolled_back));
      }
    }
    if (!committed_) FailLocked(std::move(why), &d);
  }
  Finish(std::move(d));
}

absl::Status LayerwiseAppend::status() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

}  // namespace kvpool::server
