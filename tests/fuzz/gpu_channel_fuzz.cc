// Fuzz target: what the GPU data plane reads from a peer, without a GPU: the NCCL attention
// channel's call header and status block and the plan shape a SetAttentionPlan derives
// (dataplane/attention_wire.h), and the PushKv messages' checks
// (server/transport/gpu/gpu_push_checks.h) on a GpuPushRequest parsed from the input's bytes.
//
// Input: one byte picks the message, then its bytes.
#include <cstddef>
#include <cstdint>
#include <string>

#include "kvpool/v1/gpu_transport_service.pb.h"
#include "dataplane/attention_wire.h"
#include "server/transport/gpu/gpu_push_checks.h"
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
// bytes per token.
void PushRequests(fuzz::FuzzInput& in) {
  const size_t row_bytes = (in.Byte() + 1) * size_t{64};
  int push_tokens = 0;
  absl::string_view piece;
  for (int i = 0; i < 8 && in.Framed(&piece); ++i) {
    ::kvpool::v1::GpuPushRequest request;
    if (!request.ParseFromArray(piece.data(), static_cast<int>(piece.size()))) return;
    if (request.has_header()) {
      if (!CheckGpuPushHeader(request.header(), 1 << 20).ok()) return;
      push_tokens = static_cast<int>(request.header().num_tokens());
      continue;
    }
    const ::kvpool::v1::GpuPushChunk& c = request.chunk();
    absl::StatusOr<size_t> bytes = CheckGpuPushChunk(c, push_tokens, row_bytes);
    if (!bytes.ok()) continue;
    FUZZ_CHECK(uint64_t{c.token_offset()} + c.num_tokens() <= static_cast<uint64_t>(push_tokens),
               "chunk outside its push");
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
