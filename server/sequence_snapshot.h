// SequenceSnapshot: a consistent view of some layers of one sequence, holding a reference on
// every page it shows, so it stays valid while appends, demotions or a release of the sequence go
// on. Taken by SequenceStore::Snapshot; dropping it releases the references.
//
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<SequenceSnapshot> snap,
//                           store.Snapshot(tenant, "seq-1", /*layers=*/{3}));
//   KVPOOL_RETURN_IF_ERROR(snap->ReadRotated(backend, 0, 0, snap->total(), k, v));
//
// Its layers are block ids of the pool (BlockPool::BlockId): the rows of a paged KV batch
// (kernels/paged_kv.h) for attention, made here once (KvSequence) and read as they are by the
// backends and the kernels.
//
// Thread-safe to read from several threads (it never changes after it is taken).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/bf16.h"
#include "kernels/paged_kv.h"
#include "server/backend.h"
#include "server/block_pool.h"
#include "server/model_registry.h"
#include "server/page_verifier.h"
#include "server/prefix_index.h"

namespace kvpool::server {

namespace internal {
class Sequence;
}  // namespace internal

// A consistent, reference-holding view of some layers of a sequence.
class SequenceSnapshot {
 public:
  // One layer's tiers as block ids: sink and recent in bf16_pool(), history in history_pool().
  struct Layer {
    int layer = 0;
    std::vector<int32_t> sink;
    std::vector<int32_t> history;
    std::vector<int32_t> recent;  // the first recent_head() slots of the first page were demoted
  };

  ~SequenceSnapshot();
  SequenceSnapshot(const SequenceSnapshot&) = delete;
  SequenceSnapshot& operator=(const SequenceSnapshot&) = delete;

  const Model& model() const { return *model_; }
  const std::shared_ptr<const Model>& model_ptr() const { return model_; }
  const std::string& sequence_id() const { return id_; }
  // Which life of the id this is (ReadBlocksCursor.sequence_incarnation).
  uint64_t incarnation() const { return incarnation_; }
  int sink() const { return sink_; }
  int history() const { return history_; }
  int recent() const { return recent_; }
  int total() const { return sink_ + history_ + recent_; }
  int recent_head() const { return recent_head_; }
  const std::vector<Layer>& layers() const { return layers_; }
  // Prefix units of the sequence whose hashes the daemon knows (needs token ids), in order.
  const std::vector<PrefixUnitKey>& prefix_chain() const { return chain_; }

  // The pools the block ids are in: the model's history blocks and its BF16 pages.
  const PagedKvView& history_pool() const { return history_pool_; }
  const PagedKvView& bf16_pool() const { return bf16_pool_; }
  // layers()[i] as one sequence of a paged KV batch, attended by `rows` query rows.
  PagedKvTables::Sequence KvSequence(size_t i, int rows = 1) const;
  // Rotated K and V of tokens [start, start + count) of layers()[i], as fp32
  // [count][kv_heads][head_dim] each (sink and recent exact, history dequantized). The pages
  // read are verified first (VerifyTokens).
  [[nodiscard]] absl::Status ReadRotated(ComputeBackend* backend, size_t i, int start, int count,
                                         absl::Span<float> k, absl::Span<float> v) const;
  // BF16 rows of the sink (tier 0) or recent (tier 1) tokens [start, start + count) relative
  // to the tier, of layers()[i], copied into [count][kv_heads][head_dim] buffers, after
  // verifying the pages read.
  [[nodiscard]] absl::Status CopyBf16Rows(ComputeBackend* backend, size_t i, bool recent_tier,
                                          int start, int count, absl::Span<Bf16> k,
                                          absl::Span<Bf16> v) const;
  // Bytes of history block `b` of layers()[i].
  const uint8_t* HistoryBlock(size_t i, size_t b) const;

  // Integrity (page_verifier.h). Each check that fails marks the sequence corrupt and returns
  // its DATA_LOSS error.
  // Verifies every page holding tokens [start, start + count) of layers()[i].
  [[nodiscard]] absl::Status VerifyTokens(ComputeBackend* backend, size_t i, int start,
                                          int count) const;
  // Checks a host copy of history block `b` of layers()[i] (ReadBlocks sends that copy).
  [[nodiscard]] absl::Status CheckHistoryCopy(size_t i, size_t b, const uint8_t* copy) const;
  // Every page of every layer of the snapshot, for the scrubber.
  std::vector<PageToVerify> AllPages() const;
  // Marks the sequence corrupt (counted once) and returns its error.
  absl::Status MarkCorrupt() const;

 private:
  friend class SequenceStore;
  SequenceSnapshot() = default;

  BlockPool* pool_ = nullptr;
  PagedKvView history_pool_;
  PagedKvView bf16_pool_;
  std::shared_ptr<internal::Sequence> seq_;
  std::shared_ptr<IntegrityCounters> counters_;
  std::shared_ptr<const Model> model_;
  std::string id_;
  uint64_t incarnation_ = 0;
  int sink_ = 0;
  int history_ = 0;
  int recent_ = 0;
  int recent_head_ = 0;
  std::vector<Layer> layers_;
  std::vector<PrefixUnitKey> chain_;
  std::vector<PageId> refs_;
};

}  // namespace kvpool::server
