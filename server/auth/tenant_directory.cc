#include "server/auth/tenant_directory.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "proto/text_format.h"

namespace kvpool::server {
namespace {

bool IsValidCertificateName(absl::string_view name) {
  if (name.empty() || name.size() > 256) return false;
  for (char c : name) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7e) return false;
  }
  return true;
}

}  // namespace

bool IsValidTenantName(absl::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

absl::StatusOr<std::shared_ptr<const TenantDirectory>> TenantDirectory::Parse(
    absl::string_view text, absl::string_view source) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("tenants file ", source, ": ", why));
  };
  v1::TenantsFile file;
  if (absl::Status parsed = ParseTextFormat(text, &file); !parsed.ok()) {
    return bad(std::string(parsed.message()));
  }
  if (file.tenant_size() == 0) return bad("no tenant (an empty file would lock everyone out)");
  if (static_cast<size_t>(file.tenant_size()) > kMaxTenants) {
    return bad(absl::StrCat(file.tenant_size(), " tenants, at most ", kMaxTenants));
  }
  auto dir = std::shared_ptr<TenantDirectory>(new TenantDirectory());
  for (int i = 0; i < file.tenant_size(); ++i) {
    const v1::TenantEntry& e = file.tenant(i);
    const std::string where = absl::StrCat("tenant #", i + 1, " ", Quote(e.name()));
    if (!IsValidTenantName(e.name())) {
      return bad(absl::StrCat(where, ": name must match [A-Za-z0-9._-]{1,64}"));
    }
    if (dir->names_.count(e.name()) > 0) return bad(absl::StrCat(where, ": duplicate name"));
    if (e.role() == v1::ROLE_UNSPECIFIED || !v1::TenantRole_IsValid(e.role())) {
      return bad(absl::StrCat(where, ": role must be ROLE_TENANT, ROLE_ADMIN or ROLE_ROUTER"));
    }
    if (e.token_sha256_size() == 0 && e.certificate_name_size() == 0) {
      return bad(absl::StrCat(where, ": no token_sha256 and no certificate_name"));
    }
    if (static_cast<size_t>(e.token_sha256_size()) > kMaxTokensPerTenant ||
        static_cast<size_t>(e.certificate_name_size()) > kMaxCertificateNamesPerTenant) {
      return bad(absl::StrCat(where, ": at most ", kMaxTokensPerTenant, " token hashes and ",
                              kMaxCertificateNamesPerTenant, " certificate names"));
    }
    const size_t index = dir->tenants_.size();
    for (const std::string& hex : e.token_sha256()) {
      absl::StatusOr<TokenDigest> d = DigestFromHex(hex);
      if (!d.ok()) return bad(absl::StrCat(where, ": token_sha256: ", d.status().message()));
      for (const auto& [other, owner] : dir->tokens_) {
        if (other == *d) {
          return bad(absl::StrCat(where, ": token_sha256 ", hex.substr(0, 12),
                                  "... is already tenant ", Quote(dir->tenants_[owner].name),
                                  "'s"));
        }
      }
      dir->tokens_.emplace_back(*d, index);
    }
    for (const std::string& cn : e.certificate_name()) {
      if (!IsValidCertificateName(cn)) {
        return bad(absl::StrCat(where, ": certificate_name must be 1-256 printable characters"));
      }
      auto [it, inserted] = dir->certificate_names_.emplace(cn, index);
      if (!inserted) {
        return bad(absl::StrCat(where, ": certificate_name ", Quote(cn), " is already tenant ",
                                Quote(dir->tenants_[it->second].name), "'s"));
      }
    }
    dir->names_.emplace(e.name(), index);
    dir->tenants_.push_back(TenantIdentity{e.name(), e.role(), e.quota()});
  }
  return std::shared_ptr<const TenantDirectory>(std::move(dir));
}

const TenantIdentity* TenantDirectory::ByToken(absl::string_view token) const {
  if (token.empty() || token.size() > kMaxTokenBytes) return nullptr;
  const TokenDigest d = Sha256Of(token);
  const TenantIdentity* found = nullptr;
  for (const auto& [hash, index] : tokens_) {  // no early exit: every hash is compared
    if (DigestsEqual(hash, d)) found = &tenants_[index];
  }
  return found;
}

const TenantIdentity* TenantDirectory::ByCertificateName(absl::string_view name) const {
  auto it = certificate_names_.find(name);
  return it == certificate_names_.end() ? nullptr : &tenants_[it->second];
}

const TenantIdentity* TenantDirectory::Find(absl::string_view name) const {
  auto it = names_.find(name);
  return it == names_.end() ? nullptr : &tenants_[it->second];
}

}  // namespace kvpool::server
