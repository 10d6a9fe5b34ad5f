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
//   c. out^T = M_V o'^T on the tensor cores (UnrotateGroup): warp w takes the 16-row tiles w,
//      w + warps, ... of M_V (prefetched into L1 before the grid-dependency wait). It used to run
//      on the CUDA cores, 8 x D x D multiply-adds and a butterfly of shuffles per row of M_V in
//      one CTA (NOTES.md, run 11: the tail merge at batch 32 x 32K 5 % faster on the tensor cores;
//      at small batches the parts' reads, not this phase, keep a CTA per group slower).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/attention_params.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/mma.cuh"

namespace kvpool::cuda::internal {

inline constexpr int kMergeGroupThreads = 256;
inline constexpr int kMergeMaxGroup = 8;

// Shared memory of MergeGroup for a CTA of kThreads threads.
template <int kD, int kThreads>
struct MergeGroupSmem {
  static constexpr int kItems = kMergeMaxGroup * kD / 4;  // (query, float4 column) items
  float wts[kMergeMaxGroup][kMaxParts];
  __align__(16) float o_rot[kMergeMaxGroup][kD];
  __align__(16) float4 slice_acc[kThreads > kItems ? kThreads : kItems];
  float out_s[kMergeMaxGroup][kD];
  uint32_t o_max_bits[kMergeMaxGroup];  // max |o'[n]| as float bits (non-negative floats order as
                                        // their bits)
};

// out[n][j] = sum_i o'[n][i] M_V[j][i] for the queries n < group of o' (shared memory) into
// out_s, on the tensor cores: out^T [D x 8] = M_V [D x D] o'^T [D x 8] (mma.m16n8k16, A = 16 rows
// of M_V, B column n = query n). Both operands are split into fp16 high and low parts, and the
// products hi*hi, hi*lo and lo*hi are summed, after power-of-two scaling that keeps every part
// normal: M_V by 2^10 (orthogonal, so |m| <= 1) and o'[n] by 2^(14 - e_n), where
// max |o'[n]| < 2^e_n. Warp w takes the row tiles w, w + warps, ... Reads M_V through the
// non-coherent path (constant input).
template <int kD, int kThreads>
__device__ __forceinline__ void UnrotateGroup(const AttentionParams& p, int group,
                                              MergeGroupSmem<kD, kThreads>& sm) {
  constexpr int kWarps = kThreads / kWarpSize;
  constexpr int kTiles = kD / 16;  // row tiles of M_V and k-steps over i
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int g = lane / 4;
  const int t = lane % 4;
  auto exponent = [&](int n) {  // e_n, 0 for an all-zero o'[n]
    int e = 0;
    const float m = __uint_as_float(sm.o_max_bits[n]);
    if (m > 0.f) frexpf(m, &e);
    return e;
  };
  // B operands of k-step ks: column g = query g (zero past the group), rows 2t, 2t+1 | 2t+8, 2t+9.
  uint32_t bh[kTiles][2], bl[kTiles][2];
  const bool g_valid = g < group;
  const float scale = g_valid ? ldexpf(1.f, 14 - exponent(g)) : 0.f;
  const float* orow = sm.o_rot[g_valid ? g : 0] + 2 * t;
#pragma unroll
  for (int ks = 0; ks < kTiles; ++ks) {
    const float2 x0 = *reinterpret_cast<const float2*>(orow + 16 * ks);
    const float2 x1 = *reinterpret_cast<const float2*>(orow + 16 * ks + 8);
    SplitHalf2(x0.x * scale, x0.y * scale, bh[ks][0], bl[ks][0]);
    SplitHalf2(x1.x * scale, x1.y * scale, bh[ks][1], bl[ks][1]);
  }
  // The accumulator columns 2t, 2t+1 are queries 2t, 2t+1: undo 2^10 and their o' scales.
  const int n0 = 2 * t;
  const int n1 = 2 * t + 1;
  const float unscale0 = n0 < group ? ldexpf(1.f, exponent(n0) - 24) : 0.f;
  const float unscale1 = n1 < group ? ldexpf(1.f, exponent(n1) - 24) : 0.f;
  for (int mt = warp; mt < kTiles; mt += kWarps) {
    // A operand rows g, g + 8 of the tile; columns 2t, 2t+1 | 2t+8, 2t+9 of k-step ks.
    const float* r0 = p.rotation_v + static_cast<int64_t>(16 * mt + g) * kD + 2 * t;
    const float* r1 = r0 + 8 * kD;
    float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int ks = 0; ks < kTiles; ++ks) {
      const float2 m00 = __ldg(reinterpret_cast<const float2*>(r0 + 16 * ks));
      const float2 m10 = __ldg(reinterpret_cast<const float2*>(r1 + 16 * ks));
      const float2 m01 = __ldg(reinterpret_cast<const float2*>(r0 + 16 * ks + 8));
      const float2 m11 = __ldg(reinterpret_cast<const float2*>(r1 + 16 * ks + 8));
      uint32_t ah[4], al[4];
      SplitHalf2(m00.x * 1024.f, m00.y * 1024.f, ah[0], al[0]);
      SplitHalf2(m10.x * 1024.f, m10.y * 1024.f, ah[1], al[1]);
      SplitHalf2(m01.x * 1024.f, m01.y * 1024.f, ah[2], al[2]);
      SplitHalf2(m11.x * 1024.f, m11.y * 1024.f, ah[3], al[3]);
      MmaF16(c, ah, bh[ks]);
      MmaF16(c, ah, bl[ks]);
      MmaF16(c, al, bh[ks]);
    }
    const int j = 16 * mt + g;
    if (n0 < group) {
      sm.out_s[n0][j] = c[0] * unscale0;
      sm.out_s[n0][j + 8] = c[2] * unscale0;
    }
    if (n1 < group) {
      sm.out_s[n1][j] = c[1] * unscale1;
      sm.out_s[n1][j + 8] = c[3] * unscale1;
    }
  }
}

// M_V into L1 for MergeGroup's phase c, a share of the rows per warp (constant input: this may
// run before the attention kernels finish).
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
  constexpr int kVec = kD / 4;  // float4 columns of a row (phase b)
  constexpr int kLsePerLane = kMaxParts / kWarpSize;
  static_assert(kD == 64 || kD == 128, "head dim 64 or 128");
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
    if (lane == 0) {
      p.lse[row] = m == kNegInf ? kNegInf : (m + log2f(l)) * 0.69314718055994531f;
      sm.o_max_bits[n] = 0u;
    }
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
    const float mx = fmaxf(fmaxf(fabsf(o.x), fabsf(o.y)), fmaxf(fabsf(o.z), fabsf(o.w)));
    atomicMax(&sm.o_max_bits[item / kVec], __float_as_uint(mx));
  }
  __syncthreads();

  float* out = p.out + row0 * kD;
  if (p.rotation_v == nullptr) {
    for (int idx = tid; idx < group * kD; idx += kThreads) out[idx] = sm.o_rot[idx / kD][idx % kD];
    return;
  }
  // c. Un-rotation on the tensor cores.
  UnrotateGroup<kD, kThreads>(p, group, sm);
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
