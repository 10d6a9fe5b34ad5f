// IngestAppend: one append in the ingest engine (ingest_engine.h), whatever carries its bytes
// (AppendKv, UCX, NCCL, CUDA IPC). Its chunks (K and V of some tokens of one layer) are staged
// (rotated and quantized into a SequenceStore transaction) on the worker pool as they arrive and
// the append commits atomically at the end. Any failure, a cancellation or an Abort drops the
// transaction, which returns every reserved page, so an append that dies half-way leaves nothing
// in the pool; its end is reported only after that rollback, so a retry never finds the sequence
// still locked.
//
//   IngestOptions options;
//   options.on_end = [](absl::StatusOr<AppendResult> r) { ... };  // committed, or rolled back
//   options.resume = [] { ... };                                  // a paused producer goes on
//   KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<IngestAppend> append,
//                           engine.Begin(tenant, header, std::move(options)));
//   bool more = append->Stage(/*layer=*/0, /*offset=*/0, n, k_bytes, v_bytes, done);
//   ...                                   // every layer, any order; pause while `more` is false
//   append->Commit();                     // once every chunk is handed over
//
// Staging with backpressure: chunks handed over and not yet staged form a bounded queue (a chunk
// count, and a byte bound once a few chunks wait). Stage returns false when the queue is full:
// the producer then pauses (a gRPC stream stops reading) until `resume` runs on a worker, once
// the queue has drained to half its bounds. A producer whose memory is bounded otherwise (UCX
// staging slots) sets the bound to its own and may ignore it. A full queue whose chunks all wait
// for earlier tokens of their layer can never drain: the append fails (InvalidArgument).
//
// Chunks of one layer are staged one at a time in offset order (AppendTxn's rule), whatever the
// order they arrived in; chunks of different layers run concurrently. The first task of a chunk
// is admitted by the worker pool's bounded queue (a full pool fails the append with
// RESOURCE_EXHAUSTED); its continuations always run.
//
// Thread-safe. Callbacks never run inside Stage, Commit or Abort on the caller's stack, except a
// chunk's `done` when the chunk is refused at once and Abort's `rolled_back` when the rollback
// already happened.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kernels/bf16.h"
#include "kvpool/v1/common.pb.h"
#include "server/admission/admission.h"
#include "server/codec_health.h"
#include "server/ingest/ingest_counters.h"
#include "server/sequence_store.h"
#include "server/tenant.h"
#include "server/worker_pool.h"

namespace kvpool::server {

// How an append behaves toward its producer.
struct IngestOptions {
  // Runs once, on a worker thread: with the commit's result, or with the append's first error
  // once its transaction is rolled back.
  std::function<void(absl::StatusOr<AppendResult>)> on_end;
  // Runs on a worker thread when a paused producer may hand over chunks again.
  std::function<void()> resume;
  // Checked before each chunk is staged and before the commit (a gone client): true fails the
  // append with CANCELLED.
  std::function<bool()> cancelled;
  // The queue of chunks handed over and not yet staged is full at max_pending_chunks, or at
  // min_pending_chunks holding max_pending_bytes of host payload.
  size_t max_pending_chunks = 16;
  size_t min_pending_chunks = 2;
  size_t max_pending_bytes = size_t{4} << 20;
  // The stream's admission ticket (IngestEngine::Admit), or null: the append's reserved pages
  // count against it until the append ends, and every chunk handed over or staged is progress
  // (Touch). Its expiry is the owner's to act on (IngestEngine::Begin aborts the append).
  std::shared_ptr<Admission::Ticket> ticket;
  // Whose work the chunks are in the worker pool's fair queueing (IngestEngine::Begin sets it).
  TenantId tenant = kDefaultTenant;
  // Samples arriving rows for the codec-health metrics (set by IngestEngine); null: none.
  CodecHealth* codec_health = nullptr;
};

// A chunk's codec work in fair-queueing units (worker_pool.h): one per 64 KiB of payload, plus
// one for the task.
inline uint64_t IngestUnits(size_t payload_bytes) { return 1 + payload_bytes / (64 * 1024); }

class IngestAppend : public std::enable_shared_from_this<IngestAppend> {
 public:
  // Called once per chunk, on a worker thread or on the thread that handed it over or aborted
  // the append: the chunk's status (the append's first error once it has failed) and whether its
  // layer is now fully staged. The chunk's rows may be released then.
  using ChunkDone = std::function<void(absl::Status status, bool layer_complete)>;

  // Made by IngestEngine::Begin.
  IngestAppend(std::unique_ptr<AppendTxn> txn, std::string sequence_id, v1::DType dtype,
               IngestOptions options, WorkerPool* workers, SequenceStore* store,
               IngestCounters* counters);
  ~IngestAppend();  // rolls back unless committed

  IngestAppend(const IngestAppend&) = delete;
  IngestAppend& operator=(const IngestAppend&) = delete;

  const Model& model() const { return *model_; }
  int num_tokens() const { return num_tokens_; }
  const std::string& sequence_id() const { return sequence_id_; }

  // InvalidArgument unless the chunk lies inside the append (CheckChunkPlace) and overlaps no
  // tokens of its layer handed over before. Stage checks it too; a transport that must act before
  // staging (post a receive) asks first.
  [[nodiscard]] absl::Status CheckChunk(int32_t layer, uint32_t offset, uint32_t count) const;

  // Hands over K and V rows of `layer` for input tokens [offset, offset + count), in the header's
  // dtype, [count][kv_heads][head_dim] each; they must stay valid until `done` runs. A chunk that
  // does not fit (CheckChunk, payload sizes) fails the whole append with InvalidArgument;
  // staging errors (NaN/Inf, ...) fail it too. Returns false when the producer must pause.
  bool Stage(int32_t layer, uint32_t offset, uint32_t count, absl::string_view k,
             absl::string_view v, ChunkDone done);

  // Stage for BF16 rows in GPU memory (AppendTxn::StageDeviceLayer). `ready`, when set, runs on
  // the worker first and returns once the rows are in place (a receive or copy has finished);
  // its error fails the append.
  bool StageDevice(int32_t layer, uint32_t offset, uint32_t count, const Bf16* k, const Bf16* v,
                   std::function<absl::Status()> ready, ChunkDone done);

  // Whether every layer is fully staged and nothing is running.
  bool Complete() const;
  // The producer has handed over everything: commits on a worker once every chunk is staged and
  // reports through on_end. InvalidArgument (after the rollback) when a layer is incomplete.
  // Idempotent.
  void Commit();
  // Rolls the append back (idempotent; no effect after a commit began). Chunks not yet staging
  // finish with `why`; chunks being staged finish normally and the transaction is dropped after
  // them. `rolled_back`, when set, runs once the transaction is gone (at once when it already
  // is, or when the commit has begun).
  void Abort(absl::Status why, std::function<void()> rolled_back = nullptr);
  // OK, or the append's first error.
  absl::Status status() const;

 private:
  struct Chunk {
    uint32_t offset = 0;
    uint32_t count = 0;
    absl::string_view k, v;  // host rows in the header's dtype
    const Bf16* device_k = nullptr;
    const Bf16* device_v = nullptr;
    std::function<absl::Status()> ready;  // device chunks: waits until the rows are in place
    ChunkDone done;
    size_t bytes() const { return k.size() + v.size(); }
  };
  struct LayerQueue {
    std::map<uint32_t, Chunk> waiting;  // by offset
    bool running = false;
    uint32_t running_count = 0;  // the running chunk covers [next, next + running_count)
    uint32_t next = 0;           // tokens staged so far
  };
  struct Deferred {  // work to do after releasing mu_
    std::vector<std::pair<Chunk, absl::Status>> failed;
    std::vector<std::pair<int, Chunk>> run;
    std::unique_ptr<AppendTxn> drop;
    std::vector<std::function<void()>> rolled_back;  // run after `drop` is gone
    bool resume = false;
    bool end = false;     // report the failure through on_end (after `drop`)
    bool commit = false;  // commit now (every chunk staged, Commit asked for)
  };

  bool Queue(int32_t layer, Chunk chunk);
  absl::Status CheckChunkLocked(int32_t layer, uint32_t offset, uint32_t count) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool FullLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool LowLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void FailLocked(absl::Status why, Deferred* d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hands the transaction and the rollback callbacks to `d` when nothing runs any more.
  void DropIfIdleLocked(Deferred* d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After a chunk ended or the producer finished: resume, stalls, the commit.
  void SettleLocked(Deferred* d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ScheduleLocked(int layer, Deferred* d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rolls back what `d` holds and runs its rollback callbacks.
  static void RollBack(Deferred* d);
  // Runs what `d` holds; `admit`: submit new chunk tasks through the pool's bounded queue.
  void Finish(Deferred d, bool admit);
  void RunChunk(int layer, Chunk chunk);
  absl::Status StageRows(int layer, const Chunk& chunk, AppendTxn* txn) const;
  void RunCommit();
  void End(absl::StatusOr<AppendResult> result);

  const std::shared_ptr<const Model> model_;
  const int num_tokens_;
  const std::string sequence_id_;
  const v1::DType dtype_;
  IngestOptions options_;                                     // its on_end is moved to on_end_
  std::function<void(absl::StatusOr<AppendResult>)> on_end_;  // End's alone (runs once)
  WorkerPool* const workers_;
  SequenceStore* const store_;
  IngestCounters* const counters_;

  mutable absl::Mutex mu_;
  std::unique_ptr<AppendTxn> txn_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::vector<LayerQueue> layers_ ABSL_GUARDED_BY(mu_);
  int complete_layers_ ABSL_GUARDED_BY(mu_) = 0;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  size_t pending_chunks_ ABSL_GUARDED_BY(mu_) = 0;  // handed over, not yet staged
  size_t pending_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool paused_ ABSL_GUARDED_BY(mu_) = false;            // Stage returned false; resume owed
  bool commit_requested_ ABSL_GUARDED_BY(mu_) = false;  // Commit was called
  bool committing_ ABSL_GUARDED_BY(mu_) = false;        // the commit began
  bool ended_ ABSL_GUARDED_BY(mu_) = false;             // on_end is scheduled
  std::vector<std::function<void()>> on_rolled_back_ ABSL_GUARDED_BY(mu_);
  // options_.ticket until the append ends (then its reservation is given back).
  std::shared_ptr<Admission::Ticket> ticket_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvpool::server
