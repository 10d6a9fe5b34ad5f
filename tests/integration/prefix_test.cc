// Prefix reuse through a real kvpoold: LookupPrefix finds the shared BF16 sink and the whole
// INT2 blocks of a cached prompt through the daemon's hash chain, a new sequence attaches them
// by reference (bit-identical storage, shared pages), and nothing is ever found under another
// model or another codec version.
#include <string>
#include <vector>

#include "tests/integration/integration_util.h"

namespace kvpool::integration {
namespace {

class PrefixTest : public DaemonTest {};

constexpr Shape kShape{/*num_layers=*/2, /*q_heads=*/8, /*kv_heads=*/2, /*head_dim=*/64};
constexpr int kSink = 64, kBlock = 16, kRecent = 256;

std::vector<uint32_t> Prompt(int n, uint32_t salt) {
  std::vector<uint32_t> ids(n);
  for (int i = 0; i < n; ++i) ids[i] = (static_cast<uint32_t>(i) * 2654435761u + salt) % 50000;
  return ids;
}

// Storage of a sequence as ReadBlocks returns it, without the prefix hashes.
absl::StatusOr<std::vector<std::string>> Storage(const KvpoolClient& c, const std::string& id) {
  v1::ReadBlocksRequest request;
  request.set_sequence_id(id);
  absl::StatusOr<client::BlocksRead> read = c.ReadBlocks(request);
  if (!read.ok()) return read.status();
  std::vector<std::string> out;
  for (const client::LayerBlocks& l : read->layers) {
    out.push_back(l.sink_k + l.sink_v);
    for (const v1::KvBlock& b : l.blocks) out.push_back(b.data());
    out.push_back(l.recent_k + l.recent_v);
  }
  return out;
}

TEST_F(PrefixTest, FindsSharedSinkAndBlocksAndNeverAForeignModelsOrCodecVersions) {
  // A and B: the same codec content under two ids; C: another codec version (another seed).
  absl::StatusOr<v1::ModelInfo> a =
      RegisterDataFree(client(), "pfx-a", kShape, v1::ROTATION_KIND_RANDOMIZED_HADAMARD, 7);
  absl::StatusOr<v1::ModelInfo> b =
      RegisterDataFree(client(), "pfx-b", kShape, v1::ROTATION_KIND_RANDOMIZED_HADAMARD, 7);
  absl::StatusOr<v1::ModelInfo> c =
      RegisterDataFree(client(), "pfx-c", kShape, v1::ROTATION_KIND_RANDOMIZED_HADAMARD, 8);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->codec_version(), b->codec_version());
  EXPECT_NE(a->codec_version(), c->codec_version());

  // A prompt of sink + 10 whole blocks + 4 tokens of history + the recent window.
  const int whole_blocks = 10;
  const int tokens = kSink + whole_blocks * kBlock + 4 + kRecent;
  const std::vector<uint32_t> ids = Prompt(tokens, 1);
  const SequenceKv kv = MakeSequenceKv(kShape, tokens, 3);
  for (const char* model : {"pfx-a", "pfx-b", "pfx-c"}) {
    absl::StatusOr<v1::AppendKvResponse> r =
        CreateAndAppend(client(), model, std::string(model) + "-1", kv, true, ids);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->published_units_size(), 1 + whole_blocks) << model;
    EXPECT_TRUE(r->sequence().has_token_ids());
  }
  // Model B's and C's copies are released: their units stay cached, and must still never match
  // model A's lookups (nor each other's).
  ASSERT_TRUE(client().ReleaseSequence("pfx-b-1").ok());
  ASSERT_TRUE(client().ReleaseSequence("pfx-c-1").ok());
  ASSERT_TRUE(client().SealSequence("pfx-a-1").ok());

  absl::StatusOr<v1::LookupPrefixResponse> hit = client().LookupPrefix("pfx-a", ids);
  ASSERT_TRUE(hit.ok()) << hit.status();
  const uint32_t matched = kSink + whole_blocks * kBlock;
  EXPECT_EQ(hit->matched_tokens(), matched);
  EXPECT_EQ(hit->codec_version(), a->codec_version());
  ASSERT_EQ(hit->units_size(), 1 + whole_blocks);
  EXPECT_EQ(hit->units(0).kind(), v1::PREFIX_UNIT_KIND_SINK);
  EXPECT_EQ(hit->units(0).token_start(), 0u);
  EXPECT_EQ(hit->units(0).token_count(), static_cast<uint32_t>(kSink));
  for (int i = 1; i <= whole_blocks; ++i) {
    EXPECT_EQ(hit->units(i).kind(), v1::PREFIX_UNIT_KIND_BLOCK);
    EXPECT_EQ(hit->units(i).token_start(), static_cast<uint32_t>(kSink + (i - 1) * kBlock));
    EXPECT_EQ(hit->units(i).token_count(), static_cast<uint32_t>(kBlock));
    EXPECT_EQ(hit->units(i).hash().size(), 64u);
  }

  // The blocks ReadBlocks returns carry the same hashes.
  v1::ReadBlocksRequest rb;
  rb.set_sequence_id("pfx-a-1");
  absl::StatusOr<client::BlocksRead> blocks = client().ReadBlocks(rb);
  ASSERT_TRUE(blocks.ok());
  for (const client::LayerBlocks& l : blocks->layers) {
    for (int i = 0; i < whole_blocks; ++i)
      EXPECT_EQ(l.blocks[i].prefix_hash(), hit->units(1 + i).hash());
  }

  // Same codec content under another id, and another codec version: no match, even though both
  // cached the very same tokens.
  absl::StatusOr<v1::LookupPrefixResponse> other_b = client().LookupPrefix("pfx-b", ids);
  ASSERT_TRUE(other_b.ok());
  absl::StatusOr<v1::LookupPrefixResponse> other_c = client().LookupPrefix("pfx-c", ids);
  ASSERT_TRUE(other_c.ok());
  EXPECT_EQ(other_b->codec_version(), b->codec_version());
  EXPECT_EQ(other_c->codec_version(), c->codec_version());
  for (const auto& r : {*other_b, *other_c}) {
    for (const v1::PrefixUnit& u : r.units()) {
      for (const v1::PrefixUnit& mine : hit->units()) EXPECT_NE(u.hash(), mine.hash());
    }
  }
  EXPECT_EQ(other_b->units_size(), 1 + whole_blocks) << "B finds its own cached units";

  // Partial prompts stop at the last whole unit; a changed token cuts the chain there.
  std::vector<uint32_t> shorter(ids.begin(), ids.begin() + kSink + 3 * kBlock + 5);
  EXPECT_EQ(client().LookupPrefix("pfx-a", shorter)->matched_tokens(),
            static_cast<uint32_t>(kSink + 3 * kBlock));
  std::vector<uint32_t> changed = ids;
  changed[kSink + 5 * kBlock + 3] ^= 1;
  EXPECT_EQ(client().LookupPrefix("pfx-a", changed)->matched_tokens(),
            static_cast<uint32_t>(kSink + 5 * kBlock));
  changed = ids;
  changed[10] ^= 1;
  EXPECT_EQ(client().LookupPrefix("pfx-a", changed)->matched_tokens(), 0u);
  EXPECT_EQ(client()
                .LookupPrefix("pfx-a", std::vector<uint32_t>(ids.begin(), ids.begin() + 63))
                ->matched_tokens(),
            0u);

  // A new sequence attaches the cached prefix by reference and appends the rest: its storage
  // is bit-identical to the original's, and the shared pages are counted once.
  absl::StatusOr<v1::GetStatsResponse> before_attach = client().GetStats();
  ASSERT_TRUE(before_attach.ok());
  v1::CreateSequenceRequest create;
  create.set_model_id("pfx-a");
  create.set_sequence_id("pfx-a-2");
  create.mutable_prefix_token_ids()->Add(ids.begin(), ids.end());
  absl::StatusOr<v1::CreateSequenceResponse> created = client().CreateSequence(create);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->reused_tokens(), matched);
  ASSERT_EQ(created->reused_units_size(), hit->units_size());
  for (int i = 0; i < hit->units_size(); ++i) {
    EXPECT_EQ(created->reused_units(i).hash(), hit->units(i).hash());
  }
  EXPECT_EQ(created->sequence().total_tokens(), matched);
  EXPECT_GT(created->sequence().shared_bytes(), 0u);
  absl::StatusOr<v1::GetStatsResponse> stats = client().GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->pool().used_bytes(), before_attach->pool().used_bytes())
      << "attaching takes references, it allocates nothing";

  v1::AppendKvHeader header;
  header.set_sequence_id("pfx-a-2");
  header.set_token_start(matched);
  header.set_num_tokens(tokens - matched);
  header.set_dtype(v1::DTYPE_BF16);
  header.set_end_of_prefill(true);
  header.mutable_token_ids()->Add(ids.begin() + matched, ids.end());
  const size_t row_bytes = static_cast<size_t>(kShape.kv_heads) * kShape.head_dim * 2;
  std::vector<client::LayerKv> rest;
  for (int l = 0; l < kShape.num_layers; ++l) {
    rest.push_back({l, AsBytes(kv.k[l]).substr(matched * row_bytes),
                    AsBytes(kv.v[l]).substr(matched * row_bytes)});
  }
  absl::StatusOr<v1::AppendKvResponse> appended = client().AppendKv(header, rest);
  ASSERT_TRUE(appended.ok()) << appended.status();
  EXPECT_EQ(appended->published_units_size(), 0) << "its whole units were already cached";
  EXPECT_EQ(*Storage(client(), "pfx-a-2"), *Storage(client(), "pfx-a-1"));

  // A different model never attaches A's prefix.
  create.set_model_id("pfx-c");
  create.set_sequence_id("pfx-c-2");
  created = client().CreateSequence(create);
  ASSERT_TRUE(created.ok());
  EXPECT_EQ(created->reused_tokens(), matched) << "C attaches its own cached units";
  for (const v1::PrefixUnit& u : created->reused_units()) {
    for (const v1::PrefixUnit& mine : hit->units()) EXPECT_NE(u.hash(), mine.hash());
  }
  ASSERT_TRUE(client().ReleaseSequence("pfx-c-2").ok());

  // Re-registering A's id with another codec version (after deleting it) finds nothing.
  ASSERT_TRUE(client().DeleteModel("pfx-a", /*force=*/true).ok());
  absl::StatusOr<v1::ModelInfo> a2 =
      RegisterDataFree(client(), "pfx-a", kShape, v1::ROTATION_KIND_RANDOMIZED_HADAMARD, 9);
  ASSERT_TRUE(a2.ok());
  EXPECT_NE(a2->codec_version(), a->codec_version());
  EXPECT_EQ(client().LookupPrefix("pfx-a", ids)->matched_tokens(), 0u);

  // Deleting every model returns the pool to empty: no leaked cached pages.
  for (const char* m : {"pfx-a", "pfx-b", "pfx-c"}) {
    ASSERT_TRUE(client().DeleteModel(m, /*force=*/true).ok()) << m;
  }
  stats = client().GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->pool().used_bytes(), 0u);
  EXPECT_EQ(stats->pool().cached_bytes(), 0u);
  EXPECT_EQ(stats->pool().prefix_units(), 0u);
}

TEST_F(PrefixTest, UnitsArePublishedOnlyWhenEveryTokenHasItsId) {
  ASSERT_TRUE(RegisterDataFree(client(), "pfx-ids", kShape, v1::ROTATION_KIND_HADAMARD, 0).ok());
  const int tokens = kSink + 4 * kBlock;
  const SequenceKv kv = MakeSequenceKv(kShape, tokens, 4);
  absl::StatusOr<v1::AppendKvResponse> r =
      CreateAndAppend(client(), "pfx-ids", "no-ids", kv, /*end_of_prefill=*/false);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->published_units_size(), 0);
  EXPECT_FALSE(r->sequence().has_token_ids());
  EXPECT_EQ(client().LookupPrefix("pfx-ids", Prompt(tokens, 2))->matched_tokens(), 0u);

  // With ids and a non-final prefill everything after the sink is history: 4 whole blocks.
  r = CreateAndAppend(client(), "pfx-ids", "with-ids", kv, /*end_of_prefill=*/false,
                      Prompt(tokens, 2));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->published_units_size(), 5);
  EXPECT_EQ(client().LookupPrefix("pfx-ids", Prompt(tokens, 2))->matched_tokens(),
            static_cast<uint32_t>(tokens));
  ASSERT_TRUE(client().DeleteModel("pfx-ids", /*force=*/true).ok());
}

}  // namespace
}  // namespace kvpool::integration
