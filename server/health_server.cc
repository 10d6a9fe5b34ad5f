#include "server/health_server.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "grpcpp/ext/health_check_service_server_builder_option.h"
#include "grpcpp/impl/server_builder_option.h"
#include "grpcpp/impl/server_builder_plugin.h"

namespace kvpool::server {
namespace {

using grpc::health::v1::HealthCheckResponse;

// Drops every server plugin (the process-wide reflection plugin among them), so that this port
// serves health and nothing else.
class WithoutPlugins final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments* /*args*/) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    plugins->clear();
  }
};

// A Watch looks at cancellation this often while no status changes.
constexpr absl::Duration kWatchPoll = absl::Milliseconds(500);

}  // namespace

absl::StatusOr<std::unique_ptr<HealthServer>> HealthServer::Start(const std::string& listen) {
  auto h = std::unique_ptr<HealthServer>(new HealthServer());
  h->SetServing({""}, false);  // until the daemon says it serves
  grpc::ServerBuilder builder;
  builder.SetOption(std::make_unique<WithoutPlugins>());
  // Ours instead of gRPC's default health service (which needs another service beside it).
  builder.SetOption(std::make_unique<grpc::HealthCheckServiceServerBuilderOption>(nullptr));
  builder.RegisterService(&h->service_);
  builder.SetMaxReceiveMessageSize(kMaxRequestBytes);
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &h->port_);
  h->server_ = builder.BuildAndStart();
  if (h->server_ == nullptr || h->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("--health_listen: cannot serve on ", listen));
  }
  return h;
}

HealthServer::~HealthServer() { Shutdown(); }

void HealthServer::SetServing(const std::vector<std::string>& services, bool serving) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return;  // NOT_SERVING for good
  for (const std::string& s : services) {
    statuses_[s] = serving ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING;
  }
  changed_.SignalAll();
}

void HealthServer::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
    for (auto& [name, status] : statuses_) status = HealthCheckResponse::NOT_SERVING;
    changed_.SignalAll();
  }
  if (server_ != nullptr) {
    server_->Shutdown(std::chrono::system_clock::now());
    server_->Wait();
  }
}

HealthServer::ServingStatus HealthServer::StatusOfLocked(const std::string& service) const {
  auto it = statuses_.find(service);
  return it == statuses_.end() ? HealthCheckResponse::SERVICE_UNKNOWN : it->second;
}

grpc::Status HealthServer::Service::Check(grpc::ServerContext* /*context*/,
                                          const grpc::health::v1::HealthCheckRequest* request,
                                          HealthCheckResponse* response) {
  absl::MutexLock lock(&owner_->mu_);
  const ServingStatus status = owner_->StatusOfLocked(request->service());
  if (status == HealthCheckResponse::SERVICE_UNKNOWN) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown service");
  }
  response->set_status(status);
  return grpc::Status::OK;
}

grpc::Status HealthServer::Service::Watch(grpc::ServerContext* context,
                                          const grpc::health::v1::HealthCheckRequest* request,
                                          grpc::ServerWriter<HealthCheckResponse>* writer) {
  bool first = true;
  ServingStatus last = HealthCheckResponse::UNKNOWN;
  absl::MutexLock lock(&owner_->mu_);
  if (owner_->watches_ >= kMaxWatches) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("at most ", kMaxWatches,
                                     " Watch calls at once on the health port; probes use Check"));
  }
  ++owner_->watches_;
  while (!context->IsCancelled()) {
    const ServingStatus now = owner_->StatusOfLocked(request->service());
    if (first || now != last) {  // the current status, then each change
      first = false;
      last = now;
      HealthCheckResponse response;
      response.set_status(now);
      owner_->mu_.Unlock();
      const bool written = writer->Write(response);
      owner_->mu_.Lock();
      if (!written) break;
    }
    if (owner_->shut_down_) break;
    owner_->changed_.WaitWithTimeout(&owner_->mu_, kWatchPoll);
  }
  --owner_->watches_;
  return grpc::Status::OK;
}

}  // namespace kvpool::server
