#include "server/ingest/ingest_append.h"

#include <cstdint>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/status_macros.h"
#include "server/ingest/append_checks.h"
#include "server/proto_convert.h"

namespace kvpool::server {

IngestAppend::IngestAppend(std::unique_ptr<AppendTxn> txn, std::string sequence_id, v1::DType dtype,
                           IngestOptions options, WorkerPool* workers, SequenceStore* store,
                           IngestCounters* counters)
    : model_(txn->model_ptr()),
      num_tokens_(txn->num_tokens()),
      sequence_id_(std::move(sequence_id)),
      dtype_(dtype),
      options_(std::move(options)),
      on_end_(std::move(options_.on_end)),
      workers_(workers),
      store_(store),
      counters_(counters),
      txn_(std::move(txn)),
      layers_(model_->num_layers),
      ticket_(std::move(options_.ticket)) {}

IngestAppend::~IngestAppend() = default;

bool IngestAppend::Stage(int32_t layer, uint32_t offset, uint32_t count, absl::string_view k,
                         absl::string_view v, ChunkDone done) {
  return Queue(layer, Chunk{offset, count, k, v, nullptr, nullptr, nullptr, std::move(done)});
}

bool IngestAppend::StageDevice(int32_t layer, uint32_t offset, uint32_t count, const Bf16* k,
                               const Bf16* v, std::function<absl::Status()> ready, ChunkDone done) {
  return Queue(layer, Chunk{offset, count, {}, {}, k, v, std::move(ready), std::move(done)});
}

absl::Status IngestAppend::CheckChunk(int32_t layer, uint32_t offset, uint32_t count) const {
  absl::MutexLock lock(&mu_);
  return CheckChunkLocked(layer, offset, count);
}

absl::Status IngestAppend::CheckChunkLocked(int32_t layer, uint32_t offset, uint32_t count) const {
  KVPOOL_RETURN_IF_ERROR(CheckChunkPlace(layer, offset, count, model_->num_layers, num_tokens_));
  const LayerQueue& q = layers_[layer];
  bool overlaps = offset < q.next + (q.running ? q.running_count : 0);
  auto it = q.waiting.lower_bound(offset);
  if (it != q.waiting.end() && it->first < offset + count) overlaps = true;
  if (it != q.waiting.begin() && std::prev(it)->first + std::prev(it)->second.count > offset) {
    overlaps = true;
  }
  if (overlaps) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, ": chunk tokens [", offset, ", ", uint64_t{offset} + count,
                     ") overlap tokens sent before (", q.next, " of ", num_tokens_, " staged)"));
  }
  return absl::OkStatus();
}

bool IngestAppend::FullLocked() const {
  return pending_chunks_ >= options_.max_pending_chunks ||
         (pending_chunks_ >= options_.min_pending_chunks &&
          pending_bytes_ >= options_.max_pending_bytes);
}

bool IngestAppend::LowLocked() const {
  return pending_chunks_ < options_.min_pending_chunks ||
         (pending_chunks_ <= options_.max_pending_chunks / 2 &&
          pending_bytes_ <= options_.max_pending_bytes / 2);
}

bool IngestAppend::Queue(int32_t layer, Chunk chunk) {
  Deferred d;
  bool accepting = false;
  {
    absl::MutexLock lock(&mu_);
    if (ticket_ != nullptr) ticket_->Touch();
    absl::Status refused;
    if (!status_.ok() || commit_requested_) {
      d.failed.emplace_back(
          std::move(chunk),
          status_.ok() ? absl::FailedPreconditionError("the append is committing") : status_);
    } else if (refused = CheckChunkLocked(layer, chunk.offset, chunk.count); !refused.ok()) {
      d.failed.emplace_back(std::move(chunk), absl::OkStatus());
      FailLocked(std::move(refused), &d);
    } else if (chunk.device_k == nullptr &&
               !(refused = CheckPayload(dtype_, chunk.k, chunk.count * model_->row_values(), "k"))
                    .ok()) {
      d.failed.emplace_back(std::move(chunk), absl::OkStatus());
      FailLocked(std::move(refused), &d);
    } else if (chunk.device_k == nullptr &&
               !(refused = CheckPayload(dtype_, chunk.v, chunk.count * model_->row_values(), "v"))
                    .ok()) {
      d.failed.emplace_back(std::move(chunk), absl::OkStatus());
      FailLocked(std::move(refused), &d);
    } else {
      ++pending_chunks_;
      pending_bytes_ += chunk.bytes();
      layers_[layer].waiting.emplace(chunk.offset, std::move(chunk));
      ScheduleLocked(layer, &d);
      SettleLocked(&d);
      accepting = status_.ok() && !FullLocked();
      if (status_.ok() && !accepting) paused_ = true;
    }
    for (auto& [c, s] : d.failed) {
      if (s.ok()) s = status_;
    }
  }
  Finish(std::move(d), /*admit=*/true);
  return accepting;
}

void IngestAppend::ScheduleLocked(int layer, Deferred* d) {
  LayerQueue& q = layers_[layer];
  if (q.running || q.waiting.empty() || q.waiting.begin()->first != q.next) return;
  Chunk c = std::move(q.waiting.begin()->second);
  q.waiting.erase(q.waiting.begin());
  q.running = true;
  q.running_count = c.count;
  ++running_;
  d->run.emplace_back(layer, std::move(c));
}

void IngestAppend::SettleLocked(Deferred* d) {
  if (!status_.ok()) return;
  if (paused_ && LowLocked()) {
    paused_ = false;
    d->resume = true;
  }
  // Every chunk handed over waits for earlier tokens of its layer: a full queue, or a producer
  // that has finished, can never fill those gaps.
  if (running_ == 0 && pending_chunks_ > 0 && (FullLocked() || commit_requested_)) {
    for (size_t l = 0; l < layers_.size(); ++l) {
      const LayerQueue& q = layers_[l];
      if (q.waiting.empty()) continue;
      FailLocked(absl::InvalidArgumentError(absl::StrCat(
                     "layer ", l, ": tokens [", q.next, ", ", q.waiting.begin()->first,
                     ") never arrived before its later chunks (send each layer's tokens in "
                     "order, without gaps)")),
                 d);
      return;
    }
  }
  if (commit_requested_ && !committing_ && pending_chunks_ == 0 && running_ == 0) {
    committing_ = true;
    d->commit = true;
  }
}

void IngestAppend::FailLocked(absl::Status why, Deferred* d) {
  if (status_.ok()) status_ = std::move(why);
  for (LayerQueue& q : layers_) {
    for (auto& [offset, c] : q.waiting) {
      --pending_chunks_;
      pending_bytes_ -= c.bytes();
      d->failed.emplace_back(std::move(c), status_);
    }
    q.waiting.clear();
  }
  DropIfIdleLocked(d);
}

void IngestAppend::DropIfIdleLocked(Deferred* d) {
  if (running_ > 0 || committing_ || txn_ == nullptr) return;
  d->drop = std::move(txn_);
  for (auto& fn : on_rolled_back_) d->rolled_back.push_back(std::move(fn));
  on_rolled_back_.clear();
  if (!ended_) {
    ended_ = true;
    d->end = true;
  }
}

void IngestAppend::RollBack(Deferred* d) {
  d->drop.reset();
  std::vector<std::function<void()>> callbacks = std::move(d->rolled_back);
  d->rolled_back.clear();
  for (auto& fn : callbacks) fn();
}

void IngestAppend::Finish(Deferred d, bool admit) {
  RollBack(&d);  // roll back before telling anyone
  for (auto& [c, s] : d.failed) {
    if (c.done) c.done(s, false);
  }
  if (d.end) {
    workers_->Submit([self = shared_from_this()] { self->End(self->status()); });
  }
  if (d.resume && options_.resume) options_.resume();
  for (auto& [layer, c] : d.run) {
    auto held = std::make_shared<Chunk>(std::move(c));
    auto task = [self = shared_from_this(), layer = layer, held] {
      self->RunChunk(layer, std::move(*held));
    };
    const uint64_t units = IngestUnits(held->bytes());
    if (!admit) {
      workers_->Submit(options_.tenant, units, std::move(task));
      continue;
    }
    if (workers_->TrySubmit(options_.tenant, units, std::move(task))) continue;
    // The pool's queue is full: the chunk never runs, and the append fails.
    Deferred refused;
    {
      absl::MutexLock lock(&mu_);
      LayerQueue& q = layers_[layer];
      q.running = false;
      --running_;
      --pending_chunks_;
      pending_bytes_ -= held->bytes();
      FailLocked(BusyError(), &refused);
    }
    RollBack(&refused);
    if (held->done) held->done(status(), false);
    Finish(std::move(refused), /*admit=*/false);
  }
  if (d.commit) workers_->Submit([self = shared_from_this()] { self->RunCommit(); });
}

absl::Status IngestAppend::StageRows(int layer, const Chunk& c, AppendTxn* txn) const {
  const int offset = static_cast<int>(c.offset);
  if (c.device_k != nullptr) {
    return txn->StageDeviceLayer(layer, offset, static_cast<int>(c.count), c.device_k, c.device_v);
  }
  const size_t values = static_cast<size_t>(c.count) * model_->row_values();
  // BF16 rows of the right size are used where they lie (no copy); anything else is converted.
  auto view = [&](absl::string_view bytes, const char* what,
                  std::vector<Bf16>* storage) -> absl::StatusOr<absl::Span<const Bf16>> {
    if (dtype_ == v1::DTYPE_BF16 && bytes.size() == values * sizeof(Bf16) &&
        reinterpret_cast<uintptr_t>(bytes.data()) % alignof(Bf16) == 0) {
      return absl::MakeConstSpan(reinterpret_cast<const Bf16*>(bytes.data()), values);
    }
    KVPOOL_ASSIGN_OR_RETURN(*storage, DecodeToBf16(dtype_, bytes, values, what));
    return absl::MakeConstSpan(*storage);
  };
  std::vector<Bf16> k_copy, v_copy;
  KVPOOL_ASSIGN_OR_RETURN(absl::Span<const Bf16> k, view(c.k, "k", &k_copy));
  KVPOOL_ASSIGN_OR_RETURN(absl::Span<const Bf16> v, view(c.v, "v", &v_copy));
  KVPOOL_RETURN_IF_ERROR(txn->StageLayer(layer, offset, k, v));
  if (options_.codec_health != nullptr && options_.codec_health->ShouldSample()) {
    options_.codec_health->Sample(*model_, layer, k, v);
  }
  return absl::OkStatus();
}

void IngestAppend::RunChunk(int layer, Chunk chunk) {
  AppendTxn* txn = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (status_.ok()) txn = txn_.get();
  }
  absl::Status s;
  if (txn != nullptr && options_.cancelled && options_.cancelled()) {
    s = absl::CancelledError("the append was cancelled");
  }
  if (txn != nullptr && s.ok() && chunk.ready) s = chunk.ready();
  if (txn != nullptr && s.ok()) s = StageRows(layer, chunk, txn);
  Deferred d;
  bool layer_complete = false;
  {
    absl::MutexLock lock(&mu_);
    if (ticket_ != nullptr) ticket_->Touch();  // a producer paused by backpressure is not idle
    --running_;
    --pending_chunks_;
    pending_bytes_ -= chunk.bytes();
    LayerQueue& q = layers_[layer];
    q.running = false;
    if (txn == nullptr) {
      s = status_;
    } else if (s.ok()) {
      q.next += chunk.count;
      layer_complete = q.next == static_cast<uint32_t>(num_tokens_);
      if (layer_complete) ++complete_layers_;
    } else {
      FailLocked(s, &d);
    }
    if (status_.ok()) {
      ScheduleLocked(layer, &d);
      SettleLocked(&d);
    } else {
      DropIfIdleLocked(&d);
    }
  }
  RollBack(&d);  // a failed append is rolled back before its last chunk reports
  if (chunk.done) chunk.done(s, layer_complete);
  Finish(std::move(d), /*admit=*/false);
}

void IngestAppend::RunCommit() {
  std::unique_ptr<AppendTxn> txn;
  {
    absl::MutexLock lock(&mu_);
    txn = std::move(txn_);
    ended_ = true;
  }
  absl::Status s;
  if (options_.cancelled && options_.cancelled())
    s = absl::CancelledError("the append was cancelled");
  if (s.ok()) s = txn->CheckComplete();
  absl::StatusOr<AppendResult> r =
      s.ok() ? store_->Commit(std::move(txn)) : absl::StatusOr<AppendResult>(s);
  if (s.ok() && r.ok()) counters_->CountCommit(*model_, num_tokens_);
  txn.reset();  // an incomplete or cancelled append rolls back before it is reported
  if (!r.ok()) {
    absl::MutexLock lock(&mu_);
    if (status_.ok()) status_ = r.status();
  }
  End(std::move(r));
}

void IngestAppend::End(absl::StatusOr<AppendResult> result) {
  // Committed or rolled back: the pages are the sequence's or the pool's again.
  std::shared_ptr<Admission::Ticket> ticket;
  {
    absl::MutexLock lock(&mu_);
    ticket = std::move(ticket_);
  }
  if (ticket != nullptr) ticket->Unreserve(ticket->reserved());
  ticket.reset();  // released before anyone hears of the end (unless the producer holds it too)
  // Released once run: what it captures (the producer's state) may own this append.
  std::function<void(absl::StatusOr<AppendResult>)> on_end = std::move(on_end_);
  on_end_ = nullptr;
  if (on_end) on_end(std::move(result));
}

bool IngestAppend::Complete() const {
  absl::MutexLock lock(&mu_);
  return status_.ok() && running_ == 0 && complete_layers_ == model_->num_layers;
}

void IngestAppend::Commit() {
  Deferred d;
  {
    absl::MutexLock lock(&mu_);
    if (commit_requested_ || !status_.ok()) return;
    commit_requested_ = true;
    SettleLocked(&d);
  }
  Finish(std::move(d), /*admit=*/false);
}

void IngestAppend::Abort(absl::Status why, std::function<void()> rolled_back) {
  Deferred d;
  {
    absl::MutexLock lock(&mu_);
    if (rolled_back) {
      if (committing_ || txn_ == nullptr) {
        d.rolled_back.push_back(std::move(rolled_back));
      } else {
        on_rolled_back_.push_back(std::move(rolled_back));
      }
    }
    if (!committing_) FailLocked(std::move(why), &d);
  }
  Finish(std::move(d), /*admit=*/false);
}

absl::Status IngestAppend::status() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

}  // namespace kvpool::server
