// INT2 paged decode attention on tensor cores (docs/oscar-method.md section 11, attention.h).
//
// One decode step of one layer is up to four launches on one stream:
//   1. RotateQueriesKernel   q' = q * M_K for each (sequence, KV head group); also the sum and
//                            a power-of-two scale of every rotated query.
//   2. Bf16TierKernel        attention over the BF16 sink + recent tokens, split in chunks.
//   3. INT2 history          attention over the INT2 history, split-K in chunks:
//                            Int2HistoryKernel (int2_history.cuh) for GQA groups of up to 8,
//                            Int2HistoryLargeGroupKernel (below) for groups of 9 to 16.
//   4. Merge                 exact log-sum-exp merge of all chunks, o = o' * M_V^T:
//                            MergeHeadKernel (a CTA per query head, below) or MergeGroupKernel
//                            (a CTA per KV head group, merge_group.cuh); none when the attention
//                            CTAs merge (the tail merge, MergeIfLastPart).
// Kernels 2 and 3 run only for tiers with work; cuda_attention.cc chooses the kernels and the
// split. Every chunk CTA writes a normalized partial output and its log2-sum-exp (-inf when
// empty), so no scratch needs clearing.
//
// Bf16TierKernel and Int2HistoryLargeGroupKernel (4 warps) work on 16-token tiles with
// mma.m16n8k16 (fp16 in, fp32 acc):
//   S^T[16 tokens x 8 queries] = K[16 x D] * Q^T          (tokens are the M dimension, up to 8
//   O^T[D x 8 queries]       += V^T[D x 16] * (P * s)^T    queries of the group are N)
// INT2 tier: the 2-bit codes become fp16 subnormals with one AND (mma.cuh ExtractCodes), the
// scale and minimum stay out of the inner loop:
//   q . k_t = s_t (q . c_t) + m_t sum(q)        sum_t p_t v_t = sum_t (p_t s_t) c_t + sum_t p_t m_t
// P^T moves from the accumulator layout to the B operand layout with movmatrix. The dims that a
// lane handles are chosen so that all its code loads are single coalesced 4- or 8-byte loads;
// the kernel maps them back when it writes the output.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/attention_params.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/mma.cuh"

namespace kvpool::cuda::internal {

inline constexpr int kAttnWarps = 4;
inline constexpr int kAttnThreads = kAttnWarps * kWarpSize;
inline constexpr int kTileTokens = 16;
inline constexpr int kChunkQuantum = kAttnWarps * kTileTokens;  // chunk sizes are multiples
inline constexpr int kPrefetchTiles = 6;  // L2 prefetch distance of the INT2 history, in tiles
inline constexpr float kNegInf = -__builtin_huge_valf();
inline constexpr int kMaxParts = 256;  // cuda_attention.cc keeps num_parts at or below this

// Byte offset, from the pool base, of a token's segment start for (block table, head): the
// caller adds codes/meta offsets and slot * row bytes.
struct TokenAddress {
  int64_t segment;  // block * block_bytes + head * head_segment_bytes
  int slot;
};

__device__ __forceinline__ TokenAddress AddressOf(const BlockGeometry& g, const int32_t* table,
                                                  int log2_tokens, int position, int head) {
  const int32_t block = __ldg(table + (position >> log2_tokens));
  TokenAddress a;
  a.segment = static_cast<int64_t>(block) * g.block_bytes +
              static_cast<int64_t>(head) * g.head_segment_bytes;
  a.slot = position & ((1 << log2_tokens) - 1);
  return a;
}

__device__ __forceinline__ float WarpMaxOverRows(float v) {
  // Max over the 8 lanes that share lane % 4 (the rows of a C fragment).
  v = fmaxf(v, __shfl_xor_sync(kFullMask, v, 4));
  v = fmaxf(v, __shfl_xor_sync(kFullMask, v, 8));
  v = fmaxf(v, __shfl_xor_sync(kFullMask, v, 16));
  return v;
}

__device__ __forceinline__ float WarpSumOverRows(float v) {
  v += __shfl_xor_sync(kFullMask, v, 4);
  v += __shfl_xor_sync(kFullMask, v, 8);
  v += __shfl_xor_sync(kFullMask, v, 16);
  return v;
}

// A operands of O^T += V^T (P s)^T for one 16-token tile: il[pr][h] holds 8 codes (one 16-bit
// chunk of a V row) of two tokens, token 2t + 8 pr in the low half and the next token in the high
// half; h picks one of the lane's two chunks at D = 128. Tile(mi) is M-tile mi (rows g, g + 8:
// codes mi and mi + kD / 16 of the lane's chunks; columns: the tokens).
//   - From the lane's V code words of tokens 2t, 2t+1, 2t+8, 2t+9 (dims (kD / 8) g + [0, kD / 8):
//     32 bits at D = 128, the low 16 bits at D = 64), interleaved by byte permutes: chunks 2g and
//     2g + 1 at D = 128.
//   - Or as ldmatrix.trans delivers them from a 16-token tile in shared memory
//     (FromInterleaved): chunks g and g + 8 at D = 128.
template <int kD>
struct VCodeOperands {
  uint32_t il[2][kD / 64];

  __device__ __forceinline__ VCodeOperands() = default;

  // il = {{w[0], w[1]}, {w[2], w[3]}} at D = 128, {{w[0]}, {w[1]}} at D = 64.
  __device__ __forceinline__ static VCodeOperands FromInterleaved(const uint32_t (&w)[4]) {
    VCodeOperands v;
#pragma unroll
    for (int pr = 0; pr < 2; ++pr) {
#pragma unroll
      for (int h = 0; h < kD / 64; ++h) v.il[pr][h] = w[pr * (kD / 64) + h];
    }
    return v;
  }

  __device__ __forceinline__ explicit VCodeOperands(const uint32_t (&vw)[4]) {
#pragma unroll
    for (int pr = 0; pr < 2; ++pr) {
      il[pr][0] = Permute(vw[2 * pr], vw[2 * pr + 1], 0x5410u);
      if constexpr (kD == 128) il[pr][1] = Permute(vw[2 * pr], vw[2 * pr + 1], 0x7632u);
    }
  }

  __device__ __forceinline__ void Tile(int mi, uint32_t (&a)[4]) const {
    const int ja = mi;
    const int jb = mi + kD / 16;
    a[0] = ExtractCodesAt(il[0][ja / 8], ja % 8);
    a[1] = ExtractCodesAt(il[0][jb / 8], jb % 8);
    a[2] = ExtractCodesAt(il[1][ja / 8], ja % 8);
    a[3] = ExtractCodesAt(il[1][jb / 8], jb % 8);
  }
};

// Programmatic dependent launch (PDL): the kernels after the query rotation are launched with
// programmatic stream serialization, so each can be scheduled while its predecessor still runs.
// Every CTA of every kernel executes GridDependencyWait() before it touches anything a predecessor
// writes (and before it exits), which keeps the chain transitive: kernel k+1 waits for kernel k,
// which waited for kernel k-1. Both are no-ops when the kernel was launched without the attribute.
// One exception (bf16_after_history, the default when both tiers have work): the BF16 tier
// kernel is launched after the INT2 history kernel and runs beside it, waiting for it only
// before it exits (Bf16TierKernel says why that is safe).
__device__ __forceinline__ void GridDependencyWait() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}
__device__ __forceinline__ void LaunchDependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// ---------------------------------------------------------------------------------------------
// 1. Query rotation. Grid (kv_heads, num_seqs), kRotSlices * kD threads: thread (slice, j)
// sums q[n][i] * M[i][j] over its quarter of i for every query n of the group (all its loads of
// M issued back to back), the slices are added in a fixed order through shared memory.
inline constexpr int kRotSlices = 4;

template <int kD>
__global__ void __launch_bounds__(kRotSlices* kD) RotateQueriesKernel(const AttentionParams p) {
  constexpr int kSpan = kD / kRotSlices;
  __shared__ __align__(16) float q_in[16][kD];
  __shared__ float red[kRotSlices][16][kD];
  LaunchDependents();
  const int b = blockIdx.y;
  const int head0 = blockIdx.x * p.group;
  const int slice = threadIdx.x / kD;
  const int j = threadIdx.x % kD;
  const int64_t row0 = static_cast<int64_t>(b) * p.q_heads + head0;
  // The thread's slice of M first: its loads need nothing and go out with the queries' loads
  // (after the barrier, they were a second memory round trip on this kernel's critical path).
  const int i0 = slice * kSpan;
  float m[kSpan];
  if (p.rotation_k != nullptr) {
#pragma unroll
    for (int i = 0; i < kSpan; ++i) m[i] = __ldg(p.rotation_k + (i0 + i) * kD + j);
  }
  for (int idx = threadIdx.x; idx < p.group * kD; idx += kRotSlices * kD) {
    q_in[idx / kD][idx % kD] = __ldg(p.queries + row0 * kD + idx);
  }
  __syncthreads();
  if (p.rotation_k != nullptr) {
    for (int n = 0; n < p.group; ++n) {
      float acc = 0.f;
#pragma unroll
      for (int i = 0; i < kSpan; i += 4) {
        const float4 q = *reinterpret_cast<const float4*>(&q_in[n][i0 + i]);
        acc = __fmaf_rn(q.x, m[i], acc);
        acc = __fmaf_rn(q.y, m[i + 1], acc);
        acc = __fmaf_rn(q.z, m[i + 2], acc);
        acc = __fmaf_rn(q.w, m[i + 3], acc);
      }
      red[slice][n][j] = acc;
    }
  }
  __syncthreads();
  // Thread (slice, j) finishes dim j of queries slice, slice + kRotSlices, ...
  for (int n = slice; n < p.group; n += kRotSlices) {
    float v = q_in[n][j];
    if (p.rotation_k != nullptr) {
      v = red[0][n][j];
#pragma unroll
      for (int s = 1; s < kRotSlices; ++s) v += red[s][n][j];
    }
    red[0][n][j] = v;
  }
  __syncthreads();
  // Before the first global write: a previous decode step may still read this workspace only
  // when this launch is itself programmatic (it is not; the wait keeps the rule uniform).
  GridDependencyWait();
  for (int idx = threadIdx.x; idx < p.group * kD; idx += kRotSlices * kD) {
    p.q_rot[row0 * kD + idx] = red[0][idx / kD][idx % kD];
  }
  // The tail merge's part count of this (sequence, KV head) starts at 0 (the attention CTAs
  // count only after this kernel completed).
  if (p.merge_counters != nullptr && threadIdx.x == 0) {
    p.merge_counters[static_cast<int64_t>(b) * p.kv_heads + blockIdx.x] = 0;
  }
  // Sum and scale of each query: warp w reduces queries w, w + warps, ...
  constexpr int kWarps = kRotSlices * kD / kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  for (int n = warp; n < p.group; n += kWarps) {
    float sum = 0.f;
    float max_abs = 0.f;
    for (int i = lane; i < kD; i += kWarpSize) {
      sum += red[0][n][i];
      max_abs = fmaxf(max_abs, fabsf(red[0][n][i]));
    }
    for (int o = 16; o >= 1; o >>= 1) {
      sum += __shfl_xor_sync(kFullMask, sum, o);
      max_abs = fmaxf(max_abs, __shfl_xor_sync(kFullMask, max_abs, o));
    }
    if (lane == 0) {
      int e = 0;
      float scale = 1.f;
      if (max_abs > 0.f) {
        frexpf(max_abs, &e);  // max_abs < 2^e
        scale = ldexpf(1.f, min(14 - e, 100));
      }
      p.q_sum[row0 + n] = sum;
      p.q_scale[row0 + n] = scale;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Per-warp online-softmax state for the queries of the lane's accumulator columns, and the
// accumulators of O^T. Column cc of n-tile nt is query nt * 8 + 2t + cc.
template <int kD, int kNT>
struct WarpState {
  static constexpr int kMTiles = kD / 16;
  float m[kNT][2];   // running max, log2 domain
  float l[kNT][2];   // lane-partial sum of p
  float pm[kNT][2];  // lane-partial sum of p * min (INT2 tier)
  float acc[kNT][kMTiles][4];

  __device__ __forceinline__ void Init() {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
        m[nt][cc] = kNegInf;
        l[nt][cc] = 0.f;
        pm[nt][cc] = 0.f;
      }
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
        for (int k = 0; k < 4; ++k) acc[nt][mi][k] = 0.f;
      }
    }
  }

  // Online softmax over one tile. logit[nt][cc][r] is the log2-domain logit of token row r
  // (0: g, 1: g + 8) for column (nt, cc), -inf when the token is absent; row_scale[r] and
  // row_min[r] are the tokens' V scale and minimum (1 and 0 for BF16 rows). Returns the B
  // operand (P * s)^T of the PV product in pb.
  __device__ __forceinline__ void Update(const float (&logit)[kNT][2][2],
                                         const float (&row_scale)[2], const float (&row_min)[2],
                                         uint32_t (&pb)[kNT][2]) {
    float m_new[kNT][2];
    bool grew = false;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
        const float tile_max = WarpMaxOverRows(fmaxf(logit[nt][cc][0], logit[nt][cc][1]));
        m_new[nt][cc] = fmaxf(m[nt][cc], tile_max);
        grew = grew || m_new[nt][cc] > m[nt][cc];
      }
    }
    // Rescale the running sums only when some running max grew (rare after the first tiles);
    // for the columns whose max did not grow the factor is exp2(0) = 1.
    if (__any_sync(kFullMask, grew)) {
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int cc = 0; cc < 2; ++cc) {
          const float m_use = m_new[nt][cc] == kNegInf ? 0.f : m_new[nt][cc];
          const float corr = FastExp2(m[nt][cc] - m_use);
          l[nt][cc] *= corr;
          pm[nt][cc] *= corr;
#pragma unroll
          for (int mi = 0; mi < kMTiles; ++mi) {
            acc[nt][mi][cc] *= corr;
            acc[nt][mi][2 + cc] *= corr;
          }
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      float ps[2][2];  // [cc][row]
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
        m[nt][cc] = m_new[nt][cc];
        const float m_use = m_new[nt][cc] == kNegInf ? 0.f : m_new[nt][cc];
        const float p0 = FastExp2(logit[nt][cc][0] - m_use);
        const float p1 = FastExp2(logit[nt][cc][1] - m_use);
        l[nt][cc] += p0 + p1;
        pm[nt][cc] = __fmaf_rn(p0, row_min[0], __fmaf_rn(p1, row_min[1], pm[nt][cc]));
        ps[cc][0] = p0 * row_scale[0];
        ps[cc][1] = p1 * row_scale[1];
      }
      // Rows g (tokens 0..7) and g + 8 (tokens 8..15) of P^T tile, columns 2t, 2t+1 -> transpose.
      pb[nt][0] = Transpose8x8(PackHalf2(ps[0][0], ps[1][0]));
      pb[nt][1] = Transpose8x8(PackHalf2(ps[0][1], ps[1][1]));
    }
  }
};

// Writes partial result `part` of sequence b, KV head kv_head: for each query q of the group the
// kAttnWarps warps' states (in shared memory, written before a __syncthreads: max m, sums l and
// pm at [w * kQ + q], O at [(w * kQ + q) * kD + dim]) combined and normalized.
template <int kD, int kQ>
__device__ __forceinline__ void CombineWarpStates(const AttentionParams& p, int b, int kv_head,
                                                  int part, const float* sm_o, const float* sm_m,
                                                  const float* sm_l, const float* sm_pm) {
  for (int idx = threadIdx.x; idx < p.group * kD; idx += kAttnThreads) {
    const int q = idx / kD;
    const int dim = idx % kD;
    float m_all = kNegInf;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) m_all = fmaxf(m_all, sm_m[w * kQ + q]);
    const int64_t row = (static_cast<int64_t>(b) * p.q_heads + kv_head * p.group + q);
    float o = 0.f;
    float lse = kNegInf;
    if (m_all != kNegInf) {
      float u = 0.f;
      float l = 0.f;
#pragma unroll
      for (int w = 0; w < kAttnWarps; ++w) {
        const float e = FastExp2(sm_m[w * kQ + q] - m_all);
        u = __fmaf_rn(e, sm_o[(w * kQ + q) * kD + dim] + sm_pm[w * kQ + q], u);
        l = __fmaf_rn(e, sm_l[w * kQ + q], l);
      }
      o = u / l;
      lse = m_all + __log2f(l);
    }
    p.part_out[(row * p.num_parts + part) * kD + dim] = o;
    if (dim == 0) p.part_lse[row * p.num_parts + part] = lse;
  }
}

// Writes the combined state of the CTA's warps as one normalized partial result. row_factor
// maps accumulator (mi, half) to its true scale; dims: thread (g, t) holds dims
// g * (kD / 8) + mi (rows g) and g * (kD / 8) + mi + kD / 16 (rows g + 8).
template <int kD, int kNT>
__device__ __forceinline__ void WritePartial(WarpState<kD, kNT>& st, const AttentionParams& p,
                                             int b, int kv_head, int part,
                                             const float (&row_factor)[kD / 16][2]) {
  constexpr int kQ = kNT * 8;
  constexpr int kMTiles = kD / 16;
  __shared__ float sm_o[kAttnWarps][kQ][kD];
  __shared__ float sm_m[kAttnWarps][kQ];
  __shared__ float sm_l[kAttnWarps][kQ];
  __shared__ float sm_pm[kAttnWarps][kQ];
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int g = lane / 4;
  const int t = lane % 4;
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
    for (int cc = 0; cc < 2; ++cc) {
      const float l = WarpSumOverRows(st.l[nt][cc]);
      const float pm = WarpSumOverRows(st.pm[nt][cc]);
      const int q = nt * 8 + 2 * t + cc;
      if (g == 0) {
        sm_m[warp][q] = st.m[nt][cc];
        sm_l[warp][q] = l;
        sm_pm[warp][q] = pm;
      }
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
        sm_o[warp][q][g * (kD / 8) + mi] = st.acc[nt][mi][cc] * row_factor[mi][0];
        sm_o[warp][q][g * (kD / 8) + mi + kD / 16] = st.acc[nt][mi][2 + cc] * row_factor[mi][1];
      }
    }
  }
  __syncthreads();
  CombineWarpStates<kD, kQ>(p, b, kv_head, part, &sm_o[0][0][0], &sm_m[0][0], &sm_l[0][0],
                            &sm_pm[0][0]);
}

// Where a thread of a chunked attention kernel (INT2 history, BF16 tiers) stands: grid
// (chunk, kv_head, sequence b), its warp and lane, and the lane's fragment coordinates
// g = lane / 4, t = lane % 4 (mma.cuh).
struct ChunkThread {
  int chunk;
  int kv_head;
  int b;
  int warp;
  int lane;
  int g;
  int t;
};

__device__ __forceinline__ ChunkThread ThisChunkThread() {
  const int lane = threadIdx.x % kWarpSize;
  return {static_cast<int>(blockIdx.x),
          static_cast<int>(blockIdx.y),
          static_cast<int>(blockIdx.z),
          static_cast<int>(threadIdx.x / kWarpSize),
          lane,
          lane / 4,
          lane % 4};
}

// Sequence `seq`'s part of a paged tier (kernels/paged_kv_tier.h): `count` tokens from position
// `first` of its block table row `table`.
struct TierSequence {
  int count;
  int first;
  const int32_t* table;
};

__device__ __forceinline__ TierSequence SequenceOfTier(const PagedKvTier& tier, int seq) {
  return {__ldg(tier.num_tokens + seq), __ldg(tier.first_token + seq),
          tier.block_tables + static_cast<int64_t>(seq) * tier.block_table_stride};
}

// ---------------------------------------------------------------------------------------------
// 3. INT2 history for GQA groups of 9 to 16 (kNT = 2 n-tiles of 8 queries; smaller groups take
// Int2HistoryKernel). Grid (history_chunks, kv_heads, num_seqs); a register double buffer of one
// tile per warp plus an L2 prefetch kPrefetchTiles tiles ahead.
template <int kD, int kNT>
__global__ void __launch_bounds__(kAttnThreads)
    Int2HistoryLargeGroupKernel(const AttentionParams p) {
  constexpr int kKSteps = kD / 16;
  constexpr int kMTiles = kD / 16;
  constexpr int kKWords = kD / 64;  // 32-bit K code words per token per lane
  const ChunkThread th = ThisChunkThread();
  const BlockGeometry& geo = p.int2_geo;
  const bool scale_bf16 = p.scale_is_bf16 != 0;

  const TierSequence tier = SequenceOfTier(p.history, th.b);
  const int c0 = th.chunk * p.history_chunk_tokens;
  const int c1 = min(tier.count, c0 + p.history_chunk_tokens);
  const int log2_tokens = __ffs(geo.tokens) - 1;

  struct Tile {
    uint32_t k[2][kKWords];
    uint32_t k_meta[2];
    uint32_t v_meta[2];
    uint32_t v[4];
  };
  // Code rows are kD / 4 bytes. When blocks hold a multiple of 16 tokens and the history starts
  // at a slot that is a multiple of 16 (the common case), every tile lies in one block: one
  // table lookup per tile, three lane pointers, and immediate offsets for the other tokens.
  // Otherwise every token is looked up.
  constexpr int kRowBytes = kD / 4;
  const bool aligned = geo.tokens >= kTileTokens && tier.first % kTileTokens == 0;
  const int k_lane = static_cast<int>(geo.codes_offset[0]) + th.g * kRowBytes + th.t * (kD / 16);
  const int v_lane =
      static_cast<int>(geo.codes_offset[1]) + 2 * th.t * kRowBytes + th.g * (kD / 32);
  const int m_lane = static_cast<int>(geo.meta_offset[0]) + th.g * 4;
  const int vm_delta = static_cast<int>(geo.meta_offset[1] - geo.meta_offset[0]);
  const uint8_t* head_pool =
      p.int2_pool + static_cast<int64_t>(th.kv_head) * geo.head_segment_bytes;

  auto load = [&](int start, Tile& tile) {
    if (aligned && start + kTileTokens <= c1) {
      // Full tile in one block: unconditional loads at immediate offsets from three pointers.
      const int pos = tier.first + start;
      const int slot0 = pos & (geo.tokens - 1);
      const uint8_t* seg =
          head_pool +
          static_cast<int64_t>(__ldg(tier.table + (pos >> log2_tokens))) * geo.block_bytes;
      const uint8_t* kp = seg + (k_lane + slot0 * kRowBytes);
      const uint8_t* vp = seg + (v_lane + slot0 * kRowBytes);
      const uint8_t* mp = seg + (m_lane + slot0 * 4);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if constexpr (kKWords == 2) {
          const uint2 w = __ldg(reinterpret_cast<const uint2*>(kp + 8 * r * kRowBytes));
          tile.k[r][0] = w.x;
          tile.k[r][1] = w.y;
        } else {
          tile.k[r][0] = __ldg(reinterpret_cast<const uint32_t*>(kp + 8 * r * kRowBytes));
        }
        tile.k_meta[r] = __ldg(reinterpret_cast<const uint32_t*>(mp + 32 * r));
        tile.v_meta[r] = __ldg(reinterpret_cast<const uint32_t*>(mp + vm_delta + 32 * r));
      }
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const uint8_t* src = vp + ((c & 1) + 8 * (c >> 1)) * kRowBytes;
        if constexpr (kD == 128) {
          tile.v[c] = __ldg(reinterpret_cast<const uint32_t*>(src));
        } else {
          tile.v[c] = __ldg(reinterpret_cast<const uint16_t*>(src));
        }
      }
      return;
    }
    // Partial or unaligned tile: every token looked up, absent tokens read as zero.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = start + th.g + 8 * r;
      if (i < c1) {
        const TokenAddress a = AddressOf(geo, tier.table, log2_tokens, tier.first + i, th.kv_head);
        const uint8_t* seg = p.int2_pool + a.segment;
        const uint8_t* kc = seg + geo.codes_offset[0] + a.slot * kRowBytes + th.t * (kD / 16);
        if constexpr (kKWords == 2) {
          const uint2 w = __ldg(reinterpret_cast<const uint2*>(kc));
          tile.k[r][0] = w.x;
          tile.k[r][1] = w.y;
        } else {
          tile.k[r][0] = __ldg(reinterpret_cast<const uint32_t*>(kc));
        }
        tile.k_meta[r] =
            __ldg(reinterpret_cast<const uint32_t*>(seg + geo.meta_offset[0] + a.slot * 4));
        tile.v_meta[r] =
            __ldg(reinterpret_cast<const uint32_t*>(seg + geo.meta_offset[1] + a.slot * 4));
      } else {
#pragma unroll
        for (int w = 0; w < kKWords; ++w) tile.k[r][w] = 0u;
        tile.k_meta[r] = 0u;
        tile.v_meta[r] = 0u;
      }
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int i = start + 2 * th.t + (c & 1) + 8 * (c >> 1);
      uint32_t w = 0u;
      if (i < c1) {
        const TokenAddress a = AddressOf(geo, tier.table, log2_tokens, tier.first + i, th.kv_head);
        const uint8_t* vc =
            p.int2_pool + a.segment + geo.codes_offset[1] + a.slot * kRowBytes + th.g * (kD / 32);
        if constexpr (kD == 128) {
          w = __ldg(reinterpret_cast<const uint32_t*>(vc));
        } else {
          w = __ldg(reinterpret_cast<const uint16_t*>(vc));
        }
      }
      tile.v[c] = w;
    }
  };

  // Issue the warp's first tile and the L2 prefetches of the next ones before waiting for the
  // query rotation (the pool was written by earlier, fully completed stream work).
  const int stride = kAttnWarps * kTileTokens;
  int start = c0 + th.warp * kTileTokens;
  Tile t0, t1;
  if (start < c1) load(start, t0);
  const bool prefetch = aligned && (reinterpret_cast<uintptr_t>(p.int2_pool) & 15u) == 0;
  // Bulk L2 prefetch (one instruction per range, lanes 0..3: K codes, V codes, K meta, V meta)
  // of the tile at `at`, so that the loads of later tiles find it in L2: more bytes in flight
  // per SM than the register double buffer alone allows.
  auto prefetch_tile = [&](int at) {
    if (!prefetch || at >= c1 || th.lane >= 4) return;
    const int pos = tier.first + at;
    const int slot0 = pos & (geo.tokens - 1);
    const uint8_t* seg =
        head_pool +
        static_cast<int64_t>(__ldg(tier.table + (pos >> log2_tokens))) * geo.block_bytes;
    const int64_t off = th.lane < 2 ? geo.codes_offset[th.lane] + slot0 * kRowBytes
                                    : geo.meta_offset[th.lane - 2] + slot0 * 4;
    const uint32_t bytes = th.lane < 2 ? kTileTokens * kRowBytes : kTileTokens * 4;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(seg + off), "r"(bytes)
                 : "memory");
  };
#pragma unroll 1
  for (int d = 1; d < kPrefetchTiles; ++d) prefetch_tile(start + d * stride);
  GridDependencyWait();
  LaunchDependents();

  // Query operands: code i of a K word is an fp16 c * 2^(CodePos(i) - 24), so dim d of the
  // query carries 2^-CodePos(i) and the logit 2^24.
  uint32_t qb[kNT][kKSteps][2][2];  // [..][reg][hi, lo]
  float gamma[kNT][2];
  float beta[kNT][2];
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
    const int n = nt * 8 + th.g;
    const bool valid = n < p.group;
    const int64_t qrow = static_cast<int64_t>(th.b) * p.q_heads + th.kv_head * p.group + n;
    const float* qv = p.q_rot + qrow * kD;
    const float qs = valid ? p.q_scale[qrow] : 0.f;
#pragma unroll
    for (int j = 0; j < kKSteps; ++j) {
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const int r = 2 * j + s;
        const int w = r / 8;
        const int i = r % 8;
        const int dim = th.t * (kD / 4) + w * 16 + i;
        const float f = qs / static_cast<float>(1 << CodePos(i));
        qb[nt][j][s][0] = 0u;
        qb[nt][j][s][1] = 0u;
        if (valid) SplitHalf2(qv[dim] * f, qv[dim + 8] * f, qb[nt][j][s][0], qb[nt][j][s][1]);
      }
    }
#pragma unroll
    for (int cc = 0; cc < 2; ++cc) {
      const int nq = nt * 8 + 2 * th.t + cc;
      const bool v = nq < p.group;
      const int64_t row = static_cast<int64_t>(th.b) * p.q_heads + th.kv_head * p.group + nq;
      gamma[nt][cc] = v ? 16777216.f * p.softmax_scale_log2 / p.q_scale[row] : 0.f;
      beta[nt][cc] = v ? p.q_sum[row] * p.softmax_scale_log2 : 0.f;
    }
  }

  WarpState<kD, kNT> st;
  st.Init();

  auto compute = [&](const Tile& cur, int start) {
    // S^T = K * Q^T over kKSteps k-steps of 16 dims; the hi and lo halves of the query go to
    // two accumulators, two independent MMA chains.
    float s_hi[kNT][4];
    float s_lo[kNT][4];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        s_hi[nt][k] = 0.f;
        s_lo[nt][k] = 0.f;
      }
    }
#pragma unroll
    for (int j = 0; j < kKSteps; ++j) {
      uint32_t a[4];
      KStepCodesA(cur.k[0], cur.k[1], j, a);
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const uint32_t hi[2] = {qb[nt][j][0][0], qb[nt][j][1][0]};
        const uint32_t lo[2] = {qb[nt][j][0][1], qb[nt][j][1][1]};
        MmaF16(s_hi[nt], a, hi);
        MmaF16(s_lo[nt], a, lo);
      }
    }

    float k_scale[2], k_min[2], v_scale[2], v_min[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      k_scale[r] = ScaleWordToFloat(static_cast<uint16_t>(cur.k_meta[r] & 0xffffu), scale_bf16);
      k_min[r] = ScaleWordToFloat(static_cast<uint16_t>(cur.k_meta[r] >> 16), scale_bf16);
      v_scale[r] = ScaleWordToFloat(static_cast<uint16_t>(cur.v_meta[r] & 0xffffu), scale_bf16);
      v_min[r] = ScaleWordToFloat(static_cast<uint16_t>(cur.v_meta[r] >> 16), scale_bf16);
    }
    const bool row_valid[2] = {start + th.g < c1, start + th.g + 8 < c1};
    float logit[kNT][2][2];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float qc = (s_hi[nt][2 * r + cc] + s_lo[nt][2 * r + cc]) * gamma[nt][cc];
          logit[nt][cc][r] =
              row_valid[r] ? __fmaf_rn(qc, k_scale[r], k_min[r] * beta[nt][cc]) : kNegInf;
        }
      }
    }
    uint32_t pb[kNT][2];
    st.Update(logit, v_scale, v_min, pb);

    // O^T += V^T * (P s)^T.
    const VCodeOperands<kD> vo(cur.v);
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
      uint32_t a[4];
      vo.Tile(mi, a);
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) MmaF16(st.acc[nt][mi], a, pb[nt]);
    }
  };

  // Each warp takes every kAttnWarps-th tile of the chunk; the next tile's loads are in flight
  // while the current one computes (two tile buffers, no copies), and the tile kPrefetchTiles
  // ahead is on its way into L2.
  while (start < c1) {
    if (start + stride < c1) load(start + stride, t1);
    prefetch_tile(start + kPrefetchTiles * stride);
    compute(t0, start);
    start += stride;
    if (start >= c1) break;
    if (start + stride < c1) load(start + stride, t0);
    prefetch_tile(start + kPrefetchTiles * stride);
    compute(t1, start);
    start += stride;
  }

  float row_factor[kMTiles][2];
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
    row_factor[mi][0] = static_cast<float>(1 << (24 - CodePos(mi % 8)));
    row_factor[mi][1] = static_cast<float>(1 << (24 - CodePos((mi + kD / 16) % 8)));
  }
  WritePartial<kD, kNT>(st, p, th.b, th.kv_head, th.chunk, row_factor);
}

}  // namespace kvpool::cuda::internal

#include "kernels/cuda/merge_group.cuh"  // IWYU pragma: keep

namespace kvpool::cuda::internal {

// ---------------------------------------------------------------------------------------------
// 2. BF16 tiers (sink then recent, as one list). Grid (bf16_chunks, kv_heads, num_seqs).
template <int kD, int kNT>
__global__ void __launch_bounds__(kAttnThreads) Bf16TierKernel(const AttentionParams p) {
  constexpr int kKSteps = kD / 16;
  constexpr int kMTiles = kD / 16;
  constexpr int kKVec = kD / 32;  // uint4 (8 dims) per token per lane on the K side (kD / 4 dims)
  constexpr int kVVec = kD / 64;  // uint4 per token per lane on the V side (kD / 8 dims)
  const ChunkThread th = ThisChunkThread();
  const BlockGeometry& geo = p.bf16_geo;
  const TierSequence sink_tier = SequenceOfTier(p.sink, th.b);
  const TierSequence recent_tier = SequenceOfTier(p.recent, th.b);
  const int total = sink_tier.count + recent_tier.count;
  const int c0 = th.chunk * p.bf16_chunk_tokens;
  const int c1 = min(total, c0 + p.bf16_chunk_tokens);
  const int log2_tokens = __ffs(geo.tokens) - 1;
  LaunchDependents();
  // Beside the INT2 history (bf16_after_history) this kernel is that one's dependent: it starts
  // once every history CTA has passed its own wait for the query rotation, so the rotated
  // queries are complete (read through L2 below); it waits for the history kernel at its end,
  // which keeps the chain transitive for the merge.
  if (p.bf16_after_history == 0) GridDependencyWait();

  // Lane (g, t) K side: dims t * kD/4 + [0, kD/4) as bf16 pairs; k-step j uses pairs 2j, 2j+1.
  uint32_t qb[kNT][kKSteps][2][2];  // [..][reg][hi, lo]
  float gamma[kNT][2];
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
    const int n = nt * 8 + th.g;
    const bool valid = n < p.group;
    const int64_t qrow = static_cast<int64_t>(th.b) * p.q_heads + th.kv_head * p.group + n;
    const float qs = valid ? __ldcg(p.q_scale + qrow) : 0.f;
    // The lane's dims t * kD/4 + [0, kD/4), in 16-byte loads.
    const float4* q4 = reinterpret_cast<const float4*>(p.q_rot + qrow * kD + th.t * (kD / 4));
#pragma unroll
    for (int j = 0; j < kKSteps; ++j) {
      const float4 x = valid ? __ldcg(q4 + j) : make_float4(0.f, 0.f, 0.f, 0.f);
      qb[nt][j][0][0] = 0u;
      qb[nt][j][0][1] = 0u;
      qb[nt][j][1][0] = 0u;
      qb[nt][j][1][1] = 0u;
      if (valid) {
        SplitHalf2(x.x * qs, x.y * qs, qb[nt][j][0][0], qb[nt][j][0][1]);
        SplitHalf2(x.z * qs, x.w * qs, qb[nt][j][1][0], qb[nt][j][1][1]);
      }
    }
#pragma unroll
    for (int cc = 0; cc < 2; ++cc) {
      const int nq = nt * 8 + 2 * th.t + cc;
      const int64_t row = static_cast<int64_t>(th.b) * p.q_heads + th.kv_head * p.group + nq;
      gamma[nt][cc] = nq < p.group ? p.softmax_scale_log2 / __ldcg(p.q_scale + row) : 0.f;
    }
  }

  auto segment_of = [&](int i, bool& ok) -> const uint8_t* {
    ok = i < c1;
    if (!ok) return nullptr;
    const bool sink = i < sink_tier.count;
    const TokenAddress a = AddressOf(
        geo, sink ? sink_tier.table : recent_tier.table, log2_tokens,
        sink ? sink_tier.first + i : recent_tier.first + (i - sink_tier.count), th.kv_head);
    return p.bf16_pool + a.segment + static_cast<int64_t>(a.slot) * geo.code_bytes_per_row;
  };
  auto bf16_lo = [](uint32_t w) { return __uint_as_float(w << 16); };
  auto bf16_hi = [](uint32_t w) { return __uint_as_float(w & 0xffff0000u); };

  WarpState<kD, kNT> st;
  st.Init();
  const float ones[2] = {1.f, 1.f};
  const float zeros[2] = {0.f, 0.f};
  for (int start = c0 + th.warp * kTileTokens; start < c1; start += kAttnWarps * kTileTokens) {
    uint32_t kw[2][kKVec * 4];
    bool row_valid[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint8_t* seg = segment_of(start + th.g + 8 * r, row_valid[r]);
#pragma unroll
      for (int v = 0; v < kKVec; ++v) {
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        if (row_valid[r]) {
          x = __ldg(reinterpret_cast<const uint4*>(seg + geo.codes_offset[0] +
                                                   2 * (th.t * (kD / 4)) + 16 * v));
        }
        kw[r][4 * v] = x.x;
        kw[r][4 * v + 1] = x.y;
        kw[r][4 * v + 2] = x.z;
        kw[r][4 * v + 3] = x.w;
      }
    }
    uint32_t vw[4][kVVec * 4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      bool ok;
      const uint8_t* seg = segment_of(start + 2 * th.t + (c & 1) + 8 * (c >> 1), ok);
#pragma unroll
      for (int v = 0; v < kVVec; ++v) {
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        if (ok) {
          x = __ldg(reinterpret_cast<const uint4*>(seg + geo.codes_offset[1] +
                                                   2 * (th.g * (kD / 8)) + 16 * v));
        }
        vw[c][4 * v] = x.x;
        vw[c][4 * v + 1] = x.y;
        vw[c][4 * v + 2] = x.z;
        vw[c][4 * v + 3] = x.w;
      }
    }

    float s[kNT][4];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int k = 0; k < 4; ++k) s[nt][k] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < kKSteps; ++j) {
      const uint32_t a[4] = {PackHalf2(bf16_lo(kw[0][2 * j]), bf16_hi(kw[0][2 * j])),
                             PackHalf2(bf16_lo(kw[1][2 * j]), bf16_hi(kw[1][2 * j])),
                             PackHalf2(bf16_lo(kw[0][2 * j + 1]), bf16_hi(kw[0][2 * j + 1])),
                             PackHalf2(bf16_lo(kw[1][2 * j + 1]), bf16_hi(kw[1][2 * j + 1]))};
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const uint32_t hi[2] = {qb[nt][j][0][0], qb[nt][j][1][0]};
        const uint32_t lo[2] = {qb[nt][j][0][1], qb[nt][j][1][1]};
        MmaF16(s[nt], a, hi);
        MmaF16(s[nt], a, lo);
      }
    }
    float logit[kNT][2][2];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          logit[nt][cc][r] = row_valid[r] ? s[nt][2 * r + cc] * gamma[nt][cc] : kNegInf;
        }
      }
    }
    uint32_t pb[kNT][2];
    st.Update(logit, ones, zeros, pb);

    // V^T slots: slot j of lane g is dim g * kD/8 + j; element j of a token is half j % 2 of
    // word j / 2.
    auto v_pair = [&](int c0i, int c1i, int j) {
      const uint32_t w0 = vw[c0i][j / 2];
      const uint32_t w1 = vw[c1i][j / 2];
      return (j % 2 == 0) ? PackHalf2(bf16_lo(w0), bf16_lo(w1))
                          : PackHalf2(bf16_hi(w0), bf16_hi(w1));
    };
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
      const int ja = mi;
      const int jb = mi + kD / 16;
      const uint32_t a[4] = {v_pair(0, 1, ja), v_pair(0, 1, jb), v_pair(2, 3, ja),
                             v_pair(2, 3, jb)};
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) MmaF16(st.acc[nt][mi], a, pb[nt]);
    }
  }
  float row_factor[kMTiles][2];
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
    row_factor[mi][0] = 1.f;
    row_factor[mi][1] = 1.f;
  }
  WritePartial<kD, kNT>(st, p, th.b, th.kv_head, p.history_chunks + th.chunk, row_factor);
  if constexpr (kNT == 1) {  // groups of up to 8
    if (p.merge_counters != nullptr) {
      __shared__ MergeGroupSmem<kD, kAttnThreads> merge_smem;
      MergeIfLastPart<kD, kAttnThreads>(p, th.kv_head, th.b, &merge_smem);
    }
  }
  if (p.bf16_after_history != 0) GridDependencyWait();
}

}  // namespace kvpool::cuda::internal

#include "kernels/cuda/int2_history.cuh"  // IWYU pragma: keep

namespace kvpool::cuda::internal {

// ---------------------------------------------------------------------------------------------
// 4. Merge of all parts and un-rotation, a CTA per query head: the merge kernel for groups of 9
// to 16 and, for smaller groups, while there are fewer (sequence, KV head) groups than SMs
// (more CTAs than MergeGroupKernel; NOTES.md, run 7). Grid (q_heads, num_seqs),
// kMergeHeadThreads threads; each phase's loads are issued together, so that a small batch pays
// a few L2 round trips instead of chains of them (NOTES.md, run 5):
//   a. thread k < parts loads lse_k; block max and sum; w_k = exp2(lse_k - max) / sum;
//   b. thread (slice, c) sums w_k * part_k[4c .. 4c + 3] over k = slice, slice + slices, ...,
//      the slices are added in a fixed order;
//   c. out[j] = sum_i o'[i] * M_V[j][i]: a warp takes rows j, its lanes run along i (coalesced
//      rows of M_V, every row's load in flight at once), a shuffle sum per row.
inline constexpr int kMergeHeadThreads = 256;

template <int kD>
__global__ void __launch_bounds__(kMergeHeadThreads) MergeHeadKernel(const AttentionParams p) {
  constexpr int kVec = kD / 4;  // float4 columns of a row
  constexpr int kSlices = kMergeHeadThreads / kVec;
  constexpr int kWarps = kMergeHeadThreads / kWarpSize;
  constexpr int kRowsPerPass = kWarpSize / kVec;  // rows of M_V one warp load covers
  constexpr int kPasses = kD / kWarps / kRowsPerPass;
  static_assert(kMaxParts <= kMergeHeadThreads, "one part per thread in phase a");
  __shared__ float wts[kMaxParts];
  __shared__ float red[kWarps];
  __shared__ float4 part_acc[kSlices][kVec];
  __shared__ __align__(16) float o_rot[kD];
  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int parts = p.num_parts;
  const int64_t row = static_cast<int64_t>(blockIdx.y) * p.q_heads + blockIdx.x;
  // The rows of M_V this warp un-rotates with (constant input) into L1 before the wait, so that
  // they arrive while the attention kernels still run (loaded at the end, they were one more
  // memory round trip after the parts' reduction; held in registers, they cost occupancy).
  const int sub = lane / kVec;  // which of the pass's rows
  const int li = lane % kVec;   // which float4 of the row
  auto mv_at = [&](int r) {
    const int j = (warp * kPasses + r) * kRowsPerPass + sub;
    return reinterpret_cast<const float4*>(p.rotation_v + static_cast<int64_t>(j) * kD) + li;
  };
  if (p.rotation_v != nullptr && li % 8 == 0) {  // one prefetch per 128-byte line
#pragma unroll
    for (int r = 0; r < kPasses; ++r) asm volatile("prefetch.global.L1 [%0];\n" ::"l"(mv_at(r)));
  }
  GridDependencyWait();
  const float my_lse = tid < parts ? p.part_lse[row * parts + tid] : kNegInf;
  float m = my_lse;
  for (int o = 16; o >= 1; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kFullMask, m, o));
  if (lane == 0) red[warp] = m;
  __syncthreads();
  m = red[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) m = fmaxf(m, red[w]);
  const float e = (tid < parts && m != kNegInf) ? exp2f(my_lse - m) : 0.f;
  float l = e;
  for (int o = 16; o >= 1; o >>= 1) l += __shfl_xor_sync(kFullMask, l, o);
  __syncthreads();  // every thread has read the maxima before red is reused
  if (lane == 0) red[warp] = l;
  __syncthreads();
  l = red[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) l += red[w];
  const float inv = l > 0.f ? 1.f / l : 0.f;
  if (tid < parts) wts[tid] = e * inv;
  if (tid == 0) p.lse[row] = m == kNegInf ? kNegInf : (m + log2f(l)) * 0.69314718055994531f;
  __syncthreads();

  const int slice = tid / kVec;
  const int c = tid % kVec;
  const float4* src = reinterpret_cast<const float4*>(p.part_out + row * parts * kD) + c;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
  for (int k = slice; k < parts; k += kSlices) {
    const float w = wts[k];
    const float4 v = __ldg(src + static_cast<int64_t>(k) * kVec);
    FmaFloat4(acc, w, v);
  }
  part_acc[slice][c] = acc;
  __syncthreads();
  if (tid < kVec) {
    float4 o = part_acc[0][tid];
#pragma unroll
    for (int s = 1; s < kSlices; ++s) {
      const float4 v = part_acc[s][tid];
      AddFloat4(o, v);
    }
    *reinterpret_cast<float4*>(&o_rot[4 * tid]) = o;
  }
  __syncthreads();

  float* out = p.out + row * kD;
  if (p.rotation_v == nullptr) {
    if (tid < kD) out[tid] = o_rot[tid];
    return;
  }
  const float4 o = *reinterpret_cast<const float4*>(&o_rot[4 * li]);
  float4 mv[kPasses];
#pragma unroll
  for (int r = 0; r < kPasses; ++r) mv[r] = __ldg(mv_at(r));
#pragma unroll
  for (int r = 0; r < kPasses; ++r) {
    float d = o.x * mv[r].x;
    d = __fmaf_rn(o.y, mv[r].y, d);
    d = __fmaf_rn(o.z, mv[r].z, d);
    d = __fmaf_rn(o.w, mv[r].w, d);
    for (int off = kVec / 2; off >= 1; off >>= 1) d += __shfl_xor_sync(kFullMask, d, off);
    if (li == 0) out[(warp * kPasses + r) * kRowsPerPass + sub] = d;
  }
}

// Launches `kernel` on `grid`; with `pdl`, as a programmatic dependent of the previous kernel on
// the stream (it may start while that one runs; GridDependencyWait orders the data).
template <typename Kernel>
cudaError_t LaunchAttentionKernel(Kernel kernel, dim3 grid, int threads, bool pdl,
                                  const AttentionParams& p, CUstream_st* stream,
                                  size_t dynamic_smem = 0) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = dynamic_smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = pdl ? 1 : 0;
  cudaError_t err = cudaLaunchKernelEx(&config, kernel, p);
  if (err != cudaSuccess && pdl) {
    // Should a stream or driver refuse programmatic serialization, launch plainly.
    (void)cudaGetLastError();
    config.numAttrs = 0;
    err = cudaLaunchKernelEx(&config, kernel, p);
  }
  return err;
}

template <int kD, int kGroupTiles>
int LaunchDecodeAttention(const AttentionParams& p, CUstream_st* stream) {
  const dim3 groups(p.kv_heads, p.num_seqs);
  const bool pdl = p.use_pdl != 0;
  cudaError_t err = LaunchAttentionKernel(RotateQueriesKernel<kD>, groups, kRotSlices * kD,
                                          /*pdl=*/false, p, stream);
  auto bf16_tiers = [&] {
    if (err == cudaSuccess && p.bf16_chunks > 0) {
      err = LaunchAttentionKernel(Bf16TierKernel<kD, kGroupTiles>,
                                  dim3(p.bf16_chunks, p.kv_heads, p.num_seqs), kAttnThreads, pdl, p,
                                  stream);
    }
  };
  if (p.bf16_after_history == 0) bf16_tiers();
  if (err == cudaSuccess && p.history_chunks > 0) {
    const dim3 grid(p.history_chunks, p.kv_heads, p.num_seqs);
    if constexpr (kGroupTiles == 1) {
      auto kernel = p.history_narrow != 0
                        ? (p.scale_is_bf16 != 0 ? Int2HistoryKernel<kD, true, true>
                                                : Int2HistoryKernel<kD, false, true>)
                        : (p.scale_is_bf16 != 0 ? Int2HistoryKernel<kD, true, false>
                                                : Int2HistoryKernel<kD, false, false>);
      err =
          LaunchAttentionKernel(kernel, grid, kAttnThreads, pdl, p, stream, kHistorySmemBytes<kD>);
    } else {
      err = LaunchAttentionKernel(Int2HistoryLargeGroupKernel<kD, kGroupTiles>, grid, kAttnThreads,
                                  pdl, p, stream);
    }
  }
  if (p.bf16_after_history != 0) bf16_tiers();
  if (err == cudaSuccess) {
    if (p.merge_counters != nullptr) {
      // Tail merge: the attention kernels merged every pair.
    } else if (kGroupTiles == 1 && p.merge_per_group != 0) {
      err = LaunchAttentionKernel(MergeGroupKernel<kD>, groups, kMergeGroupThreads, pdl, p, stream);
    } else {
      err = LaunchAttentionKernel(MergeHeadKernel<kD>, dim3(p.q_heads, p.num_seqs),
                                  kMergeHeadThreads, pdl, p, stream);
    }
  }
  if (err != cudaSuccess) return static_cast<int>(err);
  return static_cast<int>(cudaGetLastError());
}

template <int kD, int kGroupTiles>
int AttentionCtasPerSm(AttentionKernelKind kind) {
  int n = 0;
  cudaError_t err = cudaErrorInvalidValue;
  if (kind == AttentionKernelKind::kBf16Tiers) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Bf16TierKernel<kD, kGroupTiles>,
                                                        kAttnThreads, 0);
  } else if constexpr (kGroupTiles == 1) {
    if (kind != AttentionKernelKind::kHistoryLargeGroup) {
      err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &n,
          kind == AttentionKernelKind::kHistoryNarrow ? Int2HistoryKernel<kD, false, true>
                                                      : Int2HistoryKernel<kD, false, false>,
          kAttnThreads, kHistorySmemBytes<kD>);
    }
  } else {
    if (kind == AttentionKernelKind::kHistoryLargeGroup) {
      err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &n, Int2HistoryLargeGroupKernel<kD, kGroupTiles>, kAttnThreads, 0);
    }
  }
  return err == cudaSuccess ? n : -static_cast<int>(err);
}

}  // namespace kvpool::cuda::internal
