// The paged KV description: the one contract between the block pool, the compute backends and
// the kernel launchers (FlashInfer's paged_kv_t is the model). Plain, trivially copyable structs
// of pointers, int32 block ids and layouts, no CUDA types: the pool view (PagedKvView), one tier of
// every sequence of a batch (PagedKvTier) and a decode batch (PagedKvBatch). A batch whose arrays
// lie in a GPU copy of PagedKvTables::words() is the same struct with its array pointers moved
// there (RebaseArrays), so nothing translates between forms on the way to a kernel.
//
//   PagedKvTables tables(history_pool, bf16_pool, sequences);   // one int32 allocation
//   const PagedKvBatch& host = tables.batch();                   // arrays in host memory
//   cudaMemcpyAsync(dev, tables.words().data(), tables.words().size() * 4, ...);
//   const PagedKvBatch device = RebaseArrays(host, tables.words().data(), dev);
//
// Thread-safety: plain values; PagedKvTables is immutable once built.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "absl/types/span.h"
#include "kernels/block_layout.h"
#include "kernels/codec_config.h"
#include "kernels/paged_kv_tier.h"

namespace kvpool {

// The blocks of one layout in a pool (of one layer, or of all layers when block ids are global):
// block b starts at pool + b * stride_bytes(); ids outside [0, num_blocks) are invalid. The
// layout must be BlockLayout::ForModel(cfg, Hkv, D) of the QuantConfig the blocks are read with.
//
// `block_stride` (bytes, a multiple of 16) decouples block ids from the block size. 0 means
// layout.block_bytes() (dense blocks). A pool that holds blocks of several sizes at aligned
// offsets (kvpoold's slab arena) uses a small stride, so a block's id is its byte offset / stride.
struct PagedKvView {
  uint8_t* pool = nullptr;
  BlockLayout layout;
  ScaleDtype scale_dtype = ScaleDtype::kFp16;
  int64_t num_blocks = 0;
  int64_t block_stride = 0;

  int64_t stride_bytes() const {
    return block_stride > 0 ? block_stride : static_cast<int64_t>(layout.block_bytes());
  }
  // Start of block `id` (pool memory: host or device, as `pool`).
  uint8_t* Block(int32_t id) const { return pool + static_cast<int64_t>(id) * stride_bytes(); }
};

// A decode batch of one model and layer: sequence (query row) i attends over its BF16 sink, INT2
// history and BF16 recent tokens. The token bounds are host values (the kernels plan with them).
struct PagedKvBatch {
  PagedKvView history_pool;  // the history tier's blocks (the model's codec)
  PagedKvView bf16_pool;     // the sink and recent tiers' BF16 pages (layout bits 16)
  int32_t num_seqs = 0;
  int32_t max_history_tokens = 0;  // upper bound of any sequence's history tokens
  int32_t max_bf16_tokens = 0;     // upper bound of any sequence's sink + recent tokens
  PagedKvTier sink;                // in bf16_pool
  PagedKvTier history;             // in history_pool
  PagedKvTier recent;              // in bf16_pool

  // Sequences [first, first + count): the same pools and bounds, the arrays advanced.
  PagedKvBatch Rows(int first, int count) const;
};

static_assert(std::is_trivially_copyable_v<PagedKvBatch>);

// `batch` with its arrays moved from the int32 words at `from` (where they lie) to a copy of the
// same words at `to` (a device copy of PagedKvTables::words(), say).
PagedKvBatch RebaseArrays(const PagedKvBatch& batch, const int32_t* from, const int32_t* to);

// The host arrays of a PagedKvBatch, in one int32 allocation so that one copy moves them.
class PagedKvTables {
 public:
  // One tier of one sequence: tokens [first_token, first_token + num_tokens) of `blocks` (block
  // ids; block j holds positions [j * T, (j + 1) * T)).
  struct Tier {
    absl::Span<const int32_t> blocks;
    int32_t first_token = 0;
    int32_t num_tokens = 0;
  };
  // One sequence's tiers, attended by `rows` consecutive query rows of the batch.
  struct Sequence {
    Tier sink;
    Tier history;
    Tier recent;
    int rows = 1;
  };

  // The batch of `sequences` (row after row) over the two pools. Block table rows are padded
  // with block 0 to the longest sequence's tier (at least one entry).
  PagedKvTables(const PagedKvView& history_pool, const PagedKvView& bf16_pool,
                absl::Span<const Sequence> sequences);
  PagedKvTables(const PagedKvTables&) = delete;
  PagedKvTables& operator=(const PagedKvTables&) = delete;

  // Every array of batch(), in one allocation.
  absl::Span<const int32_t> words() const { return words_; }
  // The description, its arrays in words().
  const PagedKvBatch& batch() const { return batch_; }

 private:
  std::vector<int32_t> words_;
  PagedKvBatch batch_;
};

}  // namespace kvpool
