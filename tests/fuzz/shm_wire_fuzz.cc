// Fuzz target: what a same-host attention channel reads from the other side
// (dataplane/shm_wire.h): the daemon's decode of a client's hello, the client's decode of the
// daemon's reply, the client's reading of a region header, and the layout both derive from
// sizes a client asks for.
//
// Input: one byte picks the check, then the bytes it reads.
#include <cstddef>
#include <cstdint>
#include <string>

#include "dataplane/shm_wire.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/fuzz_input.h"

namespace kvpool::server {
namespace {

constexpr size_t kMaxRegionBytes = size_t{64} << 20;  // kvpoold's default

void Hello(fuzz::FuzzInput& in) {
  const absl::string_view bytes = in.Rest();
  absl::StatusOr<ShmHello> h = DecodeShmHello(
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
  if (!h.ok()) return;
  FUZZ_CHECK(bytes.size() == kShmHelloBytes && h->session_id != 0, "a malformed hello accepted");
  FUZZ_CHECK(h->secret.size() == kShmSecretBytes, "secret size");
  const auto again = EncodeShmHello(*h);
  FUZZ_CHECK(absl::string_view(reinterpret_cast<const char*>(again.data()), again.size()) == bytes,
             "Encode(Decode(x)) != x");
}

void Reply(fuzz::FuzzInput& in) {
  const absl::string_view bytes = in.Rest();
  absl::StatusOr<ShmReply> r = DecodeShmReply(
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
  if (!r.ok()) return;
  FUZZ_CHECK(bytes.size() == kShmReplyBytes, "a reply of another size accepted");
  FUZZ_CHECK(r->status.message().size() <= kShmReplyBytes, "message longer than the reply");
}

void Region(fuzz::FuzzInput& in) {
  const absl::string_view bytes = in.Rest();
  absl::StatusOr<ShmLayout> l = ReadShmRegionHeader(
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
  if (!l.ok()) return;
  // Whatever the header says, every slot and every part of it lies inside the mapping.
  FUZZ_CHECK(l->region_bytes() == bytes.size(), "layout larger than the region");
  FUZZ_CHECK(l->slot_at(l->slots - 1) + l->slot_bytes <= bytes.size(), "slot past the end");
  FUZZ_CHECK(l->lse_at() + l->max_lse_bytes <= l->slot_bytes, "lse past the slot");
}

void Layout(fuzz::FuzzInput& in) {
  const uint32_t slots = in.U32();
  const uint64_t query = (uint64_t{in.U32()} << 32) | in.U32();
  const uint64_t lse = (uint64_t{in.U32()} << 32) | in.U32();
  absl::StatusOr<ShmLayout> l = MakeShmLayout(slots, query, lse, kMaxRegionBytes);
  if (!l.ok()) return;
  FUZZ_CHECK(l->slots >= 1 && l->slots <= kShmMaxSlots, "slot count");
  FUZZ_CHECK(l->region_bytes() <= kMaxRegionBytes, "region over its cap");
  FUZZ_CHECK(l->max_query_bytes >= query && l->max_lse_bytes >= lse, "buffers shorter than asked");
  FUZZ_CHECK(l->lse_at() + l->max_lse_bytes <= l->slot_bytes, "lse past the slot");
}

}  // namespace
}  // namespace kvpool::server

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvpool::fuzz::FuzzInput in(data, size);
  switch (in.Byte() % 4) {
    case 0:
      kvpool::server::Hello(in);
      break;
    case 1:
      kvpool::server::Reply(in);
      break;
    case 2:
      kvpool::server::Region(in);
      break;
    default:
      kvpool::server::Layout(in);
      break;
  }
  return 0;
}
