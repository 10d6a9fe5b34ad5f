// Page checksums end to end inside the core: appends record them, reads and the scrubber verify
// them, a flipped bit makes exactly its sequence answer DATA_LOSS (CORRUPT) until released.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "proto/status.h"
#include "server/page_verifier.h"
#include "server/scrubber.h"
#include "server/sequence_store.h"
#include "server/server_test_util.h"

namespace kvpool::server {
namespace {

using testing::AppendAll;
using testing::SmallQuant;
using testing::TestCore;

// Every page of the sequence's snapshot (all layers).
std::vector<PageToVerify> PagesOf(SequenceStore& store, const std::string& id) {
  auto snap = store.Snapshot(kDefaultTenant, id, {});
  EXPECT_TRUE(snap.ok()) << snap.status();
  return snap.ok() ? (*snap)->AllPages() : std::vector<PageToVerify>{};
}

// Prefill in uneven chunks, then decode steps one token at a time (demotions included):
// the running checksums the appends recorded equal a fresh computation over every page.
TEST(IntegrityTest, AppendsRecordTheChecksumOfEveryWrittenSlot) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kHadamard, SmallQuant());
  ASSERT_TRUE(core.store->Create(kDefaultTenant, m, "s", {}).ok());
  ASSERT_TRUE(AppendAll(*core.store, *m, "s", 0, 45, AppendKind::kFinalPrefill, 1, 7).ok());
  for (int step = 0; step < 21; ++step) {
    ASSERT_TRUE(
        AppendAll(*core.store, *m, "s", 45 + step, 1, AppendKind::kDecode, 100 + step).ok());
  }
  auto snap = core.store->Snapshot(kDefaultTenant, "s", {});
  ASSERT_TRUE(snap.ok());
  const std::vector<PageToVerify> pages = (*snap)->AllPages();
  ASSERT_FALSE(pages.empty());
  int written = 0;
  for (const PageToVerify& p : pages) {
    const PageChecksum c = core.pool->Checksum(p.page);
    EXPECT_FALSE(c.empty());
    written += c.count();
  }
  // Slots written per layer: sink + history + every recent slot still held (demoted ones
  // included: their rows stay in the page).
  const int per_layer =
      (*snap)->sink() + (*snap)->history() + (*snap)->recent_head() + (*snap)->recent();
  EXPECT_EQ(written, per_layer * m->num_layers);
  EXPECT_TRUE(VerifyPages(core.backend.get(), *core.pool, *m, pages).ok());
  EXPECT_EQ(0u, core.store->integrity().corrupt_sequences.load());
}

class CorruptionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    m_ = core_.AddModel("m", RotationKind::kHadamard, SmallQuant());
    for (const char* id : {"a", "b"}) {
      ASSERT_TRUE(core_.store->Create(kDefaultTenant, m_, id, {}).ok());
      ASSERT_TRUE(AppendAll(*core_.store, *m_, id, 0, 60, AppendKind::kFinalPrefill, 3).ok());
    }
  }

  // Flips one bit inside the written rows of history block 0 of layer 1 of `id`.
  void FlipHistoryBit(const std::string& id) {
    auto snap = core_.store->Snapshot(kDefaultTenant, id, {1});
    ASSERT_TRUE(snap.ok()) << snap.status();
    const PageId page = core_.pool->PageOfBlock((*snap)->layers()[0].history.at(0));
    core_.pool->Data(page)[m_->block_layout.CodesOffset(KvTensor::kValue, 1) + 3] ^= 0x10;
  }

  absl::Status ReadAll(const std::string& id) {
    auto snap = core_.store->Snapshot(kDefaultTenant, id, {});
    if (!snap.ok()) return snap.status();
    const int n = (*snap)->total();
    std::vector<float> k(n * m_->row_values()), v(n * m_->row_values());
    for (size_t l = 0; l < (*snap)->layers().size(); ++l) {
      absl::Status s =
          (*snap)->ReadRotated(core_.backend.get(), l, 0, n, absl::MakeSpan(k), absl::MakeSpan(v));
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }

  static void ExpectCorrupt(const absl::Status& s) {
    EXPECT_EQ(absl::StatusCode::kDataLoss, s.code()) << s;
    EXPECT_EQ(ErrorReason::kCorrupt, ReasonOf(s)) << s;
  }

  TestCore core_;
  std::shared_ptr<const Model> m_;
};

TEST_F(CorruptionTest, ReadOfAFlippedBitFailsThatSequenceOnlyUntilReleased) {
  EXPECT_TRUE(ReadAll("a").ok());
  FlipHistoryBit("a");
  ExpectCorrupt(ReadAll("a"));
  EXPECT_EQ(1u, core_.store->integrity().corrupt_sequences.load());
  // From now on every data call on "a" answers the same, without reading.
  ExpectCorrupt(core_.store->Snapshot(kDefaultTenant, "a", {}).status());
  ExpectCorrupt(
      core_.store->BeginAppend(kDefaultTenant, "a", {60, 1, AppendKind::kDecode, {}}).status());
  ExpectCorrupt(ReadAll("a"));
  EXPECT_EQ(1u, core_.store->integrity().corrupt_sequences.load());  // once per sequence
  EXPECT_TRUE(ReadAll("b").ok());
  EXPECT_TRUE(core_.store->Describe(kDefaultTenant, "a").ok());  // metadata stays readable
  ASSERT_TRUE(core_.store->Release(kDefaultTenant, "a").ok());
  ASSERT_TRUE(core_.store->Create(kDefaultTenant, m_, "a", {}).ok());
  ASSERT_TRUE(AppendAll(*core_.store, *m_, "a", 0, 60, AppendKind::kFinalPrefill, 3).ok());
  EXPECT_TRUE(ReadAll("a").ok());
  EXPECT_EQ(1u, core_.store->integrity().corrupt_sequences.load());
}

TEST_F(CorruptionTest, ScrubberFindsAFlippedBitAndCountsExactly) {
  Scrubber scrubber(core_.store.get(), core_.backend.get(), core_.pool.get(),
                    {absl::Milliseconds(1), 0});
  const size_t pages_a = PagesOf(*core_.store, "a").size();
  const size_t pages_b = PagesOf(*core_.store, "b").size();
  IntegrityCounters& c = core_.store->integrity();
  ASSERT_TRUE(scrubber.SweepOnce());
  EXPECT_EQ(1u, c.sweeps_completed.load());
  EXPECT_EQ(pages_a + pages_b, c.pages_scrubbed.load());
  EXPECT_EQ(0u, c.corrupt_sequences.load());

  FlipHistoryBit("a");
  ASSERT_TRUE(scrubber.SweepOnce());
  EXPECT_EQ(1u, c.corrupt_sequences.load());
  ExpectCorrupt(ReadAll("a"));
  EXPECT_TRUE(ReadAll("b").ok());
  // Later sweeps skip the corrupt sequence: exactly b's pages each.
  const uint64_t before = c.pages_scrubbed.load();
  ASSERT_TRUE(scrubber.SweepOnce());
  EXPECT_EQ(before + pages_b, c.pages_scrubbed.load());
  EXPECT_EQ(3u, c.sweeps_completed.load());
  EXPECT_EQ(1u, c.corrupt_sequences.load());

  ASSERT_TRUE(core_.store->Release(kDefaultTenant, "a").ok());
  ASSERT_TRUE(scrubber.SweepOnce());
  EXPECT_EQ(before + 2 * pages_b, c.pages_scrubbed.load());
}

// Creates sequence `id` and appends 48 tokens with token ids (5, 6, ...), so that its blocks
// enter the prefix cache; answers the ids.
std::vector<uint32_t> PrefillWithTokenIds(TestCore& core, const std::shared_ptr<const Model>& m,
                                          const std::string& id) {
  std::vector<uint32_t> ids(48);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<uint32_t>(i + 5);
  EXPECT_TRUE(core.store->Create(kDefaultTenant, m, id, {}).ok());
  EXPECT_TRUE(AppendAll(*core.store, *m, id, 0, 48, AppendKind::kPrefill, 9, 1 << 30, ids).ok());
  return ids;
}

// Pages shared through the prefix cache are read once per sweep.
TEST(IntegrityTest, ScrubberReadsSharedPagesOncePerSweep) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kHadamard, SmallQuant());
  const std::vector<uint32_t> ids = PrefillWithTokenIds(core, m, "p");
  auto created = core.store->Create(kDefaultTenant, m, "q", ids);
  ASSERT_TRUE(created.ok()) << created.status();
  ASSERT_GT(created->first.reused_tokens, 0);
  std::vector<PageId> distinct;
  for (const char* id : {"p", "q"}) {
    for (const PageToVerify& p : PagesOf(*core.store, id)) distinct.push_back(p.page);
  }
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  Scrubber scrubber(core.store.get(), core.backend.get(), core.pool.get(),
                    {absl::Milliseconds(1), 0});
  ASSERT_TRUE(scrubber.SweepOnce());
  EXPECT_EQ(distinct.size(), core.store->integrity().pages_scrubbed.load());
}

// Units only the prefix cache holds (their sequence released) are swept too: a flipped bit in
// one drops it and every unit chained after it, so a later lookup stops before it.
TEST(IntegrityTest, ScrubberDropsACorruptUnitOnlyThePrefixCacheHolds) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kHadamard, SmallQuant());
  const std::vector<uint32_t> ids = PrefillWithTokenIds(core, m, "p");
  ASSERT_TRUE(core.store->Release(kDefaultTenant, "p").ok());
  const PrefixContext ctx = SequenceStore::ContextOf(*m);
  const std::vector<PrefixUnitKey> chain = ComputePrefixChain(ctx, ids);
  const std::vector<PrefixMatch> cached = core.index->Match(ctx, chain, /*take_refs=*/false);
  ASSERT_GE(cached.size(), 3u);  // the sink and at least two blocks
  ASSERT_EQ(PrefixUnitKind::kBlock, cached[1].key.kind);
  size_t cached_pages = 0;
  for (const PrefixMatch& u : cached) cached_pages += u.pages.size();

  Scrubber scrubber(core.store.get(), core.backend.get(), core.pool.get(),
                    {absl::Milliseconds(1), 0}, core.index.get(), core.registry.get());
  IntegrityCounters& c = core.store->integrity();
  ASSERT_TRUE(scrubber.SweepOnce());
  EXPECT_EQ(cached_pages, c.pages_scrubbed.load());
  EXPECT_EQ(0u, c.corrupt_prefix_units.load());

  // The first history block of layer 1: a written row of its V codes.
  const PageId page = cached[1].pages.at(1);
  core.pool->Data(page)[m->block_layout.CodesOffset(KvTensor::kValue, 1) + 3] ^= 0x10;
  const size_t used = core.pool->used_bytes();
  ASSERT_TRUE(scrubber.SweepOnce());
  EXPECT_EQ(1u, c.corrupt_prefix_units.load());
  EXPECT_EQ(cached.size() - 1, c.prefix_units_dropped.load());
  EXPECT_EQ(0u, c.corrupt_sequences.load());
  EXPECT_EQ(1u, core.index->Stats().units);
  EXPECT_LT(core.pool->used_bytes(), used);  // the dropped units' pages are free
  EXPECT_EQ(1u, core.index->Match(ctx, chain, /*take_refs=*/false).size());
  // A new sequence from the same tokens reuses the sink only.
  auto created = core.store->Create(kDefaultTenant, m, "q", ids);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(cached[0].key.token_count, created->first.reused_tokens);

  // Nothing corrupt is left: the next sweep reads the sink once (q shares it) and finds nothing.
  const uint64_t before = c.pages_scrubbed.load();
  ASSERT_TRUE(scrubber.SweepOnce());
  EXPECT_EQ(before + cached[0].pages.size(), c.pages_scrubbed.load());
  EXPECT_EQ(1u, c.corrupt_prefix_units.load());
}

}  // namespace
}  // namespace kvpool::server
