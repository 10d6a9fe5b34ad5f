#include "server/attention_engine.h"

#include <atomic>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "kernels/value_range.h"

namespace kvpool::server {

struct AttentionEngine::Batch {
  TenantId tenant;
  std::shared_ptr<const Model> model;
  int layer = 0;
  std::vector<AttentionQuery> queries;
  std::vector<std::unique_ptr<SequenceSnapshot>> snapshots;
  std::vector<size_t> row_offset;  // first query row of each sequence in `q`
  std::vector<float> q;            // all queries [rows][head_dim]: rotated unless batched
  std::vector<float> out;          // all outputs, same shape: rotated basis unless batched
  std::vector<AttentionResult> results;
  std::vector<absl::Status> errors;  // per sequence (per-sequence CPU path)
  std::atomic<size_t> pending{0};
  AttentionDone done;
};

// A result the caller can merge: over a non-empty sequence every output and LSE is finite.
// (An empty sequence answers output 0 and LSE -inf, the documented "nothing attended"; an
// overflow must never look like that.) The value range (kernels/value_range.h) makes overflow
// impossible on the CPU; this check is what guarantees it on every backend.
absl::Status AttentionEngine::CheckFinite(const AttentionResult& r) {
  if (r.attended_tokens == 0) return absl::OkStatus();
  bool finite = true;
  for (float x : r.lse) finite = finite && std::isfinite(x);
  for (float x : r.out) finite = finite && std::isfinite(x);
  if (finite) return absl::OkStatus();
  return absl::OutOfRangeError(absl::StrCat(
      "attention over sequence ", Quote(r.sequence_id),
      " overflowed the float range (queries and keys too large); nothing was answered"));
}

absl::Status AttentionEngine::Validate(const Model& model, int layer,
                                       const std::vector<AttentionQuery>& queries) {
  if (layer < 0 || layer >= model.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " out of range [0, ", model.num_layers, ")"));
  }
  if (queries.empty()) return absl::InvalidArgumentError("attention batch is empty");
  const size_t per_query = static_cast<size_t>(model.q_heads) * model.head_dim;
  for (const AttentionQuery& q : queries) {
    if (q.num_queries < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence ", Quote(q.sequence_id), ": num_queries must be >= 1"));
    }
    if (q.q.size() != per_query * q.num_queries) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence ", Quote(q.sequence_id), ": q must hold num_queries x q_heads x head_dim = ",
          q.num_queries, " x ", model.q_heads, " x ", model.head_dim, " values, got ", q.q.size()));
    }
    for (float x : q.q) {
      if (!std::isfinite(x)) {
        return absl::InvalidArgumentError(
            absl::StrCat("sequence ", Quote(q.sequence_id), ": q contains NaN or Inf"));
      }
      if (std::fabs(x) >= kValueMagnitudeLimit) {
        return absl::OutOfRangeError(
            absl::StrCat("sequence ", Quote(q.sequence_id), ": q has a value of magnitude >= ",
                         kValueMagnitudeLimit, " (kvpool takes |q| < 2^16)"));
      }
    }
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
  size_t rows = 0;
  for (const AttentionQuery& q : b->queries) {
    KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<SequenceSnapshot> snap,
                            SnapshotOf(b->tenant, m, b->layer, q.sequence_id));
    b->snapshots.push_back(std::move(snap));
    b->row_offset.push_back(rows);
    rows += static_cast<size_t>(q.num_queries) * m.q_heads;
  }
  std::vector<float> q_all;
  q_all.reserve(rows * m.head_dim);
  for (const AttentionQuery& q : b->queries) q_all.insert(q_all.end(), q.q.begin(), q.q.end());
  b->out.assign(q_all.size(), 0.0f);
  b->results.resize(b->queries.size());
  b->errors.assign(b->queries.size(), absl::OkStatus());
  for (size_t i = 0; i < b->queries.size(); ++i) {
    b->results[i].sequence_id = b->queries[i].sequence_id;
    b->results[i].attended_tokens = b->snapshots[i]->total();
    b->results[i].lse.resize(static_cast<size_t>(b->queries[i].num_queries) * m.q_heads);
  }
  if (backend_->batched_attention()) {  // the backend rotates on the device
    b->q = std::move(q_all);
    return absl::OkStatus();
  }
  // One batched rotation for every query row of the request.
  b->q.resize(q_all.size());
  return m.codec.rotations.Rotate(b->layer, KvTensor::kKey, q_all, absl::MakeSpan(b->q));
}

absl::Status AttentionEngine::AttendBatched(absl::Span<Batch* const> group) {
  // One backend call for every query row of every request in `group` (same model and layer).
  const Model& m = *group.front()->model;
  std::vector<std::vector<SequenceTiers>> tiers(group.size());
  AttentionBatch batch;
  batch.layer = group.front()->layer;
  std::vector<float> q, out;
  for (size_t g = 0; g < group.size(); ++g) {
    Batch* b = group[g];
    tiers[g].reserve(b->snapshots.size());
    for (const auto& snap : b->snapshots) tiers[g].push_back(snap->Tiers(0));
    for (size_t i = 0; i < tiers[g].size(); ++i) {
      for (int j = 0; j < b->queries[i].num_queries; ++j) batch.tiers.push_back(&tiers[g][i]);
    }
    q.insert(q.end(), b->q.begin(), b->q.end());
  }
  out.resize(q.size());
  std::vector<float> lse(batch.tiers.size() * m.q_heads);
  batch.queries = q;
  batch.out = absl::MakeSpan(out);
  batch.lse = absl::MakeSpan(lse);
  KVPOOL_RETURN_IF_ERROR(backend_->AttendBatch(m, batch));
  size_t out_at = 0, lse_at = 0;
  for (Batch* b : group) {
    std::copy(out.begin() + out_at, out.begin() + out_at + b->out.size(), b->out.begin());
    out_at += b->out.size();
    for (AttentionResult& r : b->results) {
      std::copy(lse.begin() + lse_at, lse.begin() + lse_at + r.lse.size(), r.lse.begin());
      lse_at += r.lse.size();
    }
  }
  return absl::OkStatus();
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
  const Model& m = *b->model;
  const SequenceTiers tiers = b->snapshots[i]->Tiers(0);
  const size_t per_query = static_cast<size_t>(m.q_heads) * m.head_dim;
  AttentionResult& r = b->results[i];
  for (int j = 0; j < b->queries[i].num_queries; ++j) {
    const size_t at = (b->row_offset[i] + static_cast<size_t>(j) * m.q_heads) * m.head_dim;
    absl::StatusOr<AttentionOutput> o =
        backend_->AttendRotated(m, tiers, absl::MakeConstSpan(b->q).subspan(at, per_query));
    if (!o.ok()) {
      b->errors[i] = o.status();
      return;
    }
    std::copy(o->out.begin(), o->out.end(), b->out.begin() + at);
    std::copy(o->lse.begin(), o->lse.end(), r.lse.begin() + static_cast<size_t>(j) * m.q_heads);
  }
}

absl::StatusOr<std::vector<AttentionResult>> AttentionEngine::Finish(Batch* b) {
  const Model& m = *b->model;
  for (const absl::Status& s : b->errors) KVPOOL_RETURN_IF_ERROR(s);
  std::vector<float> unrotated;
  if (backend_->batched_attention()) {
    unrotated = std::move(b->out);  // already in the original basis
  } else {
    unrotated.resize(b->out.size());
    KVPOOL_RETURN_IF_ERROR(
        m.codec.rotations.Unrotate(b->layer, KvTensor::kValue, b->out, absl::MakeSpan(unrotated)));
  }
  const size_t per_query = static_cast<size_t>(m.q_heads) * m.head_dim;
  for (size_t i = 0; i < b->results.size(); ++i) {
    const size_t at = b->row_offset[i] * m.head_dim;
    const size_t n = per_query * b->queries[i].num_queries;
    b->results[i].out.assign(unrotated.begin() + at, unrotated.begin() + at + n);
    KVPOOL_RETURN_IF_ERROR(CheckFinite(b->results[i]));
  }
  b->snapshots.clear();  // drop page references before answering
  return std::move(b->results);
}

absl::StatusOr<std::vector<AttentionResult>> AttentionEngine::Run(
    const TenantId& tenant, std::shared_ptr<const Model> model, int layer,
    std::vector<AttentionQuery> queries) {
  KVPOOL_RETURN_IF_ERROR(Validate(*model, layer, queries));
  Batch b;
  b.tenant = tenant;
  b.model = std::move(model);
  b.layer = layer;
  b.queries = std::move(queries);
  KVPOOL_RETURN_IF_ERROR(Prepare(&b));
  if (backend_->batched_attention()) {
    Batch* one[1] = {&b};
    KVPOOL_RETURN_IF_ERROR(AttendBatched(one));
  } else {
    for (size_t i = 0; i < b.queries.size(); ++i) AttendOne(&b, i);
  }
  return Finish(&b);
}

absl::StatusOr<std::vector<int>> AttentionEngine::RunOnDevice(const TenantId& tenant,
                                                              std::shared_ptr<const Model> model,
                                                              const DeviceAttentionCall& call) {
  if (backend_->device() < 0 || !backend_->batched_attention()) {
    return absl::UnavailableError(
        absl::StrCat("attention on device buffers needs a GPU backend; this daemon runs on '",
                     backend_->name(), "'"));
  }
  const Model& m = *model;
  if (call.layer < 0 || call.layer >= m.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", call.layer, " out of range [0, ", m.num_layers, ")"));
  }
  if (call.sequence_ids.empty()) return absl::InvalidArgumentError("attention batch is empty");
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
  std::vector<SequenceTiers> tiers;
  tiers.reserve(snapshots.size());
  for (const auto& snap : snapshots) tiers.push_back(snap->Tiers(0));
  AttentionBatch batch;
  batch.layer = call.layer;
  for (const SequenceTiers& t : tiers) {
    for (int j = 0; j < call.num_queries; ++j) batch.tiers.push_back(&t);
  }
  batch.device_queries = call.queries;
  batch.device_out = call.out;
  batch.device_lse = call.lse;
  KVPOOL_RETURN_IF_ERROR(backend_->AttendBatch(m, batch));
  std::vector<int> attended;
  attended.reserve(snapshots.size());
  for (const auto& snap : snapshots) attended.push_back(snap->total());
  return attended;  // the snapshots' page references go now
}

absl::Status AttentionEngine::Start(const TenantId& tenant, std::shared_ptr<const Model> model,
                                    int layer, std::vector<AttentionQuery> queries,
                                    AttentionDone done) {
  KVPOOL_RETURN_IF_ERROR(Validate(*model, layer, queries));
  auto b = std::make_shared<Batch>();
  b->tenant = tenant;
  b->model = std::move(model);
  b->layer = layer;
  b->queries = std::move(queries);
  b->done = std::move(done);
  if (workers_ == nullptr) {
    b->done(Run(b->tenant, b->model, b->layer, std::move(b->queries)));
    return absl::OkStatus();
  }
  auto finish_one = [this, b]() {
    // The last sequence to finish un-rotates everything and answers.
    if (b->pending.fetch_sub(1) == 1) b->done(Finish(b.get()));
  };
  const bool queued = workers_->TrySubmit([this, b, finish_one]() {
    absl::Status s = Prepare(b.get());
    if (s.ok() && backend_->batched_attention()) {
      AttendCoalesced(b);  // with whatever other requests are waiting
      return;
    }
    if (!s.ok()) {
      b->snapshots.clear();
      b->done(s);
      return;
    }
    const size_t n = b->queries.size();
    b->pending.store(n);
    // Sequences 1..n-1 go to other workers (never refused: the request was admitted);
    // this worker takes sequence 0.
    for (size_t i = 1; i < n; ++i) {
      workers_->Submit([this, b, i, finish_one]() {
        AttendOne(b.get(), i);
        finish_one();
      });
    }
    AttendOne(b.get(), 0);
    finish_one();
  });
  if (!queued) {
    return absl::ResourceExhaustedError("server busy: worker queue full, retry later");
  }
  return absl::OkStatus();
}

}  // namespace kvpool::server
