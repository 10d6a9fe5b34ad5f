// Session secrets of the data plane: the daemon hands each negotiated session an unguessable
// secret over gRPC, and a data-plane connection is bound to the session only when its first
// message carries the session id and that secret (a UCX endpoint's HELLO, ucx_wire.h; a
// shared-memory client's hello on the Unix socket, shm_wire.h).
//
//   KVPOOL_ASSIGN_OR_RETURN(std::string secret, NewSessionSecret());   // 16 random bytes
//   if (!SecretsEqual(secret, hello_secret)) ...                       // refuse the endpoint
//
// Thread-safe.
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvpool::server {

// Bytes of a session secret (128 bits).
inline constexpr size_t kSessionSecretBytes = 16;

// kSessionSecretBytes from a cryptographically secure generator (OpenSSL's RAND_bytes).
// Internal when the generator fails (it is not seeded).
[[nodiscard]] absl::StatusOr<std::string> NewSessionSecret();

// Whether `a` and `b` are equal, in time that depends only on their lengths (a caller learns
// nothing about a secret from how long a wrong guess took to refuse).
bool SecretsEqual(absl::string_view a, absl::string_view b);

}  // namespace kvpool::server
