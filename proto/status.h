// kvpool's error model at the RPC edge: absl::Status inside the code, grpc::Status on the wire,
// one conversion each way for the whole project. The two share the canonical codes. Where a
// client must branch, a status also carries a machine-readable reason (docs/api.md, "Errors"):
// in absl as a payload, on the wire as a google.rpc.ErrorInfo (domain "kvpool") in the status
// details (grpc-status-details-bin), so clients branch on reasons, never on message text.
//
//   return ToGrpcStatus(WithReason(absl::NotFoundError("sequence 's' expired"),
//                                  ErrorReason::kExpired));                    // server side
//   absl::Status s = FromGrpcStatus(stub->Call(...), "Call");                  // client side
//   if (ReasonOf(s) == ErrorReason::kExpired) { /* re-prefill */ }
#pragma once

#include <cstddef>
#include <map>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/status.h"

namespace kvpool {

// The reasons a client acts on, and their names on the wire (ErrorInfo.reason).
enum class ErrorReason {
  kEvicted,      // NOT_FOUND: the sequence was evicted under pressure
  kExpired,      // NOT_FOUND: the sequence's lease expired
  kQuota,        // RESOURCE_EXHAUSTED: the tenant is over a quota
  kLimit,        // RESOURCE_EXHAUSTED: a per-stream or per-connection limit
  kCorrupt,      // DATA_LOSS: stored bytes failed their checksum
  kWrongOwner,   // FAILED_PRECONDITION: another daemon owns the sequence (scale-out)
  kDraining,     // UNAVAILABLE: the daemon is draining
  kStaleCursor,  // FAILED_PRECONDITION: an incremental read's cursor is of an earlier sequence
};
absl::string_view ErrorReasonName(ErrorReason reason);  // "EVICTED", "EXPIRED", ...
std::optional<ErrorReason> ParseErrorReason(absl::string_view name);

// `status` with `reason` and optional key/value `metadata` attached (replacing any reason it
// had). OK stays OK.
absl::Status WithReason(absl::Status status, ErrorReason reason,
                        const std::map<std::string, std::string>& metadata = {});
// The reason `status` carries, if any (also for one that came over the wire).
std::optional<ErrorReason> ReasonOf(const absl::Status& status);
// The metadata attached with the reason (empty when none).
std::map<std::string, std::string> ReasonMetadata(const absl::Status& status);

// Longest status message sent to a client: messages quote untrusted text (common/quote.h), and
// this bound keeps any message far below gRPC's metadata limit even so.
inline constexpr size_t kMaxStatusMessageBytes = 1024;

// The same code and message (cut to kMaxStatusMessageBytes) and the reason, if any, as an
// ErrorInfo in the details.
grpc::Status ToGrpcStatus(const absl::Status& status);

// The same code; the message prefixed by `what` (the RPC or step that failed); the reason of an
// ErrorInfo of domain "kvpool" in the details, if any. Malformed details are ignored.
absl::Status FromGrpcStatus(const grpc::Status& status, absl::string_view what);

}  // namespace kvpool
