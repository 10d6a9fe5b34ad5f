#include "server/auth/call_identity.h"

#include <vector>

namespace kvpool::server {

namespace {

// The tenant of `directory` that the call's credentials (its authorization metadata, its
// connection's verified certificate) prove.
Caller ResolveCaller(const TenantDirectory& directory, const grpc::ServerContextBase& context) {
  PresentedCredentials presented;
  const auto& metadata = context.client_metadata();
  auto [begin, end] = metadata.equal_range(kAuthorizationKey);
  for (auto it = begin; it != end; ++it) {
    presented.authorization.emplace_back(it->second.data(), it->second.size());
  }
  if (std::shared_ptr<const grpc::AuthContext> auth = context.auth_context(); auth != nullptr) {
    AddCertificateIdentity(*auth, &presented);
  }
  absl::StatusOr<Caller> caller = Authenticate(directory, presented);
  if (!caller.ok()) return Caller{kUnresolvedTenant, v1::ROLE_UNSPECIFIED};
  return *caller;
}

}  // namespace

Caller CallerOfCall(const TenantsSource* tenants, const grpc::ServerContextBase& context) {
  if (tenants == nullptr) return Caller{kDefaultTenant, v1::ROLE_ADMIN};
  if (const auto* call = dynamic_cast<const CallContext*>(&context); call != nullptr) {
    return call->CallerOf(*tenants);
  }
  return ResolveCaller(*tenants->current(), context);  // a server without the allocator
}

Caller CallContext::CallerOf(const TenantsSource& tenants) const {
  std::shared_ptr<const TenantDirectory> directory = tenants.current();
  absl::MutexLock lock(&mu_);
  if (directory != resolved_against_) {
    caller_ = ResolveCaller(*directory, *this);
    resolved_against_ = std::move(directory);
  }
  return caller_;
}

CallContextAllocator::~CallContextAllocator() {
  absl::MutexLock lock(&mu_);
  for (grpc::CallbackServerContext* context : live_) delete context;
}

grpc::CallbackServerContext* CallContextAllocator::NewCallbackServerContext() {
  auto* context = new CallContext();
  absl::MutexLock lock(&mu_);
  live_.insert(context);
  return context;
}

void CallContextAllocator::Release(grpc::CallbackServerContext* context) {
  {
    absl::MutexLock lock(&mu_);
    live_.erase(context);
  }
  delete context;
}

}  // namespace kvpool::server
