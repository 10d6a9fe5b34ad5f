#include "server/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/cuda_status.h"
#include "common/status_macros.h"
#include "kernels/cuda/copy_ranges.h"
#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_codec.h"
#include "kernels/cuda/page_checksum_cuda.h"
#include "kernels/cuda/word_scatter.h"
#include "kernels/paged_kv.h"
#include "server/model_registry.h"

namespace kvpool::server {
namespace {

// Block ids are byte offsets / kBlockStride (int32 in the kernels' block tables).
constexpr int64_t kBlockStride = 16;
constexpr size_t kMaxArenaBytes = static_cast<size_t>(INT32_MAX) * kBlockStride;

class DeviceArena final : public Arena {
 public:
  DeviceArena(int device, uint8_t* data, size_t size) : device_(device), data_(data), size_(size) {}
  ~DeviceArena() override {
    cudaSetDevice(device_);
    cudaFree(data_);
  }
  uint8_t* data() const override { return data_; }
  size_t size() const override { return size_; }
  bool host_accessible() const override { return false; }

 private:
  int device_;
  uint8_t* data_;
  size_t size_;
};

// A device allocation of one lane that grows on demand (never shrinks).
//
// Growing is stream-ordered (cudaFreeAsync / cudaMallocAsync on the lane's stream): cudaFree
// waits for the whole device, and an attention channel's NCCL receive stays resident on it until
// that decode worker's next call, which may wait for this very call: a deadlock.
class DeviceBuffer {
 public:
  ~DeviceBuffer() { cudaFree(data_); }
  absl::StatusOr<uint8_t*> Reserve(size_t bytes, cudaStream_t stream) {
    if (bytes <= size_) return data_;
    const size_t want = std::max(bytes, size_ * 2);
    if (data_ != nullptr) {
      KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaFreeAsync(data_, stream), "cudaFreeAsync (staging)"));
    }
    data_ = nullptr;
    size_ = 0;
    void* p = nullptr;
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(cudaMallocAsync(&p, want, stream), "cudaMallocAsync (staging)"));
    data_ = static_cast<uint8_t*>(p);
    size_ = want;
    return data_;
  }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Page-locked host memory of a lane: an attention call's pageable host I/O (a gRPC request's
// queries, its answer) goes through it, so its copies are asynchronous DMA and no thread waits
// inside a copy for the kernels. Grown, never shrunk; buffers outgrown are kept until the lane
// goes (freeing page-locked memory may wait for the whole device).
class PinnedStaging {
 public:
  ~PinnedStaging() {
    for (void* p : retired_) cudaFreeHost(p);
    if (data_ != nullptr) cudaFreeHost(data_);
  }
  absl::StatusOr<uint8_t*> Reserve(size_t bytes) {
    if (bytes <= size_) return data_;
    const size_t want = std::max(bytes, size_ * 2);
    void* p = nullptr;
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaHostAlloc(&p, want, cudaHostAllocPortable),
                                      "cudaHostAlloc (attention staging)"));
    if (data_ != nullptr) retired_.push_back(data_);
    data_ = static_cast<uint8_t*>(p);
    size_ = want;
    return data_;
  }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::vector<void*> retired_;
};

// Whether `p` is page-locked host memory (copies from it are DMA without staging).
bool PageLocked(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeHost;
}

// A CUDA stream and the device memory one call needs; one call uses a lane at a time.
struct Lane {
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;  // kernel time of the call
  cudaEvent_t done =
      nullptr;         // blocking-sync: the end of an attention call, waited without spinning
  bool dirty = false;  // work may be in flight or the error word set (a call failed midway)
  uint32_t* error_word = nullptr;
  DeviceBuffer rows;       // BF16 rows in flight (arrival, demotion, reads)
  DeviceBuffer tables;     // int32 row offsets / first tokens / block tables; attention io
  DeviceBuffer workspace;  // attention workspace
  DeviceBuffer bf16_copy;  // BF16 copies of sequences whose history the kernel cannot read
  PinnedStaging staging;   // attention host I/O from pageable memory
  ~Lane() {
    if (start != nullptr) cudaEventDestroy(start);
    if (stop != nullptr) cudaEventDestroy(stop);
    if (done != nullptr) cudaEventDestroy(done);
    cudaFree(error_word);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

// Host-side image of a SequenceBatch: runs of rows, each at positions first_token.. of its own
// block table row (`stride` entries; Add makes single-block runs).
struct RunTable {
  std::vector<int32_t> row_offsets{0};
  std::vector<int32_t> first_token;
  std::vector<int32_t> block;
  int stride = 1;
  void Add(int rows, int slot, int32_t block_id) {
    row_offsets.push_back(row_offsets.back() + rows);
    first_token.push_back(slot);
    block.push_back(block_id);
  }
  int runs() const { return static_cast<int>(first_token.size()); }
  int rows() const { return row_offsets.back(); }
};

size_t AlignUp(size_t bytes) { return (bytes + 15) / 16 * 16; }

// CUDA errors after which the context is unusable: every later call in the process fails too,
// until the process exits (the CUDA runtime documents each so).
bool IsStickyCudaError(cudaError_t e) {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    case cudaErrorExternalDevice:
    case cudaErrorMpsClientTerminated:
#if CUDART_VERSION >= 12080
    case cudaErrorContained:
    case cudaErrorTensorMemoryLeak:
#endif
      return true;
    default:
      return false;
  }
}

// Appends `v` to the host staging vector `bytes` at a 16-byte aligned offset; returns it.
template <typename T>
size_t Append(std::vector<uint8_t>* bytes, const T* v, size_t n) {
  const size_t at = AlignUp(bytes->size());
  bytes->resize(at + n * sizeof(T));
  if (n > 0) std::memcpy(bytes->data() + at, v, n * sizeof(T));
  return at;
}

// Device memory and two interprocess events exported through CUDA IPC (DeviceMailbox). Freed
// when destroyed: never reused for another caller, who could still hold the old mapping.
class CudaMailbox final : public DeviceMailbox {
 public:
  ~CudaMailbox() override {
    if (ready_ != nullptr) cudaEventDestroy(ready_);
    if (done_ != nullptr) cudaEventDestroy(done_);
    if (data_ != nullptr) cudaFree(data_);
  }
  uint8_t* data() const override { return data_; }
  size_t size() const override { return size_; }
  std::string memory_handle() const override { return memory_handle_; }
  std::string ready_handle() const override { return ready_handle_; }
  std::string done_handle() const override { return done_handle_; }
  cudaEvent_t ready() const { return ready_; }
  cudaEvent_t done() const { return done_; }

  static absl::StatusOr<std::unique_ptr<CudaMailbox>> Create(size_t bytes) {
    auto m = std::unique_ptr<CudaMailbox>(new CudaMailbox());
    void* p = nullptr;
    // cudaMalloc, not the stream-ordered pool: only such memory can be exported this way.
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&p, bytes), "cudaMalloc (mailbox)"));
    m->data_ = static_cast<uint8_t*>(p);
    m->size_ = bytes;
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaMemset(p, 0, bytes), "cudaMemset (mailbox)"));
    cudaIpcMemHandle_t mh;
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaIpcGetMemHandle(&mh, p), "cudaIpcGetMemHandle"));
    m->memory_handle_.assign(reinterpret_cast<const char*>(&mh), sizeof(mh));
    for (auto [event, handle] :
         {std::pair{&m->ready_, &m->ready_handle_}, std::pair{&m->done_, &m->done_handle_}}) {
      KVPOOL_RETURN_IF_ERROR(CudaStatus(
          cudaEventCreateWithFlags(event, cudaEventDisableTiming | cudaEventInterprocess),
          "interprocess event"));
      cudaIpcEventHandle_t eh;
      KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaIpcGetEventHandle(&eh, *event), "event handle"));
      handle->assign(reinterpret_cast<const char*>(&eh), sizeof(eh));
    }
    return m;
  }

 private:
  CudaMailbox() = default;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  cudaEvent_t ready_ = nullptr, done_ = nullptr;
  std::string memory_handle_, ready_handle_, done_handle_;
};

class CudaBackend final : public ComputeBackend {
 public:
  CudaBackend(int device, const cuda::KernelTuning& tuning)
      : device_(device), name_(absl::StrCat("cuda:", device)), tuning_(tuning) {}

  ~CudaBackend() override {
    cudaSetDevice(device_);
    lanes_.clear();
    for (auto& [key, ptr] : rotations_) cudaFree(ptr);
    if (cudaStream_t probe = probe_.load(); probe != nullptr) cudaStreamDestroy(probe);
  }

  absl::string_view name() const override { return name_; }

  // The compute calls: refused at once once the device has failed; a call that fails checks
  // whether its error poisoned the device (then it answers Unavailable too).
  absl::Status StageRows(const Model& m, int layer, absl::Span<const Bf16> k,
                         absl::Span<const Bf16> v, absl::Span<const RowWrite> writes) override {
    return Guarded([&] { return StageRowsBody(m, layer, k, v, writes); });
  }
  absl::Status StageDeviceRows(const Model& m, int layer, const Bf16* k, const Bf16* v, int rows,
                               absl::Span<const RowWrite> writes) override {
    return Guarded([&] { return StageDeviceRowsBody(m, layer, k, v, rows, writes); });
  }
  absl::Status DemoteRows(const Model& m, absl::Span<const RowMove> moves) override {
    return Guarded([&] { return DemoteRowsBody(m, moves); });
  }
  absl::Status ReadRows(const Model& m, const uint8_t* block, bool history, KvTensor t, int slot,
                        int count, absl::Span<float> out) override {
    return Guarded([&] { return ReadRowsBody(m, block, history, t, slot, count, out); });
  }
  absl::Status ReadBf16Rows(const Model& m, const uint8_t* page, KvTensor t, int slot, int count,
                            absl::Span<Bf16> out) override {
    return Guarded([&] { return ReadBf16RowsBody(m, page, t, slot, count, out); });
  }
  absl::Status ChecksumSlots(const Model& m, absl::Span<const SlotRange> ranges,
                             absl::Span<uint32_t> out) override {
    return Guarded([&] { return ChecksumSlotsBody(m, ranges, out); });
  }
  absl::Status CopyFromPool(void* dst, const uint8_t* src, size_t bytes) override {
    return Guarded([&] { return CopyFromPoolBody(dst, src, bytes); });
  }
  absl::Status CopyPoolToDevice(absl::Span<const DeviceCopy> copies) override {
    return Guarded([&] { return CopyPoolToDeviceBody(copies); });
  }
  absl::Status Attend(const Model& m, const AttentionCall& call) override {
    return Guarded([&] { return AttendBody(m, call); });
  }
  absl::StatusOr<std::unique_ptr<ResidentTables>> AllocateTables(size_t words) override {
    absl::StatusOr<std::unique_ptr<ResidentTables>> t;
    absl::Status s = Guarded([&] {
      t = AllocateTablesBody(words);
      return t.status();
    });
    if (!s.ok()) return s;
    return t;
  }
  absl::Status PatchTables(ResidentTables* tables, absl::Span<const TableWord> patch) override {
    return Guarded([&] { return PatchTablesBody(tables, patch); });
  }
  absl::StatusOr<std::unique_ptr<HostRegistration>> RegisterHostMemory(void* p,
                                                                       size_t bytes) override;
  absl::StatusOr<std::unique_ptr<DeviceMailbox>> CreateDeviceMailbox(size_t bytes) override;

  absl::Status DeviceHealth() override {
    return CheckSticky() ? FailureStatus() : absl::OkStatus();
  }
  uint64_t calls_refused() const override { return refused_.load(std::memory_order_relaxed); }

  BackendTimes times() const override {
    absl::MutexLock lock(&mu_);
    return times_;
  }

  absl::StatusOr<std::unique_ptr<Arena>> AllocateArena(size_t bytes) override {
    if (bytes == 0) return absl::InvalidArgumentError("arena size must be > 0");
    if (bytes > kMaxArenaBytes) {
      return absl::InvalidArgumentError(absl::StrCat("a GPU pool holds at most ", kMaxArenaBytes,
                                                     " bytes (32 GiB), asked for ", bytes));
    }
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
    void* p = nullptr;
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&p, bytes), "cudaMalloc (pool arena)"));
    // Fresh pages are never read before written, but a defined arena keeps tools quiet.
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaMemset(p, 0, bytes), "cudaMemset (pool arena)"));
    if (arena_.load() != nullptr) {
      cudaFree(p);
      return absl::FailedPreconditionError("the CUDA backend holds one pool arena");
    }
    // Later allocations are stream-ordered (see DeviceBuffer) from the device's default pool;
    // keep what it frees instead of returning it to the driver at every synchronisation.
    cudaMemPool_t mem_pool = nullptr;
    uint64_t keep = UINT64_MAX;
    if (cudaDeviceGetDefaultMemPool(&mem_pool, device_) != cudaSuccess ||
        cudaMemPoolSetAttribute(mem_pool, cudaMemPoolAttrReleaseThreshold, &keep) != cudaSuccess) {
      (void)cudaGetLastError();  // only a cost, not an error
    }
    // An idle stream whose query reports a poisoned context (DeviceHealth).
    cudaStream_t probe = nullptr;
    if (cudaStreamCreateWithFlags(&probe, cudaStreamNonBlocking) != cudaSuccess) {
      cudaFree(p);
      return CudaStatus(cudaGetLastError(), "cudaStreamCreate (device health probe)");
    }
    probe_.store(probe);
    arena_bytes_.store(bytes);
    arena_.store(static_cast<uint8_t*>(p));
    return std::unique_ptr<Arena>(new DeviceArena(device_, static_cast<uint8_t*>(p), bytes));
  }

  absl::Status StageRowsBody(const Model& m, int layer, absl::Span<const Bf16> k,
                             absl::Span<const Bf16> v, absl::Span<const RowWrite> writes) {
    if (k.size() != v.size()) return absl::InternalError("StageRows: K and V sizes differ");
    KVPOOL_ASSIGN_OR_RETURN(LaneLease lane, AcquireLane());
    const size_t bytes = k.size() * sizeof(Bf16);
    KVPOOL_ASSIGN_OR_RETURN(uint8_t * rows, lane->rows.Reserve(2 * bytes, lane->stream));
    KVPOOL_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(rows, k.data(), bytes, cudaMemcpyHostToDevice, lane->stream), "H2D K"));
    KVPOOL_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(rows + bytes, v.data(), bytes, cudaMemcpyHostToDevice, lane->stream),
        "H2D V"));
    return StageOnLane(*lane, m, layer, reinterpret_cast<const Bf16*>(rows),
                       reinterpret_cast<const Bf16*>(rows + bytes), writes);
  }

  absl::Status StageDeviceRowsBody(const Model& m, int layer, const Bf16* k, const Bf16* v,
                                   int rows, absl::Span<const RowWrite> writes) {
    if (k == nullptr || v == nullptr || rows < 0) {
      return absl::InternalError("StageDeviceRows: null rows");
    }
    KVPOOL_ASSIGN_OR_RETURN(LaneLease lane, AcquireLane());
    return StageOnLane(*lane, m, layer, k, v, writes);
  }

  int device() const override { return device_; }

  size_t device_free_bytes() const override {
    size_t free_bytes = 0, total = 0;
    if (cudaSetDevice(device_) != cudaSuccess ||
        cudaMemGetInfo(&free_bytes, &total) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return free_bytes;
  }
  size_t max_arena_bytes() const override { return kMaxArenaBytes; }

  absl::Status DemoteRowsBody(const Model& m, absl::Span<const RowMove> moves) {
    if (moves.empty()) return absl::OkStatus();
    RunTable src, dst;
    for (const RowMove& mv : moves) {
      KVPOOL_ASSIGN_OR_RETURN(int32_t s, BlockId(mv.src));
      KVPOOL_ASSIGN_OR_RETURN(int32_t d, BlockId(mv.dst));
      src.Add(mv.count, mv.src_slot, s);
      dst.Add(mv.count, mv.dst_slot, d);
    }
    KVPOOL_ASSIGN_OR_RETURN(LaneLease lane, AcquireLane());
    // Move i is run i of `dst` (single-block runs): its page checksum accumulates in d_sums[i].
    const size_t num_sums = WantsChecksums(moves) ? moves.size() : 0;
    uint32_t* d_sums = nullptr;
    const RunTable* tables[] = {&src, &dst};
    KVPOOL_ASSIGN_OR_RETURN(std::vector<cuda::SequenceBatch> batch,
                            UploadRuns(*lane, tables, num_sums, &d_sums));
    // Every layer's moves, K and V, straight from the BF16 pages, with the checksums of the
    // slots written: one launch.
    const cuda::PagedRows from = PagesOf(m, batch[0]);
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(lane->start, lane->stream), "event"));
    KVPOOL_RETURN_IF_ERROR(cuda::DemoteToHistory(m.codec.quant, View(m, /*history=*/true), batch[1],
                                                 from, lane->error_word, lane->stream,
                                                 tuning_.arrival, d_sums));
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(lane->stop, lane->stream), "event"));
    KVPOOL_RETURN_IF_ERROR(CopyChecksums(*lane, d_sums, moves));
    KVPOOL_RETURN_IF_ERROR(Finish(*lane, "demotion"));
    AddTime(*lane, &BackendTimes::arrival_seconds);
    return absl::OkStatus();
  }

  // Reads (ReadKv, not a hot path) must equal the CPU backend's fp32 values exactly, which the
  // BF16 dequantization kernel would round: copy the block and decode it with the CPU codec.
  absl::Status ReadRowsBody(const Model& m, const uint8_t* block, bool history, KvTensor t,
                            int slot, int count, absl::Span<float> out) {
    const BlockLayout& layout = history ? m.block_layout : m.bf16_layout;
    std::vector<uint8_t> bytes(layout.block_bytes());
    KVPOOL_RETURN_IF_ERROR(CopyFromPoolBody(bytes.data(), block, bytes.size()));
    (history ? m.row_codec : m.bf16_codec)
        .DecodeFromBlock(t, layout, bytes.data(), slot, count, out);
    return absl::OkStatus();
  }

  absl::Status ReadBf16RowsBody(const Model& m, const uint8_t* page, KvTensor t, int slot,
                                int count, absl::Span<Bf16> out) {
    return ReadWords(m, page, /*history=*/false, t, slot, count, out);
  }

  absl::Status ChecksumSlotsBody(const Model& m, absl::Span<const SlotRange> ranges,
                                 absl::Span<uint32_t> out) {
    if (out.size() != ranges.size()) return absl::InternalError("ChecksumSlots: sizes differ");
    if (ranges.empty()) return absl::OkStatus();
    KVPOOL_ASSIGN_OR_RETURN(LaneLease lane, AcquireLane());
    KVPOOL_ASSIGN_OR_RETURN(uint32_t * d_sums, EnqueueChecksums(*lane, m, ranges));
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(out.data(), d_sums, out.size() * sizeof(uint32_t),
                                   cudaMemcpyDeviceToHost, lane->stream),
                   "D2H checksums"));
    return Finish(*lane, "checksums");
  }

  // One kernel launch for every range, on the lane's stream (a fetch is many small blocks and
  // rows, and a copy call per block cost more than its bytes take to move; the destination may
  // be a peer's allocation mapped through CUDA IPC); waits for that stream only. Empty ranges
  // are the kernel's to skip.
  absl::Status CopyPoolToDeviceBody(absl::Span<const DeviceCopy> copies) {
    if (copies.empty()) return absl::OkStatus();
    KVPOOL_ASSIGN_OR_RETURN(LaneLease lane, AcquireLane());
    const size_t bytes = copies.size() * sizeof(DeviceCopy);
    KVPOOL_ASSIGN_OR_RETURN(uint8_t * host, lane->staging.Reserve(bytes));
    std::memcpy(host, copies.data(), bytes);
    KVPOOL_ASSIGN_OR_RETURN(uint8_t * dev, lane->tables.Reserve(bytes, lane->stream));
    KVPOOL_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, lane->stream), "copy ranges"));
    KVPOOL_RETURN_IF_ERROR(cuda::CopyRanges(reinterpret_cast<const DeviceCopy*>(dev),
                                            static_cast<int>(copies.size()), lane->stream));
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(lane->stream), "D2D pool bytes"));
    lane->dirty = false;
    return absl::OkStatus();
  }

  absl::Status CopyFromPoolBody(void* dst, const uint8_t* src, size_t bytes) {
    KVPOOL_ASSIGN_OR_RETURN(LaneLease lane, AcquireLane());  // on a stream: see DeviceBuffer
    KVPOOL_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, lane->stream), "D2H pool bytes"));
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(lane->stream), "D2H pool bytes"));
    lane->dirty = false;
    return absl::OkStatus();
  }

  // Resident tables: device words on a stream of their own, an event after their last patch that
  // each Attend reading them waits for on its lane, and one after the last Attend that read them
  // that the next patch (or the free) waits for: an Attend that returned before its kernels ended
  // (a mailbox call) is never overwritten under it. No host waits either way.
  class DeviceTables final : public ResidentTables {
   public:
    ~DeviceTables() override {
      if (read_ != nullptr && stream_ != nullptr) cudaStreamWaitEvent(stream_, read_, 0);
      if (words_ != nullptr) cudaFreeAsync(words_, stream_);
      if (patch_ != nullptr) cudaFreeAsync(patch_, stream_);
      if (ready_ != nullptr) cudaEventDestroy(ready_);
      if (read_ != nullptr) cudaEventDestroy(read_);
      if (stream_ != nullptr) cudaStreamDestroy(stream_);
    }
    int32_t* words() const override { return words_; }
    size_t size() const override { return size_; }

    cudaStream_t stream_ = nullptr;
    cudaEvent_t ready_ = nullptr;
    cudaEvent_t read_ = nullptr;
    int32_t* words_ = nullptr;
    size_t size_ = 0;
    cuda::WordWrite* patch_ = nullptr;  // device copy of the last patch
    size_t patch_capacity_ = 0;
  };

  absl::StatusOr<std::unique_ptr<ResidentTables>> AllocateTablesBody(size_t words) {
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
    auto t = std::make_unique<DeviceTables>();
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(cudaStreamCreateWithFlags(&t->stream_, cudaStreamNonBlocking), "stream"));
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(cudaEventCreateWithFlags(&t->ready_, cudaEventDisableTiming), "event"));
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(cudaEventCreateWithFlags(&t->read_, cudaEventDisableTiming), "event"));
    void* p = nullptr;
    const size_t bytes = std::max<size_t>(words, 1) * sizeof(int32_t);
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(cudaMallocAsync(&p, bytes, t->stream_), "cudaMallocAsync (attention tables)"));
    t->words_ = static_cast<int32_t*>(p);
    t->size_ = words;
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(p, 0, bytes, t->stream_), "memset"));
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(t->ready_, t->stream_), "event"));
    return std::unique_ptr<ResidentTables>(std::move(t));
  }

  absl::Status PatchTablesBody(ResidentTables* tables, absl::Span<const TableWord> patch) {
    auto* t = static_cast<DeviceTables*>(tables);
    for (const TableWord& w : patch) {
      if (w.index >= t->size_) return absl::InternalError("table patch out of range");
    }
    if (patch.empty()) return absl::OkStatus();
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(cudaStreamWaitEvent(t->stream_, t->read_, 0), "wait for readers"));
    if (patch.size() > t->patch_capacity_) {
      if (t->patch_ != nullptr) {
        KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaFreeAsync(t->patch_, t->stream_), "cudaFreeAsync"));
        t->patch_ = nullptr;
      }
      const size_t want = std::max<size_t>(patch.size(), 2 * t->patch_capacity_);
      void* p = nullptr;
      KVPOOL_RETURN_IF_ERROR(CudaStatus(
          cudaMallocAsync(&p, want * sizeof(cuda::WordWrite), t->stream_), "cudaMallocAsync"));
      t->patch_ = static_cast<cuda::WordWrite*>(p);
      t->patch_capacity_ = want;
    }
    static_assert(sizeof(TableWord) == sizeof(cuda::WordWrite));
    // From pageable memory: staged by the driver before the call returns, so `patch` may go.
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(t->patch_, patch.data(), patch.size() * sizeof(TableWord),
                                   cudaMemcpyHostToDevice, t->stream_),
                   "H2D table patch"));
    KVPOOL_RETURN_IF_ERROR(
        cuda::ScatterWords(t->words_, t->patch_, static_cast<int>(patch.size()), t->stream_));
    return CudaStatus(cudaEventRecord(t->ready_, t->stream_), "event");
  }

  absl::Status AttendBody(const Model& m, const AttentionCall& call) {
    const PagedKvBatch& kv = call.kv;
    const int n = kv.num_seqs;
    if (n == 0) return absl::OkStatus();
    const size_t per_row = static_cast<size_t>(m.q_heads) * m.head_dim;
    int rows = 0;
    for (const AttentionRows& io : call.io) {
      if (io.rows < 0 || io.queries == nullptr || io.out == nullptr || io.lse == nullptr) {
        return absl::InternalError("Attend: a run of query rows has no buffers");
      }
      rows += io.rows;
    }
    // Device I/O (an NCCL attention channel) is one run: the kernel reads the queries and
    // writes the outputs where they are, with no copy through the host.
    const bool on_device = call.on_device;
    if (rows != n || (on_device && call.io.size() != 1)) {
      return absl::InternalError("Attend: query/output rows do not match the batch");
    }
    KVPOOL_ASSIGN_OR_RETURN(const float* rot_k, DeviceRotation(m, call.layer, KvTensor::kKey));
    KVPOOL_ASSIGN_OR_RETURN(const float* rot_v, DeviceRotation(m, call.layer, KvTensor::kValue));
    KVPOOL_ASSIGN_OR_RETURN(LaneLease lane, AcquireLane());

    // The kernel reads INT2 histories with one group per row; other models' sequences (INT4,
    // smaller groups, BF16 bypass) are first copied to BF16 blocks on the device (the
    // dequantization and bypass kernels) and attended as one BF16 tier (Bf16Copy).
    const bool int2_kernel = m.block_layout.bits == 2 && m.block_layout.group_size == m.head_dim;
    std::optional<Bf16Copy> copy;
    if (!int2_kernel) {
      KVPOOL_ASSIGN_OR_RETURN(copy, PlanBf16Copy(*lane, m, kv));
    }
    // Device layout of the lane's table buffer: the batch's arrays as they are, the copy's plan,
    // then (host I/O) the queries, the outputs and the LSEs.
    const auto* resident = static_cast<const DeviceTables*>(call.tables);
    if (resident != nullptr && (copy || !call.kv_words.empty())) {
      return absl::InternalError("Attend: resident tables are for the INT2 kernel's models");
    }
    const size_t words_bytes = call.kv_words.size() * sizeof(int32_t);
    const size_t plan_at = AlignUp(words_bytes);
    const size_t plan_bytes = copy ? copy->plan.size() : 0;
    const size_t q_at = AlignUp(plan_at + plan_bytes);
    const size_t out_at = AlignUp(q_at + (on_device ? 0 : n * per_row * sizeof(float)));
    const size_t lse_at = AlignUp(out_at + (on_device ? 0 : n * per_row * sizeof(float)));
    const size_t total = lse_at + (on_device ? 0 : static_cast<size_t>(n) * m.q_heads * 4);
    KVPOOL_ASSIGN_OR_RETURN(uint8_t * dev,
                            lane->tables.Reserve(std::max<size_t>(total, 16), lane->stream));
    if (resident != nullptr) {
      KVPOOL_RETURN_IF_ERROR(
          CudaStatus(cudaStreamWaitEvent(lane->stream, resident->ready_, 0), "wait tables"));
    } else {
      // From pageable memory: the driver stages it before returning (no device-wide wait, which
      // pinned allocations can cause; see DeviceBuffer).
      KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(dev, call.kv_words.data(), words_bytes,
                                                        cudaMemcpyHostToDevice, lane->stream),
                                        "H2D block tables"));
    }
    if (copy) {
      KVPOOL_RETURN_IF_ERROR(
          CudaStatus(cudaMemcpyAsync(dev + plan_at, copy->plan.data(), plan_bytes,
                                     cudaMemcpyHostToDevice, lane->stream),
                     "H2D copy plan"));
    }
    // Host I/O from pageable memory goes through the lane's page-locked staging.
    const size_t rows_bytes = n * per_row * sizeof(float);
    uint8_t* stage = nullptr;
    if (!on_device) {
      bool locked = true;
      for (const AttentionRows& r : call.io) {
        locked = locked && (r.rows == 0 || (PageLocked(r.queries) && PageLocked(r.out)));
      }
      if (!locked) {
        KVPOOL_ASSIGN_OR_RETURN(
            stage, lane->staging.Reserve(2 * rows_bytes + n * m.q_heads * sizeof(float)));
      }
    }
    size_t row = 0;
    for (const AttentionRows& io : call.io) {
      if (on_device || io.rows == 0) continue;
      const size_t bytes = io.rows * per_row * sizeof(float);
      if (stage != nullptr) {
        std::memcpy(stage + row * per_row * sizeof(float), io.queries, bytes);
      } else {
        KVPOOL_RETURN_IF_ERROR(
            CudaStatus(cudaMemcpyAsync(dev + q_at + row * per_row * sizeof(float), io.queries,
                                       bytes, cudaMemcpyHostToDevice, lane->stream),
                       "H2D queries"));
      }
      row += io.rows;
    }
    if (stage != nullptr) {
      KVPOOL_RETURN_IF_ERROR(CudaStatus(
          cudaMemcpyAsync(dev + q_at, stage, rows_bytes, cudaMemcpyHostToDevice, lane->stream),
          "H2D queries"));
    }
    PagedKvBatch batch = resident != nullptr ? kv
                                             : RebaseArrays(kv, call.kv_words.data(),
                                                            reinterpret_cast<int32_t*>(dev));
    cuda::DecodeAttentionShape shape;
    shape.cfg = m.codec.quant;
    shape.q_heads = m.q_heads;
    shape.tuning = tuning_.attention;
    if (copy) {
      KVPOOL_ASSIGN_OR_RETURN(batch, CopyToBf16Blocks(*lane, m, kv, batch, *copy, dev + plan_at));
      shape.cfg = copy->cfg;
    }
    KVPOOL_ASSIGN_OR_RETURN(size_t ws_bytes, cuda::DecodeAttentionWorkspaceBytes(shape, batch));
    KVPOOL_ASSIGN_OR_RETURN(uint8_t * ws,
                            lane->workspace.Reserve(std::max<size_t>(ws_bytes, 16), lane->stream));
    cuda::DecodeIo io;
    const AttentionRows& first = call.io.front();
    io.queries = on_device ? first.queries : reinterpret_cast<const float*>(dev + q_at);
    io.rotation_k = rot_k;
    io.rotation_v = rot_v;
    io.out = on_device ? first.out : reinterpret_cast<float*>(dev + out_at);
    io.lse = on_device ? first.lse : reinterpret_cast<float*>(dev + lse_at);
    const auto* mailbox = static_cast<const CudaMailbox*>(call.mailbox);
    if (mailbox != nullptr) {
      if (!on_device || copy) return absl::InternalError("Attend: a mailbox needs device I/O");
      // The caller's queries are written once its `ready` fires: wait for it on the device.
      KVPOOL_RETURN_IF_ERROR(
          CudaStatus(cudaStreamWaitEvent(lane->stream, mailbox->ready(), 0), "wait ready"));
    }
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(lane->start, lane->stream), "event"));
    KVPOOL_RETURN_IF_ERROR(cuda::DecodeAttention(shape, batch, io, ws, ws_bytes, lane->stream));
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(lane->stop, lane->stream), "event"));
    if (resident != nullptr) {
      KVPOOL_RETURN_IF_ERROR(
          CudaStatus(cudaEventRecord(resident->read_, lane->stream), "record tables read"));
    }
    if (mailbox != nullptr) {
      // Answered once queued: the caller waits for `done` on its own stream. Work still in
      // flight on the lane's stream orders the lane's next use after it.
      KVPOOL_RETURN_IF_ERROR(
          CudaStatus(cudaEventRecord(mailbox->done(), lane->stream), "record done"));
      lane->dirty = false;
      return absl::OkStatus();
    }
    // Host I/O: each run's outputs straight into its buffers, or all of them into the staging.
    uint8_t* const stage_out = stage == nullptr ? nullptr : stage + rows_bytes;
    if (stage_out != nullptr) {
      KVPOOL_RETURN_IF_ERROR(CudaStatus(
          cudaMemcpyAsync(stage_out, io.out, rows_bytes, cudaMemcpyDeviceToHost, lane->stream),
          "D2H attention output"));
      KVPOOL_RETURN_IF_ERROR(
          CudaStatus(cudaMemcpyAsync(stage_out + rows_bytes, io.lse, n * m.q_heads * sizeof(float),
                                     cudaMemcpyDeviceToHost, lane->stream),
                     "D2H attention LSE"));
    }
    row = 0;
    for (const AttentionRows& r : call.io) {
      if (on_device || r.rows == 0 || stage_out != nullptr) continue;
      KVPOOL_RETURN_IF_ERROR(CudaStatus(
          cudaMemcpyAsync(r.out, io.out + row * per_row, r.rows * per_row * sizeof(float),
                          cudaMemcpyDeviceToHost, lane->stream),
          "D2H attention output"));
      KVPOOL_RETURN_IF_ERROR(CudaStatus(
          cudaMemcpyAsync(r.lse, io.lse + row * m.q_heads, r.rows * m.q_heads * sizeof(float),
                          cudaMemcpyDeviceToHost, lane->stream),
          "D2H attention LSE"));
      row += r.rows;
    }
    if (copy) {
      KVPOOL_RETURN_IF_ERROR(Finish(*lane, "attention"));  // the copy kernels' data checks
    } else {
      KVPOOL_RETURN_IF_ERROR(WaitDone(*lane, "attention"));
    }
    if (stage_out != nullptr) {
      row = 0;
      for (const AttentionRows& r : call.io) {
        std::memcpy(r.out, stage_out + row * per_row * sizeof(float),
                    r.rows * per_row * sizeof(float));
        std::memcpy(r.lse, stage_out + rows_bytes + row * m.q_heads * sizeof(float),
                    r.rows * m.q_heads * sizeof(float));
        row += r.rows;
      }
    }
    AddTime(*lane, &BackendTimes::attention_seconds);
    return absl::OkStatus();
  }

  // Waits for the lane's work so far without a device or stream synchronisation: polls an event
  // for about twice as long as the last wait took (a decode step's kernels take about as long
  // each time; a blocked thread wakes tens of microseconds late), at least 50 us and at most
  // 2 ms, then blocks on it.
  absl::Status WaitDone(Lane& lane, const char* what) {
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(lane.done, lane.stream), what));
    const auto start = std::chrono::steady_clock::now();
    const auto spin =
        std::clamp(std::chrono::nanoseconds(2 * last_wait_ns_.load(std::memory_order_relaxed)),
                   kMinSpin, kMaxSpin);
    while (true) {
      const cudaError_t e = cudaEventQuery(lane.done);
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady) return CudaStatus(e, what);
      if (std::chrono::steady_clock::now() >= start + spin) {
        KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(lane.done), what));
        break;
      }
    }
    last_wait_ns_.store(std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now() - start)
                            .count(),
                        std::memory_order_relaxed);
    lane.dirty = false;
    return absl::OkStatus();
  }
  static constexpr std::chrono::nanoseconds kMinSpin = std::chrono::microseconds(50);
  static constexpr std::chrono::nanoseconds kMaxSpin = std::chrono::milliseconds(2);
  std::atomic<int64_t> last_wait_ns_{0};

 private:
  // Runs a compute call `body` (see the public wrappers).
  template <typename Fn>
  absl::Status Guarded(Fn&& body) {
    if (failed_.load(std::memory_order_acquire)) {
      refused_.fetch_add(1, std::memory_order_relaxed);
      return FailureStatus();
    }
    absl::Status s = body();
    if (!s.ok() && CheckSticky()) return FailureStatus();
    return s;
  }

  // Whether the device context is poisoned. Latches the first sticky error seen: the calling
  // thread's last error, else a query of the idle probe stream (which answers a sticky error
  // whichever call in the process caused it).
  bool CheckSticky() {
    if (failed_.load(std::memory_order_acquire)) return true;
    cudaError_t e = cudaGetLastError();
    if (!IsStickyCudaError(e)) {
      cudaStream_t probe = probe_.load();
      if (probe == nullptr) return false;
      e = cudaSetDevice(device_);
      if (e == cudaSuccess) e = cudaStreamQuery(probe);
      if (!IsStickyCudaError(e)) {
        if (e != cudaSuccess) (void)cudaGetLastError();
        return false;
      }
    }
    {
      absl::MutexLock lock(&mu_);
      if (failure_.empty())
        failure_ = absl::StrCat(cudaGetErrorName(e), ": ", cudaGetErrorString(e));
    }
    failed_.store(true, std::memory_order_release);
    return true;
  }

  absl::Status FailureStatus() const {
    absl::MutexLock lock(&mu_);
    return absl::UnavailableError(
        absl::StrCat("device ", name_, " has failed and cannot compute (", failure_,
                     "); kvpoold exits so that its supervisor restarts it"));
  }

  // A lane taken from the free list; returns it when destroyed.
  class LaneLease {
   public:
    LaneLease(CudaBackend* owner, std::unique_ptr<Lane> lane)
        : owner_(owner), lane_(std::move(lane)) {}
    LaneLease(LaneLease&&) = default;
    ~LaneLease() {
      if (lane_ != nullptr) owner_->ReturnLane(std::move(lane_));
    }
    Lane* operator->() const { return lane_.get(); }
    Lane& operator*() const { return *lane_; }

   private:
    CudaBackend* owner_;
    std::unique_ptr<Lane> lane_;
  };

  absl::StatusOr<LaneLease> AcquireLane() {
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
    {
      absl::MutexLock lock(&mu_);
      if (!lanes_.empty()) {
        std::unique_ptr<Lane> lane = std::move(lanes_.back());
        lanes_.pop_back();
        lane->dirty = true;
        return LaneLease(this, std::move(lane));
      }
    }
    auto lane = std::make_unique<Lane>();
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(cudaStreamCreateWithFlags(&lane->stream, cudaStreamNonBlocking), "stream"));
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaEventCreate(&lane->start), "event"));
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaEventCreate(&lane->stop), "event"));
    KVPOOL_RETURN_IF_ERROR(CudaStatus(
        cudaEventCreateWithFlags(&lane->done, cudaEventBlockingSync | cudaEventDisableTiming),
        "event"));
    // Stream-ordered, like every allocation after start (see DeviceBuffer).
    void* word = nullptr;
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(cudaMallocAsync(&word, sizeof(uint32_t), lane->stream), "error word"));
    lane->error_word = static_cast<uint32_t*>(word);
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(cudaMemsetAsync(lane->error_word, 0, sizeof(uint32_t), lane->stream), "memset"));
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(lane->stream), "new lane"));
    lane->dirty = true;
    return LaneLease(this, std::move(lane));
  }

  void ReturnLane(std::unique_ptr<Lane> lane) {
    if (lane->dirty) {
      // A call that failed midway: drain its launches and clear their error bits.
      cudaStreamSynchronize(lane->stream);
      cudaMemsetAsync(lane->error_word, 0, sizeof(uint32_t), lane->stream);
      cudaStreamSynchronize(lane->stream);
      (void)cudaGetLastError();
      lane->dirty = false;
    }
    absl::MutexLock lock(&mu_);
    lanes_.push_back(std::move(lane));
  }

  absl::StatusOr<int32_t> BlockId(const uint8_t* block) const {
    const uint8_t* base = arena_.load(std::memory_order_relaxed);
    if (base == nullptr || block < base ||
        block >= base + arena_bytes_.load(std::memory_order_relaxed) ||
        (block - base) % kBlockStride != 0) {
      return absl::InternalError("a block pointer is not a 16-byte aligned pool address");
    }
    return static_cast<int32_t>((block - base) / kBlockStride);
  }

  PagedKvView View(const Model& m, bool history) const {
    PagedKvView v;
    v.pool = arena_.load();
    v.layout = history ? m.block_layout : m.bf16_layout;
    v.scale_dtype = m.codec.quant.scale_dtype;
    v.num_blocks = static_cast<int64_t>(arena_bytes_ / kBlockStride);
    v.block_stride = kBlockStride;
    return v;
  }

  // The BF16 pages of the rows that `batch` names (block tables and first tokens on the device).
  cuda::PagedRows PagesOf(const Model& m, const cuda::SequenceBatch& batch) const {
    cuda::PagedRows pages;
    pages.kv = View(m, /*history=*/false);
    pages.first_token = batch.first_token;
    pages.block_tables = batch.block_tables;
    pages.block_table_stride = batch.block_table_stride;
    return pages;
  }

  // The device copy of M for (model codec, layer, tensor); nullptr for the identity.
  absl::StatusOr<const float*> DeviceRotation(const Model& m, int layer, KvTensor t) {
    const RotationSet& r = m.codec.rotations;
    if (r.kind() == RotationKind::kIdentity) return nullptr;
    if (layer < 0 || layer >= r.num_layers()) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
    }
    const auto key = std::make_tuple(m.version_hex, layer, static_cast<int>(t));
    {
      absl::MutexLock lock(&mu_);
      auto it = rotations_.find(key);
      if (it != rotations_.end()) return it->second;
    }
    // Uploaded on a lane's stream (see DeviceBuffer), outside mu_ (lanes take it).
    const std::vector<float> host = r.Matrix(layer, t);
    KVPOOL_ASSIGN_OR_RETURN(LaneLease lane, AcquireLane());
    void* dev = nullptr;
    const size_t bytes = host.size() * sizeof(float);
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(cudaMallocAsync(&dev, bytes, lane->stream), "cudaMallocAsync (rotation)"));
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(dev, host.data(), bytes, cudaMemcpyHostToDevice, lane->stream),
                   "H2D rotation"));
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(lane->stream), "H2D rotation"));
    absl::MutexLock lock(&mu_);
    auto [it, inserted] = rotations_.emplace(key, static_cast<float*>(dev));
    if (!inserted) cudaFreeAsync(dev, lane->stream);  // another call uploaded it meanwhile
    lane->dirty = !inserted;                          // then the lane drains that free
    return it->second;
  }

  // Uploads run tables into the lane's table buffer as SequenceBatches. Stream order makes
  // reusing the buffer safe: the copy runs after earlier launches of the lane that read it.
  // With `zeroed_words` > 0, the same copy also puts that many zeroed words after the tables, at
  // *zeroed (the fused page checksums' sums); *zeroed stays nullptr otherwise.
  absl::StatusOr<std::vector<cuda::SequenceBatch>> UploadRuns(
      Lane& lane, std::initializer_list<const RunTable*> tables) {
    return UploadRuns(lane, absl::MakeConstSpan(tables.begin(), tables.size()));
  }
  absl::StatusOr<std::vector<cuda::SequenceBatch>> UploadRuns(
      Lane& lane, absl::Span<const RunTable* const> tables, size_t zeroed_words = 0,
      uint32_t** zeroed = nullptr) {
    std::vector<uint8_t> host;
    std::vector<std::array<size_t, 3>> at;
    for (const RunTable* t : tables) {
      at.push_back({Append(&host, t->row_offsets.data(), t->row_offsets.size()),
                    Append(&host, t->first_token.data(), t->first_token.size()),
                    Append(&host, t->block.data(), t->block.size())});
    }
    const size_t zeroed_at = AlignUp(host.size());
    if (zeroed_words > 0) host.resize(zeroed_at + zeroed_words * sizeof(uint32_t), 0);
    KVPOOL_ASSIGN_OR_RETURN(uint8_t * dev, lane.tables.Reserve(host.size(), lane.stream));
    // From pageable memory: the driver stages it before returning (no device-wide wait, which
    // pinned allocations can cause; see DeviceBuffer).
    KVPOOL_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(dev, host.data(), host.size(), cudaMemcpyHostToDevice, lane.stream),
        "H2D block tables"));
    std::vector<cuda::SequenceBatch> out;
    size_t i = 0;
    for (const RunTable* t : tables) {
      cuda::SequenceBatch batch;
      batch.num_seqs = t->runs();
      batch.row_offsets = reinterpret_cast<const int32_t*>(dev + at[i][0]);
      batch.first_token = reinterpret_cast<const int32_t*>(dev + at[i][1]);
      batch.block_tables = reinterpret_cast<const int32_t*>(dev + at[i][2]);
      batch.block_table_stride = t->stride;
      batch.total_rows = t->rows();
      out.push_back(batch);
      ++i;
    }
    if (zeroed != nullptr) {
      *zeroed = zeroed_words > 0 ? reinterpret_cast<uint32_t*>(dev + zeroed_at) : nullptr;
    }
    return out;
  }

  cuda::ArrivalJob ArrivalJobOf(const Model& m, bool history, const cuda::SequenceBatch& batch,
                                const uint8_t* rows, const float* rotation, KvTensor tensor) const {
    cuda::ArrivalJob job;
    job.cfg = history ? m.codec.quant : m.bf16_codec.config();
    job.kv = View(m, history);
    job.batch = batch;
    job.tensor = tensor;
    job.in.rows = reinterpret_cast<const uint16_t*>(rows);
    job.in.rotation = rotation;
    return job;
  }

  absl::Status Dequantize(Lane& lane, const Model& m, bool history,
                          const cuda::SequenceBatch& batch, KvTensor tensor, uint8_t* out) {
    const QuantConfig& cfg = history ? m.codec.quant : m.bf16_codec.config();
    return cuda::DequantizeToBf16(cfg, View(m, history), batch, tensor,
                                  reinterpret_cast<uint16_t*>(out), lane.error_word, lane.stream);
  }

  absl::Status ReadWords(const Model& m, const uint8_t* block, bool history, KvTensor t, int slot,
                         int count, absl::Span<Bf16> out) {
    KVPOOL_ASSIGN_OR_RETURN(int32_t id, BlockId(block));
    RunTable table;
    table.Add(count, slot, id);
    KVPOOL_ASSIGN_OR_RETURN(LaneLease lane, AcquireLane());
    KVPOOL_ASSIGN_OR_RETURN(uint8_t * rows,
                            lane->rows.Reserve(out.size() * sizeof(Bf16), lane->stream));
    KVPOOL_ASSIGN_OR_RETURN(std::vector<cuda::SequenceBatch> batch, UploadRuns(*lane, {&table}));
    KVPOOL_RETURN_IF_ERROR(Dequantize(*lane, m, history, batch[0], t, rows));
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(out.data(), rows, out.size() * sizeof(Bf16),
                                                      cudaMemcpyDeviceToHost, lane->stream),
                                      "D2H rows"));
    return Finish(*lane, "read");
  }

  // Arrival kernels for device rows `k`, `v` on the lane's stream, then its error check.
  absl::Status StageOnLane(Lane& lane_ref, const Model& m, int layer, const Bf16* k, const Bf16* v,
                           absl::Span<const RowWrite> writes) {
    Lane* lane = &lane_ref;
    KVPOOL_ASSIGN_OR_RETURN(const float* rot_k, DeviceRotation(m, layer, KvTensor::kKey));
    const float* rot_v = nullptr;
    if (!m.codec.v_prerotated) {
      KVPOOL_ASSIGN_OR_RETURN(rot_v, DeviceRotation(m, layer, KvTensor::kValue));
    }
    const uint8_t* k_rows = reinterpret_cast<const uint8_t*>(k);
    const uint8_t* v_rows = reinterpret_cast<const uint8_t*>(v);
    // One launch per tensor and per maximal run of writes of one kind that are contiguous in
    // the input (a chunk is typically sink | history | recent: three runs). Every run's table
    // goes up in one copy first, so the launches follow each other without host gaps.
    const size_t row_bytes = m.row_values() * sizeof(Bf16);
    std::vector<RunTable> tables;
    std::vector<size_t> first_write;
    for (size_t i = 0; i < writes.size();) {
      size_t j = i + 1;
      while (j < writes.size() && writes[j].history == writes[i].history &&
             writes[j].input_row == writes[j - 1].input_row + writes[j - 1].count) {
        ++j;
      }
      RunTable& table = tables.emplace_back();
      first_write.push_back(i);
      for (size_t w = i; w < j; ++w) {
        KVPOOL_ASSIGN_OR_RETURN(int32_t id, BlockId(writes[w].block));
        table.Add(writes[w].count, writes[w].slot, id);
      }
      i = j;
    }
    std::vector<const RunTable*> table_ptrs;
    for (const RunTable& t : tables) table_ptrs.push_back(&t);
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(lane->start, lane->stream), "event"));
    // Write w is entry w - first_write[r] of run table r (single-block runs): its page checksum
    // accumulates in d_sums[w], zeroed by the upload.
    const size_t num_sums = WantsChecksums(writes) ? writes.size() : 0;
    uint32_t* d_sums = nullptr;
    KVPOOL_ASSIGN_OR_RETURN(std::vector<cuda::SequenceBatch> batch,
                            UploadRuns(*lane, table_ptrs, num_sums, &d_sums));
    // Every run's K and V in one launch where the kernels allow (a launch has a fixed cost however
    // few its rows: kernels/cuda/NOTES.md, run 6), the checksums of the slots written fused in.
    std::vector<cuda::ArrivalJob> jobs;
    for (size_t r = 0; r < tables.size(); ++r) {
      const RowWrite& w = writes[first_write[r]];
      const size_t from = static_cast<size_t>(w.input_row) * row_bytes;
      uint32_t* sums = d_sums != nullptr ? d_sums + first_write[r] : nullptr;
      jobs.push_back(ArrivalJobOf(m, w.history, batch[r], k_rows + from, rot_k, KvTensor::kKey));
      jobs.back().in.page_checksums = sums;
      jobs.push_back(ArrivalJobOf(m, w.history, batch[r], v_rows + from, rot_v, KvTensor::kValue));
      jobs.back().in.page_checksums = sums;
    }
    KVPOOL_RETURN_IF_ERROR(
        cuda::QuantizeOnArrivalJobs(jobs, lane->error_word, lane->stream, tuning_.arrival));
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(lane->stop, lane->stream), "event"));
    KVPOOL_RETURN_IF_ERROR(CopyChecksums(*lane, d_sums, writes));
    KVPOOL_RETURN_IF_ERROR(Finish(*lane, absl::StrCat("layer ", layer)));
    AddTime(*lane, &BackendTimes::arrival_seconds);
    return absl::OkStatus();
  }

  // The BF16 copy of a batch whose history the attention kernel cannot read: query row i's
  // sink, history and recent tokens, in order, in blocks [i * nb, (i + 1) * nb) of the lane's
  // bf16_copy buffer, described as one BF16 tier (`tables`; its history pool keeps the arena
  // with an INT2 layout the kernels accept, unread). `plan` holds the tables' words and, per
  // tier, the copy's row offsets and destination first tokens, for one H2D copy.
  struct Bf16Copy {
    std::unique_ptr<PagedKvTables> tables;
    QuantConfig cfg;  // of the tables' history pool
    std::vector<uint8_t> plan;
    size_t tables_at = 0;
    size_t offsets_at[3] = {0, 0, 0};
    size_t firsts_at[3] = {0, 0, 0};
    int tier_rows[3] = {0, 0, 0};
  };

  absl::StatusOr<Bf16Copy> PlanBf16Copy(Lane& lane, const Model& m, const PagedKvBatch& kv) {
    const int n = kv.num_seqs;
    const int bt = m.block_tokens();
    const PagedKvTier* tiers[3] = {&kv.sink, &kv.history, &kv.recent};
    std::vector<int> total(n, 0);
    int nb = 1;
    for (int i = 0; i < n; ++i) {
      for (const PagedKvTier* t : tiers) total[i] += t->num_tokens[i];
      nb = std::max(nb, (total[i] + bt - 1) / bt);
    }
    const size_t block_bytes = m.bf16_layout.block_bytes();
    KVPOOL_ASSIGN_OR_RETURN(
        uint8_t * blocks,
        lane.bf16_copy.Reserve(static_cast<size_t>(n) * nb * block_bytes, lane.stream));
    Bf16Copy c;
    c.cfg.block_tokens = m.codec.quant.block_tokens;
    c.cfg.scale_dtype = m.codec.quant.scale_dtype;
    PagedKvView history_pool = kv.history_pool;
    history_pool.layout = BlockLayout::ForModel(c.cfg, m.kv_heads, m.head_dim);
    const PagedKvView copy_pool{blocks, m.bf16_layout, m.codec.quant.scale_dtype,
                                static_cast<int64_t>(n) * nb, 0};
    std::vector<int32_t> block_ids(static_cast<size_t>(n) * nb);  // 0 .. n * nb - 1
    for (size_t j = 0; j < block_ids.size(); ++j) block_ids[j] = static_cast<int32_t>(j);
    std::vector<PagedKvTables::Sequence> rows(n);
    for (int i = 0; i < n; ++i) {
      rows[i].sink = {absl::MakeConstSpan(block_ids).subspan(static_cast<size_t>(i) * nb, nb), 0,
                      total[i]};
    }
    c.tables = std::make_unique<PagedKvTables>(history_pool, copy_pool, rows);
    c.tables_at = Append(&c.plan, c.tables->words().data(), c.tables->words().size());
    std::vector<int32_t> offset(n, 0);  // where the next tier starts in query row i's copy
    for (int t = 0; t < 3; ++t) {
      std::vector<int32_t> row_offsets{0};
      for (int i = 0; i < n; ++i) {
        row_offsets.push_back(row_offsets.back() + tiers[t]->num_tokens[i]);
      }
      c.offsets_at[t] = Append(&c.plan, row_offsets.data(), row_offsets.size());
      c.firsts_at[t] = Append(&c.plan, offset.data(), offset.size());
      for (int i = 0; i < n; ++i) offset[i] += tiers[t]->num_tokens[i];
      c.tier_rows[t] = row_offsets.back();
    }
    return c;
  }

  // Runs `copy` (planned by PlanBf16Copy; its plan at `plan` on the device) for the batch `kv`
  // whose arrays are at `dev` on the device; returns the copy's batch, its arrays on the device.
  // Sink and recent rows are BF16 pages already: copied page to page. History rows are
  // dequantized to a staging buffer first.
  absl::StatusOr<PagedKvBatch> CopyToBf16Blocks(Lane& lane, const Model& m, const PagedKvBatch& kv,
                                                const PagedKvBatch& dev, const Bf16Copy& copy,
                                                const uint8_t* plan) {
    const int n = kv.num_seqs;
    auto at = [&](size_t offset) { return reinterpret_cast<const int32_t*>(plan + offset); };
    const PagedKvBatch dst =
        RebaseArrays(copy.tables->batch(), copy.tables->words().data(), at(copy.tables_at));
    const PagedKvTier* from[3] = {&dev.sink, &dev.history, &dev.recent};
    for (int t = 0; t < 3; ++t) {
      if (copy.tier_rows[t] == 0) continue;
      const bool history = t == 1;
      const cuda::SequenceBatch read{n,
                                     at(copy.offsets_at[t]),
                                     from[t]->first_token,
                                     from[t]->block_tables,
                                     from[t]->block_table_stride,
                                     copy.tier_rows[t]};
      const cuda::SequenceBatch write{n,
                                      at(copy.offsets_at[t]),
                                      at(copy.firsts_at[t]),
                                      dst.sink.block_tables,
                                      dst.sink.block_table_stride,
                                      copy.tier_rows[t]};
      const cuda::PagedRows pages{kv.bf16_pool, from[t]->first_token, from[t]->block_tables,
                                  from[t]->block_table_stride};
      uint8_t* rows = nullptr;
      if (history) {
        KVPOOL_ASSIGN_OR_RETURN(
            rows, lane.rows.Reserve(static_cast<size_t>(copy.tier_rows[t]) * m.row_values() * 2,
                                    lane.stream));
      }
      for (KvTensor tensor : {KvTensor::kKey, KvTensor::kValue}) {
        cuda::ArrivalRows in;
        if (history) {
          KVPOOL_RETURN_IF_ERROR(cuda::DequantizeToBf16(m.codec.quant, kv.history_pool, read,
                                                        tensor, reinterpret_cast<uint16_t*>(rows),
                                                        lane.error_word, lane.stream));
          in.rows = reinterpret_cast<const uint16_t*>(rows);
        } else {
          in.paged = &pages;
        }
        KVPOOL_RETURN_IF_ERROR(cuda::QuantizeOnArrival(m.bf16_codec.config(), dst.bf16_pool, write,
                                                       tensor, in, lane.error_word, lane.stream,
                                                       tuning_.arrival));
      }
    }
    return dst;
  }

  // Enqueues the checksums of `ranges` (kernels/cuda/page_checksum_cuda.h, for ChecksumSlots) on
  // the lane's stream, after its earlier work; returns the device array they land in (in the lane's
  // table buffer, valid until the lane's next upload), or nullptr for no ranges.
  absl::StatusOr<uint32_t*> EnqueueChecksums(Lane& lane, const Model& m,
                                             absl::Span<const SlotRange> ranges) {
    if (ranges.empty()) return nullptr;
    std::vector<cuda::ChecksumRange> host(ranges.size());
    for (size_t i = 0; i < ranges.size(); ++i) {
      KVPOOL_ASSIGN_OR_RETURN(host[i].block, BlockId(ranges[i].page));
      host[i].first_slot = ranges[i].first_slot;
      host[i].count = ranges[i].count;
      host[i].history = ranges[i].history ? 1 : 0;
    }
    const size_t range_bytes = (host.size() * sizeof(cuda::ChecksumRange) + 15) / 16 * 16;
    KVPOOL_ASSIGN_OR_RETURN(
        uint8_t * dev,
        lane.tables.Reserve(range_bytes + host.size() * sizeof(uint32_t), lane.stream));
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(dev, host.data(), host.size() * sizeof(cuda::ChecksumRange),
                                   cudaMemcpyHostToDevice, lane.stream),
                   "H2D checksum ranges"));
    uint32_t* out = reinterpret_cast<uint32_t*>(dev + range_bytes);
    KVPOOL_RETURN_IF_ERROR(cuda::PageChecksums(
        arena_.load(), PageChecksumGeometry::Of(m.block_layout),
        PageChecksumGeometry::Of(m.bf16_layout), reinterpret_cast<const cuda::ChecksumRange*>(dev),
        static_cast<int>(host.size()), out, lane.stream));
    return out;
  }

  // Whether any of the writes or moves asks for the checksum of what it writes.
  template <typename T>
  static bool WantsChecksums(absl::Span<const T> items) {
    return std::any_of(items.begin(), items.end(),
                       [](const T& item) { return item.checksum != nullptr; });
  }

  // Copies the fused checksums (d_sums[i] for items[i]; nullptr: none asked) to the items'
  // checksum fields (waits for the stream).
  template <typename T>
  absl::Status CopyChecksums(Lane& lane, const uint32_t* d_sums, absl::Span<const T> items) {
    if (d_sums == nullptr) return absl::OkStatus();
    std::vector<uint32_t> host(items.size());
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(host.data(), d_sums, host.size() * sizeof(uint32_t),
                                   cudaMemcpyDeviceToHost, lane.stream),
                   "D2H checksums"));
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(lane.stream), "D2H checksums"));
    for (size_t i = 0; i < items.size(); ++i) {
      if (items[i].checksum != nullptr) *items[i].checksum = host[i];
    }
    return absl::OkStatus();
  }

  // Adds the time between the lane's start and stop events (both complete) to `field`.
  void AddTime(const Lane& lane, double BackendTimes::*field) {
    float ms = 0;
    if (cudaEventElapsedTime(&ms, lane.start, lane.stop) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    absl::MutexLock lock(&mu_);
    times_.*field += ms * 1e-3;
  }

  // Waits for the lane's stream and turns the kernels' data checks into a status.
  absl::Status Finish(Lane& lane, absl::string_view what) {
    absl::Status s = cuda::TakeCodecErrors(lane.error_word, lane.stream);
    lane.dirty = !s.ok() && s.code() == absl::StatusCode::kInternal;  // a CUDA error, not data
    if (s.ok()) return s;
    return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
  }

  const int device_;
  const std::string name_;
  const cuda::KernelTuning tuning_;
  mutable absl::Mutex mu_;
  // Set once by AllocateArena, before any other call; read lock-free (BlockId runs per block).
  std::atomic<uint8_t*> arena_{nullptr};
  std::atomic<size_t> arena_bytes_{0};
  std::vector<std::unique_ptr<Lane>> lanes_ ABSL_GUARDED_BY(mu_);
  BackendTimes times_ ABSL_GUARDED_BY(mu_);
  std::map<std::tuple<std::string, int, int>, float*> rotations_ ABSL_GUARDED_BY(mu_);
  // Device health: the probe stream (set by AllocateArena), whether a sticky error poisoned the
  // context, which one, and the calls refused since.
  std::atomic<cudaStream_t> probe_{nullptr};
  std::atomic<bool> failed_{false};
  std::string failure_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> refused_{0};
};

// Pinned, mapped host memory (cudaHostRegister), unregistered when destroyed.
class PinnedHost final : public HostRegistration {
 public:
  PinnedHost(uint8_t* host, uint8_t* device) : host_(host), device_(device) {}
  ~PinnedHost() override { cudaHostUnregister(host_); }
  void* KernelAddress(void* p) const override {
    return device_ + (static_cast<uint8_t*>(p) - host_);
  }

 private:
  uint8_t* const host_;
  uint8_t* const device_;
};

absl::StatusOr<std::unique_ptr<DeviceMailbox>> CudaBackend::CreateDeviceMailbox(size_t bytes) {
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<CudaMailbox> m, CudaMailbox::Create(bytes));
  return std::unique_ptr<DeviceMailbox>(std::move(m));
}

absl::StatusOr<std::unique_ptr<HostRegistration>> CudaBackend::RegisterHostMemory(void* p,
                                                                                  size_t bytes) {
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  KVPOOL_RETURN_IF_ERROR(
      CudaStatus(cudaHostRegister(p, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable),
                 "cudaHostRegister"));
  void* device = nullptr;
  const cudaError_t e = cudaHostGetDevicePointer(&device, p, 0);
  if (e != cudaSuccess) {
    cudaHostUnregister(p);
    return CudaStatus(e, "cudaHostGetDevicePointer");
  }
  return std::unique_ptr<HostRegistration>(
      new PinnedHost(static_cast<uint8_t*>(p), static_cast<uint8_t*>(device)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<ComputeBackend>> NewCudaBackend(int device,
                                                               const cuda::KernelTuning& tuning) {
  const int count = cuda::CudaDeviceCount();
  if (device >= count) {
    return absl::UnavailableError(absl::StrCat("device cuda:", device, " is not available (", count,
                                               " CUDA device(s) on this machine)"));
  }
  return std::unique_ptr<ComputeBackend>(new CudaBackend(device, tuning));
}

}  // namespace kvpool::server
