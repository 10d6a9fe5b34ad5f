// Scrubber: a background thread that verifies every live sequence's stored pages, and then the
// pages of every prefix-cache unit (those only the cache holds once their sequences are
// released), against their checksums (page_verifier.h), one full sweep per period, paced so it
// reads pool memory at a bounded rate. A page that fails marks its sequence corrupt (DATA_LOSS,
// reason CORRUPT, until released), or drops its prefix unit and the units chained after it from
// the cache (a later lookup misses instead of serving bad bytes); the counters are the store's
// IntegrityCounters.
//
//   Scrubber scrubber(&store, backend, pool, {absl::Seconds(300), 128 << 20}, &index, &registry);
//   scrubber.Start();   // no thread when the period is zero
//   ...                 // the destructor stops it
//
// Pacing: a sweep reads the written slots of the pages in use when it starts at
// used_bytes / period per second, never above max_bytes_per_second (then the sweep takes longer
// than the period), one layer of one sequence at a time. Pages shared by several sequences are
// read once per sweep. Thread-safe.
#pragma once

#include <cstdint>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/backend.h"
#include "server/block_pool.h"
#include "server/model_registry.h"
#include "server/prefix_index.h"
#include "server/sequence_store.h"

namespace kvpool::server {

struct ScrubberOptions {
  absl::Duration period = absl::ZeroDuration();  // zero: no scrubbing
  uint64_t max_bytes_per_second = 0;
};

class Scrubber {
 public:
  // All pointers outlive the scrubber. Without `index` and `registry` the prefix cache is not
  // swept.
  Scrubber(SequenceStore* store, ComputeBackend* backend, BlockPool* pool, ScrubberOptions options,
           PrefixIndex* index = nullptr, ModelRegistry* registry = nullptr);
  ~Scrubber();  // Stop()
  Scrubber(const Scrubber&) = delete;
  Scrubber& operator=(const Scrubber&) = delete;

  void Start();
  // Ends the thread (a sweep in progress stops between pages). Idempotent.
  void Stop();
  // One paced sweep on the caller's thread (what the thread runs each period; also for tests).
  // False when stopped meanwhile (then it is not counted).
  bool SweepOnce();

 private:
  void Run();
  // Verifies one prefix unit's pages not verified yet this sweep (adding them to `verified`);
  // drops the unit when one fails. Returns the bytes read.
  size_t ScrubPrefixUnit(const PrefixHash& hash, absl::flat_hash_set<PageId>* verified);
  // Waits until `deadline` or Stop; false when stopped.
  bool WaitUntil(absl::Time deadline);

  SequenceStore* const store_;
  ComputeBackend* const backend_;
  BlockPool* const pool_;
  PrefixIndex* const index_;
  ModelRegistry* const registry_;
  const ScrubberOptions options_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvpool::server
