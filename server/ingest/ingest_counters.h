// IngestCounters: what every committed ingest adds to GetStats (the ingest engine counts each
// commit here, whatever transport carried it).
//
//   counters.CountCommit(model, /*tokens=*/512);
//   uint64_t bytes = counters.ingested_bytes.load();
//
// Thread-safe (atomics).
#pragma once

#include <atomic>
#include <cstdint>

#include "server/model_registry.h"

namespace kvpool::server {

struct IngestCounters {
  std::atomic<uint64_t> ingested_bytes{0};   // BF16-equivalent bytes committed by appends
  std::atomic<uint64_t> ingested_tokens{0};  // tokens committed (per-layer count)

  // One committed append of `tokens` tokens to every layer of `model`.
  void CountCommit(const Model& model, int tokens) {
    ingested_tokens += static_cast<uint64_t>(tokens);
    ingested_bytes += static_cast<uint64_t>(tokens) * model.bf16_token_bytes() *
                      static_cast<uint64_t>(model.num_layers);
  }
};

}  // namespace kvpool::server
