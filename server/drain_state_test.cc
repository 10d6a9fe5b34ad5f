// DrainState: serving until Begin, one drain only, refusals with reason DRAINING, AwaitIdle
// waking when the last counted call ends, and which methods a drain waits for.
#include "server/drain_state.h"

#include <thread>

#include "gtest/gtest.h"
#include "proto/status.h"

namespace kvpool::server {
namespace {

TEST(DrainStateTest, ServesUntilBeganThenRefusesWithReasonDraining) {
  DrainState d;
  EXPECT_FALSE(d.draining());
  EXPECT_TRUE(d.RefuseIfDraining("CreateSequence").ok());
  v1::ServingState s;
  FillServingState(d, &s);
  EXPECT_EQ(s.state(), v1::ServingState::SERVING);
  EXPECT_EQ(s.drain_started_unix_ms(), 0);

  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  EXPECT_TRUE(d.Begin(deadline));
  EXPECT_FALSE(d.Begin(deadline + absl::Hours(1)));  // one drain: the first deadline holds
  EXPECT_EQ(d.deadline(), deadline);
  const absl::Status refused = d.RefuseIfDraining("CreateSequence");
  EXPECT_TRUE(absl::IsUnavailable(refused)) << refused;
  EXPECT_EQ(ReasonOf(refused), ErrorReason::kDraining);
  EXPECT_NE(refused.message().find("CreateSequence"), absl::string_view::npos);
  FillServingState(d, &s);
  EXPECT_EQ(s.state(), v1::ServingState::DRAINING);
  EXPECT_GT(s.drain_started_unix_ms(), 0);
  EXPECT_EQ(s.drain_deadline_unix_ms(), absl::ToUnixMillis(deadline));
}

TEST(DrainStateTest, AwaitIdleWakesWhenTheLastCallEndsAndGivesUpAtTheDeadline) {
  DrainState d;
  d.CallStarted();
  d.CallStarted();
  EXPECT_EQ(d.in_flight(), 2);
  EXPECT_FALSE(d.AwaitIdle(absl::Now()));  // calls in flight: not idle by a passed deadline
  std::thread ender([&] {
    d.CallEnded();
    d.CallEnded();
  });
  EXPECT_TRUE(d.AwaitIdle(absl::InfiniteFuture()));
  ender.join();
  EXPECT_EQ(d.in_flight(), 0);
}

TEST(DrainStateTest, WaitsForWorkNotForHealthAdminOrSubscriptions) {
  EXPECT_TRUE(DrainWaitsFor("/kvpool.v1.SequenceService/AppendKv"));
  EXPECT_TRUE(DrainWaitsFor("/kvpool.v1.AttentionService/Attend"));
  EXPECT_TRUE(DrainWaitsFor("/kvpool.v1.TransportService/PushKv"));
  EXPECT_FALSE(DrainWaitsFor("/grpc.health.v1.Health/Watch"));
  EXPECT_FALSE(DrainWaitsFor("/kvpool.v1.AdminService/Drain"));
  EXPECT_FALSE(DrainWaitsFor("/kvpool.v1.KvEventService/SubscribeKvEvents"));
  EXPECT_FALSE(DrainWaitsFor("/kvpool.v1.TransportService/WatchSession"));
}

}  // namespace
}  // namespace kvpool::server
