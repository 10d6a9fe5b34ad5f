// DevicePushCounters: what a device-memory transport (NCCL, CUDA IPC) reports of its pushes in
// GetStats (TransportStats): open ones, committed and aborted ones, bytes received.
//
//   auto counters = std::make_shared<DevicePushCounters>();   // shared with every push
//   counters->Opened();  ...  counters->Ended(status.ok());
//
// Thread-safe (atomics).
#pragma once

#include <atomic>
#include <cstdint>

#include "server/transport/transport.h"

namespace kvpool::server {

struct DevicePushCounters {
  std::atomic<uint32_t> open{0};
  std::atomic<uint64_t> committed{0};
  std::atomic<uint64_t> aborted{0};
  std::atomic<uint64_t> bytes_received{0};

  void Opened() { ++open; }
  void Ended(bool ok) {
    --open;
    ++(ok ? committed : aborted);
  }
  void Fill(TransportStats* s) const {
    s->open_pushes = open.load();
    s->pushes_committed = committed.load();
    s->pushes_aborted = aborted.load();
    s->bytes_received = bytes_received.load();
  }
};

}  // namespace kvpool::server
