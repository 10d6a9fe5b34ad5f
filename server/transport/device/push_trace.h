// PushTrace: the per-chunk timeline of one device push (NCCL or CUDA IPC), logged at its end when
// KVPOOL_TRACE_GPU_PUSH=1 (info level): where a push's time goes (message read, slot acquired,
// transfer posted, rows ready, staged) without a profiler. Costs nothing when off.
//
//   PushTrace trace;
//   const int c = trace.AddChunk(layer, offset, tokens);
//   trace.Mark(c, PushTrace::kRead);  ...  trace.Mark(c, PushTrace::kStaged);
//   trace.Log(sequence_id, status);
//
// Thread-safe.
#pragma once

#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvpool::server {

class PushTrace {
 public:
  enum Event { kRead, kSlot, kPosted, kReady, kStaged, kEvents };

  // Whether KVPOOL_TRACE_GPU_PUSH=1 (read once).
  static bool Enabled();

  PushTrace();

  // A new chunk; returns its index.
  int AddChunk(int layer, int offset, int tokens);
  void Mark(int chunk, Event e);
  void Log(const std::string& sequence_id, const absl::Status& status);

 private:
  struct Chunk {
    int layer, offset, tokens;
    double us[kEvents];
  };
  const absl::Time start_;
  absl::Mutex mu_;
  std::vector<Chunk> chunks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvpool::server
