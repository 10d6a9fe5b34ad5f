#include "server/connection_listener.h"

#include "gtest/gtest.h"

namespace kvpool::server {
namespace {

TEST(ConnectionCapTest, LeavesRoomForTheDaemonsOwnDescriptors) {
  EXPECT_EQ(*ConnectionCap(256, 0), 192);          // a quarter kept
  EXPECT_EQ(*ConnectionCap(1024, 0), 1024 - 256);  // at most 256 kept
  EXPECT_EQ(*ConnectionCap(100, 0), 100 - 32);     // at least 32 kept
  EXPECT_EQ(*ConnectionCap(1 << 20, 0), (1 << 20) - 256);
  EXPECT_EQ(*ConnectionCap(256, 100), 100);
  EXPECT_EQ(*ConnectionCap(256, 192), 192);
  EXPECT_TRUE(absl::IsInvalidArgument(ConnectionCap(256, 193).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ConnectionCap(32, 0).status()));
}

TEST(ConnectionListenerTest, BindsAFreePortAndRejectsBadAddresses) {
  absl::StatusOr<std::unique_ptr<ConnectionListener>> l = ConnectionListener::Bind("127.0.0.1:0");
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_GT((*l)->port(), 0);
  absl::StatusOr<std::unique_ptr<ConnectionListener>> v6 = ConnectionListener::Bind("[::1]:0");
  if (v6.ok()) {  // where the host has IPv6 loopback
    EXPECT_GT((*v6)->port(), 0);
  }
  EXPECT_TRUE(absl::IsInvalidArgument(ConnectionListener::Bind("no-port").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ConnectionListener::Bind("[::1:0").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ConnectionListener::Bind("127.0.0.1:notaport").status()));
  // The same port twice: the second bind fails.
  const std::string taken = "127.0.0.1:" + std::to_string((*l)->port());
  EXPECT_TRUE(absl::IsUnavailable(ConnectionListener::Bind(taken).status()));
}

}  // namespace
}  // namespace kvpool::server
