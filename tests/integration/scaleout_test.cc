// Scale-out end to end (docs/scale-out.md): real kvpoold processes on 127.0.0.2-5 (one port, four
// loopback addresses), each told the same static peer list, and the routing client. The last
// test starts four more, told the headless name a test DNS server answers. The fourth
// daemon is listed from the start but only started by the membership-change test; the daemons'
// probes add it. Tests run in order and share the daemons (spread, co-location and fan-out, a
// fourth daemon and a stale client, a SIGKILLed daemon).
#include <signal.h>
#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/routing_client.h"
#include "common/placement.h"
#include "gtest/gtest.h"
#include "kvpool/v1/transport_service.grpc.pb.h"
#include "proto/member_probe.h"
#include "tests/integration/integration_util.h"
#include "tests/support/loopback_hosts.h"
#include "tests/support/test_dns_server.h"

namespace kvpool::integration {
namespace {

using client::RoutingClient;
using client::RoutingOptions;

constexpr Shape kShape{/*num_layers=*/1, /*q_heads=*/2, /*kv_heads=*/1, /*head_dim=*/64};
constexpr int kSink = 64, kBlock = 16, kRecent = 256;
constexpr int kSpreadSequences = 3000;
using ::kvpool::testing::FreePortOnAllHosts;
constexpr auto& kHosts = ::kvpool::testing::kLoopbackHosts;

std::vector<uint32_t> Prompt(int n, uint32_t salt) {
  std::vector<uint32_t> ids(n);
  for (int i = 0; i < n; ++i) ids[i] = salt * 100003u + static_cast<uint32_t>(i) * 7u;
  return ids;
}

class ScaleOutTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    port_ = FreePortOnAllHosts(kHosts);
    ASSERT_GT(port_, 0) << "no port free on 127.0.0.2-5";
    std::vector<std::string> peers;
    for (const char* h : kHosts) peers.push_back(Endpoint(h));
    peer_list_ = absl::StrJoin(peers, ",");
    for (int i = 0; i < 3; ++i) StartMember(i);
    // All three see each other before the tests start.
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(WaitForDaemonEpoch(i, 3));
  }
  static void TearDownTestSuite() {
    for (auto& d : daemons_) d.reset();
  }

  static std::string Endpoint(const char* host) { return absl::StrCat(host, ":", port_); }
  static std::string Target(int members) {
    std::vector<std::string> e;
    for (int i = 0; i < members; ++i) e.push_back(Endpoint(kHosts[i]));
    return absl::StrJoin(e, ",");
  }
  static Membership MembersOf(std::vector<int> indices) {
    std::vector<Member> m;
    for (int i : indices) m.push_back({Endpoint(kHosts[i]), 1});
    return *Membership::Create(m);
  }

  static void StartMember(int i) {
    client::LocalDaemonOptions options;
    options.binary = KvpooldPath();
    options.listen_host = kHosts[i];
    options.listen_port = port_;
    options.flags = {"--pool_bytes=134217728", "--worker_threads=1",
                     "--log_level=warn",       absl::StrCat("--advertise=", Endpoint(kHosts[i])),
                     "--peers=" + peer_list_,  "--peers_refresh=200ms",
                     "--peer_probe_timeout=2s"};
    options.startup_timeout = absl::Seconds(180);
    absl::StatusOr<std::unique_ptr<LocalDaemon>> d = LocalDaemon::Start(options);
    ASSERT_TRUE(d.ok()) << d.status();
    daemons_[i] = *std::move(d);
    absl::StatusOr<std::unique_ptr<KvpoolClient>> c = KvpoolClient::Connect(daemons_[i]->target());
    ASSERT_TRUE(c.ok());
    direct_[i] = *std::move(c);
    absl::StatusOr<v1::ModelInfo> m =
        RegisterDataFree(*direct_[i], "m", kShape, v1::ROTATION_KIND_RANDOMIZED_HADAMARD, 7);
    ASSERT_TRUE(m.ok()) << m.status();
  }

  // Waits until daemon `i` redirects with the epoch of the first `members` daemons: asked for a
  // key it does not own under that membership, it answers WRONG_OWNER with that epoch.
  // `members` < 0: daemons 0 and 2 only (after the kill and drain tests).
  static bool WaitForDaemonEpoch(int i, int members) {
    std::vector<int> indices;
    for (int j = 0; j < members; ++j) indices.push_back(j);
    if (members < 0) indices = {0, 2};
    const Membership m = MembersOf(indices);
    PlacementKey probe;
    for (int n = 0;; ++n) {
      probe = PlacementKeyOfSequence("probe", "m", absl::StrCat("p", n));
      if (m.OwnerOf(probe).endpoint != Endpoint(kHosts[i])) break;
    }
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    while (absl::Now() < give_up) {
      std::unique_ptr<KvpoolClient> c = direct_[i]->WithCallMetadata(
          {{kEpochMetadata, m.epoch_hex()}, {kPlacementKeyMetadata, probe.Hex()}});
      absl::Status s = c->DescribeSequence("no-such-sequence").status();
      if (ReasonOf(s) == ErrorReason::kWrongOwner &&
          ReasonMetadata(s)[kWrongOwnerEpochKey] == m.epoch_hex()) {
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

  static std::unique_ptr<RoutingClient> Router(absl::Duration refresh = absl::Seconds(2)) {
    RoutingOptions options;
    options.refresh_interval = refresh;
    options.connect_timeout = absl::Seconds(5);
    absl::StatusOr<std::unique_ptr<RoutingClient>> r = RoutingClient::Connect(peer_list_, options);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *std::move(r) : nullptr;
  }

  static uint64_t SequencesOn(int i) {
    absl::StatusOr<v1::GetStatsResponse> s = direct_[i]->GetStats();
    EXPECT_TRUE(s.ok()) << s.status();
    uint64_t n = 0;
    for (const auto& m : s->models()) n += m.sequences();
    return n;
  }

  static int port_;
  static std::string peer_list_;
  static std::unique_ptr<LocalDaemon> daemons_[4];
  static std::unique_ptr<KvpoolClient> direct_[4];
  // The stale client: made with three members, never refreshed on its own.
  static std::unique_ptr<RoutingClient> stale_;
};

int ScaleOutTest::port_ = 0;
std::string ScaleOutTest::peer_list_;
std::unique_ptr<LocalDaemon> ScaleOutTest::daemons_[4];
std::unique_ptr<KvpoolClient> ScaleOutTest::direct_[4];
std::unique_ptr<RoutingClient> ScaleOutTest::stale_;

TEST_F(ScaleOutTest, SequencesSpreadEvenlyOverTheDaemons) {
  stale_ = Router(/*refresh=*/absl::Hours(10));
  ASSERT_NE(stale_, nullptr);
  ASSERT_EQ(stale_->membership()->members().size(), 3u) << "the fourth daemon is not running";
  EXPECT_EQ(stale_->membership()->epoch_hex(), MembersOf({0, 1, 2}).epoch_hex());
  for (int n = 0; n < kSpreadSequences; ++n) {
    v1::CreateSequenceRequest request;
    request.set_model_id("m");
    request.set_sequence_id(absl::StrCat("spread-", n));
    ASSERT_TRUE(stale_->CreateSequence(request).ok()) << n;
  }
  EXPECT_EQ(stale_->redirects(), 0u);
  double mean = kSpreadSequences / 3.0, var = 0;
  uint64_t total = 0;
  for (int i = 0; i < 3; ++i) {
    const uint64_t n = SequencesOn(i);  // what the daemon itself holds
    total += n;
    var += (n - mean) * (n - mean) / 3.0;
  }
  EXPECT_EQ(total, static_cast<uint64_t>(kSpreadSequences));
  const double cv = std::sqrt(var) / mean;
  std::printf("spread: %d sequences over 3 daemons, coefficient of variation %.4f\n",
              kSpreadSequences, cv);
  EXPECT_LE(cv, 0.10);
}

TEST_F(ScaleOutTest, GetStatsReportsTheMembershipTheDaemonSees) {
  const Membership three = MembersOf({0, 1, 2});
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<v1::GetStatsResponse> s = direct_[i]->GetStats();
    ASSERT_TRUE(s.ok()) << s.status();
    const v1::MembershipStats& m = s->membership();
    EXPECT_EQ(m.advertise(), Endpoint(kHosts[i]));
    EXPECT_EQ(m.weight(), 134217728u);  // its own pool bytes
    EXPECT_EQ(m.epoch(), three.epoch_hex());
    ASSERT_EQ(m.members_size(), 3);
    for (int j = 0; j < 3; ++j) EXPECT_EQ(m.members(j).endpoint(), Endpoint(kHosts[j]));
  }
}

TEST_F(ScaleOutTest, TheOwnershipCheckAnswersWrongOwnerAndRejectsMalformedMetadata) {
  const Membership three = MembersOf({0, 1, 2});
  // A key daemon 0 does not own: WRONG_OWNER naming the owner and the daemon's epoch, and
  // nothing created.
  PlacementKey key;
  for (int n = 0;; ++n) {
    key = PlacementKeyOfSequence("default", "m", absl::StrCat("check-", n));
    if (three.OwnerOf(key).endpoint != Endpoint(kHosts[0])) break;
  }
  v1::CreateSequenceRequest request;
  request.set_model_id("m");
  request.set_sequence_id("check-wrong-owner");
  std::unique_ptr<KvpoolClient> placed = direct_[0]->WithCallMetadata(
      {{kEpochMetadata, three.epoch_hex()}, {kPlacementKeyMetadata, key.Hex()}});
  absl::Status s = placed->CreateSequence(request).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  ASSERT_EQ(ReasonOf(s), ErrorReason::kWrongOwner) << s;
  EXPECT_EQ(ReasonMetadata(s)[kWrongOwnerEpochKey], three.epoch_hex());
  EXPECT_EQ(ReasonMetadata(s)[kWrongOwnerOwnerKey], three.OwnerOf(key).endpoint);
  EXPECT_EQ(direct_[0]->DescribeSequence("check-wrong-owner").status().code(),
            absl::StatusCode::kNotFound);
  // PushKv (the GPU data plane) is checked before the transport is asked: the same redirect
  // even on a daemon without a device.
  {
    grpc::ClientContext call;
    call.AddMetadata(kEpochMetadata, three.epoch_hex());
    call.AddMetadata(kPlacementKeyMetadata, key.Hex());
    call.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::AppendKvResponse response;
    auto push = v1::TransportService::NewStub(direct_[0]->channel())->PushKv(&call, &response);
    v1::DevicePushRequest header;
    header.mutable_header()->set_session_id(1);
    header.mutable_header()->mutable_append()->set_sequence_id("check-wrong-owner");
    header.mutable_header()->mutable_append()->set_num_tokens(1);
    header.mutable_header()->mutable_append()->set_dtype(v1::DTYPE_BF16);
    push->Write(header);
    push->WritesDone();
    const absl::Status pushed = FromGrpcStatus(push->Finish(), "PushKv");
    EXPECT_EQ(ReasonOf(pushed), ErrorReason::kWrongOwner) << pushed;
    EXPECT_EQ(ReasonMetadata(pushed)[kWrongOwnerOwnerKey], three.OwnerOf(key).endpoint);
  }
  // Malformed metadata: INVALID_ARGUMENT, nothing created.
  const std::vector<std::vector<std::pair<std::string, std::string>>> malformed = {
      {{kPlacementKeyMetadata, "abc"}},
      {{kPlacementKeyMetadata, std::string(64, 'z')}},
      {{kEpochMetadata, "not-an-epoch"}},
      {{kPlacementKeyMetadata, key.Hex()}, {kPlacementKeyMetadata, key.Hex()}},
  };
  for (const auto& metadata : malformed) {
    absl::Status bad = direct_[0]->WithCallMetadata(metadata)->CreateSequence(request).status();
    EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(direct_[0]->DescribeSequence("check-wrong-owner").status().code(),
            absl::StatusCode::kNotFound);
  // A single-daemon client (no metadata) is served as before, and the sequence it made stays
  // usable by a routing call that names it, whoever owns its key.
  ASSERT_TRUE(direct_[0]->CreateSequence("m", "check-wrong-owner").ok());
  EXPECT_TRUE(placed->DescribeSequence("check-wrong-owner").ok());
  EXPECT_TRUE(direct_[0]->ReleaseSequence("check-wrong-owner").ok());
}

// The `kvpool` CLI with `args`: exit status and output (stdout and stderr).
std::pair<int, std::string> RunCli(const std::vector<std::string>& args) {
  std::string cmd = BinaryPath("KVPOOL_CLI", KVPOOL_CLI_PATH);
  for (const std::string& a : args) absl::StrAppend(&cmd, " '", a, "'");
  absl::StrAppend(&cmd, " 2>&1");
  std::string output;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return {-1, "popen failed"};
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) output.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

TEST_F(ScaleOutTest, TheCliRoutesAMultiDaemonTargetByPlacement) {
  const std::string target = "--target=" + peer_list_;  // lists the fourth, not running yet
  auto [code, out] = RunCli({target, "health"});
  EXPECT_EQ(code, 0) << out;
  EXPECT_TRUE(absl::StrContains(
      out, absl::StrCat("3 daemons, membership epoch ", MembersOf({0, 1, 2}).epoch_hex())))
      << out;
  const Membership three = MembersOf({0, 1, 2});
  std::set<std::string> owners;
  for (int n = 0; n < 6; ++n) {
    const std::string id = absl::StrCat("cli-", n);
    std::tie(code, out) = RunCli({target, "create", "--model=m", "--sequence=" + id});
    ASSERT_EQ(code, 0) << out;
    // Created on its owner only, and found there by the next command.
    const std::string owner = three.OwnerOf(PlacementKeyOfSequence("default", "m", id)).endpoint;
    owners.insert(owner);
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(direct_[i]->DescribeSequence(id).ok(), Endpoint(kHosts[i]) == owner) << id;
    }
    std::tie(code, out) = RunCli({target, "seal", "--model=m", "--sequence=" + id});
    EXPECT_EQ(code, 0) << out;
    std::tie(code, out) = RunCli({target, "release", "--model=m", "--sequence=" + id});
    EXPECT_EQ(code, 0) << out;
    EXPECT_FALSE(direct_[0]->DescribeSequence(id).ok());
  }
  EXPECT_GE(owners.size(), 2u);
  // stats asks every daemon.
  std::tie(code, out) = RunCli({target, "stats"});
  EXPECT_EQ(code, 0) << out;
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(absl::StrContains(out, "== " + Endpoint(kHosts[i]))) << out;
  }
  // A target that disagrees with the daemons (it lists two of the three): the key's owner among
  // the three answers nothing, the daemon asked redirects, the CLI refreshes (still two) and
  // reports the redirect after its one retry instead of hanging.
  std::string elsewhere;
  for (int n = 0;; ++n) {
    elsewhere = absl::StrCat("cli-elsewhere-", n);
    if (three.OwnerOf(PlacementKeyOfSequence("default", "m", elsewhere)).endpoint ==
        Endpoint(kHosts[2])) {
      break;
    }
  }
  std::tie(code, out) =
      RunCli({"--target=" + Target(2), "create", "--model=m", "--sequence=" + elsewhere});
  EXPECT_EQ(code, 1) << out;
  EXPECT_TRUE(absl::StrContains(out, "FAILED_PRECONDITION")) << out;
  EXPECT_TRUE(absl::StrContains(out, Endpoint(kHosts[2]))) << out;
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(direct_[i]->DescribeSequence(elsewhere).ok());
  // A sequence command without the model cannot be placed: a usage error, nothing sent.
  std::tie(code, out) = RunCli({target, "sequence", "--sequence=cli-0"});
  EXPECT_EQ(code, 1) << out;
  EXPECT_TRUE(absl::StrContains(out, "--model is required")) << out;
}

TEST_F(ScaleOutTest, SharedFirstBlockCoLocatesAndDeduplicatesAndAttendFansOut) {
  std::unique_ptr<RoutingClient> router = Router();
  ASSERT_NE(router, nullptr);
  const int tokens = kSink + 2 * kBlock + kRecent;
  const SequenceKv kv = MakeSequenceKv(kShape, tokens, 5);
  std::vector<client::LayerKv> layers = {{0, AsBytes(kv.k[0]), AsBytes(kv.v[0])}};
  std::set<std::string> owners;
  std::vector<std::string> firsts;
  for (uint32_t prompt = 1; prompt <= 10; ++prompt) {
    const std::vector<uint32_t> ids = Prompt(tokens, prompt);
    const std::string first = absl::StrCat("pfx-", prompt, "-a");
    v1::CreateSequenceRequest request;
    request.set_model_id("m");
    request.set_sequence_id(first);
    ASSERT_TRUE(router->CreateSequence(request, absl::MakeConstSpan(ids).subspan(0, kSink)).ok());
    v1::AppendKvHeader header;
    header.set_sequence_id(first);
    header.set_num_tokens(tokens);
    header.set_dtype(v1::DTYPE_BF16);
    header.set_end_of_prefill(true);
    header.mutable_token_ids()->Add(ids.begin(), ids.end());
    absl::StatusOr<v1::AppendKvResponse> appended = router->AppendKv(header, layers);
    ASSERT_TRUE(appended.ok()) << appended.status();
    // A second sequence with the same prompt: placed by the same first block, it lands on the
    // same daemon and attaches the cached prefix there.
    const std::string owner = *router->OwnerOf(first);
    int owner_index = 0;
    while (Endpoint(kHosts[owner_index]) != owner) ++owner_index;
    absl::StatusOr<v1::GetStatsResponse> before = direct_[owner_index]->GetStats();
    ASSERT_TRUE(before.ok()) << before.status();
    v1::CreateSequenceRequest again;
    again.set_model_id("m");
    again.set_sequence_id(absl::StrCat("pfx-", prompt, "-b"));
    again.mutable_prefix_token_ids()->Add(ids.begin(), ids.end());
    absl::StatusOr<v1::CreateSequenceResponse> created = router->CreateSequence(again);
    ASSERT_TRUE(created.ok()) << created.status();
    EXPECT_EQ(created->reused_tokens(), static_cast<uint32_t>(kSink + 2 * kBlock));
    // The owner's own accounting: the prefix is attached by reference (no new pages; its pages
    // stay shared).
    absl::StatusOr<v1::GetStatsResponse> after = direct_[owner_index]->GetStats();
    ASSERT_TRUE(after.ok()) << after.status();
    EXPECT_EQ(after->pool().used_bytes(), before->pool().used_bytes());
    EXPECT_GT(after->pool().shared_bytes(), 0u);
    EXPECT_EQ(*router->OwnerOf(again.sequence_id()), owner);
    owners.insert(owner);
    firsts.push_back(first);
    // The routed LookupPrefix reaches the same daemon and finds the prefix.
    absl::StatusOr<v1::LookupPrefixResponse> hit = router->LookupPrefix("m", ids);
    ASSERT_TRUE(hit.ok()) << hit.status();
    EXPECT_EQ(hit->matched_tokens(), static_cast<uint32_t>(kSink + 2 * kBlock));
  }
  EXPECT_GE(owners.size(), 2u) << "ten prompts all on one daemon";

  // Attend over sequences on several daemons: one result per query, in the caller's order,
  // equal to asking each owner directly; an unknown sequence fails alone.
  v1::AttendRequest request;
  request.set_model_id("m");
  request.set_dtype(v1::DTYPE_BF16);
  for (size_t i = 0; i < firsts.size(); ++i) {
    v1::SequenceQuery* q = request.add_queries();
    q->set_sequence_id(firsts[firsts.size() - 1 - i]);
    q->set_num_queries(1);
    q->set_q(std::string(AsBytes(GaussianBf16(kShape.q_heads * kShape.head_dim, 30 + i))));
  }
  request.add_queries()->set_sequence_id("never-created");
  std::vector<absl::StatusOr<v1::SequenceAttention>> results = router->Attend(request);
  ASSERT_EQ(results.size(), firsts.size() + 1);
  for (size_t i = 0; i < firsts.size(); ++i) {
    ASSERT_TRUE(results[i].ok()) << results[i].status();
    EXPECT_EQ(results[i]->sequence_id(), request.queries(i).sequence_id());
    const std::string owner = *router->OwnerOf(request.queries(i).sequence_id());
    absl::StatusOr<const KvpoolClient*> direct = router->ClientFor(owner);
    ASSERT_TRUE(direct.ok());
    v1::AttendRequest one = request;
    one.clear_queries();
    *one.add_queries() = request.queries(i);
    absl::StatusOr<v1::AttendResponse> alone = (*direct)->Attend(one);
    ASSERT_TRUE(alone.ok()) << alone.status();
    EXPECT_EQ(results[i]->out(), alone->results(0).out());
    EXPECT_EQ(results[i]->attended_tokens(), static_cast<uint32_t>(tokens));
  }
  EXPECT_EQ(results.back().status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ScaleOutTest, AFourthDaemonTakesAQuarterAndAStaleClientIsRedirectedOnce) {
  ASSERT_NE(stale_, nullptr);
  StartMember(3);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(WaitForDaemonEpoch(i, 4)) << kHosts[i];
  std::unique_ptr<RoutingClient> fresh = Router();
  ASSERT_NE(fresh, nullptr);
  ASSERT_EQ(fresh->membership()->epoch_hex(), MembersOf({0, 1, 2, 3}).epoch_hex());
  const Membership three = MembersOf({0, 1, 2});
  int moved = 0;
  for (int n = 0; n < kSpreadSequences; ++n) {
    const std::string id = absl::StrCat("spread-", n);
    const PlacementKey key = fresh->KeyOfSequence("m", id);
    fresh->Place(id, key);
    const bool moves = *fresh->OwnerOf(id) != three.OwnerOf(key).endpoint;
    moved += moves;
    // Moved keys are cache misses on their new owner (the new daemon); the rest are found.
    absl::StatusOr<v1::SequenceInfo> found = fresh->DescribeSequence(id);
    if (moves) {
      EXPECT_EQ(*fresh->OwnerOf(id), Endpoint(kHosts[3]));
      EXPECT_EQ(found.status().code(), absl::StatusCode::kNotFound) << id;
    } else {
      EXPECT_TRUE(found.ok()) << id << ": " << found.status();
    }
  }
  std::printf("fourth daemon: %d of %d keys moved (%.4f)\n", moved, kSpreadSequences,
              moved / static_cast<double>(kSpreadSequences));
  EXPECT_NEAR(moved / static_cast<double>(kSpreadSequences), 0.25, 0.05);
  EXPECT_EQ(fresh->redirects(), 0u);

  // The stale client still reads what its old owner holds (nothing migrates).
  int n = 0;
  for (;; ++n) {
    const PlacementKey key = stale_->KeyOfSequence("m", absl::StrCat("spread-", n));
    if (fresh->membership()->OwnerOf(key).endpoint != three.OwnerOf(key).endpoint) break;
  }
  EXPECT_TRUE(stale_->DescribeSequence(absl::StrCat("spread-", n)).ok());
  EXPECT_EQ(stale_->redirects(), 0u);
  // A new sequence whose owner changed: the stale client asks the old owner, is redirected,
  // refreshes and succeeds on the new daemon with one retry.
  std::string id;
  for (int k = 0;; ++k) {
    id = absl::StrCat("stale-", k);
    const PlacementKey key = stale_->KeyOfSequence("m", id);
    if (fresh->membership()->OwnerOf(key).endpoint == Endpoint(kHosts[3])) break;
  }
  v1::CreateSequenceRequest request;
  request.set_model_id("m");
  request.set_sequence_id(id);
  absl::StatusOr<v1::CreateSequenceResponse> created = stale_->CreateSequence(request);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(stale_->redirects(), 1u);
  EXPECT_EQ(stale_->membership()->epoch_hex(), MembersOf({0, 1, 2, 3}).epoch_hex());
  EXPECT_TRUE(direct_[3]->DescribeSequence(id).ok());
}

TEST_F(ScaleOutTest, AKilledDaemonFailsFastAndOnlyItsSequencesAreLost) {
  std::unique_ptr<RoutingClient> router = Router(/*refresh=*/absl::Hours(10));
  ASSERT_NE(router, nullptr);
  ASSERT_EQ(router->membership()->members().size(), 4u);
  const std::string victim = Endpoint(kHosts[1]);
  std::vector<std::string> lost, kept;
  for (int n = 0; n < 400; ++n) {
    const std::string id = absl::StrCat("kill-", n);
    v1::CreateSequenceRequest request;
    request.set_model_id("m");
    request.set_sequence_id(id);
    ASSERT_TRUE(router->CreateSequence(request).ok());
    (*router->OwnerOf(id) == victim ? lost : kept).push_back(id);
  }
  ASSERT_FALSE(lost.empty());
  ASSERT_EQ(kill(daemons_[1]->pid(), SIGKILL), 0);
  while (daemons_[1]->Running()) std::this_thread::sleep_for(std::chrono::milliseconds(10));

  // A call for one of its sequences fails with UNAVAILABLE within twice the connect timeout.
  const absl::Time start = absl::Now();
  absl::Status s = router->DescribeSequence(lost[0]).status();
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  std::printf("killed daemon: the call failed after %s (connect timeout 5s)\n",
              absl::FormatDuration(took).c_str());
  EXPECT_LT(took, 2 * absl::Seconds(5));
  // That failure refreshed the membership: the dead daemon is gone.
  EXPECT_EQ(router->membership()->members().size(), 3u);
  EXPECT_FALSE(router->membership()->Contains(victim));
  // Every other sequence is still served; the dead daemon's are misses (NOT_FOUND) on their
  // new owners once the daemons have dropped it too.
  for (const std::string& id : kept) {
    absl::StatusOr<v1::SequenceInfo> found = router->DescribeSequence(id);
    EXPECT_TRUE(found.ok()) << id << ": " << found.status();
  }
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  for (const std::string& id : lost) {
    absl::Status miss = router->DescribeSequence(id).status();
    while (miss.code() != absl::StatusCode::kNotFound && absl::Now() < give_up) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      miss = router->DescribeSequence(id).status();
    }
    EXPECT_EQ(miss.code(), absl::StatusCode::kNotFound) << id << ": " << miss;
  }
}

TEST_F(ScaleOutTest, ADrainedDaemonLeavesMidLoadWithoutHangsOrWrongAnswers) {
  std::unique_ptr<RoutingClient> router = Router(/*refresh=*/absl::Milliseconds(200));
  ASSERT_NE(router, nullptr);
  const std::string drained = Endpoint(kHosts[3]);
  ASSERT_TRUE(router->membership()->Contains(drained));
  std::vector<std::string> ids;
  for (int n = 0; n < 200; ++n) {
    v1::CreateSequenceRequest request;
    request.set_model_id("m");
    request.set_sequence_id(absl::StrCat("drain-", n));
    ASSERT_TRUE(router->CreateSequence(request).ok());
    ids.push_back(request.sequence_id());
  }
  std::map<std::string, std::string> owner_before;
  for (const std::string& id : ids) owner_before[id] = *router->OwnerOf(id);
  // Load while the daemon drains (SIGTERM: health NOT_SERVING, then it stops): every answer is
  // the sequence asked for, or a miss/unavailable for the drained daemon's sequences only.
  std::atomic<bool> stop{false};
  std::atomic<int> served{0}, wrong{0};
  std::thread load([&] {
    for (int i = 0; !stop.load(); ++i) {
      const std::string& id = ids[i % ids.size()];
      absl::StatusOr<v1::SequenceInfo> info = router->DescribeSequence(id);
      if (info.ok()) {
        ++served;
        if (info->sequence_id() != id) ++wrong;
      } else if (owner_before[id] != drained) {
        ++wrong;
        ADD_FAILURE() << id << " on a live daemon: " << info.status();
      }
    }
  });
  ASSERT_TRUE(daemons_[3]->Stop().ok());
  // The client and the daemons drop it at their next probes.
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (router->membership()->Contains(drained) && absl::Now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_FALSE(router->membership()->Contains(drained));
  for (int i : {0, 2}) EXPECT_TRUE(WaitForDaemonEpoch(i, -1)) << kHosts[i];
  stop = true;
  load.join();
  EXPECT_GT(served.load(), 0);
  EXPECT_EQ(wrong.load(), 0);
  for (const std::string& id : ids) {
    absl::StatusOr<v1::SequenceInfo> info = router->DescribeSequence(id);
    if (owner_before[id] == drained) {
      EXPECT_EQ(info.status().code(), absl::StatusCode::kNotFound) << id << ": " << info.status();
    } else {
      EXPECT_TRUE(info.ok()) << id << ": " << info.status();
    }
  }
}

// The headless Service as the chart names it, answered by a DNS server on loopback: four daemons
// and a routing client given `dns://127.0.0.1:DNSPORT/kvpool-headless.test:PORT` resolve it
// through that server (c-ares), see the same four members, and place and find sequences; the
// CLI sees the same four.
TEST(ScaleOutDnsTest, DaemonsAndClientResolveTheHeadlessNameThroughADnsServer) {
  const int port = FreePortOnAllHosts(kHosts);
  ASSERT_GT(port, 0) << "no port free on 127.0.0.2-5";
  std::vector<std::string> all(std::begin(kHosts), std::end(kHosts));
  ::kvpool::testing::TestDnsServer dns("kvpool-headless.test", all);
  ASSERT_TRUE(dns.ok());
  const std::string target =
      absl::StrCat("dns://127.0.0.1:", dns.port(), "/kvpool-headless.test:", port);

  std::vector<std::unique_ptr<LocalDaemon>> daemons;
  std::vector<std::unique_ptr<KvpoolClient>> direct;
  std::vector<Member> expected;
  for (const char* host : kHosts) {
    const std::string endpoint = absl::StrCat(host, ":", port);
    expected.push_back({endpoint, 1});
    client::LocalDaemonOptions options;
    options.binary = KvpooldPath();
    options.listen_host = host;
    options.listen_port = port;
    options.flags = {"--pool_bytes=134217728",  "--worker_threads=1", "--log_level=warn",
                     "--advertise=" + endpoint, "--peers=" + target,  "--peers_refresh=200ms",
                     "--peer_probe_timeout=2s"};
    options.startup_timeout = absl::Seconds(180);
    absl::StatusOr<std::unique_ptr<LocalDaemon>> d = LocalDaemon::Start(options);
    ASSERT_TRUE(d.ok()) << d.status();
    absl::StatusOr<std::unique_ptr<KvpoolClient>> c = KvpoolClient::Connect((*d)->target());
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_TRUE(RegisterDataFree(**c, "m", kShape, v1::ROTATION_KIND_RANDOMIZED_HADAMARD, 7).ok());
    daemons.push_back(*std::move(d));
    direct.push_back(*std::move(c));
  }
  const Membership four = *Membership::Create(expected);

  // Every daemon's membership comes from the DNS answer: all four, one epoch.
  for (size_t i = 0; i < direct.size(); ++i) {
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    std::string epoch;
    while (absl::Now() < give_up) {
      absl::StatusOr<v1::GetStatsResponse> s = direct[i]->GetStats();
      ASSERT_TRUE(s.ok()) << s.status();
      epoch = s->membership().epoch();
      if (epoch == four.epoch_hex()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    EXPECT_EQ(epoch, four.epoch_hex()) << "daemon " << i;
  }

  RoutingOptions options;
  options.refresh_interval = absl::Hours(10);  // refreshed by the test alone
  options.connect_timeout = absl::Seconds(5);
  absl::StatusOr<std::unique_ptr<RoutingClient>> router = RoutingClient::Connect(target, options);
  ASSERT_TRUE(router.ok()) << router.status();
  ASSERT_EQ((*router)->membership()->members(), four.members());
  EXPECT_EQ((*router)->membership()->epoch_hex(), four.epoch_hex());

  constexpr int kSequences = 200;
  for (int n = 0; n < kSequences; ++n) {
    v1::CreateSequenceRequest request;
    request.set_model_id("m");
    request.set_sequence_id(absl::StrCat("dns-", n));
    ASSERT_TRUE((*router)->CreateSequence(request).ok()) << n;
  }
  uint64_t total = 0;
  for (size_t i = 0; i < direct.size(); ++i) {
    absl::StatusOr<v1::GetStatsResponse> s = direct[i]->GetStats();
    ASSERT_TRUE(s.ok()) << s.status();
    uint64_t on_daemon = 0;
    for (const auto& m : s->models()) on_daemon += m.sequences();
    EXPECT_GT(on_daemon, 0u) << "daemon " << i << " got no sequence";
    total += on_daemon;
  }
  EXPECT_EQ(total, static_cast<uint64_t>(kSequences));
  for (int n = 0; n < kSequences; ++n) {
    EXPECT_TRUE((*router)->DescribeSequence(absl::StrCat("dns-", n)).ok()) << n;
  }
  EXPECT_EQ((*router)->redirects(), 0u);
  // The CLI takes the same target.
  auto [code, out] = RunCli({"--target=" + target, "health"});
  EXPECT_EQ(code, 0) << out;
  EXPECT_TRUE(
      absl::StrContains(out, absl::StrCat("4 daemons, membership epoch ", four.epoch_hex())))
      << out;

  // The name is re-resolved: an address the server stops giving leaves the client's membership
  // at its next refresh, and comes back with it.
  ASSERT_TRUE(dns.SetAddresses({all[0], all[1], all[2]}));
  ASSERT_TRUE((*router)->Refresh().ok());
  EXPECT_EQ((*router)->membership()->members().size(), 3u);
  ASSERT_TRUE(dns.SetAddresses(all));
  ASSERT_TRUE((*router)->Refresh().ok());
  EXPECT_EQ((*router)->membership()->epoch_hex(), four.epoch_hex());
  for (int n = 0; n < kSequences; ++n) {
    EXPECT_TRUE((*router)->DescribeSequence(absl::StrCat("dns-", n)).ok()) << n;
  }
}

}  // namespace
}  // namespace kvpool::integration
