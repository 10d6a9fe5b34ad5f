#include "server/prefix_index.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "proto/status.h"
#include "server/cpu_backend.h"

namespace kvpool::server {
namespace {

constexpr size_t kSlab = 64 * 1024;
constexpr size_t kPage = 16 * 1024;  // 4 pages per slab

// A pool of `slabs` slabs, an index over it, and units that each own one whole slab.
struct Cache {
  explicit Cache(size_t slabs) {
    auto p = BlockPool::Create(*NewHostArena(slabs * kSlab), kSlab);
    EXPECT_TRUE(p.ok()) << p.status();
    pool = *std::move(p);
    cls = *pool->RegisterClass(kPage);
    index = std::make_unique<PrefixIndex>(pool.get());
  }

  // Publishes unit `index_in_chain` of `tenant`'s chain `name` (its parent is the previous one),
  // holding one slab of pages that only the index references.
  PrefixHash Publish(const TenantId& tenant, const std::string& name, int index_in_chain) {
    PrefixContext ctx;
    ctx.tenant = tenant;
    ctx.model_id = "m";
    ctx.block_tokens = 16;
    PrefixUnitKey key = PrefixUnitRange(ctx, index_in_chain);
    const PrefixHash parent = index_in_chain == 0 ? PrefixHash{} : hashes.at(name).back();
    std::vector<uint32_t> tokens(16);
    for (size_t i = 0; i < tokens.size(); ++i) {
      tokens[i] = static_cast<uint8_t>(name[i % name.size()]) + 256u * index_in_chain;
    }
    key.hash = HashPrefixUnit(ctx, parent, key.kind, tokens);
    // Charged to `tenant`, as a sequence's append would be.
    const PageRequest one_slab[1] = {{cls, 4}};
    std::vector<std::vector<PageId>> out;
    EXPECT_TRUE(index->AllocateEvicting(tenant, one_slab, &out).ok());
    const std::vector<PageId> pages = out.at(0);
    EXPECT_TRUE(index->Publish(ctx, key, parent, pages));
    pool->UnrefAll(pages);  // the index's reference is the only one
    hashes[name].push_back(key.hash);
    return key.hash;
  }

  std::unique_ptr<BlockPool> pool;
  PageClassId cls = 0;
  std::unique_ptr<PrefixIndex> index;
  std::map<std::string, std::vector<PrefixHash>> hashes;
};

TEST(PrefixIndexTest, RefusesWithoutEvictingWhenEvictionCannotMakeRoom) {
  Cache c(4);
  const PrefixHash a = c.Publish("t", "a", 0);
  const PrefixHash b = c.Publish("t", "b", 0);
  std::vector<PageId> live;  // a live sequence's two slabs: never evictable
  ASSERT_TRUE(c.pool->Allocate(c.cls, 8, &live).ok());
  const PrefixIndexStats before = c.index->Stats();
  const size_t used = c.pool->used_bytes();

  // Three slabs' worth: even both cached units would leave it one slab short.
  const PageRequest too_big[1] = {{c.cls, 12}};
  std::vector<std::vector<PageId>> out;
  const absl::Status s = c.index->AllocateEvicting("t", too_big, &out);
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_TRUE(c.index->Contains(a));
  EXPECT_TRUE(c.index->Contains(b));
  EXPECT_EQ(c.index->Stats().units, before.units);
  EXPECT_EQ(c.index->Stats().cached_bytes, before.cached_bytes);
  EXPECT_EQ(c.index->Stats().evicted_units, 0u);
  EXPECT_EQ(c.pool->used_bytes(), used);

  // Two slabs' worth fits after evicting both.
  const PageRequest fits[1] = {{c.cls, 8}};
  ASSERT_TRUE(c.index->AllocateEvicting("t", fits, &out).ok());
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].size(), 8u);
  EXPECT_EQ(c.index->Stats().units, 0u);
  EXPECT_EQ(c.index->Stats().evicted_units, 2u);
}

TEST(PrefixIndexTest, EvictsNothingWhenFreePagesSuffice) {
  Cache c(3);
  const PrefixHash a = c.Publish("t", "a", 0);
  const PageRequest one_slab[1] = {{c.cls, 4}};
  std::vector<std::vector<PageId>> out;
  ASSERT_TRUE(c.index->AllocateEvicting("t", one_slab, &out).ok());
  EXPECT_TRUE(c.index->Contains(a));
  EXPECT_EQ(c.index->Stats().evicted_units, 0u);
}

TEST(PrefixIndexTest, EvictsTheRequestersLeastRecentlyUsedUnitsFirstThenOthers) {
  Cache c(5);
  // Use order (oldest first): other-1, mine-1, other-2, mine-2, other-3.
  const PrefixHash other1 = c.Publish("other", "o1", 0);
  const PrefixHash mine1 = c.Publish("me", "m1", 0);
  const PrefixHash other2 = c.Publish("other", "o2", 0);
  const PrefixHash mine2 = c.Publish("me", "m2", 0);
  const PrefixHash other3 = c.Publish("other", "o3", 0);
  std::vector<std::vector<PageId>> out;

  // One slab: my oldest unit goes, although another tenant's is older.
  const PageRequest one_slab[1] = {{c.cls, 4}};
  ASSERT_TRUE(c.index->AllocateEvicting("me", one_slab, &out).ok());
  EXPECT_FALSE(c.index->Contains(mine1));
  EXPECT_TRUE(c.index->Contains(other1));
  EXPECT_TRUE(c.index->Contains(mine2));

  // Two slabs: my last unit, then the other tenant's least recently used.
  const PageRequest two_slabs[1] = {{c.cls, 8}};
  ASSERT_TRUE(c.index->AllocateEvicting("me", two_slabs, &out).ok());
  EXPECT_FALSE(c.index->Contains(mine2));
  EXPECT_FALSE(c.index->Contains(other1));
  EXPECT_TRUE(c.index->Contains(other2));
  EXPECT_TRUE(c.index->Contains(other3));
  EXPECT_EQ(c.index->Stats().evicted_units, 3u);
}

TEST(PrefixIndexTest, EvictsAChainFromItsLeafAndSkipsUnitsInUse) {
  Cache c(4);
  const PrefixHash root = c.Publish("t", "chain", 0);
  const PrefixHash leaf = c.Publish("t", "chain", 1);
  const PrefixHash lone = c.Publish("t", "lone", 0);
  // A sequence shares the lone unit's pages: not evictable.
  PrefixContext ctx;
  ctx.tenant = "t";
  ctx.model_id = "m";
  ctx.block_tokens = 16;
  PrefixUnitKey key = PrefixUnitRange(ctx, 0);
  key.hash = lone;
  const std::vector<PrefixMatch> held = c.index->Match(ctx, {key}, /*take_refs=*/true);
  ASSERT_EQ(held.size(), 1u);

  // Two slabs beyond the one free: the chain's leaf, then its root (now a leaf).
  const PageRequest three_slabs[1] = {{c.cls, 12}};
  std::vector<std::vector<PageId>> out;
  ASSERT_TRUE(c.index->AllocateEvicting("t", three_slabs, &out).ok());
  EXPECT_FALSE(c.index->Contains(leaf));
  EXPECT_FALSE(c.index->Contains(root));
  EXPECT_TRUE(c.index->Contains(lone));
  c.pool->UnrefAll(held[0].pages);
}

TEST(PrefixIndexTest, NeverEvictsAnotherTenantBelowItsGuaranteedShare) {
  Cache c(4);
  const PrefixHash o1 = c.Publish("other", "o1", 0);
  const PrefixHash o2 = c.Publish("other", "o2", 0);
  const PrefixHash m1 = c.Publish("me", "m1", 0);
  ASSERT_TRUE(c.pool->SetAccountLimits({{"other", {0, kSlab}}}).ok());
  EXPECT_EQ(c.pool->UsageOf("other").bytes(), 2 * kSlab);

  // Three slabs: the free one, my unit, and one of the other tenant's two (down to its share).
  const PageRequest three_slabs[1] = {{c.cls, 12}};
  std::vector<std::vector<PageId>> out;
  ASSERT_TRUE(c.index->AllocateEvicting("me", three_slabs, &out).ok());
  EXPECT_FALSE(c.index->Contains(m1));
  EXPECT_FALSE(c.index->Contains(o1));
  EXPECT_TRUE(c.index->Contains(o2));
  EXPECT_EQ(c.pool->UsageOf("other").bytes(), kSlab);
  EXPECT_EQ(c.pool->UsageOf("me").bytes(), 3 * kSlab);

  // The other tenant is at its guarantee: one more page is refused and nothing is evicted.
  const PageRequest one_page[1] = {{c.cls, 1}};
  const absl::Status s = c.index->AllocateEvicting("me", one_page, &out);
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_TRUE(c.index->Contains(o2));
  EXPECT_EQ(c.index->Stats().evicted_units, 2u);
  EXPECT_EQ(c.pool->used_bytes(), 4 * kSlab);
  // Its owner may still evict it for itself.
  ASSERT_TRUE(c.index->AllocateEvicting("other", one_page, &out).ok());
  EXPECT_FALSE(c.index->Contains(o2));
  EXPECT_EQ(c.pool->UsageOf("other").bytes(), kPage);
}

TEST(PrefixIndexTest, OverItsQuotaATenantEvictsItsOwnUnitsOnly) {
  Cache c(4);
  const PrefixHash m1 = c.Publish("me", "m1", 0);
  const PrefixHash o1 = c.Publish("other", "o1", 0);
  ASSERT_TRUE(c.pool->SetAccountLimits({{"me", {2 * kSlab, 0}}}).ok());
  // Two slabs would fit the pool but not my quota with m1 cached: m1 goes, o1 stays.
  const PageRequest two_slabs[1] = {{c.cls, 8}};
  std::vector<std::vector<PageId>> out;
  ASSERT_TRUE(c.index->AllocateEvicting("me", two_slabs, &out).ok());
  EXPECT_FALSE(c.index->Contains(m1));
  EXPECT_TRUE(c.index->Contains(o1));
  EXPECT_EQ(c.pool->UsageOf("me").bytes(), 2 * kSlab);
  // At the quota with nothing of mine cached: QUOTA, the pool and the cache as they were.
  const PageRequest one_page[1] = {{c.cls, 1}};
  const absl::Status s = c.index->AllocateEvicting("me", one_page, &out);
  EXPECT_EQ(ReasonOf(s), ErrorReason::kQuota) << s;
  EXPECT_NE(s.message().find("quota 131072, usage 131072, request 16384"), absl::string_view::npos)
      << s;
  EXPECT_TRUE(c.index->Contains(o1));
  EXPECT_EQ(c.pool->used_bytes(), 3 * kSlab);
}

}  // namespace
}  // namespace kvpool::server
