#include "dataplane/ucx_wire_parse.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace kvpool::ucx::wire {
namespace {

// Consumes a payload front to back; Take returns nullptr when fewer than `n` bytes remain.
class PayloadReader {
 public:
  explicit PayloadReader(absl::string_view payload) : payload_(payload) {}

  const char* Take(size_t n) {
    if (remaining() < n) return nullptr;
    const char* p = payload_.data() + pos_;
    pos_ += n;
    return p;
  }
  size_t remaining() const { return payload_.size() - pos_; }

 private:
  absl::string_view payload_;
  size_t pos_ = 0;
};

// a * b, or SIZE_MAX when it overflows (every caller compares the result with a real size).
size_t SaturatingMul(size_t a, size_t b) {
  size_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? std::numeric_limits<size_t>::max() : r;
}

size_t SaturatingAdd(size_t a, size_t b) {
  size_t r = 0;
  return __builtin_add_overflow(a, b, &r) ? std::numeric_limits<size_t>::max() : r;
}

std::vector<float> Floats(const char* bytes, size_t n) {
  std::vector<float> v(n);
  if (n > 0) std::memcpy(v.data(), bytes, n * sizeof(float));
  return v;
}

}  // namespace

absl::StatusOr<PushBegin> ParsePushBegin(const PushBeginHeader& h, absl::string_view payload) {
  if (payload.size() != size_t{h.sequence_id_bytes} + size_t{4} * h.num_token_ids ||
      (h.num_token_ids != 0 && h.num_token_ids != h.num_tokens)) {
    return absl::InvalidArgumentError("PUSH_BEGIN payload does not match its header");
  }
  PushBegin begin;
  begin.sequence_id.assign(payload.data(), h.sequence_id_bytes);
  begin.token_ids.resize(h.num_token_ids);
  if (h.num_token_ids > 0) {
    std::memcpy(begin.token_ids.data(), payload.data() + h.sequence_id_bytes,
                size_t{4} * h.num_token_ids);
  }
  return begin;
}

absl::Status CheckLayerData(const LayerDataHeader& h, size_t payload_bytes, size_t row_bytes,
                            size_t max_bytes) {
  const size_t expected = SaturatingMul(h.num_tokens, row_bytes);
  if (h.num_tokens == 0 || h.tensor > kTensorValue || payload_bytes != expected ||
      payload_bytes > max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("LAYER_DATA of layer ", h.layer, " tensor ", h.tensor, ": ", payload_bytes,
                     " payload bytes for ", h.num_tokens, " tokens; expected ", expected,
                     " and at most ", max_bytes));
  }
  return absl::OkStatus();
}

absl::Status CheckAttendHeader(const AttendHeader& h, size_t payload_bytes, uint32_t max_batch,
                               size_t max_payload_bytes) {
  if (h.batch < 1 || h.batch > max_batch) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch of ", h.batch, " sequences; must be in [1, ", max_batch, "]"));
  }
  if (payload_bytes > max_payload_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "ATTEND payload of ", payload_bytes, " bytes exceeds the limit of ", max_payload_bytes));
  }
  return absl::OkStatus();
}

absl::StatusOr<AttendPayload> ParseAttend(const AttendHeader& h, absl::string_view payload,
                                          const QueryValuesOf& query_values) {
  const absl::Status too_short = absl::InvalidArgumentError("ATTEND payload too short");
  PayloadReader reader(payload);
  const char* model_id = reader.Take(h.model_id_bytes);
  const char* metas = reader.Take(SaturatingMul(sizeof(SequenceQueryMeta), h.batch));
  if (model_id == nullptr || metas == nullptr) return too_short;
  AttendPayload parsed;
  parsed.model_id.assign(model_id, h.model_id_bytes);
  KVPOOL_ASSIGN_OR_RETURN(const size_t per_query, query_values(parsed.model_id));
  // Every meta was received (8 bytes each), so `batch` entries are bounded by the payload.
  parsed.queries.resize(h.batch);
  for (uint32_t i = 0; i < h.batch; ++i) {
    SequenceQueryMeta meta;
    std::memcpy(&meta, metas + i * sizeof(SequenceQueryMeta), sizeof(meta));
    const char* id = reader.Take(meta.id_bytes);
    if (id == nullptr) return too_short;
    if (meta.num_queries < 1 || meta.num_queries > kMaxAttendQueries) {
      return absl::InvalidArgumentError(
          absl::StrCat("num_queries must be in [1, ", kMaxAttendQueries, "]"));
    }
    parsed.queries[i].sequence_id.assign(id, meta.id_bytes);
    parsed.queries[i].num_queries = meta.num_queries;
  }
  for (AttendQuery& q : parsed.queries) {
    const size_t n = SaturatingMul(per_query, q.num_queries);
    const char* src = reader.Take(SaturatingMul(n, sizeof(float)));
    if (src == nullptr) return too_short;
    q.q = Floats(src, n);
  }
  if (reader.remaining() != 0) return absl::InvalidArgumentError("ATTEND payload too long");
  return parsed;
}

absl::StatusOr<std::vector<AttendResult>> ParseAttendDone(const AttendDoneHeader& h,
                                                          absl::string_view payload,
                                                          absl::Span<const uint32_t> num_queries,
                                                          size_t query_values) {
  if (h.batch != num_queries.size() ||
      uint64_t{h.q_heads} * h.head_dim != static_cast<uint64_t>(query_values) || h.q_heads == 0) {
    return absl::InternalError(absl::StrCat(
        "malformed ATTEND_DONE: batch ", h.batch, ", q_heads ", h.q_heads, ", head_dim ",
        h.head_dim, " for ", num_queries.size(), " sequences of ", query_values, " query values"));
  }
  PayloadReader reader(payload);
  const char* metas = reader.Take(SaturatingMul(sizeof(SequenceResultMeta), h.batch));
  if (metas == nullptr) return absl::InternalError("ATTEND_DONE payload too short");
  std::vector<AttendResult> results(h.batch);
  size_t floats = 0;  // outputs and LSEs of every sequence
  for (uint32_t i = 0; i < h.batch; ++i) {
    SequenceResultMeta meta;
    std::memcpy(&meta, metas + i * sizeof(SequenceResultMeta), sizeof(meta));
    if (meta.num_queries != num_queries[i]) {
      return absl::InternalError(absl::StrCat("ATTEND_DONE answers ", meta.num_queries,
                                              " queries for sequence ", i, " of the batch; ",
                                              num_queries[i], " were sent"));
    }
    results[i].attended_tokens = meta.attended_tokens;
    floats = SaturatingAdd(floats, SaturatingMul(meta.num_queries, query_values + h.q_heads));
  }
  if (reader.remaining() != SaturatingMul(floats, sizeof(float))) {
    return absl::InternalError("ATTEND_DONE payload size does not match its header");
  }
  // The sizes were checked above: every Take below succeeds.
  for (size_t i = 0; i < results.size(); ++i) {
    const size_t n = size_t{num_queries[i]} * query_values;
    results[i].out = Floats(reader.Take(n * sizeof(float)), n);
  }
  for (size_t i = 0; i < results.size(); ++i) {
    const size_t n = size_t{num_queries[i]} * h.q_heads;
    results[i].lse = Floats(reader.Take(n * sizeof(float)), n);
  }
  return results;
}

size_t MaxAttendDoneBytes(absl::Span<const uint32_t> num_queries, size_t query_values) {
  // Each query row has query_values outputs and at most as many LSE values (one per head).
  size_t bytes = SaturatingMul(sizeof(SequenceResultMeta), num_queries.size());
  for (uint32_t n : num_queries) {
    bytes = SaturatingAdd(bytes, SaturatingMul(SaturatingMul(n, query_values), 2 * sizeof(float)));
  }
  return std::max(bytes, kMaxErrorMessageBytes);
}

absl::Status StatusFromWire(int32_t code, absl::string_view message) {
  if (code == 0) return absl::OkStatus();
  if (code < 0 || code > static_cast<int32_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::InternalError(
        absl::StrCat("the peer answered an unknown status code ", code, ": ", message));
  }
  return absl::Status(static_cast<absl::StatusCode>(code), message);
}

}  // namespace kvpool::ucx::wire
