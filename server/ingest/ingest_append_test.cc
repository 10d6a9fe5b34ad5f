// IngestAppend: chunks handed over out of order are staged in order, layers concurrently; any
// failure or an abort rolls the whole append back before anyone hears of it; the queue of chunks
// to stage is bounded and pauses its producer; the commit counts the ingest.
#include "server/ingest/ingest_append.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "proto/status.h"
#include "server/admission/admission.h"
#include "server/ingest/ingest_engine.h"
#include "server/server_test_util.h"

namespace kvpool::server {
namespace {

using testing::BypassQuant;
using testing::TestCore;
using testing::TestRows;

v1::AppendKvHeader Header(uint32_t num_tokens, bool final = false,
                          v1::DType dtype = v1::DTYPE_BF16) {
  v1::AppendKvHeader h;
  h.set_sequence_id("s");
  h.set_token_start(0);
  h.set_num_tokens(num_tokens);
  h.set_dtype(dtype);
  h.set_end_of_prefill(final);
  return h;
}

// The append's end (IngestOptions::on_end), waited for.
struct EndWaiter {
  absl::Notification ended;
  absl::StatusOr<AppendResult> result = absl::UnknownError("not ended");

  void Watch(IngestOptions* o) {
    o->on_end = [this](absl::StatusOr<AppendResult> r) {
      result = std::move(r);
      ended.Notify();
    };
  }
  absl::StatusOr<AppendResult> Wait() {
    ended.WaitForNotification();
    return result;
  }
};

class IngestAppendTest : public ::testing::Test {
 protected:
  IngestAppendTest()
      : workers_(2, 64), engine_(core_.store.get(), core_.registry.get(), &workers_, 4096) {
    model_ = core_.AddModel("m", RotationKind::kIdentity, BypassQuant(), /*num_layers=*/3);
    EXPECT_TRUE(core_.store->Create(kDefaultTenant, model_, "s", {}).ok());
  }

  absl::StatusOr<std::shared_ptr<IngestAppend>> Begin(uint32_t tokens, IngestOptions o = {}) {
    return engine_.Begin(kDefaultTenant, "test", Header(tokens), std::move(o));
  }

  absl::string_view Bytes(const std::vector<Bf16>& rows, int offset, int count) const {
    const size_t row = model_->row_values() * sizeof(Bf16);
    return absl::string_view(reinterpret_cast<const char*>(rows.data()) + offset * row,
                             count * row);
  }

  // Stages every chunk and waits for all of them; returns the statuses.
  std::vector<absl::Status> StageAll(IngestAppend& a,
                                     const std::vector<std::pair<int, int>>& chunks, int count,
                                     const std::vector<Bf16>& rows) {
    std::vector<absl::Status> out(chunks.size());
    std::vector<absl::Notification> done(chunks.size());
    for (size_t i = 0; i < chunks.size(); ++i) {
      const auto [layer, offset] = chunks[i];
      a.Stage(layer, offset, count, Bytes(rows, offset, count), Bytes(rows, offset, count),
              [&out, &done, i](absl::Status s, bool) {
                out[i] = s;
                done[i].Notify();
              });
    }
    for (auto& d : done) d.WaitForNotification();
    return out;
  }

  TestCore core_;
  WorkerPool workers_;
  IngestEngine engine_;
  std::shared_ptr<const Model> model_;
};

TEST_F(IngestAppendTest, StagesOutOfOrderChunksInOrderAndCommits) {
  const std::vector<Bf16> rows = TestRows(40, model_->row_values(), 1);
  EndWaiter end;
  IngestOptions o;
  end.Watch(&o);
  auto a = Begin(40, std::move(o));
  ASSERT_TRUE(a.ok()) << a.status();
  std::vector<std::pair<int, int>> chunks;
  for (int layer = 2; layer >= 0; --layer) {
    for (int off : {30, 10, 20, 0}) chunks.emplace_back(layer, off);
  }
  for (const absl::Status& s : StageAll(**a, chunks, 10, rows)) EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE((*a)->Complete());
  (*a)->Commit();
  auto r = end.Wait();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->info.total(), 40);
  EXPECT_EQ(engine_.counters().ingested_tokens.load(), 40u);
  EXPECT_EQ(engine_.counters().ingested_bytes.load(), 40u * model_->bf16_token_bytes() * 3);
  workers_.Shutdown();
}

TEST_F(IngestAppendTest, OverlappingChunkFailsAndRollsBack) {
  const size_t before = core_.pool->used_bytes();
  const std::vector<Bf16> rows = TestRows(40, model_->row_values(), 1);
  {
    EndWaiter end;
    IngestOptions o;
    end.Watch(&o);
    auto a = Begin(40, std::move(o));
    ASSERT_TRUE(a.ok());
    auto st = StageAll(**a, {{0, 0}, {0, 0}}, 10, rows);
    EXPECT_FALSE((*a)->status().ok());
    (*a)->Commit();
    EXPECT_FALSE(end.Wait().ok());
  }
  {
    auto a = Begin(40);
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

// A failed append frees the sequence before anyone hears of the failure: the failing chunk's
// callback and the Abort callback both find the sequence free, and the Abort callback waits for
// the chunk that is still running.
TEST_F(IngestAppendTest, RollsBackBeforeReportingAFailure) {
  const std::vector<Bf16> rows = TestRows(10, model_->row_values(), 1);
  EndWaiter end;
  IngestOptions o;
  end.Watch(&o);
  auto a = Begin(10, std::move(o));
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
        begin_in_chunk = Begin(10).status();
        chunk_done.Notify();
      });
  running.WaitForNotification();
  (*a)->Abort(absl::CancelledError("client gone"), [&] {
    EXPECT_TRUE(chunk_status.ok());  // not yet reported: the rollback comes first
    begin_in_abort = Begin(10).status();
    rolled_back.Notify();
  });
  EXPECT_FALSE(rolled_back.HasBeenNotified());  // the chunk still runs
  release.Notify();
  chunk_done.WaitForNotification();
  ASSERT_TRUE(rolled_back.HasBeenNotified());
  EXPECT_TRUE(begin_in_abort.ok()) << begin_in_abort;
  EXPECT_TRUE(begin_in_chunk.ok()) << begin_in_chunk;
  EXPECT_EQ(chunk_status.code(), absl::StatusCode::kDataLoss);          // the chunk's own error
  EXPECT_EQ((*a)->status().code(), absl::StatusCode::kCancelled);       // the append's first error
  EXPECT_EQ(end.Wait().status().code(), absl::StatusCode::kCancelled);  // reported once, after
  // After the rollback the callback runs at once.
  bool again = false;
  (*a)->Abort(absl::CancelledError("twice"), [&] { again = true; });
  EXPECT_TRUE(again);
  workers_.Shutdown();
}

// The queue of chunks handed over and not yet staged is bounded: Stage says "pause" when it is
// full, and `resume` runs once it has drained.
TEST_F(IngestAppendTest, AFullQueuePausesTheProducerUntilItDrains) {
  const std::vector<Bf16> rows = TestRows(40, model_->row_values(), 1);
  absl::Notification resumed, release;
  EndWaiter end;
  IngestOptions o;
  end.Watch(&o);
  o.max_pending_chunks = 3;
  o.resume = [&] { resumed.Notify(); };
  auto a = Begin(40, std::move(o));
  ASSERT_TRUE(a.ok()) << a.status();
  // The first chunk holds its worker until released: the queue fills behind it.
  EXPECT_TRUE((*a)->StageDevice(
      0, 0, 10, rows.data(), rows.data(),
      [&]() -> absl::Status {
        release.WaitForNotification();
        return absl::UnavailableError("stop here");  // the rows are host memory: stop
      },
      nullptr));
  EXPECT_TRUE((*a)->Stage(0, 10, 10, Bytes(rows, 10, 10), Bytes(rows, 10, 10), nullptr));
  EXPECT_FALSE((*a)->Stage(0, 20, 10, Bytes(rows, 20, 10), Bytes(rows, 20, 10), nullptr));
  EXPECT_FALSE(resumed.HasBeenNotified());
  release.Notify();
  // The first chunk fails, so the queue drains by failing the rest: the end reports, no resume.
  EXPECT_EQ(end.Wait().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(resumed.HasBeenNotified());

  EndWaiter end2;
  IngestOptions o2;
  end2.Watch(&o2);
  o2.max_pending_chunks = 3;
  o2.resume = [&] { resumed.Notify(); };
  absl::Notification release2;
  auto b = Begin(40, std::move(o2));
  ASSERT_TRUE(b.ok()) << b.status();
  // Layer 0 is blocked by its first chunk; layers 1 and 2 wait for theirs.
  EXPECT_TRUE((*b)->Stage(0, 0, 40, Bytes(rows, 0, 40), Bytes(rows, 0, 40), nullptr));
  EXPECT_TRUE((*b)->Stage(1, 0, 40, Bytes(rows, 0, 40), Bytes(rows, 0, 40), nullptr));
  const bool more = (*b)->Stage(2, 0, 40, Bytes(rows, 0, 40), Bytes(rows, 0, 40), nullptr);
  if (!more) resumed.WaitForNotification();  // drained: the producer goes on
  (*b)->Commit();
  auto r = end2.Wait();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->info.total(), 40);
  workers_.Shutdown();
}

// A full queue whose chunks all wait for earlier tokens of their layer can never drain: the
// append fails at once (instead of pausing its producer forever) and rolls back.
TEST_F(IngestAppendTest, AQueueFullOfChunksBehindAGapFails) {
  const size_t before = core_.pool->used_bytes();
  const std::vector<Bf16> rows = TestRows(40, model_->row_values(), 1);
  EndWaiter end;
  IngestOptions o;
  end.Watch(&o);
  o.max_pending_chunks = 2;
  auto a = Begin(40, std::move(o));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE((*a)->Stage(0, 20, 10, Bytes(rows, 20, 10), Bytes(rows, 20, 10), nullptr));
  EXPECT_FALSE((*a)->Stage(0, 30, 10, Bytes(rows, 30, 10), Bytes(rows, 30, 10), nullptr));
  const absl::Status s = end.Wait().status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("tokens [0, 20)"), absl::string_view::npos) << s;
  workers_.Shutdown();
  EXPECT_EQ(core_.pool->used_bytes(), before);
}

// The producer finished, but a layer misses tokens: INVALID_ARGUMENT after the rollback, whether
// a later chunk waits behind a gap or the layer simply ends early.
TEST_F(IngestAppendTest, CommittingAnIncompleteAppendFails) {
  const size_t before = core_.pool->used_bytes();
  const std::vector<Bf16> rows = TestRows(40, model_->row_values(), 1);
  auto whole = [&](IngestAppend& a, int layer) {
    a.Stage(layer, 0, 40, Bytes(rows, 0, 40), Bytes(rows, 0, 40), nullptr);
  };
  for (bool gap : {true, false}) {
    EndWaiter end;
    IngestOptions o;
    end.Watch(&o);
    auto a = Begin(40, std::move(o));
    ASSERT_TRUE(a.ok()) << a.status();
    whole(**a, 0);
    whole(**a, 1);
    (*a)->Stage(2, 0, 10, Bytes(rows, 0, 10), Bytes(rows, 0, 10), nullptr);
    if (gap) (*a)->Stage(2, 20, 20, Bytes(rows, 20, 20), Bytes(rows, 20, 20), nullptr);
    (*a)->Commit();  // layer 2: tokens [10, 20) never come; or [10, 40)
    const absl::Status s = end.Wait().status();
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  }
  workers_.Shutdown();
  EXPECT_EQ(core_.pool->used_bytes(), before);
  EXPECT_EQ(engine_.counters().ingested_tokens.load(), 0u);
}

// Payloads in FP32 are converted on the worker; a size that does not match the dtype fails the
// append with INVALID_ARGUMENT before anything is staged.
TEST_F(IngestAppendTest, ConvertsOtherDtypesAndChecksPayloadSizes) {
  std::vector<float> k(10 * model_->row_values(), 0.5f), v(k.size(), 0.25f);
  const absl::string_view kb(reinterpret_cast<const char*>(k.data()), k.size() * 4);
  const absl::string_view vb(reinterpret_cast<const char*>(v.data()), v.size() * 4);
  {
    EndWaiter end;
    IngestOptions o;
    end.Watch(&o);
    auto a = engine_.Begin(kDefaultTenant, "test", Header(10, false, v1::DTYPE_FP32), std::move(o));
    ASSERT_TRUE(a.ok()) << a.status();
    for (int layer = 0; layer < 3; ++layer) (*a)->Stage(layer, 0, 10, kb, vb, nullptr);
    (*a)->Commit();
    auto r = end.Wait();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->info.total(), 10);
  }
  {
    EndWaiter end;
    IngestOptions o;
    end.Watch(&o);
    v1::AppendKvHeader h = Header(10, false, v1::DTYPE_FP32);
    h.set_token_start(10);
    auto a = engine_.Begin(kDefaultTenant, "test", h, std::move(o));
    ASSERT_TRUE(a.ok()) << a.status();
    (*a)->Stage(0, 0, 10, kb.substr(4), vb, nullptr);
    EXPECT_TRUE(absl::IsInvalidArgument(end.Wait().status()));
  }
  workers_.Shutdown();
}

// The first task of a chunk goes through the worker pool's bounded queue: a full pool fails the
// append with RESOURCE_EXHAUSTED (retry later) and leaves the pool as it was.
TEST_F(IngestAppendTest, AFullWorkerPoolFailsTheAppend) {
  const size_t before = core_.pool->used_bytes();
  WorkerPool tiny(1, 1);
  IngestEngine engine(core_.store.get(), core_.registry.get(), &tiny, 4096);
  absl::Notification started, release;
  ASSERT_TRUE(tiny.TrySubmit([&] {  // holds the one thread
    started.Notify();
    release.WaitForNotification();
  }));
  started.WaitForNotification();
  ASSERT_TRUE(tiny.TrySubmit([] {}));  // takes the one place in the queue
  const std::vector<Bf16> rows = TestRows(10, model_->row_values(), 1);
  EndWaiter end;
  IngestOptions o;
  end.Watch(&o);
  auto a = engine.Begin(kDefaultTenant, "test", Header(10), std::move(o));
  ASSERT_TRUE(a.ok()) << a.status();
  absl::Status chunk;
  (*a)->Stage(0, 0, 10, Bytes(rows, 0, 10), Bytes(rows, 0, 10),
              [&](absl::Status s, bool) { chunk = s; });
  EXPECT_EQ(chunk.code(), absl::StatusCode::kResourceExhausted) << chunk;
  release.Notify();
  EXPECT_EQ(end.Wait().status().code(), absl::StatusCode::kResourceExhausted);
  tiny.Shutdown();
  workers_.Shutdown();
  EXPECT_EQ(core_.pool->used_bytes(), before);
}

// Admission: the pages an append reserves count against its ticket as the store reserves them
// (exactly the pool bytes it took), a cap on reserved bytes refuses the append before anything
// is reserved, and an append that makes no progress for the idle timeout is rolled back by its
// ticket's expiry: pages and the sequence's append lock are free again.
TEST_F(IngestAppendTest, AdmissionCountsReservedPagesCapsThemAndExpiresIdleAppends) {
  AdmissionLimits limits;
  limits.idle_timeout = absl::Milliseconds(200);
  limits.reap_period = absl::Milliseconds(10);
  Admission admission(limits);
  IngestEngine engine(core_.store.get(), core_.registry.get(), &workers_, 4096, &admission);
  const size_t before = core_.pool->used_bytes();
  {
    EndWaiter end;
    IngestOptions o;
    end.Watch(&o);
    auto a = engine.Begin(kDefaultTenant, "peer", Header(40), std::move(o));
    ASSERT_TRUE(a.ok()) << a.status();
    const AdmissionCounters held = admission.Counters();
    EXPECT_EQ(held.open_streams, 1u);
    EXPECT_GT(held.reserved_bytes, 0u);
    EXPECT_EQ(held.reserved_bytes, core_.pool->used_bytes() - before);
    // Nothing arrives: the ticket expires and the append ends rolled back.
    const absl::Status ended = end.Wait().status();
    EXPECT_EQ(ended.code(), absl::StatusCode::kDeadlineExceeded) << ended;
    EXPECT_EQ(ReasonOf(ended), ErrorReason::kLimit) << ended;
    EXPECT_EQ(core_.pool->used_bytes(), before);
    EXPECT_EQ(admission.Counters().reserved_bytes, 0u);
    EXPECT_EQ(admission.Counters().expired_idle, 1u);
  }
  EXPECT_EQ(admission.Counters().open_streams, 0u);
  // The lock is free: a new append begins (and one over a byte cap would not).
  auto again = engine.Begin(kDefaultTenant, "peer", Header(40), IngestOptions{});
  ASSERT_TRUE(again.ok()) << again.status();
  (*again)->Abort(absl::CancelledError("done"));
  again->reset();

  AdmissionLimits capped = limits;
  capped.max_reserved_bytes_per_connection = 1;
  Admission tight(capped);
  IngestEngine tight_engine(core_.store.get(), core_.registry.get(), &workers_, 4096, &tight);
  // (The abort above rolled back at once: nothing of it was running.)
  absl::StatusOr<std::shared_ptr<IngestAppend>> refused =
      tight_engine.Begin(kDefaultTenant, "peer", Header(40), IngestOptions{});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_EQ(ReasonOf(refused.status()), ErrorReason::kLimit) << refused.status();
  EXPECT_EQ(tight.Counters().refused, 1u);
  EXPECT_EQ(tight.Counters().open_streams, 0u);
  EXPECT_EQ(core_.pool->used_bytes(), before);
  workers_.Shutdown();
}

}  // namespace
}  // namespace kvpool::server
