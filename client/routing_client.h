// RoutingClient: one client over many kvpoold (docs/scale-out.md). The target names the daemons
// (a static list, or dns:///NAME:PORT resolved to every address); each sequence goes to its
// owner by weighted rendezvous hashing of its placement key (common/placement.h), which the
// client remembers per sequence from CreateSequence on. Every routed call carries the client's
// membership epoch and the key; a WRONG_OWNER answer makes the client refresh its membership and
// retry once. A dead or unreachable daemon fails the call fast with UNAVAILABLE (the engine
// re-prefills) and drops out of the membership at the refresh that follows. Attend over
// sequences on several daemons is fanned out in parallel and merged in the caller's order.
//
//   KVPOOL_ASSIGN_OR_RETURN(auto pool, RoutingClient::Connect("dns:///kvpool-headless:50051"));
//   KVPOOL_RETURN_IF_ERROR(pool->ForEachMember([&](const KvpoolClient& c) {
//     return c.RegisterModel(spec).status(); }));
//   auto created = pool->CreateSequence(request, first_block_token_ids);
//   auto results = pool->Attend(attend_request);   // one StatusOr per query, in order
//
// The single-daemon KvpoolClient (client/kvpool_client.h) is unchanged; this layers on it.
// Thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/kvpool_client.h"
#include "common/placement.h"
#include "proto/member_probe.h"

namespace kvpool::client {

struct RoutingOptions {
  ClientOptions client;  // options of each daemon's client
  // The tenant name placed in placement keys; clients of one tenant must agree on it.
  std::string tenant = "default";
  // Tokens taken from CreateSequenceRequest.prefix_token_ids for the key when the caller gives
  // no first block (the model's first prefix unit: the sink, 64 tokens by default).
  size_t placement_prefix_tokens = 64;
  // How long a call waits for a connection to its daemon before failing with UNAVAILABLE.
  absl::Duration connect_timeout = absl::Seconds(2);
  // Membership refresh period (also refreshed on WRONG_OWNER and UNAVAILABLE).
  absl::Duration refresh_interval = absl::Seconds(5);
  absl::Duration probe_timeout = absl::Seconds(1);
};

class RoutingClient {
 public:
  // Parses `target`, probes the members once and starts the periodic refresh. InvalidArgument
  // for a malformed target; Unavailable when no member answers.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<RoutingClient>> Connect(
      const std::string& target, const RoutingOptions& options = {});
  ~RoutingClient();

  // Resolves and probes the target now.
  [[nodiscard]] absl::Status Refresh();
  std::shared_ptr<const Membership> membership() const;
  // The client of one member (cached; connects on first use).
  [[nodiscard]] absl::StatusOr<const KvpoolClient*> ClientFor(const std::string& endpoint);
  // Runs `call` on every member in turn; the first error stops it. (Model registration: every
  // daemon serves every model.)
  [[nodiscard]] absl::Status ForEachMember(
      const std::function<absl::Status(const KvpoolClient&)>& call);

  PlacementKey KeyOfTokens(const std::string& model_id,
                           absl::Span<const uint32_t> first_block_tokens) const;
  PlacementKey KeyOfSequence(const std::string& model_id, const std::string& sequence_id) const;
  // Remembers where `sequence_id` lives (for sequences this client did not create).
  void Place(const std::string& sequence_id, const PlacementKey& key);
  // The owner of `sequence_id` under the current membership; NotFound if never placed.
  [[nodiscard]] absl::StatusOr<std::string> OwnerOf(const std::string& sequence_id) const;

  // The owner of `key` under the current membership, connected, as a client whose calls carry
  // the routing metadata (epoch and key): for callers that make their own calls (the CLI).
  // UNAVAILABLE when no member is live or the owner is unreachable (then refreshed); a
  // WRONG_OWNER answer is the caller's to handle (Refresh, then ask again once).
  [[nodiscard]] absl::StatusOr<std::unique_ptr<KvpoolClient>> OwnerClient(const PlacementKey& key);

  // --- routed calls (as KvpoolClient's, on the sequence's owner) ---
  // Places the sequence by `first_block_tokens`, else by the first placement_prefix_tokens of
  // request.prefix_token_ids, else by its id.
  [[nodiscard]] absl::StatusOr<v1::CreateSequenceResponse> CreateSequence(
      const v1::CreateSequenceRequest& request, absl::Span<const uint32_t> first_block_tokens = {});
  [[nodiscard]] absl::StatusOr<v1::AppendKvResponse> AppendKv(const v1::AppendKvHeader& header,
                                                              absl::Span<const LayerKv> layers);
  [[nodiscard]] absl::StatusOr<v1::AppendDecodeResponse> AppendDecode(
      const v1::AppendDecodeRequest& request);
  [[nodiscard]] absl::StatusOr<v1::SequenceInfo> SealSequence(const std::string& sequence_id);
  [[nodiscard]] absl::StatusOr<v1::ReleaseSequenceResponse> ReleaseSequence(
      const std::string& sequence_id);
  [[nodiscard]] absl::StatusOr<v1::SequenceInfo> DescribeSequence(const std::string& sequence_id);
  [[nodiscard]] absl::StatusOr<KvRead> ReadKv(const v1::ReadKvRequest& request);
  // Asks the owner of the prefix's first block (the first placement_prefix_tokens tokens).
  [[nodiscard]] absl::StatusOr<v1::LookupPrefixResponse> LookupPrefix(
      const std::string& model_id, absl::Span<const uint32_t> token_ids);
  // One result per request.queries() entry, in that order: the sequence's attention or why
  // not. The batch is split by owner and the parts run in parallel.
  [[nodiscard]] std::vector<absl::StatusOr<v1::SequenceAttention>> Attend(
      const v1::AttendRequest& request);

  // Calls answered WRONG_OWNER and retried, since the start.
  uint64_t redirects() const;

 private:
  explicit RoutingClient(RoutingOptions options) : options_(std::move(options)) {}
  template <typename T>
  absl::StatusOr<T> Routed(const PlacementKey& key,
                           const std::function<absl::StatusOr<T>(const KvpoolClient&)>& call);
  // The client of `endpoint` once connected (UNAVAILABLE after connect_timeout or when the
  // connection fails).
  absl::StatusOr<const KvpoolClient*> Connected(const std::string& endpoint);
  absl::StatusOr<PlacementKey> KeyOf(const std::string& sequence_id) const;
  void RefreshLoop();

  const RoutingOptions options_;
  std::unique_ptr<MemberProber> prober_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const Membership> membership_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::unique_ptr<KvpoolClient>> clients_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, PlacementKey> placements_ ABSL_GUARDED_BY(mu_);
  uint64_t redirects_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread refresher_;
};

}  // namespace kvpool::client
