// The UCX data plane's wire format (normative; proto/kvpool/v1/transport_service.proto gives the
// session flow). Every message is a ucp active message whose id is an AmId and whose header is
// exactly one of the structs below (fixed size, little-endian, no padding surprises: every
// field is naturally aligned). Payload layouts are documented per message.
//
// A connection (UCX client-server: the client connects to the daemon's listener) belongs to no
// session until its first message, HELLO, names a negotiated session and carries its secret:
//   kHello       HelloHeader, no payload, eager. The daemon answers kHelloDone on success; it
//                closes (and counts as refused) a connection whose first message is anything
//                else, whose HELLO names an unknown, already bound or ended session or a wrong
//                secret, or that sends nothing within its hello timeout.
//   kHelloDone   HelloDoneHeader (daemon -> client): the connection is bound to the session.
// Every client -> daemon message is sent with UCP_AM_SEND_FLAG_REPLY, so that the daemon knows
// the connection it came on; one that names a session other than its connection's is dropped.
//
// Client -> daemon:
//   kPushBegin   PushBeginHeader; payload: sequence id bytes, then num_token_ids uint32 ids.
//                Sent eager (UCP_AM_SEND_FLAG_EAGER) so it is handled before later messages.
//   kLayerData   LayerDataHeader; payload: K or V (`tensor`) of layer `layer`, input tokens
//                [token_offset, token_offset + num_tokens), BF16 [num_tokens][kv_heads][D].
//                A chunk is two messages, K and V of the same tokens, each sent from the
//                client's own buffer (no copy on the client). Always rendezvous
//                (UCP_AM_SEND_FLAG_RNDV): the daemon pulls the chunk's first message into a
//                staging slot (room for both halves) when one is free, which is the
//                backpressure, and the second one into the same slot at once. At most
//                UcxSession.max_message_bytes of payload.
//   kPushCommit  PushControlHeader (layer_messages = LAYER_DATA messages sent for the push).
//   kPushAbort   PushControlHeader.
//   kAttend      AttendHeader; payload: model id bytes, then `batch` x {uint32 id_bytes,
//                uint32 num_queries}, then the sequence ids' bytes back to back, then fp32
//                queries [sum num_queries][q_heads][head_dim] (unrotated). At most kvpoold's
//                --max_message_bytes of payload (RESOURCE_EXHAUSTED before it is received).
// Daemon -> client:
//   kLayerDone   LayerDoneHeader: every token of the layer is rotated and quantized.
//   kPushDone    PushDoneHeader; payload: the error message (empty when OK).
//   kAttendDone  AttendDoneHeader; payload when OK: `batch` x {uint32 attended_tokens,
//                uint32 num_queries}, then fp32 outputs [sum num_queries][q_heads][head_dim]
//                (original basis), then fp32 LSE [sum num_queries][q_heads]; when not OK: the
//                error message.
// Status codes are absl::StatusCode values (= gRPC's).
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>

namespace kvpool::ucx::wire {

// 2: K and V in separate LAYER_DATA messages. 3: client-server connections bound by HELLO.
inline constexpr uint32_t kWireVersion = 3;

enum AmId : uint16_t {
  kPushBegin = 1,
  kLayerData = 2,
  kPushCommit = 3,
  kPushAbort = 4,
  kAttend = 5,
  kHello = 6,
  kLayerDone = 16,
  kPushDone = 17,
  kAttendDone = 18,
  kHelloDone = 19,
};

inline constexpr uint32_t kEndOfPrefill = 1u << 0;

struct HelloHeader {
  uint64_t session_id;
  uint8_t secret[16];  // UcxSession.session_secret
  uint32_t wire_version;
  uint32_t reserved;
};

struct HelloDoneHeader {
  uint64_t session_id;
};

struct PushBeginHeader {
  uint64_t session_id;
  uint64_t push_id;  // chosen by the client, unique within its session
  uint32_t token_start;
  uint32_t num_tokens;
  uint32_t flags;  // kEndOfPrefill
  uint32_t sequence_id_bytes;
  uint32_t num_token_ids;  // 0 or num_tokens
  uint32_t reserved;
};

struct LayerDataHeader {
  uint64_t session_id;
  uint64_t push_id;
  int32_t layer;
  uint32_t token_offset;  // relative to the push's token_start
  uint32_t num_tokens;
  uint32_t tensor;  // kTensorKey or kTensorValue
};

inline constexpr uint32_t kTensorKey = 0;
inline constexpr uint32_t kTensorValue = 1;

struct PushControlHeader {
  uint64_t session_id;
  uint64_t push_id;
  uint64_t layer_messages;
};

struct AttendHeader {
  uint64_t session_id;
  uint64_t call_id;
  int32_t layer;
  uint32_t batch;
  uint32_t model_id_bytes;
  uint32_t reserved;
};

struct LayerDoneHeader {
  uint64_t push_id;
  int32_t layer;
  uint32_t num_tokens;  // tokens of the layer now stored (the whole push's)
};

struct PushDoneHeader {
  uint64_t push_id;
  int32_t status_code;
  uint32_t total_tokens;  // the sequence's length after the commit
  uint32_t to_sink;
  uint32_t to_history;
  uint32_t to_recent;
  uint32_t reserved;
  uint64_t pool_bytes;  // the sequence's pool bytes after the commit
};

struct AttendDoneHeader {
  uint64_t call_id;
  int32_t status_code;
  uint32_t batch;
  uint32_t q_heads;
  uint32_t head_dim;
};

struct SequenceQueryMeta {
  uint32_t id_bytes;
  uint32_t num_queries;
};

struct SequenceResultMeta {
  uint32_t attended_tokens;
  uint32_t num_queries;
};

// The header bytes of `h`.
template <typename T>
std::string Encode(const T& h) {
  static_assert(std::is_trivially_copyable_v<T>);
  return std::string(reinterpret_cast<const char*>(&h), sizeof(T));
}

// The header of type T, or nothing when `length` is not its size.
template <typename T>
std::optional<T> Decode(const void* header, size_t length) {
  static_assert(std::is_trivially_copyable_v<T>);
  if (length != sizeof(T) || header == nullptr) return std::nullopt;
  T h;
  std::memcpy(&h, header, sizeof(T));
  return h;
}

}  // namespace kvpool::ucx::wire
