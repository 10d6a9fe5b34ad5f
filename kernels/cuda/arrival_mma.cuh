// Rotate + clip + quantize + pack on arrival on the tensor cores (included by codec_kernels.cuh):
// INT2, uniform (min/max) quantizer, one group per row (G = D), or BF16 bypass pages; D = 64 or
// 128. Codes and meta equal the CPU RowCodec's bit for bit for the same rotated BF16 rows, as
// the warp-per-row ArrivalRowKernel's do (which takes every other configuration: INT4, smaller
// groups, Lloyd-Max, other head dims, unaligned rows).
//
// One warp takes a tile of 16 consecutive input rows (token x KV head) at a time, in a
// persistent grid:
// - Rotation on the tensor cores: (X M)^T = M^T X^T with M = M_hi + M_lo (both BF16, so M carries
//   ~16 bits; the products are exact and accumulate in fp32), mma.m16n8k16. X^T is the B
//   operand: a lane's two B registers are one token's consecutive words, so the 16-byte input
//   loads feed the MMAs as they are (as the A operand, X interleaves two tokens per register
//   quad, and ptxas spent ~45 moves per row building the quads). The CTA stages M^T once,
//   already in A-fragment order, in shared memory (16-byte loads, hi and lo). The k order of the
//   product is permuted to match the loads (the rows of M are permuted the same way). One
//   movmatrix per 8 x 8 BF16 block transposes the result back to a row per quad.
// - Layout of a rotated row in its quad (the columns of M^T are permuted to give it): lane t
//   holds the dims of code words [kD/64 t, kD/64 (t+1)) of the row, as BF16 pairs (dim d, dim
//   d + 8), which the packed code word holds at bits 2 (d % 16) and 2 (d % 16) + 16: so each
//   lane packs its own code words, no shuffles.
// - The rotated row rounds to BF16 in the accumulator layout: the 4 lanes of a quad hold one
//   row (and a second one, 8 rows down), D/4 values each, as packed BF16 pairs.
// - Exact clip order statistic: a binary search for the largest magnitude key K with
//   #{keys < K} <= c, each probe one packed BF16 compare + add per two keys and two quad
//   shuffles, started from a bracket [max - 256, max] that holds for clip ratios near 1
//   (falls back to the full range when it does not).
// - Clip in the packed integer domain; min/max with packed BF16 min/max (the sign of a zero
//   min or max follows the first zero in dim order, as the CPU's sequential scan).
// - Codes without a division per element: the code is #{k : x >= T_k}, k = 1..3, for three
//   per-row BF16 thresholds found exactly (monotone search on the normative formula
//   floor(fl(fl(fl(x - m) / s) + 0.5))). The thresholds are monotone, so with the three compare
//   masks m1 >= m2 >= m3 the code's bits are (m2, m1 ^ m2 ^ m3): three packed compares and
//   three bitwise ops per element pair, straight into the lane's code words.
// - Page checksums (p.page_checksums set): each lane adds the terms of the words it stores, a
//   tile's terms go to its page's sum in one atomic (page_checksum_accumulate.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/codec_params.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/page_checksum_accumulate.cuh"

namespace kvpool::cuda::internal {

inline constexpr int kArrivalWarps = 8;
inline constexpr int kArrivalThreads = kArrivalWarps * kWarpSize;

// A fragments of M^T: [k-step][m-tile][hi, lo][lane] x {a0, a1, a2, a3}.
template <int kD>
inline constexpr int kArrivalSmemBytes = (kD / 16) * (kD / 16) * 2 * kWarpSize * 16;

__device__ __forceinline__ void MmaBf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t Bf16x2Bits(__nv_bfloat162 v) {
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ __nv_bfloat162 AsBf16x2(uint32_t v) {
  return *reinterpret_cast<const __nv_bfloat162*>(&v);
}
// Round to nearest even, low half = lo.
__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
  return Bf16x2Bits(__floats2bfloat162_rn(lo, hi));
}
__device__ __forceinline__ uint32_t LessBf16x2(uint32_t a, uint32_t b) {  // a < b: 1.0 / 0.0
  return Bf16x2Bits(__hlt2(AsBf16x2(a), AsBf16x2(b)));
}
__device__ __forceinline__ uint32_t GreaterEqualMaskBf16x2(uint32_t a, uint32_t b) {  // 0xffff / 0
  return __hge2_mask(AsBf16x2(a), AsBf16x2(b));
}
__device__ __forceinline__ uint32_t AddBf16x2(uint32_t a, uint32_t b) {
  return Bf16x2Bits(__hadd2(AsBf16x2(a), AsBf16x2(b)));
}
__device__ __forceinline__ uint32_t MinBf16x2(uint32_t a, uint32_t b) {
  return Bf16x2Bits(__hmin2(AsBf16x2(a), AsBf16x2(b)));
}
__device__ __forceinline__ uint32_t MaxBf16x2(uint32_t a, uint32_t b) {
  return Bf16x2Bits(__hmax2(AsBf16x2(a), AsBf16x2(b)));
}
__device__ __forceinline__ uint32_t MaxU16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.u16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t Word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// The dim that lane t of a quad holds in half e of its packed word L of a rotated row (the
// layout above): code word kD/64 t + L / 8, bit 2 (8 e + L % 8).
template <int kD>
__device__ __forceinline__ int ArrivalLaneDim(int t, int L, int e) {
  return 16 * ((kD / 64) * t + L / 8) + 8 * e + L % 8;
}

// Position of a BF16 bit pattern in value order (-inf = 0x7f, -0 = 0x7fff, +0 = 0x8000,
// +inf = 0xff80), and back.
__device__ __forceinline__ int Bf16Order(uint32_t b) {
  return (b & 0x8000u) ? 0x7fff - static_cast<int>(b & 0x7fffu) : static_cast<int>(b | 0x8000u);
}
__device__ __forceinline__ uint32_t Bf16FromOrder(int o) {
  return o >= 0x8000 ? static_cast<uint32_t>(o & 0x7fff)
                     : (0x8000u | static_cast<uint32_t>(0x7fff - o));
}

// Smallest fp32 y > 0 with fl(fl(y / s) + 0.5) >= k (s > 0): the threshold of code >= k in
// y = fl(x - m). Starts at fl((k - 0.5) s), within a few ulps of the answer.
__device__ __forceinline__ float CodeThresholdY(int k, float s) {
  const float kf = static_cast<float>(k);
  auto reaches = [&](float y) { return __fadd_rn(__fdiv_rn(y, s), 0.5f) >= kf; };
  float y = __fmul_rn(kf - 0.5f, s);
  if (reaches(y)) {
#pragma unroll 1
    for (int i = 0; i < 32; ++i) {
      const float down = __int_as_float(__float_as_int(y) - 1);
      if (!(down > 0.f) || !reaches(down)) break;
      y = down;
    }
  } else {
#pragma unroll 1
    for (int i = 0; i < 32 && !reaches(y); ++i) y = __int_as_float(__float_as_int(y) + 1);
  }
  return y;
}

template <int kD>
__global__ void __launch_bounds__(kArrivalThreads) ArrivalMmaKernel(const ArrivalJobsParams jobs) {
  const ArrivalParams& p = jobs.job[blockIdx.y];
  constexpr int kKSteps = kD / 16;
  constexpr int kNT = kD / 8;       // n-tiles of the rotated row
  constexpr int kChunks = kD / 32;  // 16-byte input chunks per row and lane
  constexpr int kWords = kD / 16;   // 32-bit code words per row
  constexpr int kLaneWords = kWords / 4;
  constexpr int kMT = kD / 16;  // m-tiles of the rotated row (M^T rows)
  extern __shared__ __align__(16) uint4 afrag[];
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int g = lane / 4;
  const int t = lane % 4;
  const bool rotate = p.rotation != nullptr;
  const bool bypass = p.geo.bits == 16;

  // Stage M^T (rotation only). Lane (g, t) of k-step j, m-tile mt: a0 = (m g, k 2t, 2t+1), a1 =
  // (m g+8, k 2t, 2t+1), a2 = (m g, k 2t+8, 2t+9), a3 = (m g+8, k 2t+8, 2t+9); row m of m-tile mt
  // ends, after the transpose, in lane (m % 8) / 2 of the quad, half m % 2 of its packed word
  // 2 mt + m / 8, so it is the rotated dim ArrivalLaneDim there; k index 8h + 2t + b of k-step j
  // holds input dim 32 (j / 2) + 8t + 4 (j % 2) + 2h + b (the order of the 16-byte input loads
  // below).
  // Unrolled, so that all of a thread's loads of M are in flight at once (one at a time, the
  // staging was most of a small launch's kernel time: NOTES.md, run 6).
  static_assert(kKSteps * kMT * kWarpSize % kArrivalThreads == 0);
#pragma unroll
  for (int idx = threadIdx.x; rotate && idx < kKSteps * kMT * kWarpSize; idx += kArrivalThreads) {
    const int j = idx / (kMT * kWarpSize);
    const int mt = (idx / kWarpSize) % kMT;
    const int ln = idx % kWarpSize;
    const int lg = ln / 4;
    const int lt = ln % 4;
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int n = ArrivalLaneDim<kD>(lg / 2, 2 * mt + q % 2, lg % 2);
      hi[q] = lo[q] = 0;
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int d = 32 * (j / 2) + 8 * lt + 4 * (j % 2) + 2 * (q / 2) + b;
        const float m = __ldg(p.rotation + d * kD + n);
        const uint32_t h = FloatToBf16Bits(m);
        hi[q] |= h << (16 * b);
        lo[q] |= static_cast<uint32_t>(FloatToBf16Bits(__fsub_rn(m, Bf16BitsToFloat(h))))
                 << (16 * b);
      }
    }
    const int base = ((j * kMT + mt) * 2) * kWarpSize + ln;
    afrag[base] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    afrag[base + kWarpSize] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
  }
  __syncthreads();

  const int kv_heads = p.geo.kv_heads;
  const int64_t total = static_cast<int64_t>(p.batch.total_rows) * kv_heads;
  const int64_t num_tiles = (total + 15) / 16;
  const bool scale_bf16 = p.scale_is_bf16 != 0;
  const int c = p.clip_rank;
  uint32_t* const sums = p.page_checksums;
  for (int64_t tile = static_cast<int64_t>(blockIdx.x) * kArrivalWarps + warp; tile < num_tiles;
       tile += static_cast<int64_t>(gridDim.x) * kArrivalWarps) {
    // The warp's next tile into L2 (its 16 rows are contiguous: 128 bytes per lane at D = 128),
    // so that its loads wait on L2 rather than on DRAM.
    if (p.paged.pool == nullptr) {
      const int64_t next = tile + static_cast<int64_t>(gridDim.x) * kArrivalWarps;
      if (next < num_tiles) {
        const uint16_t* ahead = p.rows + next * 16 * kD + lane * (16 * kD / kWarpSize);
        const int64_t left = (total - next * 16) * kD;
        if (lane * (16 * kD / kWarpSize) < left) {
          asm volatile("prefetch.global.L2 [%0];\n" ::"l"(ahead));
        }
      }
    }
    // Rows r = 0 (g) and 1 (g + 8) of the tile; row 1's location follows from row 0's without
    // another division or search.
    int64_t rh[2];
    bool in[2];
    RowSlot slot[2];
    const uint16_t* src_row[2];  // the input row (null past the end or for a bad source block)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      rh[r] = tile * 16 + g + 8 * r;
      in[r] = rh[r] < total;
      slot[r].valid = false;
      slot[r].codes = 0;
      slot[r].meta = 0;
      slot[r].page = 0;
      slot[r].entry = -1;
      src_row[r] = nullptr;
    }
    if (in[0]) {
      int row = static_cast<int>(rh[0] / kv_heads);
      int head = static_cast<int>(rh[0] - static_cast<int64_t>(row) * kv_heads);
      int seq = FindSequence(p.batch, row);
      slot[0] = LocateRow(p.geo, p.batch, seq, row, head, p.tensor);
      src_row[0] = ArrivalRowPtr(p, kD, rh[0], seq, row, head);
      if (in[1]) {
        for (head += 8; head >= kv_heads; head -= kv_heads) ++row;
        while (seq + 1 < p.batch.num_seqs && __ldg(p.batch.row_offsets + seq + 1) <= row) ++seq;
        slot[1] = LocateRow(p.geo, p.batch, seq, row, head, p.tensor);
        src_row[1] = ArrivalRowPtr(p, kD, rh[1], seq, row, head);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // A row with a bad source block is reported as a bad block, like a bad destination.
      if (src_row[r] == nullptr) slot[r].valid = false;
    }
    // Checksum terms of the words this lane stores in row r, and its sums index (-1: none).
    uint32_t ck_term[2] = {0u, 0u};
    int ck_entry[2] = {-1, -1};

    // ob[r][L] = the rotated row r's BF16 pair at dims ArrivalLaneDim(t, L, 0), (t, L, 1).
    uint32_t ob[2][kNT];
    if (rotate) {
      uint4 xc[2][kChunks];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint4* src = reinterpret_cast<const uint4*>(src_row[r]);
#pragma unroll
        for (int u = 0; u < kChunks; ++u) {
          xc[r][u] = src != nullptr ? __ldg(src + 4 * u + t) : make_uint4(0u, 0u, 0u, 0u);
        }
      }
      // acc[r]: M^T rows g (and g + 8) of m-tile mt for tokens 2t, 2t+1 of n-tile r (the tile's
      // rows r).
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        float acc[2][4] = {};
#pragma unroll
        for (int j = 0; j < kKSteps; ++j) {
          const uint4 ah = afrag[((j * kMT + mt) * 2) * kWarpSize + lane];
          const uint4 al = afrag[((j * kMT + mt) * 2 + 1) * kWarpSize + lane];
          const uint32_t a_hi[4] = {ah.x, ah.y, ah.z, ah.w};
          const uint32_t a_lo[4] = {al.x, al.y, al.z, al.w};
          const int u = j / 2;
          const int w = 2 * (j % 2);
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            MmaBf16(acc[r], a_hi, Word(xc[r][u], w), Word(xc[r][u], w + 1));
            MmaBf16(acc[r], a_lo, Word(xc[r][u], w), Word(xc[r][u], w + 1));
          }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          ob[r][2 * mt] = Transpose8x8(PackBf16x2(acc[r][0], acc[r][1]));
          ob[r][2 * mt + 1] = Transpose8x8(PackBf16x2(acc[r][2], acc[r][3]));
        }
      }
    } else {
      // Identity: the input bits as they are (no product, so -0 stays -0). The lane's dims are
      // contiguous: 16-byte loads, then pairs (d, d + 8) (same half of words w and w + 4).
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint4* src = reinterpret_cast<const uint4*>(src_row[r]);
        uint32_t v[kLaneWords * 8];
#pragma unroll
        for (int u = 0; u < kLaneWords * 2; ++u) {
          const uint4 x =
              src != nullptr ? __ldg(src + kLaneWords * 2 * t + u) : make_uint4(0u, 0u, 0u, 0u);
          v[4 * u] = x.x;
          v[4 * u + 1] = x.y;
          v[4 * u + 2] = x.z;
          v[4 * u + 3] = x.w;
        }
#pragma unroll
        for (int L = 0; L < kNT; ++L) {
          const int w = 8 * (L / 8) + (L % 8) / 2;
          ob[r][L] = Permute(v[w], v[w + 4], L % 2 == 0 ? 0x5410u : 0x7632u);
        }
      }
    }

    // The lane's span of row r back in dim order: word w holds dims 2w, 2w + 1 of the span.
    auto InDimOrder = [&](int r, uint32_t(&v)[kLaneWords * 8]) {
#pragma unroll
      for (int w = 0; w < kLaneWords * 8; ++w) {
        const int j = 2 * (w % 8);  // dim of the pair within its code word's 16
        const int L = 8 * (w / 8) + j % 8;
        v[w] = Permute(ob[r][L], ob[r][L + 1], j < 8 ? 0x5410u : 0x7632u);
      }
    };

    // Row status (identical on the quad's lanes).
    bool ok[2];
    int max_key[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (p.rotated_rows != nullptr && in[r] && slot[r].valid) {
        uint32_t v[kLaneWords * 8];
        InDimOrder(r, v);
        uint4* dst = reinterpret_cast<uint4*>(p.rotated_rows + rh[r] * kD) + kLaneWords * 2 * t;
#pragma unroll
        for (int u = 0; u < kLaneWords * 2; ++u) {
          dst[u] = make_uint4(v[4 * u], v[4 * u + 1], v[4 * u + 2], v[4 * u + 3]);
        }
      }
      uint32_t mk = ob[r][0] & 0x7fff7fffu;
#pragma unroll
      for (int nt = 1; nt < kNT; ++nt) mk = MaxU16x2(mk, ob[r][nt] & 0x7fff7fffu);
      int m = max(static_cast<int>(mk & 0xffffu), static_cast<int>(mk >> 16));
      m = max(m, __shfl_xor_sync(kFullMask, m, 1));
      m = max(m, __shfl_xor_sync(kFullMask, m, 2));
      max_key[r] = m;
      const bool finite = m < 0x7f80;
      const bool in_range = m < kValueMagnitudeLimitBf16Bits;
      ok[r] = in[r] && slot[r].valid && in_range;
      if (in[r] && t == 0) {
        if (!slot[r].valid) {
          atomicOr(p.error_word, kErrorBadBlock);
        } else if (!finite) {
          atomicOr(p.error_word, kErrorNonFinite);
        } else if (!in_range) {
          atomicOr(p.error_word, kErrorOutOfRange);
        }
      }
    }

    if (bypass) {  // BF16 pages (sink, recent): the rotated row as it is, 8-byte stores
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (!ok[r]) continue;
        uint32_t v[kLaneWords * 8];
        InDimOrder(r, v);
        uint2* dst = reinterpret_cast<uint2*>(p.pool + slot[r].codes) + kLaneWords * 4 * t;
#pragma unroll
        for (int u = 0; u < kLaneWords * 4; ++u) dst[u] = make_uint2(v[2 * u], v[2 * u + 1]);
        if (sums != nullptr) {
          const uint32_t at =
              static_cast<uint32_t>(slot[r].codes - slot[r].page) + 32 * kLaneWords * t;
#pragma unroll
          for (int w = 0; w < kLaneWords * 8; ++w) ck_term[r] += PageChecksumTerm(v[w], at + 4 * w);
          ck_entry[r] = static_cast<int>(slot[r].entry);
        }
      }
      if (sums != nullptr) AddTileChecksums(sums, ck_entry, ck_term);
      continue;
    }

    // Clip: tau = the c-th smallest magnitude key of the row.
    if (c >= 0) {
      // The magnitudes once (HSET2 takes no |x| operand: per probe, the abs cost a third more).
      uint32_t key[2][kNT];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) key[r][nt] = ob[r][nt] & 0x7fff7fffu;
      }
      auto count_less = [&](int r, int cand) {
        const uint32_t cc = static_cast<uint32_t>(min(cand, 0x7f80)) * 0x10001u;
        // Four partial sums: short dependent chains (exact: counts <= 64 per half).
        uint32_t part[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) part[i] = LessBf16x2(key[r][i], cc);
#pragma unroll
        for (int nt = 4; nt < kNT; ++nt) {
          part[nt % 4] = AddBf16x2(part[nt % 4], LessBf16x2(key[r][nt], cc));
        }
        uint32_t acc = AddBf16x2(AddBf16x2(part[0], part[1]), AddBf16x2(part[2], part[3]));
        acc = AddBf16x2(acc, __shfl_xor_sync(kFullMask, acc, 1));
        acc = AddBf16x2(acc, __shfl_xor_sync(kFullMask, acc, 2));
        return static_cast<int>(Bf16BitsToFloat(static_cast<uint16_t>(acc & 0xffffu)) +
                                Bf16BitsToFloat(static_cast<uint16_t>(acc >> 16)));
      };
      // Largest K with #{keys < K} <= c; invariant #{< lo} <= c < #{< hi + 1}.
      // Brackets: the binade below the max (128 keys) holds tau on Gaussian-like rows at clip
      // ratios near 1; then the next binade (only when a row of the warp needs it), then the
      // rest.
      int lo[2], hi[2];
      bool below[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        lo[r] = 0;
        hi[r] = ok[r] ? max_key[r] : 0;
        const int probe = max(hi[r] - 128, 0);
        below[r] = count_less(r, probe) > c;
        if (below[r]) {
          hi[r] = probe - 1;
        } else {
          lo[r] = probe;
        }
      }
      if (__any_sync(kFullMask, below[0] || below[1])) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int probe = max(hi[r] - 127, 0);
          const bool le = count_less(r, probe) <= c;
          if (below[r]) {
            if (le) {
              lo[r] = probe;
            } else {
              hi[r] = probe - 1;
            }
          }
        }
      }
#pragma unroll 1
      while (__any_sync(kFullMask, lo[0] < hi[0] || lo[1] < hi[1])) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int mid = (lo[r] + hi[r] + 1) >> 1;
          if (count_less(r, mid) <= c) {
            lo[r] = mid;
          } else {
            hi[r] = mid - 1;
          }
        }
      }
      // x > tau in magnitude -> sign(x) tau (std::min / std::max semantics), else unchanged.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint32_t tau2 = static_cast<uint32_t>(lo[r]) * 0x10001u;
        const uint32_t gt_bias = static_cast<uint32_t>(0x7fff - lo[r]) * 0x10001u;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          const uint32_t x = ob[r][nt];
          // Selector nibbles 8 + b replicate bit 7 of byte b: each half 0xffff where its key
          // exceeds tau (the bias carried into bit 15), else 0.
          const uint32_t above = Permute((x & 0x7fff7fffu) + gt_bias, 0u, 0xbb99u);
          const uint32_t clipped = (x & 0x80008000u) | tau2;
          ob[r][nt] = (above & clipped) | (~above & x);
        }
      }
    }

    // Min and max of the clipped row.
    uint32_t mn_bits[2], mx_bits[2];
    bool zero_case = false;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      uint32_t mn = ob[r][0];
      uint32_t mx = ob[r][0];
#pragma unroll
      for (int nt = 1; nt < kNT; ++nt) {
        mn = MinBf16x2(mn, ob[r][nt]);
        mx = MaxBf16x2(mx, ob[r][nt]);
      }
      mn = MinBf16x2(mn, __shfl_xor_sync(kFullMask, mn, 1));
      mx = MaxBf16x2(mx, __shfl_xor_sync(kFullMask, mx, 1));
      mn = MinBf16x2(mn, __shfl_xor_sync(kFullMask, mn, 2));
      mx = MaxBf16x2(mx, __shfl_xor_sync(kFullMask, mx, 2));
      mn = MinBf16x2(mn, mn >> 16) & 0xffffu;
      mx = MaxBf16x2(mx, mx >> 16) & 0xffffu;
      mn_bits[r] = mn;
      mx_bits[r] = mx;
      zero_case = zero_case || (ok[r] && ((mn & 0x7fffu) == 0u || (mx & 0x7fffu) == 0u));
    }
    if (__any_sync(kFullMask, zero_case)) {
      // A zero min or max takes the sign of the first zero of the row in dim order.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        int first = kD;
        uint32_t sign = 0u;
#pragma unroll
        for (int L = 0; L < kNT; ++L) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const uint32_t v = (ob[r][L] >> (16 * e)) & 0xffffu;
            const int d = ArrivalLaneDim<kD>(t, L, e);
            if ((v & 0x7fffu) == 0u && d < first) {
              first = d;
              sign = v & 0x8000u;
            }
          }
        }
#pragma unroll
        for (int o = 1; o <= 2; o <<= 1) {
          const int of = __shfl_xor_sync(kFullMask, first, o);
          const uint32_t os = __shfl_xor_sync(kFullMask, sign, o);
          if (of < first) {
            first = of;
            sign = os;
          }
        }
        if ((mn_bits[r] & 0x7fffu) == 0u) mn_bits[r] = sign;
        if ((mx_bits[r] & 0x7fffu) == 0u) mx_bits[r] = sign;
      }
    }

    // Scale, min, thresholds, codes, stores.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float mn_f = Bf16BitsToFloat(static_cast<uint16_t>(mn_bits[r]));
      const float mx_f = Bf16BitsToFloat(static_cast<uint16_t>(mx_bits[r]));
      const float s32 = __fdiv_rn(__fsub_rn(mx_f, mn_f), 3.0f);
      const uint16_t sw = FloatToScaleWord(s32, scale_bf16);
      const uint16_t mw = FloatToScaleWord(mn_f, scale_bf16);
      const float s = ScaleWordToFloat(sw, scale_bf16);
      const float m = ScaleWordToFloat(mw, scale_bf16);
      const bool in_range = isfinite(s) && isfinite(m);
      if (ok[r] && !in_range && t == 0) atomicOr(p.error_word, kErrorOutOfRange);
      const bool write = ok[r] && in_range;
      // Lane t < 3 finds T_{t+1}: the smallest BF16 x in [mn, next(mx)] with
      // fl(x - m) >= Y_{t+1} (next(mx): no element reaches it).
      uint32_t my_t = 0x7f80u;
      if (write && s != 0.0f && t < 3) {
        const float y = CodeThresholdY(t + 1, s);
        // Predicate P(o): fl(x(o) - m) >= y, monotone; lo_o (P false) and hi_o (P true) are
        // sentinels just outside [mn, mx]. fl(x - m) >= y holds from x - m = the midpoint of
        // y and its fp32 predecessor on (ties aside), so the answer is the BF16 value at or
        // just above m + that midpoint (exact in double): try the window of 4 around it first.
        // (Around m + y instead, the window missed whenever m + y is near zero, where BF16
        // values are dense: the middle threshold of every row that straddles zero.)
        const int o_min = Bf16Order(mn_bits[r]) - 1;
        const int o_max = Bf16Order(mx_bits[r]) + 1;
        auto holds = [&](int o) {
          return __fsub_rn(Bf16BitsToFloat(static_cast<uint16_t>(Bf16FromOrder(o))), m) >= y;
        };
        const double mid_y = 0.5 * (static_cast<double>(y) +
                                    static_cast<double>(__int_as_float(__float_as_int(y) - 1)));
        const int o_est =
            Bf16Order(FloatToBf16Bits(__double2float_rn(static_cast<double>(m) + mid_y)));
        int lo_o = max(o_min, min(o_est - 2, o_max));
        int hi_o = min(o_max, max(o_est + 2, o_min));
        if (lo_o > o_min && holds(lo_o)) lo_o = o_min;
        if (hi_o < o_max && !holds(hi_o)) hi_o = o_max;
        if (hi_o <= lo_o) {
          lo_o = o_min;
          hi_o = o_max;
        }
#pragma unroll 1
        for (int it = 0; it < 17 && hi_o - lo_o > 1; ++it) {
          const int mid = (lo_o + hi_o) >> 1;
          if (holds(mid)) {
            hi_o = mid;
          } else {
            lo_o = mid;
          }
        }
        // Ending on the upper sentinel: no element reaches the threshold (+inf; a +0 element
        // next to a -0 max must not compare equal to it).
        my_t = hi_o > Bf16Order(mx_bits[r]) ? 0x7f80u : Bf16FromOrder(hi_o);
      }
      const int quad = lane & ~3;
      const uint32_t t1 = __shfl_sync(kFullMask, my_t, quad) * 0x10001u;
      const uint32_t t2 = __shfl_sync(kFullMask, my_t, quad + 1) * 0x10001u;
      const uint32_t t3 = __shfl_sync(kFullMask, my_t, quad + 2) * 0x10001u;
      // code = #{k : x >= T_k} = (m2, m1 ^ m2 ^ m3) in bits for the masks mk = (x >= T_k).
      uint32_t mine[kLaneWords] = {};
#pragma unroll
      for (int L = 0; L < kNT; ++L) {
        const uint32_t x = ob[r][L];
        const uint32_t m1 = GreaterEqualMaskBf16x2(x, t1);
        const uint32_t m2 = GreaterEqualMaskBf16x2(x, t2);
        const uint32_t m3 = GreaterEqualMaskBf16x2(x, t3);
        const uint32_t bit0 = (0x00010001u << (2 * (L % 8)));
        mine[L / 8] |= ((m1 ^ m2 ^ m3) & bit0) | (m2 & (bit0 << 1));
      }
      if (!write) continue;
      uint8_t* codes = p.pool + slot[r].codes;
      if constexpr (kLaneWords == 2) {
        reinterpret_cast<uint2*>(codes)[t] = make_uint2(mine[0], mine[1]);
      } else {
        reinterpret_cast<uint32_t*>(codes)[t] = mine[0];
      }
      const uint32_t meta_word = static_cast<uint32_t>(sw) | (static_cast<uint32_t>(mw) << 16);
      if (t == 0) *reinterpret_cast<uint32_t*>(p.pool + slot[r].meta) = meta_word;
      if (sums != nullptr) {
        const uint32_t at =
            static_cast<uint32_t>(slot[r].codes - slot[r].page) + 4 * kLaneWords * t;
#pragma unroll
        for (int w = 0; w < kLaneWords; ++w) ck_term[r] += PageChecksumTerm(mine[w], at + 4 * w);
        if (t == 0) {
          ck_term[r] +=
              PageChecksumTerm(meta_word, static_cast<uint32_t>(slot[r].meta - slot[r].page));
        }
        ck_entry[r] = static_cast<int>(slot[r].entry);
      }
    }
    if (sums != nullptr) AddTileChecksums(sums, ck_entry, ck_term);
  }
}

}  // namespace kvpool::cuda::internal
