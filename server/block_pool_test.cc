#include "server/block_pool.h"

#include <algorithm>
#include <set>
#include <thread>

#include "gtest/gtest.h"
#include "proto/status.h"
#include "server/cpu_backend.h"

namespace kvpool::server {
namespace {

constexpr size_t kSlab = 64 * 1024;

std::unique_ptr<BlockPool> MakePool(size_t slabs) {
  auto arena = NewHostArena(slabs * kSlab);
  EXPECT_TRUE(arena.ok());
  auto pool = BlockPool::Create(*std::move(arena), kSlab);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return *std::move(pool);
}

TEST(BlockPoolTest, RejectsBadGeometry) {
  EXPECT_FALSE(BlockPool::Create(*NewHostArena(1024), kSlab).ok());  // smaller than a slab
  EXPECT_FALSE(BlockPool::Create(*NewHostArena(kSlab), 100).ok());   // not a multiple of 64
  auto pool = MakePool(2);
  EXPECT_FALSE(pool->RegisterClass(0).ok());
  EXPECT_FALSE(pool->RegisterClass(24).ok());          // not 16-aligned
  EXPECT_FALSE(pool->RegisterClass(kSlab + 16).ok());  // larger than a slab
}

// Checksum records: empty for a fresh page, kept while it lives, empty again when the page is
// handed out anew, including after its slab moved to a class with more pages per slab.
TEST(BlockPoolTest, ChecksumRecordsLiveWithTheirPage) {
  auto pool = MakePool(1);
  const PageClassId big = *pool->RegisterClass(kSlab / 4);
  const PageClassId small = *pool->RegisterClass(kSlab / 64);
  std::vector<PageId> pages;
  ASSERT_TRUE(pool->Allocate(big, 4, &pages).ok());
  for (PageId p : pages) {
    EXPECT_TRUE(pool->Checksum(p).empty());
    EXPECT_EQ(p, pool->PageOf(pool->Data(p)));
    EXPECT_EQ(p, pool->PageOf(pool->Data(p) + kSlab / 4 - 1));
  }
  const PageChecksum c{2, 9, 0xdeadbeef};
  pool->SetChecksum(pages[1], c);
  EXPECT_EQ(c, pool->Checksum(pages[1]));
  EXPECT_TRUE(pool->Checksum(pages[0]).empty());
  pool->UnrefAll(pages);
  pages.clear();
  ASSERT_TRUE(pool->Allocate(small, 64, &pages).ok());  // the slab, now of 64 pages
  for (PageId p : pages) {
    EXPECT_TRUE(pool->Checksum(p).empty());
    EXPECT_EQ(p, pool->PageOf(pool->Data(p)));
  }
  pool->SetChecksum(pages[63], c);
  EXPECT_EQ(c, pool->Checksum(pages[63]));
  pool->UnrefAll(pages);
}

TEST(BlockPoolTest, ClassesOfEqualSizeAreOne) {
  auto pool = MakePool(2);
  EXPECT_EQ(*pool->RegisterClass(1024), *pool->RegisterClass(1024));
  EXPECT_NE(*pool->RegisterClass(1024), *pool->RegisterClass(2048));
}

TEST(BlockPoolTest, AccountsExactlyAndFreesOnLastUnref) {
  auto pool = MakePool(4);
  const PageClassId cls = *pool->RegisterClass(4096);
  std::vector<PageId> pages;
  ASSERT_TRUE(pool->Allocate(cls, 20, &pages).ok());
  ASSERT_EQ(pages.size(), 20u);
  EXPECT_EQ(pool->used_bytes(), 20u * 4096);
  EXPECT_EQ(std::set<PageId>(pages.begin(), pages.end()).size(), 20u);
  // Pages do not overlap and stay inside the arena.
  std::vector<uint8_t*> starts;
  for (PageId p : pages) starts.push_back(pool->Data(p));
  std::sort(starts.begin(), starts.end());
  for (size_t i = 1; i < starts.size(); ++i) EXPECT_GE(starts[i] - starts[i - 1], 4096);
  EXPECT_GE(starts.front(), pool->arena().data());
  EXPECT_LE(starts.back() + 4096, pool->arena().data() + pool->arena().size());

  pool->Ref(pages[0]);
  EXPECT_EQ(pool->RefCount(pages[0]), 2);
  EXPECT_EQ(pool->Unref(pages[0]), 0u);  // still referenced
  EXPECT_EQ(pool->used_bytes(), 20u * 4096);
  EXPECT_EQ(pool->Unref(pages[0]), 4096u);
  EXPECT_EQ(pool->RefCount(pages[0]), 0);
  EXPECT_EQ(pool->used_bytes(), 19u * 4096);
  EXPECT_EQ(pool->UnrefAll(absl::MakeConstSpan(pages).subspan(1)), 19u * 4096);
  const BlockPoolStats st = pool->Stats();
  EXPECT_EQ(st.used_bytes, 0u);
  EXPECT_EQ(st.slabs_in_use, 0u);  // empty slabs go back to the arena
}

TEST(BlockPoolTest, AllocationIsAllOrNothing) {
  auto pool = MakePool(2);  // 2 slabs x 16 pages of 4 KiB
  const PageClassId cls = *pool->RegisterClass(4096);
  std::vector<PageId> pages;
  ASSERT_TRUE(pool->Allocate(cls, 30, &pages).ok());
  const absl::Status s = pool->Allocate(cls, 3, &pages);
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_EQ(pages.size(), 30u);
  EXPECT_EQ(pool->used_bytes(), 30u * 4096);
  ASSERT_TRUE(pool->Allocate(cls, 2, &pages).ok());
  pool->UnrefAll(pages);
  EXPECT_EQ(pool->used_bytes(), 0u);
}

TEST(BlockPoolTest, SlabsMoveBetweenClasses) {
  auto pool = MakePool(2);
  const PageClassId small = *pool->RegisterClass(1024);
  const PageClassId large = *pool->RegisterClass(kSlab);
  std::vector<PageId> a, b;
  ASSERT_TRUE(pool->Allocate(small, 64, &a).ok());  // one whole slab
  ASSERT_TRUE(pool->Allocate(large, 1, &b).ok());   // the other
  EXPECT_TRUE(absl::IsResourceExhausted(pool->Allocate(large, 1, &b)));
  pool->UnrefAll(a);                               // the small class's slab is free again ...
  ASSERT_TRUE(pool->Allocate(large, 1, &b).ok());  // ... and serves the large class
  EXPECT_EQ(pool->used_bytes(), 2 * kSlab);
  pool->UnrefAll(b);
  EXPECT_EQ(pool->used_bytes(), 0u);
}

TEST(BlockPoolTest, SharedBytesCountPagesWithSeveralOwners) {
  auto pool = MakePool(1);
  const PageClassId cls = *pool->RegisterClass(2048);
  std::vector<PageId> pages;
  ASSERT_TRUE(pool->Allocate(cls, 3, &pages).ok());
  pool->Ref(pages[1]);
  EXPECT_EQ(pool->Stats().shared_bytes, 2048u);
  const BlockPool::PageTotals two = pool->Totals({pages[0], pages[1]});
  EXPECT_EQ(two.bytes, 4096u);
  EXPECT_EQ(two.shared_bytes, 2048u);
  EXPECT_EQ(pool->Totals({pages[2]}).shared_bytes, 0u);
  pool->Unref(pages[1]);
  EXPECT_EQ(pool->Stats().shared_bytes, 0u);
  pool->UnrefAll(pages);
}

TEST(BlockPoolTest, ConcurrentAllocateAndFreeKeepExactAccounting) {
  auto pool = MakePool(16);
  const PageClassId a = *pool->RegisterClass(1024);
  const PageClassId b = *pool->RegisterClass(4096);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      const PageClassId cls = t % 2 == 0 ? a : b;
      for (int i = 0; i < 300; ++i) {
        std::vector<PageId> pages;
        if (!pool->Allocate(cls, 1 + (i % 7), &pages).ok()) continue;
        for (PageId p : pages) pool->Data(p)[0] = static_cast<uint8_t>(t);
        pool->RefAll(pages);
        pool->UnrefAll(pages);
        pool->UnrefAll(pages);
      }
    });
  }
  for (auto& th : threads) th.join();
  const BlockPoolStats st = pool->Stats();
  EXPECT_EQ(st.used_bytes, 0u);
  EXPECT_EQ(st.pages_in_use, 0u);
  EXPECT_EQ(st.slabs_in_use, 0u);
}

TEST(BlockPoolTest, BlockIdsAddressPagesThroughTheView) {
  auto pool = MakePool(4);
  EXPECT_EQ(pool->block_stride(), 16);
  const PageClassId small = *pool->RegisterClass(48);
  const PageClassId large = *pool->RegisterClass(4096);
  std::vector<PageId> pages;
  ASSERT_TRUE(pool->Allocate(small, 30, &pages).ok());
  ASSERT_TRUE(pool->Allocate(large, 10, &pages).ok());
  const PagedKvView view = pool->View(BlockLayout{}, ScaleDtype::kFp16);
  EXPECT_EQ(view.pool, pool->arena().data());
  EXPECT_EQ(view.num_blocks, static_cast<int64_t>(pool->arena().size() / 16));
  std::set<int32_t> ids;
  for (PageId p : pages) {
    const int32_t id = pool->BlockId(p);
    EXPECT_GE(id, 0);
    EXPECT_LT(id, view.num_blocks);
    EXPECT_EQ(view.Block(id), pool->Data(p));
    ids.insert(id);
  }
  EXPECT_EQ(ids.size(), pages.size());
}

TEST(BlockPoolTest, ArenaBeyond32GiBWidensTheBlockStride) {
  // 40 GiB of address space; no page is ever touched.
  constexpr size_t kArena = size_t{40} << 30, kBigSlab = size_t{4} << 20;
  auto arena = NewHostArena(kArena);
  if (!arena.ok()) GTEST_SKIP() << "no 40 GiB of address space: " << arena.status();
  auto pool = BlockPool::Create(*std::move(arena), kBigSlab);
  ASSERT_TRUE(pool.ok()) << pool.status();
  BlockPool& p = **pool;
  EXPECT_EQ(p.block_stride(), 32);
  const PageClassId odd = *p.RegisterClass(48);
  EXPECT_EQ(p.ClassPageBytes(odd), 64u);  // rounded up to whole block ids
  // Every slab, so that the last pages lie beyond 32 GiB (past int32 ids of 16 bytes).
  const PageClassId slab = *p.RegisterClass(kBigSlab);
  std::vector<PageId> pages;
  ASSERT_TRUE(p.Allocate(slab, kArena / kBigSlab - 1, &pages).ok());
  ASSERT_TRUE(p.Allocate(odd, 3, &pages).ok());
  const PagedKvView view = p.View(BlockLayout{}, ScaleDtype::kFp16);
  for (PageId page : {pages.front(), pages[pages.size() - 4], pages.back()}) {
    const int32_t id = p.BlockId(page);
    EXPECT_GE(id, 0);
    EXPECT_LT(id, view.num_blocks);
    EXPECT_EQ(view.Block(id), p.Data(page));
  }
  EXPECT_GT(p.Data(pages[pages.size() - 4]) - p.arena().data(), int64_t{32} << 30);
}

TEST(BlockPoolTest, AllocateReleasingReleasesOnlyWhatMakesRoomAcrossClasses) {
  auto pool = MakePool(3);
  const PageClassId small = *pool->RegisterClass(16 * 1024);  // 4 per slab
  const PageClassId large = *pool->RegisterClass(32 * 1024);  // 2 per slab
  // Slab 0: small pages, two of them group `a`; slab 1: group `c`'s two large pages; slab 2: a
  // live owner's small pages. Nothing is free.
  std::vector<PageId> slab0, c, live;
  ASSERT_TRUE(pool->Allocate(small, 4, &slab0).ok());
  ASSERT_TRUE(pool->Allocate(large, 2, &c).ok());
  ASSERT_TRUE(pool->Allocate(small, 4, &live).ok());
  const std::vector<PageId> a(slab0.begin(), slab0.begin() + 2);
  const size_t used = pool->used_bytes();

  // One large page: nothing is free; releasing `a` would free two small slots but no whole
  // slab, so it does not help; releasing `c` frees a whole slab. Only `c` is released.
  const absl::Span<const PageId> groups[2] = {a, c};
  const PageRequest one_large[1] = {{large, 1}};
  std::vector<std::vector<PageId>> out;
  absl::StatusOr<std::vector<size_t>> released =
      pool->AllocateReleasing(kDefaultAccount, one_large, groups, &out);
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_EQ(*released, (std::vector<size_t>{1}));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].size(), 1u);
  EXPECT_EQ(pool->RefCount(a[0]), 1);
  EXPECT_EQ(pool->RefCount(a[1]), 1);
  EXPECT_EQ(pool->used_bytes(), used - 2 * 32 * 1024 + 32 * 1024);

  // Two small pages: `a`'s slots are what makes room for them now.
  const PageRequest two_small[1] = {{small, 2}};
  const absl::Span<const PageId> only_a[1] = {a};
  released = pool->AllocateReleasing(kDefaultAccount, two_small, only_a, &out);
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_EQ(*released, (std::vector<size_t>{0}));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(std::set<PageId>(out[0].begin(), out[0].end()), std::set<PageId>(a.begin(), a.end()));
  EXPECT_EQ(pool->used_bytes(), used - 32 * 1024);

  // Nothing to release when the request fits.
  const PageRequest one_more_large[1] = {{large, 1}};
  released = pool->AllocateReleasing(kDefaultAccount, one_more_large, {}, &out);
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_TRUE(released->empty());
}

// Groups earlier in the order that do not help the request stay: a group whose pages someone
// else also holds (it frees nothing), one whose freed pages stay in a used slab of another class,
// and one made unnecessary by a later group that frees a whole slab. A refused request changes
// nothing.
TEST(BlockPoolTest, AllocateReleasingKeepsGroupsThatDoNotHelp) {
  auto pool = MakePool(4);
  const PageClassId small = *pool->RegisterClass(16 * 1024);  // 4 per slab
  const PageClassId large = *pool->RegisterClass(32 * 1024);  // 2 per slab
  std::vector<PageId> slab0, slab1, slab2, slab3;
  ASSERT_TRUE(pool->Allocate(small, 4, &slab0).ok());
  ASSERT_TRUE(pool->Allocate(small, 4, &slab1).ok());
  ASSERT_TRUE(pool->Allocate(large, 2, &slab2).ok());
  ASSERT_TRUE(pool->Allocate(large, 2, &slab3).ok());
  const std::vector<PageId> shared = {slab0[0]};
  pool->Ref(slab0[0]);                                           // also held elsewhere
  const std::vector<PageId> other_class = {slab1[0], slab1[1]};  // slab 1 stays in use
  const std::vector<PageId> half_large = {slab3[0]};             // frees one large slot
  const std::vector<PageId> whole_slab = slab2;                  // frees slab 2
  const absl::Span<const PageId> groups[4] = {shared, other_class, half_large, whole_slab};
  const size_t used = pool->used_bytes();

  // Four large pages cannot fit even after every group: refused, nothing released.
  const PageRequest four_large[1] = {{large, 4}};
  std::vector<std::vector<PageId>> out;
  absl::StatusOr<std::vector<size_t>> released =
      pool->AllocateReleasing(kDefaultAccount, four_large, groups, &out);
  EXPECT_TRUE(absl::IsResourceExhausted(released.status())) << released.status();
  EXPECT_EQ(pool->used_bytes(), used);
  for (const std::vector<PageId>* g : {&other_class, &half_large, &whole_slab}) {
    for (PageId p : *g) EXPECT_EQ(pool->RefCount(p), 1);
  }
  EXPECT_EQ(pool->RefCount(slab0[0]), 2);

  // Two large pages: the whole slab of the last group is all they need.
  const PageRequest two_large[1] = {{large, 2}};
  released = pool->AllocateReleasing(kDefaultAccount, two_large, groups, &out);
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_EQ(*released, (std::vector<size_t>{3}));
  EXPECT_EQ(pool->used_bytes(), used);  // two large pages out, two in
  EXPECT_EQ(pool->RefCount(slab0[0]), 2);
  for (PageId p : other_class) EXPECT_EQ(pool->RefCount(p), 1);
  EXPECT_EQ(pool->RefCount(slab3[0]), 1);
}

TEST(BlockPoolTest, AllocateReleasingRefusesWithoutReleasingWhenGroupsCannotMakeRoom) {
  auto pool = MakePool(2);
  const PageClassId cls = *pool->RegisterClass(16 * 1024);
  std::vector<PageId> group, live;
  ASSERT_TRUE(pool->Allocate(cls, 4, &group).ok());
  ASSERT_TRUE(pool->Allocate(cls, 4, &live).ok());
  pool->Ref(group[0]);  // someone else also holds one page: the group cannot free its slab
  const size_t used = pool->used_bytes();
  const absl::Span<const PageId> groups[1] = {group};
  const PageRequest requests[2] = {{cls, 2}, {cls, 2}};
  std::vector<std::vector<PageId>> out;
  absl::StatusOr<std::vector<size_t>> released =
      pool->AllocateReleasing(kDefaultAccount, requests, groups, &out);
  EXPECT_TRUE(absl::IsResourceExhausted(released.status())) << released.status();
  EXPECT_EQ(pool->used_bytes(), used);
  EXPECT_EQ(pool->RefCount(group[1]), 1);
  EXPECT_EQ(pool->RefCount(group[0]), 2);
  // Three pages fit once the group's three sole-owned pages go.
  const PageRequest three[2] = {{cls, 1}, {cls, 2}};
  released = pool->AllocateReleasing(kDefaultAccount, three, groups, &out);
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_EQ(*released, std::vector<size_t>{0});
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].size(), 1u);
  EXPECT_EQ(out[1].size(), 2u);
  EXPECT_EQ(pool->RefCount(group[0]), 1);
}

// Accounts, quotas and guaranteed shares (16 KiB pages, 4 per 64 KiB slab).
constexpr size_t kPage = 16 * 1024;

// Allocates `count` pages of `cls` for `account` with no groups to release.
absl::StatusOr<std::vector<PageId>> Charge(BlockPool* pool, AccountId account, PageClassId cls,
                                           size_t count, PageTier tier = PageTier::kBf16) {
  const PageRequest r[1] = {{cls, count, tier}};
  std::vector<std::vector<PageId>> out;
  absl::StatusOr<std::vector<size_t>> released = pool->AllocateReleasing(account, r, {}, &out);
  if (!released.ok()) return released.status();
  return out[0];
}

TEST(BlockPoolAccountsTest, ChargesEachPageToItsAllocatorByTierUntilFreed) {
  auto pool = MakePool(4);
  const PageClassId cls = *pool->RegisterClass(kPage);
  const AccountId a = *pool->Account("a");
  EXPECT_EQ(*pool->Account("a"), a);
  EXPECT_NE(a, kDefaultAccount);
  std::vector<PageId> bf16 = *Charge(pool.get(), a, cls, 3, PageTier::kBf16);
  std::vector<PageId> int2 = *Charge(pool.get(), a, cls, 2, PageTier::kInt2);
  EXPECT_EQ(pool->UsageOf("a").tier_bytes[0], 3 * kPage);
  EXPECT_EQ(pool->UsageOf("a").tier_bytes[1], 2 * kPage);
  EXPECT_EQ(pool->OwnerOf(bf16[0]), a);
  // A second reference (a shared prefix page) charges nothing more; the last one frees it.
  pool->Ref(int2[0]);
  EXPECT_EQ(pool->UsageOf("a").bytes(), 5 * kPage);
  pool->Unref(int2[0]);
  EXPECT_EQ(pool->UsageOf("a").bytes(), 5 * kPage);
  pool->UnrefAll(int2);
  pool->Unref(bf16[0]);
  EXPECT_EQ(pool->UsageOf("a").tier_bytes[0], 2 * kPage);
  EXPECT_EQ(pool->UsageOf("a").tier_bytes[1], 0u);
  EXPECT_EQ(pool->UsageOf("nobody").bytes(), 0u);
  EXPECT_EQ(pool->UsageOf(kDefaultTenant).bytes(), 0u);
}

TEST(BlockPoolAccountsTest, LimitRefusesWithQuotaReasonAndChangesNothing) {
  auto pool = MakePool(4);
  const PageClassId cls = *pool->RegisterClass(kPage);
  const AccountId a = *pool->Account("a");
  ASSERT_TRUE(pool->SetAccountLimits({{"a", {3 * kPage, 0}}}).ok());
  ASSERT_TRUE(Charge(pool.get(), a, cls, 2).ok());
  const size_t used = pool->used_bytes();
  absl::StatusOr<std::vector<PageId>> over = Charge(pool.get(), a, cls, 2);
  ASSERT_TRUE(absl::IsResourceExhausted(over.status())) << over.status();
  EXPECT_EQ(ReasonOf(over.status()), ErrorReason::kQuota);
  EXPECT_NE(over.status().message().find("quota 49152, usage 32768, request 32768"),
            absl::string_view::npos)
      << over.status();
  EXPECT_EQ(ReasonMetadata(over.status())["quota"], "pool_bytes");
  EXPECT_EQ(pool->used_bytes(), used);
  EXPECT_EQ(pool->UsageOf("a").bytes(), 2 * kPage);
  // Exactly up to the limit is fine; other accounts are not limited by it.
  ASSERT_TRUE(Charge(pool.get(), a, cls, 1).ok());
  ASSERT_TRUE(Charge(pool.get(), kDefaultAccount, cls, 5).ok());
  EXPECT_EQ(pool->UsageOf("a").bytes(), 3 * kPage);
}

TEST(BlockPoolAccountsTest, LoweredLimitRefusesNewPagesAndKeepsAccountingExact) {
  auto pool = MakePool(4);
  const PageClassId cls = *pool->RegisterClass(kPage);
  const AccountId a = *pool->Account("a");
  std::vector<PageId> held = *Charge(pool.get(), a, cls, 4);
  ASSERT_TRUE(pool->SetAccountLimits({{"a", {2 * kPage, 0}}}).ok());
  EXPECT_EQ(ReasonOf(Charge(pool.get(), a, cls, 1).status()), ErrorReason::kQuota);
  EXPECT_EQ(pool->UsageOf("a").bytes(), 4 * kPage);
  EXPECT_EQ(pool->UsageOf("a").limits.max_bytes, 2 * kPage);
  pool->UnrefAll(absl::MakeConstSpan(held).subspan(0, 3));
  EXPECT_EQ(pool->UsageOf("a").bytes(), kPage);
  ASSERT_TRUE(Charge(pool.get(), a, cls, 1).ok());
  // A reload without "a": no limit of its own again.
  ASSERT_TRUE(pool->SetAccountLimits({}).ok());
  EXPECT_EQ(pool->UsageOf("a").limits.max_bytes, 0u);
  ASSERT_TRUE(Charge(pool.get(), a, cls, 3).ok());
  EXPECT_EQ(pool->UsageOf("a").bytes(), 5 * kPage);
}

TEST(BlockPoolAccountsTest, OverItsLimitAnAccountReleasesOnlyItsOwnGroups) {
  auto pool = MakePool(4);
  const PageClassId cls = *pool->RegisterClass(kPage);
  const AccountId a = *pool->Account("a");
  const AccountId b = *pool->Account("b");
  const std::vector<PageId> a_cached = *Charge(pool.get(), a, cls, 1);
  const std::vector<PageId> a_live = *Charge(pool.get(), a, cls, 1);
  const std::vector<PageId> b_cached = *Charge(pool.get(), b, cls, 1);
  ASSERT_TRUE(pool->SetAccountLimits({{"a", {2 * kPage, 0}}}).ok());
  // The pool has room; only a's limit is short: b's group is passed over, a's own released.
  const absl::Span<const PageId> groups[2] = {b_cached, a_cached};
  const PageRequest one[1] = {{cls, 1}};
  std::vector<std::vector<PageId>> out;
  absl::StatusOr<std::vector<size_t>> released = pool->AllocateReleasing(a, one, groups, &out);
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_EQ(*released, std::vector<size_t>{1});
  EXPECT_EQ(pool->RefCount(b_cached[0]), 1);
  EXPECT_EQ(pool->RefCount(a_live[0]), 1);
  EXPECT_EQ(pool->used_bytes(), 3 * kPage);
  EXPECT_EQ(pool->UsageOf("a").bytes(), 2 * kPage);
  EXPECT_EQ(pool->UsageOf("b").bytes(), kPage);
  // With nothing of its own left to release: QUOTA, b's group untouched.
  const absl::Span<const PageId> only_b[1] = {b_cached};
  released = pool->AllocateReleasing(a, one, only_b, &out);
  EXPECT_EQ(ReasonOf(released.status()), ErrorReason::kQuota) << released.status();
  EXPECT_EQ(pool->RefCount(b_cached[0]), 1);
  EXPECT_EQ(pool->UsageOf("a").bytes(), 2 * kPage);
}

TEST(BlockPoolAccountsTest, ReleasesOnAnothersBehalfStopAtItsGuarantee) {
  auto pool = MakePool(2);  // 8 pages
  const PageClassId cls = *pool->RegisterClass(kPage);
  const AccountId a = *pool->Account("a");
  const AccountId b = *pool->Account("b");
  ASSERT_TRUE(pool->SetAccountLimits({{"b", {0, 3 * kPage}}}).ok());
  // b fills slab 0 with four cached pages (one group each), a fills slab 1 with live pages.
  std::vector<std::vector<PageId>> b_units;
  for (int i = 0; i < 4; ++i) b_units.push_back(*Charge(pool.get(), b, cls, 1));
  ASSERT_TRUE(Charge(pool.get(), a, cls, 4).ok());
  std::vector<absl::Span<const PageId>> groups(b_units.begin(), b_units.end());
  const PageRequest one[1] = {{cls, 1}};
  std::vector<std::vector<PageId>> out;
  // b holds 4 pages over a guarantee of 3: exactly one page may go on a's behalf.
  absl::StatusOr<std::vector<size_t>> released = pool->AllocateReleasing(a, one, groups, &out);
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_EQ(*released, std::vector<size_t>{0});
  EXPECT_EQ(pool->UsageOf("b").bytes(), 3 * kPage);
  EXPECT_EQ(pool->UsageOf("a").bytes(), 5 * kPage);
  // Now b is at its guarantee: a is refused and nothing changes.
  groups.erase(groups.begin());
  const size_t used = pool->used_bytes();
  released = pool->AllocateReleasing(a, one, groups, &out);
  EXPECT_TRUE(absl::IsResourceExhausted(released.status())) << released.status();
  EXPECT_FALSE(ReasonOf(released.status()).has_value());
  EXPECT_EQ(pool->used_bytes(), used);
  EXPECT_EQ(pool->UsageOf("b").bytes(), 3 * kPage);
  // b itself may release its own units below its guarantee.
  released = pool->AllocateReleasing(b, one, groups, &out);
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_EQ(*released, std::vector<size_t>{0});
  EXPECT_EQ(pool->UsageOf("b").bytes(), 3 * kPage);
}

TEST(BlockPoolAccountsTest, UnusedGuaranteesAreHeldForTheirOwners) {
  auto pool = MakePool(4);  // 16 pages
  const PageClassId cls = *pool->RegisterClass(kPage);
  const AccountId a = *pool->Account("a");
  const AccountId b = *pool->Account("b");
  ASSERT_TRUE(pool->SetAccountLimits({{"b", {0, 6 * kPage}}}).ok());
  ASSERT_TRUE(Charge(pool.get(), b, cls, 2).ok());
  // 14 pages free, 4 of them held for b's guarantee: a gets 10, not 11.
  ASSERT_TRUE(Charge(pool.get(), a, cls, 10).ok());
  absl::StatusOr<std::vector<PageId>> more = Charge(pool.get(), a, cls, 1);
  EXPECT_TRUE(absl::IsResourceExhausted(more.status())) << more.status();
  EXPECT_NE(more.status().message().find("65536 held for other tenants' guaranteed shares"),
            absl::string_view::npos)
      << more.status();
  EXPECT_EQ(pool->UsageOf("a").bytes(), 10 * kPage);
  // b reaches its guarantee in the room held for it.
  ASSERT_TRUE(Charge(pool.get(), b, cls, 4).ok());
  EXPECT_EQ(pool->UsageOf("b").bytes(), 6 * kPage);
  EXPECT_EQ(pool->used_bytes(), 16 * kPage);
}

}  // namespace
}  // namespace kvpool::server
