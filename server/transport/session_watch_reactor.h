// TransportService.WatchSession: a session's lease. The reactor registers with the transport that
// holds the session, answers one message once the watch holds and keeps the stream open; the
// stream ends when the session does (OK after CloseSession, else the transport's reason), and
// the session is closed when the client cancels the stream or goes away.
//
//   return StartSessionWatch(ctx, call, request->session_id());   // TransportServiceImpl
//
// Thread-safe; the reactor lives until the call is done and the session's end has been heard.
#pragma once

#include <cstdint>

#include "grpcpp/grpcpp.h"
#include "kvpool/v1/transport_service.grpc.pb.h"
#include "server/service_context.h"

namespace kvpool::server {

grpc::ServerWriteReactor<::kvpool::v1::WatchSessionResponse>* StartSessionWatch(
    ServiceContext* ctx, grpc::CallbackServerContext* call, uint64_t session_id);

}  // namespace kvpool::server
