#include "server/layer_watch.h"

#include <algorithm>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "server/internal/sequence.h"
#include "server/page_verifier.h"

namespace kvpool::server {
namespace {

// Brings `have` (pages this watch references) to `now`, keeping the references right: pages
// that appeared are referenced (into *added), pages that left are returned in *left. A tier
// either grows at its end (sink, history) or also loses its front (recent: demotion), so the
// common case finds `have`'s kept part as a run of `now`; anything else is a full swap.
template <typename Have, typename Now>
void Follow(const Have& have_in, const Now& now, Have* have, std::vector<PageId>* added,
            std::vector<PageId>* left) {
  size_t drop = 0;
  if (!now.empty()) {
    auto it = std::find(have_in.begin(), have_in.end(), now.front());
    drop = it == have_in.end() ? have_in.size() : static_cast<size_t>(it - have_in.begin());
  } else {
    drop = have_in.size();
  }
  const size_t kept = have_in.size() - drop;
  bool run = kept <= now.size();
  for (size_t i = 0; run && i < kept; ++i) run = have_in[drop + i] == now[i];
  if (!run) {
    left->insert(left->end(), have_in.begin(), have_in.end());
    added->insert(added->end(), now.begin(), now.end());
    have->assign(now.begin(), now.end());
    return;
  }
  left->insert(left->end(), have_in.begin(), have_in.begin() + drop);
  added->insert(added->end(), now.begin() + kept, now.end());
  have->erase(have->begin(), have->begin() + drop);
  have->insert(have->end(), now.begin() + kept, now.end());
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
    Follow(std::vector<PageId>(sink_pages_), p.sink, &sink_pages_, &added, &left);
    Follow(std::vector<PageId>(history_pages_), p.history, &history_pages_, &added, &left);
    Follow(std::deque<PageId>(recent_pages_), p.recent, &recent_pages_, &added, &left);
    sink_ = seq.layout.sink();
    history_ = seq.layout.history();
    recent_ = seq.layout.recent();
    recent_head_ = seq.recent_head;
    // Taken under the sequence's lock: its own references may go as soon as it is released.
    pool_->RefAll(added);
  }
  pool_->UnrefAll(left);
  auto ids = [&](const auto& pages, std::vector<int32_t>* out) {
    out->resize(pages.size());
    for (size_t i = 0; i < pages.size(); ++i) (*out)[i] = pool_->BlockId(pages[i]);
  };
  ids(sink_pages_, &ids_[0]);
  ids(history_pages_, &ids_[1]);
  ids(recent_pages_, &ids_[2]);
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
