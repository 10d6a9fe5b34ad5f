// The request id of the call a thread is working for, so that log lines written anywhere on the
// call's path carry it without every function passing it along.
//
//   ScopedRequestId scope(id);        // the interceptor, around the handler; the worker pool,
//   spdlog::info("...");              // around a task submitted from inside a call
//   CurrentRequestId();               // "" outside any call
//
// Ids arrive in the "x-request-id" call metadata, which is untrusted: RequestIdFromClient keeps
// one only when it is printable ASCII without spaces and at most kMaxRequestIdBytes long, and
// otherwise makes a new one, so a raw client string never reaches a log line.
#pragma once

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace kvpool::server {

inline constexpr char kRequestIdMetadataKey[] = "x-request-id";
inline constexpr size_t kMaxRequestIdBytes = 128;

// 1..kMaxRequestIdBytes bytes, each in '!'..'~'.
bool IsValidRequestId(absl::string_view id);

// A fresh id: 32 hex digits of randomness.
std::string NewRequestId();

// `sent` when it is a valid id, else a fresh one (also when the client sent none).
std::string RequestIdFromClient(absl::string_view sent);

// The id set by the innermost ScopedRequestId alive on this thread; "" when none is.
absl::string_view CurrentRequestId();

// Sets this thread's current request id for the scope's lifetime, then restores the previous
// one (scopes nest).
class ScopedRequestId {
 public:
  explicit ScopedRequestId(std::string id);
  ~ScopedRequestId();
  ScopedRequestId(const ScopedRequestId&) = delete;
  ScopedRequestId& operator=(const ScopedRequestId&) = delete;

 private:
  std::string previous_;
};

}  // namespace kvpool::server
