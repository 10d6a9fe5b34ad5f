#include "server/attention_combiner.h"

#include <cstring>
#include <thread>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "server/server_test_util.h"
#include "tests/support/test_data.h"

namespace kvpool::server {
namespace {

using testing::AppendAll;
using testing::SmallQuant;
using testing::TestCore;

// The CPU backend, whose first Attend holds until `release` (so that calls pile up behind it)
// and which counts its calls and their runs of rows.
class HoldingBackend final : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  absl::Status Attend(const Model& m, const AttentionCall& call) override {
    if (calls_.fetch_add(1) == 0) release.WaitForNotification();
    runs_.fetch_add(call.io.size());
    return inner()->Attend(m, call);
  }
  absl::Notification release;
  std::atomic<int> calls_{0};
  std::atomic<int> runs_{0};
};

struct Caller {
  std::unique_ptr<AttentionPlan> plan;
  std::vector<float> q, out, lse;
  absl::StatusOr<std::vector<int32_t>> tokens = absl::UnknownError("not run");
  AttentionRows io() { return {q.data(), out.data(), lse.data(), plan->rows()}; }
};

TEST(AttentionCombinerTest, CallsThatArriveTogetherShareOneBackendCall) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kHadamard, SmallQuant());
  const int tokens[4] = {70, 33, 9, 120};
  for (int i = 0; i < 4; ++i) {
    const std::string id = "s" + std::to_string(i);
    ASSERT_TRUE(core.store->Create(kDefaultTenant, m, id, {}).ok());
    ASSERT_TRUE(AppendAll(*core.store, *m, id, 0, tokens[i], AppendKind::kFinalPrefill, i).ok());
  }
  HoldingBackend backend(core.backend.get());
  AttentionCombiner combiner(&backend);
  std::vector<Caller> callers(4);
  for (int i = 0; i < 4; ++i) {
    auto p = AttentionPlan::Create(core.store.get(), &backend, kDefaultTenant, m,
                                   {"s" + std::to_string(i)}, 1 + i % 2);
    ASSERT_TRUE(p.ok());
    callers[i].plan = *std::move(p);
    const size_t n = static_cast<size_t>(callers[i].plan->rows()) * m->q_heads * m->head_dim;
    callers[i].q = kvpool::testing::GaussianValues(n, 50 + i);
    callers[i].out.assign(n, 0.0f);
    callers[i].lse.assign(static_cast<size_t>(callers[i].plan->rows()) * m->q_heads, 0.0f);
  }
  auto run = [&](int i) {
    Caller& c = callers[i];
    absl::StatusOr<absl::Span<const int32_t>> r =
        combiner.Attend(c.plan.get(), 1, c.io(), c.io(), false);
    if (r.ok()) {
      c.tokens = std::vector<int32_t>(r->begin(), r->end());
    } else {
      c.tokens = r.status();
    }
  };
  // Caller 0 runs alone and holds the backend; 1, 2 and 3 arrive meanwhile.
  std::thread first(run, 0);
  while (backend.calls_.load() == 0) std::this_thread::yield();
  std::vector<std::thread> rest;
  for (int i = 1; i < 4; ++i) rest.emplace_back(run, i);
  while (combiner.waiting() < 3) std::this_thread::yield();
  backend.release.Notify();
  first.join();
  for (std::thread& t : rest) t.join();
  EXPECT_EQ(backend.calls_.load(), 2);  // the lone call, then one for the three others
  EXPECT_EQ(combiner.fused_calls(), 1u);
  EXPECT_EQ(combiner.fused_members(), 3u);
  // Each caller's answer is the one its plan gives alone, to the bit.
  for (int i = 0; i < 4; ++i) {
    Caller& c = callers[i];
    ASSERT_TRUE(c.tokens.ok()) << c.tokens.status();
    EXPECT_EQ((*c.tokens)[0], tokens[i]);
    std::vector<float> out(c.out.size()), lse(c.lse.size());
    ASSERT_TRUE(
        c.plan->Attend(1, {c.q.data(), out.data(), lse.data(), c.plan->rows()}, false).ok());
    EXPECT_EQ(std::memcmp(out.data(), c.out.data(), out.size() * 4), 0) << i;
    EXPECT_EQ(std::memcmp(lse.data(), c.lse.data(), lse.size() * 4), 0) << i;
  }
}

TEST(AttentionCombinerTest, AFailingMemberDoesNotFailTheOthers) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kHadamard, SmallQuant());
  ASSERT_TRUE(core.store->Create(kDefaultTenant, m, "ok", {}).ok());
  ASSERT_TRUE(AppendAll(*core.store, *m, "ok", 0, 40, AppendKind::kFinalPrefill, 1).ok());
  HoldingBackend backend(core.backend.get());
  AttentionCombiner combiner(&backend);
  std::vector<Caller> callers(3);
  const char* ids[3] = {"ok", "ok", "missing"};
  for (int i = 0; i < 3; ++i) {
    callers[i].plan =
        *AttentionPlan::Create(core.store.get(), &backend, kDefaultTenant, m, {ids[i]}, 1);
    const size_t n = static_cast<size_t>(m->q_heads) * m->head_dim;
    callers[i].q = kvpool::testing::GaussianValues(n, i);
    callers[i].out.assign(n, 0.0f);
    callers[i].lse.assign(m->q_heads, 0.0f);
  }
  auto run = [&](int i) {
    Caller& c = callers[i];
    auto r = combiner.Attend(c.plan.get(), 0, c.io(), c.io(), false);
    c.tokens =
        r.ok() ? absl::StatusOr<std::vector<int32_t>>(std::vector<int32_t>(r->begin(), r->end()))
               : r.status();
  };
  std::thread first(run, 0);
  while (backend.calls_.load() == 0) std::this_thread::yield();
  std::thread b(run, 1), c(run, 2);
  while (combiner.waiting() < 2) std::this_thread::yield();
  backend.release.Notify();
  first.join();
  b.join();
  c.join();
  EXPECT_TRUE(callers[0].tokens.ok());
  EXPECT_TRUE(callers[1].tokens.ok());
  EXPECT_TRUE(absl::IsNotFound(callers[2].tokens.status()));
}

}  // namespace
}  // namespace kvpool::server
