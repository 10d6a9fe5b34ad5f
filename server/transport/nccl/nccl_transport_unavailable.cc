// NewNcclTransport in builds without CUDA and NCCL: there is no NCCL data plane.
#include "server/transport/nccl/nccl_transport.h"

namespace kvpool::server {

absl::StatusOr<std::unique_ptr<Transport>> NewNcclTransport(
    ServiceContext* /*ctx*/, const NcclTransportOptions& /*options*/) {
  return absl::UnavailableError("kvpoold was built without CUDA and NCCL");
}

}  // namespace kvpool::server
