#include "server/auth/auth_processor.h"

#include <string>

#include "server/auth/authenticate.h"
#include "server/auth/method_policy.h"

namespace kvpool::server {

grpc::Status AuthProcessor::Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                                    OutputMetadata* /*consumed_auth_metadata*/,
                                    OutputMetadata* /*response_metadata*/) {
  absl::string_view path;
  PresentedCredentials presented;
  for (const auto& [key, value] : auth_metadata) {
    const absl::string_view k(key.data(), key.size());
    if (k == ":path") {
      path = absl::string_view(value.data(), value.size());
    } else if (k == kAuthorizationKey) {
      presented.authorization.emplace_back(value.data(), value.size());
    }
  }
  if (IsPublicMethod(path)) return grpc::Status::OK;
  if (context != nullptr) AddCertificateIdentity(*context, &presented);
  absl::StatusOr<Caller> caller = Authenticate(*tenants_->current(), presented);
  if (!caller.ok()) {
    ++counters_->unauthenticated;
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, std::string(caller.status().message()));
  }
  if (absl::Status s = AuthorizeMethod(path, caller->role); !s.ok()) {
    ++counters_->permission_denied;
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, std::string(s.message()));
  }
  return grpc::Status::OK;
}

}  // namespace kvpool::server
