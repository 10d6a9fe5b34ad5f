#include "server/attention_engine.h"

#include <atomic>
#include <cmath>
#include <thread>

#include "absl/synchronization/notification.h"
#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "kernels/attention.h"
#include "server/server_test_util.h"
#include "tests/support/test_data.h"

namespace kvpool::server {
namespace {

using testing::AppendAll;
using testing::SmallQuant;
using testing::TestCore;

// One sequence's queries and results, the per-sequence view the tests compare.
struct AttentionQuery {
  std::string sequence_id;
  int num_queries = 1;
  std::vector<float> q;  // [num_queries][q_heads][head_dim], unrotated
};

struct AttentionResult {
  std::string sequence_id;
  std::vector<float> out;  // [num_queries][q_heads][head_dim], original basis
  std::vector<float> lse;  // [num_queries][q_heads], natural log; -inf for no tokens
  int attended_tokens = 0;
};

std::vector<AttentionQuery> Queries(const Model& m, const std::vector<std::string>& ids) {
  std::vector<AttentionQuery> qs;
  for (size_t i = 0; i < ids.size(); ++i) {
    AttentionQuery q;
    q.sequence_id = ids[i];
    q.num_queries = 1 + static_cast<int>(i % 2);
    q.q = kvpool::testing::GaussianValues(q.num_queries * m.q_heads * m.head_dim, 40 + i);
    qs.push_back(std::move(q));
  }
  return qs;
}

// The request form of `qs`: every query in one buffer, as the wire decodes it.
AttentionRequest RequestOf(const std::vector<AttentionQuery>& qs) {
  AttentionRequest r;
  for (const AttentionQuery& q : qs) {
    r.sequence_ids.push_back(q.sequence_id);
    r.num_queries.push_back(q.num_queries);
    r.queries.insert(r.queries.end(), q.q.begin(), q.q.end());
  }
  return r;
}

// `answer` to `request`, per sequence.
std::vector<AttentionResult> ResultsOf(const Model& m, const AttentionRequest& request,
                                       const AttentionAnswer& answer) {
  const size_t per_query = static_cast<size_t>(m.q_heads) * m.head_dim;
  std::vector<AttentionResult> out;
  size_t row = 0;
  for (size_t i = 0; i < request.sequence_ids.size(); ++i) {
    const size_t n = request.num_queries[i];
    AttentionResult r;
    r.sequence_id = request.sequence_ids[i];
    r.attended_tokens = answer.attended_tokens[i];
    r.out.assign(answer.out.begin() + row * per_query, answer.out.begin() + (row + n) * per_query);
    r.lse.assign(answer.lse.begin() + row * m.q_heads, answer.lse.begin() + (row + n) * m.q_heads);
    out.push_back(std::move(r));
    row += n;
  }
  return out;
}

// Run's answer per sequence.
absl::StatusOr<std::vector<AttentionResult>> RunPerSequence(AttentionEngine& engine,
                                                            const std::shared_ptr<const Model>& m,
                                                            int layer,
                                                            const std::vector<AttentionQuery>& qs) {
  const AttentionRequest request = RequestOf(qs);
  KVPOOL_ASSIGN_OR_RETURN(AttentionAnswer answer, engine.Run(kDefaultTenant, m, layer, request));
  return ResultsOf(*m, request, answer);
}

// Empty sequences "s0" ... of `m`, `n` of them.
std::vector<std::string> CreateSequences(TestCore& core, const std::shared_ptr<const Model>& m,
                                         int n) {
  std::vector<std::string> ids;
  for (int i = 0; i < n; ++i) {
    ids.push_back("s" + std::to_string(i));
    EXPECT_TRUE(core.store->Create(kDefaultTenant, m, ids.back(), {}).ok());
  }
  return ids;
}

TEST(AttentionEngineTest, BatchMatchesDenseAttentionOverStoredKv) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kHadamard, SmallQuant());
  const std::vector<std::string> ids = CreateSequences(core, m, 5);
  for (int i = 1; i < 5; ++i) {  // s0 stays empty: lse -inf, zero output
    ASSERT_TRUE(
        AppendAll(*core.store, *m, ids[i], 0, 20 + 17 * i, AppendKind::kFinalPrefill, i).ok());
    for (int d = 0; d < i * 3; ++d) {
      ASSERT_TRUE(
          AppendAll(*core.store, *m, ids[i], 20 + 17 * i + d, 1, AppendKind::kDecode, 100 + d)
              .ok());
    }
  }
  WorkerPool workers(3, 64);
  AttentionEngine inline_engine(core.store.get(), core.backend.get(), nullptr);
  AttentionEngine engine(core.store.get(), core.backend.get(), &workers);
  auto want = RunPerSequence(inline_engine, m, 1, Queries(*m, ids));
  ASSERT_TRUE(want.ok()) << want.status();
  // Start on the workers.
  const AttentionRequest request = RequestOf(Queries(*m, ids));
  absl::Notification done;
  absl::StatusOr<AttentionAnswer> answer;
  ASSERT_TRUE(engine
                  .Start(kDefaultTenant, m, 1, request,
                         [&](absl::StatusOr<AttentionAnswer> a) {
                           answer = std::move(a);
                           done.Notify();
                         })
                  .ok());
  done.WaitForNotification();
  ASSERT_TRUE(answer.ok()) << answer.status();
  const absl::StatusOr<std::vector<AttentionResult>> got = ResultsOf(*m, request, *answer);
  ASSERT_EQ(got->size(), ids.size());
  const std::vector<AttentionQuery> qs = Queries(*m, ids);
  const AttentionShape shape{m->q_heads, m->kv_heads, m->head_dim};
  for (size_t i = 0; i < ids.size(); ++i) {
    const AttentionResult& r = (*got)[i];
    EXPECT_EQ(r.out, (*want)[i].out);  // the parallel path computes the same thing
    EXPECT_EQ(r.sequence_id, ids[i]);
    auto snap = *core.store->Snapshot(kDefaultTenant, ids[i], std::vector<int>{1});
    const int n = snap->total();
    EXPECT_EQ(r.attended_tokens, n);
    if (n == 0) {
      for (float l : r.lse) EXPECT_TRUE(std::isinf(l) && l < 0);
      for (float o : r.out) EXPECT_EQ(o, 0.0f);
      continue;
    }
    std::vector<float> k(n * m->row_values()), v(n * m->row_values());
    ASSERT_TRUE(
        snap->ReadRotated(core.backend.get(), 0, 0, n, absl::MakeSpan(k), absl::MakeSpan(v)).ok());
    for (int j = 0; j < qs[i].num_queries; ++j) {
      const size_t per = m->q_heads * m->head_dim;
      std::vector<float> q(qs[i].q.begin() + j * per, qs[i].q.begin() + (j + 1) * per);
      std::vector<float> qr(per), o(per);
      ASSERT_TRUE(m->codec.rotations.Rotate(1, KvTensor::kKey, q, absl::MakeSpan(qr)).ok());
      AttentionOutput ref = DenseAttentionReference(shape, qr, k, v, n);
      ASSERT_TRUE(
          m->codec.rotations.Unrotate(1, KvTensor::kValue, ref.out, absl::MakeSpan(o)).ok());
      for (size_t e = 0; e < per; ++e) {
        EXPECT_NEAR(r.out[j * per + e], o[e], 1e-3 * (1 + std::fabs(o[e])));
      }
      for (int h = 0; h < m->q_heads; ++h) {
        EXPECT_NEAR(r.lse[j * m->q_heads + h], ref.lse[h], 1e-3 * (1 + std::fabs(ref.lse[h])));
      }
    }
  }
  workers.Shutdown();
}

TEST(AttentionEngineTest, RejectsBadRequests) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kHadamard, SmallQuant());
  auto other = core.AddModel("other", RotationKind::kIdentity, SmallQuant());
  ASSERT_TRUE(core.store->Create(kDefaultTenant, m, "s", {}).ok());
  ASSERT_TRUE(core.store->Create(kDefaultTenant, other, "o", {}).ok());
  AttentionEngine engine(core.store.get(), core.backend.get(), nullptr);
  auto q = Queries(*m, {"s"});
  EXPECT_TRUE(absl::IsInvalidArgument(RunPerSequence(engine, m, 2, q).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(RunPerSequence(engine, m, 0, {}).status()));
  auto short_q = q;
  short_q[0].q.pop_back();
  EXPECT_TRUE(absl::IsInvalidArgument(RunPerSequence(engine, m, 0, short_q).status()));
  auto nan_q = q;
  nan_q[0].q[3] = std::nanf("");
  EXPECT_TRUE(absl::IsInvalidArgument(RunPerSequence(engine, m, 0, nan_q).status()));
  EXPECT_TRUE(absl::IsNotFound(RunPerSequence(engine, m, 0, Queries(*m, {"x"})).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(RunPerSequence(engine, m, 0, Queries(*m, {"o"})).status()));
  EXPECT_TRUE(RunPerSequence(engine, m, 0, q).ok());
}

TEST(AttentionEngineTest, FullQueueIsResourceExhausted) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kHadamard, SmallQuant());
  ASSERT_TRUE(core.store->Create(kDefaultTenant, m, "s", {}).ok());
  WorkerPool workers(1, 1);
  absl::Notification release, started;
  ASSERT_TRUE(workers.TrySubmit([&] {
    started.Notify();
    release.WaitForNotification();
  }));
  started.WaitForNotification();
  ASSERT_TRUE(workers.TrySubmit([] {}));  // the queue is now full
  AttentionEngine engine(core.store.get(), core.backend.get(), &workers);
  const absl::Status s =
      engine.Start(kDefaultTenant, m, 0, RequestOf(Queries(*m, {"s"})), [](auto) { FAIL(); });
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  release.Notify();
  workers.Shutdown();
}

TEST(AttentionEngineTest, SmallCallRunsOnTheCallerOnlyWhenNoWorkIsWaiting) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kHadamard, SmallQuant());
  ASSERT_TRUE(core.store->Create(kDefaultTenant, m, "s", {}).ok());
  ASSERT_TRUE(AppendAll(*core.store, *m, "s", 0, 40, AppendKind::kFinalPrefill, 1).ok());
  WorkerPool workers(1, 8);
  AttentionEngine engine(core.store.get(), core.backend.get(), &workers);
  const std::thread::id caller = std::this_thread::get_id();

  // Idle workers: answered on this thread before Start returns.
  std::thread::id answered_on;
  bool answered = false;
  ASSERT_TRUE(engine
                  .Start(kDefaultTenant, m, 0, RequestOf(Queries(*m, {"s"})),
                         [&](absl::StatusOr<AttentionAnswer> a) {
                           EXPECT_TRUE(a.ok()) << a.status();
                           answered_on = std::this_thread::get_id();
                           answered = true;
                         })
                  .ok());
  EXPECT_TRUE(answered);
  EXPECT_EQ(answered_on, caller);

  // Work waiting for the busy worker: the call queues behind it and runs on the worker.
  absl::Notification release, started, done;
  ASSERT_TRUE(workers.TrySubmit([&] {
    started.Notify();
    release.WaitForNotification();
  }));
  started.WaitForNotification();
  ASSERT_TRUE(workers.TrySubmit([] {}));
  ASSERT_TRUE(engine
                  .Start(kDefaultTenant, m, 0, RequestOf(Queries(*m, {"s"})),
                         [&](absl::StatusOr<AttentionAnswer> a) {
                           EXPECT_TRUE(a.ok()) << a.status();
                           answered_on = std::this_thread::get_id();
                           done.Notify();
                         })
                  .ok());
  EXPECT_FALSE(done.HasBeenNotified());
  release.Notify();
  done.WaitForNotification();
  EXPECT_NE(answered_on, caller);
  workers.Shutdown();
}

TEST(AttentionEngineTest, CancelledCallSkipsTheSequencesItHasNotStarted) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kHadamard, SmallQuant());
  const std::vector<std::string> ids = CreateSequences(core, m, 5);
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(AppendAll(*core.store, *m, ids[i], 0, 40, AppendKind::kFinalPrefill, i).ok());
  }
  // One worker: the call's task checks before looking at the sequences, then before sequence
  // 0, then the other sequences' tasks check in turn. The caller goes away after sequence 0.
  WorkerPool workers(1, 64);
  AttentionEngine engine(core.store.get(), core.backend.get(), &workers);
  CancellationCounters counters;
  std::atomic<int> checks{0};
  auto cancel = std::make_shared<CallCancellation>(
      absl::InfiniteFuture(), [&] { return checks.fetch_add(1) >= 2; }, &counters);
  absl::Notification done;
  absl::Status status;
  ASSERT_TRUE(engine
                  .Start(
                      kDefaultTenant, m, 0, RequestOf(Queries(*m, ids)),
                      [&](absl::StatusOr<AttentionAnswer> a) {
                        status = a.status();
                        done.Notify();
                      },
                      cancel)
                  .ok());
  done.WaitForNotification();
  EXPECT_TRUE(absl::IsCancelled(status)) << status;
  EXPECT_EQ(counters.calls_cancelled.load(), 1u);
  EXPECT_EQ(counters.units_skipped.load(), ids.size() - 1);

  // A deadline already past: nothing is looked at.
  CancellationCounters late;
  absl::Notification late_done;
  ASSERT_TRUE(engine
                  .Start(
                      kDefaultTenant, m, 0, RequestOf(Queries(*m, ids)),
                      [&](absl::StatusOr<AttentionAnswer> a) {
                        status = a.status();
                        late_done.Notify();
                      },
                      std::make_shared<CallCancellation>(absl::InfinitePast(), nullptr, &late))
                  .ok());
  late_done.WaitForNotification();
  EXPECT_TRUE(absl::IsDeadlineExceeded(status)) << status;
  EXPECT_EQ(late.calls_cancelled.load(), 1u);
  EXPECT_EQ(late.units_skipped.load(), ids.size());
  workers.Shutdown();
}

TEST(AttentionEngineTest, DeviceCallIsUnavailableOnTheCpuBackend) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kHadamard, SmallQuant());
  ASSERT_TRUE(core.store->Create(kDefaultTenant, m, "s", {}).ok());
  AttentionEngine engine(core.store.get(), core.backend.get(), nullptr);
  std::vector<float> q(m->q_heads * m->head_dim), out(q.size()), lse(m->q_heads);
  const std::string ids[1] = {"s"};
  const absl::StatusOr<std::vector<int>> r =
      engine.RunOnDevice(kDefaultTenant, m, {0, ids, 1, q.data(), out.data(), lse.data()});
  EXPECT_TRUE(absl::IsUnavailable(r.status())) << r.status();
}

// A "GPU" backend whose device memory is host memory: Attend with device I/O hands the same
// call to the CPU backend, its buffers read as host memory, so RunOnDevice's mapping of rows to
// sequences can be checked against Run without a GPU.
class HostMemoryAsDevice final : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  absl::string_view name() const override { return "host-as-device"; }
  int device() const override { return 0; }
  absl::Status Attend(const Model& m, const AttentionCall& call) override {
    ++calls;
    if (!call.on_device || call.io.size() != 1) return absl::InternalError("expected device I/O");
    AttentionCall host = call;
    host.on_device = false;
    return inner()->Attend(m, host);
  }
  // The rest is the CPU backend's (ForwardingBackend: the store writes through the real one).
  int calls = 0;
};

TEST(AttentionEngineTest, DeviceCallMatchesRunRowForRow) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kHadamard, SmallQuant());
  const std::vector<std::string> ids = {"a", "b", "empty", "a"};  // a duplicate is allowed
  for (const char* id : {"a", "b", "empty"}) {
    ASSERT_TRUE(core.store->Create(kDefaultTenant, m, id, {}).ok());
  }
  ASSERT_TRUE(AppendAll(*core.store, *m, "a", 0, 61, AppendKind::kFinalPrefill, 1).ok());
  ASSERT_TRUE(AppendAll(*core.store, *m, "b", 0, 29, AppendKind::kFinalPrefill, 2).ok());
  constexpr int kQueries = 2;
  std::vector<AttentionQuery> host = Queries(*m, ids);
  std::vector<float> q;  // [batch][kQueries][Hq][D], the same values as `host`
  for (AttentionQuery& hq : host) {
    hq.num_queries = kQueries;
    hq.q = kvpool::testing::GaussianValues(kQueries * m->q_heads * m->head_dim,
                                           hq.q.size() + q.size());
    q.insert(q.end(), hq.q.begin(), hq.q.end());
  }
  AttentionEngine cpu_engine(core.store.get(), core.backend.get(), nullptr);
  auto want = RunPerSequence(cpu_engine, m, 1, host);
  ASSERT_TRUE(want.ok()) << want.status();

  HostMemoryAsDevice device(core.backend.get());
  AttentionEngine engine(core.store.get(), &device, nullptr);
  std::vector<float> out(q.size(), -7.0f), lse(q.size() / m->head_dim, -7.0f);
  absl::StatusOr<std::vector<int>> got =
      engine.RunOnDevice(kDefaultTenant, m, {1, ids, kQueries, q.data(), out.data(), lse.data()});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(device.calls, 1);
  ASSERT_EQ(got->size(), ids.size());
  const size_t per_seq_out = static_cast<size_t>(kQueries) * m->q_heads * m->head_dim;
  const size_t per_seq_lse = static_cast<size_t>(kQueries) * m->q_heads;
  for (size_t i = 0; i < ids.size(); ++i) {
    const AttentionResult& w = (*want)[i];
    EXPECT_EQ((*got)[i], w.attended_tokens) << ids[i];
    for (size_t j = 0; j < per_seq_out; ++j) {
      ASSERT_NEAR(out[i * per_seq_out + j], w.out[j], 1e-5 * (1 + std::fabs(w.out[j])))
          << ids[i] << " value " << j;
    }
    for (size_t j = 0; j < per_seq_lse; ++j) {
      const float g = lse[i * per_seq_lse + j];
      if (std::isinf(w.lse[j])) {
        EXPECT_EQ(g, w.lse[j]) << ids[i];  // the empty sequence: -inf
      } else {
        ASSERT_NEAR(g, w.lse[j], 1e-5 * (1 + std::fabs(w.lse[j]))) << ids[i] << " lse " << j;
      }
    }
  }
  EXPECT_EQ((*got)[0], 61);
  EXPECT_EQ((*got)[1], 29);
  EXPECT_EQ((*got)[2], 0);
}

TEST(AttentionEngineTest, DeviceCallRejectsBadCallsBeforeTheBackend) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kHadamard, SmallQuant());
  auto other = core.AddModel("other", RotationKind::kIdentity, SmallQuant());
  ASSERT_TRUE(core.store->Create(kDefaultTenant, m, "s", {}).ok());
  ASSERT_TRUE(core.store->Create(kDefaultTenant, other, "o", {}).ok());
  HostMemoryAsDevice device(core.backend.get());
  AttentionEngine engine(core.store.get(), &device, nullptr);
  std::vector<float> q(2 * m->q_heads * m->head_dim), out(q.size()), lse(2 * m->q_heads);
  const std::vector<std::string> s = {"s"}, missing = {"s", "x"}, foreign = {"o"};
  auto run = [&](int layer, const std::vector<std::string>& ids, int nq, float* o) {
    return engine.RunOnDevice(kDefaultTenant, m, {layer, ids, nq, q.data(), o, lse.data()})
        .status();
  };
  EXPECT_TRUE(absl::IsInvalidArgument(run(2, s, 1, out.data())));   // layer out of range
  EXPECT_TRUE(absl::IsInvalidArgument(run(-1, s, 1, out.data())));  // layer out of range
  EXPECT_TRUE(absl::IsInvalidArgument(run(0, {}, 1, out.data())));  // empty batch
  EXPECT_TRUE(absl::IsInvalidArgument(run(0, s, 0, out.data())));   // no query rows
  EXPECT_TRUE(absl::IsInvalidArgument(run(0, s, 1, nullptr)));      // no output buffer
  EXPECT_TRUE(absl::IsNotFound(run(0, missing, 1, out.data())));
  EXPECT_TRUE(absl::IsInvalidArgument(run(0, foreign, 1, out.data())));  // another model's
  EXPECT_EQ(device.calls, 0);
  EXPECT_TRUE(run(1, s, 2, out.data()).ok());
  EXPECT_EQ(device.calls, 1);
}

}  // namespace
}  // namespace kvpool::server
