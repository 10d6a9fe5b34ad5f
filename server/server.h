// KvpoolServer: assembles kvpoold from a ServerConfig — backend, block pool, prefix index, model
// registry, sequence store, worker pool, attention engine, ingest engine, the data-plane
// transports (server/transport/: grpc_inline always, UCX unless --transports='', NCCL and CUDA
// IPC when the pool is on a GPU), the six kvpool.v1
// services, gRPC's health service (grpc.health.v1) and reflection — and runs the gRPC server.
//
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<KvpoolServer> server, KvpoolServer::Start(config));
//   std::cout << "port " << server->port();
//   ...
//   server->Shutdown(std::chrono::seconds(5));   // from any thread, e.g. on SIGTERM
//   server->Wait();
//
// Thread-safe: Shutdown may race with Wait; everything else is set up before Start returns.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "server/admission/admission.h"
#include "server/config.h"
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
class OwnershipGuard;

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
  ServiceContext* context() { return &ctx_; }
  // A channel to this server inside the process (no socket), for tests and fuzz targets. Its
  // messages are limited to max_message_bytes like the listening port's.
  std::shared_ptr<grpc::Channel> InProcessChannel();

  // Marks health NOT_SERVING, stops accepting calls, lets in-flight calls finish for up to
  // `grace` then cancels them, and drains the worker pool. Idempotent.
  void Shutdown(std::chrono::milliseconds grace);
  // Blocks until the server has shut down.
  void Wait();

 private:
  KvpoolServer() = default;

  ServerConfig config_;
  // Outlives every stream's ticket (destroyed after the services, transports and workers).
  std::unique_ptr<Admission> admission_;
  std::unique_ptr<ComputeBackend> backend_;
  std::unique_ptr<BlockPool> pool_;
  std::unique_ptr<PrefixIndex> index_;
  std::unique_ptr<ModelRegistry> registry_;
  std::unique_ptr<SequenceStore> store_;
  std::unique_ptr<SequenceReaper> reaper_;  // releases the store's expired leases
  std::unique_ptr<WorkerPool> workers_;
  std::unique_ptr<AttentionEngine> attention_;
  std::unique_ptr<IngestEngine> ingest_;
  std::unique_ptr<Scrubber> scrubber_;                  // stopped before what it reads goes away
  std::vector<std::unique_ptr<Transport>> transports_;  // shut down before the workers drain
  ServiceContext ctx_;
  std::unique_ptr<OwnershipGuard> ownership_;  // scale-out (docs/scale-out.md)
  std::unique_ptr<ModelServiceImpl> model_service_;
  std::unique_ptr<SequenceServiceImpl> sequence_service_;
  std::unique_ptr<ReadServiceImpl> read_service_;
  std::unique_ptr<AttentionServiceImpl> attention_service_;
  std::unique_ptr<StatsServiceImpl> stats_service_;
  std::unique_ptr<TransportServiceImpl> transport_service_;
  std::unique_ptr<grpc::Service> extra_service_;
  std::unique_ptr<ConnectionListener> listener_;  // accepts connections for server_
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
};

}  // namespace kvpool::server
