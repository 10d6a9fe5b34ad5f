#include "common/placement.h"

#include <openssl/evp.h>
#include <openssl/sha.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/quote.h"

namespace kvpool {
namespace {

void AppendU32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void AppendString(std::string* out, absl::string_view s) {
  AppendU32(out, static_cast<uint32_t>(s.size()));
  out->append(s.data(), s.size());
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

Sha256Digest Sha256(absl::string_view bytes) {
  // The one-shot SHA256() looks the algorithm up on every call; placement hashes several times
  // per routed call, so the algorithm is fetched once and each thread reuses its context.
  static EVP_MD* const kSha256 = EVP_MD_fetch(nullptr, "SHA256", nullptr);
  struct ContextFree {
    void operator()(EVP_MD_CTX* c) const { EVP_MD_CTX_free(c); }
  };
  thread_local std::unique_ptr<EVP_MD_CTX, ContextFree> context(EVP_MD_CTX_new());
  Sha256Digest digest;
  unsigned int size = 0;
  if (kSha256 == nullptr || context == nullptr ||
      EVP_DigestInit_ex(context.get(), kSha256, nullptr) != 1 ||
      EVP_DigestUpdate(context.get(), bytes.data(), bytes.size()) != 1 ||
      EVP_DigestFinal_ex(context.get(), digest.data(), &size) != 1 || size != digest.size()) {
    // Only without a working libcrypto; the one-shot form reports nothing either.
    SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), digest.data());
  }
  return digest;
}

std::string HexOf(absl::Span<const uint8_t> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(bytes.size() * 2);
  for (uint8_t b : bytes) {
    hex.push_back(kDigits[b >> 4]);
    hex.push_back(kDigits[b & 0xf]);
  }
  return hex;
}

std::string PlacementKey::Hex() const { return HexOf(digest); }

absl::StatusOr<PlacementKey> PlacementKey::FromHex(absl::string_view hex) {
  if (hex.size() != 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("placement key: expected 64 hex digits, got ", Quote(hex)));
  }
  PlacementKey key;
  for (size_t i = 0; i < 32; ++i) {
    const int hi = HexDigit(hex[2 * i]);
    const int lo = HexDigit(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("placement key: not hexadecimal: ", Quote(hex)));
    }
    key.digest[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return key;
}

PlacementKey PlacementKeyOfTokens(absl::string_view tenant, absl::string_view model_id,
                                  absl::Span<const uint32_t> first_block_tokens) {
  std::string bytes(1, '\x01');
  AppendString(&bytes, tenant);
  AppendString(&bytes, model_id);
  AppendU32(&bytes, static_cast<uint32_t>(first_block_tokens.size()));
  for (uint32_t token : first_block_tokens) AppendU32(&bytes, token);
  return PlacementKey{Sha256(bytes)};
}

PlacementKey PlacementKeyOfSequence(absl::string_view tenant, absl::string_view model_id,
                                    absl::string_view sequence_id) {
  std::string bytes(1, '\x02');
  AppendString(&bytes, tenant);
  AppendString(&bytes, model_id);
  AppendString(&bytes, sequence_id);
  return PlacementKey{Sha256(bytes)};
}

double RendezvousScore(const PlacementKey& key, absl::string_view endpoint, uint64_t weight) {
  std::string bytes(reinterpret_cast<const char*>(key.digest.data()), key.digest.size());
  bytes.append(endpoint.data(), endpoint.size());
  const Sha256Digest digest = Sha256(bytes);
  uint64_t h = 0;
  for (int i = 0; i < 8; ++i) h |= uint64_t{digest[i]} << (8 * i);
  // 2 * (h >> 12) + 1 < 2^53: exact in a double, and u is never 0 or 1.
  const double u = static_cast<double>(2 * (h >> 12) + 1) / 9007199254740992.0;  // 2^53
  return -static_cast<double>(weight) / std::log(u);
}

Sha256Digest EpochOf(std::vector<std::string> endpoints) {
  std::sort(endpoints.begin(), endpoints.end());
  endpoints.erase(std::unique(endpoints.begin(), endpoints.end()), endpoints.end());
  std::string bytes;
  for (const std::string& e : endpoints) AppendString(&bytes, e);
  return Sha256(bytes);
}

Membership::Membership() : epoch_(EpochOf({})) {}

absl::StatusOr<Membership> Membership::Create(std::vector<Member> members) {
  if (members.size() > kMaxMembers) {
    return absl::InvalidArgumentError(
        absl::StrCat("membership: ", members.size(), " members, at most ", kMaxMembers));
  }
  for (const Member& m : members) {
    if (m.endpoint.empty() || m.endpoint.size() > kMaxEndpointBytes) {
      return absl::InvalidArgumentError(absl::StrCat("membership: endpoint ", Quote(m.endpoint),
                                                     " must have 1 to ", kMaxEndpointBytes,
                                                     " bytes"));
    }
    for (char c : m.endpoint) {
      if (absl::ascii_isspace(static_cast<unsigned char>(c)) || c == ',' || c == '=' ||
          !absl::ascii_isprint(static_cast<unsigned char>(c))) {
        return absl::InvalidArgumentError(
            absl::StrCat("membership: endpoint ", Quote(m.endpoint), " has a forbidden byte"));
      }
    }
    if (m.weight == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("membership: endpoint ", Quote(m.endpoint), " has weight 0"));
    }
  }
  std::sort(members.begin(), members.end(), [](const Member& a, const Member& b) {
    return a.endpoint != b.endpoint ? a.endpoint < b.endpoint : a.weight < b.weight;
  });
  members.erase(std::unique(members.begin(), members.end()), members.end());
  for (size_t i = 1; i < members.size(); ++i) {
    if (members[i].endpoint == members[i - 1].endpoint) {
      return absl::InvalidArgumentError(absl::StrCat(
          "membership: endpoint ", Quote(members[i].endpoint), " given with two weights"));
    }
  }
  Membership result;
  std::vector<std::string> endpoints;
  endpoints.reserve(members.size());
  for (const Member& m : members) endpoints.push_back(m.endpoint);
  result.members_ = std::move(members);
  result.epoch_ = EpochOf(std::move(endpoints));
  return result;
}

bool Membership::Contains(absl::string_view endpoint) const {
  return std::binary_search(
      members_.begin(), members_.end(), Member{std::string(endpoint), 0},
      [](const Member& a, const Member& b) { return a.endpoint < b.endpoint; });
}

const Member& Membership::OwnerOf(const PlacementKey& key) const {
  const Member* best = &members_.front();
  double best_score = RendezvousScore(key, best->endpoint, best->weight);
  // Members are sorted by endpoint, so keeping the first of equal scores keeps the smaller.
  for (size_t i = 1; i < members_.size(); ++i) {
    const double score = RendezvousScore(key, members_[i].endpoint, members_[i].weight);
    if (score > best_score) {
      best = &members_[i];
      best_score = score;
    }
  }
  return *best;
}

}  // namespace kvpool
