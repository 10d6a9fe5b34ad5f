#include "kernels/paged_kv.h"

#include <algorithm>
#include <cstddef>

namespace kvpool {
namespace {

PagedKvTier TierRows(const PagedKvTier& t, int first) {
  PagedKvTier out = t;
  out.block_tables += static_cast<ptrdiff_t>(first) * t.block_table_stride;
  out.first_token += first;
  out.num_tokens += first;
  return out;
}

PagedKvTier TierMoved(const PagedKvTier& t, const int32_t* from, const int32_t* to) {
  PagedKvTier out = t;
  out.block_tables = to + (t.block_tables - from);
  out.first_token = to + (t.first_token - from);
  out.num_tokens = to + (t.num_tokens - from);
  return out;
}

}  // namespace

PagedKvBatch PagedKvBatch::Rows(int first, int count) const {
  PagedKvBatch out = *this;
  out.num_seqs = count;
  out.sink = TierRows(sink, first);
  out.history = TierRows(history, first);
  out.recent = TierRows(recent, first);
  return out;
}

PagedKvBatch RebaseArrays(const PagedKvBatch& batch, const int32_t* from, const int32_t* to) {
  PagedKvBatch out = batch;
  out.sink = TierMoved(batch.sink, from, to);
  out.history = TierMoved(batch.history, from, to);
  out.recent = TierMoved(batch.recent, from, to);
  return out;
}

PagedKvTables::PagedKvTables(const PagedKvView& history_pool, const PagedKvView& bf16_pool,
                             absl::Span<const Sequence> sequences) {
  Tier Sequence::*const tiers[3] = {&Sequence::sink, &Sequence::history, &Sequence::recent};
  int32_t rows = 0;
  int32_t stride[3] = {1, 1, 1};
  for (const Sequence& s : sequences) {
    rows += s.rows;
    for (int t = 0; t < 3; ++t) {
      stride[t] = std::max(stride[t], static_cast<int32_t>((s.*tiers[t]).blocks.size()));
    }
  }
  // Per tier: the block tables, then the first tokens, then the token counts.
  size_t at[3];
  size_t total = 0;
  for (int t = 0; t < 3; ++t) {
    at[t] = total;
    total += static_cast<size_t>(rows) * (stride[t] + 2);
  }
  words_.assign(total, 0);
  batch_.history_pool = history_pool;
  batch_.bf16_pool = bf16_pool;
  batch_.num_seqs = rows;
  PagedKvTier* out[3] = {&batch_.sink, &batch_.history, &batch_.recent};
  for (int t = 0; t < 3; ++t) {
    int32_t* table = words_.data() + at[t];
    int32_t* first = table + static_cast<size_t>(rows) * stride[t];
    int32_t* count = first + rows;
    *out[t] = PagedKvTier{table, stride[t], first, count};
    size_t row = 0;
    for (const Sequence& s : sequences) {
      const Tier& tier = s.*tiers[t];
      for (int r = 0; r < s.rows; ++r, ++row) {
        std::copy(tier.blocks.begin(), tier.blocks.end(), table + row * stride[t]);
        first[row] = tier.first_token;
        count[row] = tier.num_tokens;
      }
    }
  }
  for (const Sequence& s : sequences) {
    if (s.rows < 1) continue;
    batch_.max_history_tokens = std::max(batch_.max_history_tokens, s.history.num_tokens);
    batch_.max_bf16_tokens =
        std::max(batch_.max_bf16_tokens, s.sink.num_tokens + s.recent.num_tokens);
  }
}

}  // namespace kvpool
