// PageVerifier: checks stored pages against the checksum records the block pool keeps beside them
// (block_pool.h, kernels/page_checksum.h), and the counters and error of what it finds.
//
// Reads that leave the daemon (ReadBlocks, ReadKv) and the scrubber (scrubber.h) verify every page
// they touch; a mismatch marks the sequence corrupt, and from then on the sequence answers
// DATA_LOSS with reason CORRUPT until it is released.
//
//   std::vector<PageToVerify> pages = {{page, /*history=*/true}};
//   absl::Status s = VerifyPages(backend, pool, model, pages);  // DataLoss on a mismatch
//
// Thread-safe (stateless functions; the counters are atomics).
#pragma once

#include <atomic>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "server/backend.h"
#include "server/block_pool.h"
#include "server/model_registry.h"

namespace kvpool::server {

// What integrity checking found, since start (GetStats).
struct IntegrityCounters {
  std::atomic<uint64_t> corrupt_sequences{0};     // sequences marked corrupt
  std::atomic<uint64_t> pages_scrubbed{0};        // pages the scrubber verified
  std::atomic<uint64_t> bytes_scrubbed{0};        // bytes of their written slots
  std::atomic<uint64_t> sweeps_completed{0};      // full sweeps of every live sequence and unit
  std::atomic<uint64_t> corrupt_prefix_units{0};  // prefix units whose pages failed
  std::atomic<uint64_t> prefix_units_dropped{0};  // those and the units chained after them
};

// A page to check: an INT2 history block (`history`) or a BF16 page of `model`.
struct PageToVerify {
  PageId page = kInvalidPage;
  bool history = false;
};

// Verifies the written slots of every page (the caller holds a reference on each) on the
// backend. DataLoss (reason CORRUPT) naming the first page that fails; Internal for a backend
// error. Pages with an empty record (nothing written yet) pass.
[[nodiscard]] absl::Status VerifyPages(ComputeBackend* backend, const BlockPool& pool,
                                       const Model& model, absl::Span<const PageToVerify> pages);

// Bytes VerifyPages reads for `pages` (their written slots).
size_t VerifiedBytes(const BlockPool& pool, const Model& model,
                     absl::Span<const PageToVerify> pages);

// The error a corrupt sequence answers: DATA_LOSS, reason CORRUPT.
absl::Status CorruptSequenceError(absl::string_view sequence_id);

}  // namespace kvpool::server
