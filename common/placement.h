// Placement of sequences on the daemons of a scale-out deployment (docs/scale-out.md): the
// membership (advertised endpoints with weights), its epoch, the placement key of a sequence and
// its owner by weighted rendezvous hashing. Client and daemon link this one implementation, and
// the Python package (client/python/kvpool/placement.py) computes the same bytes; the fixed
// vectors in tests/fixtures/placement_vectors.json hold both to it.
//
//   KVPOOL_ASSIGN_OR_RETURN(Membership members,
//                           Membership::Create({{"10.0.0.1:50051", 1}, {"10.0.0.2:50051", 1}}));
//   PlacementKey key = PlacementKeyOfTokens("tenant-a", "llama", first_block_token_ids);
//   const Member& owner = members.OwnerOf(key);       // every client and daemon agrees
//   std::string epoch = members.epoch_hex();          // SHA-256 over the sorted endpoints
//
// Encodings (all integers little-endian; str(x) = u32 length of x, then the bytes of x):
//   epoch          = SHA-256( str(e) for each endpoint e, sorted bytewise, duplicates removed )
//   key (tokens)   = SHA-256( 0x01 str(tenant) str(model) u32(n) u32(token_0) ... u32(token_n-1) )
//   key (sequence) = SHA-256( 0x02 str(tenant) str(model) str(sequence_id) )
//   h(key, e)      = the first 8 bytes of SHA-256( key (32 bytes) e ) as a u64
//   u              = (2 * (h >> 12) + 1) / 2^53          (exact in a double, strictly in (0, 1))
//   score(key, e)  = -weight(e) / ln(u)
//   owner          = the endpoint with the highest score; on equal scores the smaller endpoint.
// All types here are immutable values, safe to share between threads.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvpool {

// Longest endpoint ("host:port") a membership accepts.
inline constexpr size_t kMaxEndpointBytes = 255;
// Most members of one membership.
inline constexpr size_t kMaxMembers = 4096;

using Sha256Digest = std::array<uint8_t, 32>;

// The placement key of a sequence: a SHA-256 digest.
struct PlacementKey {
  Sha256Digest digest{};
  // 64 lowercase hex digits (what the call metadata carries).
  std::string Hex() const;
  // The key from 64 hex digits (either case); InvalidArgument otherwise.
  [[nodiscard]] static absl::StatusOr<PlacementKey> FromHex(absl::string_view hex);
  bool operator==(const PlacementKey& other) const { return digest == other.digest; }
};

// SHA-256 of `bytes` (OpenSSL libcrypto).
Sha256Digest Sha256(absl::string_view bytes);
std::string HexOf(absl::Span<const uint8_t> bytes);

// The key of a sequence whose first block holds `first_block_tokens` (the caller passes the
// token ids of the model's first block, or all of them when the prompt is shorter).
PlacementKey PlacementKeyOfTokens(absl::string_view tenant, absl::string_view model_id,
                                  absl::Span<const uint32_t> first_block_tokens);
// The key of a sequence created without tokens.
PlacementKey PlacementKeyOfSequence(absl::string_view tenant, absl::string_view model_id,
                                    absl::string_view sequence_id);

struct Member {
  std::string endpoint;  // "host:port" as the daemon advertises it
  uint64_t weight = 1;   // the daemon's pool bytes (or any common unit); > 0
  bool operator==(const Member& other) const {
    return endpoint == other.endpoint && weight == other.weight;
  }
};

// The rendezvous-hashing score of `endpoint` (with `weight`) for `key`; the owner has the highest.
double RendezvousScore(const PlacementKey& key, absl::string_view endpoint, uint64_t weight);

class Membership {
 public:
  // An empty membership (owns nothing).
  Membership();
  // `members` sorted by endpoint, exact duplicates merged. InvalidArgument for an empty or
  // oversize endpoint, one with whitespace or ',' or '=', a zero weight, one endpoint with two
  // weights, or more than kMaxMembers members.
  [[nodiscard]] static absl::StatusOr<Membership> Create(std::vector<Member> members);

  const std::vector<Member>& members() const { return members_; }
  bool empty() const { return members_.empty(); }
  bool Contains(absl::string_view endpoint) const;
  const Sha256Digest& epoch() const { return epoch_; }
  std::string epoch_hex() const { return HexOf(epoch_); }

  // The member that owns `key`; must not be called on an empty membership.
  const Member& OwnerOf(const PlacementKey& key) const;

 private:
  std::vector<Member> members_;
  Sha256Digest epoch_{};
};

// The epoch of the endpoints (sorted and deduplicated here), as Membership::epoch.
Sha256Digest EpochOf(std::vector<std::string> endpoints);

}  // namespace kvpool
