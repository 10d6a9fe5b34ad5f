#include "server/attention_engine.h"

#include <cmath>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "server/server_test_util.h"
#include "tests/support/test_data.h"

namespace kvpool::server {
namespace {

using testing::AppendAll;
using testing::SmallQuant;
using testing::TestCore;

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

TEST(AttentionEngineTest, BatchMatchesDenseAttentionOverStoredKv) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kHadamard, SmallQuant());
  std::vector<std::string> ids;
  for (int i = 0; i < 5; ++i) {
    ids.push_back("s" + std::to_string(i));
    ASSERT_TRUE(core.store->Create(kDefaultTenant, m, ids.back(), {}).ok());
    if (i == 0) continue;  // an empty sequence: lse -inf, zero output
    ASSERT_TRUE(
        AppendAll(*core.store, *m, ids.back(), 0, 20 + 17 * i, AppendKind::kFinalPrefill, i).ok());
    for (int d = 0; d < i * 3; ++d) {
      ASSERT_TRUE(
          AppendAll(*core.store, *m, ids.back(), 20 + 17 * i + d, 1, AppendKind::kDecode, 100 + d)
              .ok());
    }
  }
  WorkerPool workers(3, 64);
  AttentionEngine inline_engine(core.store.get(), core.backend.get(), nullptr);
  AttentionEngine engine(core.store.get(), core.backend.get(), &workers);
  auto want = inline_engine.Run(kDefaultTenant, m, 1, Queries(*m, ids));
  ASSERT_TRUE(want.ok()) << want.status();
  absl::Notification done;
  absl::StatusOr<std::vector<AttentionResult>> got;
  ASSERT_TRUE(engine
                  .Start(kDefaultTenant, m, 1, Queries(*m, ids),
                         [&](absl::StatusOr<std::vector<AttentionResult>> r) {
                           got = std::move(r);
                           done.Notify();
                         })
                  .ok());
  done.WaitForNotification();
  ASSERT_TRUE(got.ok()) << got.status();
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
  EXPECT_TRUE(absl::IsInvalidArgument(engine.Run(kDefaultTenant, m, 2, q).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(engine.Run(kDefaultTenant, m, 0, {}).status()));
  auto short_q = q;
  short_q[0].q.pop_back();
  EXPECT_TRUE(absl::IsInvalidArgument(engine.Run(kDefaultTenant, m, 0, short_q).status()));
  auto nan_q = q;
  nan_q[0].q[3] = std::nanf("");
  EXPECT_TRUE(absl::IsInvalidArgument(engine.Run(kDefaultTenant, m, 0, nan_q).status()));
  EXPECT_TRUE(absl::IsNotFound(engine.Run(kDefaultTenant, m, 0, Queries(*m, {"x"})).status()));
  EXPECT_TRUE(
      absl::IsInvalidArgument(engine.Run(kDefaultTenant, m, 0, Queries(*m, {"o"})).status()));
  EXPECT_TRUE(engine.Run(kDefaultTenant, m, 0, q).ok());
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
      engine.Start(kDefaultTenant, m, 0, Queries(*m, {"s"}), [](auto) { FAIL(); });
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  release.Notify();
  workers.Shutdown();
}

}  // namespace
}  // namespace kvpool::server
