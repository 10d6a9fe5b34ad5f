#include "server/read_cursor.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "proto/status.h"

namespace kvpool::server {

absl::StatusOr<ReadStarts> PlanRead(const v1::ReadBlocksCursor* since, const SequenceTiers& now,
                                    int sink_size, int block_tokens) {
  const int blocks = (now.history + block_tokens - 1) / block_tokens;
  ReadStarts starts;
  starts.recent_token = now.sink + now.history;
  if (since == nullptr) return starts;
  const uint64_t sink = since->sink_tokens();
  const uint64_t history = since->history_tokens();
  const uint64_t recent = since->recent_tokens();
  if (sink > static_cast<uint64_t>(std::max(sink_size, 0))) {
    return absl::InvalidArgumentError(
        absl::StrCat("cursor: ", sink, " sink tokens, the model's sink holds ", sink_size));
  }
  if (sink < static_cast<uint64_t>(sink_size) && history + recent > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cursor: history or recent tokens with the sink not full (", sink, " of ", sink_size, ")"));
  }
  if (since->sequence_incarnation() != now.incarnation) {
    return WithReason(absl::FailedPreconditionError(
                          "cursor: of an earlier sequence with this id; read it in full"),
                      ErrorReason::kStaleCursor);
  }
  // 64-bit sums: three uint32 cannot overflow them.
  if (sink > static_cast<uint64_t>(now.sink) || history > static_cast<uint64_t>(now.history) ||
      sink + history + recent > static_cast<uint64_t>(now.total())) {
    return absl::OutOfRangeError(absl::StrCat("cursor: ", sink, " sink, ", history, " history and ",
                                              recent, " recent tokens, beyond the sequence's ",
                                              now.sink, ", ", now.history, " and ", now.recent));
  }
  starts.sink_token = static_cast<int>(sink);
  starts.history_block = history < static_cast<uint64_t>(now.history)
                             ? static_cast<int>(history) / block_tokens
                             : blocks;
  starts.recent_token =
      static_cast<int>(std::max<uint64_t>(sink + history + recent, now.sink + now.history));
  return starts;
}

bool SendsNothing(const ReadStarts& starts, const SequenceTiers& now, int block_tokens) {
  const int blocks = (now.history + block_tokens - 1) / block_tokens;
  return starts.sink_token >= now.sink && starts.history_block >= blocks &&
         starts.recent_token >= now.total();
}

}  // namespace kvpool::server
