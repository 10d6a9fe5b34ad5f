// Request ids through the C++ client against a real kvpoold: the id a caller sets
// (ClientOptions::request_id or WithRequestId) comes back on a failed call (RequestIdOf), a
// bad one is replaced by one the daemon makes, and without one the daemon makes one per call.
// The same id in the daemon's log lines is checked by tests/observability/test_logs.py.
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "proto/status.h"
#include "tests/integration/integration_util.h"

namespace kvpool::integration {
namespace {

// What the daemon makes: 32 lowercase hex digits.
bool IsGeneratedId(const std::string& id) {
  return id.size() == 32 && id.find_first_not_of("0123456789abcdef") == std::string::npos;
}

std::unique_ptr<KvpoolClient> Connect(const std::string& target,
                                      const client::ClientOptions& options) {
  absl::StatusOr<std::unique_ptr<KvpoolClient>> c = KvpoolClient::Connect(target, options);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

class RequestIdTest : public DaemonTest {};

// The id the daemon answered for a call that must fail with NOT_FOUND.
std::string IdOfFailedCall(const KvpoolClient& c) {
  const absl::StatusOr<v1::SequenceInfo> info = c.DescribeSequence("no-such-sequence");
  EXPECT_EQ(info.status().code(), absl::StatusCode::kNotFound) << info.status();
  return client::RequestIdOf(info.status()).value_or("<none>");
}

TEST_F(RequestIdTest, TheCallersIdComesBackOnAnError) {
  client::ClientOptions options;
  options.request_id = "cpp-req-1";
  std::unique_ptr<KvpoolClient> c = Connect(daemon().target(), options);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(IdOfFailedCall(*c), "cpp-req-1");
  EXPECT_EQ(IdOfFailedCall(*c->WithRequestId("cpp-req-2")), "cpp-req-2");
  // The same channel and id on a successful call.
  EXPECT_TRUE(c->WithRequestId("cpp-req-3")->GetStats().ok());
}

TEST_F(RequestIdTest, WithoutAnIdTheDaemonMakesOnePerCall) {
  const std::string first = IdOfFailedCall(client());
  const std::string second = IdOfFailedCall(client());
  EXPECT_TRUE(IsGeneratedId(first)) << first;
  EXPECT_NE(first, second);
}

TEST_F(RequestIdTest, ABadIdIsReplaced) {
  for (const std::string& bad : {std::string("has spaces"), std::string(200, 'x')}) {
    const std::string answered = IdOfFailedCall(*client().WithRequestId(bad));
    EXPECT_NE(answered, bad);
    EXPECT_TRUE(IsGeneratedId(answered)) << answered;
  }
}

TEST_F(RequestIdTest, AnUnreachableDaemonAnswersNoId) {
  client::ClientOptions options;
  options.request_id = "cpp-req-unreachable";
  options.deadline = absl::Seconds(5);
  // Port 1: privileged, so no daemon of these tests listens there.
  std::unique_ptr<KvpoolClient> c = Connect("127.0.0.1:1", options);
  ASSERT_NE(c, nullptr);
  const absl::StatusOr<v1::GetStatsResponse> stats = c->GetStats();
  EXPECT_EQ(stats.status().code(), absl::StatusCode::kUnavailable) << stats.status();
  EXPECT_FALSE(client::RequestIdOf(stats.status()).has_value());
}

}  // namespace
}  // namespace kvpool::integration
