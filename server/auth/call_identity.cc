#include "server/auth/call_identity.h"

namespace kvpool::server {

Caller CallerOfCall(const TenantsSource* tenants, const grpc::ServerContextBase& context) {
  if (tenants == nullptr) return Caller{kDefaultTenant, v1::ROLE_ADMIN};
  PresentedCredentials presented;
  const auto& metadata = context.client_metadata();
  auto [begin, end] = metadata.equal_range(kAuthorizationKey);
  for (auto it = begin; it != end; ++it) {
    presented.authorization.emplace_back(it->second.data(), it->second.size());
  }
  if (std::shared_ptr<const grpc::AuthContext> auth = context.auth_context(); auth != nullptr) {
    AddCertificateIdentity(*auth, &presented);
  }
  absl::StatusOr<Caller> caller = Authenticate(*tenants->current(), presented);
  if (!caller.ok()) return Caller{kUnresolvedTenant, v1::ROLE_UNSPECIFIED};
  return *caller;
}

}  // namespace kvpool::server
