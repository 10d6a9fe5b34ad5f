#include "server/worker_pool.h"

#include <atomic>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace kvpool::server {
namespace {

TEST(WorkerPoolTest, RunsEverythingSubmitted) {
  std::atomic<int> count{0};
  {
    WorkerPool pool(3, 1000);
    for (int i = 0; i < 500; ++i) ASSERT_TRUE(pool.TrySubmit([&] { ++count; }));
    pool.Shutdown();
  }
  EXPECT_EQ(count.load(), 500);
}

TEST(WorkerPoolTest, FullQueueRefusesWork) {
  WorkerPool pool(1, 2);
  absl::Notification release, started;
  ASSERT_TRUE(pool.TrySubmit([&] {
    started.Notify();
    release.WaitForNotification();
  }));
  started.WaitForNotification();  // the worker is busy; the queue is empty
  EXPECT_TRUE(pool.TrySubmit([] {}));
  EXPECT_TRUE(pool.TrySubmit([] {}));
  EXPECT_FALSE(pool.TrySubmit([] {}));  // bound reached: backpressure
  EXPECT_EQ(pool.rejected(), 1u);
  EXPECT_EQ(pool.queue_depth(), 2u);
  // Continuations of admitted work are never refused.
  std::atomic<bool> ran{false};
  pool.Submit([&] { ran = true; });
  release.Notify();
  pool.Shutdown();
  EXPECT_TRUE(ran.load());
}

TEST(WorkerPoolTest, SubmitAfterShutdownRunsInline) {
  WorkerPool pool(2, 4);
  pool.Shutdown();
  EXPECT_FALSE(pool.TrySubmit([] {}));
  bool ran = false;
  pool.Submit([&] { ran = true; });
  EXPECT_TRUE(ran);
}

}  // namespace
}  // namespace kvpool::server
