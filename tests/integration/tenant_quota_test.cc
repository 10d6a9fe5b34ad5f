// Tenant quotas against a real kvpoold with a tenants file (issue 19): sixteen clients of three
// token tenants create, append and release sequences at once against their pool-bytes,
// sequences and models quotas. Every refusal is RESOURCE_EXHAUSTED with reason QUOTA naming the
// quota, and the accounting is exact: each tenant's GetStats row shows the refusals its clients
// saw, kind by kind, its pool bytes equal the sum its live sequences report and stay within its
// quota, and an admin sees the three rows, whose pool bytes add up to the pool's used bytes.
// Lowering a quota by a reload refuses new work and keeps what is stored.
//
// Nothing is timed: the reload is awaited by polling GetStats' reload counter.
#include <stdlib.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "proto/status.h"
#include "server/auth/token_hash.h"
#include "tests/integration/integration_util.h"

namespace kvpool::integration {
namespace {

constexpr Shape kShape{/*num_layers=*/2, /*q_heads=*/8, /*kv_heads=*/2, /*head_dim=*/64};
constexpr int kTenants = 3, kClients = 16, kRounds = 10, kTokens = 512;
const char* const kTenantTokens[kTenants] = {"quota-t0-4f2a9c", "quota-t1-8b3d1e",
                                             "quota-t2-c7e6f0"};
constexpr char kAdminToken[] = "quota-admin-19d2";

std::string Hash(const std::string& token) { return server::HexOf(server::Sha256Of(token)); }

// t0: `t0_pool_bytes` of pool; t1: 4 sequences; t2: one model and 3 MiB.
std::string TenantsText(uint64_t t0_pool_bytes) {
  return absl::StrCat(
      "tenant { name: \"t0\" role: ROLE_TENANT token_sha256: \"", Hash(kTenantTokens[0]),
      "\" quota { pool_bytes: ", t0_pool_bytes, " } }\n",
      "tenant { name: \"t1\" role: ROLE_TENANT token_sha256: \"", Hash(kTenantTokens[1]),
      "\" quota { sequences: 4 } }\n", "tenant { name: \"t2\" role: ROLE_TENANT token_sha256: \"",
      Hash(kTenantTokens[2]), "\" quota { models: 1 pool_bytes: 3145728 } }\n",
      "tenant { name: \"ops\" role: ROLE_ADMIN token_sha256: \"", Hash(kAdminToken), "\" }\n");
}

void WriteFile(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
  }
  ASSERT_EQ(std::rename(tmp.c_str(), path.c_str()), 0) << path;
}

std::unique_ptr<KvpoolClient> As(const std::string& target, const std::string& token) {
  client::ClientOptions o;
  o.deadline = absl::Seconds(300);
  o.security.token = token;
  // Sixteen channels connect at once on a loaded machine: a connection attempt that fails
  // transiently must not count as a refusal (the test is about quotas, not connecting).
  o.wait_for_ready = true;
  auto c = KvpoolClient::Connect(target, o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

// Refusals a tenant's clients saw, by quota kind.
struct Seen {
  absl::Mutex mu;
  std::map<std::string, uint64_t> by_kind;
  void Count(const absl::Status& s) {
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    EXPECT_EQ(ReasonOf(s), ErrorReason::kQuota) << s;
    const std::string kind = ReasonMetadata(s)["quota"];
    EXPECT_FALSE(kind.empty()) << s;
    absl::MutexLock lock(&mu);
    ++by_kind[kind];
  }
  uint64_t Of(const std::string& kind) {
    absl::MutexLock lock(&mu);
    return by_kind[kind];
  }
};

TEST(TenantQuotaTest, SixteenClientsOfThreeTenantsKeepExactAccounting) {
  char tmpl[] = "/tmp/kvpool-quota-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const std::string tenants = dir + "/tenants.txtpb";
  WriteFile(tenants, TenantsText(1048576));
  auto d = StartDaemon({"--pool_bytes=67108864", "--slab_bytes=262144", "--worker_threads=2",
                        "--tenants_file=" + tenants, "--tenants_poll_ms=100"});
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string target = (*d)->target();
  std::vector<std::unique_ptr<KvpoolClient>> owners;
  for (int t = 0; t < kTenants; ++t) {
    owners.push_back(As(target, kTenantTokens[t]));
    ASSERT_NE(owners.back(), nullptr);
    ASSERT_TRUE(RegisterDataFree(*owners[t], "m", kShape, v1::ROTATION_KIND_HADAMARD, 1).ok());
  }
  Seen seen[kTenants];
  // t2 may hold one model: a second is refused, and nothing changes.
  seen[2].Count(RegisterDataFree(*owners[2], "m2", kShape, v1::ROTATION_KIND_HADAMARD, 1).status());

  const SequenceKv kv = MakeSequenceKv(kShape, kTokens, 7);
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      const int t = c % kTenants;
      std::unique_ptr<KvpoolClient> me = As(target, kTenantTokens[t]);
      if (me == nullptr) return;
      std::vector<std::string> live;
      for (int round = 0; round < kRounds; ++round) {
        const std::string id = absl::StrCat("c", c, "-", round);
        absl::Status s = me->CreateSequence("m", id).status();
        if (!s.ok()) {
          seen[t].Count(s);
        } else {
          s = AppendSequence(*me, id, kv).status();
          if (!s.ok()) seen[t].Count(s);
          live.push_back(id);  // created: released below whether its append got in or not
        }
        // Keep at most two: the others' refusals come and go with what is held.
        while (live.size() > 2) {
          EXPECT_TRUE(me->ReleaseSequence(live.front()).ok()) << live.front();
          live.erase(live.begin());
        }
      }
    });
  }
  for (std::thread& t : clients) t.join();

  std::unique_ptr<KvpoolClient> admin = As(target, kAdminToken);
  ASSERT_NE(admin, nullptr);
  absl::StatusOr<v1::GetStatsResponse> all = admin->GetStats();
  ASSERT_TRUE(all.ok()) << all.status();
  uint64_t rows_bytes = 0;
  int rows = 0;
  for (const v1::TenantUsage& row : all->tenants()) rows_bytes += row.pool_bytes(), ++rows;
  EXPECT_GE(rows, kTenants);
  EXPECT_EQ(rows_bytes, all->pool().used_bytes()) << "every pool byte is charged to a tenant";

  for (int t = 0; t < kTenants; ++t) {
    SCOPED_TRACE(absl::StrCat("t", t));
    absl::StatusOr<v1::GetStatsResponse> mine = owners[t]->GetStats(/*include_sequences=*/true);
    ASSERT_TRUE(mine.ok()) << mine.status();
    ASSERT_EQ(mine->tenants_size(), 1) << "a tenant sees its own row only";
    const v1::TenantUsage& row = mine->tenants(0);
    EXPECT_EQ(row.tenant(), absl::StrCat("t", t));
    EXPECT_EQ(row.rejected_pool_bytes(), seen[t].Of("pool_bytes"));
    EXPECT_EQ(row.rejected_sequences(), seen[t].Of("sequences"));
    EXPECT_EQ(row.rejected_models(), seen[t].Of("models"));
    uint64_t sequence_bytes = 0;
    for (const v1::SequenceStats& s : mine->sequences()) sequence_bytes += s.pool_bytes();
    EXPECT_EQ(row.pool_bytes(), sequence_bytes);
    EXPECT_EQ(row.sequences(), static_cast<uint64_t>(mine->sequences_size()));
    if (row.quota().pool_bytes() > 0) {
      EXPECT_LE(row.pool_bytes(), row.quota().pool_bytes());
    }
    if (row.quota().sequences() > 0) {
      EXPECT_LE(row.sequences(), row.quota().sequences());
    }
  }
  // Each quota was reached by its tenant's clients (five or six clients a tenant, two live each).
  EXPECT_GT(seen[0].Of("pool_bytes"), 0u);
  EXPECT_GT(seen[1].Of("sequences"), 0u);
  EXPECT_EQ(seen[2].Of("models"), 1u);
  std::printf(
      "refused: t0 pool_bytes %llu, t1 sequences %llu, t2 models %llu pool_bytes %llu; "
      "pool used %llu bytes\n",
      static_cast<unsigned long long>(seen[0].Of("pool_bytes")),
      static_cast<unsigned long long>(seen[1].Of("sequences")),
      static_cast<unsigned long long>(seen[2].Of("models")),
      static_cast<unsigned long long>(seen[2].Of("pool_bytes")),
      static_cast<unsigned long long>(all->pool().used_bytes()));

  // A reload lowering t0's quota under its usage refuses new work and keeps what it holds.
  absl::StatusOr<v1::GetStatsResponse> before = owners[0]->GetStats(true);
  ASSERT_TRUE(before.ok());
  for (const v1::SequenceStats& s : before->sequences()) {
    EXPECT_TRUE(owners[0]->ReleaseSequence(s.sequence_id()).ok()) << s.sequence_id();
  }
  ASSERT_TRUE(owners[0]->CreateSequence("m", "keep").ok());
  ASSERT_TRUE(AppendSequence(*owners[0], "keep", MakeSequenceKv(kShape, 64, 3)).ok());
  const uint64_t reloads = before->security().tenants_reloads();
  WriteFile(tenants, TenantsText(4096));
  const absl::Time give_up = absl::Now() + absl::Minutes(2);
  absl::StatusOr<v1::GetStatsResponse> after = owners[0]->GetStats(true);
  while (after.ok() && after->security().tenants_reloads() == reloads && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(50));
    after = owners[0]->GetStats(true);
  }
  ASSERT_TRUE(after.ok()) << after.status();
  ASSERT_GT(after->security().tenants_reloads(), reloads) << "the reload was not seen";
  EXPECT_EQ(after->tenants(0).quota().pool_bytes(), 4096u);
  EXPECT_GT(after->tenants(0).pool_bytes(), 4096u);
  ASSERT_TRUE(owners[0]->CreateSequence("m", "more").ok());
  const absl::Status refused = AppendSequence(*owners[0], "more", kv).status();
  EXPECT_EQ(ReasonOf(refused), ErrorReason::kQuota) << refused;
  v1::ReadKvRequest read;
  read.set_sequence_id("keep");
  EXPECT_TRUE(owners[0]->ReadKv(read).ok()) << "what t0 stored stays";

  EXPECT_TRUE((*d)->Stop().ok());
  (void)std::system(("rm -rf " + dir).c_str());
}

}  // namespace
}  // namespace kvpool::integration
