#include "server/sequence_store.h"

#include <atomic>
#include <numeric>
#include <thread>

#include "gtest/gtest.h"
#include "proto/status.h"
#include "server/server_test_util.h"

namespace kvpool::server {
namespace {

using testing::AppendAll;
using testing::BypassQuant;
using testing::SmallQuant;
using testing::TestCore;
using testing::TestRows;

// Expected K (or V) of one layer, appended piece by piece as AppendAll generates them.
struct Expected {
  std::vector<std::vector<Bf16>> k, v;  // per layer
  void Add(const Model& m, int tokens, uint64_t seed) {
    k.resize(m.num_layers);
    v.resize(m.num_layers);
    for (int l = 0; l < m.num_layers; ++l) {
      auto kr = TestRows(tokens, m.row_values(), seed + 2 * l);
      auto vr = TestRows(tokens, m.row_values(), seed + 2 * l + 1);
      k[l].insert(k[l].end(), kr.begin(), kr.end());
      v[l].insert(v[l].end(), vr.begin(), vr.end());
    }
  }
};

std::vector<uint32_t> Iota(int n, uint32_t from = 0) {
  std::vector<uint32_t> ids(n);
  std::iota(ids.begin(), ids.end(), from);
  return ids;
}

// Pages a sequence of this shape must hold (per layer, times layers).
size_t ExpectedBytes(const Model& m, int sink, int history, int recent_pages) {
  const int bt = m.block_tokens();
  const size_t per_layer = ((sink + bt - 1) / bt + recent_pages) * m.bf16_page_bytes +
                           static_cast<size_t>((history + bt - 1) / bt) * m.block_bytes;
  return per_layer * m.num_layers;
}

void ExpectExactReadback(TestCore& core, const Model& m, const std::string& id,
                         const Expected& want, SequenceStore* store = nullptr) {
  auto snap = (store != nullptr ? store : core.store.get())->Snapshot(kDefaultTenant, id, {});
  ASSERT_TRUE(snap.ok()) << snap.status();
  const int n = (*snap)->total();
  const size_t row = m.row_values();
  std::vector<float> k(n * row), v(n * row);
  for (int l = 0; l < m.num_layers; ++l) {
    ASSERT_TRUE((*snap)
                    ->ReadRotated(core.backend.get(), l, 0, n, absl::MakeSpan(k), absl::MakeSpan(v))
                    .ok());
    ASSERT_EQ(want.k[l].size(), k.size());
    for (size_t i = 0; i < k.size(); ++i) {
      ASSERT_EQ(Bf16::FromFloat(k[i]).bits, want.k[l][i].bits) << "layer " << l << " K " << i;
      ASSERT_EQ(Bf16::FromFloat(v[i]).bits, want.v[l][i].bits) << "layer " << l << " V " << i;
    }
  }
}

TEST(SequenceStoreTest, FinalPrefillSplitsTiersAndReadsBackExactly) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kIdentity, BypassQuant());
  ASSERT_TRUE(core.store->Create(kDefaultTenant, m, "s", {}).ok());
  ASSERT_TRUE(AppendAll(*core.store, *m, "s", 0, 100, AppendKind::kFinalPrefill, 1, 30).ok());
  auto info = *core.store->Describe(kDefaultTenant, "s");
  EXPECT_EQ(info.sink, 8);
  EXPECT_EQ(info.recent, 16);
  EXPECT_EQ(info.history, 76);
  EXPECT_EQ(info.state, SequenceState::kDecode);
  // Recent starts on a fresh page: 16 tokens = 2 pages of 8.
  EXPECT_EQ(core.pool->used_bytes(), ExpectedBytes(*m, 8, 76, 2));
  EXPECT_EQ(info.pool_bytes, core.pool->used_bytes());
  Expected want;
  want.Add(*m, 100, 1);
  ExpectExactReadback(core, *m, "s", want);
}

TEST(SequenceStoreTest, DecodeDemotesInBatchesAndKeepsExactData) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kIdentity, BypassQuant());
  ASSERT_TRUE(core.store->Create(kDefaultTenant, m, "s", {}).ok());
  Expected want;
  ASSERT_TRUE(AppendAll(*core.store, *m, "s", 0, 37, AppendKind::kFinalPrefill, 1, 5).ok());
  want.Add(*m, 37, 1);
  int history = 37 - 8 - 16;
  for (int step = 0; step < 40; ++step) {
    const int before = core.store->Describe(kDefaultTenant, "s")->total();
    ASSERT_TRUE(
        AppendAll(*core.store, *m, "s", before, 1, AppendKind::kDecode, 1000 + step * 10).ok());
    want.Add(*m, 1, 1000 + step * 10);
    auto info = *core.store->Describe(kDefaultTenant, "s");
    // W <= recent <= W + B - 1; demotion happens in whole batches of B = 8.
    EXPECT_GE(info.recent, 16);
    EXPECT_LE(info.recent, 16 + 8 - 1);
    if (info.history != history) {
      EXPECT_EQ(info.history, history + 8) << "step " << step;
      EXPECT_EQ(info.recent, 16);
      history = info.history;
    }
    EXPECT_EQ(info.total(), before + 1);
  }
  EXPECT_EQ(history, 13 + 40);  // 5 demotions of 8 = 40 tokens, all in batches
  ExpectExactReadback(core, *m, "s", want);
  // Demoted recent pages were returned: the pool holds exactly the live pages.
  auto info = *core.store->Describe(kDefaultTenant, "s");
  EXPECT_EQ(info.pool_bytes, core.pool->used_bytes());
  ASSERT_TRUE(core.store->Release(kDefaultTenant, "s").ok());
  EXPECT_EQ(core.pool->used_bytes(), 0u);
}

// The CPU backend, counting the DemoteRows calls and their moves.
class DemotionCountingBackend final : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  int calls = 0;
  std::vector<size_t> moves_per_call;
  absl::Status DemoteRows(const Model& m, absl::Span<const RowMove> moves) override {
    ++calls;
    moves_per_call.push_back(moves.size());
    return ForwardingBackend::DemoteRows(m, moves);
  }
};

// A decode step appends a token to every layer; when it demotes, every layer's moves go to the
// backend in one DemoteRows call (one kernel launch on the GPU), and the data stays exact.
TEST(SequenceStoreTest, DecodeDemotesEveryLayerInOneBackendCall) {
  TestCore core;
  const int layers = 5;
  auto m = core.AddModel("m", RotationKind::kIdentity, BypassQuant(), layers);
  DemotionCountingBackend counting(core.backend.get());
  SequenceStore store(core.pool.get(), core.index.get(), &counting);
  ASSERT_TRUE(store.Create(kDefaultTenant, m, "s", {}).ok());
  Expected want;
  ASSERT_TRUE(AppendAll(store, *m, "s", 0, 24, AppendKind::kFinalPrefill, 1).ok());
  want.Add(*m, 24, 1);
  counting.calls = 0;
  counting.moves_per_call.clear();
  for (int step = 0; step < 16; ++step) {  // demotes once every 8 steps (batch 8, window 16)
    ASSERT_TRUE(AppendAll(store, *m, "s", 24 + step, 1, AppendKind::kDecode, 500 + step).ok());
    want.Add(*m, 1, 500 + step);
  }
  // One call per demoting step (2 of the 16), none for the others, each with every layer's moves.
  ASSERT_EQ(counting.calls, 2);
  for (size_t moves : counting.moves_per_call) {
    EXPECT_EQ(moves % layers, 0u) << "every layer's moves in the same call";
    EXPECT_GE(moves, static_cast<size_t>(layers));
  }
  EXPECT_EQ(store.Describe(kDefaultTenant, "s")->history, 24 - 8 - 16 + 16);
  ExpectExactReadback(core, *m, "s", want, &store);
  ASSERT_TRUE(store.Release(kDefaultTenant, "s").ok());
}

TEST(SequenceStoreTest, MultiTokenDecodeEqualsStepByStep) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kIdentity, BypassQuant());
  ASSERT_TRUE(core.store->Create(kDefaultTenant, m, "a", {}).ok());
  ASSERT_TRUE(core.store->Create(kDefaultTenant, m, "b", {}).ok());
  ASSERT_TRUE(AppendAll(*core.store, *m, "a", 0, 30, AppendKind::kFinalPrefill, 1).ok());
  ASSERT_TRUE(AppendAll(*core.store, *m, "b", 0, 30, AppendKind::kFinalPrefill, 1).ok());
  ASSERT_TRUE(AppendAll(*core.store, *m, "a", 30, 21, AppendKind::kDecode, 50).ok());
  Expected want;
  want.Add(*m, 30, 1);
  want.Add(*m, 21, 50);
  ExpectExactReadback(core, *m, "a", want);
  // One token at a time with the same rows gives the same tiers.
  for (int i = 0; i < 21; ++i) {
    AppendSpec spec{30 + i, 1, AppendKind::kDecode, {}};
    auto txn = core.store->BeginAppend(kDefaultTenant, "b", spec);
    ASSERT_TRUE(txn.ok()) << txn.status();
    for (int l = 0; l < m->num_layers; ++l) {
      const size_t row = m->row_values();
      auto k = absl::MakeConstSpan(want.k[l]).subspan((30 + i) * row, row);
      auto v = absl::MakeConstSpan(want.v[l]).subspan((30 + i) * row, row);
      ASSERT_TRUE((*txn)->StageLayer(l, 0, k, v).ok());
    }
    ASSERT_TRUE(core.store->Commit(*std::move(txn)).ok());
  }
  auto a = *core.store->Describe(kDefaultTenant, "a");
  auto b = *core.store->Describe(kDefaultTenant, "b");
  EXPECT_EQ(a.history, b.history);
  EXPECT_EQ(a.recent, b.recent);
  ExpectExactReadback(core, *m, "b", want);
}

TEST(SequenceStoreTest, QuantizedHistoryMatchesTheCodecBitForBit) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kHadamard, SmallQuant());
  ASSERT_TRUE(core.store->Create(kDefaultTenant, m, "s", {}).ok());
  ASSERT_TRUE(AppendAll(*core.store, *m, "s", 0, 64, AppendKind::kPrefill, 3, 13).ok());
  auto snap = *core.store->Snapshot(kDefaultTenant, "s", {});
  ASSERT_EQ(snap->history(), 56);
  const size_t row = m->row_values();
  for (int l = 0; l < m->num_layers; ++l) {
    for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
      const auto in = TestRows(64, row, 3 + 2 * l + (t == KvTensor::kValue ? 1 : 0));
      std::vector<Bf16> rotated(in.size());
      ASSERT_TRUE(m->codec.rotations.RotateBf16(l, t, in, absl::MakeSpan(rotated)).ok());
      std::vector<float> k(64 * row), v(64 * row);
      ASSERT_TRUE(
          snap->ReadRotated(core.backend.get(), l, 0, 64, absl::MakeSpan(k), absl::MakeSpan(v))
              .ok());
      const std::vector<float>& got = t == KvTensor::kKey ? k : v;
      for (int tok = 0; tok < 64; ++tok) {
        for (int h = 0; h < m->kv_heads; ++h) {
          const auto src = absl::MakeConstSpan(rotated).subspan(
              (tok * m->kv_heads + h) * m->head_dim, m->head_dim);
          std::vector<float> want(m->head_dim);
          if (tok < 8) {
            for (int d = 0; d < m->head_dim; ++d) want[d] = src[d].ToFloat();  // sink: exact
          } else {
            std::vector<uint8_t> codes(m->block_layout.code_bytes_per_row());
            std::vector<GroupMeta> meta(m->block_layout.groups_per_row());
            ASSERT_TRUE(m->row_codec.Encode(t, src, codes.data(), meta.data()).ok());
            m->row_codec.Decode(codes.data(), meta.data(), absl::MakeSpan(want));
          }
          for (int d = 0; d < m->head_dim; ++d) {
            ASSERT_EQ(got[(tok * m->kv_heads + h) * m->head_dim + d], want[d])
                << "layer " << l << " token " << tok << " head " << h << " dim " << d;
          }
        }
      }
    }
  }
}

TEST(SequenceStoreTest, FailedAppendLeavesThePoolExactlyAsItWas) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kHadamard, SmallQuant());
  ASSERT_TRUE(core.store->Create(kDefaultTenant, m, "s", {}).ok());
  ASSERT_TRUE(AppendAll(*core.store, *m, "s", 0, 21, AppendKind::kPrefill, 1).ok());
  const size_t used = core.pool->used_bytes();
  const auto before = *core.store->Describe(kDefaultTenant, "s");
  const size_t row = m->row_values();

  {  // NaN in the second layer, after the first layer was staged (into a partial block too).
    auto txn = core.store->BeginAppend(kDefaultTenant, "s", {21, 40, AppendKind::kPrefill, {}});
    ASSERT_TRUE(txn.ok());
    EXPECT_GT(core.pool->used_bytes(), used);  // pages reserved up front
    auto k = TestRows(40, row, 9), v = TestRows(40, row, 10);
    ASSERT_TRUE((*txn)->StageLayer(0, 0, k, v).ok());
    v[77] = Bf16::FromFloat(std::nanf(""));
    const absl::Status s = (*txn)->StageLayer(1, 0, k, v);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  }
  EXPECT_EQ(core.pool->used_bytes(), used);
  {  // A layer never sent: the commit is refused.
    auto txn = core.store->BeginAppend(kDefaultTenant, "s", {21, 5, AppendKind::kPrefill, {}});
    ASSERT_TRUE(txn.ok());
    auto k = TestRows(5, row, 9);
    ASSERT_TRUE((*txn)->StageLayer(0, 0, k, k).ok());
    const auto r = core.store->Commit(*std::move(txn));
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << r.status();
  }
  EXPECT_EQ(core.pool->used_bytes(), used);
  {  // Chunks out of order, wrong sizes, Inf.
    auto txn = core.store->BeginAppend(kDefaultTenant, "s", {21, 5, AppendKind::kPrefill, {}});
    ASSERT_TRUE(txn.ok());
    auto k = TestRows(5, row, 9);
    EXPECT_TRUE(absl::IsInvalidArgument((*txn)->StageLayer(0, 2, k, k)));
    EXPECT_TRUE(
        absl::IsInvalidArgument((*txn)->StageLayer(0, 0, absl::MakeConstSpan(k).subspan(1), k)));
    EXPECT_TRUE(absl::IsInvalidArgument((*txn)->StageLayer(7, 0, k, k)));
    k[3] = Bf16::FromFloat(INFINITY);
    EXPECT_TRUE(absl::IsInvalidArgument((*txn)->StageLayer(0, 0, k, k)));
  }
  EXPECT_EQ(core.pool->used_bytes(), used);
  const auto after = *core.store->Describe(kDefaultTenant, "s");
  EXPECT_EQ(after.total(), before.total());
  EXPECT_EQ(after.history, before.history);
  // The sequence still takes a valid append where it left off.
  ASSERT_TRUE(AppendAll(*core.store, *m, "s", 21, 40, AppendKind::kFinalPrefill, 4).ok());
}

TEST(SequenceStoreTest, StateAndOrderingErrorsHavePreciseCodes) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kIdentity, SmallQuant());
  EXPECT_TRUE(absl::IsNotFound(
      core.store->BeginAppend(kDefaultTenant, "nope", {0, 1, AppendKind::kPrefill, {}}).status()));
  ASSERT_TRUE(core.store->Create(kDefaultTenant, m, "s", {}).ok());
  EXPECT_TRUE(absl::IsAlreadyExists(core.store->Create(kDefaultTenant, m, "s", {}).status()));
  EXPECT_TRUE(
      absl::IsInvalidArgument(core.store->Create(kDefaultTenant, m, "bad id", {}).status()));
  EXPECT_TRUE(absl::IsFailedPrecondition(
      core.store->BeginAppend(kDefaultTenant, "s", {5, 1, AppendKind::kPrefill, {}}).status()));
  EXPECT_TRUE(absl::IsFailedPrecondition(
      core.store->BeginAppend(kDefaultTenant, "s", {0, 1, AppendKind::kDecode, {}}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      core.store->BeginAppend(kDefaultTenant, "s", {0, 0, AppendKind::kPrefill, {}}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      core.store->BeginAppend(kDefaultTenant, "s", {0, 3, AppendKind::kPrefill, {1, 2}}).status()));
  {
    auto txn = core.store->BeginAppend(kDefaultTenant, "s", {0, 4, AppendKind::kPrefill, {}});
    ASSERT_TRUE(txn.ok());
    EXPECT_TRUE(absl::IsAborted(
        core.store->BeginAppend(kDefaultTenant, "s", {0, 4, AppendKind::kPrefill, {}}).status()));
  }
  ASSERT_TRUE(AppendAll(*core.store, *m, "s", 0, 10, AppendKind::kFinalPrefill, 1).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(
      core.store->BeginAppend(kDefaultTenant, "s", {10, 4, AppendKind::kPrefill, {}}).status()));
  ASSERT_TRUE(core.store->Seal(kDefaultTenant, "s").ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(
      core.store->BeginAppend(kDefaultTenant, "s", {10, 1, AppendKind::kDecode, {}}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      core.store->Snapshot(kDefaultTenant, "s", std::vector<int>{2}).status()));
  ASSERT_TRUE(core.store->Release(kDefaultTenant, "s").ok());
  EXPECT_TRUE(absl::IsNotFound(core.store->Release(kDefaultTenant, "s").status()));
  EXPECT_EQ(core.pool->used_bytes(), 0u);
}

TEST(SequenceStoreTest, FullPoolFailsAtBeginAndChangesNothing) {
  TestCore core(/*pool_bytes=*/1 << 20, /*slab_bytes=*/64 << 10);
  auto m = core.AddModel("m", RotationKind::kIdentity, SmallQuant());
  ASSERT_TRUE(core.store->Create(kDefaultTenant, m, "s", {}).ok());
  const auto r =
      core.store->BeginAppend(kDefaultTenant, "s", {0, 100000, AppendKind::kPrefill, {}});
  EXPECT_TRUE(absl::IsResourceExhausted(r.status())) << r.status();
  EXPECT_EQ(core.pool->used_bytes(), 0u);
  // Not blocked by the failed attempt.
  ASSERT_TRUE(AppendAll(*core.store, *m, "s", 0, 50, AppendKind::kFinalPrefill, 1).ok());
}

TEST(SequenceStoreTest, ReleaseDuringAppendRollsTheAppendBack) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kIdentity, SmallQuant());
  ASSERT_TRUE(core.store->Create(kDefaultTenant, m, "s", {}).ok());
  ASSERT_TRUE(AppendAll(*core.store, *m, "s", 0, 20, AppendKind::kPrefill, 1).ok());
  auto txn = core.store->BeginAppend(kDefaultTenant, "s", {20, 30, AppendKind::kPrefill, {}});
  ASSERT_TRUE(txn.ok());
  auto k = TestRows(30, m->row_values(), 5);
  ASSERT_TRUE((*txn)->StageLayer(0, 0, k, k).ok());
  ASSERT_TRUE(core.store->Release(kDefaultTenant, "s").ok());
  ASSERT_TRUE((*txn)->StageLayer(1, 0, k, k).ok());  // writes into pages it still holds
  EXPECT_TRUE(absl::IsNotFound(core.store->Commit(*std::move(txn)).status()));
  EXPECT_EQ(core.pool->used_bytes(), 0u);
}

TEST(SequenceStoreTest, SnapshotSurvivesDemotionAndRelease) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kIdentity, BypassQuant());
  ASSERT_TRUE(core.store->Create(kDefaultTenant, m, "s", {}).ok());
  ASSERT_TRUE(AppendAll(*core.store, *m, "s", 0, 40, AppendKind::kFinalPrefill, 1).ok());
  auto snap = *core.store->Snapshot(kDefaultTenant, "s", {});
  for (int i = 0; i < 9; ++i) {
    ASSERT_TRUE(AppendAll(*core.store, *m, "s", 40 + i, 1, AppendKind::kDecode, 90 + i).ok());
  }
  ASSERT_TRUE(core.store->Release(kDefaultTenant, "s").ok());
  EXPECT_GT(core.pool->used_bytes(), 0u);  // the snapshot still holds its pages
  Expected want;
  want.Add(*m, 40, 1);
  const size_t row = m->row_values();
  std::vector<float> k(40 * row), v(40 * row);
  ASSERT_TRUE(
      snap->ReadRotated(core.backend.get(), 1, 0, 40, absl::MakeSpan(k), absl::MakeSpan(v)).ok());
  for (size_t i = 0; i < k.size(); ++i) ASSERT_EQ(Bf16::FromFloat(k[i]).bits, want.k[1][i].bits);
  snap.reset();
  EXPECT_EQ(core.pool->used_bytes(), 0u);
}

TEST(SequenceStoreTest, SnapshotWithoutPagesHoldsNoneAndShowsTheTiers) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kIdentity, BypassQuant());
  ASSERT_TRUE(core.store->Create(kDefaultTenant, m, "s", {}).ok());
  ASSERT_TRUE(AppendAll(*core.store, *m, "s", 0, 40, AppendKind::kFinalPrefill, 1).ok());
  auto full = *core.store->Snapshot(kDefaultTenant, "s", {});
  auto bare = *core.store->Snapshot(kDefaultTenant, "s", {}, SnapshotPages::kNone);
  EXPECT_EQ(bare->sink(), full->sink());
  EXPECT_EQ(bare->history(), full->history());
  EXPECT_EQ(bare->recent(), full->recent());
  EXPECT_EQ(bare->incarnation(), full->incarnation());
  ASSERT_EQ(bare->layers().size(), full->layers().size());
  for (const auto& l : bare->layers()) {
    EXPECT_TRUE(l.sink.empty() && l.history.empty() && l.recent.empty());
  }
  // The same checks as a full snapshot.
  EXPECT_TRUE(absl::IsInvalidArgument(
      core.store->Snapshot(kDefaultTenant, "s", std::vector<int>{9}, SnapshotPages::kNone)
          .status()));
  EXPECT_TRUE(absl::IsNotFound(
      core.store->Snapshot(kDefaultTenant, "x", {}, SnapshotPages::kNone).status()));
  full.reset();
  ASSERT_TRUE(core.store->Release(kDefaultTenant, "s").ok());
  EXPECT_EQ(core.pool->used_bytes(), 0u);  // the bare snapshot kept nothing alive
}

TEST(SequenceStoreTest, PrefixUnitsAreSharedAndCachedAfterRelease) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kHadamard, SmallQuant());
  auto other = core.AddModel("other", RotationKind::kHadamard, SmallQuant());
  const std::vector<uint32_t> ids = Iota(60, 100);
  ASSERT_TRUE(core.store->Create(kDefaultTenant, m, "a", {}).ok());
  // Non-final prefill: tokens 8..59 go to history: 6 whole blocks + 4 tokens.
  ASSERT_TRUE(AppendAll(*core.store, *m, "a", 0, 60, AppendKind::kPrefill, 1, 60, ids).ok());
  EXPECT_EQ(core.index->Stats().units, 7u);  // sink + 6 blocks

  auto hit = core.store->Create(kDefaultTenant, m, "b", ids);
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_EQ(hit->first.total(), 56);
  EXPECT_EQ(hit->first.reused_tokens, 56);
  EXPECT_EQ(hit->second.size(), 7u);
  EXPECT_EQ(hit->first.shared_bytes, hit->first.pool_bytes);

  // Shared data is the same data.
  auto sa = *core.store->Snapshot(kDefaultTenant, "a", {});
  auto sb = *core.store->Snapshot(kDefaultTenant, "b", {});
  const size_t row = m->row_values();
  std::vector<float> ka(56 * row), va(56 * row), kb(56 * row), vb(56 * row);
  for (int l = 0; l < 2; ++l) {
    ASSERT_TRUE(
        sa->ReadRotated(core.backend.get(), l, 0, 56, absl::MakeSpan(ka), absl::MakeSpan(va)).ok());
    ASSERT_TRUE(
        sb->ReadRotated(core.backend.get(), l, 0, 56, absl::MakeSpan(kb), absl::MakeSpan(vb)).ok());
    EXPECT_EQ(ka, kb);
    EXPECT_EQ(va, vb);
  }
  sa.reset();
  sb.reset();

  // Continuing b from the shared prefix works and does not touch a's blocks.
  ASSERT_TRUE(AppendAll(*core.store, *m, "b", 56, 20, AppendKind::kFinalPrefill, 8).ok());

  // Another model, a shorter prompt, a different token: no (or a shorter) match.
  EXPECT_EQ(core.store->Create(kDefaultTenant, other, "c", ids)->first.reused_tokens, 0);
  EXPECT_EQ(core.store->Create(kDefaultTenant, m, "d", Iota(20, 100))->first.reused_tokens, 16);
  std::vector<uint32_t> changed = ids;
  changed[30] = 7;
  EXPECT_EQ(core.store->Create(kDefaultTenant, m, "e", changed)->first.reused_tokens, 24);

  for (const char* id : {"a", "b", "c", "d", "e"}) {
    ASSERT_TRUE(core.store->Release(kDefaultTenant, id).ok());
  }
  // Only the index holds pages now, all evictable.
  const auto st = core.index->Stats();
  EXPECT_EQ(core.pool->used_bytes(), st.bytes);
  EXPECT_EQ(st.cached_bytes, st.bytes);
  while (core.index->EvictOne() > 0) {
  }
  EXPECT_EQ(core.index->Stats().units, 0u);
  EXPECT_EQ(core.pool->used_bytes(), 0u);
}

TEST(SequenceStoreTest, EvictsCachedUnitsWhenThePoolIsFull) {
  TestCore core(/*pool_bytes=*/2 << 20, /*slab_bytes=*/64 << 10);
  auto m = core.AddModel("m", RotationKind::kHadamard, SmallQuant());
  // Fill the cache with released sequences' published units.
  int n = 0;
  for (;; ++n) {
    const std::string id = "s" + std::to_string(n);
    ASSERT_TRUE(core.store->Create(kDefaultTenant, m, id, {}).ok());
    const absl::Status s =
        AppendAll(*core.store, *m, id, 0, 200, AppendKind::kPrefill, n, 200, Iota(200, n * 1000));
    ASSERT_TRUE(core.store->Release(kDefaultTenant, id).ok());
    if (!s.ok() || core.index->Stats().bytes > (1 << 20)) break;
  }
  const size_t cached = core.index->Stats().bytes;
  EXPECT_GT(cached, 0u);
  // A big append needs the cache's memory: it gets it by evicting least recently used units.
  ASSERT_TRUE(core.store->Create(kDefaultTenant, m, "big", {}).ok());
  ASSERT_TRUE(AppendAll(*core.store, *m, "big", 0, 12000, AppendKind::kPrefill, 5).ok());
  EXPECT_GT(core.index->Stats().evicted_units, 0u);
  ASSERT_TRUE(core.store->Release(kDefaultTenant, "big").ok());
  EXPECT_EQ(core.pool->used_bytes(), core.index->Stats().bytes);
}

TEST(SequenceStoreTest, LeasesRunOutWithoutUseAndAnswerExpired) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kHadamard, SmallQuant());
  SequenceStore store(core.pool.get(), core.index.get(), core.backend.get(),
                      /*default_ttl=*/absl::Minutes(10));
  ASSERT_TRUE(store.Create(kDefaultTenant, m, "default", {}).ok());
  ASSERT_TRUE(store.Create(kDefaultTenant, m, "own", {}, absl::Minutes(1)).ok());
  ASSERT_TRUE(AppendAll(store, *m, "default", 0, 40, AppendKind::kFinalPrefill, 1).ok());
  EXPECT_EQ(store.leased_sequences(), 2u);
  EXPECT_EQ(store.Describe(kDefaultTenant, "own")->ttl, absl::Minutes(1));
  EXPECT_GT(core.pool->used_bytes(), 0u);

  // Nothing expires before its lease; "own" after its minute, "default" after ten.
  const absl::Time now = absl::Now();
  EXPECT_EQ(store.ReleaseExpired(now + absl::Seconds(50)), 0u);
  EXPECT_EQ(store.ReleaseExpired(now + absl::Minutes(2)), 1u);
  absl::StatusOr<SequenceInfo> own = store.Describe(kDefaultTenant, "own");
  EXPECT_TRUE(absl::IsNotFound(own.status())) << own.status();
  EXPECT_EQ(ReasonOf(own.status()), ErrorReason::kExpired);
  EXPECT_EQ(ReasonOf(store.Snapshot(kDefaultTenant, "own", {}).status()), ErrorReason::kExpired);
  EXPECT_EQ(ReasonOf(store.Release(kDefaultTenant, "own").status()), ErrorReason::kExpired);
  EXPECT_EQ(ReasonOf(AppendAll(store, *m, "own", 0, 1, AppendKind::kPrefill, 1)),
            ErrorReason::kExpired);
  // A name never seen is plain NotFound.
  EXPECT_FALSE(ReasonOf(store.Describe(kDefaultTenant, "never").status()).has_value());

  // An append in progress holds the lease.
  absl::StatusOr<std::unique_ptr<AppendTxn>> txn =
      store.BeginAppend(kDefaultTenant, "default", AppendSpec{40, 1, AppendKind::kDecode, {}});
  ASSERT_TRUE(txn.ok()) << txn.status();
  EXPECT_EQ(store.ReleaseExpired(now + absl::Minutes(20)), 0u);
  txn->reset();  // rolled back
  EXPECT_EQ(store.ReleaseExpired(now + absl::Minutes(20)), 1u);
  EXPECT_EQ(store.expired_sequences(), 2u);
  EXPECT_EQ(store.leased_sequences(), 0u);
  EXPECT_EQ(store.size(), 0u);
  EXPECT_EQ(core.pool->used_bytes(), core.index->Stats().bytes);

  // The id can be created again, and is then an ordinary live sequence.
  ASSERT_TRUE(store.Create(kDefaultTenant, m, "own", {}).ok());
  EXPECT_TRUE(store.Describe(kDefaultTenant, "own").ok());
  ASSERT_TRUE(store.Release(kDefaultTenant, "own").ok());
  EXPECT_FALSE(ReasonOf(store.Describe(kDefaultTenant, "own").status()).has_value());
}

TEST(SequenceStoreTest, ConcurrentAppendsKeepExactAccounting) {
  TestCore core(/*pool_bytes=*/64 << 20);
  auto m = core.AddModel("m", RotationKind::kHadamard, SmallQuant());
  constexpr int kThreads = 8;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 6; ++round) {
        const std::string id = "t" + std::to_string(t) + "-" + std::to_string(round);
        if (!core.store->Create(kDefaultTenant, m, id, {}).ok()) ++failures;
        if (!AppendAll(*core.store, *m, id, 0, 50 + t, AppendKind::kFinalPrefill, t, 17).ok()) {
          ++failures;
        }
        for (int i = 0; i < 12; ++i) {
          if (!AppendAll(*core.store, *m, id, 50 + t + i, 1, AppendKind::kDecode, i).ok()) {
            ++failures;
          }
        }
        if (round % 2 == 1 && !core.store->Release(kDefaultTenant, id).ok()) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  size_t sum = 0;
  for (const SequenceInfo& info : core.store->List(kDefaultTenant)) {
    EXPECT_EQ(info.total(), 50 + (info.id[1] - '0') + 12);
    EXPECT_EQ(info.shared_bytes, 0u);
    sum += info.pool_bytes;
  }
  EXPECT_EQ(core.store->size(), kThreads * 3u);
  EXPECT_EQ(sum, core.pool->used_bytes());
  for (const SequenceInfo& info : core.store->List(kDefaultTenant)) {
    ASSERT_TRUE(core.store->Release(kDefaultTenant, info.id).ok());
  }
  EXPECT_EQ(core.pool->used_bytes(), 0u);
}

TEST(SequenceStoreTest, ConcurrentAppendersOnOneSequenceAreSerialized) {
  TestCore core;
  auto m = core.AddModel("m", RotationKind::kIdentity, SmallQuant());
  ASSERT_TRUE(core.store->Create(kDefaultTenant, m, "s", {}).ok());
  ASSERT_TRUE(AppendAll(*core.store, *m, "s", 0, 30, AppendKind::kFinalPrefill, 1).ok());
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 50; ++i) {
        const int len = core.store->Describe(kDefaultTenant, "s")->total();
        const absl::Status s = AppendAll(*core.store, *m, "s", len, 1, AppendKind::kDecode, t);
        if (s.ok()) {
          ++ok;
        } else if (!absl::IsAborted(s) && !absl::IsFailedPrecondition(s)) {
          ADD_FAILURE() << s;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  auto info = *core.store->Describe(kDefaultTenant, "s");
  EXPECT_EQ(info.total(), 30 + ok.load());
  EXPECT_EQ(info.pool_bytes, core.pool->used_bytes());
}

}  // namespace
}  // namespace kvpool::server
