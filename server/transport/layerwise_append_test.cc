// LayerwiseAppend: chunks queued out of order are staged in order, layers concurrently; any
// failure or an abort rolls the whole append back.
#include "server/transport/layerwise_append.h"

#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "server/server_test_util.h"

namespace kvpool::server {
namespace {

using testing::BypassQuant;
using testing::TestCore;
using testing::TestRows;

class LayerwiseAppendTest : public ::testing::Test {
 protected:
  LayerwiseAppendTest() : workers_(2, 64) {
    ctx_.config = &config_;
    ctx_.store = core_.store.get();
    ctx_.workers = &workers_;
    model_ = core_.AddModel("m", RotationKind::kIdentity, BypassQuant(), /*num_layers=*/3);
    EXPECT_TRUE(core_.store->Create(kDefaultTenant, model_, "s", {}).ok());
  }

  // Stages every chunk and waits for all of them; returns the statuses.
  std::vector<absl::Status> StageAll(LayerwiseAppend& a,
                                     const std::vector<std::pair<int, int>>& chunks, int count,
                                     const std::vector<Bf16>& rows) {
    std::vector<absl::Status> out(chunks.size());
    std::vector<absl::Notification> done(chunks.size());
    for (size_t i = 0; i < chunks.size(); ++i) {
      const auto [layer, offset] = chunks[i];
      const Bf16* p = rows.data() + static_cast<size_t>(offset) * model_->row_values();
      a.Stage(layer, offset, count, p, p, [&out, &done, i](absl::Status s, bool) {
        out[i] = s;
        done[i].Notify();
      });
    }
    for (auto& d : done) d.WaitForNotification();
    return out;
  }

  ServerConfig config_;
  TestCore core_;
  WorkerPool workers_;
  ServiceContext ctx_;
  std::shared_ptr<const Model> model_;
};

TEST_F(LayerwiseAppendTest, StagesOutOfOrderChunksInOrderAndCommits) {
  const std::vector<Bf16> rows = TestRows(40, model_->row_values(), 1);
  AppendSpec spec{0, 40, AppendKind::kFinalPrefill, {}};
  auto a = LayerwiseAppend::Begin(&ctx_, kDefaultTenant, "s", spec);
  ASSERT_TRUE(a.ok()) << a.status();
  std::vector<std::pair<int, int>> chunks;
  for (int layer = 2; layer >= 0; --layer) {
    for (int off : {30, 10, 20, 0}) chunks.emplace_back(layer, off);
  }
  for (const absl::Status& s : StageAll(**a, chunks, 10, rows)) EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE((*a)->Complete());
  auto r = (*a)->Commit();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->info.total(), 40);
  workers_.Shutdown();
}

TEST_F(LayerwiseAppendTest, OverlappingChunkFailsAndRollsBack) {
  const size_t before = core_.pool->used_bytes();
  const std::vector<Bf16> rows = TestRows(40, model_->row_values(), 1);
  {
    auto a = LayerwiseAppend::Begin(&ctx_, kDefaultTenant, "s", {0, 40, AppendKind::kPrefill, {}});
    ASSERT_TRUE(a.ok());
    auto st = StageAll(**a, {{0, 0}, {0, 0}}, 10, rows);
    EXPECT_FALSE((*a)->status().ok());
    EXPECT_FALSE((*a)->Commit().ok());
  }
  {
    auto a = LayerwiseAppend::Begin(&ctx_, kDefaultTenant, "s", {0, 40, AppendKind::kPrefill, {}});
    ASSERT_TRUE(a.ok()) << a.status();  // the failed one released the sequence
    (*a)->Abort(absl::CancelledError("test"));
    EXPECT_EQ((*a)->status().code(), absl::StatusCode::kCancelled);
  }
  workers_.Shutdown();
  EXPECT_EQ(core_.pool->used_bytes(), before);
  auto info = core_.store->Describe(kDefaultTenant, "s");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->total(), 0);
}

// A failed push frees the sequence before anyone hears of the failure: the failing chunk's
// callback and the Abort callback both find the sequence free, and the Abort callback waits for
// the chunk that is still running.
TEST_F(LayerwiseAppendTest, RollsBackBeforeReportingAFailure) {
  const std::vector<Bf16> rows = TestRows(10, model_->row_values(), 1);
  auto a = LayerwiseAppend::Begin(&ctx_, kDefaultTenant, "s", {0, 10, AppendKind::kPrefill, {}});
  ASSERT_TRUE(a.ok()) << a.status();
  absl::Notification running, release, chunk_done, rolled_back;
  absl::Status chunk_status, begin_in_chunk, begin_in_abort;
  (*a)->StageDevice(
      0, 0, 10, rows.data(), rows.data(),
      [&]() -> absl::Status {
        running.Notify();
        release.WaitForNotification();
        return absl::DataLossError("the transfer broke");
      },
      [&](absl::Status s, bool) {
        chunk_status = s;
        begin_in_chunk =
            LayerwiseAppend::Begin(&ctx_, kDefaultTenant, "s", {0, 10, AppendKind::kPrefill, {}})
                .status();
        chunk_done.Notify();
      });
  running.WaitForNotification();
  (*a)->Abort(absl::CancelledError("client gone"), [&] {
    EXPECT_TRUE(chunk_status.ok());  // not yet reported: the rollback comes first
    begin_in_abort =
        LayerwiseAppend::Begin(&ctx_, kDefaultTenant, "s", {0, 10, AppendKind::kPrefill, {}})
            .status();
    rolled_back.Notify();
  });
  EXPECT_FALSE(rolled_back.HasBeenNotified());  // the chunk still runs
  release.Notify();
  chunk_done.WaitForNotification();
  ASSERT_TRUE(rolled_back.HasBeenNotified());
  EXPECT_TRUE(begin_in_abort.ok()) << begin_in_abort;
  EXPECT_TRUE(begin_in_chunk.ok()) << begin_in_chunk;
  EXPECT_EQ(chunk_status.code(), absl::StatusCode::kDataLoss);     // the chunk's own error
  EXPECT_EQ((*a)->status().code(), absl::StatusCode::kCancelled);  // the push's first error
  // After the rollback the callback runs at once.
  bool again = false;
  (*a)->Abort(absl::CancelledError("twice"), [&] { again = true; });
  EXPECT_TRUE(again);
  workers_.Shutdown();
}

}  // namespace
}  // namespace kvpool::server
