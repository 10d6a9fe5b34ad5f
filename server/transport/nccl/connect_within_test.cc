#include "server/transport/nccl/connect_within.h"

#include <atomic>
#include <memory>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace kvpool::server {
namespace {

TEST(ConnectWithinTest, ReturnsTheStepsOwnStatus) {
  bool abandoned = true;
  std::atomic<int> abandons{0};
  EXPECT_TRUE(ConnectWithin([] { return absl::OkStatus(); }, [&] { ++abandons; }, absl::Seconds(10),
                            [] { return false; }, &abandoned)
                  .ok());
  EXPECT_FALSE(abandoned);
  // A failing step's error comes back as it is, even a deadline of its own.
  const absl::Status s =
      ConnectWithin([] { return absl::DeadlineExceededError("step's own"); }, [&] { ++abandons; },
                    absl::Seconds(10), [] { return false; }, &abandoned);
  EXPECT_EQ(s.message(), "step's own");
  EXPECT_FALSE(abandoned);
  EXPECT_EQ(abandons.load(), 0);
}

// A step that blocks past the time limit: the wait ends with DeadlineExceeded while it still
// runs, and `abandon` runs on its thread only once it returned.
TEST(ConnectWithinTest, GivesUpOnABlockedStepAndLetsItCleanUp) {
  auto release = std::make_shared<absl::Notification>();
  auto cleaned = std::make_shared<absl::Notification>();
  auto step_returned = std::make_shared<std::atomic<bool>>(false);
  bool abandoned = false;
  const absl::Time start = absl::Now();
  const absl::Status s = ConnectWithin(
      [release, step_returned] {
        release->WaitForNotification();
        step_returned->store(true);
        return absl::OkStatus();
      },
      [cleaned, step_returned] {
        EXPECT_TRUE(step_returned->load());
        cleaned->Notify();
      },
      absl::Milliseconds(100), [] { return false; }, &abandoned);
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_TRUE(abandoned);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(100));
  EXPECT_FALSE(cleaned->HasBeenNotified());
  release->Notify();
  EXPECT_TRUE(cleaned->WaitForNotificationWithTimeout(absl::Seconds(10)));
}

TEST(ConnectWithinTest, CancellationEndsTheWait) {
  auto release = std::make_shared<absl::Notification>();
  auto cleaned = std::make_shared<absl::Notification>();
  std::atomic<bool> cancel{false};
  bool abandoned = false;
  const absl::Status s = ConnectWithin(
      [release, &cancel] {
        cancel.store(true);  // the caller cancels while the step blocks
        release->WaitForNotification();
        return absl::OkStatus();
      },
      [cleaned] { cleaned->Notify(); }, absl::Seconds(30), [&] { return cancel.load(); },
      &abandoned);
  EXPECT_TRUE(absl::IsCancelled(s)) << s;
  EXPECT_TRUE(abandoned);
  release->Notify();
  EXPECT_TRUE(cleaned->WaitForNotificationWithTimeout(absl::Seconds(10)));
}

}  // namespace
}  // namespace kvpool::server
