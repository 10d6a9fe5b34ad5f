#include "common/placement.h"

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/membership_target.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace kvpool {
namespace {

nlohmann::json LoadVectors() {
  std::ifstream in(std::string(KVPOOL_FIXTURES_DIR) + "/placement_vectors.json");
  EXPECT_TRUE(in.good());
  return nlohmann::json::parse(in);
}

Membership MembershipFromJson(const nlohmann::json& list) {
  std::vector<Member> members;
  for (const auto& m : list) members.push_back({m[0].get<std::string>(), m[1].get<uint64_t>()});
  absl::StatusOr<Membership> membership = Membership::Create(members);
  EXPECT_TRUE(membership.ok()) << membership.status();
  return *membership;
}

Membership Equal(int n, int first_octet = 2) {
  std::vector<Member> members;
  for (int i = 0; i < n; ++i)
    members.push_back({absl::StrCat("127.0.0.", first_octet + i, ":7000"), 1});
  return *Membership::Create(members);
}

TEST(PlacementTest, EpochsMatchTheFixedVectors) {
  const nlohmann::json v = LoadVectors();
  ASSERT_GE(v["epochs"].size(), 4u);
  for (const auto& e : v["epochs"]) {
    EXPECT_EQ(HexOf(EpochOf(e["endpoints"].get<std::vector<std::string>>())),
              e["epoch"].get<std::string>());
  }
}

TEST(PlacementTest, KeysMatchTheFixedVectors) {
  const nlohmann::json v = LoadVectors();
  ASSERT_GE(v["keys"].size(), 7u);
  for (const auto& k : v["keys"]) {
    const std::string tenant = k["tenant"], model = k["model"];
    PlacementKey key;
    if (k["kind"] == "tokens") {
      key = PlacementKeyOfTokens(tenant, model, k["tokens"].get<std::vector<uint32_t>>());
    } else {
      key = PlacementKeyOfSequence(tenant, model, k["sequence_id"].get<std::string>());
    }
    EXPECT_EQ(key.Hex(), k["key"].get<std::string>());
  }
}

TEST(PlacementTest, ScoresAndOwnersMatchTheFixedVectors) {
  const nlohmann::json v = LoadVectors();
  ASSERT_GE(v["owners"].size(), 24u);
  for (const auto& o : v["owners"]) {
    const nlohmann::json& list = v["memberships"][o["membership"].get<int>()];
    const Membership members = MembershipFromJson(list);
    absl::StatusOr<PlacementKey> key = PlacementKey::FromHex(o["key"].get<std::string>());
    ASSERT_TRUE(key.ok()) << key.status();
    for (size_t i = 0; i < list.size(); ++i) {
      const double expected = std::strtod(o["scores"][i].get<std::string>().c_str(), nullptr);
      EXPECT_EQ(RendezvousScore(*key, list[i][0].get<std::string>(), list[i][1].get<uint64_t>()),
                expected);
    }
    EXPECT_EQ(members.OwnerOf(*key).endpoint, o["owner"].get<std::string>());
  }
}

TEST(PlacementTest, EqualWeightsSpreadKeysEvenly) {
  const Membership members = Equal(4);
  std::map<std::string, int> per_endpoint;
  constexpr int kKeys = 4000;
  for (int i = 0; i < kKeys; ++i) {
    ++per_endpoint[members.OwnerOf(PlacementKeyOfSequence("t", "m", absl::StrCat("s", i)))
                       .endpoint];
  }
  ASSERT_EQ(per_endpoint.size(), 4u);
  const double mean = kKeys / 4.0;
  double var = 0;
  for (const auto& [e, n] : per_endpoint) var += (n - mean) * (n - mean) / 4.0;
  EXPECT_LE(std::sqrt(var) / mean, 0.10);
}

TEST(PlacementTest, UnequalWeightsTakeProportionalShares) {
  const Membership members =
      *Membership::Create({{"a:1", 4 << 20}, {"b:1", 2 << 20}, {"c:1", 1 << 20}, {"d:1", 1 << 20}});
  std::map<std::string, int> per_endpoint;
  constexpr int kKeys = 8000;
  for (int i = 0; i < kKeys; ++i) {
    ++per_endpoint[members.OwnerOf(PlacementKeyOfTokens("t", "m", {uint32_t(i), 1, 2})).endpoint];
  }
  const std::map<std::string, double> expected = {
      {"a:1", 0.5}, {"b:1", 0.25}, {"c:1", 0.125}, {"d:1", 0.125}};
  for (const auto& [e, share] : expected) {
    EXPECT_NEAR(per_endpoint[e] / double(kKeys), share, 0.025) << e;
  }
}

TEST(PlacementTest, AddingAFourthEndpointMovesAQuarterOfTheKeysOnlyToIt) {
  const Membership three = Equal(3), four = Equal(4);
  constexpr int kKeys = 4000;
  int moved = 0;
  for (int i = 0; i < kKeys; ++i) {
    const PlacementKey key = PlacementKeyOfSequence("t", "m", absl::StrCat("s", i));
    const std::string before = three.OwnerOf(key).endpoint, after = four.OwnerOf(key).endpoint;
    if (before != after) {
      ++moved;
      EXPECT_EQ(after, "127.0.0.5:7000");  // keys only move to the new endpoint
    }
  }
  EXPECT_NEAR(moved / double(kKeys), 0.25, 0.05);
}

TEST(PlacementTest, SameFirstBlockSameOwner) {
  const Membership members = Equal(4);
  const std::vector<uint32_t> block = {5, 6, 7, 8, 9, 10, 11, 12};
  EXPECT_EQ(members.OwnerOf(PlacementKeyOfTokens("t", "m", block)).endpoint,
            members.OwnerOf(PlacementKeyOfTokens("t", "m", block)).endpoint);
  EXPECT_FALSE(PlacementKeyOfTokens("t", "m", block) == PlacementKeyOfTokens("u", "m", block));
  EXPECT_FALSE(PlacementKeyOfTokens("t", "m", block) == PlacementKeyOfTokens("t", "n", block));
}

TEST(PlacementTest, MembershipRejectsBadMembers) {
  EXPECT_FALSE(Membership::Create({{"", 1}}).ok());
  EXPECT_FALSE(Membership::Create({{"a:1", 0}}).ok());
  EXPECT_FALSE(Membership::Create({{"a :1", 1}}).ok());
  EXPECT_FALSE(Membership::Create({{"a:1,b:2", 1}}).ok());
  EXPECT_FALSE(Membership::Create({{std::string(300, 'a'), 1}}).ok());
  EXPECT_FALSE(Membership::Create({{"a:1", 1}, {"a:1", 2}}).ok());
  absl::StatusOr<Membership> dup = Membership::Create({{"b:1", 1}, {"a:1", 1}, {"b:1", 1}});
  ASSERT_TRUE(dup.ok());
  EXPECT_EQ(dup->members().size(), 2u);
  EXPECT_EQ(dup->members()[0].endpoint, "a:1");
  EXPECT_TRUE(dup->Contains("b:1"));
  EXPECT_FALSE(dup->Contains("c:1"));
}

TEST(PlacementTest, KeyHexRoundTripsAndRejectsGarbage) {
  const PlacementKey key = PlacementKeyOfSequence("t", "m", "s");
  absl::StatusOr<PlacementKey> back = PlacementKey::FromHex(key.Hex());
  ASSERT_TRUE(back.ok());
  EXPECT_TRUE(*back == key);
  EXPECT_FALSE(PlacementKey::FromHex("abc").ok());
  EXPECT_FALSE(PlacementKey::FromHex(std::string(64, 'g')).ok());
}

TEST(MembershipTargetTest, ParsesStaticListsWithAndWithoutWeights) {
  absl::StatusOr<MembershipTarget> t = ParseMembershipTarget("127.0.0.2:7000, 127.0.0.3:7001=42");
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->entries.size(), 2u);
  absl::StatusOr<std::vector<Member>> members = ResolveMembershipTarget(*t, 9);
  ASSERT_TRUE(members.ok());
  EXPECT_EQ((*members)[0], (Member{"127.0.0.2:7000", 9}));
  EXPECT_EQ((*members)[1], (Member{"127.0.0.3:7001", 42}));
}

TEST(MembershipTargetTest, RejectsMalformedTargets) {
  for (const char* bad : {"",
                          ",",
                          "host",
                          "host:",
                          "host:0",
                          "host:70000",
                          "host:x",
                          "host:1=0",
                          "host:1=-3",
                          "host:1=x",
                          "ho st:1",
                          "dns:///name",
                          "dns:///:1",
                          "dns:/name:1",
                          "dns://name:1",
                          "dns://dns.example/x:1",
                          "dns://1.2.3/x:1",
                          "dns://1.2.3.4:/x:1",
                          "dns://1.2.3.4:0/x:1",
                          "dns://1.2.3.4:70000/x:1",
                          "dns://1.2.3.4:5x/x:1",
                          "dns://[::1/x:1",
                          "dns://[::1]x/x:1",
                          "dns://[1.2.3.4]/x:1",
                          "dns://::1/x:1",
                          "dns://1.2.3.4/x",
                          "dns://1.2.3.4/x/y:1"}) {
    EXPECT_FALSE(ParseMembershipTarget(bad).ok()) << bad;
  }
}

TEST(MembershipTargetTest, ParsesADnsAuthority) {
  absl::StatusOr<MembershipTarget> system = ParseMembershipTarget("dns:///kvpool.ns.svc:50051");
  ASSERT_TRUE(system.ok()) << system.status();
  EXPECT_EQ(system->dns_server, "");
  EXPECT_EQ(system->dns_host, "kvpool.ns.svc");
  EXPECT_EQ(system->dns_port, 50051);

  absl::StatusOr<MembershipTarget> v4 = ParseMembershipTarget("dns://10.96.0.10/kvpool.ns.svc:7");
  ASSERT_TRUE(v4.ok()) << v4.status();
  EXPECT_TRUE(v4->is_dns());
  EXPECT_EQ(v4->dns_server, "10.96.0.10");
  EXPECT_EQ(v4->dns_server_port, 53);
  EXPECT_EQ(v4->dns_host, "kvpool.ns.svc");
  EXPECT_EQ(v4->dns_port, 7);

  absl::StatusOr<MembershipTarget> port =
      ParseMembershipTarget("dns://127.0.0.1:5353/kvpool-headless.test:50051");
  ASSERT_TRUE(port.ok()) << port.status();
  EXPECT_EQ(port->dns_server, "127.0.0.1");
  EXPECT_EQ(port->dns_server_port, 5353);
  EXPECT_EQ(port->dns_host, "kvpool-headless.test");
  EXPECT_EQ(port->dns_port, 50051);

  absl::StatusOr<MembershipTarget> v6 = ParseMembershipTarget("dns://[fd00::a]:1053/n:9");
  ASSERT_TRUE(v6.ok()) << v6.status();
  EXPECT_EQ(v6->dns_server, "fd00::a");
  EXPECT_EQ(v6->dns_server_port, 1053);
  absl::StatusOr<MembershipTarget> v6_default = ParseMembershipTarget("dns://[::1]/n:9");
  ASSERT_TRUE(v6_default.ok()) << v6_default.status();
  EXPECT_EQ(v6_default->dns_server, "::1");
  EXPECT_EQ(v6_default->dns_server_port, 53);
}

TEST(MembershipTargetTest, ResolvesADnsNameThroughTheSystemResolver) {
  absl::StatusOr<MembershipTarget> t = ParseMembershipTarget("dns:///localhost:7000");
  ASSERT_TRUE(t.ok()) << t.status();
  absl::StatusOr<std::vector<Member>> members = ResolveMembershipTarget(*t, 1);
  ASSERT_TRUE(members.ok()) << members.status();
  ASSERT_FALSE(members->empty());
  for (const Member& m : *members) {
    EXPECT_TRUE(absl::StartsWith(m.endpoint, "127.")) << m.endpoint;  // a loopback address
    EXPECT_TRUE(absl::EndsWith(m.endpoint, ":7000")) << m.endpoint;
  }
  absl::StatusOr<MembershipTarget> none = ParseMembershipTarget("dns:///no-such-host.invalid:7000");
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(ResolveMembershipTarget(*none, 1).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace kvpool
