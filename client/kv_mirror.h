// KvMirror: a decode worker's copy of the attention-ready storage of some sequences of one model
// (every layer), kept current by incremental fetches (ReadBlocks with a cursor,
// docs/api.md "Incremental fetch") and laid out like kvpoold's pool, so that a PagedKvBatch
// (kernels/paged_kv.h) describes it as it is: INT2 history blocks in one region of the arena,
// BF16 sink and recent pages (the same block format with 16-bit rows) in another, both
// addressed by slot id.
//
//   KVPOOL_ASSIGN_OR_RETURN(auto mirror, KvMirror::Create(client, "llama", {4096, 1024}));
//   KVPOOL_ASSIGN_OR_RETURN(FetchStats moved, mirror->Fetch("seq-1"));  // first: everything
//   ...  // the sequence grows
//   KVPOOL_ASSIGN_OR_RETURN(moved, mirror->Fetch("seq-1"));  // only the new blocks and rows
//   KVPOOL_ASSIGN_OR_RETURN(auto tables, mirror->Tables(layer, {"seq-1"}));
//   attend(tables->batch());  // pools point into the arena, arrays into tables->words()
//
// A fetch moves the history blocks the mirror does not hold (and the one it holds partly, which
// demotion filled, again whole) and the recent rows after the ones it holds; recent rows the
// daemon demoted meanwhile are dropped here (they arrive inside history blocks), and pages they
// emptied go back to the slot allocator, which hands freed slots out again. A fetch is all or
// nothing: on any error the mirror is unchanged.
//
// Page convention: BF16 token position p lies in slot p % T of the page of chunk p / T (T the
// block tokens), so the recent tier of a sequence whose window starts at W is its pages from
// chunk W / T, first token W % T.
//
// The arena is host memory the mirror allocates, or a buffer the caller owns (a worker's GPU
// memory, say) with a `write` function that copies host bytes into it (Fetch: the bytes come over
// gRPC), or that the daemon writes itself (FetchToDevice: CUDA IPC, same host). Tables' arrays
// are host memory; a GPU kernel takes a device copy of tables->words() and the batch moved there
// with RebaseArrays (kernels/paged_kv.h).
//
// Thread-compatible: one thread fetches; attention reads the arena between fetches (a fetch
// rewrites a partly held history block and fills recent pages in place).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/kvpool_client.h"
#include "kernels/block_layout.h"
#include "kernels/paged_kv.h"

namespace kvpool::client {

// Capacity of a mirror, in slots.
struct KvMirrorOptions {
  int32_t history_slots = 0;  // INT2 history blocks
  int32_t bf16_slots = 0;     // BF16 sink and recent pages
};

// Memory the caller owns for the mirror: [base, base + bytes), at least ArenaBytes(), 16-byte
// aligned; `write` copies `n` host bytes to `dst` inside it, `read` (optional: Gather) `n` bytes
// from `src` inside it to host memory.
struct MirrorArena {
  using Copy = std::function<absl::Status(uint8_t* dst, const uint8_t* src, size_t n)>;
  uint8_t* base = nullptr;
  size_t bytes = 0;
  Copy write;
  Copy read;
};

// Where FetchToDevice's daemon writes: the mirror's arena exported over a CUDA IPC session.
struct DeviceFetchTarget {
  uint64_t session_id = 0;  // a CUDA IPC session (TransportService.Negotiate)
  std::string handle;       // cudaIpcMemHandle_t bytes of the arena's allocation
  uint64_t offset = 0;      // of the arena's base in that allocation (16-byte aligned)
};

// What one fetch moved.
struct FetchStats {
  uint64_t bytes = 0;           // payload: history blocks plus the rows' K and V
  uint64_t history_blocks = 0;  // blocks received (all layers)
  uint64_t rows = 0;            // sink and recent rows received (all layers)
  bool full = false;            // a whole read: the first, or after a stale cursor
};

class KvMirror {
 public:
  // A mirror of `model_id`'s sequences (DescribeModel gives the layouts) with `options`' slots,
  // in host memory it allocates, or in `arena` when it has a base. InvalidArgument for zero
  // slots or an arena too small or misaligned; DescribeModel's errors.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<KvMirror>> Create(
      const KvpoolClient* client, const std::string& model_id, const KvMirrorOptions& options,
      MirrorArena arena = {});
  // Bytes of an arena for `options` with these layouts.
  static size_t ArenaBytes(const BlockLayout& history, const BlockLayout& bf16,
                           const KvMirrorOptions& options);

  KvMirror(const KvMirror&) = delete;
  KvMirror& operator=(const KvMirror&) = delete;

  // Brings the sequence up to date: everything on the first fetch, then only what it gained.
  // A cursor the daemon calls stale (the id was released and created anew) drops the copy and
  // reads the new sequence in full; so does an answer in full from a daemon that predates
  // cursors (then a failure leaves the sequence out of the mirror). The daemon's errors (NOT_FOUND
  // for a released sequence, ...) leave the mirror unchanged; RESOURCE_EXHAUSTED when the new data
  // does not fit the free slots; DATA_LOSS when the daemon's answer does not continue what the
  // mirror holds.
  [[nodiscard]] absl::StatusOr<FetchStats> Fetch(const std::string& sequence_id);
  // Fetch as above, but the daemon itself copies the new blocks and rows from its pool (on a
  // GPU) into the arena (a worker's GPU buffer exported as `target`, same host: CUDA IPC) and
  // answers which slots it wrote; nothing moves through this process. UNAVAILABLE from a
  // daemon whose pool is not on a GPU; otherwise as Fetch.
  [[nodiscard]] absl::StatusOr<FetchStats> FetchToDevice(const std::string& sequence_id,
                                                         const DeviceFetchTarget& target);
  // Forgets a sequence and frees its slots. NotFound when it is not held.
  [[nodiscard]] absl::Status Drop(const std::string& sequence_id);

  // The cursor of a held sequence (what the next fetch sends), or null.
  const v1::ReadBlocksCursor* Held(const std::string& sequence_id) const;
  // Layer `layer` of `sequence_ids` (all held) as a decode batch, each sequence attended by
  // `rows` query rows; the pools point into the arena. NotFound, InvalidArgument (layer).
  [[nodiscard]] absl::StatusOr<std::unique_ptr<PagedKvTables>> Tables(
      int layer, absl::Span<const std::string> sequence_ids, int rows = 1) const;
  // One layer of a held sequence in ReadBlocks' gathered form (every sink row, history block
  // and recent row), read from the arena (a caller's arena through its `read`;
  // FailedPrecondition without one).
  [[nodiscard]] absl::StatusOr<LayerBlocks> Gather(const std::string& sequence_id, int layer) const;

  const PagedKvView& history_pool() const { return history_pool_; }
  const PagedKvView& bf16_pool() const { return bf16_pool_; }
  int num_layers() const { return num_layers_; }
  size_t free_history_slots() const { return free_history_.size(); }
  size_t free_bf16_slots() const { return free_bf16_.size(); }

 private:
  struct Layer {
    std::deque<int32_t> sink;      // page of chunk c at [c]
    std::vector<int32_t> history;  // block i at [i]
    std::deque<int32_t> recent;    // page of chunk recent_chunk0 + i at [i]
  };
  struct HeldSequence {
    v1::ReadBlocksCursor cursor;
    int64_t recent_chunk0 = 0;
    std::vector<Layer> layers;
  };

  // Where an answer to a cursor's read begins, checked against what `held` holds (DATA_LOSS
  // when the answer does not continue it).
  struct Continuation {
    int64_t block_start = 0;
    int64_t recent_start = 0;
    int64_t chunk_begin = 0;  // the recent window's chunks [chunk_begin, chunk_end)
    int64_t chunk_end = 0;
  };
  absl::StatusOr<Continuation> Continues(const v1::ReadBlocksHeader& h,
                                         const HeldSequence& held) const;
  // Applies FetchToDevice's answer (the daemon wrote the data) to `held`'s slot lists.
  absl::Status ApplyDeviceWrites(const v1::FetchToDeviceResponse& r, HeldSequence* held,
                                 FetchStats* stats);
  static void SetCursor(const v1::ReadBlocksHeader& h, HeldSequence* held);
  // Free slots of each kind a fetch of a held sequence offers per layer at first.
  static constexpr int kHeldFetchSlotsPerLayer = 4;
  // Takes `slot` out of a free list; false when it is not free.
  static bool TakeFree(std::vector<int32_t>* free, int32_t slot);

  KvMirror() = default;
  // Applies a gathered read to `held` (a fresh entry for a full read); all or nothing.
  absl::Status Apply(const BlocksRead& read, HeldSequence* held, FetchStats* stats);
  // Copies BF16 rows [first, first + count) (positions; wire layout [n][Hkv][D]) into `pages`,
  // whose entry i is the page of chunk chunk0 + i.
  absl::Status WriteRows(const std::string& k, const std::string& v, int64_t first, int64_t count,
                         const std::deque<int32_t>& pages, int64_t chunk0);
  absl::Status Write(uint8_t* dst, const uint8_t* src, size_t n);
  void Free(HeldSequence* held);

  const KvpoolClient* client_ = nullptr;
  std::string model_id_;
  int num_layers_ = 0;
  BlockLayout history_layout_;
  BlockLayout bf16_layout_;
  PagedKvView history_pool_;
  PagedKvView bf16_pool_;
  struct AlignedDelete {
    void operator()(uint8_t* p) const;
  };
  std::unique_ptr<uint8_t, AlignedDelete> owned_;  // the host arena, when the mirror made it
  MirrorArena arena_;
  KvMirrorOptions slots_;
  std::vector<int32_t> free_history_;  // free slots, the next one handed out last
  std::vector<int32_t> free_bf16_;
  std::map<std::string, HeldSequence> held_;
};

}  // namespace kvpool::client
