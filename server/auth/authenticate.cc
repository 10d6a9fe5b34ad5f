#include "server/auth/authenticate.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "grpc/grpc_security_constants.h"

namespace kvpool::server {
namespace {

std::string StringOf(const grpc::string_ref& s) { return std::string(s.data(), s.size()); }

}  // namespace

void AddCertificateIdentity(const grpc::AuthContext& auth, PresentedCredentials* out) {
  if (!auth.FindPropertyValues(GRPC_X509_PEM_CERT_PROPERTY_NAME).empty()) {
    out->has_certificate = true;
  }
  for (const grpc::string_ref& uri : auth.FindPropertyValues(GRPC_PEER_URI_PROPERTY_NAME)) {
    out->uri_sans.push_back(StringOf(uri));
  }
  for (const grpc::string_ref& cn : auth.FindPropertyValues(GRPC_X509_CN_PROPERTY_NAME)) {
    if (out->common_name.empty()) out->common_name = StringOf(cn);
  }
}

std::string CertificateNameOf(const PresentedCredentials& c) {
  if (!c.has_certificate) return "";
  for (const std::string& uri : c.uri_sans) {
    if (absl::StartsWith(uri, kTenantUriPrefix)) return uri.substr(sizeof(kTenantUriPrefix) - 1);
  }
  return c.common_name;
}

absl::StatusOr<Caller> Authenticate(const TenantDirectory& directory,
                                    const PresentedCredentials& c) {
  const TenantIdentity* by_token = nullptr;
  if (c.authorization.size() > 1) {
    return absl::UnauthenticatedError("more than one 'authorization' metadata entry");
  }
  if (c.authorization.size() == 1) {
    absl::string_view value = c.authorization[0];
    if (!absl::StartsWithIgnoreCase(value, kBearerPrefix)) {
      return absl::UnauthenticatedError("'authorization' must be 'Bearer <token>'");
    }
    value.remove_prefix(sizeof(kBearerPrefix) - 1);
    by_token = directory.ByToken(value);
    if (by_token == nullptr)
      return absl::UnauthenticatedError("the bearer token matches no tenant");
  }
  const TenantIdentity* by_certificate = nullptr;
  if (c.has_certificate) {
    const std::string name = CertificateNameOf(c);
    by_certificate = directory.ByCertificateName(name);
    if (by_certificate == nullptr && by_token == nullptr) {
      return absl::UnauthenticatedError(
          absl::StrCat("no tenant has the client certificate name ", Quote(name)));
    }
  }
  if (by_token != nullptr && by_certificate != nullptr && by_token != by_certificate) {
    return absl::UnauthenticatedError(
        "the bearer token and the client certificate are of "
        "different tenants");
  }
  const TenantIdentity* who = by_token != nullptr ? by_token : by_certificate;
  if (who == nullptr) {
    return absl::UnauthenticatedError(
        "no credentials: send 'authorization: Bearer <token>' metadata or a client certificate");
  }
  return Caller{who->name, who->role};
}

}  // namespace kvpool::server
