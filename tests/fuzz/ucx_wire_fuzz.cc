// Fuzz target: the UCX data plane's received data messages (dataplane/ucx_wire.h,
// ucx_wire_parse.h): the header decode and every check the daemon (PUSH_BEGIN, LAYER_DATA,
// ATTEND) and the client (PUSH_DONE, ATTEND_DONE) apply before acting on a message.
//
// Input: one byte picks the message, then its header's bytes, then the payload.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "dataplane/ucx_wire.h"
#include "dataplane/ucx_wire_parse.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/fuzz_input.h"

namespace kvpool::ucx::wire {
namespace {

// The daemon's defaults (kvpoold --max_append_tokens, --max_attention_batch,
// --max_message_bytes; a 1 MiB half slot) and the fuzz model: 4 query heads of 32 values.
constexpr uint32_t kMaxBatch = 256;
constexpr size_t kMaxMessageBytes = size_t{16} << 20;
constexpr size_t kHalfBytes = size_t{1} << 20;
constexpr size_t kModelQueryValues = 4 * 32;

// The header of type T from the input, checked to re-encode to the same bytes.
template <typename T>
std::optional<T> Header(fuzz::FuzzInput& in) {
  const absl::string_view bytes = in.Bytes(sizeof(T));
  std::optional<T> h = Decode<T>(bytes.data(), bytes.size());
  FUZZ_CHECK(h.has_value() == (bytes.size() == sizeof(T)), "Decode accepted a wrong length");
  if (h) FUZZ_CHECK(Encode(*h) == bytes, "Encode(Decode(x)) != x");
  return h;
}

void PushBeginMessage(fuzz::FuzzInput& in) {
  const std::optional<PushBeginHeader> h = Header<PushBeginHeader>(in);
  if (!h) return;
  const absl::string_view payload = in.Rest();
  absl::StatusOr<PushBegin> begin = ParsePushBegin(*h, payload);
  if (!begin.ok()) return;
  FUZZ_CHECK(begin->sequence_id.size() + 4 * begin->token_ids.size() == payload.size(),
             "PUSH_BEGIN parts do not add up to the payload");
  FUZZ_CHECK(begin->token_ids.empty() || begin->token_ids.size() == h->num_tokens, "token ids");
}

void LayerDataMessage(fuzz::FuzzInput& in) {
  const size_t row_bytes = in.Byte() * size_t{64};  // 0 .. 255 x 64 bytes per token
  const std::optional<LayerDataHeader> h = Header<LayerDataHeader>(in);
  if (!h) return;
  const size_t length = in.Rest().size();
  if (CheckLayerData(*h, length, row_bytes, kHalfBytes).ok()) {
    FUZZ_CHECK(length == size_t{h->num_tokens} * row_bytes && length <= kHalfBytes, "length");
  }
}

void AttendMessage(fuzz::FuzzInput& in) {
  const std::optional<AttendHeader> h = Header<AttendHeader>(in);
  if (!h) return;
  const absl::string_view payload = in.Rest();
  if (!CheckAttendHeader(*h, payload.size(), kMaxBatch, kMaxMessageBytes).ok()) return;
  absl::StatusOr<AttendPayload> parsed =
      ParseAttend(*h, payload, [](const std::string& model_id) -> absl::StatusOr<size_t> {
        if (model_id == "m") return kModelQueryValues;
        return absl::NotFoundError("no model");
      });
  if (!parsed.ok()) return;
  size_t bytes = parsed->model_id.size() + parsed->queries.size() * sizeof(SequenceQueryMeta);
  for (const AttendQuery& q : parsed->queries) {
    FUZZ_CHECK(q.num_queries >= 1 && q.num_queries <= kMaxAttendQueries, "num_queries");
    FUZZ_CHECK(q.q.size() == q.num_queries * kModelQueryValues, "query values");
    bytes += q.sequence_id.size() + q.q.size() * sizeof(float);
  }
  FUZZ_CHECK(parsed->queries.size() == h->batch && bytes == payload.size(),
             "ATTEND parts do not add up to the payload");
}

// The client's view: it asked for the per-sequence query counts and values the input names
// (or those the answer states, so that well-formed answers get through).
void AttendDoneMessage(fuzz::FuzzInput& in) {
  const bool as_stated = (in.Byte() & 1) != 0;
  const std::optional<AttendDoneHeader> h = Header<AttendDoneHeader>(in);
  if (!h) return;
  const absl::string_view payload = in.Rest();
  std::vector<uint32_t> asked;
  size_t query_values = kModelQueryValues;
  if (as_stated) {
    query_values = static_cast<size_t>(uint64_t{h->q_heads} * h->head_dim);
    for (uint32_t i = 0; i < h->batch && (i + 1) * sizeof(SequenceResultMeta) <= payload.size();
         ++i) {
      SequenceResultMeta m;
      std::memcpy(&m, payload.data() + i * sizeof(m), sizeof(m));
      asked.push_back(m.num_queries);
    }
  } else {
    asked.assign(h->batch % 64, 1);
  }
  if (payload.size() > MaxAttendDoneBytes(asked, query_values)) return;  // never received
  if (h->status_code != 0) {
    FUZZ_CHECK(!StatusFromWire(h->status_code, payload).ok(), "an error code read as OK");
    return;
  }
  absl::StatusOr<std::vector<AttendResult>> results =
      ParseAttendDone(*h, payload, asked, query_values);
  if (!results.ok()) {
    FUZZ_CHECK(absl::IsInternal(results.status()), results.status().ToString());
    return;
  }
  FUZZ_CHECK(results->size() == asked.size(), "result count");
  for (size_t i = 0; i < asked.size(); ++i) {
    FUZZ_CHECK((*results)[i].out.size() == size_t{asked[i]} * query_values, "out size");
    FUZZ_CHECK((*results)[i].lse.size() == size_t{asked[i]} * h->q_heads, "lse size");
  }
}

void PushDoneMessage(fuzz::FuzzInput& in) {
  const std::optional<PushDoneHeader> h = Header<PushDoneHeader>(in);
  if (!h) return;
  const absl::Status s = StatusFromWire(h->status_code, in.Rest());
  FUZZ_CHECK(s.ok() == (h->status_code == 0), s.ToString());
}

void OtherHeaders(fuzz::FuzzInput& in) {
  // Messages whose header is all there is (PUSH_COMMIT / PUSH_ABORT, LAYER_DONE).
  if (in.Byte() & 1) {
    Header<PushControlHeader>(in);
  } else {
    Header<LayerDoneHeader>(in);
  }
}

}  // namespace
}  // namespace kvpool::ucx::wire

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvpool::ucx::wire;
  kvpool::fuzz::FuzzInput in(data, size);
  switch (in.Byte() % 6) {
    case 0:
      PushBeginMessage(in);
      break;
    case 1:
      LayerDataMessage(in);
      break;
    case 2:
      AttendMessage(in);
      break;
    case 3:
      AttendDoneMessage(in);
      break;
    case 4:
      PushDoneMessage(in);
      break;
    default:
      OtherHeaders(in);
      break;
  }
  return 0;
}
