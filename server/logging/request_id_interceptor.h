// The request id of every call kvpoold serves, in one place: a server interceptor that takes
// the id from the "x-request-id" call metadata (validated, else replaced: request_context.h) or
// makes one, and then
//   - answers it in the response's initial metadata (and, on a failure, its trailing metadata
//     and the ErrorInfo of the status details, when there is one, as metadata "request_id");
//   - makes it the thread's current request id while gRPC runs the call's handler, so log lines
//     written there carry it (work the handler hands to the WorkerPool keeps it too);
//   - writes one log line per finished call: debug for every call, warn for the codes that mean
//     a server fault (INTERNAL, UNKNOWN, DATA_LOSS).
//
//   interceptors.push_back(NewRequestIdInterceptorFactory());  // first, so it wraps the rest
#pragma once

#include <memory>

#include "grpcpp/support/server_interceptor.h"

namespace kvpool::server {

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
NewRequestIdInterceptorFactory();

}  // namespace kvpool::server
