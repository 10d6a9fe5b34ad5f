#include "server/transport/nccl/join_admission.h"

#include "gtest/gtest.h"

namespace kvpool::server {
namespace {

TEST(JoinAdmissionTest, TimeoutDefaultsAndHasACeiling) {
  EXPECT_EQ(*JoinTimeout(0), absl::Milliseconds(kDefaultJoinTimeoutMs));
  EXPECT_EQ(*JoinTimeout(1), absl::Milliseconds(1));
  EXPECT_EQ(*JoinTimeout(kMaxJoinTimeoutMs), absl::Milliseconds(kMaxJoinTimeoutMs));
  EXPECT_TRUE(absl::IsInvalidArgument(JoinTimeout(kMaxJoinTimeoutMs + 1).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(JoinTimeout(0xffffffffu).status()));
}

TEST(JoinAdmissionTest, AtMostMaxPendingJoinsWaitAtOnce) {
  PendingJoins joins;
  for (int i = 0; i < kMaxPendingJoins; ++i) EXPECT_TRUE(joins.TryAcquire()) << i;
  EXPECT_FALSE(joins.TryAcquire());
  joins.Release();
  EXPECT_TRUE(joins.TryAcquire());
  EXPECT_FALSE(joins.TryAcquire());
}

}  // namespace
}  // namespace kvpool::server
