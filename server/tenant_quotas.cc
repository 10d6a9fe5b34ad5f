#include "server/tenant_quotas.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "proto/status.h"

namespace kvpool::server {

absl::string_view QuotaKindName(QuotaKind kind) {
  switch (kind) {
    case QuotaKind::kPoolBytes:
      return "pool_bytes";
    case QuotaKind::kSequences:
      return "sequences";
    case QuotaKind::kModels:
      return "models";
  }
  return "unknown";
}

absl::Status QuotaError(const TenantId& tenant, QuotaKind kind, uint64_t quota, uint64_t usage,
                        uint64_t request) {
  return WithReason(absl::ResourceExhaustedError(absl::StrCat(
                        "tenant ", Quote(tenant), " over its ", QuotaKindName(kind),
                        " quota: quota ", quota, ", usage ", usage, ", request ", request)),
                    ErrorReason::kQuota,
                    {{"quota", std::string(QuotaKindName(kind))},
                     {"limit", absl::StrCat(quota)},
                     {"usage", absl::StrCat(usage)},
                     {"request", absl::StrCat(request)}});
}

TenantQuota TenantQuotaTable::Get(const TenantId& tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = quotas_.find(tenant);
  return it == quotas_.end() ? TenantQuota{} : it->second;
}

bool TenantQuotaTable::Has(const TenantId& tenant) const {
  absl::MutexLock lock(&mu_);
  return quotas_.count(tenant) > 0;
}

std::vector<TenantId> TenantQuotaTable::Tenants() const {
  absl::MutexLock lock(&mu_);
  std::vector<TenantId> out;
  out.reserve(quotas_.size());
  for (const auto& [tenant, q] : quotas_) out.push_back(tenant);
  return out;
}

void TenantQuotaTable::Replace(std::map<TenantId, TenantQuota> quotas) {
  absl::MutexLock lock(&mu_);
  quotas_ = std::move(quotas);
}

void TenantQuotaTable::CountRejection(const TenantId& tenant, QuotaKind kind) {
  absl::MutexLock lock(&mu_);
  QuotaRejections& r = rejections_[tenant];
  switch (kind) {
    case QuotaKind::kPoolBytes:
      ++r.pool_bytes;
      break;
    case QuotaKind::kSequences:
      ++r.sequences;
      break;
    case QuotaKind::kModels:
      ++r.models;
      break;
  }
}

QuotaRejections TenantQuotaTable::Rejections(const TenantId& tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = rejections_.find(tenant);
  return it == rejections_.end() ? QuotaRejections{} : it->second;
}

}  // namespace kvpool::server
