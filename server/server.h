// KvpoolServer: assembles kvpoold from a ServerConfig — backend, block pool, prefix index, model
// registry, sequence store, worker pool, attention engine, ingest engine, the data-plane
// transports (server/transport/: grpc_inline always, UCX unless --transports='', NCCL and CUDA
// IPC when the pool is on a GPU), the six kvpool.v1
// services, gRPC's health service (grpc.health.v1) and reflection — and runs the gRPC server.
//
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<KvpoolServer> server, KvpoolServer::Start(config));
//   std::cout << "port " << server->port();
//   ...
//   server->Drain(std::chrono::seconds(5));      // from any thread, e.g. on SIGTERM
//   server->Wait();
//
// Thread-safe: Shutdown may race with Wait; everything else is set up before Start returns.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "server/admission/admission.h"
#include "server/admission/tenant_policy.h"
#include "server/config.h"
#include "server/device_health_monitor.h"
#include "server/drain_state.h"
#include "server/scrubber.h"
#include "server/sequence_reaper.h"
#include "server/service_context.h"

namespace kvpool::server {

class ModelServiceImpl;
class SequenceServiceImpl;
class ReadServiceImpl;
class AttentionServiceImpl;
class StatsServiceImpl;
class TransportServiceImpl;
class Transport;
class ConnectionListener;
class RpcLatency;
class KvEventHub;
class CodecHealth;
class KvEventServiceImpl;
class MetricsHttpServer;
class OwnershipGuard;
class AdminServiceImpl;
class HealthServer;

class KvpoolServer {
 public:
  // Builds everything and starts listening. InvalidArgument (config), Unavailable (cannot bind
  // the address), ResourceExhausted (pool memory).
  // `extra_service`, when set, builds one more service to register (a test daemon's).
  using ServiceFactory = std::function<std::unique_ptr<grpc::Service>(ServiceContext*)>;
  static absl::StatusOr<std::unique_ptr<KvpoolServer>> Start(
      const ServerConfig& config, const ServiceFactory& extra_service = nullptr);
  ~KvpoolServer();

  KvpoolServer(const KvpoolServer&) = delete;
  KvpoolServer& operator=(const KvpoolServer&) = delete;

  // The configuration in effect (the pool size resolved for the backend).
  const ServerConfig& config() const { return config_; }
  // The bound port (useful with a :0 listen address).
  int port() const { return port_; }
  // The bound port of the metrics endpoint (--metrics_listen); 0 without one.
  int metrics_port() const;
  // The bound port of the plaintext health port (--health_listen); 0 without one.
  int health_port() const;
  ServiceContext* context() { return &ctx_; }
  // Where the tenants file's quotas are installed, at start and on every reload.
  TenantPolicy* tenant_policy() { return tenant_policy_.get(); }
  // A channel to this server inside the process (no socket), for tests and fuzz targets. Its
  // messages are limited to max_message_bytes like the listening port's.
  std::shared_ptr<grpc::Channel> InProcessChannel();

  // The one drain (docs/operations.md, "Drain"), begun by SIGTERM and AdminService.Drain alike:
  // health NOT_SERVING at once, new sequences, appends and pushes refused with UNAVAILABLE and
  // reason DRAINING, then, once no call is in flight (DrainState) or after `grace`, Shutdown:
  // Wait returns and the daemon exits with status 0. Returns at once; false when a drain or a
  // shutdown was already under way.
  bool Drain(std::chrono::milliseconds grace);

  // Marks health NOT_SERVING, stops accepting calls, lets in-flight calls finish for up to
  // `grace` then cancels them, and drains the worker pool. Idempotent.
  void Shutdown(std::chrono::milliseconds grace);
  // Blocks until the server has shut down.
  void Wait();
  // The process exit status the daemon should end with: 0, or kDeviceFailedExitStatus when it
  // shut itself down because its device failed (a poisoned CUDA context).
  static constexpr int kDeviceFailedExitStatus = 3;
  int exit_status() const { return exit_status_.load(); }

  // Re-reads --tenants_file now (SIGHUP); FailedPrecondition without one, else as
  // TenantsSource::Reload. Tenants it removes lose their models and sequences.
  absl::Status ReloadTenants();
  // Releases every model and sequence of `tenant` (it left the tenants file).
  void ReleaseTenant(const TenantId& tenant);

 private:
  KvpoolServer() = default;
  // Health of the daemon and of each kvpool service, on its port and on the health port.
  void SetHealth(bool serving);

  ServerConfig config_;
  // Outlives every stream's ticket (destroyed after the services, transports and workers).
  std::unique_ptr<Admission> admission_;
  TenantQuotaTable quotas_;  // read by the store and the registry: outlives them
  std::unique_ptr<ComputeBackend> backend_;
  std::unique_ptr<BlockPool> pool_;
  std::unique_ptr<PrefixIndex> index_;
  std::unique_ptr<KvEventHub> kv_events_;  // observes index_ (gone first)
  std::unique_ptr<ModelRegistry> registry_;
  std::unique_ptr<SequenceStore> store_;
  std::unique_ptr<SequenceReaper> reaper_;  // releases the store's expired leases
  std::unique_ptr<WorkerPool> workers_;
  std::unique_ptr<AttentionEngine> attention_;
  std::unique_ptr<AttentionCombiner> combiner_;
  std::unique_ptr<CodecHealth> codec_health_;  // sampled by ingest_
  std::unique_ptr<IngestEngine> ingest_;
  std::unique_ptr<TenantPolicy> tenant_policy_;
  std::unique_ptr<Scrubber> scrubber_;                  // stopped before what it reads goes away
  std::vector<std::unique_ptr<Transport>> transports_;  // shut down before the workers drain
  ServiceContext ctx_;
  // Read by the auth processor (owned by server_, destroyed first) and the services.
  std::unique_ptr<TenantsSource> tenants_;
  std::unique_ptr<OwnershipGuard> ownership_;  // scale-out (docs/scale-out.md)
  std::unique_ptr<ModelServiceImpl> model_service_;
  std::unique_ptr<SequenceServiceImpl> sequence_service_;
  std::unique_ptr<ReadServiceImpl> read_service_;
  std::unique_ptr<AttentionServiceImpl> attention_service_;
  std::unique_ptr<StatsServiceImpl> stats_service_;
  std::unique_ptr<TransportServiceImpl> transport_service_;
  std::unique_ptr<KvEventServiceImpl> kv_event_service_;
  std::unique_ptr<AdminServiceImpl> admin_service_;
  std::unique_ptr<grpc::Service> extra_service_;
  std::unique_ptr<ConnectionListener> listener_;  // accepts connections for server_
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor_;
  DrainState drain_;  // counted by an interceptor of server_: outlives it
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<HealthServer> health_server_;      // --health_listen
  std::unique_ptr<RpcLatency> rpc_latency_;          // fed by an interceptor of server_
  std::unique_ptr<RpcLatency> attend_latency_;       // the same, Attend by batch size
  std::unique_ptr<MetricsHttpServer> metrics_http_;  // reads everything above: stopped first
  int port_ = 0;
  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
  std::thread drain_thread_ ABSL_GUARDED_BY(shutdown_mu_);  // waits for the calls in flight
  std::atomic<int> exit_status_{0};
  // Last: stopped first on destruction, while everything its callbacks touch still exists.
  std::unique_ptr<DeviceHealthMonitor> device_monitor_;
};

}  // namespace kvpool::server
