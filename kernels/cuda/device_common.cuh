// Device helpers shared by the codec and attention kernels: 16-bit float words, warp constants,
// and addressing of rows inside paged blocks through a block table (codec_params.h).
//
//   const int seq = FindSequence(p.batch, row);
//   RowSlot slot = LocateRow(p.geo, p.batch, seq, row, head, tensor);
//   uint8_t* codes = pool + slot.codes;
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/cuda/codec_params.h"

namespace kvpool::cuda::internal {

inline constexpr unsigned kFullMask = 0xffffffffu;
inline constexpr int kWarpSize = 32;

__device__ __forceinline__ float Bf16BitsToFloat(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

// Round to nearest even, exactly as kvpool::Bf16::FromFloat.
__device__ __forceinline__ uint16_t FloatToBf16Bits(float f) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}

// The 16-bit scale/min word of a model's ScaleDtype (fp16 or bf16), round to nearest even.
__device__ __forceinline__ uint16_t FloatToScaleWord(float f, bool is_bf16) {
  return is_bf16 ? FloatToBf16Bits(f) : __half_as_ushort(__float2half_rn(f));
}

__device__ __forceinline__ float ScaleWordToFloat(uint16_t w, bool is_bf16) {
  return is_bf16 ? Bf16BitsToFloat(w) : __half2float(__ushort_as_half(w));
}

// acc += w * x and acc += x, element by element (fp32, no contraction across elements).
__device__ __forceinline__ void FmaFloat4(float4& acc, float w, const float4& x) {
  acc.x = __fmaf_rn(w, x.x, acc.x);
  acc.y = __fmaf_rn(w, x.y, acc.y);
  acc.z = __fmaf_rn(w, x.z, acc.z);
  acc.w = __fmaf_rn(w, x.w, acc.w);
}
__device__ __forceinline__ void AddFloat4(float4& acc, const float4& x) {
  acc.x += x.x;
  acc.y += x.y;
  acc.z += x.z;
  acc.w += x.w;
}

// Index of the sequence that owns input row `row` (binary search over row_offsets).
__device__ __forceinline__ int FindSequence(const BatchParams& b, int row) {
  int lo = 0;
  int hi = b.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(b.row_offsets + mid) <= row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Byte offsets, from the pool base, of one stored row (token of a sequence, KV head, tensor).
struct RowSlot {
  int64_t codes;
  int64_t meta;
  int64_t page;   // the block's first byte: codes - page is the row's offset inside its page
  int64_t entry;  // index of the block table entry: seq * block_table_stride + block index
  bool valid;     // false when the block table entry is outside [0, num_blocks)
};

__device__ __forceinline__ RowSlot LocateRow(const BlockGeometry& g, const BatchParams& b, int seq,
                                             int row, int head, int tensor) {
  const int position = __ldg(b.first_token + seq) + (row - __ldg(b.row_offsets + seq));
  // Blocks are powers of two tokens in every layout kvpool builds: a shift, not a division.
  const int block_index =
      (g.tokens & (g.tokens - 1)) == 0 ? position >> (__ffs(g.tokens) - 1) : position / g.tokens;
  const int slot = position - block_index * g.tokens;
  const int64_t entry = static_cast<int64_t>(seq) * b.block_table_stride + block_index;
  const int32_t block = __ldg(b.block_tables + entry);
  RowSlot r;
  r.valid = block >= 0 && block < g.num_blocks;
  r.page = static_cast<int64_t>(block) * g.block_bytes;
  r.entry = entry;
  const int64_t base = r.page + static_cast<int64_t>(head) * g.head_segment_bytes;
  r.codes = base + g.codes_offset[tensor] + static_cast<int64_t>(slot) * g.code_bytes_per_row;
  r.meta = base + g.meta_offset[tensor] + static_cast<int64_t>(slot) * g.meta_bytes_per_row;
  return r;
}

// Input row `row_head` (= row * kv_heads + head, of sequence `seq`) of an arrival: a flat row, or
// a BF16 row in the pages of p.paged (nullptr when its block id is outside the source pool).
__device__ __forceinline__ const uint16_t* ArrivalRowPtr(const ArrivalParams& p, int head_dim,
                                                         int64_t row_head, int seq, int row,
                                                         int head) {
  if (p.paged.pool == nullptr) return p.rows + row_head * head_dim;
  BatchParams src = p.batch;
  src.first_token = p.paged.first_token;
  src.block_tables = p.paged.block_tables;
  src.block_table_stride = p.paged.block_table_stride;
  const RowSlot s = LocateRow(p.paged.geo, src, seq, row, head, p.tensor);
  return s.valid ? reinterpret_cast<const uint16_t*>(p.paged.pool + s.codes) : nullptr;
}

}  // namespace kvpool::cuda::internal
