// 16-bit float storage types and their exact conversions.
//
// Bf16 is bfloat16 (8-bit exponent), Fp16 is IEEE binary16. Both are plain 16-bit words so
// that the same bytes can be handed to CUDA as __nv_bfloat16 / __half. Conversions from float
// round to nearest, ties to even, exactly as the CUDA intrinsics __float2bfloat16_rn and
// __float2half_rn do, so CPU and GPU agree bit for bit.
//
//   Bf16 b = Bf16::FromFloat(1.5f);
//   float f = b.ToFloat();
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kvpool {

struct Bf16 {
  uint16_t bits = 0;

  static Bf16 FromBits(uint16_t b) { return Bf16{b}; }
  static Bf16 FromFloat(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) return Bf16{static_cast<uint16_t>((u >> 16) | 0x40u)};
    const uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
    return Bf16{static_cast<uint16_t>((u + rounding_bias) >> 16)};
  }
  float ToFloat() const {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  }
  bool IsFinite() const { return (bits & 0x7f80u) != 0x7f80u; }  // exponent all ones: Inf/NaN
};
static_assert(sizeof(Bf16) == 2, "Bf16 must be a plain 16-bit word");

// Whether none of `n` words is Inf or NaN. Branch-free over blocks of 256 words so that the
// compiler vectorizes it (the scan runs over every arriving K/V row).
inline bool AllFinite(const Bf16* x, size_t n) {
  constexpr size_t kBlock = 256;
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    unsigned bad = 0;
    for (size_t j = 0; j < kBlock; ++j) bad |= (x[i + j].bits & 0x7f80u) == 0x7f80u;
    if (bad != 0) return false;
  }
  for (; i < n; ++i) {
    if (!x[i].IsFinite()) return false;
  }
  return true;
}

struct Fp16 {
  uint16_t bits = 0;

  static Fp16 FromBits(uint16_t b) { return Fp16{b}; }
  static Fp16 FromFloat(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
    const uint32_t abs = u & 0x7fffffffu;
    if (abs > 0x7f800000u) return Fp16{static_cast<uint16_t>(sign | 0x7e00u)};   // NaN
    if (abs >= 0x477ff000u) return Fp16{static_cast<uint16_t>(sign | 0x7c00u)};  // overflow
    if (abs < 0x38800000u) {
      // Result is subnormal (or zero) in half: value = abs_float * 2^24 rounded to integer.
      if (abs < 0x33000000u) return Fp16{sign};  // below half of the smallest subnormal
      const uint32_t exp = abs >> 23;
      const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
      const uint32_t shift = 126u - exp;  // 14 + (112 - exp) + 1 ... see derivation below
      // value = mant * 2^(exp-150); half subnormal unit is 2^-24 -> units = mant * 2^(exp-126)
      const uint32_t units = mant >> shift;
      const uint32_t rem = mant & ((1u << shift) - 1u);
      const uint32_t half = 1u << (shift - 1u);
      uint32_t r = units;
      if (rem > half || (rem == half && (units & 1u))) ++r;
      return Fp16{static_cast<uint16_t>(sign | r)};
    }
    // Normal: rebias exponent (127 -> 15) and round the 13 dropped mantissa bits to even.
    uint32_t h = ((abs - 0x38000000u) >> 13);
    const uint32_t rem = abs & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
    return Fp16{static_cast<uint16_t>(sign | h)};
  }
  float ToFloat() const {
    const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
    const uint32_t exp = (bits >> 10) & 0x1fu;
    const uint32_t mant = bits & 0x3ffu;
    uint32_t u;
    if (exp == 0) {
      if (mant == 0) {
        u = sign;
      } else {  // subnormal: normalize
        int e = -1;
        uint32_t m = mant;
        do {
          ++e;
          m <<= 1;
        } while ((m & 0x400u) == 0);
        u = sign | ((112u - static_cast<uint32_t>(e)) << 23) | ((m & 0x3ffu) << 13);
      }
    } else if (exp == 0x1f) {
      u = sign | 0x7f800000u | (mant << 13);
    } else {
      u = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  }
};
static_assert(sizeof(Fp16) == 2, "Fp16 must be a plain 16-bit word");

}  // namespace kvpool
