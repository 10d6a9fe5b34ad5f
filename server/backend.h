// ComputeBackend: where kvpoold's pool memory lives and what runs the codec math on it.
//
// The CPU backend (cpu_backend.h) is the embedded default: host memory and the kernels/ CPU code.
// The CUDA backend (cuda_backend.h) keeps the arena in GPU memory and runs the kernels/cuda
// kernels. CreateBackend picks one by name; nothing here changes with build flags.
//
// Pool pages are blocks of kernels/block_layout.h: INT2 history blocks in the model's layout
// (Model::block_layout) and BF16 sink/recent pages in the same format with 16-bit bypass rows
// (Model::bf16_layout). Block pointers point into the backend's arena; only the backend reads or
// writes through them (the arena may not be host memory).
//
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<ComputeBackend> backend, CreateBackend("cpu"));
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<Arena> arena, backend->AllocateArena(1 << 30));
//   KVPOOL_RETURN_IF_ERROR(backend->StageRows(model, layer, k, v, writes));
//
// Thread-safety: a backend is shared by all worker threads; every method must be safe to call
// concurrently (on disjoint output memory).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/bf16.h"
#include "kernels/block_layout.h"
#include "kernels/codec_config.h"
#include "kernels/cuda/kernel_tuning.h"
#include "kernels/device_copy.h"
#include "kernels/paged_kv.h"
#include "kernels/rotation.h"
#include "kernels/row_codec.h"

namespace kvpool::server {

struct Model;

// One contiguous allocation holding the whole block pool.
class Arena {
 public:
  virtual ~Arena() = default;
  virtual uint8_t* data() const = 0;
  virtual size_t size() const = 0;
  // Whether the CPU may read and write data() directly.
  virtual bool host_accessible() const = 0;
};

// Input rows [input_row, input_row + count) of an arriving chunk go to slots
// [slot, slot + count) of one pool block: clipped and quantized into an INT2 history block
// (`history`), or kept as rotated BF16 in a sink/recent page.
// With `checksum` set, the backend also stores there the checksum (kernels/page_checksum.h) of
// the slots it wrote, computed from pool memory after the write.
struct RowWrite {
  int input_row = 0;
  int count = 0;
  uint8_t* block = nullptr;
  int slot = 0;
  bool history = false;
  uint32_t* checksum = nullptr;
};

// Demotion: rows of slots [src_slot, src_slot + count) of a BF16 page are quantized into slots
// [dst_slot, dst_slot + count) of an INT2 history block.
// [dst_slot, dst_slot + count) of an INT2 history block; `checksum` as in RowWrite, of the slots
// written in `dst`.
struct RowMove {
  const uint8_t* src = nullptr;
  int src_slot = 0;
  uint8_t* dst = nullptr;
  int dst_slot = 0;
  int count = 0;
  uint32_t* checksum = nullptr;
};

// Slots [first_slot, first_slot + count) of a pool page: an INT2 history block (`history`) or a
// BF16 page.
struct SlotRange {
  const uint8_t* page = nullptr;
  int first_slot = 0;
  int count = 0;
  bool history = false;
};

// Query rows of an attention call and their outputs: `rows` consecutive rows of the batch.
struct AttentionRows {
  const float* queries = nullptr;  // [rows][Hq][D], original basis
  float* out = nullptr;            // [rows][Hq][D], original basis
  float* lse = nullptr;            // [rows][Hq], natural log
  int rows = 0;
};

// Attention tables kept where the backend computes (device memory on a GPU backend), for callers
// that attend the same batch again and again (server/attention_plan.h): written word by word by
// PatchTables, read by Attend calls whose batch arrays point into words().
class ResidentTables {
 public:
  virtual ~ResidentTables() = default;
  virtual int32_t* words() const = 0;
  virtual size_t size() const = 0;  // in words
};

// One word of a table patch: words()[index] = value.
struct TableWord {
  uint32_t index = 0;
  int32_t value = 0;
};

// Host memory the backend's kernels read and write in place (pinned and mapped on a GPU): a
// same-host caller's shared queries and outputs. Unregistered when destroyed.
class HostRegistration {
 public:
  virtual ~HostRegistration() = default;
  // The address kernels use for host address `p` of the registered range.
  virtual void* KernelAddress(void* p) const = 0;
};

// Device memory and two events a GPU process on this host shares with the backend through CUDA
// IPC (a same-host attention channel's device I/O, server/transport/shm): the process writes its
// queries into data() and records `ready`; an Attend given the mailbox waits for `ready` on the
// device, writes the outputs into data() and records `done` for the process to wait on, so no
// data and no wait cross the host. Its handles are what the process opens.
class DeviceMailbox {
 public:
  virtual ~DeviceMailbox() = default;
  virtual uint8_t* data() const = 0;  // device memory
  virtual size_t size() const = 0;
  // Opaque CUDA IPC handles (cudaIpcMemHandle_t, cudaIpcEventHandle_t bytes).
  virtual std::string memory_handle() const = 0;
  virtual std::string ready_handle() const = 0;
  virtual std::string done_handle() const = 0;
};

// Decode attention of one model and layer: query row i attends over sequence i of `kv` (the
// paged KV description, kernels/paged_kv.h, made by the sequences' snapshots; its arrays lie in
// the host words `kv_words`, which a GPU backend copies to the device as they are). The rows of
// `io` follow each other and cover kv.num_seqs rows.
//
// The io buffers are host memory by default. A GPU backend also takes them in its device memory
// (on_device: remote attention over an NCCL channel): then `io` is one run, the caller guarantees
// the queries are complete (no write pending on any stream) and the buffers stay valid until
// Attend returns, when the outputs are complete.
//
// With `tables` set, kv's arrays already lie in those resident tables (kv_words is empty): nothing
// is copied per call, and the call is ordered after the tables' last patch.
struct AttentionCall {
  int layer = 0;
  PagedKvBatch kv;
  absl::Span<const int32_t> kv_words;
  absl::Span<const AttentionRows> io;
  bool on_device = false;
  const ResidentTables* tables = nullptr;
  // With a mailbox (on_device, io inside it): the call waits for its `ready` event on the device
  // and records `done` after the outputs; Attend returns once the work is queued.
  const DeviceMailbox* mailbox = nullptr;
};

// Device time spent in the backend's kernels since start (zero where nothing measures it).
struct BackendTimes {
  double arrival_seconds = 0;    // StageRows and DemoteRows kernels
  double attention_seconds = 0;  // Attend kernels
};

class ComputeBackend {
 public:
  virtual ~ComputeBackend() = default;

  virtual absl::string_view name() const = 0;
  virtual BackendTimes times() const { return {}; }

  // The pool's memory, `bytes` long. ResourceExhausted when it cannot be had.
  virtual absl::StatusOr<std::unique_ptr<Arena>> AllocateArena(size_t bytes) = 0;

  // Arrival: rotates the chunk's K and V rows (BF16 [n][kv_heads][D], engine basis; V as it is
  // when the model's V arrives pre-rotated) by (model, layer), rounds them to BF16 and writes
  // them where `writes` say. InvalidArgument when a rotated row overflows BF16, OutOfRange when
  // a scale or min overflows its 16-bit type. On error some writes may have happened: callers
  // write only into slots nobody reads yet and drop them on error.
  virtual absl::Status StageRows(const Model& model, int layer, absl::Span<const Bf16> k,
                                 absl::Span<const Bf16> v, absl::Span<const RowWrite> writes) = 0;

  // StageRows for rows already in GPU memory: `k` and `v` ([rows][kv_heads][D] BF16) are device
  // pointers on this backend's GPU, or a peer GPU's memory mapped into this process (CUDA IPC).
  // Unimplemented on a host backend.
  virtual absl::Status StageDeviceRows(const Model& /*model*/, int /*layer*/, const Bf16* /*k*/,
                                       const Bf16* /*v*/, int /*rows*/,
                                       absl::Span<const RowWrite> /*writes*/) {
    return absl::UnimplementedError("this backend takes K/V from host memory only");
  }
  // The CUDA device of the pool, or -1 for host memory.
  virtual int device() const { return -1; }
  // Free memory of that device and the largest arena it can hold (0 for host memory).
  virtual size_t device_free_bytes() const { return 0; }
  virtual size_t max_arena_bytes() const { return 0; }

  // Demotion of recent BF16 rows into INT2 history blocks (same error contract as StageRows).
  virtual absl::Status DemoteRows(const Model& model, absl::Span<const RowMove> moves) = 0;

  // Rows of slots [slot, slot + count) of a history block (`history`) or a BF16 page, tensor
  // `t`, decoded to fp32 [count][kv_heads][D] in the rotated basis.
  virtual absl::Status ReadRows(const Model& model, const uint8_t* block, bool history, KvTensor t,
                                int slot, int count, absl::Span<float> out) = 0;
  // The exact BF16 words of rows of a BF16 page, [count][kv_heads][D].
  virtual absl::Status ReadBf16Rows(const Model& model, const uint8_t* page, KvTensor t, int slot,
                                    int count, absl::Span<Bf16> out) = 0;
  // The checksum (kernels/page_checksum.h) of each range, computed where the pool lives, into
  // out[i] (out.size() == ranges.size()).
  virtual absl::Status ChecksumSlots(const Model& model, absl::Span<const SlotRange> ranges,
                                     absl::Span<uint32_t> out) = 0;
  // Raw bytes out of pool memory (attention-ready blocks for clients).
  virtual absl::Status CopyFromPool(void* dst, const uint8_t* src, size_t bytes) = 0;
  // Pool memory into device memory: this GPU's, or a client's allocation mapped into this
  // process (CUDA IPC: a decode worker's mirror arena). Stream-ordered on one lane; returns once
  // every copy has landed. Unimplemented on a host backend.
  virtual absl::Status CopyPoolToDevice(absl::Span<const DeviceCopy> /*copies*/) {
    return absl::UnimplementedError("this backend's pool is not in device memory");
  }

  // Decode attention of every query row of `call`: the queries are rotated by M_K, attended
  // over their sequences' sink, history and recent tokens, and the outputs un-rotated by M_V^T
  // (an empty sequence answers output 0 and LSE -inf). A backend on a device (device() >= 0)
  // takes whole requests at once, several coalesced; the host backend computes on the calling
  // thread, so callers give it one sequence's rows per call and spread the calls over their
  // workers. Device I/O (call.on_device) only where device() >= 0.
  virtual absl::Status Attend(const Model& model, const AttentionCall& call) = 0;

  // Resident attention tables of `words` zeroed words (host memory here; a GPU backend's device
  // memory). ResourceExhausted when they cannot be had.
  virtual absl::StatusOr<std::unique_ptr<ResidentTables>> AllocateTables(size_t words);
  // Applies `patch` (indices below size(), checked) to `tables`, ordered before every later
  // Attend that reads them; the caller makes no Attend on them meanwhile.
  virtual absl::Status PatchTables(ResidentTables* tables, absl::Span<const TableWord> patch);
  // Registers host memory [p, p + bytes) for kernels to use in place (on_device I/O); host
  // memory needs nothing here.
  virtual absl::StatusOr<std::unique_ptr<HostRegistration>> RegisterHostMemory(void* p,
                                                                               size_t bytes);
  // A mailbox of `bytes` device memory; Unimplemented on a host backend.
  virtual absl::StatusOr<std::unique_ptr<DeviceMailbox>> CreateDeviceMailbox(size_t /*bytes*/) {
    return absl::UnimplementedError("device mailboxes need a GPU backend");
  }

  // Device health: OK while the backend can compute. Unavailable, for good, once it cannot: a
  // sticky CUDA error (an illegal address, say) poisoned the device context, by one of its own
  // calls or by anything else in the process; from then on every compute call answers that
  // status at once. Checks the device when asked (cheap), so a supervisor can poll it.
  virtual absl::Status DeviceHealth() { return absl::OkStatus(); }
  // Compute calls answered Unavailable because the device had failed, since start.
  virtual uint64_t calls_refused() const { return 0; }
};

// The backend of `name`: "cpu", or "cuda:N" (GPU N) in a build with CUDA, whose kernels run with
// `cuda_tuning` (kvpoold's --cuda_* flags). InvalidArgument for an unknown name, Unavailable for
// a known one this build or machine cannot provide.
absl::StatusOr<std::unique_ptr<ComputeBackend>> CreateBackend(
    absl::string_view name, const cuda::KernelTuning& cuda_tuning = {});

}  // namespace kvpool::server
