// FaultInjectionService: kvpool.testing.FaultInjection, which flips bits of stored pages so the
// integrity tests can watch reads and the scrubber catch them, and poisons the GPU's CUDA context
// so the device-health test can watch the daemon stop serving and exit. Linked only into
// kvpoold-fault-injection (CMake option KVPOOL_FAULT_INJECTION); kvpoold never serves it.
//
//   KvpoolServer::Start(config, NewFaultInjectionService);
//
// Thread-safe: the flip is a single byte store into a page the call holds a reference on; the
// poisoning uses a stream of its own.
#pragma once

#include <memory>

#include "grpcpp/grpcpp.h"
#include "server/service_context.h"

namespace kvpool::server {

// The service over `ctx` (which outlives it).
std::unique_ptr<grpc::Service> NewFaultInjectionService(ServiceContext* ctx);

}  // namespace kvpool::server
