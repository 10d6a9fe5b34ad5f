// TenantDirectory: one parsed, validated tenants file (proto/kvpool/v1/tenants.proto): who may
// call kvpoold, by which bearer-token hashes or client-certificate names, in which role.
// Immutable; a reload builds a new one (server/auth/tenants_source.h).
//
//   KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<const TenantDirectory> dir,
//                           TenantDirectory::Parse(text, "/etc/kvpool/tenants.txtpb"));
//   const TenantIdentity* who = dir->ByToken(presented_token);   // null: no such tenant
//
// Thread-safe (immutable after Parse).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvpool/v1/tenants.pb.h"
#include "server/auth/token_hash.h"
#include "server/tenant.h"

namespace kvpool::server {

struct TenantIdentity {
  TenantId name;
  v1::TenantRole role = v1::ROLE_TENANT;
  v1::TenantQuota quota;
};

class TenantDirectory {
 public:
  // Most tenants, tokens per tenant and certificate names per tenant a file may hold.
  static constexpr size_t kMaxTenants = 4096;
  static constexpr size_t kMaxTokensPerTenant = 16;
  static constexpr size_t kMaxCertificateNamesPerTenant = 16;
  // Longest bearer token hashed; longer ones are refused unhashed.
  static constexpr size_t kMaxTokenBytes = 4096;

  // Parses and validates the text-format file `text` (`source` names it in errors). Rejected
  // with InvalidArgument naming the tenant and field: a syntax error, a name outside
  // [A-Za-z0-9._-]{1,64}, a duplicate name, ROLE_UNSPECIFIED, a token hash that is not 64 hex
  // characters, a token hash or certificate name given to two tenants, a tenant with no way to
  // authenticate, an empty file, or more than the limits above.
  [[nodiscard]] static absl::StatusOr<std::shared_ptr<const TenantDirectory>> Parse(
      absl::string_view text, absl::string_view source);

  // The tenant whose token hashes include SHA-256(`token`), or null. Compares against every
  // hash of every tenant in constant time each, so the time taken says nothing about which
  // hash came close.
  const TenantIdentity* ByToken(absl::string_view token) const;
  // The tenant that lists `name` among its certificate names, or null.
  const TenantIdentity* ByCertificateName(absl::string_view name) const;
  // The tenant called `name`, or null.
  const TenantIdentity* Find(absl::string_view name) const;

  const std::vector<TenantIdentity>& tenants() const { return tenants_; }

 private:
  TenantDirectory() = default;

  std::vector<TenantIdentity> tenants_;
  std::vector<std::pair<TokenDigest, size_t>> tokens_;  // hash -> index in tenants_
  std::map<std::string, size_t, std::less<>> certificate_names_;
  std::map<std::string, size_t, std::less<>> names_;
};

// Whether `name` is a valid tenant name: [A-Za-z0-9._-]{1,64}.
bool IsValidTenantName(absl::string_view name);

}  // namespace kvpool::server
