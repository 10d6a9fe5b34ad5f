// Internal to the sequence store: the record of one live sequence (its tier layout, its pages per
// layer, its state and prefix chain), shared by SequenceStore, AppendTxn and the snapshots the
// store takes. Every field after `model` is guarded by `mu`.
//
//   absl::MutexLock lock(&seq->mu);
//   const SequenceInfo info = seq->InfoLocked(*pool);
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/mixed_sequence.h"
#include "server/block_pool.h"
#include "server/model_registry.h"
#include "server/prefix_index.h"
#include "server/sequence_info.h"
#include "server/tenant.h"

namespace kvpool::server::internal {

// Per-layer storage of a sequence.
struct LayerPages {
  std::vector<PageId> sink;
  std::vector<PageId> history;
  std::deque<PageId> recent;
};

class Sequence {
 public:
  Sequence(TenantId tenant_in, std::string id_in, std::shared_ptr<const Model> model_in);

  const TenantId tenant;
  const std::string id;
  const std::shared_ptr<const Model> model;
  // Random, so two sequences that had the same id (also across restarts) differ: an
  // incremental read's cursor names the one it was taken from (ReadBlocksCursor).
  const uint64_t incarnation;
  // Lease: released by the store's reaper after `ttl` without use (zero: never). Set before the
  // sequence is published; `last_use` is renewed by appends, reads and attention, lock-free.
  absl::Duration ttl = absl::ZeroDuration();
  std::atomic<int64_t> last_use_ns{0};
  void Touch() { last_use_ns.store(absl::ToUnixNanos(absl::Now()), std::memory_order_relaxed); }
  bool ExpiredAt(absl::Time now) const {
    return ttl > absl::ZeroDuration() &&
           now - absl::FromUnixNanos(last_use_ns.load(std::memory_order_relaxed)) >= ttl;
  }

  // Set when a page of the sequence failed its checksum; never cleared (release ends it).
  std::atomic<bool> corrupt{false};
  // Advanced (under `mu`, release order) by every change of the pages or the tier layout and by
  // the release, so a LayerWatch tells "nothing changed" from one lock-free load.
  std::atomic<uint64_t> generation{0};

  mutable absl::Mutex mu;
  MixedSequenceLayout layout ABSL_GUARDED_BY(mu);
  int recent_head ABSL_GUARDED_BY(mu) = 0;
  std::vector<LayerPages> layers ABSL_GUARDED_BY(mu);
  SequenceState state ABSL_GUARDED_BY(mu) = SequenceState::kPrefill;
  bool append_active ABSL_GUARDED_BY(mu) = false;
  bool released ABSL_GUARDED_BY(mu) = false;
  bool expired ABSL_GUARDED_BY(mu) = false;  // released because its lease ran out
  std::vector<uint32_t> token_ids ABSL_GUARDED_BY(mu);
  bool token_ids_complete ABSL_GUARDED_BY(mu) = true;
  // Units of the prefix chain hashed so far (attached, published, or already cached).
  std::vector<PrefixUnitKey> chain ABSL_GUARDED_BY(mu);
  int reused_tokens ABSL_GUARDED_BY(mu) = 0;

  // Every page of every layer (the sequence holds one reference on each).
  std::vector<PageId> AllPagesLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  SequenceInfo InfoLocked(const BlockPool& pool) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
};

// What a call on a released sequence answers: NotFound, with reason EXPIRED when its lease ran
// out (proto/status.h).
absl::Status ReleasedError(const std::string& id, bool expired);

}  // namespace kvpool::server::internal
