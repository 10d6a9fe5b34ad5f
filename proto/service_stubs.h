// One stub of each kvpool gRPC service on one channel: the client library's, and those of tests
// that call a server directly.
//
//   ServiceStubs stubs(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
//   grpc::Status s = stubs.sequences->CreateSequence(&ctx, request, &response);
#pragma once

#include <memory>

#include "grpcpp/grpcpp.h"
#include "kvpool/v1/admin_service.grpc.pb.h"
#include "kvpool/v1/attention_service.grpc.pb.h"
#include "kvpool/v1/model_service.grpc.pb.h"
#include "kvpool/v1/read_service.grpc.pb.h"
#include "kvpool/v1/sequence_service.grpc.pb.h"
#include "kvpool/v1/stats_service.grpc.pb.h"
#include "kvpool/v1/transport_service.grpc.pb.h"

namespace kvpool {

struct ServiceStubs {
  explicit ServiceStubs(const std::shared_ptr<grpc::Channel>& channel)
      : models(v1::ModelService::NewStub(channel)),
        sequences(v1::SequenceService::NewStub(channel)),
        reads(v1::ReadService::NewStub(channel)),
        attention(v1::AttentionService::NewStub(channel)),
        stats(v1::StatsService::NewStub(channel)),
        transport(v1::TransportService::NewStub(channel)),
        admin(v1::AdminService::NewStub(channel)) {}

  std::unique_ptr<v1::ModelService::Stub> models;
  std::unique_ptr<v1::SequenceService::Stub> sequences;
  std::unique_ptr<v1::ReadService::Stub> reads;
  std::unique_ptr<v1::AttentionService::Stub> attention;
  std::unique_ptr<v1::StatsService::Stub> stats;
  std::unique_ptr<v1::TransportService::Stub> transport;
  std::unique_ptr<v1::AdminService::Stub> admin;
};

}  // namespace kvpool
