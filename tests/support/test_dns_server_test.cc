// The test DNS server, and through it the resolution of a membership target with a DNS server
// (common/dns_query.h, common/membership_target.h): the real c-ares client over real UDP.
#include "tests/support/test_dns_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dns_query.h"
#include "common/membership_target.h"
#include "gtest/gtest.h"

namespace kvpool::testing {
namespace {

constexpr absl::Duration kTimeout = absl::Seconds(10);  // generous: a loaded machine

TEST(TestDnsServerTest, AnswersTheNameWithItsAddressesAndNothingElse) {
  TestDnsServer dns("kvpool-headless.test", {"127.0.0.3", "127.0.0.2"});
  ASSERT_TRUE(dns.ok());
  absl::StatusOr<std::vector<std::string>> ips =
      QueryDnsAddresses("127.0.0.1", dns.port(), "kvpool-headless.test", kTimeout);
  ASSERT_TRUE(ips.ok()) << ips.status();
  EXPECT_EQ(*ips, (std::vector<std::string>{"127.0.0.2", "127.0.0.3"}));
  // Names are compared without regard to case, as DNS does.
  ips = QueryDnsAddresses("127.0.0.1", dns.port(), "KVPOOL-Headless.test", kTimeout);
  ASSERT_TRUE(ips.ok()) << ips.status();
  EXPECT_EQ(ips->size(), 2u);

  EXPECT_EQ(QueryDnsAddresses("127.0.0.1", dns.port(), "other.test", kTimeout).status().code(),
            absl::StatusCode::kNotFound);
  ASSERT_TRUE(dns.SetAddresses({}));
  EXPECT_EQ(
      QueryDnsAddresses("127.0.0.1", dns.port(), "kvpool-headless.test", kTimeout).status().code(),
      absl::StatusCode::kNotFound);
  ASSERT_TRUE(dns.SetAddresses({"127.0.0.5"}));
  ips = QueryDnsAddresses("127.0.0.1", dns.port(), "kvpool-headless.test", kTimeout);
  ASSERT_TRUE(ips.ok()) << ips.status();
  EXPECT_EQ(*ips, (std::vector<std::string>{"127.0.0.5"}));
  EXPECT_FALSE(dns.SetAddresses({"not-an-ip"}));
  EXPECT_GE(dns.answered(), 8u);  // A and AAAA for each of the four lookups
}

TEST(TestDnsServerTest, AMembershipTargetWithTheServerResolvesToItsAddresses) {
  TestDnsServer dns("kvpool-headless.test", {"127.0.0.4", "127.0.0.2", "127.0.0.3"});
  ASSERT_TRUE(dns.ok());
  absl::StatusOr<MembershipTarget> target = ParseMembershipTarget(
      absl::StrCat("dns://127.0.0.1:", dns.port(), "/kvpool-headless.test:7000"));
  ASSERT_TRUE(target.ok()) << target.status();
  absl::StatusOr<std::vector<Member>> members = ResolveMembershipTarget(*target, 5);
  ASSERT_TRUE(members.ok()) << members.status();
  EXPECT_EQ(*members, (std::vector<Member>{
                          {"127.0.0.2:7000", 5}, {"127.0.0.3:7000", 5}, {"127.0.0.4:7000", 5}}));

  absl::StatusOr<MembershipTarget> unknown = ParseMembershipTarget(
      absl::StrCat("dns://127.0.0.1:", dns.port(), "/no-such-name.test:7000"));
  ASSERT_TRUE(unknown.ok());
  EXPECT_EQ(ResolveMembershipTarget(*unknown, 1).status().code(), absl::StatusCode::kNotFound);
}

TEST(TestDnsServerTest, AServerThatDoesNotAnswerIsUnavailable) {
  // A bound UDP socket nobody reads: the queries go unanswered.
  const int fd = socket(AF_INET, SOCK_DGRAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  absl::StatusOr<std::vector<std::string>> ips =
      QueryDnsAddresses("127.0.0.1", ntohs(addr.sin_port), "x.test", absl::Seconds(1));
  EXPECT_EQ(ips.status().code(), absl::StatusCode::kUnavailable) << ips.status();
  close(fd);
  EXPECT_EQ(QueryDnsAddresses("dns.example", 53, "x.test", kTimeout).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TestDnsServerTest, HostileDatagramsAreDroppedAndTheServerKeepsAnswering) {
  TestDnsServer dns("kvpool-headless.test", {"127.0.0.2"});
  ASSERT_TRUE(dns.ok());
  const int fd = socket(AF_INET, SOCK_DGRAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  to.sin_port = htons(dns.port());
  auto send = [&](const std::string& bytes) {
    ASSERT_EQ(
        sendto(fd, bytes.data(), bytes.size(), 0, reinterpret_cast<sockaddr*>(&to), sizeof(to)),
        static_cast<ssize_t>(bytes.size()));
  };
  const std::string header("\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00", 12);
  send("");
  send(std::string("\x12\x34\x01", 3));  // a short header
  send(header);                          // no question
  send(header + std::string("\x3f"
                            "abc",
                            4));                              // a label past the end
  send(header + std::string("\xc0\x0c\x00\x01\x00\x01", 6));  // a compression pointer
  send(header + std::string("\x03"
                            "abc",
                            4));  // no terminating label
  send(header + std::string("\x03"
                            "abc\x00\x00",
                            6));  // a short type and class
  std::string long_name = header;
  for (int i = 0; i < 10; ++i) long_name += std::string(1, '\x3f') + std::string(63, 'a');
  send(long_name + std::string("\x00\x00\x01\x00\x01", 5));  // a name over 255 bytes
  std::string response = header;
  response[2] = '\x81';  // a response, not a query
  send(response + std::string("\x01"
                              "a\x00\x00\x01\x00\x01",
                              7));
  std::mt19937 random(7);
  for (int i = 0; i < 200; ++i) {  // well within the socket's receive buffer
    std::string junk(random() % 300, '\0');
    for (char& c : junk) c = static_cast<char>(random());
    send(junk);
  }
  close(fd);
  absl::StatusOr<std::vector<std::string>> ips =
      QueryDnsAddresses("127.0.0.1", dns.port(), "kvpool-headless.test", kTimeout);
  ASSERT_TRUE(ips.ok()) << ips.status();
  EXPECT_EQ(*ips, (std::vector<std::string>{"127.0.0.2"}));
}

}  // namespace
}  // namespace kvpool::testing
