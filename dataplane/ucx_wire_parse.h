// The checks the daemon and the client apply to received UCX data messages (ucx_wire.h gives the
// layouts): each takes a decoded header and the payload bytes, validates every count and size
// against the payload and the receiver's limits before anything is allocated, and returns what
// the receiver acts on or a precise status. No UCX here, so the fuzz target
// (tests/fuzz/ucx_wire_fuzz.cc) runs them on arbitrary bytes.
//
//   std::optional<PushBeginHeader> h = Decode<PushBeginHeader>(header, header_length);
//   KVPOOL_ASSIGN_OR_RETURN(PushBegin begin, ParsePushBegin(*h, payload));
//
// Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "dataplane/ucx_wire.h"

namespace kvpool::ucx::wire {

// Most query rows per sequence in one ATTEND.
inline constexpr uint32_t kMaxAttendQueries = 1024;

// PUSH_BEGIN's payload: the sequence id, then 0 or num_tokens token ids.
struct PushBegin {
  std::string sequence_id;
  std::vector<uint32_t> token_ids;
};

// InvalidArgument when the payload does not match the header (the sequence id's bytes, then 0 or
// num_tokens token ids). The append's own fields (token range, sequence id) are the daemon's
// header validation, the same for every ingest (server/ingest/append_checks.h).
absl::StatusOr<PushBegin> ParsePushBegin(const PushBeginHeader& h, absl::string_view payload);

// LAYER_DATA: InvalidArgument unless num_tokens >= 1, the tensor is K or V, the payload holds
// exactly num_tokens rows of `row_bytes` and at most `max_bytes`.
absl::Status CheckLayerData(const LayerDataHeader& h, size_t payload_bytes, size_t row_bytes,
                            size_t max_bytes);

// ATTEND, before its payload is received: InvalidArgument unless 1 <= batch <= max_batch;
// ResourceExhausted when the payload is longer than max_payload_bytes.
absl::Status CheckAttendHeader(const AttendHeader& h, size_t payload_bytes, uint32_t max_batch,
                               size_t max_payload_bytes);

struct AttendQuery {
  std::string sequence_id;
  uint32_t num_queries = 0;
  std::vector<float> q;  // [num_queries][query_values] fp32, unrotated
};

struct AttendPayload {
  std::string model_id;
  std::vector<AttendQuery> queries;
};

// Values of one query row (q_heads x head_dim) of a model, or the model lookup's error.
using QueryValuesOf = std::function<absl::StatusOr<size_t>(const std::string& model_id)>;

// ATTEND's payload (after CheckAttendHeader): the model id, the per-sequence metas, the ids and
// the queries. InvalidArgument for a payload too short or too long or num_queries outside
// [1, kMaxAttendQueries]; the model lookup's error when `query_values` fails.
absl::StatusOr<AttendPayload> ParseAttend(const AttendHeader& h, absl::string_view payload,
                                          const QueryValuesOf& query_values);

struct AttendResult {
  uint32_t attended_tokens = 0;
  std::vector<float> out;  // [num_queries][q_heads][head_dim]
  std::vector<float> lse;  // [num_queries][q_heads]
};

// ATTEND_DONE with status 0, on the client that asked for `num_queries[i]` rows of
// `query_values` values for sequence i. Internal (the daemon broke the protocol) unless the
// header and every meta answer exactly that and the payload holds exactly the outputs and LSEs.
absl::StatusOr<std::vector<AttendResult>> ParseAttendDone(const AttendDoneHeader& h,
                                                          absl::string_view payload,
                                                          absl::Span<const uint32_t> num_queries,
                                                          size_t query_values);

// Most payload bytes of an ATTEND_DONE for that request (an answer, or an error message of up to
// kMaxErrorMessageBytes): what the client accepts to receive.
inline constexpr size_t kMaxErrorMessageBytes = size_t{64} << 10;
size_t MaxAttendDoneBytes(absl::Span<const uint32_t> num_queries, size_t query_values);

// A status code and message received from the peer: OK for 0, the canonical code for 1..16,
// Internal naming the code for anything else.
absl::Status StatusFromWire(int32_t code, absl::string_view message);

}  // namespace kvpool::ucx::wire
