#include "server/attention_engine.h"

#include <atomic>
#include <cmath>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "kernels/paged_kv.h"
#include "kernels/value_range.h"

namespace kvpool::server {
namespace {

size_t RowValues(const Model& m) { return static_cast<size_t>(m.q_heads) * m.head_dim; }

absl::Status CheckLayerAndBatch(const Model& model, int layer, size_t sequences) {
  if (layer < 0 || layer >= model.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " out of range [0, ", model.num_layers, ")"));
  }
  if (sequences == 0) return absl::InvalidArgumentError("attention batch is empty");
  return absl::OkStatus();
}

absl::Status CheckQueryRows(const std::string& id, int num_queries) {
  if (num_queries < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence ", Quote(id), ": num_queries must be >= 1"));
  }
  return absl::OkStatus();
}

// Whether every value is finite with |x| below `limit`. Branch-free so that it vectorizes: it
// runs over every query and answer value of a call (a NaN fails the comparison).
bool AllBelow(absl::Span<const float> v, float limit) {
  uint32_t out_of_range = 0;
  for (float x : v) out_of_range |= !(std::fabs(x) < limit);
  return out_of_range == 0;
}

absl::Status CheckQueryValues(const std::string& id, absl::Span<const float> q) {
  if (AllBelow(q, kValueMagnitudeLimit)) return absl::OkStatus();
  for (float x : q) {
    if (!std::isfinite(x)) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence ", Quote(id), ": q contains NaN or Inf"));
    }
  }
  return absl::OutOfRangeError(
      absl::StrCat("sequence ", Quote(id), ": q has a value of magnitude >= ", kValueMagnitudeLimit,
                   " (kvpool takes |q| < 2^16)"));
}

// A result the caller can merge: over a non-empty sequence every output and LSE is finite.
// (An empty sequence answers output 0 and LSE -inf, the documented "nothing attended"; an
// overflow must never look like that.) The value range (kernels/value_range.h) makes overflow
// impossible on the CPU; this check is what guarantees it on every backend.
absl::Status CheckFinite(const std::string& id, int attended_tokens, absl::Span<const float> out,
                         absl::Span<const float> lse) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  if (attended_tokens == 0 || (AllBelow(lse, kInf) && AllBelow(out, kInf))) {
    return absl::OkStatus();
  }
  return absl::OutOfRangeError(absl::StrCat(
      "attention over sequence ", Quote(id),
      " overflowed the float range (queries and keys too large); nothing was answered"));
}

// Layer 0 of each snapshot as a sequence of a paged KV batch, attended by rows[i] query rows.
void AddKvSequences(const std::vector<std::unique_ptr<SequenceSnapshot>>& snapshots,
                    absl::Span<const int> rows, std::vector<PagedKvTables::Sequence>* out) {
  for (size_t i = 0; i < snapshots.size(); ++i)
    out->push_back(snapshots[i]->KvSequence(0, rows[i]));
}

}  // namespace

struct AttentionEngine::Batch {
  TenantId tenant;
  std::shared_ptr<const Model> model;
  int layer = 0;
  AttentionRequest request;
  std::vector<std::unique_ptr<SequenceSnapshot>> snapshots;
  std::vector<size_t> first_row;  // of each sequence
  int rows = 0;
  std::optional<PagedKvTables> kv;  // the request's batch (host backend)
  AttentionAnswer answer;
  std::vector<absl::Status> errors;  // per sequence (host backend)
  std::atomic<size_t> pending{0};
  AttentionDone done;
  std::shared_ptr<CallCancellation> cancel;  // null: runs to the end
};

uint64_t AttentionEngine::AttentionUnits(const Batch& b, size_t i) {
  // Work grows with the tokens attended times the query rows; a unit is kAttentionUnitTokens
  // of that, plus one for the call itself.
  const uint64_t token_rows = static_cast<uint64_t>(b.snapshots[i]->total()) *
                              static_cast<uint64_t>(b.request.num_queries[i]);
  return 1 + token_rows / kAttentionUnitTokens;
}

bool AttentionEngine::StopIfCancelled(Batch* b, size_t units) {
  if (b->cancel == nullptr || !b->cancel->Cancelled()) return false;
  b->cancel->Skip(units);
  return true;
}

absl::Status AttentionEngine::Validate(const Model& model, int layer,
                                       const AttentionRequest& request) {
  KVPOOL_RETURN_IF_ERROR(CheckLayerAndBatch(model, layer, request.sequence_ids.size()));
  const size_t n = request.sequence_ids.size();
  if (request.num_queries.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("attention batch of ", n, " sequences has ",
                                                   request.num_queries.size(), " query counts"));
  }
  size_t rows = 0;
  for (size_t i = 0; i < n; ++i) {
    KVPOOL_RETURN_IF_ERROR(CheckQueryRows(request.sequence_ids[i], request.num_queries[i]));
    rows += static_cast<size_t>(request.num_queries[i]);
  }
  const size_t per_query = RowValues(model);
  if (request.queries.size() != rows * per_query) {
    return absl::InvalidArgumentError(
        absl::StrCat("queries must hold rows x q_heads x head_dim = ", rows, " x ", model.q_heads,
                     " x ", model.head_dim, " values, got ", request.queries.size()));
  }
  size_t at = 0;
  for (size_t i = 0; i < n; ++i) {
    const size_t len = per_query * request.num_queries[i];
    KVPOOL_RETURN_IF_ERROR(CheckQueryValues(request.sequence_ids[i],
                                            absl::MakeConstSpan(request.queries).subspan(at, len)));
    at += len;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SequenceSnapshot>> AttentionEngine::SnapshotOf(
    const TenantId& tenant, const Model& m, int layer, const std::string& id) const {
  const int layer_list[1] = {layer};
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<SequenceSnapshot> snap,
                          store_->Snapshot(tenant, id, layer_list));
  if (snap->model().id != m.id || snap->model().version != m.version) {
    return absl::InvalidArgumentError(absl::StrCat("sequence ", Quote(id), " belongs to model '",
                                                   snap->model().id, "', not ", Quote(m.id)));
  }
  return snap;
}

absl::Status AttentionEngine::Prepare(Batch* b) {
  const Model& m = *b->model;
  const AttentionRequest& req = b->request;
  const size_t n = req.sequence_ids.size();
  for (size_t i = 0; i < n; ++i) {
    KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<SequenceSnapshot> snap,
                            SnapshotOf(b->tenant, m, b->layer, req.sequence_ids[i]));
    b->answer.attended_tokens.push_back(snap->total());
    b->snapshots.push_back(std::move(snap));
    b->first_row.push_back(static_cast<size_t>(b->rows));
    b->rows += req.num_queries[i];
  }
  b->answer.out.resize(static_cast<size_t>(b->rows) * RowValues(m));
  b->answer.lse.resize(static_cast<size_t>(b->rows) * m.q_heads);
  b->errors.assign(n, absl::OkStatus());
  if (backend_->device() < 0) {
    // The host backend attends sequence by sequence on the workers, over rows of this batch.
    std::vector<PagedKvTables::Sequence> seqs;
    AddKvSequences(b->snapshots, req.num_queries, &seqs);
    const SequenceSnapshot& first = *b->snapshots.front();
    b->kv.emplace(first.history_pool(), first.bf16_pool(), seqs);
  }
  return absl::OkStatus();
}

absl::Status AttentionEngine::AttendBatched(absl::Span<Batch* const> group) {
  // One backend call for every query row of every request in `group` (same model and layer):
  // each request's queries and answer are one run of rows.
  const Model& m = *group.front()->model;
  std::vector<PagedKvTables::Sequence> seqs;
  std::vector<AttentionRows> io;
  for (Batch* b : group) {
    AddKvSequences(b->snapshots, b->request.num_queries, &seqs);
    io.push_back({b->request.queries.data(), b->answer.out.data(), b->answer.lse.data(), b->rows});
  }
  const SequenceSnapshot& first = *group.front()->snapshots.front();
  const PagedKvTables kv(first.history_pool(), first.bf16_pool(), seqs);
  AttentionCall call;
  call.layer = group.front()->layer;
  call.kv = kv.batch();
  call.kv_words = kv.words();
  call.io = io;
  return backend_->Attend(m, call);
}

void AttentionEngine::AttendCoalesced(std::shared_ptr<Batch> b) {
  {
    absl::MutexLock lock(&coalesce_mu_);
    waiting_.push_back(std::move(b));
    if (coalescing_) return;  // the running round's thread picks it up
    coalescing_ = true;
  }
  // This thread leads: each round takes every request that arrived meanwhile and makes one
  // backend call per (model, layer) group.
  while (true) {
    std::vector<std::shared_ptr<Batch>> round;
    {
      absl::MutexLock lock(&coalesce_mu_);
      if (waiting_.empty()) {
        coalescing_ = false;
        return;
      }
      round.swap(waiting_);
    }
    std::vector<bool> done(round.size(), false);
    for (size_t i = 0; i < round.size(); ++i) {
      // A request whose caller has gone leaves the round before the device works on it.
      if (StopIfCancelled(round[i].get(), round[i]->snapshots.size())) {
        done[i] = true;
        round[i]->snapshots.clear();
        round[i]->done(round[i]->cancel->status());
      }
    }
    for (size_t i = 0; i < round.size(); ++i) {
      if (done[i]) continue;
      std::vector<Batch*> group;
      for (size_t j = i; j < round.size(); ++j) {
        if (!done[j] && round[j]->model == round[i]->model && round[j]->layer == round[i]->layer) {
          group.push_back(round[j].get());
          done[j] = true;
        }
      }
      const absl::Status s = AttendBatched(group);
      for (Batch* g : group) {
        if (s.ok()) {
          g->done(Finish(g));
        } else {
          g->snapshots.clear();
          g->done(s);
        }
      }
    }
  }
}

void AttentionEngine::AttendOne(Batch* b, size_t i) {
  if (StopIfCancelled(b, 1)) {
    b->errors[i] = b->cancel->status();
    return;
  }
  const Model& m = *b->model;
  const size_t first = b->first_row[i];
  const int rows = b->request.num_queries[i];
  const size_t per_row = RowValues(m);
  const AttentionRows io{b->request.queries.data() + first * per_row,
                         b->answer.out.data() + first * per_row,
                         b->answer.lse.data() + first * m.q_heads, rows};
  AttentionCall call;
  call.layer = b->layer;
  call.kv = b->kv->batch().Rows(static_cast<int>(first), rows);
  call.kv_words = b->kv->words();
  call.io = absl::MakeConstSpan(&io, 1);
  b->errors[i] = backend_->Attend(m, call);
}

absl::StatusOr<AttentionAnswer> AttentionEngine::Finish(Batch* b) {
  const Model& m = *b->model;
  for (const absl::Status& s : b->errors) KVPOOL_RETURN_IF_ERROR(s);
  const size_t per_row = RowValues(m);
  const AttentionAnswer& a = b->answer;
  for (size_t i = 0; i < b->snapshots.size(); ++i) {
    const size_t rows = static_cast<size_t>(b->request.num_queries[i]);
    KVPOOL_RETURN_IF_ERROR(CheckFinite(
        b->request.sequence_ids[i], a.attended_tokens[i],
        absl::MakeConstSpan(a.out).subspan(b->first_row[i] * per_row, rows * per_row),
        absl::MakeConstSpan(a.lse).subspan(b->first_row[i] * m.q_heads, rows * m.q_heads)));
  }
  b->snapshots.clear();  // drop page references before answering
  b->kv.reset();
  return std::move(b->answer);
}

absl::StatusOr<AttentionAnswer> AttentionEngine::Run(const TenantId& tenant,
                                                     std::shared_ptr<const Model> model, int layer,
                                                     AttentionRequest request) {
  KVPOOL_RETURN_IF_ERROR(Validate(*model, layer, request));
  Batch b;
  b.tenant = tenant;
  b.model = std::move(model);
  b.layer = layer;
  b.request = std::move(request);
  KVPOOL_RETURN_IF_ERROR(Prepare(&b));
  if (backend_->device() >= 0) {
    Batch* one[1] = {&b};
    KVPOOL_RETURN_IF_ERROR(AttendBatched(one));
  } else {
    for (size_t i = 0; i < b.snapshots.size(); ++i) AttendOne(&b, i);
  }
  return Finish(&b);
}

absl::StatusOr<std::vector<int>> AttentionEngine::RunOnDevice(const TenantId& tenant,
                                                              std::shared_ptr<const Model> model,
                                                              const DeviceAttentionCall& call) {
  if (backend_->device() < 0) {
    return absl::UnavailableError(
        absl::StrCat("attention on device buffers needs a GPU backend; this daemon runs on '",
                     backend_->name(), "'"));
  }
  const Model& m = *model;
  KVPOOL_RETURN_IF_ERROR(CheckLayerAndBatch(m, call.layer, call.sequence_ids.size()));
  if (call.num_queries < 1) return absl::InvalidArgumentError("num_queries must be >= 1");
  if (call.queries == nullptr || call.out == nullptr || call.lse == nullptr) {
    return absl::InvalidArgumentError("device attention needs query, output and LSE buffers");
  }
  std::vector<std::unique_ptr<SequenceSnapshot>> snapshots;
  snapshots.reserve(call.sequence_ids.size());
  for (const std::string& id : call.sequence_ids) {
    KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<SequenceSnapshot> snap,
                            SnapshotOf(tenant, m, call.layer, id));
    snapshots.push_back(std::move(snap));
  }
  std::vector<PagedKvTables::Sequence> seqs;
  AddKvSequences(snapshots, std::vector<int>(snapshots.size(), call.num_queries), &seqs);
  const PagedKvTables kv(snapshots.front()->history_pool(), snapshots.front()->bf16_pool(), seqs);
  const AttentionRows io{call.queries, call.out, call.lse, kv.batch().num_seqs};
  AttentionCall c;
  c.layer = call.layer;
  c.kv = kv.batch();
  c.kv_words = kv.words();
  c.io = absl::MakeConstSpan(&io, 1);
  c.on_device = true;
  KVPOOL_RETURN_IF_ERROR(backend_->Attend(m, c));
  std::vector<int> attended;
  attended.reserve(snapshots.size());
  for (const auto& snap : snapshots) attended.push_back(snap->total());
  return attended;  // the snapshots' page references go now
}

void AttentionEngine::Begin(std::shared_ptr<Batch> b, bool on_caller) {
  // Abandoned while it waited: none of its sequences are looked at.
  if (StopIfCancelled(b.get(), b->request.sequence_ids.size())) {
    b->done(b->cancel->status());
    return;
  }
  if (absl::Status s = Prepare(b.get()); !s.ok()) {
    b->snapshots.clear();
    b->done(s);
    return;
  }
  if (backend_->device() >= 0) {
    AttendCoalesced(std::move(b));  // with whatever other requests are waiting
    return;
  }
  const size_t n = b->snapshots.size();
  uint64_t units = 0;
  for (size_t i = 0; i < n; ++i) units += AttentionUnits(*b, i);
  if (on_caller && units <= kInlineHostUnits) {
    for (size_t i = 0; i < n; ++i) AttendOne(b.get(), i);
    b->done(Finish(b.get()));
    return;
  }
  b->pending.store(n);
  // Never refused: the request was admitted. The last sequence to finish answers.
  for (size_t i = 0; i < n; ++i) {
    workers_->Submit(b->tenant, AttentionUnits(*b, i), [this, b, i]() {
      AttendOne(b.get(), i);
      if (b->pending.fetch_sub(1) == 1) b->done(Finish(b.get()));
    });
  }
}

absl::Status AttentionEngine::Start(const TenantId& tenant, std::shared_ptr<const Model> model,
                                    int layer, AttentionRequest request, AttentionDone done,
                                    std::shared_ptr<CallCancellation> cancellation) {
  KVPOOL_RETURN_IF_ERROR(Validate(*model, layer, request));
  auto b = std::make_shared<Batch>();
  b->cancel = std::move(cancellation);
  b->tenant = tenant;
  b->model = std::move(model);
  b->layer = layer;
  b->request = std::move(request);
  b->done = std::move(done);
  if (workers_ == nullptr) {
    b->done(Run(b->tenant, b->model, b->layer, std::move(b->request)));
    return absl::OkStatus();
  }
  // A call that finds no work waiting runs on the thread that received it: the hop to a worker
  // and back is most of a short call's latency, and with nothing queued fair queueing has no
  // one to put first. At most as many such calls at once as there are workers.
  if (inline_calls_.fetch_add(1) < workers_->threads() && workers_->queue_depth() == 0) {
    Begin(b, /*on_caller=*/true);
    inline_calls_.fetch_sub(1);
    return absl::OkStatus();
  }
  inline_calls_.fetch_sub(1);
  // The request's first task only snapshots its sequences; each sequence's attention is then a
  // task of its own, costed by the work it does, so tenants share the workers by weighted fair
  // queueing (worker_pool.h) sequence by sequence.
  const bool queued =
      workers_->TrySubmit(b->tenant, 1, [this, b]() { Begin(b, /*on_caller=*/false); });
  if (!queued) {
    return absl::ResourceExhaustedError("server busy: worker queue full, retry later");
  }
  return absl::OkStatus();
}

}  // namespace kvpool::server
