// StatsServiceImpl: the kvpool.v1.StatsService gRPC service: pool accounting, per-model usage,
// service counters and limits.
//
//   StatsServiceImpl stats(&service_context);
//   builder.RegisterService(&stats);
//
// Thread-safe; cheap enough to poll.
#pragma once

#include "kvpool/v1/stats_service.grpc.pb.h"
#include "server/service_context.h"

namespace kvpool::server {

class StatsServiceImpl final : public ::kvpool::v1::StatsService::CallbackService {
 public:
  explicit StatsServiceImpl(ServiceContext* ctx) : ctx_(ctx) {}

  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* context,
                                     const ::kvpool::v1::GetStatsRequest* request,
                                     ::kvpool::v1::GetStatsResponse* response) override;

  // What GetStats answers `tenant` (the metrics endpoint reads the same numbers through it).
  void Collect(const TenantId& tenant, const ::kvpool::v1::GetStatsRequest* request,
               ::kvpool::v1::GetStatsResponse* response) const;

 private:
  ServiceContext* const ctx_;
};

// The daemon's version string.
const char* KvpoolVersion();

}  // namespace kvpool::server
