#include "dataplane/shm_wire.h"

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

constexpr size_t kAlign = 64;
constexpr size_t kReplyMessageAt = 24;

size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

size_t ShmLayout::mailbox_at() { return AlignUp(kShmSlotStatusAt + kCallStatusBytes); }
size_t ShmLayout::queries_at() { return mailbox_at() + kShmMailboxBytes; }

absl::StatusOr<ShmLayout> MakeShmLayout(uint32_t slots, size_t max_query_bytes,
                                        size_t max_lse_bytes, size_t max_region_bytes) {
  if (slots < 1 || slots > kShmMaxSlots) {
    return absl::InvalidArgumentError(
        absl::StrCat("a shared-memory channel has 1 to ", kShmMaxSlots, " slots, not ", slots));
  }
  if (max_query_bytes == 0 || max_query_bytes % 4 != 0 || max_query_bytes > kMaxCallQueryBytes ||
      max_lse_bytes == 0 || max_lse_bytes % 4 != 0 || max_lse_bytes > max_query_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared-memory channel sizes: need 0 < lse bytes <= query bytes <= ", kMaxCallQueryBytes,
        ", multiples of 4; got ", max_query_bytes, " and ", max_lse_bytes));
  }
  ShmLayout l;
  l.slots = slots;
  l.max_query_bytes = AlignUp(max_query_bytes);
  l.max_lse_bytes = AlignUp(max_lse_bytes);
  l.slot_bytes = AlignUp(l.lse_at() + l.max_lse_bytes);
  if (l.region_bytes() > max_region_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a shared-memory channel of ", slots, " slots of ", max_query_bytes, " query bytes needs ",
        l.region_bytes(), " bytes; this daemon allows ", max_region_bytes));
  }
  return l;
}

void WriteShmRegionHeader(const ShmLayout& l, uint8_t* region) {
  std::memset(region, 0, kShmDoorbellAt);
  Put<uint32_t>(region, kShmRegionMagic);
  Put<uint32_t>(region + 4, kShmWireVersion);
  Put<uint32_t>(region + 8, l.slots);
  Put<uint64_t>(region + 16, l.slot_bytes);
  Put<uint64_t>(region + 24, l.max_query_bytes);
  Put<uint64_t>(region + 32, l.max_lse_bytes);
}

absl::StatusOr<ShmLayout> ReadShmRegionHeader(absl::Span<const uint8_t> region) {
  if (region.size() < kShmSlotsAt) return absl::InvalidArgumentError("region too small");
  const uint8_t* p = region.data();
  if (Get<uint32_t>(p) != kShmRegionMagic || Get<uint32_t>(p + 4) != kShmWireVersion ||
      Get<uint32_t>(p + 12) != 0 || !AllZero(p + 40, kShmDoorbellAt - 40)) {
    return absl::InvalidArgumentError("not a kvpool shared-memory region of this version");
  }
  ShmLayout l;
  l.slots = Get<uint32_t>(p + 8);
  l.slot_bytes = Get<uint64_t>(p + 16);
  l.max_query_bytes = Get<uint64_t>(p + 24);
  l.max_lse_bytes = Get<uint64_t>(p + 32);
  absl::StatusOr<ShmLayout> want =
      MakeShmLayout(l.slots, l.max_query_bytes, l.max_lse_bytes, region.size());
  if (!want.ok() || want->slot_bytes != l.slot_bytes || want->region_bytes() != region.size()) {
    return absl::InvalidArgumentError("shared-memory region header does not match its size");
  }
  return l;
}

std::array<uint8_t, kShmHelloBytes> EncodeShmHello(const ShmHello& h) {
  std::array<uint8_t, kShmHelloBytes> b{};
  Put<uint32_t>(&b[0], kShmHelloMagic);
  Put<uint32_t>(&b[4], kShmWireVersion);
  Put<uint64_t>(&b[8], h.session_id);
  std::memcpy(&b[16], h.secret.data(), std::min(h.secret.size(), kShmSecretBytes));
  return b;
}

absl::StatusOr<ShmHello> DecodeShmHello(absl::Span<const uint8_t> bytes) {
  if (bytes.size() != kShmHelloBytes) return absl::InvalidArgumentError("bad hello size");
  const uint8_t* p = bytes.data();
  if (Get<uint32_t>(p) != kShmHelloMagic || Get<uint32_t>(p + 4) != kShmWireVersion ||
      !AllZero(p + 16 + kShmSecretBytes, kShmHelloBytes - 16 - kShmSecretBytes)) {
    return absl::InvalidArgumentError("not a kvpool shared-memory hello of this version");
  }
  ShmHello h;
  h.session_id = Get<uint64_t>(p + 8);
  if (h.session_id == 0) return absl::InvalidArgumentError("hello names session 0");
  h.secret.assign(reinterpret_cast<const char*>(p + 16), kShmSecretBytes);
  return h;
}

std::array<uint8_t, kShmReplyBytes> EncodeShmReply(const ShmReply& r) {
  std::array<uint8_t, kShmReplyBytes> b{};
  Put<uint32_t>(&b[0], kShmReplyMagic);
  Put<uint32_t>(&b[4], kShmWireVersion);
  Put<uint32_t>(&b[8], static_cast<uint32_t>(r.status.code()));
  Put<uint64_t>(&b[16], r.region_bytes);
  const absl::string_view m = r.status.message();
  std::memcpy(&b[kReplyMessageAt], m.data(), std::min(m.size(), kShmReplyBytes - kReplyMessageAt));
  return b;
}

absl::StatusOr<ShmReply> DecodeShmReply(absl::Span<const uint8_t> bytes) {
  if (bytes.size() != kShmReplyBytes) return absl::InvalidArgumentError("bad reply size");
  const uint8_t* p = bytes.data();
  const uint32_t code = Get<uint32_t>(p + 8);
  if (Get<uint32_t>(p) != kShmReplyMagic || Get<uint32_t>(p + 4) != kShmWireVersion ||
      Get<uint32_t>(p + 12) != 0 ||
      code > static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::InvalidArgumentError("not a kvpool shared-memory reply of this version");
  }
  const char* m = reinterpret_cast<const char*>(p + kReplyMessageAt);
  const size_t len = strnlen(m, kShmReplyBytes - kReplyMessageAt);
  ShmReply r;
  r.status = absl::Status(static_cast<absl::StatusCode>(code), absl::string_view(m, len));
  r.region_bytes = Get<uint64_t>(p + 16);
  return r;
}

}  // namespace kvpool::server
