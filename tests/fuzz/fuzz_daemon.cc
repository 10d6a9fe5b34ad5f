#include "tests/fuzz/fuzz_daemon.h"

#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "kvpool/v1/model_service.grpc.pb.h"
#include "kvpool/v1/sequence_service.grpc.pb.h"
#include "proto/status.h"
#include "spdlog/spdlog.h"
#include "tests/fuzz/fuzz_requests.h"

namespace kvpool::fuzz {

namespace v1 = ::kvpool::v1;

namespace {

FuzzDaemon* g_daemon = nullptr;

}  // namespace

FuzzDaemon& FuzzDaemon::Get(const std::string& transports) {
  if (g_daemon == nullptr) {
    g_daemon = new FuzzDaemon();
    absl::Status s = g_daemon->Start(transports);
    if (s.ok()) s = g_daemon->Reset();
    if (!s.ok()) {
      std::fprintf(stderr, "fuzz daemon: cannot start: %s\n", s.ToString().c_str());
      std::abort();
    }
    // Shut down cleanly at exit, before gRPC's own static state goes away.
    std::atexit([] {
      delete g_daemon;
      g_daemon = nullptr;
    });
  }
  return *g_daemon;
}

absl::Status FuzzDaemon::Start(const std::string& transports) {
  server::ServerConfig cfg;
  cfg.listen = "127.0.0.1:0";
  cfg.pool_bytes = size_t{32} << 20;
  cfg.slab_bytes = size_t{256} << 10;
  cfg.worker_threads = 2;
  cfg.transports = transports;
  cfg.log_level = "error";
  cfg.malloc_retain_bytes = 0;  // leave glibc's (and the sanitizers') allocator alone
  spdlog::set_level(spdlog::level::err);
  absl::StatusOr<std::unique_ptr<server::KvpoolServer>> s = server::KvpoolServer::Start(cfg);
  if (!s.ok()) return s.status();
  server_ = *std::move(s);
  channel_ = server_->InProcessChannel();
  return absl::OkStatus();
}

void FuzzDaemon::SetDeadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() + kCallDeadline);
}

absl::Status FuzzDaemon::Reset() {
  auto models = v1::ModelService::NewStub(channel_);
  v1::ListModelsResponse list;
  {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    if (absl::Status s = FromGrpcStatus(models->ListModels(&ctx, {}, &list), "ListModels");
        !s.ok()) {
      return s;
    }
  }
  for (const v1::ModelInfo& m : list.models()) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::DeleteModelRequest req;
    req.set_model_id(m.model_id());
    req.set_force(true);
    v1::DeleteModelResponse resp;
    if (absl::Status s = FromGrpcStatus(models->DeleteModel(&ctx, req, &resp), "DeleteModel");
        !s.ok()) {
      return s;
    }
  }
  return BuildBaseState();
}

absl::Status FuzzDaemon::BuildBaseState() {
  auto models = v1::ModelService::NewStub(channel_);
  auto sequences = v1::SequenceService::NewStub(channel_);
  {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::RegisterModelResponse resp;
    auto w = models->RegisterModel(&ctx, &resp);
    w->Write(ModelSpecRequest(kModelId));
    w->WritesDone();
    if (absl::Status s = FromGrpcStatus(w->Finish(), "RegisterModel"); !s.ok()) return s;
  }
  for (const char* id : {kSequenceId, kEmptySequenceId}) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::CreateSequenceRequest req;
    req.set_model_id(kModelId);
    req.set_sequence_id(id);
    v1::CreateSequenceResponse resp;
    if (absl::Status s =
            FromGrpcStatus(sequences->CreateSequence(&ctx, req, &resp), "CreateSequence");
        !s.ok()) {
      return s;
    }
  }
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::AppendKvResponse resp;
  auto w = sequences->AppendKv(&ctx, &resp);
  for (const v1::AppendKvRequest& r :
       AppendRequests(kSequenceId, 0, kBaseTokens, /*token_ids=*/true, /*end_of_prefill=*/true)) {
    if (!w->Write(r)) break;
  }
  w->WritesDone();
  return FromGrpcStatus(w->Finish(), "AppendKv");
}

absl::StatusOr<v1::GetStatsResponse> FuzzDaemon::StateSnapshot() {
  auto stats = v1::StatsService::NewStub(channel_);
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::GetStatsRequest req;
  req.set_include_sequences(true);
  v1::GetStatsResponse resp;
  if (absl::Status s = FromGrpcStatus(stats->GetStats(&ctx, req, &resp), "GetStats"); !s.ok())
    return s;
  resp.clear_service();
  resp.clear_transport();
  // Counters since start (refusals), and tickets a finished stream gives back when gRPC is done
  // with it, which may be just after its client saw the answer.
  resp.clear_admission();
  resp.mutable_pool()->clear_evicted_units();
  // Prefix lookups count every LookupPrefix that reaches the index, read-only ones included.
  resp.mutable_pool()->clear_prefix_lookups();
  resp.mutable_pool()->clear_prefix_lookup_tokens();
  resp.mutable_pool()->clear_prefix_hit_tokens();
  // Counters of calls stopped and leases, and the time since each sequence's last use, move
  // with any read or call, successful or not.
  resp.clear_lifecycle();
  for (v1::SequenceStats& s : *resp.mutable_sequences()) s.clear_idle_ms();
  // Calls in flight include those gRPC is still finishing after their client saw the answer;
  // the serving state itself stays compared (nothing the fuzzer sends may start a drain).
  resp.mutable_serving()->clear_in_flight_calls();
  // A tenant's refusals and its work in the worker pool count calls, not state.
  for (v1::TenantUsage& t : *resp.mutable_tenants()) {
    t.clear_rejected_pool_bytes();
    t.clear_rejected_sequences();
    t.clear_rejected_models();
    t.clear_queued_tasks();
    t.clear_queued_units();
    t.clear_served_tasks();
    t.clear_served_units();
  }
  return resp;
}

}  // namespace kvpool::fuzz
