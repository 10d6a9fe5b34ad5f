// HealthServer: the plaintext health port (--health_listen): a second gRPC server that serves
// grpc.health.v1.Health (Check and Watch) and nothing else (no credentials, no reflection, no
// kvpool service), so that Kubernetes' native gRPC probes work when the daemon's port requires
// TLS. It answers what the daemon's own health service answers (KvpoolServer sets both).
//
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<HealthServer> h, HealthServer::Start("0.0.0.0:8081"));
//   h->SetServing({"", "kvpool.v1.SequenceService"}, true);
//   h->Shutdown();
//
// Thread-safe.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace kvpool::server {

class HealthServer {
 public:
  // Listens on `listen` (host:port, port 0 picks one). Every service NOT_SERVING until
  // SetServing. Unavailable when it cannot bind.
  static absl::StatusOr<std::unique_ptr<HealthServer>> Start(const std::string& listen);
  ~HealthServer();

  int port() const { return port_; }
  // Sets the status of each of `services` ("" is the daemon as a whole).
  void SetServing(const std::vector<std::string>& services, bool serving);
  // NOT_SERVING for all, ends every Watch and stops answering; idempotent.
  void Shutdown();

 private:
  using ServingStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;
  // Watch calls open at once on the unauthenticated port; more are RESOURCE_EXHAUSTED.
  static constexpr int kMaxWatches = 8;
  // Largest request the port accepts (a service name).
  static constexpr int kMaxRequestBytes = 4096;

  // The grpc.health.v1 service over the statuses below (synchronous: a Watch holds one of the
  // server's threads while it waits for a change, so at most kMaxWatches run at once and Check,
  // which probes use, always finds a thread).
  class Service final : public grpc::health::v1::Health::Service {
   public:
    explicit Service(HealthServer* owner) : owner_(owner) {}
    grpc::Status Check(grpc::ServerContext* context,
                       const grpc::health::v1::HealthCheckRequest* request,
                       grpc::health::v1::HealthCheckResponse* response) override;
    grpc::Status Watch(grpc::ServerContext* context,
                       const grpc::health::v1::HealthCheckRequest* request,
                       grpc::ServerWriter<grpc::health::v1::HealthCheckResponse>* writer) override;

   private:
    HealthServer* const owner_;
  };

  HealthServer() : service_(this) {}
  // SERVICE_UNKNOWN for a service never set.
  ServingStatus StatusOfLocked(const std::string& service) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  absl::CondVar changed_;
  std::map<std::string, ServingStatus> statuses_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  int watches_ ABSL_GUARDED_BY(mu_) = 0;
  Service service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace kvpool::server
