// AttentionEngine: remote decode attention for a batch of sequences of one model and one layer.
//
// Per request: snapshot every sequence's layer (references keep its pages alive), then either
// (CPU) rotate all queries with M_K in one batched call, attend each sequence over its BF16 sink
// + recent rows and its INT2 history (per-tier passes merged exactly through the log-sum-exp) in
// parallel on the worker pool, and un-rotate all outputs with M_V^T in one batched call; or (a
// backend with batched_attention(), the GPU) hand the request, together with every other
// request of the same model and layer waiting at that moment, to one backend call that
// rotates, attends and un-rotates on the device. The output is in the engine's original basis
// with the natural-log LSE per query head.
//
//   AttentionEngine engine(&store, backend.get(), &workers);
//   KVPOOL_RETURN_IF_ERROR(engine.Start(tenant, model, /*layer=*/3, std::move(queries),
//       [](absl::StatusOr<std::vector<AttentionResult>> r) { ... }));   // runs on a worker
//   auto results = engine.Run(tenant, model, 3, queries);                 // same, on this thread
//
// Thread-safe.
#pragma once

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
#include "server/model_registry.h"
#include "server/sequence_store.h"
#include "server/worker_pool.h"

namespace kvpool::server {

struct AttentionQuery {
  std::string sequence_id;
  int num_queries = 1;
  std::vector<float> q;  // [num_queries][q_heads][head_dim], unrotated
};

struct AttentionResult {
  std::string sequence_id;
  std::vector<float> out;  // [num_queries][q_heads][head_dim], original basis
  std::vector<float> lse;  // [num_queries][q_heads], natural log; -inf for no tokens
  int attended_tokens = 0;
};

using AttentionDone = std::function<void(absl::StatusOr<std::vector<AttentionResult>>)>;

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
  // is called exactly once, on a worker thread, with the results in request order or the first
  // error (NotFound for an unknown sequence, InvalidArgument for one of another model).
  // ResourceExhausted when the worker queue is full (`done` is then not called).
  [[nodiscard]] absl::Status Start(const TenantId& tenant, std::shared_ptr<const Model> model,
                                   int layer, std::vector<AttentionQuery> queries,
                                   AttentionDone done);

  // The same computation on the calling thread.
  [[nodiscard]] absl::StatusOr<std::vector<AttentionResult>> Run(
      const TenantId& tenant, std::shared_ptr<const Model> model, int layer,
      std::vector<AttentionQuery> queries);

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
                                             const std::vector<AttentionQuery>& queries);
  // OutOfRange when a result over a non-empty sequence holds a non-finite output or LSE.
  [[nodiscard]] static absl::Status CheckFinite(const AttentionResult& result);

 private:
  struct Batch;
  // A snapshot of `id`'s `layer`; InvalidArgument when it belongs to another model than `m`.
  absl::StatusOr<std::unique_ptr<SequenceSnapshot>> SnapshotOf(const TenantId& tenant,
                                                               const Model& m, int layer,
                                                               const std::string& id) const;
  absl::Status Prepare(Batch* batch);
  void AttendOne(Batch* batch, size_t i);  // one sequence, rotated queries (CPU)
  // Batched backends (GPU): one backend call for a group of requests of one model and layer.
  absl::Status AttendBatched(absl::Span<Batch* const> group);
  // Queues a prepared request; the first thread to find no round running leads rounds that
  // take every waiting request, so concurrent requests share device calls.
  void AttendCoalesced(std::shared_ptr<Batch> batch);
  absl::StatusOr<std::vector<AttentionResult>> Finish(Batch* batch);

  SequenceStore* const store_;
  ComputeBackend* const backend_;
  WorkerPool* const workers_;
  absl::Mutex coalesce_mu_;
  bool coalescing_ ABSL_GUARDED_BY(coalesce_mu_) = false;
  std::vector<std::shared_ptr<Batch>> waiting_ ABSL_GUARDED_BY(coalesce_mu_);
};

}  // namespace kvpool::server
