#include "server/attention_plan.h"

#include <cstring>

#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "server/attention_engine.h"
#include "server/server_test_util.h"
#include "tests/support/test_data.h"

namespace kvpool::server {
namespace {

using testing::AppendAll;
using testing::SmallQuant;
using testing::TestCore;

// What one plan call answers.
struct Answer {
  std::vector<float> out, lse;
  std::vector<int32_t> tokens;
};

absl::StatusOr<Answer> PlanCall(AttentionPlan& plan, int layer, const std::vector<float>& q) {
  const Model& m = plan.model();
  Answer a;
  a.out.assign(q.size(), 0.0f);
  a.lse.assign(static_cast<size_t>(plan.rows()) * m.q_heads, 0.0f);
  const AttentionRows io{q.data(), a.out.data(), a.lse.data(), plan.rows()};
  KVPOOL_ASSIGN_OR_RETURN(absl::Span<const int32_t> tokens, plan.Attend(layer, io, false));
  a.tokens.assign(tokens.begin(), tokens.end());
  return a;
}

// The same call through the engine (snapshots and tables built per call): the reference.
Answer EngineCall(TestCore& core, std::shared_ptr<const Model> m, int layer,
                  const std::vector<std::string>& ids, int num_queries,
                  const std::vector<float>& q) {
  AttentionEngine engine(core.store.get(), core.backend.get(), nullptr);
  AttentionRequest r;
  r.sequence_ids = ids;
  r.num_queries.assign(ids.size(), num_queries);
  r.queries = q;
  absl::StatusOr<AttentionAnswer> a = engine.Run(kDefaultTenant, m, layer, std::move(r));
  EXPECT_TRUE(a.ok()) << a.status();
  if (!a.ok()) return {};
  return {a->out, a->lse,
          std::vector<int32_t>(a->attended_tokens.begin(), a->attended_tokens.end())};
}

void ExpectSameBits(const Answer& got, const Answer& want) {
  ASSERT_EQ(got.out.size(), want.out.size());
  ASSERT_EQ(got.lse.size(), want.lse.size());
  EXPECT_EQ(std::memcmp(got.out.data(), want.out.data(), got.out.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(got.lse.data(), want.lse.data(), got.lse.size() * sizeof(float)), 0);
  EXPECT_EQ(got.tokens, want.tokens);
}

TEST(AttentionPlanTest, FollowsGrowthAndDemotionBitForBit) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kHadamard, SmallQuant());
  const std::vector<std::string> ids = {"a", "b", "empty", "a"};  // a repeat is allowed
  for (const char* id : {"a", "b", "empty"}) {
    ASSERT_TRUE(core.store->Create(kDefaultTenant, m, id, {}).ok());
  }
  ASSERT_TRUE(AppendAll(*core.store, *m, "a", 0, 61, AppendKind::kFinalPrefill, 1).ok());
  ASSERT_TRUE(AppendAll(*core.store, *m, "b", 0, 29, AppendKind::kFinalPrefill, 2).ok());
  constexpr int kQueries = 2;
  auto plan =
      AttentionPlan::Create(core.store.get(), core.backend.get(), kDefaultTenant, m, ids, kQueries);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const std::vector<float> q = kvpool::testing::GaussianValues(
      static_cast<size_t>((*plan)->rows()) * m->q_heads * m->head_dim, 7);
  int a_tokens = 61;
  for (int step = 0; step < 40; ++step) {
    for (int layer = 0; layer < m->num_layers; ++layer) {
      absl::StatusOr<Answer> got = PlanCall(**plan, layer, q);
      ASSERT_TRUE(got.ok()) << got.status();
      ExpectSameBits(*got, EngineCall(core, m, layer, ids, kQueries, q));
      EXPECT_EQ(got->tokens[0], a_tokens);
    }
    // One decode token: the recent window grows and, every few steps, demotes into history.
    ASSERT_TRUE(AppendAll(*core.store, *m, "a", a_tokens, 1, AppendKind::kDecode, 100 + step).ok());
    ++a_tokens;
  }
}

TEST(AttentionPlanTest, AnUnchangedBatchWritesNoTableWords) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kHadamard, SmallQuant());
  ASSERT_TRUE(core.store->Create(kDefaultTenant, m, "a", {}).ok());
  ASSERT_TRUE(AppendAll(*core.store, *m, "a", 0, 200, AppendKind::kFinalPrefill, 1).ok());
  auto plan =
      AttentionPlan::Create(core.store.get(), core.backend.get(), kDefaultTenant, m, {"a"}, 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const std::vector<float> q =
      kvpool::testing::GaussianValues(static_cast<size_t>(m->q_heads) * m->head_dim, 3);
  ASSERT_TRUE(PlanCall(**plan, 0, q).ok());
  const uint64_t first = (*plan)->words_written();
  EXPECT_GT(first, 0u);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(PlanCall(**plan, 0, q).ok());
  EXPECT_EQ((*plan)->words_written(), first);
  // One more token changes the recent tier's count and perhaps one block id: a few words, not
  // the sequence's whole table.
  ASSERT_TRUE(AppendAll(*core.store, *m, "a", 200, 1, AppendKind::kDecode, 9).ok());
  ASSERT_TRUE(PlanCall(**plan, 0, q).ok());
  EXPECT_GT((*plan)->words_written(), first);
  EXPECT_LE((*plan)->words_written() - first, 4u);
}

TEST(AttentionPlanTest, ReleasedSequenceFailsItsCallsAndNothingElse) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kHadamard, SmallQuant());
  for (const char* id : {"a", "b"}) {
    ASSERT_TRUE(core.store->Create(kDefaultTenant, m, id, {}).ok());
    ASSERT_TRUE(AppendAll(*core.store, *m, id, 0, 40, AppendKind::kFinalPrefill, 1).ok());
  }
  auto plan =
      AttentionPlan::Create(core.store.get(), core.backend.get(), kDefaultTenant, m, {"a", "b"}, 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const std::vector<float> q =
      kvpool::testing::GaussianValues(static_cast<size_t>(2) * m->q_heads * m->head_dim, 3);
  ASSERT_TRUE(PlanCall(**plan, 1, q).ok());
  ASSERT_TRUE(core.store->Release(kDefaultTenant, "b").ok());
  EXPECT_TRUE(absl::IsNotFound(PlanCall(**plan, 1, q).status()));
  EXPECT_TRUE(absl::IsNotFound(PlanCall(**plan, 0, q).status()));
  // Created anew under the same id, it is found again.
  ASSERT_TRUE(core.store->Create(kDefaultTenant, m, "b", {}).ok());
  ASSERT_TRUE(AppendAll(*core.store, *m, "b", 0, 12, AppendKind::kFinalPrefill, 5).ok());
  absl::StatusOr<Answer> again = PlanCall(**plan, 1, q);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->tokens[1], 12);
  auto other =
      AttentionPlan::Create(core.store.get(), core.backend.get(), kDefaultTenant, m, {"a"}, 1);
  ASSERT_TRUE(other.ok());
  std::vector<float> q1(q.begin(), q.begin() + m->q_heads * m->head_dim);
  EXPECT_TRUE(PlanCall(**other, 1, q1).ok());
}

TEST(AttentionPlanTest, RefusesBadShapes) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kHadamard, SmallQuant());
  auto other = core.AddModel("other", RotationKind::kHadamard, SmallQuant());
  ASSERT_TRUE(core.store->Create(kDefaultTenant, m, "a", {}).ok());
  ASSERT_TRUE(core.store->Create(kDefaultTenant, other, "o", {}).ok());
  auto make = [&](std::vector<std::string> ids, int nq) {
    return AttentionPlan::Create(core.store.get(), core.backend.get(), kDefaultTenant, m,
                                 std::move(ids), nq)
        .status();
  };
  EXPECT_TRUE(absl::IsInvalidArgument(make({}, 1)));
  EXPECT_TRUE(absl::IsInvalidArgument(make({"a"}, 0)));
  EXPECT_TRUE(absl::IsInvalidArgument(make({""}, 1)));
  std::vector<float> q(static_cast<size_t>(m->q_heads) * m->head_dim, 0.5f);
  auto call = [&](std::vector<std::string> ids, const TenantId& tenant) {
    auto p =
        AttentionPlan::Create(core.store.get(), core.backend.get(), tenant, m, std::move(ids), 1);
    EXPECT_TRUE(p.ok());
    return p.ok() ? PlanCall(**p, 0, q).status() : p.status();
  };
  EXPECT_TRUE(absl::IsNotFound(call({"nope"}, kDefaultTenant)));
  EXPECT_TRUE(absl::IsInvalidArgument(call({"o"}, kDefaultTenant)));
  EXPECT_TRUE(absl::IsNotFound(call({"a"}, TenantId("someone-else"))));
  auto plan =
      AttentionPlan::Create(core.store.get(), core.backend.get(), kDefaultTenant, m, {"a"}, 1);
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(PlanCall(**plan, -1, q).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(PlanCall(**plan, m->num_layers, q).status()));
  std::vector<float> out(q.size()), lse(m->q_heads);
  EXPECT_TRUE(absl::IsInvalidArgument(
      (*plan)->Attend(0, {q.data(), out.data(), lse.data(), 2}, false).status()));
}

}  // namespace
}  // namespace kvpool::server
