// TransportService.PushKv: one push of prefill K/V whose bytes move GPU to GPU, over an NCCL
// ingest session or a CUDA IPC session. The stream is the push's control and a thin ingest
// reactor (server/ingest_stream_reactor.h): the header (its AppendKvHeader, BF16) begins the
// append in the ingest engine, each chunk message is checked against the append and handed to
// the session's transport (DevicePush: an NCCL receive into a slot, a copy from the client's
// mapped buffers), which stages it; reads pause while the transport's slots are all in use; the
// half-close commits; a failed or cancelled push rolls back and aborts what the client may be
// blocked on (its NCCL channel).
//
//   return NewDevicePushReactor(ctx, call, response);   // TransportServiceImpl::PushKv
//
// Thread-safe; deletes itself when the call is done.
#pragma once

#include "grpcpp/grpcpp.h"
#include "kvpool/v1/transport_service.grpc.pb.h"
#include "server/service_context.h"

namespace kvpool::server {

grpc::ServerReadReactor<::kvpool::v1::DevicePushRequest>* NewDevicePushReactor(
    ServiceContext* ctx, grpc::CallbackServerContext* call,
    ::kvpool::v1::AppendKvResponse* response);

}  // namespace kvpool::server
