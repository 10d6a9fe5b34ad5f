// INT2 history attention for GQA groups of up to 8 (included by decode_attention.cuh; groups of
// 9 to 16 take Int2HistoryLargeGroupKernel there). kernels/cuda/NOTES.md (runs 3, 7 and 8) has
// the measurements behind each choice below.
//
// - Loads leave the dependent chains and most issue slots. Each warp owns a ring of
//   kHistoryStages 16-token tiles in shared memory, filled by asynchronous 16-byte copies
//   (cp.async.cg, three per lane and tile at D = 128, one commit group per pair of tiles);
//   kHistoryStages / 2 pairs are in flight while a pair computes. With blocks of 16 tokens a head
//   segment is laid out exactly like a stage, so a copy is the segment base plus an immediate
//   offset. Block-table entries travel by asynchronous copies too, in the commit group of an
//   earlier pair, so no warp waits on a table load before a copy. (One cp.async.bulk per tile
//   from lane 0, counted on an mbarrier, costs the warp more issue slots per pair than the
//   16-byte copies: NOTES.md, run 11.) Other sequences (history start not a multiple of 16,
//   blocks of other sizes, or AttentionTuning::history_async_copies off) fill the same ring with
//   ordinary loads instead.
// - V codes reach the PV product's A operand by one ldmatrix.trans per tile (load_codes): the
//   lane receives each 16-bit chunk of two tokens already interleaved.
// - Wide layout (groups of 5 to 8): queries on the M dimension, S[16 rows x 8 tokens] = Q * K^T
//   with rows 0..7 the fp16 high parts of the group's 8 queries and rows 8..15 the low parts, so
//   the hi/lo split costs no extra MMA; the accumulator layout of S (row = query g, columns 2t,
//   2t+1) is exactly the B operand layout of O^T += V^T * (P s)^T, so P needs no transpose.
// - Narrow layout (groups of up to 4, AttentionTuning::narrow_layout): tokens on the M dimension,
//   S^T[16 tokens x 8] = K Q^T with columns 2t, 2t+1 the high and low part of query t, so no MMA
//   row and no lane's softmax work is empty for small groups; P s enters the PV product as fp16
//   high + low part after one movmatrix per 8-token block.
// - A lane's softmax state is one query; the max over tokens needs no shuffle in the common
//   case: the reference `mo` (the max when it last moved) only moves when a logit exceeds it by
//   more than kLazyMargin, so p = exp2(logit - mo) <= 2^kLazyMargin (P s stays far from the fp16
//   limit for stored fp16 scales below 65504 / 2^kLazyMargin = 1023).
// - Two tiles (32 tokens) per iteration: four independent MMA chains for QK, one vote for both.
// - P in fp32, P * s_v rounded to fp16 once, the sum of p * min_v in fp32 FMA: on the tensor
//   cores (fp16 P, an HMUL2 by s) the output lost accuracy at long contexts (NOTES.md, run 3).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/attention_params.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/mma.cuh"

namespace kvpool::cuda::internal {

inline constexpr int kHistoryStages = 8;       // 16-token tiles per warp ring (even)
inline constexpr int kHistoryPairTokens = 32;  // tokens per warp iteration
inline constexpr int kHistoryQuantum = 4 * kHistoryPairTokens;  // history chunk sizes are multiples
inline constexpr float kLazyMargin = 6.f;  // log2 units a logit may exceed mo by

template <int kD>
inline constexpr int kHistoryTileBytes = 2 * 16 * (kD / 4) + 2 * 64;  // K, V codes + K, V meta
inline constexpr int kHistoryEntrySlots = 8;  // pairs of block-table entries per warp ring
template <int kD>
inline constexpr int kHistorySmemBytes =
    4 * kHistoryStages* kHistoryTileBytes<kD> + 4 * kHistoryEntrySlots * 8;

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy that bypasses L1 (cp.async.cg), the source lines marked
// evict-first in L2 (the history is read once per decode step).
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(dst),
               "l"(src), "l"(policy)
               : "memory");
}

// The same copy when `pred` holds, else nothing (a predicated instruction, no branch).
__device__ __forceinline__ void CpAsync16If(bool pred, uint32_t dst, const void* src,
                                            uint64_t policy) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %3, 0;\n"
      " @p cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n}\n" ::"r"(dst),
      "l"(src), "l"(policy), "r"(static_cast<int>(pred))
      : "memory");
}

// 4-byte global -> shared copy when `pred` holds (block-table entries).
__device__ __forceinline__ void CpAsync4If(bool pred, uint32_t dst, const void* src) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p cp.async.ca.shared.global [%0], [%1], "
      "4;\n}\n" ::"r"(dst),
      "l"(src), "r"(static_cast<int>(pred))
      : "memory");
}

__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most kPending of this thread's most recent groups are still in flight.
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ uint64_t EvictFirstPolicy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// Makes `v` opaque to the compiler, so that it stays in a register instead of being recomputed.
template <typename T>
__device__ __forceinline__ void PinRegister(T*& v) {
  asm volatile("" : "+l"(v));
}
__device__ __forceinline__ void PinRegister(uint32_t& v) { asm volatile("" : "+r"(v)); }

template <typename T>
__device__ __forceinline__ T LoadShared(const uint8_t* p) {
  return *reinterpret_cast<const T*>(p);
}

// fp16 / bf16 scale-or-min word halves to fp32.
template <bool kBf16>
__device__ __forceinline__ float MetaLo(uint32_t w) {
  if constexpr (kBf16) {
    return __uint_as_float(w << 16);
  } else {
    return __low2float(*reinterpret_cast<const __half2*>(&w));
  }
}
template <bool kBf16>
__device__ __forceinline__ float MetaHi(uint32_t w) {
  if constexpr (kBf16) {
    return __uint_as_float(w & 0xffff0000u);
  } else {
    return __high2float(*reinterpret_cast<const __half2*>(&w));
  }
}

// 3. INT2 history, groups of up to 8. Grid (history_chunks, kv_heads, num_seqs), 4 warps; chunk
// sizes are multiples of kHistoryQuantum. Warp w takes the token pairs [c0 + 32 (w + 4k), +32).
// kNarrow: the narrow layout (groups of up to 4); kBf16: bf16 scale and minimum words.
template <int kD, bool kBf16, bool kNarrow>
__global__ void __launch_bounds__(kAttnThreads, 4) Int2HistoryKernel(const AttentionParams p) {
  constexpr int kRow = kD / 4;  // code bytes per row
  constexpr int kKSteps = kD / 16;
  constexpr int kMTiles = kD / 16;
  constexpr int kKWords = kD / 64;  // K code words per token per lane
  constexpr int kTile = kHistoryTileBytes<kD>;
  constexpr int kS = kHistoryStages;
  constexpr int kVOff = 16 * kRow;        // V codes in a stage
  constexpr int kKmOff = 32 * kRow;       // K meta
  constexpr int kVmOff = 32 * kRow + 64;  // V meta
  extern __shared__ __align__(128) uint8_t history_smem[];

  const ChunkThread th = ThisChunkThread();
  const BlockGeometry& geo = p.int2_geo;

  const TierSequence tier = SequenceOfTier(p.history, th.b);
  const int c0 = th.chunk * p.history_chunk_tokens;
  const int c1 = min(tier.count, c0 + p.history_chunk_tokens);
  const int log2_tokens = __ffs(geo.tokens) - 1;
  const bool bulk = p.history_async_copies != 0 && (tier.first & 15) == 0;
  const int w0 = c0 + kHistoryPairTokens * th.warp;
  const int n_pairs = c1 > w0 ? (c1 - w0 + kHistoryQuantum - 1) / kHistoryQuantum : 0;
  auto pair_start = [&](int k) { return w0 + kHistoryQuantum * k; };

  uint8_t* ring = history_smem + th.warp * (kS * kTile);
  const uint32_t ring_addr = SmemAddress(ring);

  // Asynchronous copies (history_async_copies: blocks of 16 tokens whose head segment is laid
  // out like a stage): 16-byte chunk c = lane + 32 j of tile e of pair k is byte 16 c of the
  // segment of block E[k][e] = table[(first + w0) / 16 + 8 k + e]. Every copy is a predicated
  // instruction (no branches in the loop). The entries themselves also arrive by asynchronous
  // copies, into a per-warp ring of kHistoryEntrySlots pairs in shared memory: E[k + kS] travels in
  // the commit group of pair k + kS / 2, which the loop waits for before it needs E[k + kS].
  // (Loaded into registers one pair ahead, ptxas placed the wait for them at the top of the next
  // iteration: NOTES.md, run 7.)
  constexpr int kChunks = kTile / 16;
  constexpr int kChunksPerLane = (kChunks + kWarpSize - 1) / kWarpSize;
  constexpr int kER = kHistoryEntrySlots;
  static_assert(kER >= kS / 2 + 1 && kER >= kS - kS / 2, "entry ring too small");
  const uint8_t* seg_lane =
      p.int2_pool + static_cast<int64_t>(th.kv_head) * geo.head_segment_bytes + 16 * th.lane;
  uint32_t dst_lane = ring_addr + 16 * th.lane;
  const int32_t* pair_table = tier.table + ((tier.first + w0) >> 4);
  const int32_t* entries =
      reinterpret_cast<const int32_t*>(history_smem + 4 * kS * kTile) + th.warp * 2 * kER;
  const uint32_t entries_addr = SmemAddress(entries);
  const uint64_t policy = EvictFirstPolicy();
  // Kept in registers (ptxas otherwise recomputes them from the thread index every tile).
  PinRegister(seg_lane);
  PinRegister(dst_lane);
  PinRegister(pair_table);
  // Tile e of pair k holds tokens: pair_start(k) < c1 exactly when k < n_pairs, so one
  // subtraction and a compare per tile. Block offsets in 32 bits (cuda_attention.cc takes this
  // path only for blocks below 4 GiB).
  auto tile_present = [&](int k, int e) { return c1 - pair_start(k) > 16 * e; };
  const uint32_t block_bytes = static_cast<uint32_t>(geo.block_bytes);
  // Copies of pair k (blocks blk0, blk1) into its stages; no commit.
  auto copy_pair = [&](int k, int blk0, int blk1) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const bool present = tile_present(k, e);
      const uint8_t* src =
          seg_lane +
          static_cast<uint64_t>(static_cast<uint32_t>(e == 0 ? blk0 : blk1)) * block_bytes;
      const uint32_t dst = dst_lane + ((2 * k + e) % kS) * kTile;
#pragma unroll
      for (int j = 0; j < kChunksPerLane; ++j) {
        const bool lane_has =
            kChunks % kWarpSize == 0 || j + 1 < kChunksPerLane || th.lane + kWarpSize * j < kChunks;
        CpAsync16If(present && lane_has, dst + 16 * kWarpSize * j, src + 16 * kWarpSize * j,
                    policy);
      }
    }
  };
  // E[k0 .. k0 + pairs - 1] into their ring slots (lane l: entry l % 2 of pair k0 + l / 2; no
  // commit).
  auto copy_entries = [&](int k0, int pairs) {
    const int k = pairs > 1 ? k0 + th.lane / 2 : k0;  // one pair (the loop's case): warp-uniform
    const int e = th.lane & 1;
    CpAsync4If(th.lane < 2 * pairs && tile_present(k, e), entries_addr + 8 * (k % kER) + 4 * e,
               pair_table + 8 * k + e);
  };
  // Ordinary fill of one tile (tokens [ts, ts + 16), zeros past c1): lane (token, half) copies
  // the K (half 0) or V (half 1) code row and meta word of one token.
  auto fill = [&](int ts, uint8_t* stage) {
    const int tok = th.lane >> 1;
    const int half = th.lane & 1;
    const int i = ts + tok;
    uint2 row[kRow / 8];
    uint32_t meta = 0u;
#pragma unroll
    for (int v = 0; v < kRow / 8; ++v) row[v] = make_uint2(0u, 0u);
    if (i < c1) {
      const TokenAddress a = AddressOf(geo, tier.table, log2_tokens, tier.first + i, th.kv_head);
      const uint8_t* seg = p.int2_pool + a.segment;
      const uint8_t* src = seg + geo.codes_offset[half] + a.slot * kRow;
#pragma unroll
      for (int v = 0; v < kRow / 8; ++v) row[v] = __ldg(reinterpret_cast<const uint2*>(src) + v);
      meta = __ldg(reinterpret_cast<const uint32_t*>(seg + geo.meta_offset[half] + a.slot * 4));
    }
    uint8_t* dst = stage + half * kVOff + tok * kRow;
#pragma unroll
    for (int v = 0; v < kRow / 8; ++v) reinterpret_cast<uint2*>(dst)[v] = row[v];
    *reinterpret_cast<uint32_t*>(stage + kKmOff + half * 64 + tok * 4) = meta;
  };

  // Prologue: the first pair on its way before waiting for the query rotation (the pool was
  // written by earlier, completed stream work), the other kS / 2 - 1 right after the rotated
  // queries' loads, which would otherwise queue behind all kS / 2 pairs of copies (NOTES.md,
  // run 5, "Split prologue"). Entries E[0 .. kS/2 - 1] are loaded directly; E[kS/2 .. kS - 1]
  // travel with pair 0 (lanes 0 .. kS - 1).
  int blk[kS / 2][2];
  if (bulk) {
#pragma unroll
    for (int k = 0; k < kS / 2; ++k) {
#pragma unroll
      for (int e = 0; e < 2; ++e)
        blk[k][e] = tile_present(k, e) ? __ldg(pair_table + 8 * k + e) : 0;
    }
    copy_pair(0, blk[0][0], blk[0][1]);
    copy_entries(kS / 2, kS / 2);
    CpAsyncCommit();
  }
  GridDependencyWait();
  LaunchDependents();

  // Wide: A operand of Q * K^T for k-step j: rows g (query g, fp16 high part) and g + 8 (low
  // part); columns 2t, 2t+1 | 2t+8, 2t+9 are the dims of codes i, i+8 | i+1, i+9 (i = 2 (j % 4))
  // of the lane's K word j / 4, each query dim scaled by 2^-CodePos(i) (mma.cuh).
  // Narrow: B operand of S^T = K Q^T for k-step j: column g is the high (g even) or low part of
  // query g / 2, rows 2t, 2t+1 | 2t+8, 2t+9 the same dims as the wide columns.
  // The lane's softmax query: g (wide) or t (narrow).
  constexpr int kQRegs = kNarrow ? 2 : 4;
  uint32_t qf[kKSteps][kQRegs];
  float gamma, beta_g;
  {
    const int64_t qrow0 = static_cast<int64_t>(th.b) * p.q_heads + th.kv_head * p.group;
    const int fq = kNarrow ? th.g / 2 : th.g;  // query of the fragment
    const bool f_valid = fq < p.group;
    const int sq = kNarrow ? th.t : th.g;  // query of the softmax state
    const bool s_valid = sq < p.group;
    const float qs_f = f_valid ? p.q_scale[qrow0 + fq] : 0.f;
    const float qs = kNarrow ? (s_valid ? p.q_scale[qrow0 + sq] : 0.f) : qs_f;
    const float q_sum = s_valid ? p.q_sum[qrow0 + sq] : 0.f;
    // The lane's dims are t * kD/4 + [0, kD/4): kD/16 16-byte loads, not scalar ones (NOTES.md,
    // run 5, "Vectorized query loads").
    float q[kD / 4];
    const float4* q4 =
        reinterpret_cast<const float4*>(p.q_rot + (qrow0 + fq) * kD + th.t * (kD / 4));
#pragma unroll
    for (int v = 0; v < kD / 16; ++v) {
      const float4 x = f_valid ? q4[v] : make_float4(0.f, 0.f, 0.f, 0.f);
      q[4 * v] = x.x;
      q[4 * v + 1] = x.y;
      q[4 * v + 2] = x.z;
      q[4 * v + 3] = x.w;
    }
    if (bulk) {  // the rest of the prologue, behind the queries' loads
#pragma unroll
      for (int k = 1; k < kS / 2; ++k) {
        copy_pair(k, blk[k][0], blk[k][1]);
        CpAsyncCommit();
      }
    }
#pragma unroll
    for (int j = 0; j < kKSteps; ++j) {
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const int i = 2 * (j % 4) + s;
        const int dim = (j / 4) * 16 + i;
        const float f = qs_f / static_cast<float>(1 << CodePos(i));
        uint32_t hi = 0u, lo = 0u;
        if (f_valid) SplitHalf2(q[dim] * f, q[dim + 8] * f, hi, lo);
        if constexpr (kNarrow) {
          qf[j][s] = (th.g & 1) == 0 ? hi : lo;
        } else {
          qf[j][2 * s] = hi;
          qf[j][2 * s + 1] = lo;
        }
      }
    }
    // logit (log2) = gamma * unscaled with unscaled = s_k * (q'.c) + m_k * beta_g.
    gamma = s_valid ? 16777216.f * p.softmax_scale_log2 / qs : 1.f;
    beta_g = s_valid ? q_sum * qs * (1.f / 16777216.f) : 0.f;
  }

  // Softmax state of the lane's query (wide: uniform over a quad; narrow: over the lanes of one t).
  float mo = kNegInf;   // reference of p = exp2(logit - mo)
  float lim = kNegInf;  // mo + kLazyMargin
  float l_part = 0.f;   // lane-partial sum of p
  float pm_part = 0.f;  // lane-partial sum of p * min_v, fp32
  float acc[kMTiles][4];
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
    for (int k = 0; k < 4; ++k) acc[mi][k] = 0.f;
  }

  // Moves the lane's reference to qmax if that is above its limit, rescales the lane's sums and
  // returns the factor for its accumulators (0 when mo was -inf, 1 when it did not move).
  auto move_reference = [&](float qmax) {
    const bool up = qmax > lim;
    const float corr = up ? FastExp2(mo - qmax) : 1.f;
    mo = up ? qmax : mo;
    lim = mo + kLazyMargin;
    l_part *= corr;
    pm_part *= corr;
    return corr;
  };
  // The lane's V row address relative to a stage for load_codes' ldmatrix. The wide layout keeps
  // it in a register (ptxas otherwise recomputes it from the thread index every pair); pinned in
  // the narrow layout, it cost that loop more instructions than it saved.
  const int v_row_lane = kD == 128
                             ? (th.lane % 8 + 8 * (th.lane / 16)) * kRow + 16 * ((th.lane / 8) % 2)
                             : (th.lane % 8 + 8 * ((th.lane / 8) % 2)) * kRow;
  uint32_t v_row_pinned = v_row_lane + kVOff;
  if constexpr (!kNarrow) PinRegister(v_row_pinned);
  // The code words of one tile that both layouts read: K of tokens g and g + 8 (the lane's
  // kD / 4 dims); V as the interleaved A operands (VCodeOperands::FromInterleaved) by one
  // ldmatrix.trans: the 8 x 8 matrices of 16-bit chunks (tokens 0-7 | 8-15) x (chunks 0-7 | 8-15),
  // lane l addressing row l % 8 of matrix l / 8, so that lane (g, t) receives chunk g (and g + 8
  // at D = 128) of tokens 2t, 2t+1 and 2t+8, 2t+9 (at D = 128: dims 8 g + [0, 8) and
  // kD / 2 + 8 g + [0, 8); at D = 64: dims 8 g + [0, 8)). It replaces four loads and four byte
  // permutes per tile.
  auto load_codes = [&](const uint8_t* sb, uint32_t(&kw)[2][kKWords], uint32_t(&vw)[4]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint8_t* src = sb + (th.g + 8 * r) * kRow + th.t * (kD / 16);
      if constexpr (kKWords == 2) {
        const uint2 w = LoadShared<uint2>(src);
        kw[r][0] = w.x;
        kw[r][1] = w.y;
      } else {
        kw[r][0] = LoadShared<uint32_t>(src);
      }
    }
    const uint32_t v_addr =
        kNarrow ? SmemAddress(sb + kVOff + v_row_lane) : SmemAddress(sb) + v_row_pinned;
    LoadMatricesTransposed<kD == 128 ? 4 : 2>(v_addr, vw);
  };
  // O^T += V^T (P s)^T for one tile; pb is the B operand of the layout.
  auto accumulate_pv = [&](const uint32_t(&vw)[4], const uint32_t(&pb)[2]) {
    const VCodeOperands<kD> vo = VCodeOperands<kD>::FromInterleaved(vw);
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
      uint32_t a[4];
      vo.Tile(mi, a);
      MmaF16(acc[mi], a, pb);
    }
  };

  // One pair of tiles from stages sb[0], sb[1], their codes in kw (the n-tile is tokens g | g + 8)
  // and vw as compute below loads them; kMasked: tokens at or past c1 are absent. (The arrays come
  // as auto&: nvcc's front end crashes on array parameter types of a generic lambda here.)
  auto compute_wide = [&](const auto& sb, const auto& kw, const auto& vw, int start,
                          auto masked_tag) {
    constexpr bool kMasked = decltype(masked_tag)::value;
    uint32_t km[2][2][2];  // [tile][tokens 2t,2t+1 | 2t+8,2t+9][token of the pair]
    uint32_t vm[2][2][2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const uint2 a = LoadShared<uint2>(sb[e] + kKmOff + 32 * nt + 8 * th.t);
        const uint2 c = LoadShared<uint2>(sb[e] + kVmOff + 32 * nt + 8 * th.t);
        km[e][nt][0] = a.x;
        km[e][nt][1] = a.y;
        vm[e][nt][0] = c.x;
        vm[e][nt][1] = c.y;
      }
    }
    // S = Q K^T: four independent chains (tile, n-tile).
    float s[2][2][4] = {};
#pragma unroll
    for (int j = 0; j < kKSteps; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          uint32_t bk[2];
          KStepCodesB(kw[e][nt], j, bk);
          if constexpr (!kNarrow) MmaF16(s[e][nt], qf[j], bk);
        }
      }
    }
    // unscaled logit per token [tile][n-tile][cc] (token 16 e + 8 nt + 2t + cc of the pair).
    float unscaled[2][2][2];
    float mx = kNegInf;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int cc = 0; cc < 2; ++cc) {
          const float qc = s[e][nt][cc] + s[e][nt][2 + cc];
          const uint32_t w = km[e][nt][cc];
          float v = __fmaf_rn(MetaLo<kBf16>(w), qc, MetaHi<kBf16>(w) * beta_g);
          if constexpr (kMasked) {
            const bool ok = start + 16 * e + 8 * nt + 2 * th.t + cc < c1;
            v = ok ? v : kNegInf;
            vm[e][nt][cc] = ok ? vm[e][nt][cc] : 0u;
          }
          unscaled[e][nt][cc] = v;
          mx = fmaxf(mx, v);
        }
      }
    }
    const float mxl = mx * gamma;
    if (__any_sync(kFullMask, mxl > lim)) {
      // Move the reference of every query whose quad saw a logit above its limit to the quad's
      // max; rescale its sums.
      float qmax = fmaxf(mxl, __shfl_xor_sync(kFullMask, mxl, 1));
      qmax = fmaxf(qmax, __shfl_xor_sync(kFullMask, qmax, 2));
      const float corr = move_reference(qmax);
      // The O^T columns of this lane are queries 2t and 2t + 1: their factors live in quads
      // 2t and 2t + 1.
      const float c_even = __shfl_sync(kFullMask, corr, 8 * th.t);
      const float c_odd = __shfl_sync(kFullMask, corr, 8 * th.t + 4);
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
        acc[mi][0] *= c_even;
        acc[mi][1] *= c_odd;
        acc[mi][2] *= c_even;
        acc[mi][3] *= c_odd;
      }
    }
    // P, its sums, and the B operand (P s)^T: b[nt] holds tokens 8 nt + 2t, +1 for query g.
    // Both scale dtypes: p in fp32, P s rounded to fp16 once, and sum p * min_v in fp32 FMA. On
    // the tensor cores sum p * min_v would be biased: their fp32 accumulation truncates each
    // product to the accumulator's ulp, a bias that grows with the tokens per accumulator, and
    // sum p * min_v nearly cancels sum (P s) c, which amplifies its relative error (NOTES.md,
    // run 3).
    uint32_t pb[2][2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const float p0 = FastExp2(__fmaf_rn(unscaled[e][nt][0], gamma, -mo));
        const float p1 = FastExp2(__fmaf_rn(unscaled[e][nt][1], gamma, -mo));
        l_part += p0 + p1;
        pm_part = __fmaf_rn(p0, MetaHi<kBf16>(vm[e][nt][0]),
                            __fmaf_rn(p1, MetaHi<kBf16>(vm[e][nt][1]), pm_part));
        pb[e][nt] = PackHalf2(p0 * MetaLo<kBf16>(vm[e][nt][0]), p1 * MetaLo<kBf16>(vm[e][nt][1]));
      }
    }
    // O^T += V^T (P s)^T.
#pragma unroll
    for (int e = 0; e < 2; ++e) accumulate_pv(vw[e], pb[e]);
  };

  // Narrow layout: S^T [16 tokens x 8] = K [16 x D] Q^T per tile (rows g, g + 8 = tokens, columns
  // 2t, 2t+1 = high and low part of query t), O^T [D x 8] += V^T [D x 16] (P s)^T with columns
  // 2t, 2t+1 = high and low part of query t's P s (two fp16 terms: ~22 bits, no rounding of P s).
  // (P s)^T comes from the S layout by one movmatrix per 8-token block.
  auto compute_narrow = [&](const auto& sb, const auto& kw, const auto& vw, int start,
                            auto masked_tag) {
    constexpr bool kMasked = decltype(masked_tag)::value;
    uint32_t km[2][2];  // [tile][tokens g | g + 8]
    uint32_t vm[2][2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        km[e][r] = LoadShared<uint32_t>(sb[e] + kKmOff + 4 * (th.g + 8 * r));
        vm[e][r] = LoadShared<uint32_t>(sb[e] + kVmOff + 4 * (th.g + 8 * r));
      }
    }
    // S^T = K Q^T: two independent chains (tiles).
    float s[2][4] = {};
#pragma unroll
    for (int j = 0; j < kKSteps; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        uint32_t ak[4];
        KStepCodesA(kw[e][0], kw[e][1], j, ak);
        if constexpr (kNarrow) MmaF16(s[e], ak, qf[j]);
      }
    }
    // unscaled logit per token [tile][r]: token 16 e + g + 8 r of the pair, query t.
    float unscaled[2][2];
    float mx = kNegInf;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float qc = s[e][2 * r] + s[e][2 * r + 1];
        float v = __fmaf_rn(MetaLo<kBf16>(km[e][r]), qc, MetaHi<kBf16>(km[e][r]) * beta_g);
        if constexpr (kMasked) {
          const bool ok = start + 16 * e + th.g + 8 * r < c1;
          v = ok ? v : kNegInf;
          vm[e][r] = ok ? vm[e][r] : 0u;
        }
        unscaled[e][r] = v;
        mx = fmaxf(mx, v);
      }
    }
    const float mxl = mx * gamma;
    if (__any_sync(kFullMask, mxl > lim)) {
      // The reference of query t moves to the max over its 8 lanes; every accumulator column
      // of this lane belongs to query t.
      float qmax = fmaxf(mxl, __shfl_xor_sync(kFullMask, mxl, 4));
      qmax = fmaxf(qmax, __shfl_xor_sync(kFullMask, qmax, 8));
      qmax = fmaxf(qmax, __shfl_xor_sync(kFullMask, qmax, 16));
      const float corr = move_reference(qmax);
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
        for (int k = 0; k < 4; ++k) acc[mi][k] *= corr;
      }
    }
    // P in fp32; P s as fp16 high + low part in columns 2t, 2t+1 of block r, transposed into
    // the B operand (tokens 8 r + 2t, +1 of column g); sum p * min_v in fp32 FMA.
    uint32_t pb[2][2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float pr = FastExp2(__fmaf_rn(unscaled[e][r], gamma, -mo));
        l_part += pr;
        pm_part = __fmaf_rn(pr, MetaHi<kBf16>(vm[e][r]), pm_part);
        const float ps = pr * MetaLo<kBf16>(vm[e][r]);
        pb[e][r] = Transpose8x8(PackHalf2(ps, ps - __half2float(__float2half_rn(ps))));
      }
    }
    // O^T += V^T (P s)^T, as in the wide layout.
#pragma unroll
    for (int e = 0; e < 2; ++e) accumulate_pv(vw[e], pb[e]);
  };
  // One pair of tiles from stages sb0, sb1 in the kernel's layout: the codes of both tiles, then
  // the layout's own meta loads and math.
  auto compute = [&](const uint8_t* sb0, const uint8_t* sb1, int start, auto masked_tag) {
    const uint8_t* const sb[2] = {sb0, sb1};
    uint32_t kw[2][2][kKWords];  // [tile][tokens g | g + 8][word]
    uint32_t vw[2][4];           // [tile][V operands as load_codes delivers them]
#pragma unroll
    for (int e = 0; e < 2; ++e) load_codes(sb[e], kw[e], vw[e]);
    if constexpr (kNarrow) {
      compute_narrow(sb, kw, vw, start, masked_tag);
    } else {
      compute_wide(sb, kw, vw, start, masked_tag);
    }
  };

  auto stage = [&](int k) { return ring + ((2 * k) % kS) * kTile; };
  if (bulk) {
    // Full pairs: no masks, no branches but the loop's. Groups of pairs 0 .. k + kS/2 - 1 are
    // committed: all but the kS/2 - 1 newest are done, so pair k and E[k + kS/2] are in.
    const int n_full =
        c1 > w0 ? min(n_pairs, (c1 - w0 + kHistoryQuantum - kHistoryPairTokens) / kHistoryQuantum)
                : 0;
#pragma unroll 1
    for (int k = 0; k < n_full; ++k) {
      CpAsyncWait<kS / 2 - 1>();
      __syncwarp();
      compute(stage(k), stage(k) + kTile, pair_start(k), std::false_type{});
      // Every lane's reads of this pair's stages were consumed above; refill them with pair
      // k + kS/2, and fetch the entries of pair k + kS.
      __syncwarp();
      const int kn = k + kS / 2;
      const int2 e = *reinterpret_cast<const int2*>(entries + 2 * (kn % kER));
      copy_pair(kn, e.x, e.y);
      copy_entries(kn + kS / 2, 1);
      CpAsyncCommit();
    }
    if (n_full < n_pairs) {  // the last pair, partial (its group is the oldest pending)
      CpAsyncWait<kS / 2 - 1>();
      __syncwarp();
      compute(stage(n_full), stage(n_full) + kTile, pair_start(n_full), std::true_type{});
    }
    CpAsyncWait<0>();  // nothing is still in flight when the ring is reused below
  } else {
#pragma unroll 1
    for (int k = 0; k < n_pairs; ++k) {
      const int start = pair_start(k);
      __syncwarp();
      fill(start, stage(k));
      if (start + 16 < c1) fill(start + 16, stage(k) + kTile);
      __syncwarp();
      compute(stage(k), stage(k) + kTile, start, std::true_type{});
    }
  }

  // Partial result: combine the warps through shared memory (the ring is free: every copy
  // issued was waited for).
  // The lanes that share the softmax query: a quad (wide) or the 8 lanes of one t (narrow).
#pragma unroll
  for (int o = kNarrow ? 4 : 1; o <= (kNarrow ? 16 : 2); o *= 2) {
    l_part += __shfl_xor_sync(kFullMask, l_part, o);
    pm_part += __shfl_xor_sync(kFullMask, pm_part, o);
  }
  __syncthreads();
  float* sm_o = reinterpret_cast<float*>(history_smem);  // [warps][8][kD]
  float* sm_m = sm_o + kAttnWarps * 8 * kD;              // [warps][8]
  float* sm_l = sm_m + kAttnWarps * 8;
  float* sm_pm = sm_l + kAttnWarps * 8;
  const int sq = kNarrow ? th.t : th.g;
  if ((kNarrow ? th.g : th.t) == 0) {
    sm_m[th.warp * 8 + sq] = mo;
    sm_l[th.warp * 8 + sq] = l_part;
    sm_pm[th.warp * 8 + sq] = pm_part;
  }
  // Rows g, g + 8 of M-tile mi are dims 8 g + mi and 8 g + mi + kSecond (load_codes).
  constexpr int kSecond = kD == 128 ? kD / 2 : kD / 16;
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
    const float f0 = static_cast<float>(1 << (24 - CodePos(mi % 8)));
    const float f1 = static_cast<float>(1 << (24 - CodePos((mi + kD / 16) % 8)));
    if constexpr (kNarrow) {  // columns 2t, 2t+1: the two parts of query t
      float* o = sm_o + (th.warp * 8 + th.t) * kD + 8 * th.g + mi;
      o[0] = (acc[mi][0] + acc[mi][1]) * f0;
      o[kSecond] = (acc[mi][2] + acc[mi][3]) * f1;
    } else {  // columns 2t, 2t+1: queries 2t, 2t+1
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
        float* o = sm_o + (th.warp * 8 + 2 * th.t + cc) * kD + 8 * th.g + mi;
        o[0] = acc[mi][cc] * f0;
        o[kSecond] = acc[mi][2 + cc] * f1;
      }
    }
  }
  __syncthreads();
  CombineWarpStates<kD, 8>(p, th.b, th.kv_head, th.chunk, sm_o, sm_m, sm_l, sm_pm);
  if (p.merge_counters != nullptr) {
    static_assert(sizeof(MergeGroupSmem<kD, kAttnThreads>) <= kHistorySmemBytes<kD>);
    MergeIfLastPart<kD, kAttnThreads>(p, th.kv_head, th.b, history_smem);  // the ring is free
  }
}

}  // namespace kvpool::cuda::internal
