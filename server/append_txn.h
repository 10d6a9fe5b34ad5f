// AppendTxn: one append to a sequence in progress, as a transaction. SequenceStore::BeginAppend
// reserves every page the append needs (all layers) up front; StageLayer rotates and quantizes
// rows of one layer into reserved pages or into unused slots of the sequence's partly filled
// pages (never over committed data, so concurrent readers are safe); SequenceStore::Commit
// publishes the new state atomically. A transaction destroyed without Commit returns everything it
// reserved: a failed append leaves the pool exactly as it was.
//
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<AppendTxn> txn,
//       store.BeginAppend(tenant, "seq-1", AppendSpec{.token_start = 0, .num_tokens = 512,
//                                                    .kind = AppendKind::kFinalPrefill}));
//   for (int layer = 0; layer < model.num_layers; ++layer)
//     KVPOOL_RETURN_IF_ERROR(txn->StageLayer(layer, 0, k_rows, v_rows));  // worker thread
//   KVPOOL_ASSIGN_OR_RETURN(AppendResult r, store.Commit(std::move(txn)));
//
// Thread-safety: different layers may be staged concurrently, one layer's chunks in order.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kernels/bf16.h"
#include "kernels/mixed_sequence.h"
#include "server/backend.h"
#include "server/block_pool.h"
#include "server/model_registry.h"
#include "server/prefix_index.h"
#include "server/sequence_info.h"

namespace kvpool::server {

struct AppendSpec {
  int token_start = 0;                     // must equal the sequence's length
  int num_tokens = 0;                      // >= 1
  AppendKind kind = AppendKind::kPrefill;  // kDecode: num_tokens decode steps
  std::vector<uint32_t> token_ids;         // empty, or num_tokens ids
};

struct AppendResult {
  SequenceInfo info;
  int to_sink = 0;
  int to_history = 0;
  int to_recent = 0;
  int demoted = 0;
  std::vector<PrefixUnitKey> published;
};

namespace internal {
class Sequence;
}  // namespace internal
class SequenceStore;

// An append in progress. Created by SequenceStore::BeginAppend; committed by
// SequenceStore::Commit; destroying it uncommitted rolls it back.
class AppendTxn {
 public:
  ~AppendTxn();
  AppendTxn(const AppendTxn&) = delete;
  AppendTxn& operator=(const AppendTxn&) = delete;

  const Model& model() const { return *model_; }
  const std::shared_ptr<const Model>& model_ptr() const { return model_; }
  int num_tokens() const { return num_tokens_; }
  int token_start() const { return token_start_; }
  // Input tokens of `layer` staged so far.
  int staged(int layer) const { return layers_.at(layer).cursor; }

  // Stages input tokens [offset, offset + n) of `layer`: K and V rows in the engine's basis,
  // BF16 [n][kv_heads][head_dim] each. Rotates, checks finiteness, writes sink/recent rows and
  // quantizes history rows; after the layer's last token, demotes what the plan demotes.
  // InvalidArgument (layer, offset not at the layer's cursor, sizes, NaN/Inf), OutOfRange
  // (a value beyond the scale type). On error the transaction must be dropped.
  [[nodiscard]] absl::Status StageLayer(int layer, int offset, absl::Span<const Bf16> k,
                                        absl::Span<const Bf16> v);

  // StageLayer for K and V rows already in GPU memory (device pointers, [n][kv_heads][head_dim]
  // BF16 each; the backend's StageDeviceRows). No host-side finiteness scan: the arrival
  // kernels reject non-finite rows. Unimplemented on a host backend.
  [[nodiscard]] absl::Status StageDeviceLayer(int layer, int offset, int n, const Bf16* k,
                                              const Bf16* v);

  // InvalidArgument naming the first layer not fully staged, else OK.
  [[nodiscard]] absl::Status CheckComplete() const;

 private:
  friend class SequenceStore;
  enum class Tier : uint8_t { kSink, kHistory, kRecent };
  // Input tokens [input, input + count) go to positions [dest, dest + count) of `tier`
  // (sink/history: token positions in the tier; recent: slots from the base deque's front).
  struct Segment {
    int input = 0;
    int count = 0;
    Tier tier = Tier::kSink;
    int dest = 0;
  };
  // Recent slots [src, src + count) move to history positions [dst, dst + count).
  struct Demotion {
    int src = 0;
    int dst = 0;
    int count = 0;
  };
  struct LayerState {
    std::vector<PageId> base_sink;            // the sequence's sink pages at Begin
    PageId base_history_tail = kInvalidPage;  // its partly filled last block, if any
    int base_history_blocks = 0;
    std::vector<PageId> base_recent;  // its recent pages at Begin
    std::vector<PageId> new_sink;
    std::vector<PageId> new_history;
    std::vector<PageId> new_recent;
    int cursor = 0;
  };

  AppendTxn() = default;
  uint8_t* SinkPage(const LayerState& l, int index) const;
  uint8_t* HistoryBlock(const LayerState& l, int index) const;
  uint8_t* RecentPage(const LayerState& l, int index) const;
  // Appends the writes that put input rows [input_row, input_row + n) at positions
  // [dest, dest + n) of `tier`, split at block boundaries.
  void PlanWrites(LayerState& l, Tier tier, int dest, int input_row, int n,
                  std::vector<RowWrite>* out) const;
  // Layer range and cursor checks of a chunk of n tokens at `offset`.
  absl::Status CheckChunk(int layer, int offset, int n) const;
  // Plans the chunk's writes, hands them to `write` (the backend), advances the layer's cursor
  // and demotes after its last token.
  absl::Status Stage(int layer, int offset, int n,
                     const std::function<absl::Status(absl::Span<const RowWrite>)>& write);
  // Queues the layer's demotion moves; the layer that completes last hands every layer's moves
  // to the backend in one DemoteRows (one kernel launch on the GPU for K and V of every layer: a
  // decode step appends one token to every layer), shared with the demotions of other appends
  // running at the same moment (DemotionBatcher).
  absl::Status Demote(LayerState& l);
  void Release();

  SequenceStore* store_ = nullptr;
  std::shared_ptr<internal::Sequence> seq_;
  std::shared_ptr<const Model> model_;
  BlockPool* pool_ = nullptr;
  ComputeBackend* backend_ = nullptr;
  int token_start_ = 0;
  int num_tokens_ = 0;
  std::vector<std::pair<AppendPlan, AppendKind>> plans_;
  std::vector<Segment> segments_;
  std::vector<Demotion> demotions_;
  absl::Mutex demote_mu_;  // layers may complete concurrently (layer-wise pushes)
  std::vector<RowMove> pending_moves_ ABSL_GUARDED_BY(demote_mu_);
  int demoted_layers_ ABSL_GUARDED_BY(demote_mu_) = 0;
  int final_recent_head_ = 0;
  int popped_recent_pages_ = 0;
  int to_sink_ = 0;
  int to_history_ = 0;
  int to_recent_ = 0;
  int demoted_ = 0;
  std::vector<uint32_t> token_ids_;
  std::vector<LayerState> layers_;
  std::vector<PageId> base_refs_;  // references on base pages this transaction touches
  bool done_ = false;
};

}  // namespace kvpool::server
