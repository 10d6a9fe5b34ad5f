// ReadServiceImpl: the kvpool.v1.ReadService gRPC service: attention-ready blocks (ReadBlocks)
// and dequantized K/V in the original basis (ReadKv), both server-streaming from a snapshot of
// the sequence (page references keep the data stable while the sequence goes on changing).
//
//   ReadServiceImpl reads(&service_context);
//   builder.RegisterService(&reads);
//
// Thread-safe. ReadKv's dequantize + un-rotate runs on the worker pool.
#pragma once

#include "kvpool/v1/read_service.grpc.pb.h"
#include "server/service_context.h"

namespace kvpool::server {

class ReadServiceImpl final : public ::kvpool::v1::ReadService::CallbackService {
 public:
  explicit ReadServiceImpl(ServiceContext* ctx) : ctx_(ctx) {}

  grpc::ServerWriteReactor<::kvpool::v1::ReadBlocksResponse>* ReadBlocks(
      grpc::CallbackServerContext* context,
      const ::kvpool::v1::ReadBlocksRequest* request) override;
  grpc::ServerWriteReactor<::kvpool::v1::ReadKvResponse>* ReadKv(
      grpc::CallbackServerContext* context, const ::kvpool::v1::ReadKvRequest* request) override;

 private:
  ServiceContext* const ctx_;
};

}  // namespace kvpool::server
