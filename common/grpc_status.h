// absl::Status <-> grpc::Status at the RPC edge, one conversion each way for the whole project.
// The two share the canonical codes, so nothing is lost but what the bound on messages cuts.
//
//   return ToGrpcStatus(absl::NotFoundError("no model 'x'"));         // server side
//   KVPOOL_RETURN_IF_ERROR(FromGrpcStatus(stub->Call(...), "Call"));  // client side
#pragma once

#include <cstddef>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/status.h"

namespace kvpool {

// Longest status message sent to a client: messages quote untrusted text (common/quote.h), and
// this bound keeps any message far below gRPC's metadata limit even so.
inline constexpr size_t kMaxStatusMessageBytes = 1024;

// The same code and message, the message cut to kMaxStatusMessageBytes.
grpc::Status ToGrpcStatus(const absl::Status& status);

// The same code; the message prefixed by `what` (the RPC or step that failed).
absl::Status FromGrpcStatus(const grpc::Status& status, absl::string_view what);

}  // namespace kvpool
