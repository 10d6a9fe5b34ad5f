#include "kernels/paged_kv.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace kvpool {
namespace {

std::vector<int32_t> Row(const int32_t* a, int n) { return std::vector<int32_t>(a, a + n); }

// Two sequences: A (two query rows) with all three tiers, B (one row) without history.
class PagedKvTablesTest : public ::testing::Test {
 protected:
  PagedKvTablesTest() {
    history_pool_.pool = reinterpret_cast<uint8_t*>(uintptr_t{0x1000});
    history_pool_.num_blocks = 100;
    history_pool_.block_stride = 16;
    bf16_pool_ = history_pool_;
    bf16_pool_.layout.bits = 16;
    PagedKvTables::Sequence a;
    a.sink = {a_sink_, 0, 20};
    a.history = {a_history_, 0, 5};
    a.recent = {a_recent_, 3, 30};
    a.rows = 2;
    PagedKvTables::Sequence b;
    b.sink = {b_sink_, 0, 3};
    b.recent = {b_recent_, 0, 2};
    sequences_ = {a, b};
  }

  PagedKvView history_pool_, bf16_pool_;
  const std::vector<int32_t> a_sink_{1, 2}, a_history_{7}, a_recent_{9, 10, 11};
  const std::vector<int32_t> b_sink_{4}, b_recent_{12};
  std::vector<PagedKvTables::Sequence> sequences_;
};

TEST_F(PagedKvTablesTest, LaysOutOneRowPerQueryRowPaddedToTheLongestTier) {
  const PagedKvTables tables(history_pool_, bf16_pool_, sequences_);
  const PagedKvBatch& b = tables.batch();
  EXPECT_EQ(b.num_seqs, 3);
  EXPECT_EQ(b.history_pool.pool, history_pool_.pool);
  EXPECT_EQ(b.bf16_pool.layout.bits, 16);
  EXPECT_EQ(b.max_history_tokens, 5);
  EXPECT_EQ(b.max_bf16_tokens, 50);  // A: 20 sink + 30 recent

  EXPECT_EQ(b.sink.block_table_stride, 2);
  EXPECT_EQ(Row(b.sink.block_tables, 6), (std::vector<int32_t>{1, 2, 1, 2, 4, 0}));
  EXPECT_EQ(Row(b.sink.first_token, 3), (std::vector<int32_t>{0, 0, 0}));
  EXPECT_EQ(Row(b.sink.num_tokens, 3), (std::vector<int32_t>{20, 20, 3}));

  EXPECT_EQ(b.history.block_table_stride, 1);  // B has none: one padding entry per row
  EXPECT_EQ(Row(b.history.block_tables, 3), (std::vector<int32_t>{7, 7, 0}));
  EXPECT_EQ(Row(b.history.num_tokens, 3), (std::vector<int32_t>{5, 5, 0}));

  EXPECT_EQ(b.recent.block_table_stride, 3);
  EXPECT_EQ(Row(b.recent.block_tables, 9), (std::vector<int32_t>{9, 10, 11, 9, 10, 11, 12, 0, 0}));
  EXPECT_EQ(Row(b.recent.first_token, 3), (std::vector<int32_t>{3, 3, 0}));
  EXPECT_EQ(Row(b.recent.num_tokens, 3), (std::vector<int32_t>{30, 30, 2}));

  // Every array lies in words(): one copy moves the batch.
  const int32_t* begin = tables.words().data();
  const int32_t* end = begin + tables.words().size();
  for (const PagedKvTier* t : {&b.sink, &b.history, &b.recent}) {
    EXPECT_GE(t->block_tables, begin);
    EXPECT_LE(t->num_tokens + b.num_seqs, end);
  }
}

TEST_F(PagedKvTablesTest, RowsAndRebaseMoveOnlyTheArrays) {
  const PagedKvTables tables(history_pool_, bf16_pool_, sequences_);
  const PagedKvBatch rows = tables.batch().Rows(1, 2);  // A's second row and B
  EXPECT_EQ(rows.num_seqs, 2);
  EXPECT_EQ(rows.max_bf16_tokens, 50);
  EXPECT_EQ(Row(rows.sink.block_tables, 4), (std::vector<int32_t>{1, 2, 4, 0}));
  EXPECT_EQ(Row(rows.recent.first_token, 2), (std::vector<int32_t>{3, 0}));
  EXPECT_EQ(Row(rows.history.num_tokens, 2), (std::vector<int32_t>{5, 0}));

  const std::vector<int32_t> copy(tables.words().begin(), tables.words().end());
  const PagedKvBatch moved = RebaseArrays(rows, tables.words().data(), copy.data());
  EXPECT_EQ(moved.num_seqs, 2);
  EXPECT_EQ(moved.bf16_pool.pool, bf16_pool_.pool);
  for (const auto& [got, want] :
       {std::make_pair(moved.sink, rows.sink), std::make_pair(moved.history, rows.history),
        std::make_pair(moved.recent, rows.recent)}) {
    EXPECT_GE(got.block_tables, copy.data());
    EXPECT_LT(got.num_tokens, copy.data() + copy.size());
    EXPECT_EQ(got.block_table_stride, want.block_table_stride);
    EXPECT_EQ(Row(got.block_tables, 2 * got.block_table_stride),
              Row(want.block_tables, 2 * want.block_table_stride));
    EXPECT_EQ(Row(got.first_token, 2), Row(want.first_token, 2));
    EXPECT_EQ(Row(got.num_tokens, 2), Row(want.num_tokens, 2));
  }
}

TEST(PagedKvViewTest, BlocksLieAStrideApart) {
  PagedKvView v;
  v.pool = reinterpret_cast<uint8_t*>(uintptr_t{0x10000});
  v.layout.kv_heads = 2;
  v.layout.head_dim = 64;
  v.block_stride = 16;
  EXPECT_EQ(v.Block(5), v.pool + 80);
  v.block_stride = 0;  // dense blocks
  EXPECT_EQ(v.stride_bytes(), static_cast<int64_t>(v.layout.block_bytes()));
  EXPECT_EQ(v.Block(3), v.pool + 3 * v.layout.block_bytes());
}

}  // namespace
}  // namespace kvpool
