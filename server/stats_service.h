// StatsServiceImpl: the kvpool.v1.StatsService gRPC service: pool accounting, per-model usage,
// service counters and limits.
//
//   StatsServiceImpl stats(&service_context);
//   builder.RegisterService(&stats);
//
// Thread-safe; cheap enough to poll.
#pragma once

#include <vector>

#include "kvpool/v1/stats_service.grpc.pb.h"
#include "server/service_context.h"

namespace kvpool::server {

class StatsServiceImpl final : public ::kvpool::v1::StatsService::CallbackService {
 public:
  explicit StatsServiceImpl(ServiceContext* ctx) : ctx_(ctx) {}

  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* context,
                                     const ::kvpool::v1::GetStatsRequest* request,
                                     ::kvpool::v1::GetStatsResponse* response) override;

  // What GetStats answers `caller` (the metrics endpoint reads the same numbers through it, as
  // each tenant).
  void Collect(const Caller& caller, const ::kvpool::v1::GetStatsRequest* request,
               ::kvpool::v1::GetStatsResponse* response) const;

 private:
  ServiceContext* const ctx_;
};

// The daemon's version string: "kvpoold 0.1.0".
const char* KvpoolVersion();

// This build and the API version (GetStatsResponse.build).
void FillBuildInfo(::kvpool::v1::BuildInfo* out);

// The tenants whose usage rows (GetStatsResponse.tenants) `caller` is shown: this function alone
// decides. A tenant sees its own row; an admin or a router every tenant in `known` (those with
// quotas or in the tenants file) and its own.
std::vector<TenantId> TenantRowsVisibleTo(const Caller& caller, const std::vector<TenantId>& known);

// One tenant's row from the pool's accounts, the store, the registry, the quota table and the
// worker pool.
::kvpool::v1::TenantUsage TenantUsageOf(const ServiceContext& ctx, const TenantId& tenant);

}  // namespace kvpool::server
