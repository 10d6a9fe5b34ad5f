#include "server/admission/tenant_policy.h"

#include <atomic>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "proto/status.h"
#include "server/server_test_util.h"

namespace kvpool::server {
namespace {

using ::kvpool::server::testing::AppendAll;
using ::kvpool::server::testing::BypassQuant;
using ::kvpool::server::testing::SmallQuant;
using ::kvpool::server::testing::TestCore;

v1::TenantQuota Quota(uint64_t pool_bytes, uint64_t sequences = 0, uint64_t models = 0,
                      uint64_t guaranteed = 0, uint32_t weight = 0) {
  v1::TenantQuota q;
  q.set_pool_bytes(pool_bytes);
  q.set_sequences(sequences);
  q.set_models(models);
  q.set_guaranteed_pool_bytes(guaranteed);
  q.set_compute_weight(weight);
  return q;
}

bool Contains(const absl::Status& s, const std::string& text) {
  return s.message().find(text) != absl::string_view::npos;
}

TEST(TenantPolicyTest, RefusesQuotasThatDoNotFitThePoolAndInstallsNothing) {
  TestCore core(size_t{4} << 20);
  TenantPolicy policy(core.pool.get(), &core.quotas, nullptr);
  const size_t capacity = core.pool->capacity_bytes();
  ASSERT_EQ(capacity, size_t{4} << 20);

  absl::Status s = policy.SetTenantQuotas({{"a", Quota(1 << 20, 0, 0, 2 << 20)}});
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_TRUE(Contains(s, "guaranteed_pool_bytes 2097152 exceeds its pool_bytes quota 1048576"))
      << s;

  s = policy.SetTenantQuotas({{"a", Quota(0, 0, 0, 3 << 20)}, {"b", Quota(0, 0, 0, 2 << 20)}});
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_TRUE(Contains(s, "capacity of 4194304 bytes ('a' 3145728, 'b' 2097152)")) << s;

  s = policy.SetTenantQuotas({{"a", Quota(0, 0, 0, 0, TenantPolicy::kMaxComputeWeight + 1)}});
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;

  EXPECT_FALSE(core.quotas.Has("a"));
  EXPECT_EQ(core.pool->UsageOf("a").limits.guaranteed_bytes, 0u);

  // Exactly the capacity in guarantees is fine.
  ASSERT_TRUE(
      policy.SetTenantQuotas({{"a", Quota(0, 0, 0, 3 << 20)}, {"b", Quota(0, 0, 0, 1 << 20)}})
          .ok());
  EXPECT_EQ(core.pool->UsageOf("a").limits.guaranteed_bytes, size_t{3} << 20);
  EXPECT_EQ(core.quotas.Get("b").guaranteed_pool_bytes, uint64_t{1} << 20);
}

TEST(TenantPolicyTest, InstallsATenantsFileByName) {
  TestCore core;
  TenantPolicy policy(core.pool.get(), &core.quotas, nullptr);
  v1::TenantsFile file;
  v1::TenantEntry* a = file.add_tenant();
  a->set_name("a");
  *a->mutable_quota() = Quota(1 << 20, 7, 2, 1 << 19, 4);
  file.add_tenant()->set_name("b");  // no quota message: none of its own
  ASSERT_TRUE(policy.SetTenantQuotasFrom(file).ok());
  EXPECT_EQ(core.quotas.Get("a").sequences, 7u);
  EXPECT_EQ(core.quotas.Get("a").compute_weight, 4u);
  EXPECT_EQ(core.pool->UsageOf("a").limits.max_bytes, size_t{1} << 20);
  EXPECT_EQ(core.pool->UsageOf("a").limits.guaranteed_bytes, size_t{1} << 19);
  EXPECT_TRUE(core.quotas.Has("b"));
  EXPECT_EQ(core.quotas.Get("b").pool_bytes, 0u);
  file.add_tenant()->set_name("a");
  EXPECT_TRUE(absl::IsInvalidArgument(policy.SetTenantQuotasFrom(file)));
  EXPECT_EQ(core.quotas.Get("a").sequences, 7u);
}

TEST(TenantPolicyTest, SequencesQuotaRefusesTheOneTooManyAndReloads) {
  TestCore core;
  TenantPolicy policy(core.pool.get(), &core.quotas, nullptr);
  auto m = core.AddModel("m", RotationKind::kIdentity, BypassQuant(), 2, 4, 2, 32, "a");
  auto d = core.AddModel("m", RotationKind::kIdentity, BypassQuant());
  ASSERT_TRUE(policy.SetTenantQuotas({{"a", Quota(0, 2)}}).ok());
  ASSERT_TRUE(core.store->Create("a", m, "s1", {}).ok());
  ASSERT_TRUE(core.store->Create("a", m, "", {}).ok());  // a daemon-picked id counts the same
  auto third = core.store->Create("a", m, "s3", {});
  ASSERT_FALSE(third.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(third.status())) << third.status();
  EXPECT_EQ(ReasonOf(third.status()), ErrorReason::kQuota);
  EXPECT_TRUE(Contains(third.status(), "over its sequences quota: quota 2, usage 2, request 1"))
      << third.status();
  EXPECT_EQ(core.store->List("a").size(), 2u);
  EXPECT_EQ(core.store->SequencesOf("a"), 2u);
  EXPECT_EQ(core.quotas.Rejections("a").sequences, 1u);
  // Other tenants are not bound by it.
  for (const char* id : {"d1", "d2", "d3"}) ASSERT_TRUE(core.store->Create("", d, id, {}).ok());

  ASSERT_TRUE(core.store->Release("a", "s1").ok());
  EXPECT_EQ(core.store->SequencesOf("a"), 1u);
  ASSERT_TRUE(core.store->Create("a", m, "s3", {}).ok());

  // Lowered below the usage: new sequences are refused, the existing ones stay.
  ASSERT_TRUE(policy.SetTenantQuotas({{"a", Quota(0, 1)}}).ok());
  EXPECT_EQ(ReasonOf(core.store->Create("a", m, "s4", {}).status()), ErrorReason::kQuota);
  EXPECT_EQ(core.store->List("a").size(), 2u);
  // Removed from the table: no quota of its own.
  ASSERT_TRUE(policy.SetTenantQuotas({}).ok());
  ASSERT_TRUE(core.store->Create("a", m, "s4", {}).ok());
  EXPECT_EQ(core.store->SequencesOf("a"), 3u);
}

TEST(TenantPolicyTest, ModelsQuotaRefusesANewModelButNotARegistration) {
  TestCore core;
  TenantPolicy policy(core.pool.get(), &core.quotas, nullptr);
  ASSERT_TRUE(policy.SetTenantQuotas({{"a", Quota(0, 0, 1)}}).ok());
  ASSERT_NE(core.AddModel("m1", RotationKind::kIdentity, BypassQuant(), 2, 4, 2, 32, "a"), nullptr);
  auto registration = [](const std::string& id) {
    ModelRegistration req(*DataFreeCodec(RotationKind::kIdentity, 7, 2, 32, BypassQuant()));
    req.model_id = id;
    req.q_heads = 4;
    req.kv_heads = 2;
    return req;
  };
  // The same model again is no new model.
  absl::StatusOr<RegisterResult> again = core.registry->Register("a", registration("m1"));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->already_registered);
  absl::StatusOr<RegisterResult> second = core.registry->Register("a", registration("m2"));
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(ReasonOf(second.status()), ErrorReason::kQuota);
  EXPECT_TRUE(Contains(second.status(), "over its models quota: quota 1, usage 1, request 1"))
      << second.status();
  EXPECT_EQ(core.registry->CountOf("a"), 1u);
  EXPECT_EQ(core.quotas.Rejections("a").models, 1u);
  ASSERT_TRUE(core.registry->Register("b", registration("m2")).ok());
}

TEST(TenantPolicyTest, PoolBytesQuotaChargesAppendsExactlyByTier) {
  TestCore core;
  TenantPolicy policy(core.pool.get(), &core.quotas, nullptr);
  auto m = core.AddModel("m", RotationKind::kIdentity, SmallQuant(), 2, 4, 2, 32, "a");
  const size_t bf16 = core.pool->ClassPageBytes(m->bf16_class);
  const size_t int2 = core.pool->ClassPageBytes(m->block_class);
  ASSERT_TRUE(core.store->Create("a", m, "s", {}).ok());
  // The sink (8 tokens, one BF16 page per layer) fits exactly.
  ASSERT_TRUE(policy.SetTenantQuotas({{"a", Quota(2 * bf16)}}).ok());
  ASSERT_TRUE(
      AppendAll(*core.store, *m, "s", 0, 8, AppendKind::kPrefill, 1, 1 << 30, {}, "a").ok());
  EXPECT_EQ(core.pool->UsageOf("a").tier_bytes[static_cast<int>(PageTier::kBf16)], 2 * bf16);
  // The next 8 tokens of a non-final prefill go straight into an INT2 block per layer: refused,
  // nothing allocated.
  const size_t used = core.pool->used_bytes();
  absl::Status over =
      AppendAll(*core.store, *m, "s", 8, 8, AppendKind::kPrefill, 2, 1 << 30, {}, "a");
  EXPECT_EQ(ReasonOf(over), ErrorReason::kQuota) << over;
  EXPECT_TRUE(Contains(over, "quota " + std::to_string(2 * bf16) + ", usage " +
                                 std::to_string(2 * bf16) + ", request " +
                                 std::to_string(2 * int2)))
      << over;
  EXPECT_EQ(core.pool->used_bytes(), used);
  EXPECT_EQ(core.store->Describe("a", "s")->total(), 8);
  EXPECT_EQ(core.quotas.Rejections("a").pool_bytes, 1u);

  // Without a quota the prefill goes on into demotion: INT2 blocks are charged as INT2.
  ASSERT_TRUE(policy.SetTenantQuotas({}).ok());
  ASSERT_TRUE(
      AppendAll(*core.store, *m, "s", 8, 40, AppendKind::kFinalPrefill, 3, 1 << 30, {}, "a").ok());
  const StoreTotals totals = core.store->TotalsByModel("a").at("m");
  const AccountUsage usage = core.pool->UsageOf("a");
  EXPECT_EQ(usage.bytes(), totals.pool_bytes);
  EXPECT_EQ(usage.tier_bytes[static_cast<int>(PageTier::kInt2)],
            2 * ((totals.history_tokens + 7) / 8) * int2);
  EXPECT_GT(totals.history_tokens, 0u);

  // A quota at the usage: decode steps go on while they need no new page, and the first that
  // needs one (a demotion into a new INT2 block, or a new recent page) is refused intact.
  ASSERT_TRUE(policy.SetTenantQuotas({{"a", Quota(usage.bytes())}}).ok());
  int length = core.store->Describe("a", "s")->total();
  absl::Status step;
  for (int i = 0; i < 32 && step.ok(); ++i) {
    step =
        AppendAll(*core.store, *m, "s", length, 1, AppendKind::kDecode, 10 + i, 1 << 30, {}, "a");
    if (step.ok()) ++length;
  }
  EXPECT_EQ(ReasonOf(step), ErrorReason::kQuota) << step;
  EXPECT_EQ(core.store->Describe("a", "s")->total(), length);
  EXPECT_EQ(core.pool->UsageOf("a").bytes(), usage.bytes());
  EXPECT_EQ(core.pool->UsageOf("a").bytes(), core.store->TotalsByModel("a").at("m").pool_bytes);
}

TEST(TenantPolicyTest, PrefixSharedPagesAreChargedOnceToTheirTenant) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kIdentity, SmallQuant(), 2, 4, 2, 32, "a");
  std::vector<uint32_t> ids(24);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<uint32_t>(100 + i);
  ASSERT_TRUE(core.store->Create("a", m, "s1", {}).ok());
  ASSERT_TRUE(
      AppendAll(*core.store, *m, "s1", 0, 24, AppendKind::kPrefill, 1, 1 << 30, ids, "a").ok());
  const size_t charged = core.pool->UsageOf("a").bytes();
  ASSERT_GT(charged, 0u);
  // A second sequence starting from the cached prefix shares its pages: no new charge.
  auto s2 = core.store->Create("a", m, "s2", ids);
  ASSERT_TRUE(s2.ok()) << s2.status();
  ASSERT_FALSE(s2->second.empty());
  EXPECT_EQ(core.pool->UsageOf("a").bytes(), charged);
  // Both released: the cached units stay charged to "a" until evicted.
  ASSERT_TRUE(core.store->Release("a", "s1").ok());
  ASSERT_TRUE(core.store->Release("a", "s2").ok());
  EXPECT_GT(core.index->Stats().cached_bytes, 0u);
  EXPECT_EQ(core.pool->UsageOf("a").bytes(), core.index->Stats().cached_bytes);
  EXPECT_EQ(core.pool->UsageOf("").bytes(), 0u);
}

// What the end-to-end test of 16 clients of 3 tenants checks, at the core every transport
// appends through (identities come from the identity work): concurrent creations and appends
// against sequences and pool_bytes quotas; every refusal is QUOTA and counted; afterwards each
// tenant's charge equals its sequences' pages exactly and stays within its quota.
TEST(TenantPolicyTest, SixteenClientsOfThreeTenantsKeepExactAccountingAtTheirQuotas) {
  TestCore core(size_t{16} << 20);
  TenantPolicy policy(core.pool.get(), &core.quotas, nullptr);
  const std::vector<TenantId> tenants = {"a", "b", "c"};
  std::map<TenantId, std::shared_ptr<const Model>> models;
  for (const TenantId& t : tenants) {
    models[t] = core.AddModel("m", RotationKind::kHadamard, SmallQuant(), 2, 4, 2, 32, t);
  }
  const size_t bf16 = core.pool->ClassPageBytes(models["a"]->bf16_class);
  // A 24-token final prefill takes 3 BF16 pages per layer (sink 8, recent 16): 6 pages.
  const size_t per_sequence = 6 * bf16;
  std::map<TenantId, v1::TenantQuota> quotas = {
      {"a", Quota(3 * per_sequence + bf16, 8)},  // pool bytes bind: 3 sequences' worth
      {"b", Quota(0, 3)},                        // sequences bind
      {"c", Quota(5 * per_sequence, 5)}};        // both at once
  ASSERT_TRUE(policy.SetTenantQuotas(quotas).ok());

  struct Seen {
    std::atomic<int> sequences{0}, pool_bytes{0}, other{0};
  };
  std::map<TenantId, Seen> seen;
  for (const TenantId& t : tenants) seen[t];
  std::vector<std::thread> clients;
  for (int c = 0; c < 16; ++c) {
    clients.emplace_back([&, c] {
      const TenantId& t = tenants[c % 3];
      for (int round = 0; round < 6; ++round) {
        const std::string id = "c" + std::to_string(c) + "-" + std::to_string(round);
        auto created = core.store->Create(t, models[t], id, {});
        if (!created.ok()) {
          ++(ReasonOf(created.status()) == ErrorReason::kQuota ? seen[t].sequences : seen[t].other);
          continue;
        }
        absl::Status s = AppendAll(*core.store, *models[t], id, 0, 24, AppendKind::kFinalPrefill,
                                   c * 100 + round, 5, {}, t);
        if (!s.ok()) ++(ReasonOf(s) == ErrorReason::kQuota ? seen[t].pool_bytes : seen[t].other);
        if (!s.ok() || round % 2 == 1) {
          if (!core.store->Release(t, id).ok()) ++seen[t].other;
        }
      }
    });
  }
  for (std::thread& th : clients) th.join();

  size_t charged = 0;
  for (const TenantId& t : tenants) {
    SCOPED_TRACE(t);
    EXPECT_EQ(seen[t].other.load(), 0);
    const QuotaRejections r = core.quotas.Rejections(t);
    EXPECT_EQ(r.sequences, static_cast<uint64_t>(seen[t].sequences.load()));
    EXPECT_EQ(r.pool_bytes, static_cast<uint64_t>(seen[t].pool_bytes.load()));
    const size_t usage = core.pool->UsageOf(t).bytes();
    const auto totals = core.store->TotalsByModel(t);
    EXPECT_EQ(usage, totals.count("m") ? totals.at("m").pool_bytes : 0);
    EXPECT_EQ(usage % per_sequence, 0u);
    if (quotas[t].pool_bytes() > 0) {
      EXPECT_LE(usage, quotas[t].pool_bytes());
    }
    EXPECT_EQ(core.store->SequencesOf(t), core.store->List(t).size());
    EXPECT_LE(core.store->List(t).size(), quotas[t].sequences());
    charged += usage;
  }
  EXPECT_GT(seen["a"].pool_bytes.load(), 0);
  EXPECT_GT(seen["b"].sequences.load(), 0);
  EXPECT_EQ(charged, core.pool->used_bytes());
}

}  // namespace
}  // namespace kvpool::server
