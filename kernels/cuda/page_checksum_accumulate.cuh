// Page checksums fused into the kernels that write pool pages (arrival, demotion): each warp adds
// the terms (kernels/page_checksum.h) of the words it stores to its page's running sum with an
// atomic add. The sum is mod 2^32, order-free and additive over slots, so the total equals the
// CPU's PageSlotsChecksum of the written slots whatever the order of the warps; K and V, and the
// jobs of one launch, add to the same sums.
//
//   AddTileChecksums(p.page_checksums, entry, term);       // ArrivalMmaKernel, once per tile
//   AddRowChecksum(p.page_checksums + slot.entry, ...);    // ArrivalRowKernel, once per row
#pragma once

#include <cstdint>

#include "kernels/cuda/device_common.cuh"
#include "kernels/page_checksum.h"

namespace kvpool::cuda::internal {

// For a tile of the tensor-core arrival kernel (lane quads own rows g and g + 8): entry[r] is the
// sums index of the lane's row r (-1 when it wrote nothing) and term[r] the lane's terms of it.
// One atomic per warp when every written row of the tile lies in one page (the usual case: a
// tile's rows are consecutive tokens of one block), else one per written row. Warp-uniform.
__device__ __forceinline__ void AddTileChecksums(uint32_t* sums, const int (&entry)[2],
                                                 const uint32_t (&term)[2]) {
  const int top = __reduce_max_sync(kFullMask, max(entry[0], entry[1]));
  if (top < 0) return;
  const bool one_page =
      __all_sync(kFullMask, (entry[0] < 0 || entry[0] == top) && (entry[1] < 0 || entry[1] == top));
  if (one_page) {
    const uint32_t s = __reduce_add_sync(kFullMask, term[0] + term[1]);
    if (threadIdx.x % kWarpSize == 0) atomicAdd(sums + top, s);
    return;
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    uint32_t s = term[r];
    s += __shfl_xor_sync(kFullMask, s, 1);
    s += __shfl_xor_sync(kFullMask, s, 2);
    if (threadIdx.x % 4 == 0 && entry[r] >= 0) atomicAdd(sums + entry[r], s);
  }
}

// For the warp-per-row kernels, after the warp stored one row (its `code_bytes` at pool + codes,
// its `meta_bytes` at pool + meta, in the page at pool + page): reads the row back (the warp's own
// stores, ordered by the __syncwarp) and adds its terms to *sum. Warp-uniform.
__device__ __forceinline__ void AddRowChecksum(uint32_t* sum, const uint8_t* pool, int64_t page,
                                               int64_t codes, int64_t meta, int code_bytes,
                                               int meta_bytes) {
  __syncwarp();
  const int lane = threadIdx.x % kWarpSize;
  const int code_words = code_bytes / 4;
  const int words = code_words + meta_bytes / 4;
  uint32_t s = 0;
  for (int w = lane; w < words; w += kWarpSize) {
    const int64_t at = w < code_words ? codes + 4 * w : meta + 4 * (w - code_words);
    s += PageChecksumTerm(*reinterpret_cast<const uint32_t*>(pool + at),
                          static_cast<uint32_t>(at - page));
  }
  s = __reduce_add_sync(kFullMask, s);
  if (lane == 0) atomicAdd(sum, s);
}

}  // namespace kvpool::cuda::internal
