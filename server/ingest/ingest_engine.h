// IngestEngine: the one path every append of K/V into the pool takes, whatever carries it
// (SequenceService.AppendKv and AppendDecode, the UCX transport, NCCL and CUDA IPC device
// pushes): header validation (append_checks.h), the store's transaction, staging with
// backpressure and rollback (ingest_append.h), the commit and the ingest counters. It is the
// single choke point where admission limits, quotas and tenants apply to every ingest: each
// call names the tenant it runs for and the client connection it came on, and holds an admission
// ticket (server/admission/) for as long as it runs: it counts against the caps on open streams
// and reserved bytes, its reserved pages count as they are reserved, and a stream that makes no
// progress for the idle timeout (or runs past the total one) is rolled back, releasing its pages
// and the sequence's append lock.
//
//   IngestEngine engine(&store, &registry, &workers, config.max_append_tokens, &admission);
//   KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<IngestAppend> append,
//                           engine.Begin(tenant, peer, header, std::move(options)));
//   KVPOOL_ASSIGN_OR_RETURN(AppendResult r, engine.AppendDecode(tenant, peer, decode_request));
//   uint64_t tokens = engine.counters().ingested_tokens.load();
//
// Thread-safe.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kvpool/v1/sequence_service.pb.h"
#include "server/admission/admission.h"
#include "server/drain_state.h"
#include "server/ingest/ingest_append.h"
#include "server/ingest/ingest_counters.h"
#include "server/model_registry.h"
#include "server/sequence_store.h"
#include "server/tenant.h"
#include "server/worker_pool.h"

namespace kvpool::server {

class IngestEngine {
 public:
  // Every pointer outlives the engine; without `admission` nothing is capped or expires.
  IngestEngine(SequenceStore* store, ModelRegistry* registry, WorkerPool* workers,
               int max_append_tokens, Admission* admission = nullptr);

  IngestEngine(const IngestEngine&) = delete;
  IngestEngine& operator=(const IngestEngine&) = delete;

  // Opens the admission ticket of a stream of `tenant` on `connection` (gRPC's peer string, a
  // transport session) for `what` (named in errors) before its first message: `on_expire` ends
  // the stream (Admission::Open). RESOURCE_EXHAUSTED with reason LIMIT over a stream cap;
  // UNAVAILABLE with reason DRAINING while the daemon drains; null without an admission.
  [[nodiscard]] absl::StatusOr<std::shared_ptr<Admission::Ticket>> Admit(
      const TenantId& tenant, const std::string& connection, const std::string& what,
      Admission::OnExpire on_expire);

  // Begins an append of `tenant` on `connection` whose chunks arrive later (IngestAppend). It
  // holds options.ticket, or a ticket of its own whose expiry aborts it. ValidateAppendHeader's
  // errors, RESOURCE_EXHAUSTED with reason LIMIT (a cap on streams or reserved bytes), then
  // SequenceStore::BeginAppend's (NotFound, FailedPrecondition, Aborted, ResourceExhausted,
  // InvalidArgument for token ids).
  [[nodiscard]] absl::StatusOr<std::shared_ptr<IngestAppend>> Begin(
      const TenantId& tenant, const std::string& connection,
      const ::kvpool::v1::AppendKvHeader& header, IngestOptions options);

  // Appends decode tokens, every layer's rows at once, staged and committed on the calling
  // thread (a worker). The payload is checked against the sequence's model before anything is
  // reserved. The header's errors (as Begin), the store's, InvalidArgument (payload sizes,
  // NaN/Inf), OutOfRange.
  [[nodiscard]] absl::StatusOr<AppendResult> AppendDecode(
      const TenantId& tenant, const std::string& connection,
      const ::kvpool::v1::AppendDecodeRequest& request);

  // Refuses every later admission (new streams, pushes, decode appends) while `drain` is
  // draining (null: never); set before serving.
  void SetDrainState(const DrainState* drain) { drain_ = drain; }

  // Samples arriving rows of every later append into `health` (null: none); set before serving.
  void SetCodecHealth(CodecHealth* health) { codec_health_ = health; }

  const IngestCounters& counters() const { return counters_; }
  int max_append_tokens() const { return max_append_tokens_; }
  // Null when nothing is capped.
  const Admission* admission() const { return admission_; }

 private:
  SequenceStore* const store_;
  ModelRegistry* const registry_;
  WorkerPool* const workers_;
  const int max_append_tokens_;
  Admission* const admission_;
  CodecHealth* codec_health_ = nullptr;
  const DrainState* drain_ = nullptr;
  IngestCounters counters_;
};

}  // namespace kvpool::server
