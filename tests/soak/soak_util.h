// Constants and small helpers shared by the soak client's files (soak_client.cc, soak_hostile.cc).
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/kvpool_client.h"
#include "kernels/bf16.h"

namespace kvpool::soak {

// The shared system prompts: the sink plus 5 whole blocks of the soak models' tiers.
inline constexpr int kPromptTokens = 96;
inline constexpr int kSharedPrompts = 4;
inline constexpr int kBlockTokens = 16;
inline constexpr int kSinkTokens = 16;
// How long an append retries ABORTED: one cancelled just before may still be rolling back
// (sanitizer builds are slow; this is a bound, not an expectation).
inline constexpr absl::Duration kAbortedRetry = absl::Seconds(120);

inline std::string Bytes(const std::vector<Bf16>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(Bf16));
}
inline std::string Bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

// The status of a finished raw gRPC call, in the client library's "Rpc: message" form.
inline absl::Status Answer(const grpc::Status& s, absl::string_view rpc) {
  return client::FromGrpcStatus(s, rpc);
}

}  // namespace kvpool::soak
