// IngestEngine: the one path every append of K/V into the pool takes, whatever carries it
// (SequenceService.AppendKv and AppendDecode, the UCX transport, NCCL and CUDA IPC device
// pushes): header validation (append_checks.h), the store's transaction, staging with
// backpressure and rollback (ingest_append.h), the commit and the ingest counters. It is the
// single choke point where admission limits, quotas and tenants apply to every ingest: each
// call names the tenant it runs for.
//
//   IngestEngine engine(&store, &registry, &workers, config.max_append_tokens);
//   KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<IngestAppend> append,
//                           engine.Begin(tenant, header, std::move(options)));
//   KVPOOL_ASSIGN_OR_RETURN(AppendResult r, engine.AppendDecode(tenant, decode_request));
//   uint64_t tokens = engine.counters().ingested_tokens.load();
//
// Thread-safe.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "kvpool/v1/sequence_service.pb.h"
#include "server/ingest/ingest_append.h"
#include "server/ingest/ingest_counters.h"
#include "server/model_registry.h"
#include "server/sequence_store.h"
#include "server/tenant.h"
#include "server/worker_pool.h"

namespace kvpool::server {

class IngestEngine {
 public:
  // Every pointer outlives the engine.
  IngestEngine(SequenceStore* store, ModelRegistry* registry, WorkerPool* workers,
               int max_append_tokens);

  IngestEngine(const IngestEngine&) = delete;
  IngestEngine& operator=(const IngestEngine&) = delete;

  // Begins an append of `tenant` whose chunks arrive later (IngestAppend). ValidateAppendHeader's
  // errors, then SequenceStore::BeginAppend's (NotFound, FailedPrecondition, Aborted,
  // ResourceExhausted, InvalidArgument for token ids).
  [[nodiscard]] absl::StatusOr<std::shared_ptr<IngestAppend>> Begin(
      const TenantId& tenant, const ::kvpool::v1::AppendKvHeader& header, IngestOptions options);

  // Appends decode tokens, every layer's rows at once, staged and committed on the calling
  // thread (a worker). The payload is checked against the sequence's model before anything is
  // reserved. The header's errors (as Begin), the store's, InvalidArgument (payload sizes,
  // NaN/Inf), OutOfRange.
  [[nodiscard]] absl::StatusOr<AppendResult> AppendDecode(
      const TenantId& tenant, const ::kvpool::v1::AppendDecodeRequest& request);

  const IngestCounters& counters() const { return counters_; }
  int max_append_tokens() const { return max_append_tokens_; }

 private:
  SequenceStore* const store_;
  ModelRegistry* const registry_;
  WorkerPool* const workers_;
  const int max_append_tokens_;
  IngestCounters counters_;
};

}  // namespace kvpool::server
