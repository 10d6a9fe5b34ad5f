#include "server/server.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "grpc/grpc.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "server/admin_service.h"
#include "server/attention_service.h"
#include "server/auth/call_identity.h"
#include "server/auth/server_credentials.h"
#include "server/connection_listener.h"
#include "server/events/kv_event_hub.h"
#include "server/events/kv_event_service.h"
#include "server/health_server.h"
#include "server/ingest/ingest_engine.h"
#include "server/logging/request_id_interceptor.h"
#include "server/metrics/metrics_http_server.h"
#include "server/metrics/metrics_page.h"
#include "server/metrics/rpc_latency.h"
#include "server/model_config.h"
#include "server/model_service.h"
#include "server/read_service.h"
#include "server/scaleout/ownership_guard.h"
#include "server/sequence_service.h"
#include "server/stats_service.h"
#include "server/transport/cuda_ipc/cuda_ipc_transport.h"
#include "server/transport/grpc_inline/grpc_inline_transport.h"
#include "server/transport/nccl/nccl_transport.h"
#include "server/transport/shm/shm_transport.h"
#include "server/transport/transport_service.h"
#include "server/transport/ucx/ucx_transport.h"
#include "spdlog/spdlog.h"

namespace kvpool::server {
namespace {

// Each tenant's quota message by name (the tenant policy's input).
std::map<TenantId, v1::TenantQuota> QuotasOf(const TenantDirectory& tenants) {
  std::map<TenantId, v1::TenantQuota> quotas;
  for (const TenantIdentity& t : tenants.tenants()) quotas[t.name] = t.quota;
  return quotas;
}

constexpr const char* kServiceNames[] = {"kvpool.v1.ModelService",  "kvpool.v1.SequenceService",
                                         "kvpool.v1.ReadService",   "kvpool.v1.AttentionService",
                                         "kvpool.v1.StatsService",  "kvpool.v1.TransportService",
                                         "kvpool.v1.KvEventService"};

// Keeps freed heap memory for reuse (config.malloc_retain_bytes): without it every large
// message buffer (gRPC reads, parsed K/V payloads) is mapped fresh and faulted in page by page.
void TuneMalloc(size_t retain_bytes) {
#if defined(__GLIBC__)
  if (retain_bytes == 0) return;
  constexpr size_t kMaxMmapThreshold = size_t{32} << 20;  // glibc's limit on 64-bit
  const size_t clamp = std::min<size_t>(retain_bytes, INT32_MAX);
  mallopt(M_MMAP_THRESHOLD, static_cast<int>(std::min(clamp, kMaxMmapThreshold)));
  mallopt(M_TRIM_THRESHOLD, static_cast<int>(clamp));
#else
  (void)retain_bytes;
#endif
}

AdmissionLimits AdmissionLimitsOf(const ServerConfig& config) {
  AdmissionLimits l;
  l.max_streams_per_connection = config.max_streams_per_connection;
  l.max_streams_per_tenant = config.max_streams_per_tenant;
  l.max_reserved_bytes_per_connection = config.max_reserved_bytes_per_connection;
  l.max_reserved_bytes_per_tenant = config.max_reserved_bytes_per_tenant;
  l.max_reads_per_connection = config.max_reads_per_connection;
  l.max_reads_per_tenant = config.max_reads_per_tenant;
  l.max_read_bytes_per_connection = config.max_read_bytes_per_connection;
  l.max_read_bytes_per_tenant = config.max_read_bytes_per_tenant;
  l.idle_timeout = absl::Milliseconds(config.stream_idle_timeout_ms);
  l.total_timeout = absl::Milliseconds(config.stream_total_timeout_ms);
  // The reaper looks often enough that a timeout is acted on within a tenth of it.
  l.reap_period = std::clamp(l.idle_timeout / 10, absl::Milliseconds(10), absl::Milliseconds(100));
  return l;
}

}  // namespace

void KvpoolServer::SetHealth(bool serving) {
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  if (health != nullptr) {
    health->SetServingStatus(serving);  // overall ("") and every service
    for (const char* name : kServiceNames) health->SetServingStatus(name, serving);
  }
  if (health_server_ != nullptr) {
    std::vector<std::string> names = {""};
    names.insert(names.end(), std::begin(kServiceNames), std::end(kServiceNames));
    health_server_->SetServing(names, serving);
  }
}

absl::StatusOr<std::unique_ptr<KvpoolServer>> KvpoolServer::Start(
    const ServerConfig& config, const ServiceFactory& extra_service) {
  KVPOOL_RETURN_IF_ERROR(config.Validate());
  TuneMalloc(config.malloc_retain_bytes);
  auto s = std::unique_ptr<KvpoolServer>(new KvpoolServer());
  s->config_ = config;
  KVPOOL_ASSIGN_OR_RETURN(s->backend_, CreateBackend(config.device, config.cuda_tuning));
  if (config.pool_auto && s->backend_->device_free_bytes() > 0) {
    // Sized from host memory by default; a GPU pool takes its share of the GPU's free memory.
    s->config_.pool_bytes = PoolBytesOf(
        s->backend_->device_free_bytes(), config.pool_fraction,
        std::min(config.pool_max_bytes, s->backend_->max_arena_bytes()), config.slab_bytes);
  }
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<Arena> arena,
                          s->backend_->AllocateArena(s->config_.pool_bytes));
  KVPOOL_ASSIGN_OR_RETURN(s->pool_, BlockPool::Create(std::move(arena), config.slab_bytes));
  s->index_ = std::make_unique<PrefixIndex>(s->pool_.get());
  s->kv_events_ = std::make_unique<KvEventHub>(s->index_.get(), config.kv_events_max_subscribers);
  s->registry_ = std::make_unique<ModelRegistry>(s->pool_.get(), &s->quotas_);
  s->store_ = std::make_unique<SequenceStore>(s->pool_.get(), s->index_.get(), s->backend_.get(),
                                              config.sequence_ttl, &s->quotas_);
  s->reaper_ = std::make_unique<SequenceReaper>(s->store_.get(), SequenceReaper::kCheckPeriod);
  s->workers_ = std::make_unique<WorkerPool>(config.worker_threads, config.worker_queue);
  s->workers_->SetFairness(config.fair_compute);
  s->attention_ =
      std::make_unique<AttentionEngine>(s->store_.get(), s->backend_.get(), s->workers_.get());
  if (config.transport_idle_timeout_ms > 0) {
    spdlog::warn(
        "--transport_idle_timeout_ms is deprecated: use --stream_idle_timeout_ms ({} ms "
        "now applies to every stream and push, gRPC or UCX)",
        config.stream_idle_timeout_ms);
  }
  s->admission_ = std::make_unique<Admission>(AdmissionLimitsOf(config));
  s->ingest_ =
      std::make_unique<IngestEngine>(s->store_.get(), s->registry_.get(), s->workers_.get(),
                                     config.max_append_tokens, s->admission_.get());
  s->tenant_policy_ =
      std::make_unique<TenantPolicy>(s->pool_.get(), &s->quotas_, s->workers_.get());
  s->codec_health_ = std::make_unique<CodecHealth>(config.codec_health_sample_every);
  s->ingest_->SetCodecHealth(s->codec_health_.get());
  ServiceContext& ctx = s->ctx_;
  ctx.quotas = &s->quotas_;
  ctx.tenant_policy = s->tenant_policy_.get();
  ctx.config = &s->config_;
  ctx.backend = s->backend_.get();
  ctx.pool = s->pool_.get();
  ctx.index = s->index_.get();
  ctx.registry = s->registry_.get();
  ctx.store = s->store_.get();
  ctx.workers = s->workers_.get();
  ctx.attention = s->attention_.get();
  s->combiner_ = std::make_unique<AttentionCombiner>(s->backend_.get());
  ctx.combiner = s->combiner_.get();
  ctx.ingest = s->ingest_.get();
  ctx.admission = s->admission_.get();
  ctx.drain = &s->drain_;
  s->ingest_->SetDrainState(&s->drain_);
  if (!config.tenants_file.empty()) {
    KVPOOL_ASSIGN_OR_RETURN(
        s->tenants_,
        TenantsSource::Open(config.tenants_file, absl::Milliseconds(config.tenants_poll_ms)));
    // The quotas of the file's tenants: a table that does not fit the pool refuses the start.
    KVPOOL_RETURN_IF_ERROR(s->tenant_policy_->SetTenantQuotas(QuotasOf(*s->tenants_->current())));
    KvpoolServer* server = s.get();
    s->tenants_->OnChange([server](const TenantDirectory& before, const TenantDirectory& after) {
      for (const TenantIdentity& t : before.tenants()) {
        if (after.Find(t.name) == nullptr) server->ReleaseTenant(t.name);
      }
      // Calls that raced a removal ran in nobody's namespace: nothing there is kept either.
      server->ReleaseTenant(kUnresolvedTenant);
      // A reloaded table that does not fit the pool leaves the quotas in force as they were.
      const absl::Status quotas = server->tenant_policy_->SetTenantQuotas(QuotasOf(after));
      if (!quotas.ok())
        spdlog::error("tenants file reload: quotas kept: {}", std::string(quotas.message()));
    });
    ctx.tenants = s->tenants_.get();
    spdlog::info("tenants file {}: {} tenants", config.tenants_file,
                 s->tenants_->current()->tenants().size());
  }
  // Before anything serves: every replica starts with the same models, or does not start.
  if (!config.model_config.empty())
    KVPOOL_RETURN_IF_ERROR(LoadModelConfig(config.model_config, ctx));
  s->transports_.push_back(std::make_unique<GrpcInlineTransport>());
  if (config.transports == "ucx") {
    absl::StatusOr<std::unique_ptr<UcxTransport>> ucx =
        UcxTransport::Create(&ctx, UcxTransportOptionsFromConfig(config));
    if (ucx.ok()) {
      spdlog::info("data plane: UCX ({}), {} MiB staging in {} KiB messages",
                   (*ucx)->Stats().transports, config.transport_staging_bytes >> 20,
                   config.transport_message_bytes >> 10);
      s->transports_.push_back(*std::move(ucx));
    } else {
      spdlog::warn("data plane: UCX unavailable, offering grpc_inline only: {}",
                   ucx.status().ToString());
    }
  }
  if (config.shm_max_sessions > 0) {
    ShmTransportOptions shm;
    shm.socket_dir = config.shm_socket_dir;
    shm.max_sessions = static_cast<size_t>(config.shm_max_sessions);
    shm.max_region_bytes = config.shm_max_region_bytes;
    shm.hello_timeout = absl::Milliseconds(config.transport_hello_timeout_ms);
    absl::StatusOr<std::unique_ptr<Transport>> t = NewShmTransport(&ctx, shm);
    if (t.ok()) {
      spdlog::info("data plane: shared-memory attention channels (up to {})",
                   config.shm_max_sessions);
      s->transports_.push_back(*std::move(t));
    } else {
      spdlog::warn("data plane: shared memory unavailable: {}", t.status().ToString());
    }
  }
  if (s->backend_->device() >= 0) {
    // A pool on a GPU also takes pushes GPU to GPU, and serves attention channels over NCCL.
    NcclTransportOptions nccl;
    nccl.watch_timeout = absl::Milliseconds(config.transport_hello_timeout_ms);
    std::vector<absl::StatusOr<std::unique_ptr<Transport>>> gpu;
    gpu.push_back(NewNcclTransport(&ctx, nccl));
    gpu.push_back(NewCudaIpcTransport(&ctx, CudaIpcTransportOptions{}));
    for (absl::StatusOr<std::unique_ptr<Transport>>& t : gpu) {
      if (t.ok()) {
        spdlog::info("data plane: {} on cuda:{}", std::string((*t)->name()), s->backend_->device());
        s->transports_.push_back(*std::move(t));
      } else {
        spdlog::warn("data plane: {}", t.status().ToString());
      }
    }
  }
  for (const auto& t : s->transports_) ctx.transports.push_back(t.get());
  KVPOOL_ASSIGN_OR_RETURN(s->ownership_,
                          OwnershipGuard::Start(ScaleOutConfigFromFlags(), s->config_.pool_bytes));
  ctx.ownership = s->ownership_.get();
  s->model_service_ = std::make_unique<ModelServiceImpl>(&ctx);
  s->sequence_service_ = std::make_unique<SequenceServiceImpl>(&ctx);
  s->read_service_ = std::make_unique<ReadServiceImpl>(&ctx);
  s->attention_service_ = std::make_unique<AttentionServiceImpl>(&ctx);
  s->stats_service_ = std::make_unique<StatsServiceImpl>(&ctx);
  s->transport_service_ = std::make_unique<TransportServiceImpl>(&ctx);
  s->kv_event_service_ =
      std::make_unique<KvEventServiceImpl>(&s->ctx_, s->kv_events_.get(), config.kv_events_buffer);
  {
    KvpoolServer* server = s.get();
    const auto grace = std::chrono::milliseconds(config.shutdown_grace_ms);
    s->admin_service_ = std::make_unique<AdminServiceImpl>(
        &ctx, AdminActions{[server, grace] { return server->Drain(grace); },
                           [server] { return server->ReloadTenants(); }});
  }

  // The daemon accepts its own connections (server/connection_listener.h) and hands them to
  // gRPC: it owns its descriptor budget.
  KVPOOL_ASSIGN_OR_RETURN(const int max_connections,
                          ConnectionCap(RaiseOpenFileLimit(), config.max_connections));
  KVPOOL_ASSIGN_OR_RETURN(s->listener_, ConnectionListener::Bind(config.listen));
  s->port_ = s->listener_->port();
  ctx.listener = s->listener_.get();
  ctx.max_connections = max_connections;
  std::shared_ptr<grpc::AuthMetadataProcessor> processor;
  if (ctx.tenants != nullptr) processor = std::make_shared<AuthProcessor>(ctx.tenants, &ctx.auth);
  KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                          ServerCredentialsFor(config, processor));
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  s->acceptor_ = builder.experimental().AddExternalConnectionAcceptor(
      grpc::ServerBuilder::experimental_type::ExternalConnectionType::FROM_FD, credentials);
  builder.SetMaxReceiveMessageSize(static_cast<int>(config.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(config.max_message_bytes));
  // A per-stream window large enough that the next AppendKv chunk (256 KiB of K plus V) can
  // arrive while the previous one is being staged.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 4 << 20);
  // Every call's latency by method and status, in one place (the metrics endpoint shows it).
  s->rpc_latency_ = std::make_unique<RpcLatency>();
  s->attend_latency_ = std::make_unique<RpcLatency>();
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  // First: the request id is set while the other interceptors and the handler run.
  interceptors.push_back(NewRequestIdInterceptorFactory());
  interceptors.push_back(
      NewRpcLatencyInterceptorFactory(s->rpc_latency_.get(), s->attend_latency_.get()));
  interceptors.push_back(NewInFlightInterceptorFactory(&s->drain_));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  // Each call keeps the caller its first lookup resolved (server/auth/call_identity.h).
  if (ctx.tenants != nullptr) builder.SetContextAllocator(std::make_unique<CallContextAllocator>());
  builder.RegisterService(s->model_service_.get());
  builder.RegisterService(s->sequence_service_.get());
  builder.RegisterService(s->read_service_.get());
  builder.RegisterService(s->attention_service_.get());
  builder.RegisterService(s->stats_service_.get());
  builder.RegisterService(s->transport_service_.get());
  builder.RegisterService(s->kv_event_service_.get());
  builder.RegisterService(s->admin_service_.get());
  if (extra_service != nullptr) {
    s->extra_service_ = extra_service(&ctx);
    builder.RegisterService(s->extra_service_.get());
  }
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot serve on ", config.listen));
  }
  s->listener_->Start(s->acceptor_.get(), max_connections);
  s->scrubber_ = std::make_unique<Scrubber>(
      s->store_.get(), s->backend_.get(), s->pool_.get(),
      ScrubberOptions{config.scrub_period, config.scrub_max_bytes_per_second}, s->index_.get(),
      s->registry_.get());
  s->scrubber_->Start();
  if (s->tenants_ != nullptr) s->tenants_->Start();
  if (!config.metrics_listen.empty()) {
    const MetricsSources sources{&s->ctx_,
                                 s->stats_service_.get(),
                                 s->rpc_latency_.get(),
                                 s->attend_latency_.get(),
                                 s->kv_events_.get(),
                                 s->codec_health_.get()};
    const bool tenant_labels = config.metrics_tenant_labels;
    KVPOOL_ASSIGN_OR_RETURN(
        s->metrics_http_, MetricsHttpServer::Start(config.metrics_listen, [sources, tenant_labels] {
          return RenderMetricsPage(sources, tenant_labels);
        }));
    spdlog::info("metrics on http://{}:{}/metrics (plaintext)",
                 config.metrics_listen.substr(0, config.metrics_listen.rfind(':')),
                 s->metrics_http_->port());
  }
  if (!config.health_listen.empty()) {
    KVPOOL_ASSIGN_OR_RETURN(s->health_server_, HealthServer::Start(config.health_listen));
    spdlog::info("health on {}:{} (plaintext, grpc.health.v1 only)",
                 config.health_listen.substr(0, config.health_listen.rfind(':')),
                 s->health_server_->port());
  }
  spdlog::info("serving on port {}, at most {} connections", s->port_, max_connections);
  s->SetHealth(true);
  // A poisoned device: NOT_SERVING at once (the backend refuses every compute call), then, after
  // the grace, a shutdown that makes the daemon exit with kDeviceFailedExitStatus.
  KvpoolServer* server = s.get();
  const absl::Duration grace = config.device_failure_exit_grace;
  s->device_monitor_ = std::make_unique<DeviceHealthMonitor>(
      s->backend_.get(), DeviceHealthMonitor::Options{config.device_check_period, grace},
      [server, grace](const absl::Status& failure) {
        spdlog::critical("{}: health NOT_SERVING, compute calls answer UNAVAILABLE; exiting in {}",
                         std::string(failure.message()), absl::FormatDuration(grace));
        server->SetHealth(false);
      },
      [server] {
        spdlog::critical("exiting (status {}) after the device failure", kDeviceFailedExitStatus);
        server->exit_status_.store(kDeviceFailedExitStatus);
        // Tearing down what a poisoned context holds (NCCL channels, say) may hang: the process
        // ends with the same status in any case.
        std::thread([] {
          std::this_thread::sleep_for(std::chrono::seconds(30));
          std::_Exit(kDeviceFailedExitStatus);
        }).detach();
        server->Shutdown(std::chrono::milliseconds(0));
      });
  s->device_monitor_->Start();
  return s;
}

KvpoolServer::~KvpoolServer() {
  Shutdown(std::chrono::milliseconds(0));
  Wait();
  std::thread drain;
  {
    absl::MutexLock lock(&shutdown_mu_);
    drain = std::move(drain_thread_);
  }
  if (drain.joinable()) drain.join();  // it ends once the shutdown above ended every call
}

bool KvpoolServer::Drain(std::chrono::milliseconds grace) {
  const absl::Time deadline = absl::Now() + absl::FromChrono(grace);
  absl::MutexLock lock(&shutdown_mu_);
  if (shut_down_ || server_ == nullptr || !drain_.Begin(deadline)) return false;
  SetHealth(false);
  spdlog::info(
      "draining: health NOT_SERVING, new sequences, appends and pushes refused (DRAINING); "
      "{} calls in flight get up to {} ms",
      drain_.in_flight(), grace.count());
  drain_thread_ = std::thread([this, deadline] {
    if (drain_.AwaitIdle(deadline)) {
      spdlog::info("drained: no call in flight; stopping");
    } else {
      spdlog::warn("drain grace over: cancelling {} calls in flight", drain_.in_flight());
    }
    // What is left are subscriptions (KV events, session watches), or calls past the grace.
    Shutdown(std::chrono::milliseconds(0));
  });
  return true;
}

void KvpoolServer::Shutdown(std::chrono::milliseconds grace) {
  {
    absl::MutexLock lock(&shutdown_mu_);
    if (shut_down_ || server_ == nullptr) return;
    shut_down_ = true;
  }
  SetHealth(false);
  if (tenants_ != nullptr) tenants_->Stop();
  if (metrics_http_ != nullptr) metrics_http_->Stop();
  listener_->Stop();
  scrubber_->Stop();
  for (const auto& t : transports_) t->Shutdown();  // rolls back open pushes
  server_->Shutdown(std::chrono::system_clock::now() + grace);
  if (health_server_ != nullptr) health_server_->Shutdown();
  workers_->Shutdown();
}

absl::Status KvpoolServer::ReloadTenants() {
  if (tenants_ == nullptr) return absl::FailedPreconditionError("no --tenants_file");
  return tenants_->Reload();
}

void KvpoolServer::ReleaseTenant(const TenantId& tenant) {
  size_t models = 0, sequences = 0, bytes = 0;
  for (const auto& m : registry_->List(tenant)) {
    if (!registry_->Remove(tenant, m->id).ok()) continue;  // deleted meanwhile
    const auto [released, freed] = store_->ReleaseModel(tenant, m->id);
    bytes += freed + index_->DropModel(tenant, m->id);
    sequences += released;
    ++models;
  }
  if (models == 0) return;
  spdlog::info(
      "tenant '{}' removed from the tenants file: {} models and {} sequences released, "
      "{} bytes freed",
      tenant, models, sequences, bytes);
}

int KvpoolServer::health_port() const {
  return health_server_ == nullptr ? 0 : health_server_->port();
}

int KvpoolServer::metrics_port() const {
  return metrics_http_ == nullptr ? 0 : metrics_http_->port();
}

std::shared_ptr<grpc::Channel> KvpoolServer::InProcessChannel() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(config_.max_message_bytes));
  args.SetMaxSendMessageSize(static_cast<int>(config_.max_message_bytes));
  return server_->InProcessChannel(args);
}

void KvpoolServer::Wait() {
  if (server_ != nullptr) server_->Wait();
}

}  // namespace kvpool::server
