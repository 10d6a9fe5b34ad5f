// The bytes of a same-host attention channel (a SHARED_MEMORY session,
// proto/kvpool/v1/transport_service.proto), shared by the daemon
// (server/transport/shm/shm_channel.h) and the client (client/transport/shm_attention.h).
//
// The channel is one shared-memory region (a memfd: it has no name anyone could open), created
// by the daemon and handed to the client as a descriptor over a Unix socket (mode 0600) after the
// client proved its session with the session's secret:
//
//   client -> daemon  hello (kShmHelloBytes)    daemon -> client  reply (kShmReplyBytes) + fd
//    0  u32 magic kShmHelloMagic                  0  u32 magic kShmReplyMagic
//    4  u32 version kShmWireVersion               4  u32 version
//    8  u64 session_id                            8  u32 code (absl::StatusCode, 0 = OK)
//   16  16 bytes session secret                  12  u32 zero
//   32  zero up to 64                            16  u64 region_bytes
//                                                24  message (UTF-8, zero padded) up to 128
//
// Region (little-endian; every offset a multiple of 64):
//    0  header: u32 magic kShmRegionMagic, u32 version, u32 slots, u32 zero, u64 slot_bytes,
//       u64 max_query_bytes, u64 max_lse_bytes, zero up to 64
//   64  u32 doorbell: the client adds 1 after publishing a call (futex word, shm_doorbell.h)
//   68  u32 daemon_sleeping: 1 while the daemon blocks on the doorbell
//  128  slot i at kShmSlotsAt + i * slot_bytes:
//        0  u32 state (futex word): kSlotFree -> (client) kSlotRequest -> (daemon) kSlotDone
//        4  u32 client_sleeping: 1 while the client blocks on the state
//        8  u32 io: kIoRegion (queries and outputs in this slot) or kIoDevice (in the slot's
//           device mailbox: the daemon waits for its `ready` event on the device, attends and
//           records `done`, and answers as soon as that work is queued)
//       64  call header (kCallHeaderBytes, dataplane/attention_wire.h)
//      128  status block (kCallStatusBytes, the same file)
//       .. device mailbox (kShmMailboxBytes; zero without one): CUDA IPC handles of its memory
//           (64 bytes; queries at 0, out at max_query_bytes, lse at 2 x max_query_bytes), of
//           its `ready` event (64) and of its `done` event (64)
//       .. queries, then out (max_query_bytes each), then lse (max_lse_bytes), float32
//
// A slot in state kSlotRequest belongs to the daemon; in any other state to the client. The
// daemon treats the region as hostile: it copies the header out before reading it, checks every
// size against its own layout (never the region's header), reads the queries in place (a client
// that rewrites them mid-call changes only its own answer) and writes only inside the slot.
//
// Pure functions; thread-safe.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dataplane/attention_wire.h"

namespace kvpool::server {

inline constexpr uint32_t kShmHelloMagic = 0x4853564B;   // "KVSH"
inline constexpr uint32_t kShmReplyMagic = 0x5253564B;   // "KVSR"
inline constexpr uint32_t kShmRegionMagic = 0x4D53564B;  // "KVSM"
inline constexpr uint32_t kShmWireVersion = 1;
inline constexpr size_t kShmHelloBytes = 64;
inline constexpr size_t kShmReplyBytes = 128;
inline constexpr size_t kShmSecretBytes = 16;
inline constexpr size_t kShmDoorbellAt = 64;
inline constexpr size_t kShmDaemonSleepingAt = 68;
inline constexpr size_t kShmSlotsAt = 128;
inline constexpr size_t kShmSlotHeaderAt = 64;
inline constexpr size_t kShmSlotStatusAt = 128;
inline constexpr uint32_t kSlotFree = 0;
inline constexpr uint32_t kSlotRequest = 1;
inline constexpr uint32_t kSlotDone = 2;
inline constexpr size_t kShmSlotIoAt = 8;
inline constexpr uint32_t kIoRegion = 0;
inline constexpr uint32_t kIoDevice = 1;
inline constexpr size_t kShmIpcHandleBytes = 64;  // cudaIpcMemHandle_t, cudaIpcEventHandle_t
inline constexpr size_t kShmMailboxBytes = 256;
// Bounds a daemon enforces on what a client asks for.
inline constexpr uint32_t kShmMaxSlots = 16;

// Where everything is, computed by both ends from the session's sizes.
struct ShmLayout {
  uint32_t slots = 0;
  size_t max_query_bytes = 0;
  size_t max_lse_bytes = 0;
  size_t slot_bytes = 0;

  size_t region_bytes() const { return kShmSlotsAt + slots * slot_bytes; }
  size_t slot_at(uint32_t i) const { return kShmSlotsAt + static_cast<size_t>(i) * slot_bytes; }
  // Offsets inside a slot.
  static size_t mailbox_at();
  static size_t queries_at();
  size_t out_at() const { return queries_at() + max_query_bytes; }
  size_t lse_at() const { return out_at() + max_query_bytes; }
};

// InvalidArgument unless 1 <= slots <= kShmMaxSlots, 0 < max_lse_bytes <= max_query_bytes <=
// kMaxCallQueryBytes, both multiples of 4, and the region stays within max_region_bytes.
absl::StatusOr<ShmLayout> MakeShmLayout(uint32_t slots, size_t max_query_bytes,
                                        size_t max_lse_bytes, size_t max_region_bytes);

// The region header of `layout` into region[0, 64).
void WriteShmRegionHeader(const ShmLayout& layout, uint8_t* region);
// The layout a region header describes, checked against the `mapped_bytes` the client mapped.
absl::StatusOr<ShmLayout> ReadShmRegionHeader(absl::Span<const uint8_t> region);

struct ShmHello {
  uint64_t session_id = 0;
  std::string secret;  // kShmSecretBytes
};
std::array<uint8_t, kShmHelloBytes> EncodeShmHello(const ShmHello& h);
// InvalidArgument for anything but a well-formed hello (magic, version, zero padding, id != 0).
absl::StatusOr<ShmHello> DecodeShmHello(absl::Span<const uint8_t> bytes);

struct ShmReply {
  absl::Status status;  // message cut to fit
  uint64_t region_bytes = 0;
};
std::array<uint8_t, kShmReplyBytes> EncodeShmReply(const ShmReply& r);
absl::StatusOr<ShmReply> DecodeShmReply(absl::Span<const uint8_t> bytes);

}  // namespace kvpool::server
