// TenantPolicy: installs each tenant's quotas (kvpool.v1.TenantQuota from the tenants file) into
// the parts that enforce them, after checking them against the pool's real capacity:
//   pool_bytes, guaranteed_pool_bytes -> the block pool's accounts (BlockPool::SetAccountLimits:
//                                        appends, UCX/NCCL/CUDA IPC pushes and demotion all
//                                        allocate through it)
//   sequences, models                 -> the quota table the sequence store and the model
//                                        registry read (TenantQuotaTable)
//   compute_weight                    -> the worker pool's weighted fair queueing
//
//   TenantPolicy policy(pool, &quota_table, workers);
//   std::map<TenantId, v1::TenantQuota> quotas;   // by tenant name, from the tenants file
//   quotas["team-a"].set_pool_bytes(1 << 30);
//   KVPOOL_RETURN_IF_ERROR(policy.SetTenantQuotas(quotas));   // at start and on every reload
//
// SetTenantQuotas may be called at any time (a reload of the tenants file): the new table replaces
// the old one as a whole; tenants absent from it get no quota of their own (the default). What a
// tenant holds stays charged: a quota lowered below its usage refuses new work (RESOURCE_EXHAUSTED,
// reason QUOTA) until the usage falls below it, and never releases anything by itself.
//
// Thread-safe; installs are serialized.
#pragma once

#include <cstddef>
#include <map>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "kvpool/v1/tenants.pb.h"
#include "server/block_pool.h"
#include "server/tenant.h"
#include "server/tenant_quotas.h"
#include "server/worker_pool.h"

namespace kvpool::server {

class TenantPolicy {
 public:
  // Largest compute_weight accepted.
  static constexpr uint32_t kMaxComputeWeight = 1000000;

  // Every pointer outlives the policy; `workers` may be null (no fair queueing to configure).
  TenantPolicy(BlockPool* pool, TenantQuotaTable* table, WorkerPool* workers)
      : pool_(pool), table_(table), workers_(workers) {}

  // Checks `quotas` (Validate) and installs them everywhere; InvalidArgument, naming the
  // tenant and the numbers, and nothing changed, when they do not fit.
  [[nodiscard]] absl::Status SetTenantQuotas(
      const std::map<TenantId, ::kvpool::v1::TenantQuota>& quotas);

  // The same for every tenant of a tenants file, by name (a tenant without a quota message gets
  // zeros: no quota of its own). InvalidArgument when a name appears twice.
  [[nodiscard]] absl::Status SetTenantQuotasFrom(const ::kvpool::v1::TenantsFile& file);

  // The checks alone, against a pool of `capacity_bytes` (BF16 pages and INT2 blocks share
  // the one arena): each guarantee within its tenant's pool_bytes quota (when it has one), the
  // guarantees together within the capacity, compute_weight at most kMaxComputeWeight.
  [[nodiscard]] static absl::Status Validate(
      const std::map<TenantId, ::kvpool::v1::TenantQuota>& quotas, size_t capacity_bytes);

 private:
  BlockPool* const pool_;
  TenantQuotaTable* const table_;
  WorkerPool* const workers_;
  absl::Mutex mu_;
};

}  // namespace kvpool::server
