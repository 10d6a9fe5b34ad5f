// AttentionServiceImpl: the kvpool.v1.AttentionService gRPC service (remote decode attention for
// a batch of sequences), a thin edge over AttentionEngine.
//
//   AttentionServiceImpl attention(&service_context);
//   builder.RegisterService(&attention);
//
// Thread-safe; the math runs on the worker pool.
#pragma once

#include "kvpool/v1/attention_service.grpc.pb.h"
#include "server/service_context.h"

namespace kvpool::server {

class AttentionServiceImpl final : public ::kvpool::v1::AttentionService::CallbackService {
 public:
  explicit AttentionServiceImpl(ServiceContext* ctx) : ctx_(ctx) {}

  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const ::kvpool::v1::AttendRequest* request,
                                   ::kvpool::v1::AttendResponse* response) override;

 private:
  ServiceContext* const ctx_;
};

}  // namespace kvpool::server
