// Warp-level tensor-core and register helpers (sm_80+ PTX, all valid on sm_90 and sm_90a):
// mma.sync m16n8k16 with fp16 inputs and fp32 accumulators, an in-register 8x8 transpose, and
// the 2-bit code -> fp16 extraction used by the INT2 attention.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), with g = lane / 4 and
// t = lane % 4:
//   A (16x16, row-major): a[0] = (row g,   cols 2t, 2t+1)   a[1] = (row g+8, cols 2t, 2t+1)
//                         a[2] = (row g,   cols 2t+8, 2t+9) a[3] = (row g+8, cols 2t+8, 2t+9)
//   B (16x8):             b[0] = (rows 2t, 2t+1, col g)     b[1] = (rows 2t+8, 2t+9, col g)
//   C (16x8, fp32):       c[0], c[1] = (row g, cols 2t, 2t+1), c[2], c[3] = (row g+8, same)
// Each 32-bit register holds two fp16 values, the lower-numbered column/row in the low half.
//
//   float c[4] = {0, 0, 0, 0};
//   MmaF16(c, a, b);
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

namespace kvpool::cuda::internal {

// c += A * B (fp16 inputs, fp32 accumulate).
__device__ __forceinline__ void MmaF16(float (&c)[4], const uint32_t (&a)[4],
                                       const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Transposes an 8x8 matrix of 16-bit values held in the C/ldmatrix layout (lane holds row
// lane / 4, columns 2 (lane % 4) and +1): afterwards the lane holds the same positions of the
// transpose.
__device__ __forceinline__ uint32_t Transpose8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// ldmatrix.trans of kMatrices (2 or 4) 8x8 matrices of 16-bit values from shared memory: lane l
// addresses row l % 8 of matrix l / 8 and receives, in register m, the transpose's positions of
// Transpose8x8's layout in matrix m.
template <int kMatrices>
__device__ __forceinline__ void LoadMatricesTransposed(uint32_t smem_addr, uint32_t (&r)[4]) {
  static_assert(kMatrices == 2 || kMatrices == 4);
  if constexpr (kMatrices == 4) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(smem_addr));
  }
}

__device__ __forceinline__ uint32_t PackHalf2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Byte permute (prmt.b32): result byte k = byte selector[k] of the 8-byte value {b, a}.
__device__ __forceinline__ uint32_t Permute(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}

// Splits x = hi + lo into two fp16 values (hi = fp16(x), lo = fp16(x - hi)): the tensor-core
// products hi * c + lo * c against exact operands c (codes), or hi hi + hi lo + lo hi between two
// split operands, carry about 22 bits: fp32-like accuracy although the MMA inputs are fp16.
__device__ __forceinline__ void SplitHalf2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __half2 h = __floats2half2_rn(x0, x1);
  const float2 back = __half22float2(h);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = PackHalf2(x0 - back.x, x1 - back.y);
}

__device__ __forceinline__ float FastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 2-bit codes to fp16 without arithmetic. A 32-bit word w holds 16 codes, code i (0..15) in
// bits [2i, 2i+1]. ExtractCodesAt(w, i) for i in 0..7 returns a register whose low half holds code
// i and high half code i+8, each as an fp16 SUBNORMAL c * 2^(pos - 24) with pos = CodePos(i): the
// code sits in mantissa bits [pos, pos+1] and the exponent field is 0. Tensor cores take subnormal
// fp16 exactly; the caller folds 2^(24 - pos) back into the other operand or the accumulator. One
// AND (plus one shift for i >= 5) per two codes.
__host__ __device__ constexpr int CodePos(int i) { return i < 5 ? 2 * i : 2 * (i - 5); }

// i is a compile-time constant after unrolling; the branch folds away.
__device__ __forceinline__ uint32_t ExtractCodesAt(uint32_t w, int i) {
  return i < 5 ? (w & (0x00030003u << (2 * i))) : ((w >> 10) & (0x00030003u << (2 * (i - 5))));
}

// K-step j (16 dims) of a lane's K code words (word j / 4, codes 2 (j % 4) and 2 (j % 4) + 1 of
// it) as MMA operand registers: the B operand of one token row, or the A operand of the rows
// g (k0) and g + 8 (k1).
template <int kWords>
__device__ __forceinline__ void KStepCodesB(const uint32_t (&k)[kWords], int j, uint32_t (&b)[2]) {
  b[0] = ExtractCodesAt(k[j / 4], 2 * (j % 4));
  b[1] = ExtractCodesAt(k[j / 4], 2 * (j % 4) + 1);
}
template <int kWords>
__device__ __forceinline__ void KStepCodesA(const uint32_t (&k0)[kWords],
                                            const uint32_t (&k1)[kWords], int j, uint32_t (&a)[4]) {
  uint32_t row0[2];
  uint32_t row1[2];
  KStepCodesB(k0, j, row0);
  KStepCodesB(k1, j, row1);
  a[0] = row0[0];
  a[1] = row1[0];
  a[2] = row0[1];
  a[3] = row1[1];
}

}  // namespace kvpool::cuda::internal
