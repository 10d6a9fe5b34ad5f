// Merge of a KV head group's parts (included by decode_attention.cuh before the attention
// kernels, which also call it as their tail merge; GQA groups of up to 8).
//
// One CTA per (KV head, sequence) merges all of the group's query heads, so each CTA reads the
// output rotation M_V once for up to 8 heads (MergeHeadKernel reads it once per query head, far
// more L2 traffic than the partial results at large batches; NOTES.md, run 7). It runs as the
// merge kernel (MergeGroupKernel) or as the tail merge (MergeIfLastPart) from as many
// (sequence, KV head) groups as SMs; with fewer, MergeHeadKernel's additional CTAs win (runs 7
// and 8). Every phase keeps its loads independent (no chains of L2 round trips):
//   a. warp n < group: weights w_k = exp2(lse_k - max) / sum of query n's parts (parts spread
//      over the lanes, warp shuffles), and the merged LSE;
//   b. thread (slice, query, float4 column) sums w_k * part_k over parts k = slice, slice +
//      slices, ... ; the slices are added in a fixed order through shared memory;
//   c. out[n][j] = sum_i o'[n][i] * M_V[j][i]: warp w takes rows j of M_V (a coalesced row per
//      load, prefetched into L1 before the grid-dependency wait), its lanes run along i, and the
//      8 queries' partial dots are reduced by a halving butterfly (9 shuffles per row, not 40).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/attention_params.h"
#include "kernels/cuda/device_common.cuh"

namespace kvpool::cuda::internal {

inline constexpr int kMergeGroupThreads = 256;
inline constexpr int kMergeMaxGroup = 8;

// Halving butterfly: lane l holds partial sums d[0..7] of 8 queries; afterwards d[0] of lane l
// is the warp's total for query (l >> 2) & 7 (each step keeps half of the queries and adds the
// partner lane's sums of the same half).
__device__ __forceinline__ float ReduceEightOverWarp(float (&d)[kMergeMaxGroup], int lane) {
#pragma unroll
  for (int width = kMergeMaxGroup / 2, mask = 16; width >= 1; width /= 2, mask /= 2) {
    const bool upper = (lane & mask) != 0;
#pragma unroll
    for (int q = 0; q < width; ++q) {
      const float keep = upper ? d[q + width] : d[q];
      const float send = upper ? d[q] : d[q + width];
      d[q] = keep + __shfl_xor_sync(kFullMask, send, mask);
    }
  }
  d[0] += __shfl_xor_sync(kFullMask, d[0], 2);
  d[0] += __shfl_xor_sync(kFullMask, d[0], 1);
  return d[0];
}

// Shared memory of MergeGroup for a CTA of kThreads threads.
template <int kD, int kThreads>
struct MergeGroupSmem {
  static constexpr int kItems = kMergeMaxGroup * kD / 4;  // (query, float4 column) items
  float wts[kMergeMaxGroup][kMaxParts];
  __align__(16) float o_rot[kMergeMaxGroup][kD];
  __align__(16) float4 slice_acc[kThreads > kItems ? kThreads : kItems];
  float out_s[kMergeMaxGroup][kD];
};

// The rows of M_V that warp `warp` of a kThreads CTA reads in MergeGroup's phase c, into L1
// (constant input: this may run before the attention kernels finish).
template <int kD, int kThreads>
__device__ __forceinline__ void PrefetchMergeRows(const AttentionParams& p) {
  constexpr int kRowsPerWarp = kD / (kThreads / kWarpSize);
  if (p.rotation_v == nullptr) return;
  const int warp = threadIdx.x / kWarpSize;
  const float* rows = p.rotation_v + static_cast<int64_t>(warp) * kRowsPerWarp * kD;
  constexpr int kLines = kRowsPerWarp * kD * 4 / 128;
  for (int l = threadIdx.x % kWarpSize; l < kLines; l += kWarpSize) {
    asm volatile("prefetch.global.L1 [%0];\n" ::"l"(rows + 32 * l));
  }
}

// Merges every part of the query heads of (KV head `kv_head`, sequence `b`) and un-rotates the
// output, with all kThreads threads of the CTA (p.group <= kMergeMaxGroup). The parts may have
// been written by other CTAs of a kernel still running (the tail merge), so they are read
// through L2 (ld.global.cg), never through the non-coherent path.
template <int kD, int kThreads>
__device__ __forceinline__ void MergeGroup(const AttentionParams& p, int kv_head, int b,
                                           MergeGroupSmem<kD, kThreads>& sm) {
  constexpr int kWarps = kThreads / kWarpSize;
  constexpr int kVec = kD / 4;               // float4 columns of a row (phase b)
  constexpr int kPerLane = kD / kWarpSize;   // dims i of a lane (phase c)
  constexpr int kRowsPerWarp = kD / kWarps;  // rows j of M_V per warp (phase c)
  constexpr int kLsePerLane = kMaxParts / kWarpSize;
  static_assert(kPerLane == 2 || kPerLane == 4, "head dim 64 or 128");
  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int group = p.group;
  const int parts = p.num_parts;
  const int64_t row0 = static_cast<int64_t>(b) * p.q_heads + kv_head * group;

  // a. Weights and LSE of queries warp, warp + kWarps, ...
  for (int n = warp; n < group; n += kWarps) {
    const int64_t row = row0 + n;
    float v[kLsePerLane];
    float m = kNegInf;
#pragma unroll
    for (int r = 0; r < kLsePerLane; ++r) {
      const int k = lane + kWarpSize * r;
      v[r] = k < parts ? __ldcg(p.part_lse + row * parts + k) : kNegInf;
      m = fmaxf(m, v[r]);
    }
    for (int o = 16; o >= 1; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kFullMask, m, o));
    float l = 0.f;
#pragma unroll
    for (int r = 0; r < kLsePerLane; ++r) {
      v[r] = m != kNegInf ? exp2f(v[r] - m) : 0.f;
      l += v[r];
    }
    for (int o = 16; o >= 1; o >>= 1) l += __shfl_xor_sync(kFullMask, l, o);
    const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
    for (int r = 0; r < kLsePerLane; ++r) {
      const int k = lane + kWarpSize * r;
      if (k < parts) sm.wts[n][k] = v[r] * inv;
    }
    if (lane == 0) p.lse[row] = m == kNegInf ? kNegInf : (m + log2f(l)) * 0.69314718055994531f;
  }
  __syncthreads();

  // b. o'[n] = sum_k w[n][k] part_k[n]: work item (slice, n, c) sums parts k = slice,
  // slice + slices, ...; the slices are added in a fixed order.
  const int items = group * kVec;
  const int slices = max(1, kThreads / items);
  for (int it = tid; it < slices * items; it += kThreads) {
    const int slice = it / items;
    const int item = it % items;
    const int n = item / kVec;
    const int c = item % kVec;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    const float4* src = reinterpret_cast<const float4*>(p.part_out + (row0 + n) * parts * kD) + c;
#pragma unroll 8
    for (int k = slice; k < parts; k += slices) {
      const float w = sm.wts[n][k];
      const float4 x = __ldcg(src + static_cast<int64_t>(k) * kVec);
      FmaFloat4(acc, w, x);
    }
    sm.slice_acc[it] = acc;
  }
  __syncthreads();
  for (int item = tid; item < items; item += kThreads) {
    float4 o = sm.slice_acc[item];
    for (int s = 1; s < slices; ++s) {
      const float4 x = sm.slice_acc[s * items + item];
      AddFloat4(o, x);
    }
    *reinterpret_cast<float4*>(&sm.o_rot[item / kVec][4 * (item % kVec)]) = o;
  }
  __syncthreads();

  float* out = p.out + row0 * kD;
  if (p.rotation_v == nullptr) {
    for (int idx = tid; idx < group * kD; idx += kThreads) out[idx] = sm.o_rot[idx / kD][idx % kD];
    return;
  }
  // c. Un-rotation, out[n][j] = sum_i o'[n][i] M_V[j][i]: warp w takes rows j of M_V (a
  // coalesced row per load), its lanes dims i = kPerLane * lane + [0, kPerLane), and the 8
  // queries' partial dots are reduced by a halving butterfly.
  const float* mv_rows = p.rotation_v + static_cast<int64_t>(warp) * kRowsPerWarp * kD;
  float o[kMergeMaxGroup][kPerLane];
#pragma unroll
  for (int n = 0; n < kMergeMaxGroup; ++n) {
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      o[n][e] = n < group ? sm.o_rot[n][kPerLane * lane + e] : 0.f;
    }
  }
  const int my_query = (lane >> 2) & 7;
#pragma unroll 4
  for (int r = 0; r < kRowsPerWarp; ++r) {
    float mv[kPerLane];
    if constexpr (kPerLane == 4) {
      const float4 x = __ldg(reinterpret_cast<const float4*>(mv_rows + r * kD) + lane);
      mv[0] = x.x;
      mv[1] = x.y;
      mv[2] = x.z;
      mv[3] = x.w;
    } else {
      const float2 x = __ldg(reinterpret_cast<const float2*>(mv_rows + r * kD) + lane);
      mv[0] = x.x;
      mv[1] = x.y;
    }
    float d[kMergeMaxGroup];
#pragma unroll
    for (int n = 0; n < kMergeMaxGroup; ++n) {
      d[n] = o[n][0] * mv[0];
#pragma unroll
      for (int e = 1; e < kPerLane; ++e) d[n] = __fmaf_rn(o[n][e], mv[e], d[n]);
    }
    const float total = ReduceEightOverWarp(d, lane);
    if ((lane & 3) == 0 && my_query < group) sm.out_s[my_query][warp * kRowsPerWarp + r] = total;
  }
  __syncthreads();
  for (int idx = tid; idx < group * kD; idx += kThreads) out[idx] = sm.out_s[idx / kD][idx % kD];
}

// Grid (kv_heads, num_seqs), kMergeGroupThreads threads; p.group <= kMergeMaxGroup.
template <int kD>
__global__ void __launch_bounds__(kMergeGroupThreads) MergeGroupKernel(const AttentionParams p) {
  __shared__ MergeGroupSmem<kD, kMergeGroupThreads> sm;
  PrefetchMergeRows<kD, kMergeGroupThreads>(p);
  GridDependencyWait();
  MergeGroup<kD, kMergeGroupThreads>(p, blockIdx.x, blockIdx.y, sm);
}

// Tail merge (p.merge_counters set): called by every CTA of the attention kernels after it wrote
// its part of (sequence b, KV head kv_head); the CTA that completes the pair's last part merges
// them. Each thread's part writes are made visible device-wide before one thread counts the
// part (the fence-then-count order of a split-K reduction), and the merging CTA fences again
// before it reads the others' parts. `smem` is free shared memory of at least
// sizeof(MergeGroupSmem<kD, kThreads>) bytes, 16-byte aligned.
template <int kD, int kThreads>
__device__ __forceinline__ void MergeIfLastPart(const AttentionParams& p, int kv_head, int b,
                                                void* smem) {
  __shared__ int is_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int done =
        atomicAdd(p.merge_counters + static_cast<int64_t>(b) * p.kv_heads + kv_head, 1);
    is_last = done == p.num_parts - 1;
  }
  __syncthreads();
  if (is_last == 0) return;
  __threadfence();
  PrefetchMergeRows<kD, kThreads>(p);
  MergeGroup<kD, kThreads>(p, kv_head, b, *static_cast<MergeGroupSmem<kD, kThreads>*>(smem));
}

}  // namespace kvpool::cuda::internal
