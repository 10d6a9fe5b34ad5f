// SequenceServiceImpl: the kvpool.v1.SequenceService gRPC service (create, AppendKv stream,
// AppendDecode, seal, release, describe, prefix lookup).
//
// AppendKv is a read reactor that overlaps receiving with staging: it starts the next read as
// soon as a chunk is taken out of the message and queues the chunk (a bounded number of chunks
// and bytes wait), and one worker-pool task per stream stages the queue in order (rotate and
// quantize into the transaction's reserved pages, reading BF16 payloads where the message holds
// them). When the queue is full the read waits, so gRPC flow control pushes back on a fast
// client; the worker has it resumed on a gRPC thread, so that receiving never runs on a worker.
// The transaction commits once the client has half-closed and the queue has drained; any error,
// a cancelled call or a full worker queue drops it, which returns every reserved page.
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
