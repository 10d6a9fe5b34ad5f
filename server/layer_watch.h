// LayerWatch: one layer of one sequence, kept up to date for a caller that attends it again and
// again (server/attention_plan.h). Like a SequenceSnapshot it holds a reference on every page it
// shows, so its block ids stay valid whatever happens to the sequence; unlike a snapshot it
// follows the sequence: Refresh takes references only on pages that appeared since the last
// refresh and drops only those that left (demoted recent pages), so its cost grows with the
// change, not with the sequence, and an unchanged sequence costs one atomic load.
//
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<LayerWatch> w, store.WatchLayer(tenant, "s", 3));
//   KVPOOL_ASSIGN_OR_RETURN(bool changed, w->Refresh());   // before each use
//   PagedKvTables::Sequence kv = w->KvSequence(/*rows=*/1);
//
// Not thread-safe: one owner refreshes and reads it.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/paged_kv.h"
#include "server/block_pool.h"

namespace kvpool::server {
namespace internal {
class Sequence;
}  // namespace internal

class LayerWatch {
 public:
  ~LayerWatch();  // drops the references
  LayerWatch(const LayerWatch&) = delete;
  LayerWatch& operator=(const LayerWatch&) = delete;

  // Brings the view up to the sequence's current pages; returns whether anything changed. Renews
  // the sequence's lease (attention is use). NotFound once the sequence was released (reason
  // EXPIRED when its lease ran out), DataLoss (reason CORRUPT) once a page failed its checksum;
  // the view is then unchanged and the caller should drop it.
  absl::StatusOr<bool> Refresh();

  const std::string& sequence_id() const { return id_; }
  int layer() const { return layer_; }
  int total() const { return sink_ + history_ + recent_; }
  // The layer as one sequence of a paged KV batch (block ids of the watch's pages).
  PagedKvTables::Sequence KvSequence(int rows) const;
  // The pools the block ids are in: the model's history blocks and its BF16 pages.
  PagedKvView history_pool() const;
  PagedKvView bf16_pool() const;
  // Block ids of each tier, as KvSequence shows them.
  const std::vector<int32_t>& sink_ids() const { return ids_[0]; }
  const std::vector<int32_t>& history_ids() const { return ids_[1]; }
  const std::vector<int32_t>& recent_ids() const { return ids_[2]; }

 private:
  friend class SequenceStore;
  LayerWatch(BlockPool* pool, std::shared_ptr<internal::Sequence> seq, int layer);

  BlockPool* const pool_;
  const std::shared_ptr<internal::Sequence> seq_;
  const std::string id_;
  const int layer_;
  uint64_t generation_ = ~uint64_t{0};  // none seen yet: the first Refresh fills the view
  int sink_ = 0, history_ = 0, recent_ = 0, recent_head_ = 0;
  std::vector<PageId> sink_pages_, history_pages_;
  std::deque<PageId> recent_pages_;
  std::vector<int32_t> ids_[3];  // sink, history, recent
};

}  // namespace kvpool::server
