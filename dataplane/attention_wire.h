// The bytes a remote attention call moves over an NCCL attention channel (an NCCL session of use
// ATTENTION, proto/kvpool/v1/transport_service.proto), shared by the daemon
// (server/transport/nccl/attention_channel.cc) and the client (client/transport/gpu_attention.h).
//
// Once the communicator is up, both ends first send each other kConnectBytes (any content) in
// one group, which connects both directions before the first call (NCCL connects each direction
// at its first use and waits for the peer there; a call's one-group round trip would deadlock).
// A call is then, client to daemon: the call header (kCallHeaderBytes), then the queries; daemon
// to client: the status block (kCallStatusBytes), then out, then lse. Integers are
// little-endian.
//
//   call header (64 bytes)             status block (kCallStatusBytes)
//    0  u32 magic kCallMagic            0  u32 magic kStatusMagic
//    4  u32 version kWireVersion        4  u32 version kWireVersion
//    8  u32 plan_id (!= 0)              8  u64 call (echoes the header's)
//   12  i32 layer                      16  u32 code (absl::StatusCode, 0 = OK)
//   16  u64 call (1, 2, 3, ...)        20  u32 num_sequences
//   24  u64 query_bytes                24  u32 message_bytes
//   32  u64 lse_bytes                  28  zero up to 64
//   40  zero up to 64                  64  u32 attended_tokens[kMaxPlanSequences]
//                                      64 + 4 kMaxPlanSequences: message (UTF-8, not terminated)
//
//   std::array<uint8_t, kCallHeaderBytes> h = EncodeCallHeader({plan, layer, call, qb, lb});
//   KVPOOL_ASSIGN_OR_RETURN(CallHeader got, DecodeCallHeader(h));
//   KVPOOL_ASSIGN_OR_RETURN(AttentionPlanShape s, MakeAttentionPlanShape(8, 1, 64, 128, 256));
//
// Pure functions; thread-safe.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvpool::server {

inline constexpr uint32_t kCallMagic = 0x5141564B;    // "KVAQ"
inline constexpr uint32_t kStatusMagic = 0x5341564B;  // "KVAS"
inline constexpr uint32_t kWireVersion = 1;
inline constexpr size_t kCallHeaderBytes = 64;
inline constexpr size_t kConnectBytes = 64;
// Most sequences in one plan (the status block has a slot for each).
inline constexpr int kMaxPlanSequences = 1024;
// Most query rows per sequence in one plan.
inline constexpr int kMaxPlanQueries = 1024;
// Most bytes of a status message (longer ones are cut).
inline constexpr size_t kStatusMessageBytes = 256;
inline constexpr size_t kCallStatusBytes = 64 + 4 * kMaxPlanSequences + kStatusMessageBytes;
// Most query bytes of one call (the daemon's receive buffer grows up to it).
inline constexpr size_t kMaxCallQueryBytes = size_t{64} << 20;

struct CallHeader {
  uint32_t plan_id = 0;
  int32_t layer = 0;
  uint64_t call = 0;  // the channel's call number: 1 for the first call, then +1 per call
  uint64_t query_bytes = 0;
  uint64_t lse_bytes = 0;
};

struct CallStatus {
  uint64_t call = 0;
  absl::Status status;  // the call's outcome; the message is cut to kStatusMessageBytes
  std::vector<uint32_t> attended_tokens;  // per sequence of the plan (empty on error)
};

std::array<uint8_t, kCallHeaderBytes> EncodeCallHeader(const CallHeader& h);
// InvalidArgument for anything but exactly kCallHeaderBytes of a well-formed header: magic,
// version, zero padding, a plan id and call number other than 0, query_bytes a positive
// multiple of 4 up to kMaxCallQueryBytes, lse_bytes a positive multiple of 4 dividing it.
absl::StatusOr<CallHeader> DecodeCallHeader(absl::Span<const uint8_t> bytes);

// Writes kCallStatusBytes into `out` (InvalidArgument when it is not that long or
// attended_tokens has more than kMaxPlanSequences entries).
absl::Status EncodeCallStatus(const CallStatus& s, absl::Span<uint8_t> out);
// InvalidArgument for a malformed block (size, magic, version, counts, unknown code).
absl::StatusOr<CallStatus> DecodeCallStatus(absl::Span<const uint8_t> bytes);

// The shape every call of a plan moves.
struct AttentionPlanShape {
  int batch = 0;        // sequences
  int num_queries = 0;  // query rows per sequence
  int q_heads = 0;
  int head_dim = 0;
  size_t rows() const { return static_cast<size_t>(batch) * num_queries; }
  // [batch][num_queries][q_heads][head_dim] float32 (queries, and out)
  size_t query_bytes() const { return rows() * q_heads * head_dim * sizeof(float); }
  // [batch][num_queries][q_heads] float32
  size_t lse_bytes() const { return rows() * q_heads * sizeof(float); }
};

// InvalidArgument unless 1 <= batch <= min(max_batch, kMaxPlanSequences), 1 <= num_queries <=
// kMaxPlanQueries, the heads and head_dim are positive and the queries fit kMaxCallQueryBytes.
absl::StatusOr<AttentionPlanShape> MakeAttentionPlanShape(int batch, int num_queries, int q_heads,
                                                          int head_dim, int max_batch);

}  // namespace kvpool::server
