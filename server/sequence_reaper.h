// SequenceReaper: a background thread that releases sequences whose lease ran out
// (SequenceStore::ReleaseExpired), so a client that crashed or forgot its sequences does not
// hold the pool forever.
//
//   SequenceReaper reaper(&store, SequenceReaper::kCheckPeriod);  // runs until destroyed
//
// Thread-safe; the store outlives the reaper.
#pragma once

#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/sequence_store.h"

namespace kvpool::server {

class SequenceReaper {
 public:
  // How often leases are checked: a sequence is released at most this long after its lease ran
  // out. A check with no leased sequence costs nothing.
  static constexpr absl::Duration kCheckPeriod = absl::Milliseconds(250);

  SequenceReaper(SequenceStore* store, absl::Duration period);
  ~SequenceReaper();  // stops the thread

  SequenceReaper(const SequenceReaper&) = delete;
  SequenceReaper& operator=(const SequenceReaper&) = delete;

 private:
  void Run();

  SequenceStore* const store_;
  const absl::Duration period_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvpool::server
