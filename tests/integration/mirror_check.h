// A client mirror (client/kv_mirror.h) checked against a fresh full ReadBlocks of the same
// sequence, for the incremental fetch tests (CPU and GPU).
#pragma once

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/kv_mirror.h"
#include "client/kvpool_client.h"
#include "gtest/gtest.h"
#include "kernels/paged_kv.h"
#include "tests/integration/integration_util.h"

namespace kvpool::integration {

// K (or V, `value`) rows of one tier of sequence 0 of `batch`, read through its description:
// block table, first token and count, in pages of `pool` (the BF16 layout).
inline std::string TierRows(const PagedKvBatch& batch, const PagedKvTier& tier, bool value) {
  const BlockLayout& l = batch.bf16_pool.layout;
  const size_t head_row = l.code_bytes_per_row();
  std::string out;
  for (int t = 0; t < tier.num_tokens[0]; ++t) {
    const int pos = tier.first_token[0] + t;
    const uint8_t* page = batch.bf16_pool.Block(tier.block_tables[pos / l.tokens]);
    for (int h = 0; h < l.kv_heads; ++h) {
      const uint8_t* row = page + l.CodesOffset(value ? KvTensor::kValue : KvTensor::kKey, h) +
                           (pos % l.tokens) * head_row;
      out.append(reinterpret_cast<const char*>(row), head_row);
    }
  }
  return out;
}

// The mirror's copy of `id` equals a full ReadBlocks now, gathered and, for a host arena
// (`host`), read through its batches.
inline void ExpectMirrorIsFullRead(const KvpoolClient& c, const client::KvMirror& mirror,
                                   const std::string& id, int num_layers, bool host = true) {
  v1::ReadBlocksRequest request;
  request.set_sequence_id(id);
  absl::StatusOr<client::BlocksRead> full = c.ReadBlocks(request);
  ASSERT_TRUE(full.ok()) << full.status();
  const v1::ReadBlocksCursor* held = mirror.Held(id);
  ASSERT_NE(held, nullptr);
  EXPECT_EQ(held->sequence_incarnation(), full->header.sequence_incarnation());
  EXPECT_EQ(held->sink_tokens(), full->header.sink_tokens());
  EXPECT_EQ(held->history_tokens(), full->header.history_tokens());
  EXPECT_EQ(held->recent_tokens(), full->header.recent_tokens());
  for (int layer = 0; layer < num_layers; ++layer) {
    SCOPED_TRACE(absl::StrCat(id, " layer ", layer));
    const client::LayerBlocks& want = full->layers[layer];
    absl::StatusOr<client::LayerBlocks> got = mirror.Gather(id, layer);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(got->sink_k == want.sink_k && got->sink_v == want.sink_v);
    EXPECT_TRUE(got->recent_k == want.recent_k && got->recent_v == want.recent_v);
    ASSERT_EQ(got->blocks.size(), want.blocks.size());
    for (size_t b = 0; b < want.blocks.size(); ++b) {
      EXPECT_EQ(got->blocks[b].valid_tokens(), want.blocks[b].valid_tokens());
      EXPECT_TRUE(got->blocks[b].data() == want.blocks[b].data()) << "block " << b;
    }
    if (!host) continue;
    // The decode batch describes the same bytes: its pools are the mirror's arena.
    auto tables = mirror.Tables(layer, {id});
    ASSERT_TRUE(tables.ok()) << tables.status();
    const PagedKvBatch& batch = (*tables)->batch();
    EXPECT_EQ(batch.num_seqs, 1);
    EXPECT_EQ(batch.history_pool.pool, mirror.history_pool().pool);
    EXPECT_TRUE(TierRows(batch, batch.sink, false) == want.sink_k);
    EXPECT_TRUE(TierRows(batch, batch.sink, true) == want.sink_v);
    EXPECT_TRUE(TierRows(batch, batch.recent, false) == want.recent_k);
    EXPECT_TRUE(TierRows(batch, batch.recent, true) == want.recent_v);
    ASSERT_EQ(batch.history.num_tokens[0], static_cast<int>(full->header.history_tokens()));
    for (size_t b = 0; b < want.blocks.size(); ++b) {
      const uint8_t* block = batch.history_pool.Block(batch.history.block_tables[b]);
      EXPECT_EQ(std::memcmp(block, want.blocks[b].data().data(), want.blocks[b].data().size()), 0)
          << "history block " << b << " through the batch";
    }
  }
}

}  // namespace kvpool::integration
