#include "server/attention_plan.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "common/status_macros.h"

namespace kvpool::server {
namespace {

constexpr int kTiers = 3;  // sink, history, recent: the order of PagedKvTables' words

// Table entries a tier gets for `need` block ids: room to grow, so a growing sequence rewrites
// only its new entries for a while instead of the layer's whole layout.
int32_t Capacity(size_t need) {
  return static_cast<int32_t>(std::max<size_t>(1, need + need / 4 + 4));
}

}  // namespace

struct AttentionPlan::Layer {
  std::vector<std::unique_ptr<LayerWatch>> watches;  // per sequence
  std::unique_ptr<ResidentTables> tables;  // null where the backend cannot read them resident
  std::vector<int32_t> host;               // the tables' image (what they hold)
  int32_t cap[kTiers] = {0, 0, 0};         // block table stride per tier
  size_t at[kTiers] = {0, 0, 0};           // word offset of each tier's block tables
  PagedKvBatch batch;                      // arrays in tables (or in host)
  bool valid = false;                      // tables match the watches
};

AttentionPlan::AttentionPlan(SequenceStore* store, ComputeBackend* backend, TenantId tenant,
                             std::shared_ptr<const Model> model, std::vector<std::string> ids,
                             int num_queries)
    : store_(store),
      backend_(backend),
      tenant_(std::move(tenant)),
      model_(std::move(model)),
      ids_(std::move(ids)),
      num_queries_(num_queries),
      layers_(model_->num_layers),
      attended_(ids_.size(), 0) {}

AttentionPlan::~AttentionPlan() = default;

absl::StatusOr<std::unique_ptr<AttentionPlan>> AttentionPlan::Create(
    SequenceStore* store, ComputeBackend* backend, TenantId tenant,
    std::shared_ptr<const Model> model, std::vector<std::string> sequence_ids, int num_queries) {
  if (sequence_ids.empty()) return absl::InvalidArgumentError("attention batch is empty");
  if (num_queries < 1) return absl::InvalidArgumentError("num_queries must be >= 1");
  for (const std::string& id : sequence_ids) {
    if (id.empty()) return absl::InvalidArgumentError("empty sequence id in an attention plan");
  }
  return std::unique_ptr<AttentionPlan>(new AttentionPlan(
      store, backend, std::move(tenant), std::move(model), std::move(sequence_ids), num_queries));
}

void AttentionPlan::WriteRow(Layer* l, int row, const LayerWatch& w) {
  const PagedKvTables::Sequence s = w.KvSequence(1);
  const PagedKvTables::Tier* tiers[kTiers] = {&s.sink, &s.history, &s.recent};
  const size_t rows = static_cast<size_t>(this->rows());
  auto put = [&](size_t index, int32_t value) {
    if (l->host[index] == value) return;
    l->host[index] = value;
    patch_.push_back({static_cast<uint32_t>(index), value});
  };
  for (int t = 0; t < kTiers; ++t) {
    const size_t table = l->at[t] + static_cast<size_t>(row) * l->cap[t];
    for (size_t j = 0; j < tiers[t]->blocks.size(); ++j) put(table + j, tiers[t]->blocks[j]);
    const size_t first = l->at[t] + rows * l->cap[t] + row;
    put(first, tiers[t]->first_token);
    put(first + rows, tiers[t]->num_tokens);
  }
}

absl::Status AttentionPlan::Relayout(Layer* l) {
  l->valid = false;
  const size_t rows = static_cast<size_t>(this->rows());
  size_t need[kTiers] = {0, 0, 0};
  for (const auto& w : l->watches) {
    need[0] = std::max(need[0], w->sink_ids().size());
    need[1] = std::max(need[1], w->history_ids().size());
    need[2] = std::max(need[2], w->recent_ids().size());
  }
  size_t total = 0;
  for (int t = 0; t < kTiers; ++t) {
    l->cap[t] = Capacity(need[t]);
    l->at[t] = total;
    total += rows * (static_cast<size_t>(l->cap[t]) + 2);
  }
  if (total > UINT32_MAX) return absl::ResourceExhaustedError("attention plan tables too large");
  const Model& m = *model_;
  const bool int2_kernel = m.block_layout.bits == 2 && m.block_layout.group_size == m.head_dim;
  l->tables.reset();
  if (backend_->device() < 0 || int2_kernel) {
    KVPOOL_ASSIGN_OR_RETURN(l->tables, backend_->AllocateTables(total));
  }
  l->host.assign(total, 0);  // what fresh tables hold
  patch_.clear();
  for (size_t i = 0; i < l->watches.size(); ++i) {
    for (int q = 0; q < num_queries_; ++q) {
      WriteRow(l, static_cast<int>(i) * num_queries_ + q, *l->watches[i]);
    }
  }
  if (l->tables != nullptr) {
    KVPOOL_RETURN_IF_ERROR(backend_->PatchTables(l->tables.get(), patch_));
    words_written_ += patch_.size();
  }
  const int32_t* words = l->tables != nullptr ? l->tables->words() : l->host.data();
  PagedKvBatch& b = l->batch;
  b.history_pool = l->watches.front()->history_pool();
  b.bf16_pool = l->watches.front()->bf16_pool();
  b.num_seqs = static_cast<int32_t>(rows);
  PagedKvTier* tiers[kTiers] = {&b.sink, &b.history, &b.recent};
  for (int t = 0; t < kTiers; ++t) {
    const int32_t* table = words + l->at[t];
    const int32_t* first = table + rows * l->cap[t];
    *tiers[t] = PagedKvTier{table, l->cap[t], first, first + rows};
  }
  l->valid = true;
  return absl::OkStatus();
}

absl::StatusOr<AttentionPlan::Layer*> AttentionPlan::Prepare(int layer) {
  std::unique_ptr<Layer>& slot = layers_[layer];
  if (slot == nullptr) {
    auto l = std::make_unique<Layer>();
    for (const std::string& id : ids_) {
      KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<LayerWatch> w,
                              store_->WatchLayer(tenant_, id, *model_, layer));
      l->watches.push_back(std::move(w));
    }
    slot = std::move(l);
  }
  return slot.get();
}

absl::Status AttentionPlan::Refresh(Layer* l) {
  bool relayout = !l->valid;
  patch_.clear();
  for (size_t i = 0; i < l->watches.size(); ++i) {
    LayerWatch& w = *l->watches[i];
    KVPOOL_ASSIGN_OR_RETURN(bool changed, w.Refresh());
    if (!changed || relayout) continue;
    if (w.sink_ids().size() > static_cast<size_t>(l->cap[0]) ||
        w.history_ids().size() > static_cast<size_t>(l->cap[1]) ||
        w.recent_ids().size() > static_cast<size_t>(l->cap[2])) {
      relayout = true;
      continue;
    }
    for (int q = 0; q < num_queries_; ++q) {
      WriteRow(l, static_cast<int>(i) * num_queries_ + q, w);
    }
  }
  if (relayout) {
    KVPOOL_RETURN_IF_ERROR(Relayout(l));
  } else if (!patch_.empty() && l->tables != nullptr) {
    absl::Status s = backend_->PatchTables(l->tables.get(), patch_);
    if (!s.ok()) {
      l->valid = false;
      return s;
    }
    words_written_ += patch_.size();
  }
  PagedKvBatch& b = l->batch;
  b.max_history_tokens = 0;
  b.max_bf16_tokens = 0;
  for (const auto& w : l->watches) {
    const PagedKvTables::Sequence s = w->KvSequence(1);
    b.max_history_tokens = std::max(b.max_history_tokens, s.history.num_tokens);
    b.max_bf16_tokens = std::max(b.max_bf16_tokens, s.sink.num_tokens + s.recent.num_tokens);
  }
  return absl::OkStatus();
}

absl::StatusOr<AttentionPlan::Layer*> AttentionPlan::Ready(int layer, const AttentionRows& io) {
  if (layer < 0 || layer >= model_->num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " out of range [0, ", model_->num_layers, ")"));
  }
  if (io.rows != rows() || io.queries == nullptr || io.out == nullptr || io.lse == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("an attention plan call needs ", rows(), " query rows and all buffers"));
  }
  KVPOOL_ASSIGN_OR_RETURN(Layer * l, Prepare(layer));
  if (absl::Status s = Refresh(l); !s.ok()) {
    // Sequences are looked up again by the next call: one released since may exist anew.
    layers_[layer].reset();
    return s;
  }
  return l;
}

absl::Span<const int32_t> AttentionPlan::Attended(const Layer& l) {
  for (size_t i = 0; i < l.watches.size(); ++i) attended_[i] = l.watches[i]->total();
  return absl::MakeConstSpan(attended_);
}

absl::StatusOr<absl::Span<const int32_t>> AttentionPlan::Attend(int layer, const AttentionRows& io,
                                                                bool on_device,
                                                                const DeviceMailbox* mailbox) {
  KVPOOL_ASSIGN_OR_RETURN(Layer * l, Ready(layer, io));
  AttentionCall call;
  call.layer = layer;
  call.kv = l->batch;
  call.io = absl::MakeConstSpan(&io, 1);
  call.on_device = on_device;
  call.tables = l->tables.get();
  call.mailbox = mailbox;
  if (l->tables == nullptr) call.kv_words = l->host;
  KVPOOL_RETURN_IF_ERROR(backend_->Attend(*model_, call));
  return Attended(*l);
}

absl::StatusOr<absl::Span<const int32_t>> AttentionPlan::AppendTo(
    int layer, const AttentionRows& io, std::vector<PagedKvTables::Sequence>* sequences,
    PagedKvView* history_pool, PagedKvView* bf16_pool) {
  KVPOOL_ASSIGN_OR_RETURN(Layer * l, Ready(layer, io));
  for (const auto& w : l->watches) sequences->push_back(w->KvSequence(num_queries_));
  *history_pool = l->batch.history_pool;
  *bf16_pool = l->batch.bf16_pool;
  return Attended(*l);
}

}  // namespace kvpool::server
