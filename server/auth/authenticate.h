// Authentication: which tenant presented these credentials. A bearer token in the call's
// `authorization` metadata ("Bearer <token>") or a verified client certificate (its URI SAN
// kvpool://tenant/NAME, else its subject CN), looked up in the tenants file. Never a request
// field.
//
//   PresentedCredentials c = CredentialsOf(metadata, *context.auth_context());
//   KVPOOL_ASSIGN_OR_RETURN(Caller who, Authenticate(*directory, c));   // Unauthenticated
//
// Thread-safe (pure functions).
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/security/auth_context.h"
#include "kvpool/v1/tenants.pb.h"
#include "server/auth/tenant_directory.h"
#include "server/tenant.h"

namespace kvpool::server {

// Who is calling, as the handlers see it.
struct Caller {
  TenantId tenant;
  v1::TenantRole role = v1::ROLE_TENANT;
};

// What a call presented: the values of its `authorization` metadata and its peer's verified
// certificate identity (empty when it showed none).
struct PresentedCredentials {
  std::vector<std::string> authorization;
  bool has_certificate = false;
  std::vector<std::string> uri_sans;
  std::string common_name;
};

// The metadata key and scheme of bearer tokens.
inline constexpr char kAuthorizationKey[] = "authorization";
inline constexpr char kBearerPrefix[] = "Bearer ";
// A certificate names its tenant with a URI SAN of this prefix.
inline constexpr char kTenantUriPrefix[] = "kvpool://tenant/";

// Fills the certificate part of `out` from a connection's auth context (properties set by
// gRPC's TLS handshake after it verified the chain).
void AddCertificateIdentity(const grpc::AuthContext& auth, PresentedCredentials* out);

// The certificate name a tenants file maps (the kvpool://tenant/ URI SAN's NAME, else the CN);
// empty without a certificate.
std::string CertificateNameOf(const PresentedCredentials& c);

// The tenant `c` proves to be. Unauthenticated when it presents nothing, a malformed or unknown
// token, a certificate no tenant lists, several tokens, or a token and a certificate of two
// different tenants.
[[nodiscard]] absl::StatusOr<Caller> Authenticate(const TenantDirectory& directory,
                                                  const PresentedCredentials& c);

}  // namespace kvpool::server
