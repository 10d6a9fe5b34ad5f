// LayerwiseAppend: one append to a sequence whose layers arrive as independent chunks from a
// data-plane transport, staged (rotated and quantized) on the worker pool as they arrive and
// committed atomically at the end. It wraps a SequenceStore transaction (AppendTxn): any failure
// or an Abort drops the transaction, which returns every reserved page, so a push that dies
// half-way leaves nothing in the pool.
//
//   KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<LayerwiseAppend> push,
//                           LayerwiseAppend::Begin(ctx, tenant, "seq-1", spec));
//   push->Stage(/*layer=*/0, /*offset=*/0, n, k, v, [](absl::Status s, bool layer_done) {...});
//   ...                                            // every layer, any order, chunks in any order
//   KVPOOL_ASSIGN_OR_RETURN(AppendResult r, push->Commit());   // after every chunk is done
//
// Chunks of one layer are staged one at a time in offset order (AppendTxn's rule), whatever the
// order they were queued in; chunks of different layers run concurrently.
//
// Thread-safe.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/bf16.h"
#include "server/sequence_store.h"
#include "server/service_context.h"

namespace kvpool::server {

class LayerwiseAppend : public std::enable_shared_from_this<LayerwiseAppend> {
 public:
  // Called once per chunk, on a worker thread or on the thread that queued or aborted it: the
  // chunk's status (the push's first error once it has failed) and whether its layer is now
  // fully staged.
  using ChunkDone = std::function<void(absl::Status status, bool layer_complete)>;

  // Begins the append (SequenceStore::BeginAppend's errors).
  [[nodiscard]] static absl::StatusOr<std::shared_ptr<LayerwiseAppend>> Begin(
      ServiceContext* ctx, const TenantId& tenant, const std::string& sequence_id, AppendSpec spec);
  ~LayerwiseAppend();  // rolls back unless committed

  LayerwiseAppend(const LayerwiseAppend&) = delete;
  LayerwiseAppend& operator=(const LayerwiseAppend&) = delete;

  const Model& model() const { return *model_; }
  int num_tokens() const { return num_tokens_; }
  const std::string& sequence_id() const { return sequence_id_; }

  // Queues BF16 K and V rows of `layer` for input tokens [offset, offset + count), each
  // [count][kv_heads][head_dim], for staging on the worker pool. The rows must stay valid until
  // `done` runs. A chunk that does not fit (layer, range, overlap with another chunk) fails the
  // whole push with InvalidArgument; staging errors (NaN/Inf, ...) fail it too.
  void Stage(int layer, int offset, int count, const Bf16* k, const Bf16* v, ChunkDone done);

  // Stage for rows in GPU memory (AppendTxn::StageDeviceLayer). `ready`, when set, runs on the
  // worker first and returns once the rows are in place (an NCCL receive has finished); its
  // error fails the push.
  void StageDevice(int layer, int offset, int count, const Bf16* k, const Bf16* v,
                   std::function<absl::Status()> ready, ChunkDone done);

  // Whether every layer is fully staged and nothing is running.
  bool Complete() const;
  // Commits the append (on the calling thread). FailedPrecondition while layers are missing or
  // chunks are staging; the push's error when it failed; SequenceStore::Commit's errors.
  [[nodiscard]] absl::StatusOr<AppendResult> Commit();
  // Rolls the append back (idempotent; no effect after a commit). Queued chunks finish with
  // `why`; chunks being staged finish normally and the transaction is dropped after them.
  // `rolled_back`, when set, runs once the transaction is gone (at once when it already is, or
  // after a commit) so that the caller can answer only when the sequence is free again.
  void Abort(absl::Status why, std::function<void()> rolled_back = nullptr);
  // OK, or the push's first error.
  absl::Status status() const;

 private:
  struct Chunk {
    int offset = 0;
    int count = 0;
    const Bf16* k = nullptr;
    const Bf16* v = nullptr;
    ChunkDone done;
    bool device = false;                  // k and v are GPU memory
    std::function<absl::Status()> ready;  // device chunks: waits until the rows are in place
  };
  struct LayerQueue {
    std::map<int, Chunk> waiting;  // by offset
    bool running = false;
    int running_count = 0;  // the running chunk covers [next, next + running_count)
    int next = 0;           // tokens staged so far
  };
  struct Deferred {  // work to do after releasing mu_
    std::vector<std::pair<Chunk, absl::Status>> failed;
    std::vector<std::pair<int, Chunk>> run;
    std::unique_ptr<AppendTxn> drop;
    std::vector<std::function<void()>> rolled_back;  // run after `drop` is gone
  };

  LayerwiseAppend(ServiceContext* ctx, std::unique_ptr<AppendTxn> txn, std::string sequence_id);
  void FailLocked(absl::Status why, Deferred* d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hands the transaction and the rollback callbacks to `d` when nothing runs any more.
  void DropIfIdleLocked(Deferred* d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rolls back what `d` holds and runs its rollback callbacks.
  static void RollBack(Deferred* d);
  // Whether [offset, offset + count) overlaps tokens staged, staging or queued in `q`.
  static bool Overlaps(const LayerQueue& q, int offset, int count);
  void ScheduleLocked(int layer, Deferred* d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Finish(Deferred d);
  void RunChunk(int layer, Chunk chunk);
  void Queue(int layer, Chunk chunk);

  ServiceContext* const ctx_;
  const std::shared_ptr<const Model> model_;
  const int num_tokens_;
  const std::string sequence_id_;
  mutable absl::Mutex mu_;
  std::unique_ptr<AppendTxn> txn_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::vector<LayerQueue> layers_ ABSL_GUARDED_BY(mu_);
  int complete_layers_ ABSL_GUARDED_BY(mu_) = 0;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  bool committed_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::function<void()>> on_rolled_back_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvpool::server
