#include "server/admission/tenant_policy.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "common/status_macros.h"

namespace kvpool::server {

absl::Status TenantPolicy::Validate(const std::map<TenantId, v1::TenantQuota>& quotas,
                                    size_t capacity_bytes) {
  uint64_t guaranteed = 0;  // at most the capacity while `over` is false
  bool over = false;
  std::string shares;
  for (const auto& [tenant, q] : quotas) {
    if (q.pool_bytes() > 0 && q.guaranteed_pool_bytes() > q.pool_bytes()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tenant ", Quote(tenant), ": guaranteed_pool_bytes ", q.guaranteed_pool_bytes(),
          " exceeds its pool_bytes quota ", q.pool_bytes()));
    }
    if (q.compute_weight() > kMaxComputeWeight) {
      return absl::InvalidArgumentError(absl::StrCat("tenant ", Quote(tenant), ": compute_weight ",
                                                     q.compute_weight(), " exceeds ",
                                                     kMaxComputeWeight));
    }
    if (q.guaranteed_pool_bytes() == 0) continue;
    if (q.guaranteed_pool_bytes() > capacity_bytes - guaranteed) over = true;
    if (!over) guaranteed += q.guaranteed_pool_bytes();
    absl::StrAppend(&shares, shares.empty() ? "" : ", ", Quote(tenant), " ",
                    q.guaranteed_pool_bytes());
  }
  if (over) {
    return absl::InvalidArgumentError(
        absl::StrCat("guaranteed_pool_bytes add up to more than the pool's capacity of ",
                     capacity_bytes, " bytes (", shares, ")"));
  }
  return absl::OkStatus();
}

absl::Status TenantPolicy::SetTenantQuotas(const std::map<TenantId, v1::TenantQuota>& quotas) {
  absl::MutexLock lock(&mu_);
  KVPOOL_RETURN_IF_ERROR(Validate(quotas, pool_->capacity_bytes()));
  std::map<TenantId, AccountLimits> limits;
  std::map<TenantId, TenantQuota> table;
  std::map<TenantId, uint32_t> weights;
  for (const auto& [tenant, q] : quotas) {
    limits[tenant] = AccountLimits{static_cast<size_t>(q.pool_bytes()),
                                   static_cast<size_t>(q.guaranteed_pool_bytes())};
    table[tenant] = TenantQuota{q.pool_bytes(), q.sequences(), q.models(),
                                q.guaranteed_pool_bytes(), q.compute_weight()};
    weights[tenant] = q.compute_weight();
  }
  // The pool's is the only install that can fail (too many accounts): first, so that a failure
  // changes nothing.
  KVPOOL_RETURN_IF_ERROR(pool_->SetAccountLimits(limits));
  table_->Replace(std::move(table));
  if (workers_ != nullptr) workers_->SetWeights(std::move(weights));
  return absl::OkStatus();
}

absl::Status TenantPolicy::SetTenantQuotasFrom(const v1::TenantsFile& file) {
  std::map<TenantId, v1::TenantQuota> quotas;
  for (const v1::TenantEntry& t : file.tenant()) {
    if (!quotas.emplace(t.name(), t.quota()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tenant ", Quote(t.name()), " appears twice in the tenants file"));
    }
  }
  return SetTenantQuotas(quotas);
}

}  // namespace kvpool::server
