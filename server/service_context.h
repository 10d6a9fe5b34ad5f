// ServiceContext: what the gRPC service implementations share (the core objects, the config and
// service counters), plus the conversion of absl::Status to grpc::Status at the RPC edge and the
// caller's tenant (authenticated by server/auth/).
//
//   ServiceContext ctx{...};
//   ModelServiceImpl models(&ctx);
//   return ToGrpcStatus(absl::NotFoundError("no model 'x'"));   // NOT_FOUND, same message
//
// The pointed-to objects are thread-safe; counters are atomics.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "proto/status.h"
#include "server/attention_combiner.h"
#include "server/attention_engine.h"
#include "server/auth/auth_processor.h"
#include "server/auth/call_identity.h"
#include "server/auth/tenants_source.h"
#include "server/backend.h"
#include "server/block_pool.h"
#include "server/call_cancellation.h"
#include "server/config.h"
#include "server/drain_state.h"
#include "server/model_registry.h"
#include "server/prefix_index.h"
#include "server/sequence_store.h"
#include "server/tenant.h"
#include "server/tenant_quotas.h"
#include "server/worker_pool.h"

namespace kvpool::server {

class IngestEngine;        // server/ingest/ingest_engine.h
class Admission;           // server/admission/admission.h
class Transport;           // server/transport/transport.h
class ConnectionListener;  // server/connection_listener.h
class TenantPolicy;        // server/admission/tenant_policy.h
class OwnershipGuard;      // server/scaleout/ownership_guard.h

// Ingest counters are the ingest engine's (IngestEngine::counters).
struct ServiceCounters {
  std::atomic<uint64_t> attention_calls{0};
  std::atomic<uint64_t> attention_sequences{0};
  // Attend, ReadKv and ReadBlocks calls stopped because their caller went away.
  CancellationCounters cancellation;
};

struct ServiceContext {
  const ServerConfig* config = nullptr;
  ComputeBackend* backend = nullptr;
  BlockPool* pool = nullptr;
  PrefixIndex* index = nullptr;
  ModelRegistry* registry = nullptr;
  SequenceStore* store = nullptr;
  WorkerPool* workers = nullptr;
  AttentionEngine* attention = nullptr;
  // Plan calls of same-host channels that arrive together share backend calls (null: each
  // runs alone).
  AttentionCombiner* combiner = nullptr;
  // Every append of K/V, whatever carries it, goes through it.
  IngestEngine* ingest = nullptr;
  // Tickets of reads and Attend calls (server/read_ticket.h); null: not capped.
  Admission* admission = nullptr;
  // Tenants' quotas and refusals, and where a (re)loaded tenants file installs them.
  const TenantQuotaTable* quotas = nullptr;
  TenantPolicy* tenant_policy = nullptr;
  // Data-plane transports offered in TransportService.Negotiate (grpc_inline first).
  std::vector<Transport*> transports;
  // The gRPC port's accept loop and its connection cap (null in servers without a port).
  const ConnectionListener* listener = nullptr;
  int max_connections = 0;
  // Scale-out ownership of sequences (null: not checked).
  const OwnershipGuard* ownership = nullptr;
  ServiceCounters counters;
  // The tenants file in force (null: none, every caller is the default tenant) and the calls
  // the auth processor refused.
  const TenantsSource* tenants = nullptr;
  AuthCounters auth;
  // Serving or draining (null: never drains).
  const DrainState* drain = nullptr;
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
};

// The cancellation of a call served with `context` (the caller cancelling, or its deadline),
// counted in `counters`. Valid until the call is finished.
inline std::shared_ptr<CallCancellation> CancellationOf(grpc::CallbackServerContext* context,
                                                        CancellationCounters* counters) {
  return std::make_shared<CallCancellation>(
      absl::FromChrono(context->deadline()), [context] { return context->IsCancelled(); },
      counters);
}

// OK, or UNAVAILABLE with reason DRAINING naming `what` while the daemon drains.
inline absl::Status RefuseIfDraining(const ServiceContext& ctx, absl::string_view what) {
  return ctx.drain == nullptr ? absl::OkStatus() : ctx.drain->RefuseIfDraining(what);
}

// The caller of `context`: the tenant and role its credentials prove (server/auth/), which the
// auth processor already checked against the method before the handler ran; the default
// tenant (as admin) when the daemon has no tenants file. Never from a request field.
inline Caller CallerOf(const ServiceContext& ctx, const grpc::ServerContextBase* context) {
  return CallerOfCall(ctx.tenants, *context);
}
inline TenantId TenantOf(const ServiceContext& ctx, const grpc::ServerContextBase* context) {
  return CallerOf(ctx, context).tenant;
}

}  // namespace kvpool::server
