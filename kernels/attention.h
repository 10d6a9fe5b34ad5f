// Decode attention over one sequence's mixed-precision KV (CPU reference), with log-sum-exp.
//
// All K/V here are in the rotated basis and so is the query (q' = q * M_K). With scale
// 1/sqrt(D), for query head j (served by KV head j / (Hq / Hkv)):
//
//   l_t = (q'_j . k'_t) / sqrt(D);  lse_j = ln sum_t exp(l_t);  o'_j = sum_t exp(l_t - lse_j) v'_t
//
// Partial results over disjoint token sets merge exactly through their lse (MergeAttention).
// An empty token set gives lse = -inf and a zero output. Accumulation is in fp32 (float64 in
// tests); the INT2 tier folds scale and min out of the dot products.
// Arguments whose shapes do not agree (q, k, v sizes; layout vs shape vs codec; too few or null
// blocks) are a programming error: debug builds assert, release builds return NaN in every out
// and lse entry. All functions are reentrant (no shared state).
//
//   AttentionShape shape{/*q_heads=*/64, /*kv_heads=*/8, /*head_dim=*/128};
//   AttentionOutput part_a = AttendBf16Rows(shape, q, k_rows, v_rows, n);
//   AttentionOutput part_b = AttendBlocks(shape, codec, layout, blocks, history_tokens, q);
//   MergeAttention(shape, part_a, &part_b);   // part_b now covers both token sets
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/bf16.h"
#include "kernels/block_layout.h"
#include "kernels/row_codec.h"

namespace kvpool {

struct AttentionShape {
  int q_heads = 1;   // Hq
  int kv_heads = 1;  // Hkv, divides Hq
  int head_dim = 128;
};

struct AttentionOutput {
  std::vector<float> out;  // [Hq][D], normalized, rotated basis (V basis)
  std::vector<float> lse;  // [Hq], natural log; -inf when no token was attended
};

// Attention of `q` ([Hq][D], rotated) over `n` BF16 rows of K and V, each [n][Hkv][D].
AttentionOutput AttendBf16Rows(const AttentionShape& shape, absl::Span<const float> q,
                               absl::Span<const Bf16> k, absl::Span<const Bf16> v, int n);

// Attention over `tokens` tokens stored in consecutive paged blocks (`blocks[i]` holds tokens
// [i*layout.tokens, (i+1)*layout.tokens); the last block may be partly filled). The codec
// decodes the stored K/V (any bits, including the BF16 bypass).
AttentionOutput AttendBlocks(const AttentionShape& shape, const RowCodec& codec,
                             const BlockLayout& layout, absl::Span<const uint8_t* const> blocks,
                             int tokens, absl::Span<const float> q);

// The same over `tokens` tokens that start at slot `first_slot` (0 <= first_slot < T) of
// `blocks[0]` and continue through the following blocks. AttendBlocks is first_slot = 0.
AttentionOutput AttendBlocksFrom(const AttentionShape& shape, const RowCodec& codec,
                                 const BlockLayout& layout, absl::Span<const uint8_t* const> blocks,
                                 int first_slot, int tokens, absl::Span<const float> q);

// Folds `part` into `acc` so that `acc` covers the union of both token sets (exact merge
// through the log-sum-exp). Either side may be empty (lse = -inf).
void MergeAttention(const AttentionShape& shape, const AttentionOutput& part, AttentionOutput* acc);

// Dense reference in float64 over fp32 K/V rows ([n][Hkv][D]); used by tests and benchmarks.
AttentionOutput DenseAttentionReference(const AttentionShape& shape, absl::Span<const float> q,
                                        absl::Span<const float> k, absl::Span<const float> v,
                                        int n);

}  // namespace kvpool
