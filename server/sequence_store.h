// SequenceStore: every live sequence's KV in the block pool, by tenant and id.
//
// Per sequence, one MixedSequenceLayout (kernels/mixed_sequence.h) decides which tokens are BF16
// sink, INT2 history or BF16 recent; it is the same for every layer. Per layer the store keeps
//   sink:    BF16 pages (block_tokens rows of K then V, [t][kv_heads][head_dim] each)
//   history: INT2 blocks (kernels/block_layout.h), history token i in block i / block_tokens
//   recent:  a deque of BF16 pages; the oldest page's first `recent_head` slots were demoted.
// All rows are in the rotated basis. Appends are transactions (append_txn.h); reads take a
// SequenceSnapshot (sequence_snapshot.h).
//
//   KVPOOL_ASSIGN_OR_RETURN(auto created, store.Create(tenant, model, "seq-1", {}));
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<AppendTxn> txn, store.BeginAppend(tenant, "seq-1",
//   spec));
//   ...  // stage every layer
//   KVPOOL_ASSIGN_OR_RETURN(AppendResult r, store.Commit(std::move(txn)));
//
// Thread-safe. One append per sequence at a time (another gets ABORTED); different layers of one
// transaction may be staged concurrently, one layer's chunks in order.
#pragma once

#include <cstddef>
#include <cstdint>
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
#include "server/append_txn.h"
#include "server/backend.h"
#include "server/block_pool.h"
#include "server/demotion_batcher.h"
#include "server/model_registry.h"
#include "server/prefix_index.h"
#include "server/sequence_info.h"
#include "server/sequence_snapshot.h"
#include "server/tenant.h"

namespace kvpool::server {

namespace internal {
class Sequence;
}  // namespace internal

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
  // ResourceExhausted (pool, after evicting what the prefix cache can give up), `admit`'s error.
  // `admit`, when set, runs once the append's new pages are counted and before any is
  // allocated, with their pool bytes (admission's caps on reserved bytes).
  using AdmitPages = std::function<absl::Status(size_t bytes)>;
  [[nodiscard]] absl::StatusOr<std::unique_ptr<AppendTxn>> BeginAppend(
      const TenantId& tenant, const std::string& id, AppendSpec spec,
      const AdmitPages& admit = nullptr);
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
  std::shared_ptr<internal::Sequence> Find(const TenantId& tenant, const std::string& id) const;
  void Abort(AppendTxn* txn);

  BlockPool* const pool_;
  PrefixIndex* const index_;
  ComputeBackend* const backend_;
  DemotionBatcher demotions_;  // concurrent appends' demotions share backend calls
  mutable absl::Mutex mu_;
  std::map<std::pair<TenantId, std::string>, std::shared_ptr<internal::Sequence>> sequences_
      ABSL_GUARDED_BY(mu_);
  uint64_t next_auto_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace kvpool::server
