#include "server/worker_pool.h"

#include <atomic>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "server/logging/request_context.h"

namespace kvpool::server {
namespace {

// Keeps the pool's one worker busy (with tenant "x"'s task) until `release` is notified, so
// that what is submitted meanwhile queues.
void HoldTheWorker(WorkerPool& pool, absl::Notification& release) {
  absl::Notification started;
  ASSERT_TRUE(pool.TrySubmit("x", 1, [&] {
    started.Notify();
    release.WaitForNotification();
  }));
  started.WaitForNotification();
}

TEST(WorkerPoolTest, RunsEverythingSubmitted) {
  std::atomic<int> count{0};
  {
    WorkerPool pool(3, 1000);
    for (int i = 0; i < 500; ++i) ASSERT_TRUE(pool.TrySubmit([&] { ++count; }));
    pool.Shutdown();
  }
  EXPECT_EQ(count.load(), 500);
}

TEST(WorkerPoolTest, TasksRunUnderTheRequestIdOfTheirSubmitter) {
  WorkerPool pool(2, 16);
  std::string in_call, continuation, outside = "unset";
  absl::Notification done;
  {
    ScopedRequestId scope("req-9");
    ASSERT_TRUE(pool.TrySubmit([&] {
      in_call = std::string(CurrentRequestId());
      // A continuation submitted from the worker keeps the id too.
      pool.Submit([&] {
        continuation = std::string(CurrentRequestId());
        done.Notify();
      });
    }));
  }
  done.WaitForNotification();
  absl::Notification plain;
  ASSERT_TRUE(pool.TrySubmit([&] {
    outside = std::string(CurrentRequestId());
    plain.Notify();
  }));
  plain.WaitForNotification();
  pool.Shutdown();
  EXPECT_EQ(in_call, "req-9");
  EXPECT_EQ(continuation, "req-9");
  EXPECT_EQ(outside, "");  // the worker thread does not keep a finished task's id
}

TEST(WorkerPoolTest, FullQueueRefusesWork) {
  WorkerPool pool(1, 2);
  absl::Notification release;
  HoldTheWorker(pool, release);  // the worker is busy; the queue is empty
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

// With one worker held busy, the queue's order and bound across tenants are deterministic.
TEST(WorkerPoolTest, FullQueueStillAdmitsATenantBelowItsShareAndRunsItFirst) {
  WorkerPool pool(1, 4);
  absl::Notification release;
  HoldTheWorker(pool, release);
  absl::Mutex mu;
  std::vector<std::string> order;
  auto record = [&](std::string name) {
    return [&, name] {
      absl::MutexLock lock(&mu);
      order.push_back(name);
    };
  };
  for (int i = 0; i < 4; ++i)
    ASSERT_TRUE(pool.TrySubmit("big", 10, record("big" + std::to_string(i))));
  EXPECT_FALSE(pool.TrySubmit("big", 10, record("big4")));  // full, and all of it is big's
  // Two tenants with work: each may hold half of the bound.
  EXPECT_TRUE(pool.TrySubmit("small", 1, record("small0")));
  EXPECT_TRUE(pool.TrySubmit("small", 1, record("small1")));
  EXPECT_FALSE(pool.TrySubmit("small", 1, record("small2")));
  EXPECT_EQ(pool.TenantStats("big").queued, 4u);
  EXPECT_EQ(pool.TenantStats("small").queued_units, 2u);
  release.Notify();
  pool.Shutdown();
  EXPECT_EQ(order, (std::vector<std::string>{"small0", "small1", "big0", "big1", "big2", "big3"}));
  EXPECT_EQ(pool.TenantStats("big").served_units, 40u);
  EXPECT_EQ(pool.rejected(), 2u);
}

TEST(WorkerPoolTest, FifoModeRunsInArrivalOrder) {
  WorkerPool pool(1, 16);
  pool.SetFairness(false);
  absl::Notification release;
  HoldTheWorker(pool, release);
  absl::Mutex mu;
  std::vector<std::string> order;
  for (const char* name : {"big0", "big1", "small0"}) {
    const std::string tenant = std::string(name).substr(0, std::string(name).size() - 1);
    ASSERT_TRUE(pool.TrySubmit(tenant, tenant == "big" ? 10 : 1, [&, n = std::string(name)] {
      absl::MutexLock lock(&mu);
      order.push_back(n);
    }));
  }
  release.Notify();
  pool.Shutdown();
  EXPECT_EQ(order, (std::vector<std::string>{"big0", "big1", "small0"}));
}

}  // namespace
}  // namespace kvpool::server
