// PagedKvTier, the part of the paged KV description (kernels/paged_kv.h) that the attention
// kernels read on the device as it is: plain int32 arrays, no Abseil, no CUDA types.
#pragma once

#include <cstdint>

namespace kvpool {

// One tier (sink, history or recent) of every sequence of a batch: sequence i's tier holds the
// tokens at positions [first_token[i], first_token[i] + num_tokens[i]) of block table row i
// (entry p / T of the row holds position p at slot p % T, T = layout.tokens). The arrays are int32
// in one memory (host, or a device copy).
struct PagedKvTier {
  const int32_t* block_tables = nullptr;  // [num_seqs][block_table_stride] block ids
  int32_t block_table_stride = 0;
  const int32_t* first_token = nullptr;  // [num_seqs]
  const int32_t* num_tokens = nullptr;   // [num_seqs]
};

}  // namespace kvpool
