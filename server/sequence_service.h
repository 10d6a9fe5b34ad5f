// SequenceServiceImpl: the kvpool.v1.SequenceService gRPC service (create, AppendKv stream,
// AppendDecode, seal, release, describe, prefix lookup).
//
// AppendKv and AppendDecode go through the ingest engine (server/ingest/): AppendKv is a thin
// read reactor (server/ingest_stream_reactor.h) that hands each chunk message to the engine as it
// arrives and pauses reading while the engine's queue of chunks to stage is full; the engine
// stages the chunks on the worker pool (reading BF16 payloads where the message holds them),
// commits once the client has half-closed and every chunk is staged, and rolls back on any
// error, a cancelled call or a full worker queue, which returns every reserved page.
//
//   SequenceServiceImpl sequences(&service_context);
//   builder.RegisterService(&sequences);
//
// Thread-safe.
#pragma once

#include "kvpool/v1/sequence_service.grpc.pb.h"
#include "server/service_context.h"

namespace kvpool::server {

class SequenceServiceImpl final : public ::kvpool::v1::SequenceService::CallbackService {
 public:
  explicit SequenceServiceImpl(ServiceContext* ctx) : ctx_(ctx) {}

  grpc::ServerUnaryReactor* CreateSequence(grpc::CallbackServerContext* context,
                                           const ::kvpool::v1::CreateSequenceRequest* request,
                                           ::kvpool::v1::CreateSequenceResponse* response) override;
  grpc::ServerReadReactor<::kvpool::v1::AppendKvRequest>* AppendKv(
      grpc::CallbackServerContext* context, ::kvpool::v1::AppendKvResponse* response) override;
  grpc::ServerUnaryReactor* AppendDecode(grpc::CallbackServerContext* context,
                                         const ::kvpool::v1::AppendDecodeRequest* request,
                                         ::kvpool::v1::AppendDecodeResponse* response) override;
  grpc::ServerUnaryReactor* SealSequence(grpc::CallbackServerContext* context,
                                         const ::kvpool::v1::SealSequenceRequest* request,
                                         ::kvpool::v1::SealSequenceResponse* response) override;
  grpc::ServerUnaryReactor* ReleaseSequence(
      grpc::CallbackServerContext* context, const ::kvpool::v1::ReleaseSequenceRequest* request,
      ::kvpool::v1::ReleaseSequenceResponse* response) override;
  grpc::ServerUnaryReactor* DescribeSequence(grpc::CallbackServerContext* context,
                                             const ::kvpool::v1::DescribeSequenceRequest* request,
                                             ::kvpool::v1::SequenceInfo* response) override;
  grpc::ServerUnaryReactor* LookupPrefix(grpc::CallbackServerContext* context,
                                         const ::kvpool::v1::LookupPrefixRequest* request,
                                         ::kvpool::v1::LookupPrefixResponse* response) override;

 private:
  ServiceContext* const ctx_;
};

}  // namespace kvpool::server
