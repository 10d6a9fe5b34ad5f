#include "client/routing_client.h"

#include <algorithm>
#include <future>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/membership_target.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "proto/status.h"

namespace kvpool::client {

absl::StatusOr<std::unique_ptr<RoutingClient>> RoutingClient::Connect(
    const std::string& target, const RoutingOptions& options) {
  KVPOOL_ASSIGN_OR_RETURN(MembershipTarget parsed, ParseMembershipTarget(target));
  auto client = std::unique_ptr<RoutingClient>(new RoutingClient(options));
  client->prober_ = std::make_unique<MemberProber>(std::move(parsed), /*default_weight=*/1,
                                                   options.probe_timeout);
  KVPOOL_RETURN_IF_ERROR(client->Refresh());
  if (client->membership()->empty()) {
    return absl::UnavailableError(absl::StrCat("no daemon of ", Quote(target), " answers"));
  }
  client->refresher_ = std::thread([c = client.get()] { c->RefreshLoop(); });
  return client;
}

RoutingClient::~RoutingClient() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (refresher_.joinable()) refresher_.join();
}

absl::Status RoutingClient::Refresh() {
  KVPOOL_ASSIGN_OR_RETURN(Membership live, prober_->Probe());
  absl::MutexLock lock(&mu_);
  membership_ = std::make_shared<const Membership>(std::move(live));
  return absl::OkStatus();
}

void RoutingClient::RefreshLoop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto stopping = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_; };
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping), options_.refresh_interval)) return;
    }
    (void)Refresh();  // a failed refresh keeps the last membership
  }
}

std::shared_ptr<const Membership> RoutingClient::membership() const {
  absl::MutexLock lock(&mu_);
  return membership_;
}

uint64_t RoutingClient::redirects() const {
  absl::MutexLock lock(&mu_);
  return redirects_;
}

absl::StatusOr<const KvpoolClient*> RoutingClient::ClientFor(const std::string& endpoint) {
  absl::MutexLock lock(&mu_);
  std::unique_ptr<KvpoolClient>& client = clients_[endpoint];
  if (client == nullptr) {
    KVPOOL_ASSIGN_OR_RETURN(client, KvpoolClient::Connect(endpoint, options_.client));
  }
  return client.get();
}

absl::StatusOr<const KvpoolClient*> RoutingClient::Connected(const std::string& endpoint) {
  KVPOOL_ASSIGN_OR_RETURN(const KvpoolClient* client, ClientFor(endpoint));
  const auto give_up = absl::ToChronoTime(absl::Now() + options_.connect_timeout);
  grpc_connectivity_state state = client->channel()->GetState(/*try_to_connect=*/true);
  while (state != GRPC_CHANNEL_READY) {
    if (state == GRPC_CHANNEL_TRANSIENT_FAILURE || state == GRPC_CHANNEL_SHUTDOWN ||
        !client->channel()->WaitForStateChange(state, give_up)) {
      return absl::UnavailableError(absl::StrCat(
          "daemon ", endpoint, " is unreachable (its sequences are lost: re-prefill)"));
    }
    state = client->channel()->GetState(/*try_to_connect=*/true);
  }
  return client;
}

absl::Status RoutingClient::ForEachMember(
    const std::function<absl::Status(const KvpoolClient&)>& call) {
  for (const Member& m : membership()->members()) {
    KVPOOL_ASSIGN_OR_RETURN(const KvpoolClient* client, Connected(m.endpoint));
    KVPOOL_RETURN_IF_ERROR(call(*client));
  }
  return absl::OkStatus();
}

PlacementKey RoutingClient::KeyOfTokens(const std::string& model_id,
                                        absl::Span<const uint32_t> first_block_tokens) const {
  return PlacementKeyOfTokens(options_.tenant, model_id, first_block_tokens);
}

PlacementKey RoutingClient::KeyOfSequence(const std::string& model_id,
                                          const std::string& sequence_id) const {
  return PlacementKeyOfSequence(options_.tenant, model_id, sequence_id);
}

void RoutingClient::Place(const std::string& sequence_id, const PlacementKey& key) {
  absl::MutexLock lock(&mu_);
  placements_[sequence_id] = key;
}

absl::StatusOr<PlacementKey> RoutingClient::KeyOf(const std::string& sequence_id) const {
  absl::MutexLock lock(&mu_);
  auto it = placements_.find(sequence_id);
  if (it == placements_.end()) {
    return absl::NotFoundError(absl::StrCat("sequence ", Quote(sequence_id),
                                            " was not placed by this client (CreateSequence or "
                                            "Place first)"));
  }
  return it->second;
}

absl::StatusOr<std::string> RoutingClient::OwnerOf(const std::string& sequence_id) const {
  KVPOOL_ASSIGN_OR_RETURN(PlacementKey key, KeyOf(sequence_id));
  std::shared_ptr<const Membership> members = membership();
  if (members->empty()) return absl::UnavailableError("no live daemon");
  return members->OwnerOf(key).endpoint;
}

absl::StatusOr<std::unique_ptr<KvpoolClient>> RoutingClient::OwnerClient(const PlacementKey& key) {
  std::shared_ptr<const Membership> members = membership();
  if (members->empty()) {
    (void)Refresh();
    members = membership();
    if (members->empty()) return absl::UnavailableError("no live daemon");
  }
  absl::StatusOr<const KvpoolClient*> client = Connected(members->OwnerOf(key).endpoint);
  if (!client.ok()) {
    (void)Refresh();  // the dead daemon leaves the membership
    return client.status();
  }
  return (*client)->WithCallMetadata(
      {{kEpochMetadata, members->epoch_hex()}, {kPlacementKeyMetadata, key.Hex()}});
}

template <typename T>
absl::StatusOr<T> RoutingClient::Routed(
    const PlacementKey& key, const std::function<absl::StatusOr<T>(const KvpoolClient&)>& call) {
  absl::Status last;
  for (int attempt = 0; attempt < 2; ++attempt) {
    KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<KvpoolClient> placed, OwnerClient(key));
    absl::StatusOr<T> result = call(*placed);
    if (result.ok()) return result;
    last = result.status();
    if (ReasonOf(last) == ErrorReason::kWrongOwner && attempt == 0) {
      {
        absl::MutexLock lock(&mu_);
        ++redirects_;
      }
      KVPOOL_RETURN_IF_ERROR(Refresh());
      continue;
    }
    if (last.code() == absl::StatusCode::kUnavailable) (void)Refresh();
    return last;
  }
  return last;
}

absl::StatusOr<v1::CreateSequenceResponse> RoutingClient::CreateSequence(
    const v1::CreateSequenceRequest& request, absl::Span<const uint32_t> first_block_tokens) {
  PlacementKey key;
  if (!first_block_tokens.empty()) {
    key = KeyOfTokens(request.model_id(), first_block_tokens);
  } else if (request.prefix_token_ids_size() > 0) {
    const size_t n =
        std::min<size_t>(request.prefix_token_ids_size(), options_.placement_prefix_tokens);
    key =
        KeyOfTokens(request.model_id(), absl::MakeConstSpan(request.prefix_token_ids().data(), n));
  } else {
    key = KeyOfSequence(request.model_id(), request.sequence_id());
  }
  auto result = Routed<v1::CreateSequenceResponse>(
      key, [&](const KvpoolClient& c) { return c.CreateSequence(request); });
  if (result.ok()) Place(result->sequence().sequence_id(), key);
  return result;
}

absl::StatusOr<v1::AppendKvResponse> RoutingClient::AppendKv(const v1::AppendKvHeader& header,
                                                             absl::Span<const LayerKv> layers) {
  KVPOOL_ASSIGN_OR_RETURN(PlacementKey key, KeyOf(header.sequence_id()));
  return Routed<v1::AppendKvResponse>(
      key, [&](const KvpoolClient& c) { return c.AppendKv(header, layers); });
}

absl::StatusOr<v1::AppendDecodeResponse> RoutingClient::AppendDecode(
    const v1::AppendDecodeRequest& request) {
  KVPOOL_ASSIGN_OR_RETURN(PlacementKey key, KeyOf(request.sequence_id()));
  return Routed<v1::AppendDecodeResponse>(
      key, [&](const KvpoolClient& c) { return c.AppendDecode(request); });
}

absl::StatusOr<v1::SequenceInfo> RoutingClient::SealSequence(const std::string& sequence_id) {
  KVPOOL_ASSIGN_OR_RETURN(PlacementKey key, KeyOf(sequence_id));
  return Routed<v1::SequenceInfo>(
      key, [&](const KvpoolClient& c) { return c.SealSequence(sequence_id); });
}

absl::StatusOr<v1::ReleaseSequenceResponse> RoutingClient::ReleaseSequence(
    const std::string& sequence_id) {
  KVPOOL_ASSIGN_OR_RETURN(PlacementKey key, KeyOf(sequence_id));
  auto result = Routed<v1::ReleaseSequenceResponse>(
      key, [&](const KvpoolClient& c) { return c.ReleaseSequence(sequence_id); });
  if (result.ok()) {
    absl::MutexLock lock(&mu_);
    placements_.erase(sequence_id);
  }
  return result;
}

absl::StatusOr<v1::SequenceInfo> RoutingClient::DescribeSequence(const std::string& sequence_id) {
  KVPOOL_ASSIGN_OR_RETURN(PlacementKey key, KeyOf(sequence_id));
  return Routed<v1::SequenceInfo>(
      key, [&](const KvpoolClient& c) { return c.DescribeSequence(sequence_id); });
}

absl::StatusOr<KvRead> RoutingClient::ReadKv(const v1::ReadKvRequest& request) {
  KVPOOL_ASSIGN_OR_RETURN(PlacementKey key, KeyOf(request.sequence_id()));
  return Routed<KvRead>(key, [&](const KvpoolClient& c) { return c.ReadKv(request); });
}

absl::StatusOr<v1::LookupPrefixResponse> RoutingClient::LookupPrefix(
    const std::string& model_id, absl::Span<const uint32_t> token_ids) {
  const PlacementKey key = KeyOfTokens(
      model_id, token_ids.subspan(0, std::min(token_ids.size(), options_.placement_prefix_tokens)));
  return Routed<v1::LookupPrefixResponse>(
      key, [&](const KvpoolClient& c) { return c.LookupPrefix(model_id, token_ids); });
}

std::vector<absl::StatusOr<v1::SequenceAttention>> RoutingClient::Attend(
    const v1::AttendRequest& request) {
  const int n = request.queries_size();
  std::vector<absl::StatusOr<v1::SequenceAttention>> results(
      n, absl::InternalError("Attend: not attempted"));
  std::vector<int> pending(n);
  for (int i = 0; i < n; ++i) pending[i] = i;
  for (int attempt = 0; attempt < 2 && !pending.empty(); ++attempt) {
    std::shared_ptr<const Membership> members = membership();
    // Owner -> indices into request.queries().
    std::map<std::string, std::vector<int>> groups;
    for (int i : pending) {
      absl::StatusOr<PlacementKey> key = KeyOf(request.queries(i).sequence_id());
      if (!key.ok()) {
        results[i] = key.status();
      } else if (members->empty()) {
        results[i] = absl::UnavailableError("Attend: no live daemon");
      } else {
        groups[members->OwnerOf(*key).endpoint].push_back(i);
      }
    }
    std::vector<std::pair<const std::vector<int>*, std::future<absl::Status>>> parts;
    for (const auto& [owner, indices] : groups) {
      const std::string endpoint = owner;
      const std::vector<int>* idx = &indices;
      parts.emplace_back(
          idx, std::async(std::launch::async, [&, endpoint, idx]() -> absl::Status {
            KVPOOL_ASSIGN_OR_RETURN(const KvpoolClient* client, Connected(endpoint));
            v1::AttendRequest part;
            part.set_model_id(request.model_id());
            part.set_layer(request.layer());
            part.set_dtype(request.dtype());
            for (int i : *idx) *part.add_queries() = request.queries(i);
            std::unique_ptr<KvpoolClient> placed =
                client->WithCallMetadata({{kEpochMetadata, members->epoch_hex()}});
            KVPOOL_ASSIGN_OR_RETURN(v1::AttendResponse response, placed->Attend(part));
            if (response.results_size() != static_cast<int>(idx->size())) {
              return absl::DataLossError(
                  "Attend: the daemon answered a different number of results");
            }
            for (size_t j = 0; j < idx->size(); ++j) {
              results[(*idx)[j]] = std::move(*response.mutable_results(static_cast<int>(j)));
            }
            return absl::OkStatus();
          }));
    }
    std::vector<int> retry;
    bool refresh = false;
    for (auto& [idx, done] : parts) {
      const absl::Status s = done.get();
      if (s.ok()) continue;
      for (int i : *idx) results[i] = s;
      if (ReasonOf(s) == ErrorReason::kWrongOwner && attempt == 0) {
        retry.insert(retry.end(), idx->begin(), idx->end());
      }
      refresh |=
          ReasonOf(s) == ErrorReason::kWrongOwner || s.code() == absl::StatusCode::kUnavailable;
    }
    if (refresh) (void)Refresh();
    if (!retry.empty()) {
      absl::MutexLock lock(&mu_);
      ++redirects_;
    }
    pending = std::move(retry);
  }
  return results;
}

}  // namespace kvpool::client
