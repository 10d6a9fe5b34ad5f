#include "server/layer_watch.h"

#include <algorithm>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "server/internal/sequence.h"
#include "server/page_verifier.h"

namespace kvpool::server {
namespace {

// Brings `have` (pages this watch references) and `ids` (their block ids) to `now`, keeping the
// references right: pages that appeared are referenced (into *added), pages that left are
// returned in *left. A tier's pages never change in place: it grows at its end (sink, history)
// and may lose its front (recent: demotion), so the common case finds `have`'s kept part as a
// run of `now` by its two ends and touches only what changed; anything else is a full swap.
template <typename Have, typename Now>
void Follow(const Now& now, const BlockPool& pool, Have* have, std::vector<int32_t>* ids,
            std::vector<PageId>* added, std::vector<PageId>* left) {
  size_t drop = have->size();
  if (!now.empty()) {
    drop = static_cast<size_t>(std::find(have->begin(), have->end(), now.front()) - have->begin());
  }
  size_t kept = have->size() - drop;
  const bool run = kept <= now.size() && (kept == 0 || have->back() == now[kept - 1]);
  if (!run) {
    drop = have->size();
    kept = 0;
  }
  left->insert(left->end(), have->begin(), have->begin() + drop);
  have->erase(have->begin(), have->begin() + drop);
  ids->erase(ids->begin(), ids->begin() + drop);
  for (size_t i = kept; i < now.size(); ++i) {
    added->push_back(now[i]);
    have->push_back(now[i]);
    ids->push_back(pool.BlockId(now[i]));
  }
}

}  // namespace

LayerWatch::LayerWatch(BlockPool* pool, std::shared_ptr<internal::Sequence> seq, int layer)
    : pool_(pool), seq_(std::move(seq)), id_(seq_->id), layer_(layer) {}

LayerWatch::~LayerWatch() {
  std::vector<PageId> refs(sink_pages_.begin(), sink_pages_.end());
  refs.insert(refs.end(), history_pages_.begin(), history_pages_.end());
  refs.insert(refs.end(), recent_pages_.begin(), recent_pages_.end());
  pool_->UnrefAll(refs);
}

absl::StatusOr<bool> LayerWatch::Refresh() {
  internal::Sequence& seq = *seq_;
  seq.Touch();
  if (seq.corrupt.load(std::memory_order_acquire)) return CorruptSequenceError(id_);
  if (seq.generation.load(std::memory_order_acquire) == generation_) return false;
  std::vector<PageId> added, left;
  {
    absl::MutexLock lock(&seq.mu);
    if (seq.released) return internal::ReleasedError(id_, seq.expired);
    generation_ = seq.generation.load(std::memory_order_relaxed);
    const internal::LayerPages& p = seq.layers[layer_];
    Follow(p.sink, *pool_, &sink_pages_, &ids_[0], &added, &left);
    Follow(p.history, *pool_, &history_pages_, &ids_[1], &added, &left);
    Follow(p.recent, *pool_, &recent_pages_, &ids_[2], &added, &left);
    sink_ = seq.layout.sink();
    history_ = seq.layout.history();
    recent_ = seq.layout.recent();
    recent_head_ = seq.recent_head;
    // Taken under the sequence's lock: its own references may go as soon as it is released.
    pool_->RefAll(added);
  }
  pool_->UnrefAll(left);
  return true;
}

PagedKvView LayerWatch::history_pool() const {
  const Model& m = *seq_->model;
  return pool_->View(m.block_layout, m.codec.quant.scale_dtype);
}

PagedKvView LayerWatch::bf16_pool() const {
  const Model& m = *seq_->model;
  return pool_->View(m.bf16_layout, m.codec.quant.scale_dtype);
}

PagedKvTables::Sequence LayerWatch::KvSequence(int rows) const {
  PagedKvTables::Sequence s;
  s.sink = {ids_[0], 0, sink_};
  s.history = {ids_[1], 0, history_};
  s.recent = {ids_[2], recent_head_, recent_};
  s.rows = rows;
  return s;
}

}  // namespace kvpool::server
