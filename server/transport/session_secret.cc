#include "server/transport/session_secret.h"

#include <openssl/crypto.h>
#include <openssl/rand.h>

#include "absl/status/status.h"

namespace kvpool::server {

absl::StatusOr<std::string> NewSessionSecret() {
  std::string secret(kSessionSecretBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(secret.data()),
                 static_cast<int>(secret.size())) != 1) {
    return absl::InternalError("the random generator failed (RAND_bytes)");
  }
  return secret;
}

bool SecretsEqual(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;  // lengths are public (kSessionSecretBytes)
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace kvpool::server
