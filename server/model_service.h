// ModelServiceImpl: the kvpool.v1.ModelService gRPC service (register, list, describe, delete).
//
//   ModelServiceImpl models(&service_context);
//   builder.RegisterService(&models);
//
// Thread-safe (callback API; heavy parsing of rotation files runs on the worker pool).
#pragma once

#include "kvpool/v1/model_service.grpc.pb.h"
#include "server/service_context.h"

namespace kvpool::server {

class ModelServiceImpl final : public ::kvpool::v1::ModelService::CallbackService {
 public:
  explicit ModelServiceImpl(ServiceContext* ctx) : ctx_(ctx) {}

  grpc::ServerReadReactor<::kvpool::v1::RegisterModelRequest>* RegisterModel(
      grpc::CallbackServerContext* context, ::kvpool::v1::RegisterModelResponse* response) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const ::kvpool::v1::ListModelsRequest* request,
                                       ::kvpool::v1::ListModelsResponse* response) override;
  grpc::ServerWriteReactor<::kvpool::v1::DescribeModelResponse>* DescribeModel(
      grpc::CallbackServerContext* context,
      const ::kvpool::v1::DescribeModelRequest* request) override;
  grpc::ServerUnaryReactor* DeleteModel(grpc::CallbackServerContext* context,
                                        const ::kvpool::v1::DeleteModelRequest* request,
                                        ::kvpool::v1::DeleteModelResponse* response) override;

 private:
  ServiceContext* const ctx_;
};

}  // namespace kvpool::server
