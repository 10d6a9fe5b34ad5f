// The incremental part of ReadBlocks (kvpool.v1.ReadBlocksCursor): from what a reader holds of a
// sequence and the sequence's tiers now, where each tier's data to send begins. A cursor that
// does not fit the sequence is refused here, before anything is read or sent.
//
//   KVPOOL_ASSIGN_OR_RETURN(ReadStarts starts, PlanRead(&cursor, now, sink_size, bt));
//   // sink rows [starts.sink_token, now.sink), history blocks [starts.history_block, blocks),
//   // recent positions [starts.recent_token, now.total())
//
// Pure functions; thread-safe.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "kvpool/v1/read_service.pb.h"

namespace kvpool::server {

// A sequence's tier sizes and incarnation (the same for every layer).
struct SequenceTiers {
  uint64_t incarnation = 0;
  int sink = 0;
  int history = 0;
  int recent = 0;
  int64_t total() const { return int64_t{sink} + history + recent; }
};

// Where an answer's data begins (ReadBlocksHeader's *_start fields).
struct ReadStarts {
  int sink_token = 0;     // first sink row sent
  int history_block = 0;  // first history block sent (== the block count: none)
  int recent_token = 0;   // sequence position of the first recent row sent
};

// The starts of a read of `now` by a reader holding `since` (null: nothing, a full read).
// `sink_size` is the model's sink size (QuantConfig.sink_tokens), `block_tokens` its tokens per
// block. INVALID_ARGUMENT for a cursor inconsistent in itself, OUT_OF_RANGE for one beyond the
// sequence, FAILED_PRECONDITION (reason STALE_CURSOR) for one of another incarnation.
absl::StatusOr<ReadStarts> PlanRead(const v1::ReadBlocksCursor* since, const SequenceTiers& now,
                                    int sink_size, int block_tokens);

// Whether a read of `now` from `starts` sends no row and no block (the reader is up to date).
bool SendsNothing(const ReadStarts& starts, const SequenceTiers& now, int block_tokens);

}  // namespace kvpool::server
