// SHA-256 of bearer tokens: the tenants file holds only these hashes, and a presented token is
// hashed and compared in constant time (server/auth/tenant_directory.h).
//
//   TokenDigest d = Sha256Of("s3cret");
//   std::string hex = HexOf(d);                          // what goes into token_sha256
//   absl::StatusOr<TokenDigest> back = DigestFromHex(hex);
//
// Thread-safe (pure functions).
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvpool::server {

using TokenDigest = std::array<uint8_t, 32>;

// SHA-256 of `bytes` (OpenSSL's libcrypto).
TokenDigest Sha256Of(absl::string_view bytes);

// Lower-case hex of `digest` (64 characters).
std::string HexOf(const TokenDigest& digest);

// The digest that 64 hex characters (either case) spell; InvalidArgument otherwise.
[[nodiscard]] absl::StatusOr<TokenDigest> DigestFromHex(absl::string_view hex);

// Whether `a` and `b` are equal, in time independent of where they differ.
bool DigestsEqual(const TokenDigest& a, const TokenDigest& b);

}  // namespace kvpool::server
