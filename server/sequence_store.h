// SequenceStore: every live sequence's KV in the block pool, and the transactions that append
// to it.
//
// Per sequence, one MixedSequenceLayout (kernels/mixed_sequence.h) decides which tokens are BF16
// sink, INT2 history or BF16 recent; it is the same for every layer. Per layer the store keeps
//   sink:    BF16 pages (block_tokens rows of K then V, [t][kv_heads][head_dim] each)
//   history: INT2 blocks (kernels/block_layout.h), history token i in block i / block_tokens
//   recent:  a deque of BF16 pages; the oldest page's first `recent_head` slots were demoted.
// All rows are in the rotated basis.
//
// Appends are transactions: Begin reserves every page the append needs (all layers) up front,
// Stage rotates and quantizes rows of one layer into reserved pages or into unused slots of the
// sequence's partly filled pages (never over committed data, so concurrent readers are safe),
// and Commit publishes the new state atomically. A transaction destroyed without Commit
// returns everything it reserved: a failed append leaves the pool exactly as it was.
//
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<AppendTxn> txn,
//       store.BeginAppend(tenant, "seq-1", AppendSpec{.token_start = 0, .num_tokens = 512,
//                                                    .kind = AppendKind::kFinalPrefill}));
//   for (int layer = 0; layer < model.num_layers; ++layer)
//     KVPOOL_RETURN_IF_ERROR(txn->StageLayer(layer, 0, k_rows, v_rows));  // worker thread
//   KVPOOL_ASSIGN_OR_RETURN(AppendResult r, store.Commit(std::move(txn)));
//
// Reads take a SequenceSnapshot: a consistent view holding references on the pages it shows,
// so it stays valid while appends, demotions or a release go on.
//
// Thread-safe. One append per sequence at a time (another gets ABORTED); different layers of one
// transaction may be staged concurrently, one layer's chunks in order.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kernels/bf16.h"
#include "kernels/mixed_sequence.h"
#include "server/backend.h"
#include "server/block_pool.h"
#include "server/demotion_batcher.h"
#include "server/model_registry.h"
#include "server/prefix_index.h"
#include "server/tenant.h"

namespace kvpool::server {

enum class SequenceState { kPrefill, kDecode, kSealed };

// Public description of a sequence.
struct SequenceInfo {
  std::string id;
  std::string model_id;
  TenantId tenant;
  SequenceState state = SequenceState::kPrefill;
  int sink = 0;
  int history = 0;
  int recent = 0;
  int reused_tokens = 0;
  bool has_token_ids = true;
  size_t pool_bytes = 0;
  size_t shared_bytes = 0;
  size_t bf16_equivalent_bytes = 0;
  int total() const { return sink + history + recent; }
};

// A consistent, reference-holding view of some layers of a sequence.
class SequenceSnapshot {
 public:
  struct Layer {
    int layer = 0;
    std::vector<PageId> sink;
    std::vector<PageId> history;
    std::vector<PageId> recent;
  };

  ~SequenceSnapshot();
  SequenceSnapshot(const SequenceSnapshot&) = delete;
  SequenceSnapshot& operator=(const SequenceSnapshot&) = delete;

  const Model& model() const { return *model_; }
  const std::shared_ptr<const Model>& model_ptr() const { return model_; }
  const std::string& sequence_id() const { return id_; }
  int sink() const { return sink_; }
  int history() const { return history_; }
  int recent() const { return recent_; }
  int total() const { return sink_ + history_ + recent_; }
  int recent_head() const { return recent_head_; }
  const std::vector<Layer>& layers() const { return layers_; }
  // Prefix units of the sequence whose hashes the daemon knows (needs token ids), in order.
  const std::vector<PrefixUnitKey>& prefix_chain() const { return chain_; }

  // Pointers into pool memory for attention over layers()[i].
  SequenceTiers Tiers(size_t i) const;
  // Rotated K and V of tokens [start, start + count) of layers()[i], as fp32
  // [count][kv_heads][head_dim] each (sink and recent exact, history dequantized).
  [[nodiscard]] absl::Status ReadRotated(ComputeBackend* backend, size_t i, int start, int count,
                                         absl::Span<float> k, absl::Span<float> v) const;
  // BF16 rows of the sink (tier 0) or recent (tier 1) tokens [start, start + count) relative
  // to the tier, of layers()[i], copied into [count][kv_heads][head_dim] buffers.
  [[nodiscard]] absl::Status CopyBf16Rows(ComputeBackend* backend, size_t i, bool recent_tier,
                                          int start, int count, absl::Span<Bf16> k,
                                          absl::Span<Bf16> v) const;
  // Bytes of history block `b` of layers()[i].
  const uint8_t* HistoryBlock(size_t i, size_t b) const;

 private:
  friend class SequenceStore;
  SequenceSnapshot() = default;

  BlockPool* pool_ = nullptr;
  std::shared_ptr<const Model> model_;
  std::string id_;
  int sink_ = 0;
  int history_ = 0;
  int recent_ = 0;
  int recent_head_ = 0;
  std::vector<Layer> layers_;
  std::vector<PrefixUnitKey> chain_;
  std::vector<PageId> refs_;
};

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

class Sequence;
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
  std::shared_ptr<Sequence> seq_;
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

struct StoreTotals {
  size_t sequences = 0;
  uint64_t sink_tokens = 0;
  uint64_t history_tokens = 0;
  uint64_t recent_tokens = 0;
  size_t pool_bytes = 0;  // distinct pages
  size_t bf16_equivalent_bytes = 0;
};

class SequenceStore {
 public:
  // All pointers outlive the store.
  SequenceStore(BlockPool* pool, PrefixIndex* index, ComputeBackend* backend);
  ~SequenceStore();  // releases every sequence

  // Creates an empty sequence (a fresh id when `id` is empty), or one starting from the
  // longest cached prefix of `prefix_token_ids`. InvalidArgument, AlreadyExists.
  [[nodiscard]] absl::StatusOr<std::pair<SequenceInfo, std::vector<PrefixUnitKey>>> Create(
      const TenantId& tenant, std::shared_ptr<const Model> model, std::string id,
      absl::Span<const uint32_t> prefix_token_ids);

  // Starts an append. NotFound, FailedPrecondition (sealed, wrong phase, token_start not the
  // length), InvalidArgument (counts, token ids), Aborted (another append in progress),
  // ResourceExhausted (pool, after evicting what the prefix cache can give up).
  [[nodiscard]] absl::StatusOr<std::unique_ptr<AppendTxn>> BeginAppend(const TenantId& tenant,
                                                                       const std::string& id,
                                                                       AppendSpec spec);
  // Publishes a fully staged append. InvalidArgument (incomplete layers), NotFound (the
  // sequence was released meanwhile). On error the append is rolled back.
  [[nodiscard]] absl::StatusOr<AppendResult> Commit(std::unique_ptr<AppendTxn> txn);

  [[nodiscard]] absl::StatusOr<SequenceInfo> Seal(const TenantId& tenant, const std::string& id);
  // Releases the sequence; returns the pool bytes freed.
  [[nodiscard]] absl::StatusOr<size_t> Release(const TenantId& tenant, const std::string& id);
  // Releases every sequence of a model; returns (sequences, bytes freed).
  std::pair<size_t, size_t> ReleaseModel(const TenantId& tenant, const std::string& model_id);
  [[nodiscard]] absl::StatusOr<SequenceInfo> Describe(const TenantId& tenant,
                                                      const std::string& id) const;
  // A snapshot of `layers` (all when empty; repeats merged, first occurrence kept). NotFound,
  // InvalidArgument (layer range).
  [[nodiscard]] absl::StatusOr<std::unique_ptr<SequenceSnapshot>> Snapshot(
      const TenantId& tenant, const std::string& id, absl::Span<const int> layers) const;

  std::vector<SequenceInfo> List(const TenantId& tenant) const;
  // Totals per model id (of every tenant when `tenant` is null).
  std::map<std::string, StoreTotals> TotalsByModel(const TenantId& tenant) const;
  size_t size() const;

  // Allocates pages, evicting cached prefix units while the pool is full.
  [[nodiscard]] absl::Status AllocatePages(PageClassId cls, size_t count, std::vector<PageId>* out);
  static PrefixContext ContextOf(const Model& model);

 private:
  friend class AppendTxn;
  std::shared_ptr<Sequence> Find(const TenantId& tenant, const std::string& id) const;
  void Abort(AppendTxn* txn);

  BlockPool* const pool_;
  PrefixIndex* const index_;
  ComputeBackend* const backend_;
  DemotionBatcher demotions_;  // concurrent appends' demotions share backend calls
  mutable absl::Mutex mu_;
  std::map<std::pair<TenantId, std::string>, std::shared_ptr<Sequence>> sequences_
      ABSL_GUARDED_BY(mu_);
  uint64_t next_auto_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace kvpool::server
