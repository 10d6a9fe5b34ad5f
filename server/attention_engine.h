// AttentionEngine: remote decode attention for a batch of sequences of one model and one layer.
//
// Per request: snapshot every sequence's layer (references keep its pages alive; the snapshots
// make the request's paged KV batch, kernels/paged_kv.h), then hand it to the backend's one
// Attend method. The host backend gets one sequence's rows per call, spread over the worker pool;
// a backend on a device gets the whole request, together with every other request of the same
// model and layer waiting at that moment, in one call. The queries are read where the request
// decoded them and the outputs written once into the answer (original basis, natural-log LSE
// per query head).
//
//   AttentionEngine engine(&store, backend.get(), &workers);
//   AttentionRequest request{{"seq-1"}, {1}, std::move(queries)};   // decoded from the wire
//   KVPOOL_RETURN_IF_ERROR(engine.Start(tenant, model, /*layer=*/3, std::move(request),
//       [](absl::StatusOr<AttentionAnswer> a) { ... }));             // runs on a worker
//   auto answer = engine.Run(tenant, model, 3, std::move(request));  // same, on this thread
//
// Thread-safe.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "server/backend.h"
#include "server/call_cancellation.h"
#include "server/model_registry.h"
#include "server/sequence_store.h"
#include "server/worker_pool.h"

namespace kvpool::server {

// A request's queries, decoded once from the wire into the buffer the backend reads.
struct AttentionRequest {
  std::vector<std::string> sequence_ids;
  std::vector<int> num_queries;  // query rows per sequence, >= 1
  std::vector<float> queries;    // [rows][q_heads][head_dim], sequence after sequence, unrotated
};

// The answer, written once by the backend; the response is built from it.
struct AttentionAnswer {
  std::vector<int> attended_tokens;  // per sequence
  std::vector<float> out;            // [rows][q_heads][head_dim], original basis
  std::vector<float> lse;            // [rows][q_heads], natural log; -inf for no tokens
};

using AttentionDone = std::function<void(absl::StatusOr<AttentionAnswer>)>;

// One call with queries and outputs in the backend's GPU memory (an NCCL attention channel,
// server/transport/gpu/gpu_attention_service.h): num_queries query rows per sequence.
struct DeviceAttentionCall {
  int layer = 0;
  absl::Span<const std::string> sequence_ids;  // the batch, in row order
  int num_queries = 1;
  const float* queries = nullptr;  // [batch][num_queries][q_heads][head_dim], unrotated
  float* out = nullptr;            // same shape, original basis
  float* lse = nullptr;            // [batch][num_queries][q_heads], natural log
};

class AttentionEngine {
 public:
  // `workers` may be null: everything then runs on the calling thread.
  AttentionEngine(SequenceStore* store, ComputeBackend* backend, WorkerPool* workers)
      : store_(store), backend_(backend), workers_(workers) {}

  // Checks shapes and values of the request (InvalidArgument), then queues the work; `done`
  // is called exactly once, with the answer (sequences in request order) or
  // the first error (NotFound for an unknown sequence, InvalidArgument for one of another model).
  // It runs on a worker thread, or on the calling thread before Start returns when no work is
  // waiting for the workers (on the host backend only for a call of at most kInlineHostUnits).
  // ResourceExhausted when the worker queue is full (`done` is then not called). With
  // `cancellation`, each sequence's work is skipped once the caller has gone or its deadline
  // passed (counted there); `done` then gets CANCELLED or DEADLINE_EXCEEDED.
  [[nodiscard]] absl::Status Start(const TenantId& tenant, std::shared_ptr<const Model> model,
                                   int layer, AttentionRequest request, AttentionDone done,
                                   std::shared_ptr<CallCancellation> cancellation = nullptr);
  // The same computation on the calling thread.
  [[nodiscard]] absl::StatusOr<AttentionAnswer> Run(const TenantId& tenant,
                                                    std::shared_ptr<const Model> model, int layer,
                                                    AttentionRequest request);

  // One call whose queries and outputs stay in the backend's device memory, on the calling
  // thread (not coalesced with other requests): the same snapshot, validation and kernels as
  // Run. Returns the attended tokens per sequence; the outputs are complete on return.
  // Unavailable where the backend's memory is the host's (CPU backend); InvalidArgument for the
  // layer, an empty batch, num_queries < 1, a null buffer or a sequence of another model;
  // NotFound for an unknown sequence. The queries are not checked for NaN/Inf (they stay on the
  // device): non-finite queries give non-finite outputs of that call only.
  [[nodiscard]] absl::StatusOr<std::vector<int>> RunOnDevice(const TenantId& tenant,
                                                             std::shared_ptr<const Model> model,
                                                             const DeviceAttentionCall& call);

  // Validation alone (shapes, finiteness and range of the queries, layer range).
  [[nodiscard]] static absl::Status Validate(const Model& model, int layer,
                                             const AttentionRequest& request);

 private:
  struct Batch;
  // A snapshot of `id`'s `layer`; InvalidArgument when it belongs to another model than `m`.
  absl::StatusOr<std::unique_ptr<SequenceSnapshot>> SnapshotOf(const TenantId& tenant,
                                                               const Model& m, int layer,
                                                               const std::string& id) const;
  absl::Status Prepare(Batch* batch);
  // Snapshots, then attends (device backends: coalesced) or queues each sequence's attention;
  // `on_caller` says it runs on the thread that called Start.
  void Begin(std::shared_ptr<Batch> batch, bool on_caller);
  void AttendOne(Batch* batch, size_t i);  // one sequence's rows (host backend)
  // Sequence i's attention in work units for fair queueing: 1 + tokens * query rows / 256.
  static constexpr uint64_t kAttentionUnitTokens = 256;
  static uint64_t AttentionUnits(const Batch& batch, size_t i);
  // The most work units a host-backend call may take on the thread that received it.
  static constexpr uint64_t kInlineHostUnits = 16;
  // Whether the batch's caller is gone; if so, counts `units` sequences as skipped.
  static bool StopIfCancelled(Batch* batch, size_t units);
  // Device backends: one backend call for a group of requests of one model and layer.
  absl::Status AttendBatched(absl::Span<Batch* const> group);
  // Queues a prepared request; the first thread to find no round running leads rounds that
  // take every waiting request, so concurrent requests share device calls.
  void AttendCoalesced(std::shared_ptr<Batch> batch);
  absl::StatusOr<AttentionAnswer> Finish(Batch* batch);

  SequenceStore* const store_;
  ComputeBackend* const backend_;
  WorkerPool* const workers_;
  absl::Mutex coalesce_mu_;
  bool coalescing_ ABSL_GUARDED_BY(coalesce_mu_) = false;
  std::atomic<int> inline_calls_{0};  // calls running on the thread that called Start
  std::vector<std::shared_ptr<Batch>> waiting_ ABSL_GUARDED_BY(coalesce_mu_);
};

}  // namespace kvpool::server
