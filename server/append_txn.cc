#include "server/append_txn.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/internal/sequence.h"
#include "server/sequence_store.h"

namespace kvpool::server {

AppendTxn::~AppendTxn() {
  if (!done_ && store_ != nullptr) store_->Abort(this);
}

uint8_t* AppendTxn::SinkPage(const LayerState& l, int index) const {
  const int base = static_cast<int>(l.base_sink.size());
  return pool_->Data(index < base ? l.base_sink[index] : l.new_sink.at(index - base));
}

uint8_t* AppendTxn::HistoryBlock(const LayerState& l, int index) const {
  // Appends only ever write the partly filled last base block or fresh ones.
  if (index < l.base_history_blocks) return pool_->Data(l.base_history_tail);
  return pool_->Data(l.new_history.at(index - l.base_history_blocks));
}

uint8_t* AppendTxn::RecentPage(const LayerState& l, int index) const {
  const int base = static_cast<int>(l.base_recent.size());
  return pool_->Data(index < base ? l.base_recent[index] : l.new_recent.at(index - base));
}

void AppendTxn::PlanWrites(LayerState& l, Tier tier, int dest, int input_row, int n,
                           std::vector<RowWrite>* out) const {
  const int bt = model_->block_tokens();
  for (int done = 0; done < n;) {
    const int pos = dest + done;
    const int slot = pos % bt;
    const int take = std::min(n - done, bt - slot);
    uint8_t* block = tier == Tier::kHistory ? HistoryBlock(l, pos / bt)
                     : tier == Tier::kSink  ? SinkPage(l, pos / bt)
                                            : RecentPage(l, pos / bt);
    out->push_back({input_row + done, take, block, slot, tier == Tier::kHistory});
    done += take;
  }
}

absl::Status AppendTxn::Demote(LayerState& l) {
  const int bt = model_->block_tokens();
  std::vector<RowMove> moves;
  for (const Demotion& d : demotions_) {
    for (int done = 0; done < d.count;) {
      const int src = d.src + done;
      const int dst = d.dst + done;
      const int take = std::min({d.count - done, bt - src % bt, bt - dst % bt});
      moves.push_back(
          {RecentPage(l, src / bt), src % bt, HistoryBlock(l, dst / bt), dst % bt, take});
      done += take;
    }
  }
  {
    absl::MutexLock lock(&demote_mu_);
    pending_moves_.insert(pending_moves_.end(), moves.begin(), moves.end());
    if (++demoted_layers_ < model_->num_layers) return absl::OkStatus();
    moves = std::move(pending_moves_);
    pending_moves_.clear();
  }
  std::vector<uint32_t> sums(moves.size());
  for (size_t i = 0; i < sums.size(); ++i) moves[i].checksum = &sums[i];
  std::vector<RowMove> done = moves;
  KVPOOL_RETURN_IF_ERROR(store_->demotions_.Demote(*model_, std::move(moves)));
  for (size_t i = 0; i < sums.size(); ++i) {
    RecordWritten(done[i].dst, done[i].dst_slot, done[i].count, sums[i]);
  }
  return absl::OkStatus();
}

void AppendTxn::RecordWritten(const uint8_t* page, int slot, int count, uint32_t sum) {
  const PageId id = pool_->PageOf(page);
  absl::MutexLock lock(&checksum_mu_);
  auto [it, fresh] = written_.try_emplace(id);
  PageChecksum& c = it->second;
  if (fresh) c = pool_->Checksum(id);  // its committed slots; appends write the ones after them
  if (c.empty()) c = {static_cast<uint32_t>(slot), static_cast<uint32_t>(slot), 0};
  c.first = std::min<uint32_t>(c.first, slot);
  c.end = std::max<uint32_t>(c.end, slot + count);
  c.sum += sum;
}

void AppendTxn::PublishChecksums() {
  absl::MutexLock lock(&checksum_mu_);
  for (const auto& [page, c] : written_) pool_->SetChecksum(page, c);
  written_.clear();
}

absl::Status AppendTxn::CheckChunk(int layer, int offset, int n) const {
  const Model& m = *model_;
  if (layer < 0 || layer >= m.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " out of range [0, ", m.num_layers, ")"));
  }
  const LayerState& l = layers_[layer];
  if (offset != l.cursor) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk of layer ", layer, " starts at token offset ", offset, ", expected ",
                     l.cursor, " (a layer's chunks must come in order without gaps or overlaps)"));
  }
  if (n < 1 || n > num_tokens_ - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, ": chunk of ", n, " tokens at offset ", offset,
                     " does not fit the append's ", num_tokens_, " tokens"));
  }
  return absl::OkStatus();
}

absl::Status AppendTxn::StageLayer(int layer, int offset, absl::Span<const Bf16> k,
                                   absl::Span<const Bf16> v) {
  const size_t row = model_->row_values();
  if (k.empty() || k.size() % row != 0 || v.size() != k.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", layer, ": k and v must each hold a positive multiple of kv_heads x head_dim = ",
        row, " values, got ", k.size(), " and ", v.size()));
  }
  const int n = static_cast<int>(k.size() / row);
  KVPOOL_RETURN_IF_ERROR(CheckChunk(layer, offset, n));
  // No separate finiteness scan here: every backend rejects NaN/Inf rows itself, block by block
  // while the rows are in cache (the CPU codec's first pass, the GPU arrival kernels). A scan
  // of the whole chunk first read it from memory once more, about a third of the BF16 store
  // path's time; on error the transaction is dropped, so the blocks written before the bad
  // row do not matter.
  absl::Status s = Stage(layer, offset, n, [&](absl::Span<const RowWrite> writes) {
    return backend_->StageRows(*model_, layer, k, v, writes);
  });
  if (!s.ok() && absl::IsInvalidArgument(s)) {
    return absl::Status(s.code(),
                        absl::StrCat("layer ", layer, " (tokens ", token_start_ + offset, "..",
                                     token_start_ + offset + n - 1, "): ", s.message()));
  }
  return s;
}

absl::Status AppendTxn::StageDeviceLayer(int layer, int offset, int n, const Bf16* k,
                                         const Bf16* v) {
  KVPOOL_RETURN_IF_ERROR(CheckChunk(layer, offset, n));
  return Stage(layer, offset, n, [&](absl::Span<const RowWrite> writes) {
    return backend_->StageDeviceRows(*model_, layer, k, v, n, writes);
  });
}

absl::Status AppendTxn::Stage(
    int layer, int offset, int n,
    const std::function<absl::Status(absl::Span<const RowWrite>)>& write) {
  LayerState& l = layers_[layer];
  const int end = offset + n;
  std::vector<RowWrite> writes;
  for (const Segment& seg : segments_) {
    const int a = std::max(offset, seg.input);
    const int b = std::min(end, seg.input + seg.count);
    if (a >= b) continue;
    PlanWrites(l, seg.tier, seg.dest + (a - seg.input), a - offset, b - a, &writes);
  }
  std::vector<uint32_t> sums(writes.size());
  for (size_t i = 0; i < sums.size(); ++i) writes[i].checksum = &sums[i];
  KVPOOL_RETURN_IF_ERROR(write(writes));
  for (size_t i = 0; i < sums.size(); ++i) {
    RecordWritten(writes[i].block, writes[i].slot, writes[i].count, sums[i]);
  }
  l.cursor = end;
  if (l.cursor == num_tokens_) KVPOOL_RETURN_IF_ERROR(Demote(l));
  return absl::OkStatus();
}

absl::Status AppendTxn::CheckComplete() const {
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (layers_[i].cursor != num_tokens_) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", i,
                                                     " is incomplete: ", layers_[i].cursor, " of ",
                                                     num_tokens_, " tokens received"));
    }
  }
  return absl::OkStatus();
}

void AppendTxn::Release() {
  std::vector<PageId> pages = std::move(base_refs_);
  for (LayerState& l : layers_) {
    pages.insert(pages.end(), l.new_sink.begin(), l.new_sink.end());
    pages.insert(pages.end(), l.new_history.begin(), l.new_history.end());
    pages.insert(pages.end(), l.new_recent.begin(), l.new_recent.end());
    l.new_sink.clear();
    l.new_history.clear();
    l.new_recent.clear();
  }
  pool_->UnrefAll(pages);
  done_ = true;
}

}  // namespace kvpool::server
