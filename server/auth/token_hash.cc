#include "server/auth/token_hash.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include "absl/strings/str_cat.h"

namespace kvpool::server {
namespace {

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

TokenDigest Sha256Of(absl::string_view bytes) {
  TokenDigest d;
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), d.data());
  return d;
}

std::string HexOf(const TokenDigest& digest) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(digest.size() * 2);
  for (uint8_t b : digest) {
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 15]);
  }
  return out;
}

absl::StatusOr<TokenDigest> DigestFromHex(absl::string_view hex) {
  TokenDigest d;
  if (hex.size() != d.size() * 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("a SHA-256 is 64 hex characters, got ", hex.size()));
  }
  for (size_t i = 0; i < d.size(); ++i) {
    const int hi = HexValue(hex[2 * i]);
    const int lo = HexValue(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("not a hex digit at character ", hi < 0 ? 2 * i + 1 : 2 * i + 2));
    }
    d[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return d;
}

bool DigestsEqual(const TokenDigest& a, const TokenDigest& b) {
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace kvpool::server
