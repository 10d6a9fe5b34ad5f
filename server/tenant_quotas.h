// TenantQuotaTable: each tenant's quotas (pool bytes, sequences, models, guaranteed pool bytes,
// compute weight) as the enforcers read them, and the refusals they counted. The table is
// installed as a whole (server/admission/tenant_policy.h validates and installs it, also on a
// reload); a tenant absent from it has no quota of its own (only the pool bounds it).
//
//   TenantQuotaTable table;
//   table.Replace({{"team-a", TenantQuota{.pool_bytes = 1 << 30, .sequences = 4096}}});
//   if (count + 1 > table.Get("team-a").sequences) {
//     table.CountRejection("team-a", QuotaKind::kSequences);
//     return QuotaError("team-a", QuotaKind::kSequences, limit, count, 1);
//   }
//
// Over quota is RESOURCE_EXHAUSTED with reason QUOTA (proto/status.h), naming the quota, the
// usage and the request.
//
// Thread-safe. The table never calls out under its lock, so an enforcer may read it while
// holding its own.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/tenant.h"

namespace kvpool::server {

// One tenant's quotas; 0 means none of its own.
struct TenantQuota {
  uint64_t pool_bytes = 0;
  uint64_t sequences = 0;
  uint64_t models = 0;
  uint64_t guaranteed_pool_bytes = 0;
  uint32_t compute_weight = 0;  // 0 counts as 1
};

enum class QuotaKind { kPoolBytes, kSequences, kModels };
absl::string_view QuotaKindName(QuotaKind kind);  // "pool_bytes", "sequences", "models"

// Refusals by quota, since start.
struct QuotaRejections {
  uint64_t pool_bytes = 0;
  uint64_t sequences = 0;
  uint64_t models = 0;
};

// RESOURCE_EXHAUSTED, reason QUOTA, with metadata quota/limit/usage/request:
// "tenant 'a' over its sequences quota: quota 4, usage 4, request 1".
absl::Status QuotaError(const TenantId& tenant, QuotaKind kind, uint64_t quota, uint64_t usage,
                        uint64_t request);

class TenantQuotaTable {
 public:
  // The quotas of `tenant` (all zero when it has none).
  TenantQuota Get(const TenantId& tenant) const;
  // Whether `tenant` has an entry.
  bool Has(const TenantId& tenant) const;
  // Tenants with an entry, sorted.
  std::vector<TenantId> Tenants() const;
  // Replaces every entry (no validation here: TenantPolicy validates).
  void Replace(std::map<TenantId, TenantQuota> quotas);

  void CountRejection(const TenantId& tenant, QuotaKind kind);
  QuotaRejections Rejections(const TenantId& tenant) const;

 private:
  mutable absl::Mutex mu_;
  std::map<TenantId, TenantQuota> quotas_ ABSL_GUARDED_BY(mu_);
  std::map<TenantId, QuotaRejections> rejections_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvpool::server
