#include "dataplane/attention_wire.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "dataplane/little_endian.h"

namespace kvpool::server {
namespace {

using wire::AllZero;
using wire::Get;
using wire::Put;

constexpr size_t kTokensAt = 64;
constexpr size_t kMessageAt = kTokensAt + 4 * kMaxPlanSequences;

}  // namespace

std::array<uint8_t, kCallHeaderBytes> EncodeCallHeader(const CallHeader& h) {
  std::array<uint8_t, kCallHeaderBytes> b{};
  Put<uint32_t>(&b[0], kCallMagic);
  Put<uint32_t>(&b[4], kWireVersion);
  Put<uint32_t>(&b[8], h.plan_id);
  Put<uint32_t>(&b[12], static_cast<uint32_t>(h.layer));
  Put<uint64_t>(&b[16], h.call);
  Put<uint64_t>(&b[24], h.query_bytes);
  Put<uint64_t>(&b[32], h.lse_bytes);
  return b;
}

absl::StatusOr<CallHeader> DecodeCallHeader(absl::Span<const uint8_t> bytes) {
  if (bytes.size() != kCallHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("a call header has ", kCallHeaderBytes, " bytes, got ", bytes.size()));
  }
  const uint8_t* p = bytes.data();
  if (Get<uint32_t>(p) != kCallMagic) {
    return absl::InvalidArgumentError("not a call header (bad magic)");
  }
  if (Get<uint32_t>(p + 4) != kWireVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("call header version ", Get<uint32_t>(p + 4), ", expected ", kWireVersion));
  }
  if (!AllZero(p + 40, kCallHeaderBytes - 40)) {
    return absl::InvalidArgumentError("call header padding is not zero");
  }
  CallHeader h;
  h.plan_id = Get<uint32_t>(p + 8);
  h.layer = static_cast<int32_t>(Get<uint32_t>(p + 12));
  h.call = Get<uint64_t>(p + 16);
  h.query_bytes = Get<uint64_t>(p + 24);
  h.lse_bytes = Get<uint64_t>(p + 32);
  if (h.plan_id == 0 || h.call == 0) {
    return absl::InvalidArgumentError("call header: plan id and call number must not be 0");
  }
  if (h.query_bytes == 0 || h.query_bytes % 4 != 0 || h.query_bytes > kMaxCallQueryBytes) {
    return absl::InvalidArgumentError(absl::StrCat("call header: query_bytes ", h.query_bytes,
                                                   " is not a positive multiple of 4 up to ",
                                                   kMaxCallQueryBytes));
  }
  if (h.lse_bytes == 0 || h.lse_bytes % 4 != 0 || h.query_bytes % h.lse_bytes != 0) {
    return absl::InvalidArgumentError(absl::StrCat("call header: lse_bytes ", h.lse_bytes,
                                                   " is not a positive multiple of 4 dividing "
                                                   "query_bytes ",
                                                   h.query_bytes));
  }
  return h;
}

absl::Status EncodeCallStatus(const CallStatus& s, absl::Span<uint8_t> out) {
  if (out.size() != kCallStatusBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("a status block has ", kCallStatusBytes, " bytes, got ", out.size()));
  }
  if (s.attended_tokens.size() > static_cast<size_t>(kMaxPlanSequences)) {
    return absl::InvalidArgumentError("more attended-token counts than a status block holds");
  }
  uint8_t* p = out.data();
  std::memset(p, 0, out.size());
  const absl::string_view message(s.status.message().data(),
                                  std::min(s.status.message().size(), kStatusMessageBytes));
  Put<uint32_t>(p, kStatusMagic);
  Put<uint32_t>(p + 4, kWireVersion);
  Put<uint64_t>(p + 8, s.call);
  Put<uint32_t>(p + 16, static_cast<uint32_t>(s.status.code()));
  Put<uint32_t>(p + 20, static_cast<uint32_t>(s.attended_tokens.size()));
  Put<uint32_t>(p + 24, static_cast<uint32_t>(message.size()));
  for (size_t i = 0; i < s.attended_tokens.size(); ++i) {
    Put<uint32_t>(p + kTokensAt + 4 * i, s.attended_tokens[i]);
  }
  if (!message.empty()) std::memcpy(p + kMessageAt, message.data(), message.size());
  return absl::OkStatus();
}

absl::StatusOr<CallStatus> DecodeCallStatus(absl::Span<const uint8_t> bytes) {
  if (bytes.size() != kCallStatusBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("a status block has ", kCallStatusBytes, " bytes, got ", bytes.size()));
  }
  const uint8_t* p = bytes.data();
  if (Get<uint32_t>(p) != kStatusMagic || Get<uint32_t>(p + 4) != kWireVersion) {
    return absl::InvalidArgumentError("not a status block (bad magic or version)");
  }
  const uint32_t code = Get<uint32_t>(p + 16);
  const uint32_t n = Get<uint32_t>(p + 20);
  const uint32_t message_bytes = Get<uint32_t>(p + 24);
  if (code > static_cast<uint32_t>(absl::StatusCode::kUnauthenticated) ||
      n > static_cast<uint32_t>(kMaxPlanSequences) || message_bytes > kStatusMessageBytes) {
    return absl::InvalidArgumentError("status block: code, count or message size out of range");
  }
  CallStatus s;
  s.call = Get<uint64_t>(p + 8);
  if (code != 0) {
    s.status = absl::Status(
        static_cast<absl::StatusCode>(code),
        absl::string_view(reinterpret_cast<const char*>(p + kMessageAt), message_bytes));
  }
  s.attended_tokens.resize(n);
  for (uint32_t i = 0; i < n; ++i) s.attended_tokens[i] = Get<uint32_t>(p + kTokensAt + 4 * i);
  return s;
}

absl::StatusOr<AttentionPlanShape> MakeAttentionPlanShape(int batch, int num_queries, int q_heads,
                                                          int head_dim, int max_batch) {
  const int most = std::min(max_batch, kMaxPlanSequences);
  if (batch < 1 || batch > most) {
    return absl::InvalidArgumentError(
        absl::StrCat("a plan holds 1 to ", most, " sequences, got ", batch));
  }
  if (num_queries < 1 || num_queries > kMaxPlanQueries) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_queries must be in [1, ", kMaxPlanQueries, "], got ", num_queries));
  }
  if (q_heads < 1 || head_dim < 1) {
    return absl::InvalidArgumentError("q_heads and head_dim must be positive");
  }
  AttentionPlanShape s{batch, num_queries, q_heads, head_dim};
  // rows() <= 2^20 and heads x dim < 2^62: the exact size fits 128 bits (size_t could wrap).
  const unsigned __int128 query_bytes = static_cast<unsigned __int128>(s.rows()) *
                                        static_cast<uint64_t>(q_heads) *
                                        static_cast<uint64_t>(head_dim) * sizeof(float);
  if (query_bytes > kMaxCallQueryBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a call of this plan (", batch, " x ", num_queries, " query rows of ", q_heads, " x ",
        head_dim, " values) moves more than ", kMaxCallQueryBytes, " query bytes"));
  }
  return s;
}

}  // namespace kvpool::server
