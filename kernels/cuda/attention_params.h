// Internal: plain parameter structs of the decode attention kernels and their launchers (filled
// by cuda_attention.cc, read by decode_attention.cuh). No CUDA types, no Abseil.
#pragma once

#include <cstdint>

#include "kernels/cuda/codec_params.h"
#include "kernels/paged_kv_tier.h"

struct CUstream_st;

namespace kvpool::cuda::internal {

struct AttentionParams {
  const uint8_t* int2_pool;
  BlockGeometry int2_geo;
  const uint8_t* bf16_pool;
  BlockGeometry bf16_geo;
  PagedKvTier sink;  // the batch's tiers, arrays in device memory
  PagedKvTier history;
  PagedKvTier recent;
  int32_t num_seqs;
  int32_t q_heads;
  int32_t kv_heads;
  int32_t group;  // q_heads / kv_heads
  int32_t scale_is_bf16;
  float softmax_scale_log2;  // log2(e) / sqrt(D)

  const float* queries;     // [num_seqs][q_heads][D] fp32, original basis
  const float* rotation_k;  // D x D or nullptr
  const float* rotation_v;  // D x D or nullptr
  float* q_rot;             // workspace [num_seqs][q_heads][D]
  float* q_sum;             // workspace [num_seqs][q_heads]: sum of the rotated query
  float* q_scale;           // workspace [num_seqs][q_heads]: power of two, max|q| * it < 2^14
  float* part_out;          // workspace [num_seqs][q_heads][num_parts][D]
  float* part_lse;          // workspace [num_seqs][q_heads][num_parts], log2 domain
  int32_t num_parts;        // history_chunks + bf16_chunks
  int32_t history_chunks;
  int32_t history_chunk_tokens;  // multiple of 64 (of 128 for Int2HistoryKernel)
  int32_t bf16_chunks;
  int32_t bf16_chunk_tokens;  // multiple of 64
  float* out;                 // [num_seqs][q_heads][D] fp32, original basis
  float* lse;                 // [num_seqs][q_heads], natural log
  int32_t use_pdl;  // 1: every kernel after the query rotation is a programmatic dependent launch
  int32_t history_async_copies;  // 1: Int2HistoryKernel fills its ring with asynchronous copies
  int32_t history_narrow;        // 1: Int2HistoryKernel in the narrow layout (groups of up to 4)
  int32_t merge_per_group;     // 1: MergeGroupKernel (a CTA per KV head group), 0: MergeHeadKernel
  int32_t bf16_after_history;  // 1: the BF16 tier kernel runs beside the INT2 history (PDL)
  // Workspace [num_seqs][kv_heads]: parts written per (sequence, KV head), for the tail merge
  // (the attention CTA that writes a pair's last part merges it; no merge kernel). nullptr: the
  // merge kernel that merge_per_group names.
  int32_t* merge_counters;
};

// The attention kernels whose occupancy decides the split of the work.
enum class AttentionKernelKind : int32_t {
  kHistory = 0,            // Int2HistoryKernel, wide layout (kGroupTiles = 1)
  kHistoryNarrow = 1,      // Int2HistoryKernel, narrow layout (kGroupTiles = 1)
  kHistoryLargeGroup = 2,  // Int2HistoryLargeGroupKernel (kGroupTiles = 2)
  kBf16Tiers = 3,          // Bf16TierKernel
};

// Enqueues the whole decode step (query rotation, BF16 tiers, INT2 history, merge and output
// un-rotation). kD in {64, 128}; kGroupTiles = ceil(group / 8) in {1, 2}. Returns a
// cudaError_t value.
template <int kD, int kGroupTiles>
int LaunchDecodeAttention(const AttentionParams& p, CUstream_st* stream);

// Resident CTAs per SM of one attention kernel, from the occupancy calculator; a negative
// cudaError_t value on failure (also for a kind that kGroupTiles does not launch).
template <int kD, int kGroupTiles>
int AttentionCtasPerSm(AttentionKernelKind kind);

}  // namespace kvpool::cuda::internal
