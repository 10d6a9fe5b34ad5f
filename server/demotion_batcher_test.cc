// DemotionBatcher: requests that wait while a call runs share the next backend call; a merged
// call that fails is redone request by request so each caller gets its own error.
#include "server/demotion_batcher.h"

#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "server/server_test_util.h"

namespace kvpool::server {
namespace {

using testing::BypassQuant;
using testing::TestCore;

// Records DemoteRows calls (their moves are never carried out); the first call blocks until
// `release`; a call with a move of count kBad fails.
class RecordingBackend final : public testing::ForwardingBackend {
 public:
  static constexpr int kBad = 99;
  using ForwardingBackend::ForwardingBackend;
  absl::Notification entered_first, release;
  absl::Mutex mu;
  std::vector<std::pair<const Model*, size_t>> calls ABSL_GUARDED_BY(mu);  // model, moves

  absl::Status DemoteRows(const Model& m, absl::Span<const RowMove> moves) override {
    bool first = false;
    {
      absl::MutexLock lock(&mu);
      first = calls.empty();
      calls.emplace_back(&m, moves.size());
    }
    if (first) {
      entered_first.Notify();
      release.WaitForNotification();
    }
    for (const RowMove& mv : moves) {
      if (mv.count == kBad) return absl::OutOfRangeError("a scale overflows");
    }
    return absl::OkStatus();
  }
};

std::vector<RowMove> Moves(int n, int count = 1) {
  return std::vector<RowMove>(n, RowMove{nullptr, 0, nullptr, 0, count});
}

void WaitForQueued(DemotionBatcher& b, size_t n) {
  while (b.waiting_for_testing() < n) absl::SleepFor(absl::Milliseconds(1));
}

class DemotionBatcherTest : public ::testing::Test {
 protected:
  DemotionBatcherTest() {
    a_ = core_.AddModel("a", RotationKind::kIdentity, BypassQuant());
    b_ = core_.AddModel("b", RotationKind::kIdentity, BypassQuant());
  }
  TestCore core_;
  std::shared_ptr<const Model> a_, b_;
};

TEST_F(DemotionBatcherTest, RequestsWaitingDuringACallShareTheNextOne) {
  RecordingBackend backend(core_.backend.get());
  DemotionBatcher batcher(&backend);
  std::thread leader([&] { EXPECT_TRUE(batcher.Demote(*a_, Moves(2)).ok()); });
  backend.entered_first.WaitForNotification();
  std::vector<std::thread> followers;
  for (int i = 1; i <= 3; ++i) {
    followers.emplace_back([&, i] { EXPECT_TRUE(batcher.Demote(*a_, Moves(i)).ok()); });
  }
  WaitForQueued(batcher, 3);
  backend.release.Notify();
  leader.join();
  for (auto& t : followers) t.join();
  absl::MutexLock lock(&backend.mu);
  ASSERT_EQ(backend.calls.size(), 2u);
  EXPECT_EQ(backend.calls[0].second, 2u);
  EXPECT_EQ(backend.calls[1].second, 1u + 2u + 3u);  // the three waiting requests, one call
}

TEST_F(DemotionBatcherTest, ModelsGetTheirOwnCallsAndEmptyRequestsNone) {
  RecordingBackend backend(core_.backend.get());
  DemotionBatcher batcher(&backend);
  EXPECT_TRUE(batcher.Demote(*a_, {}).ok());
  {
    absl::MutexLock lock(&backend.mu);
    EXPECT_TRUE(backend.calls.empty());
  }
  std::thread leader([&] { EXPECT_TRUE(batcher.Demote(*a_, Moves(1)).ok()); });
  backend.entered_first.WaitForNotification();
  std::thread on_a([&] { EXPECT_TRUE(batcher.Demote(*a_, Moves(2)).ok()); });
  std::thread on_b([&] { EXPECT_TRUE(batcher.Demote(*b_, Moves(4)).ok()); });
  WaitForQueued(batcher, 2);
  backend.release.Notify();
  leader.join();
  on_a.join();
  on_b.join();
  absl::MutexLock lock(&backend.mu);
  ASSERT_EQ(backend.calls.size(), 3u);
  size_t on_model_a = 0, on_model_b = 0;
  for (size_t i = 1; i < 3; ++i) {
    if (backend.calls[i].first == a_.get()) on_model_a = backend.calls[i].second;
    if (backend.calls[i].first == b_.get()) on_model_b = backend.calls[i].second;
  }
  EXPECT_EQ(on_model_a, 2u);
  EXPECT_EQ(on_model_b, 4u);
}

TEST_F(DemotionBatcherTest, AFailedMergedCallBlamesOnlyTheRequestThatFails) {
  RecordingBackend backend(core_.backend.get());
  DemotionBatcher batcher(&backend);
  std::thread leader([&] { EXPECT_TRUE(batcher.Demote(*a_, Moves(1)).ok()); });
  backend.entered_first.WaitForNotification();
  absl::Status good, bad;
  std::thread t1([&] { good = batcher.Demote(*a_, Moves(3)); });
  std::thread t2([&] { bad = batcher.Demote(*a_, Moves(2, RecordingBackend::kBad)); });
  WaitForQueued(batcher, 2);
  backend.release.Notify();
  leader.join();
  t1.join();
  t2.join();
  EXPECT_TRUE(good.ok()) << good;
  EXPECT_EQ(bad.code(), absl::StatusCode::kOutOfRange);
  absl::MutexLock lock(&backend.mu);
  // The first call, the merged one (failed), then each request alone.
  ASSERT_EQ(backend.calls.size(), 4u);
  EXPECT_EQ(backend.calls[1].second, 5u);
}

}  // namespace
}  // namespace kvpool::server
