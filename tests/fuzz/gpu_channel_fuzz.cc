// Fuzz target: what the GPU data plane reads from a peer, without a GPU: the NCCL attention
// channel's call header and status block and the plan shape a SetAttentionPlan derives
// (dataplane/attention_wire.h), and the checks of TransportService.PushKv's messages (the append
// header every ingest shares, server/ingest/append_checks.h; a chunk's place and size; a CUDA IPC
// buffer's range, server/transport/cuda_ipc/ipc_range_check.h) on DevicePushRequests parsed from
// the input's bytes.
//
// Input: one byte picks the message, then its bytes.
#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>

#include "dataplane/attention_wire.h"
#include "kvpool/v1/transport_service.pb.h"
#include "server/ingest/append_checks.h"
#include "server/transport/cuda_ipc/ipc_range_check.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/quiet_protobuf.h"

namespace kvpool::server {
namespace {

absl::Span<const uint8_t> AsBytes(absl::string_view s) {
  return absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

// The daemon's side of a call: a header it accepts re-encodes to the same bytes.
void CallHeaderMessage(fuzz::FuzzInput& in) {
  const absl::string_view bytes = in.Bytes(kCallHeaderBytes);
  absl::StatusOr<CallHeader> h = DecodeCallHeader(AsBytes(bytes));
  if (!h.ok()) {
    FUZZ_CHECK(absl::IsInvalidArgument(h.status()), h.status().ToString());
    return;
  }
  FUZZ_CHECK(h->query_bytes <= kMaxCallQueryBytes && h->lse_bytes <= h->query_bytes, "sizes");
  const std::array<uint8_t, kCallHeaderBytes> again = EncodeCallHeader(*h);
  FUZZ_CHECK(absl::string_view(reinterpret_cast<const char*>(again.data()), again.size()) == bytes,
             "EncodeCallHeader(DecodeCallHeader(x)) != x");
}

// The client's side: a status block it accepts encodes and decodes to the same status.
void CallStatusMessage(fuzz::FuzzInput& in) {
  const absl::string_view bytes = in.Bytes(kCallStatusBytes);
  absl::StatusOr<CallStatus> s = DecodeCallStatus(AsBytes(bytes));
  if (!s.ok()) {
    FUZZ_CHECK(absl::IsInvalidArgument(s.status()), s.status().ToString());
    return;
  }
  FUZZ_CHECK(s->attended_tokens.size() <= static_cast<size_t>(kMaxPlanSequences), "count");
  std::string block(kCallStatusBytes, '\0');
  absl::Status encoded =
      EncodeCallStatus(*s, absl::MakeSpan(reinterpret_cast<uint8_t*>(block.data()), block.size()));
  FUZZ_CHECK(encoded.ok(), encoded.ToString());
  absl::StatusOr<CallStatus> back = DecodeCallStatus(AsBytes(block));
  FUZZ_CHECK(back.ok(), back.status().ToString());
  FUZZ_CHECK(back->call == s->call && back->status == s->status &&
                 back->attended_tokens == s->attended_tokens,
             "status block changed in a round trip");
}

// A plan's shape from any counts: accepted shapes move at most kMaxCallQueryBytes, computed
// without overflow.
void PlanShape(fuzz::FuzzInput& in) {
  const int batch = static_cast<int>(in.U32());
  const int num_queries = static_cast<int>(in.U32());
  const int q_heads = static_cast<int>(in.U32());
  const int head_dim = static_cast<int>(in.U32());
  const int max_batch = static_cast<int>(in.U32());
  absl::StatusOr<AttentionPlanShape> s =
      MakeAttentionPlanShape(batch, num_queries, q_heads, head_dim, max_batch);
  if (!s.ok()) return;
  const unsigned __int128 exact =
      static_cast<unsigned __int128>(batch) * num_queries * q_heads * head_dim * sizeof(float);
  FUZZ_CHECK(exact <= kMaxCallQueryBytes && exact == s->query_bytes(),
             "an accepted plan moves more than kMaxCallQueryBytes (or its size overflowed)");
  FUZZ_CHECK(s->lse_bytes() > 0 && s->query_bytes() % s->lse_bytes() == 0, "lse bytes");
}

// A PushKv stream's header and chunks as the daemon checks them, for a model of `row_bytes`
// bytes per token and `num_layers` layers.
void PushRequests(fuzz::FuzzInput& in) {
  constexpr int kMaxAppendTokens = 1 << 20;
  const size_t row_bytes = (in.Byte() + 1) * size_t{64};
  const int num_layers = in.Byte() + 1;
  int push_tokens = 0;
  absl::string_view piece;
  for (int i = 0; i < 8 && in.Framed(&piece); ++i) {
    ::kvpool::v1::DevicePushRequest request;
    if (!request.ParseFromArray(piece.data(), static_cast<int>(piece.size()))) return;
    if (request.has_header()) {
      const ::kvpool::v1::AppendKvHeader& h = request.header().append();
      if (!ValidateAppendHeader(h, kMaxAppendTokens).ok()) return;
      FUZZ_CHECK(h.num_tokens() >= 1 && h.num_tokens() <= kMaxAppendTokens, "num_tokens");
      FUZZ_CHECK(uint64_t{h.token_start()} + h.num_tokens() <= uint64_t{INT32_MAX},
                 "an accepted append passes INT32_MAX");
      push_tokens = static_cast<int>(h.num_tokens());
      continue;
    }
    const ::kvpool::v1::DevicePushChunk& c = request.chunk();
    if (!CheckChunkPlace(c.layer(), c.token_offset(), c.num_tokens(), num_layers, push_tokens)
             .ok()) {
      continue;
    }
    FUZZ_CHECK(c.layer() >= 0 && c.layer() < num_layers, "layer outside the model");
    FUZZ_CHECK(uint64_t{c.token_offset()} + c.num_tokens() <= static_cast<uint64_t>(push_tokens),
               "chunk outside its push");
    absl::StatusOr<size_t> bytes = ChunkBytes(c.num_tokens(), row_bytes);
    if (!bytes.ok()) continue;
    const size_t allocation = in.U32();
    for (const ::kvpool::v1::CudaIpcBuffer* b : {&c.k(), &c.v()}) {
      if (CheckIpcRange(b->offset(), *bytes, allocation, "k").ok()) {
        FUZZ_CHECK(b->offset() + *bytes <= allocation, "IPC range outside its allocation");
      }
    }
  }
}

}  // namespace
}  // namespace kvpool::server

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvpool::server;
  static const bool quiet = (kvpool::fuzz::QuietProtobufLogs(), true);
  (void)quiet;
  kvpool::fuzz::FuzzInput in(data, size);
  switch (in.Byte() % 4) {
    case 0:
      CallHeaderMessage(in);
      break;
    case 1:
      CallStatusMessage(in);
      break;
    case 2:
      PlanShape(in);
      break;
    default:
      PushRequests(in);
      break;
  }
  return 0;
}
