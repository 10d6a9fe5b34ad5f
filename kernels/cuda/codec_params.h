// Internal: the plain parameter structs that the host entry points (cuda_codec.cc) fill and the
// CUDA kernels (*.cu) read, plus the launchers the instantiation files define. No CUDA types and
// no Abseil here, so both g++ and nvcc include it. Not part of the public API.
#pragma once

#include <cstdint>

#include "kernels/value_range.h"

struct CUstream_st;

namespace kvpool::cuda::internal {

// Error bits a kernel ORs into the caller's device error word.
inline constexpr uint32_t kErrorNonFinite = 1u;   // a row (after rotation) holds NaN or Inf
inline constexpr uint32_t kErrorOutOfRange = 2u;  // |x| >= 2^16, or scale or min overflows
inline constexpr uint32_t kErrorBadBlock = 4u;    // a block table entry outside [0, num_blocks)

// The byte geometry of one block (kernels/block_layout.h), precomputed on the host from
// BlockLayout so that device code never re-derives it.
struct BlockGeometry {
  int64_t block_bytes;
  int64_t head_segment_bytes;
  int64_t codes_offset[2];  // [K, V] offset of head 0's codes inside a block
  int64_t meta_offset[2];   // [K, V] offset of head 0's meta inside a block
  int32_t code_bytes_per_row;
  int32_t meta_bytes_per_row;
  int32_t tokens;  // tokens per block
  int32_t kv_heads;
  int32_t head_dim;
  int32_t group_size;
  int32_t bits;        // 2, 4 or 16 (BF16 bypass)
  int64_t num_blocks;  // valid block ids are [0, num_blocks)
};

// A batch of sequences, each contributing consecutive input rows.
struct BatchParams {
  const int32_t* row_offsets;   // [num_seqs + 1]
  const int32_t* first_token;   // [num_seqs]: sequence position of the sequence's first row
  const int32_t* block_tables;  // [num_seqs][block_table_stride]
  int32_t block_table_stride;
  int32_t num_seqs;
  int32_t total_rows;
};

// Arrival rows that already sit in BF16 bypass pages of a pool (demotion): row r of sequence i
// is token first_token[i] + r, through block_tables (the batch's row_offsets are shared).
struct PagedRowSource {
  const uint8_t* pool;  // nullptr: the rows are ArrivalParams::rows
  BlockGeometry geo;    // bits 16
  const int32_t* first_token;
  const int32_t* block_tables;
  int32_t block_table_stride;
};

struct ArrivalParams {
  BlockGeometry geo;
  BatchParams batch;
  const uint16_t* rows;    // BF16 [total_rows][kv_heads][head_dim], original basis
  PagedRowSource paged;    // instead of rows when paged.pool != nullptr
  const float* rotation;   // D x D row-major fp32, nullptr for the identity
  uint16_t* rotated_rows;  // optional BF16 out, same shape as rows
  uint8_t* pool;
  uint32_t* error_word;
  int32_t tensor;          // 0 = K, 1 = V
  int32_t clip_rank;       // c of the clip order statistic, -1 = no clip
  int32_t scale_is_bf16;   // 0 = fp16 scale/min, 1 = bf16
  int32_t lloyd_max;       // 1 = Lloyd-Max quantizer (INT2, G = D)
  int32_t use_mma_kernel;  // 1 = ArrivalMmaKernel where it applies (ArrivalMmaFits)
  // nullptr, or per block table entry (batch.block_tables' shape) the running page checksum
  // (kernels/page_checksum.h) that the kernel adds the terms of its stored words to
  uint32_t* page_checksums;
};

// Several arrival jobs (a chunk's K and V of its sink, history and recent runs) for one launch
// of ArrivalMmaKernel: job blockIdx.y. The jobs must write disjoint rows.
inline constexpr int kMaxArrivalJobs = 6;
struct ArrivalJobsParams {
  ArrivalParams job[kMaxArrivalJobs];
  int32_t count;
};

struct DequantParams {
  BlockGeometry geo;
  BatchParams batch;
  const uint8_t* pool;
  uint16_t* out;  // BF16 [total_rows][kv_heads][head_dim]
  uint32_t* error_word;
  int32_t tensor;
  int32_t scale_is_bf16;
  const float* unrotation;  // nullptr: rotated basis; else the original one: x = x_rot U
};

// Launchers, one set per instantiation file. Return a cudaError_t value (0 on success).
// kD = 0 is the generic path (any supported head_dim at run time).
template <int kD>
int LaunchArrival(const ArrivalParams& p, CUstream_st* stream);
// One launch for every job when all of them take ArrivalMmaKernel; else launches nothing and
// returns kArrivalNotFused.
inline constexpr int kArrivalNotFused = -1;
template <int kD>
int LaunchArrivalJobs(const ArrivalJobsParams& p, CUstream_st* stream);
template <int kD>
int LaunchDequant(const DequantParams& p, CUstream_st* stream);

}  // namespace kvpool::cuda::internal
