// Scrubber: a background thread that verifies every live sequence's stored pages against their
// checksums (page_verifier.h), one full sweep per period, paced so it reads pool memory at a
// bounded rate. A page that fails marks its sequence corrupt (DATA_LOSS, reason CORRUPT, until
// released); the counters are the store's IntegrityCounters.
//
//   Scrubber scrubber(&store, backend, pool, {absl::Seconds(300), 128 << 20});
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
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/backend.h"
#include "server/block_pool.h"
#include "server/sequence_store.h"

namespace kvpool::server {

struct ScrubberOptions {
  absl::Duration period = absl::ZeroDuration();  // zero: no scrubbing
  uint64_t max_bytes_per_second = 0;
};

class Scrubber {
 public:
  // All pointers outlive the scrubber.
  Scrubber(SequenceStore* store, ComputeBackend* backend, BlockPool* pool, ScrubberOptions options);
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
  // Waits until `deadline` or Stop; false when stopped.
  bool WaitUntil(absl::Time deadline);

  SequenceStore* const store_;
  ComputeBackend* const backend_;
  BlockPool* const pool_;
  const ScrubberOptions options_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvpool::server
