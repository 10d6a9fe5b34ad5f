// The row codec on the GPU: one warp clips, quantizes and packs one rotated BF16 row, or unpacks
// and dequantizes one stored row, with the normative arithmetic of kernels/row_codec.h (fp32,
// explicit round-to-nearest intrinsics, no FMA), so codes equal the CPU RowCodec's bit for bit.
//
// Each lane holds E = D / 32 consecutive dims [lane * E, lane * E + E) of the row, so a lane's
// codes are one contiguous run of E * bits bits in the packed row (block_layout.h: dim 4j+i of
// an INT2 row sits in bits [2i, 2i+1] of byte j). kMaxE is E when D is known at compile time,
// else an upper bound (8, D = 256) and `e < E` guards the elements.
//
//   uint32_t err = EncodeRowWarp<4>(bits, 4, shape, codes_ptr, meta_ptr);   // D = 128
//   DecodeRowWarp<4>(codes_ptr, meta_ptr, 4, shape, values);
#pragma once

#include <cstdint>

#include "kernels/cuda/device_common.cuh"

namespace kvpool::cuda::internal {

// What an encoder needs to know about a row besides its values.
struct RowShape {
  int head_dim;     // D
  int group_size;   // G
  int bits;         // 2, 4, or 16 (bypass)
  int clip_rank;    // c, or -1 for no clip
  bool scale_bf16;  // 16-bit scale/min dtype
  bool lloyd_max;   // Lloyd-Max buckets (INT2, G = D) instead of the uniform min/max grid
};

// Lloyd-Max constants (docs/oscar-method.md section 8), the same fp32 expressions as the CPU codec.
inline constexpr float kLloydMaxStep = (2.0f * 1.50956f / 3.0f) * 1.16f;
inline constexpr float kLloydMaxThreshold = 0.98107f;
inline constexpr float kLloydMaxEps = 1e-8f;

// Sum of the row in the normative order (row_codec.h): pairwise halving v[i] += v[i + n/2] for
// n = D, D/2, ..., 2. With E consecutive dims per lane, the halvings of at least E are a
// shuffle-down tree over lanes (same element slot), the rest happen inside lane 0; the result
// is broadcast to every lane.
template <int kMaxE>
__device__ __forceinline__ float WarpHalvingSum(const float (&x)[kMaxE], int e_count) {
  float v[kMaxE];
#pragma unroll
  for (int e = 0; e < kMaxE; ++e) v[e] = x[e];
#pragma unroll
  for (int lanes = kWarpSize / 2; lanes >= 1; lanes >>= 1) {
#pragma unroll
    for (int e = 0; e < kMaxE; ++e) {
      v[e] = __fadd_rn(v[e], __shfl_down_sync(kFullMask, v[e], lanes));
    }
  }
#pragma unroll
  for (int h = kMaxE / 2; h >= 1; h >>= 1) {
    if (h > e_count / 2) continue;
#pragma unroll
    for (int e = 0; e < h; ++e) v[e] = __fadd_rn(v[e], v[e + h]);
  }
  return __shfl_sync(kFullMask, v[0], 0);
}

// 0 on every lane when every valid element of the row (BF16 words) is finite and inside
// kvpool's value range (kernels/value_range.h); else kErrorNonFinite or kErrorOutOfRange.
template <int kMaxE>
__device__ __forceinline__ uint32_t WarpRowRangeError(const uint16_t (&bits)[kMaxE], int e_count) {
  uint32_t worst = 0;
#pragma unroll
  for (int e = 0; e < kMaxE; ++e) {
    if (e < e_count) worst = max(worst, static_cast<uint32_t>(bits[e] & 0x7fffu));
  }
  if (__any_sync(kFullMask, worst >= 0x7f80u)) return kErrorNonFinite;
  return __any_sync(kFullMask, worst >= kValueMagnitudeLimitBf16Bits) ? kErrorOutOfRange : 0u;
}

// The c-th smallest (0-based) magnitude over the warp's row, as a BF16 magnitude key
// (bits & 0x7fff; for finite values its order is the order of |x|). Radix select over the 15
// key bits, most significant first; every lane returns the same key.
template <int kMaxE>
__device__ __forceinline__ uint32_t WarpSelectMagnitude(const uint16_t (&bits)[kMaxE], int e_count,
                                                        int c) {
  uint32_t key[kMaxE];
#pragma unroll
  for (int e = 0; e < kMaxE; ++e) key[e] = bits[e] & 0x7fffu;
  uint32_t prefix = 0;
  int rank = c;
#pragma unroll 1
  for (int b = 14; b >= 0; --b) {
    const uint32_t high = prefix >> (b + 1);
    int zeros = 0;
#pragma unroll
    for (int e = 0; e < kMaxE; ++e) {
      const bool zero = e < e_count && (key[e] >> (b + 1)) == high && ((key[e] >> b) & 1u) == 0;
      zeros += __popc(__ballot_sync(kFullMask, zero));
    }
    if (rank >= zeros) {
      rank -= zeros;
      prefix |= 1u << b;
    }
  }
  return prefix;
}

// Min and max of each element's group over the row, where the group may span lanes. Ties keep
// the value of the lowest dim (the result of a sequential scan `if (x < mn) mn = x` in dim
// order), which matters only for +0 versus -0.
template <int kMaxE>
__device__ __forceinline__ void WarpGroupMinMax(const float (&x)[kMaxE], int e_count, int group,
                                                float (&mn)[kMaxE], float (&mx)[kMaxE]) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int e = 0; e < kMaxE; ++e) {
    mn[e] = x[e];
    mx[e] = x[e];
    if (e >= e_count) continue;
    const int g = (lane * e_count + e) / group;
    bool seen = false;
#pragma unroll
    for (int f = 0; f < kMaxE; ++f) {
      if (f >= e_count || (lane * e_count + f) / group != g) continue;
      if (!seen) {
        mn[e] = x[f];
        mx[e] = x[f];
        seen = true;
      } else {
        if (x[f] < mn[e]) mn[e] = x[f];
        if (mx[e] < x[f]) mx[e] = x[f];
      }
    }
  }
  // Groups wider than one lane: butterfly over group / E aligned lanes.
  const int lanes_per_group = group / e_count;
#pragma unroll 1
  for (int o = 1; o < lanes_per_group; o <<= 1) {
    const bool other_first = (lane & o) != 0;
#pragma unroll
    for (int e = 0; e < kMaxE; ++e) {
      const float omn = __shfl_xor_sync(kFullMask, mn[e], o);
      const float omx = __shfl_xor_sync(kFullMask, mx[e], o);
      if (other_first) {
        mn[e] = (mn[e] < omn) ? mn[e] : omn;
        mx[e] = (omx < mx[e]) ? mx[e] : omx;
      } else {
        mn[e] = (omn < mn[e]) ? omn : mn[e];
        mx[e] = (mx[e] < omx) ? omx : mx[e];
      }
    }
  }
}

// Writes the lane's `per_lane_bits` bits (its codes, little end first) into the packed row.
__device__ __forceinline__ void WarpStorePackedBits(uint32_t word, int per_lane_bits,
                                                    uint8_t* row) {
  const int lane = threadIdx.x % kWarpSize;
  if (per_lane_bits >= 8) {
    const int nbytes = per_lane_bits / 8;
    uint8_t* dst = row + lane * nbytes;
    if (nbytes == 4) {
      *reinterpret_cast<uint32_t*>(dst) = word;
    } else if (nbytes == 2) {
      *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(word);
    } else {
      *dst = static_cast<uint8_t>(word);
    }
    return;
  }
  const int lanes_per_byte = 8 / per_lane_bits;
  uint32_t v = word << (per_lane_bits * (lane % lanes_per_byte));
  for (int o = 1; o < lanes_per_byte; o <<= 1) v |= __shfl_xor_sync(kFullMask, v, o);
  if (lane % lanes_per_byte == 0) row[lane / lanes_per_byte] = static_cast<uint8_t>(v);
}

// Reads back the lane's `per_lane_bits` bits of a packed row.
__device__ __forceinline__ uint32_t WarpLoadPackedBits(const uint8_t* row, int per_lane_bits) {
  const int lane = threadIdx.x % kWarpSize;
  if (per_lane_bits >= 8) {
    const int nbytes = per_lane_bits / 8;
    const uint8_t* src = row + lane * nbytes;
    if (nbytes == 4) return __ldg(reinterpret_cast<const uint32_t*>(src));
    if (nbytes == 2) return __ldg(reinterpret_cast<const uint16_t*>(src));
    return __ldg(src);
  }
  const int bit = lane * per_lane_bits;
  const uint32_t byte = __ldg(row + bit / 8);
  return (byte >> (bit % 8)) & ((1u << per_lane_bits) - 1u);
}

// Clips, quantizes and packs one rotated BF16 row held by the warp (`bits`, E per lane) into
// `codes` (code_bytes_per_row bytes) and `meta` (groups x {u16 scale, u16 min}). Returns 0, or
// error bits (codec_params.h) identical on every lane, in which case nothing was written.
template <int kMaxE>
__device__ __forceinline__ uint32_t EncodeRowWarp(const uint16_t (&bits)[kMaxE], int e_count,
                                                  const RowShape& shape, uint8_t* codes,
                                                  uint8_t* meta) {
  const int lane = threadIdx.x % kWarpSize;
  if (const uint32_t error = WarpRowRangeError<kMaxE>(bits, e_count); error != 0) return error;

  if (shape.bits == 16) {  // bypass: the rotated BF16 row as it is
    uint16_t* dst = reinterpret_cast<uint16_t*>(codes) + lane * e_count;
#pragma unroll
    for (int e = 0; e < kMaxE; ++e) {
      if (e < e_count) dst[e] = bits[e];
    }
    return 0;
  }

  float x[kMaxE];
#pragma unroll
  for (int e = 0; e < kMaxE; ++e) x[e] = Bf16BitsToFloat(bits[e]);

  if (shape.clip_rank >= 0) {
    const float tau = Bf16BitsToFloat(
        static_cast<uint16_t>(WarpSelectMagnitude<kMaxE>(bits, e_count, shape.clip_rank)));
    const float neg_tau = -tau;
#pragma unroll
    for (int e = 0; e < kMaxE; ++e) {
      // min(max(x, -tau), tau) with std::max / std::min semantics.
      const float y = (x[e] < neg_tau) ? neg_tau : x[e];
      x[e] = (tau < y) ? tau : y;
    }
  }

  const float levels = static_cast<float>((1 << shape.bits) - 1);
  uint16_t scale_word[kMaxE];
  uint16_t min_word[kMaxE];
  bool in_range = true;
  uint32_t word = 0;
  if (shape.lloyd_max) {
    // One group (G = D): mu, sigma over the clipped row; codes from the Gaussian buckets.
    const float d_float = static_cast<float>(shape.head_dim);
    const float mu = __fdiv_rn(WarpHalvingSum<kMaxE>(x, e_count), d_float);
    float sq[kMaxE];
#pragma unroll
    for (int e = 0; e < kMaxE; ++e) {
      const float dev = __fsub_rn(x[e], mu);
      sq[e] = e < e_count ? __fmul_rn(dev, dev) : 0.f;
    }
    const float var = __fdiv_rn(WarpHalvingSum<kMaxE>(sq, e_count), d_float);
    const float sigma = __fsqrt_rn(__fadd_rn(var, kLloydMaxEps));
    const float s32 = __fmul_rn(kLloydMaxStep, sigma);
    const float m32 = __fsub_rn(mu, __fmul_rn(1.5f, s32));
    const uint16_t sw = FloatToScaleWord(s32, shape.scale_bf16);
    const uint16_t mw = FloatToScaleWord(m32, shape.scale_bf16);
    in_range = isfinite(ScaleWordToFloat(sw, shape.scale_bf16)) &&
               isfinite(ScaleWordToFloat(mw, shape.scale_bf16));
#pragma unroll
    for (int e = 0; e < kMaxE; ++e) {
      scale_word[e] = sw;
      min_word[e] = mw;
      if (e >= e_count) continue;
      const float tn = __fdiv_rn(__fsub_rn(x[e], mu), sigma);
      const uint32_t code = static_cast<uint32_t>(tn >= -kLloydMaxThreshold) +
                            static_cast<uint32_t>(tn >= 0.0f) +
                            static_cast<uint32_t>(tn >= kLloydMaxThreshold);
      word |= code << (e * shape.bits);
    }
  } else {
    float mn[kMaxE];
    float mx[kMaxE];
    WarpGroupMinMax<kMaxE>(x, e_count, shape.group_size, mn, mx);
#pragma unroll
    for (int e = 0; e < kMaxE; ++e) {
      if (e >= e_count) continue;
      const float s32 = __fdiv_rn(__fsub_rn(mx[e], mn[e]), levels);
      scale_word[e] = FloatToScaleWord(s32, shape.scale_bf16);
      min_word[e] = FloatToScaleWord(mn[e], shape.scale_bf16);
      const float s = ScaleWordToFloat(scale_word[e], shape.scale_bf16);
      const float m = ScaleWordToFloat(min_word[e], shape.scale_bf16);
      in_range = in_range && isfinite(s) && isfinite(m);
      uint32_t code = 0;
      if (s != 0.0f) {
        float t = floorf(__fadd_rn(__fdiv_rn(__fsub_rn(x[e], m), s), 0.5f));
        t = (t < 0.0f) ? 0.0f : t;
        t = (levels < t) ? levels : t;
        code = static_cast<uint32_t>(t);
      }
      word |= code << (e * shape.bits);
    }
  }
  if (!__all_sync(kFullMask, in_range)) return kErrorOutOfRange;

  WarpStorePackedBits(word, e_count * shape.bits, codes);
#pragma unroll
  for (int e = 0; e < kMaxE; ++e) {
    if (e >= e_count) continue;
    const int dim = lane * e_count + e;
    if (dim % shape.group_size == 0) {
      const uint32_t pair =
          static_cast<uint32_t>(scale_word[e]) | (static_cast<uint32_t>(min_word[e]) << 16);
      reinterpret_cast<uint32_t*>(meta)[dim / shape.group_size] = pair;
    }
  }
  return 0;
}

// Unpacks and dequantizes one stored row (x = min + code * scale, fp32, no FMA) into the lane's
// E values, returned as fp32; for the bypass the stored BF16 words widened.
template <int kMaxE>
__device__ __forceinline__ void DecodeRowWarp(const uint8_t* codes, const uint8_t* meta,
                                              int e_count, const RowShape& shape,
                                              float (&out)[kMaxE]) {
  const int lane = threadIdx.x % kWarpSize;
  if (shape.bits == 16) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(codes) + lane * e_count;
#pragma unroll
    for (int e = 0; e < kMaxE; ++e) out[e] = e < e_count ? Bf16BitsToFloat(__ldg(src + e)) : 0.f;
    return;
  }
  const uint32_t word = WarpLoadPackedBits(codes, e_count * shape.bits);
  const uint32_t mask = (1u << shape.bits) - 1u;
  const uint32_t* meta_words = reinterpret_cast<const uint32_t*>(meta);
#pragma unroll
  for (int e = 0; e < kMaxE; ++e) {
    out[e] = 0.f;
    if (e >= e_count) continue;
    const int dim = lane * e_count + e;
    const uint32_t pair = __ldg(meta_words + dim / shape.group_size);
    const float s = ScaleWordToFloat(static_cast<uint16_t>(pair & 0xffffu), shape.scale_bf16);
    const float m = ScaleWordToFloat(static_cast<uint16_t>(pair >> 16), shape.scale_bf16);
    const float code = static_cast<float>((word >> (e * shape.bits)) & mask);
    out[e] = __fadd_rn(m, __fmul_rn(code, s));
  }
}

}  // namespace kvpool::cuda::internal
