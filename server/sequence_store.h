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

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/append_txn.h"
#include "server/backend.h"
#include "server/block_pool.h"
#include "server/demotion_batcher.h"
#include "server/layer_watch.h"
#include "server/model_registry.h"
#include "server/page_verifier.h"
#include "server/prefix_index.h"
#include "server/sequence_info.h"
#include "server/sequence_snapshot.h"
#include "server/tenant.h"
#include "server/tenant_quotas.h"

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

// Whether a snapshot takes references on the pages it shows (SequenceStore::Snapshot).
enum class SnapshotPages { kAll, kNone };

class SequenceStore {
 public:
  // All pointers outlive the store. `default_ttl`: the lease of a sequence created without one
  // (zero: none). `quotas` (may be null: no quotas): each tenant's sequences quota, and where
  // refusals by quota are counted.
  SequenceStore(BlockPool* pool, PrefixIndex* index, ComputeBackend* backend,
                absl::Duration default_ttl = absl::ZeroDuration(),
                TenantQuotaTable* quotas = nullptr);
  ~SequenceStore();  // releases every sequence

  // Creates an empty sequence (a fresh id when `id` is empty), or one starting from the
  // longest cached prefix of `prefix_token_ids`, with a lease of `ttl` (zero: the store's
  // default). InvalidArgument, AlreadyExists, RESOURCE_EXHAUSTED with reason QUOTA when the
  // tenant holds its sequences quota already (sequences being created count).
  [[nodiscard]] absl::StatusOr<std::pair<SequenceInfo, std::vector<PrefixUnitKey>>> Create(
      const TenantId& tenant, std::shared_ptr<const Model> model, std::string id,
      absl::Span<const uint32_t> prefix_token_ids, absl::Duration ttl = absl::ZeroDuration());

  // Starts an append. NotFound, FailedPrecondition (sealed, wrong phase, token_start not the
  // length), InvalidArgument (counts, token ids), Aborted (another append in progress),
  // ResourceExhausted (the pool, even after evicting every evictable cached unit; then nothing
  // was evicted), `admit`'s error. `admit`, when set, runs once the append's new pages are
  // counted and before any is allocated, with their pool bytes (admission's caps on reserved
  // bytes).
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
  // InvalidArgument (layer range), DataLoss (reason CORRUPT: the sequence failed a checksum;
  // BeginAppend answers the same). With SnapshotPages::kNone it holds the tiers, the layers'
  // ids, the model and the prefix chain but no page (its layers' page lists are empty): for an
  // answer that reads no page, at a cost that does not grow with the sequence.
  [[nodiscard]] absl::StatusOr<std::unique_ptr<SequenceSnapshot>> Snapshot(
      const TenantId& tenant, const std::string& id, absl::Span<const int> layers,
      SnapshotPages pages = SnapshotPages::kAll) const;

  // A watch of one layer (layer_watch.h), filled by its first Refresh. NotFound, InvalidArgument
  // (layer range, or a sequence of another model than `model`: id and version).
  [[nodiscard]] absl::StatusOr<std::unique_ptr<LayerWatch>> WatchLayer(const TenantId& tenant,
                                                                       const std::string& id,
                                                                       const Model& model,
                                                                       int layer) const;

  std::vector<SequenceInfo> List(const TenantId& tenant) const;
  // (tenant, id) of every live sequence, for the scrubber.
  std::vector<std::pair<TenantId, std::string>> Keys() const;
  // Integrity counters (page_verifier.h), shared with the snapshots and the scrubber.
  IntegrityCounters& integrity() const { return *integrity_; }

  // Leases. Every sequence with a lease, unused (no append, read or attention; an append in
  // progress counts as use) for its lease at `now`, is released as by Release; later calls on it
  // answer NotFound with reason EXPIRED (proto/status.h) until its id is created again (the last
  // kExpiredIdsRemembered ids are remembered). Returns how many were released.
  size_t ReleaseExpired(absl::Time now);
  // Sequences released by ReleaseExpired since start.
  uint64_t expired_sequences() const { return expired_count_.load(); }
  // Sequences that have a lease now (none: ReleaseExpired has nothing to look at).
  size_t leased_sequences() const { return leased_count_.load(); }
  absl::Duration default_ttl() const { return default_ttl_; }
  static constexpr size_t kExpiredIdsRemembered = 4096;
  // Totals per model id (of every tenant when `tenant` is null).
  std::map<std::string, StoreTotals> TotalsByModel(const TenantId& tenant) const;
  size_t size() const;
  // Sequences `tenant` holds (with those being created), as its quota counts them.
  size_t SequencesOf(const TenantId& tenant) const;

  // Allocates pages of several classes for `tenant` (all or nothing), evicting cached prefix
  // units only when that makes the allocation fit, `tenant`'s least recently used first
  // (PrefixIndex::AllocateEvicting), charged to `tenant` (its pool_bytes quota; refusals by
  // quota are counted). ResourceExhausted leaves the pool and the cache unchanged.
  [[nodiscard]] absl::Status AllocatePages(const TenantId& tenant,
                                           absl::Span<const PageRequest> requests,
                                           std::vector<std::vector<PageId>>* out);
  static PrefixContext ContextOf(const Model& model);

 private:
  friend class AppendTxn;
  std::shared_ptr<internal::Sequence> Find(const TenantId& tenant, const std::string& id) const;
  // NotFound for a sequence the caller names and the store does not have: with reason EXPIRED
  // when its lease ran out.
  absl::Status Missing(const TenantId& tenant, const std::string& id) const;
  // Drops `seq` from the map (it must be there) and frees its pages; under mu_.
  size_t ReleaseLocked(
      std::map<std::pair<TenantId, std::string>, std::shared_ptr<internal::Sequence>>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Abort(AppendTxn* txn);
  // Gives back a sequence slot Create counted for `tenant`.
  void UncountSequenceLocked(const TenantId& tenant) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  BlockPool* const pool_;
  PrefixIndex* const index_;
  ComputeBackend* const backend_;
  const std::shared_ptr<IntegrityCounters> integrity_ = std::make_shared<IntegrityCounters>();
  DemotionBatcher demotions_;  // concurrent appends' demotions share backend calls
  mutable absl::Mutex mu_;
  std::map<std::pair<TenantId, std::string>, std::shared_ptr<internal::Sequence>> sequences_
      ABSL_GUARDED_BY(mu_);
  TenantQuotaTable* const quotas_;
  // Per tenant: live sequences plus those being created (only tenants that hold some).
  std::map<TenantId, size_t> tenant_sequences_ ABSL_GUARDED_BY(mu_);
  const absl::Duration default_ttl_;
  // Ids whose lease ran out, oldest first (at most kExpiredIdsRemembered).
  std::set<std::pair<TenantId, std::string>> expired_ids_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<TenantId, std::string>> expired_order_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> expired_count_{0};
  std::atomic<size_t> leased_count_{0};
};

}  // namespace kvpool::server
