// AdminServiceImpl: the kvpool.v1.AdminService gRPC service: drain and tenants reload, the same
// operations SIGTERM and SIGHUP start (KvpoolServer::Drain, KvpoolServer::ReloadTenants). Only
// the admin role reaches it (server/auth/method_policy.cc).
//
//   AdminServiceImpl admin(&drain_state, {[&] { return server->Drain(grace); },
//                                         [&] { return server->ReloadTenants(); }});
//   builder.RegisterService(&admin);
//
// Thread-safe.
#pragma once

#include <functional>
#include <utility>

#include "absl/status/status.h"
#include "kvpool/v1/admin_service.grpc.pb.h"
#include "server/drain_state.h"
#include "server/service_context.h"

namespace kvpool::server {

struct AdminActions {
  // Begins the drain; false when one was under way.
  std::function<bool()> drain;
  // Re-reads the tenants file.
  std::function<absl::Status()> reload_tenants;
};

class AdminServiceImpl final : public ::kvpool::v1::AdminService::CallbackService {
 public:
  AdminServiceImpl(const ServiceContext* ctx, AdminActions actions)
      : ctx_(ctx), actions_(std::move(actions)) {}

  grpc::ServerUnaryReactor* Drain(grpc::CallbackServerContext* context,
                                  const ::kvpool::v1::DrainRequest* request,
                                  ::kvpool::v1::DrainResponse* response) override;
  grpc::ServerUnaryReactor* ReloadTenants(grpc::CallbackServerContext* context,
                                          const ::kvpool::v1::ReloadTenantsRequest* request,
                                          ::kvpool::v1::ReloadTenantsResponse* response) override;

 private:
  const ServiceContext* const ctx_;
  const AdminActions actions_;
};

}  // namespace kvpool::server
