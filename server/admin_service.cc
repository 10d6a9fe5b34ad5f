#include "server/admin_service.h"

#include "server/auth/tenant_directory.h"
#include "spdlog/spdlog.h"

namespace kvpool::server {
namespace {

grpc::ServerUnaryReactor* FinishWith(grpc::CallbackServerContext* context,
                                     const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace

grpc::ServerUnaryReactor* AdminServiceImpl::Drain(grpc::CallbackServerContext* context,
                                                  const v1::DrainRequest* /*request*/,
                                                  v1::DrainResponse* response) {
  spdlog::info("AdminService.Drain from {} ('{}')", context->peer(), TenantOf(*ctx_, context));
  response->set_started(actions_.drain());
  if (ctx_->drain != nullptr) FillServingState(*ctx_->drain, response->mutable_serving());
  return FinishWith(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* AdminServiceImpl::ReloadTenants(
    grpc::CallbackServerContext* context, const v1::ReloadTenantsRequest* /*request*/,
    v1::ReloadTenantsResponse* response) {
  const absl::Status reloaded = actions_.reload_tenants();
  spdlog::info("AdminService.ReloadTenants from {}: {}", context->peer(),
               reloaded.ok() ? "re-read" : reloaded.ToString());
  if (reloaded.ok() && ctx_->tenants != nullptr) {
    response->set_tenants(static_cast<uint32_t>(ctx_->tenants->current()->tenants().size()));
  }
  return FinishWith(context, reloaded);
}

}  // namespace kvpool::server
