// The codec kernels: fused rotate + clip + quantize + pack on arrival, and dequantize to BF16.
// Arrival takes ArrivalMmaKernel (arrival_mma.cuh: 16-row tiles per warp, rotation on the tensor
// cores) where it fits (ArrivalMmaFits), else ArrivalRowKernel; ArrivalRowKernel and
// DequantKernel take one warp per (token, KV head) row, kCodecWarpsPerCta rows per CTA. Templated
// on the head dim (kD = 0: the generic path, D read at run time); codec_d*.cu instantiate them.
//
//   LaunchArrival<128>(params, stream);   // defined here, instantiated in codec_d128.cu
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "kernels/cuda/arrival_mma.cuh"
#include "kernels/cuda/codec_params.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/page_checksum_accumulate.cuh"
#include "kernels/cuda/warp_row_codec.cuh"

namespace kvpool::cuda::internal {

inline constexpr int kCodecWarpsPerCta = 4;

// Elements per lane: exact when D is a template constant, else the largest supported (D = 256).
template <int kD>
inline constexpr int kMaxElemsPerLane = kD == 0 ? 8 : kD / kWarpSize;

// Loads `count` consecutive floats (the lane's slice of a matrix row) with the widest loads
// the static shape allows.
template <int kMaxE, bool kStatic>
__device__ __forceinline__ void LoadLaneFloats(const float* __restrict__ src, int count,
                                               float (&out)[kMaxE]) {
  if constexpr (kStatic && kMaxE % 4 == 0) {
#pragma unroll
    for (int e = 0; e < kMaxE; e += 4) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(src + e));
      out[e] = v.x;
      out[e + 1] = v.y;
      out[e + 2] = v.z;
      out[e + 3] = v.w;
    }
  } else if constexpr (kStatic && kMaxE == 2) {
    const float2 v = __ldg(reinterpret_cast<const float2*>(src));
    out[0] = v.x;
    out[1] = v.y;
  } else {
#pragma unroll
    for (int e = 0; e < kMaxE; ++e) out[e] = e < count ? __ldg(src + e) : 0.f;
  }
}

// A row times a D x D row-major fp32 matrix, in fp32: the row is staged in the warp's shared
// memory (xs[0, head_dim)), lane l gets out dims [l e_count, (l + 1) e_count) (lanes read
// consecutive columns of each matrix row).
template <int kMaxE, bool kStatic>
__device__ __forceinline__ void WarpRowTimesMatrix(const float* xs, const float* __restrict__ m,
                                                   int head_dim, int e_count, float (&acc)[kMaxE]) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int e = 0; e < kMaxE; ++e) acc[e] = 0.f;
  const float* m_col = m + lane * e_count;
#pragma unroll 4
  for (int i = 0; i < head_dim; ++i) {
    float v[kMaxE];
    LoadLaneFloats<kMaxE, kStatic>(m_col + static_cast<int64_t>(i) * head_dim, e_count, v);
    const float xi = xs[i];
#pragma unroll
    for (int e = 0; e < kMaxE; ++e) acc[e] = __fmaf_rn(xi, v[e], acc[e]);
  }
}

template <int kD>
__global__ void __launch_bounds__(kCodecWarpsPerCta* kWarpSize)
    ArrivalRowKernel(const ArrivalParams p) {
  constexpr int kMaxE = kMaxElemsPerLane<kD>;
  constexpr bool kStatic = kD != 0;
  __shared__ float row_smem[kCodecWarpsPerCta][kMaxE * kWarpSize];

  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int head_dim = kStatic ? kD : p.geo.head_dim;
  const int e_count = kStatic ? kMaxE : head_dim / kWarpSize;
  const int kv_heads = p.geo.kv_heads;
  const int64_t row_head = static_cast<int64_t>(blockIdx.x) * kCodecWarpsPerCta + warp;
  if (row_head >= static_cast<int64_t>(p.batch.total_rows) * kv_heads) return;
  const int row = static_cast<int>(row_head / kv_heads);
  const int head = static_cast<int>(row_head % kv_heads);

  const int seq = FindSequence(p.batch, row);
  const RowSlot slot = LocateRow(p.geo, p.batch, seq, row, head, p.tensor);
  if (!slot.valid) {
    if (lane == 0) atomicOr(p.error_word, kErrorBadBlock);
    return;
  }

  const uint16_t* row_src = ArrivalRowPtr(p, head_dim, row_head, seq, row, head);
  if (row_src == nullptr) {
    if (lane == 0) atomicOr(p.error_word, kErrorBadBlock);
    return;
  }
  // The lane's slice of the input row.
  const uint16_t* src = row_src + lane * e_count;
  uint16_t bits[kMaxE];
#pragma unroll
  for (int e = 0; e < kMaxE; ++e) bits[e] = e < e_count ? __ldg(src + e) : 0;

  if (p.rotation != nullptr) {
    // x_rot[j] = sum_i x[i] * M[i][j] in fp32 (the rotation is compared with a tolerance; only
    // clip and quantize below are bit-exact).
    float* xs = row_smem[warp];
#pragma unroll
    for (int e = 0; e < kMaxE; ++e) {
      if (e < e_count) xs[lane * e_count + e] = Bf16BitsToFloat(bits[e]);
    }
    __syncwarp();
    float acc[kMaxE];
    WarpRowTimesMatrix<kMaxE, kStatic>(xs, p.rotation, head_dim, e_count, acc);
#pragma unroll
    for (int e = 0; e < kMaxE; ++e) bits[e] = e < e_count ? FloatToBf16Bits(acc[e]) : 0;
  }

  if (p.rotated_rows != nullptr) {
    uint16_t* dst = p.rotated_rows + row_head * head_dim + lane * e_count;
#pragma unroll
    for (int e = 0; e < kMaxE; ++e) {
      if (e < e_count) dst[e] = bits[e];
    }
  }

  RowShape shape;
  shape.head_dim = head_dim;
  shape.group_size = p.geo.group_size;
  shape.bits = p.geo.bits;
  shape.clip_rank = p.clip_rank;
  shape.scale_bf16 = p.scale_is_bf16 != 0;
  shape.lloyd_max = p.lloyd_max != 0;
  const uint32_t err =
      EncodeRowWarp<kMaxE>(bits, e_count, shape, p.pool + slot.codes, p.pool + slot.meta);
  if (err != 0 && lane == 0) atomicOr(p.error_word, err);
  if (err == 0 && p.page_checksums != nullptr) {
    AddRowChecksum(p.page_checksums + slot.entry, p.pool, slot.page, slot.codes, slot.meta,
                   p.geo.code_bytes_per_row, p.geo.meta_bytes_per_row);
  }
}

template <int kD>
__global__ void __launch_bounds__(kCodecWarpsPerCta* kWarpSize)
    DequantKernel(const DequantParams p) {
  constexpr int kMaxE = kMaxElemsPerLane<kD>;
  constexpr bool kStatic = kD != 0;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int head_dim = kStatic ? kD : p.geo.head_dim;
  const int e_count = kStatic ? kMaxE : head_dim / kWarpSize;
  const int kv_heads = p.geo.kv_heads;
  const int64_t row_head = static_cast<int64_t>(blockIdx.x) * kCodecWarpsPerCta + warp;
  if (row_head >= static_cast<int64_t>(p.batch.total_rows) * kv_heads) return;
  const int row = static_cast<int>(row_head / kv_heads);
  const int head = static_cast<int>(row_head % kv_heads);

  const int seq = FindSequence(p.batch, row);
  const RowSlot slot = LocateRow(p.geo, p.batch, seq, row, head, p.tensor);
  if (!slot.valid) {
    if (lane == 0) atomicOr(p.error_word, kErrorBadBlock);
    return;
  }
  RowShape shape;
  shape.head_dim = head_dim;
  shape.group_size = p.geo.group_size;
  shape.bits = p.geo.bits;
  shape.clip_rank = -1;
  shape.scale_bf16 = p.scale_is_bf16 != 0;
  shape.lloyd_max = false;
  float values[kMaxE];
  DecodeRowWarp<kMaxE>(p.pool + slot.codes, p.pool + slot.meta, e_count, shape, values);
  if (p.unrotation != nullptr) {
    // Back to the original basis, x[i] = sum_j x_rot[j] U[j][i], in fp32 from the decoded
    // values: the arrival rotation's access pattern (lanes read consecutive columns of row j).
    __shared__ float row_smem[kCodecWarpsPerCta][kMaxE * kWarpSize];
    float* xs = row_smem[warp];
#pragma unroll
    for (int e = 0; e < kMaxE; ++e) {
      if (e < e_count) xs[lane * e_count + e] = values[e];
    }
    __syncwarp();
    WarpRowTimesMatrix<kMaxE, kStatic>(xs, p.unrotation, head_dim, e_count, values);
  }
  uint16_t* dst = p.out + row_head * head_dim + lane * e_count;
#pragma unroll
  for (int e = 0; e < kMaxE; ++e) {
    if (e < e_count) dst[e] = FloatToBf16Bits(values[e]);
  }
}

inline unsigned CodecGrid(int total_rows, int kv_heads) {
  const int64_t rows = static_cast<int64_t>(total_rows) * kv_heads;
  return static_cast<unsigned>((rows + kCodecWarpsPerCta - 1) / kCodecWarpsPerCta);
}

// Resident CTAs of ArrivalMmaKernel<kD> on the current device (with its shared-memory limit
// raised); cached per device.
template <int kD>
int ArrivalMmaCtas() {
  static std::atomic<int> cache[16] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return -1;
  if (device < 16 && cache[device].load(std::memory_order_relaxed) > 0) {
    return cache[device].load(std::memory_order_relaxed);
  }
  int sms = 0;
  int per_sm = 0;
  if (cudaFuncSetAttribute(ArrivalMmaKernel<kD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           kArrivalSmemBytes<kD>) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, ArrivalMmaKernel<kD>, kArrivalThreads,
                                                    kArrivalSmemBytes<kD>) != cudaSuccess) {
    return -1;
  }
  const int ctas = std::max(1, sms * std::max(per_sm, 1));
  if (device < 16) cache[device].store(ctas, std::memory_order_relaxed);
  return ctas;
}

// Whether ArrivalMmaKernel takes `p`: INT2 with one group per row, or BF16 bypass pages
// whose rows take 8-byte stores; 16-byte aligned rows.
template <int kD>
bool ArrivalMmaFits(const ArrivalParams& p) {
  if constexpr (kD == 64 || kD == 128) {
    const bool int2 = p.geo.bits == 2 && p.geo.group_size == kD && p.lloyd_max == 0;
    const bool bypass = p.geo.bits == 16 && p.geo.code_bytes_per_row == 2 * kD &&
                        p.geo.block_bytes % 8 == 0 && p.geo.head_segment_bytes % 8 == 0 &&
                        p.geo.codes_offset[p.tensor] % 8 == 0;
    // Paged input rows take 16-byte loads.
    const PagedRowSource& src = p.paged;
    const bool rows_aligned =
        src.pool == nullptr
            ? reinterpret_cast<uintptr_t>(p.rows) % 16 == 0
            : reinterpret_cast<uintptr_t>(src.pool) % 16 == 0 && src.geo.bits == 16 &&
                  src.geo.code_bytes_per_row == 2 * kD && src.geo.block_bytes % 16 == 0 &&
                  src.geo.head_segment_bytes % 16 == 0 && src.geo.codes_offset[p.tensor] % 16 == 0;
    return p.use_mma_kernel != 0 && (int2 || bypass) && rows_aligned &&
           reinterpret_cast<uintptr_t>(p.pool) % 8 == 0 &&
           reinterpret_cast<uintptr_t>(p.rotated_rows) % 16 == 0;
  } else {
    return false;
  }
}

template <int kD>
int LaunchArrivalJobs(const ArrivalJobsParams& p, CUstream_st* stream) {
  if (p.count < 1 || p.count > kMaxArrivalJobs) return kArrivalNotFused;
  bool rotate = false;
  int64_t most_tiles = 0;
  for (int i = 0; i < p.count; ++i) {
    if (!ArrivalMmaFits<kD>(p.job[i])) return kArrivalNotFused;
    rotate = rotate || p.job[i].rotation != nullptr;
    most_tiles = std::max<int64_t>(
        most_tiles,
        (static_cast<int64_t>(p.job[i].batch.total_rows) * p.job[i].geo.kv_heads + 15) / 16);
  }
  if constexpr (kD == 64 || kD == 128) {
    if (most_tiles == 0) return 0;
    const int ctas = ArrivalMmaCtas<kD>();
    if (ctas < 0) return static_cast<int>(cudaGetLastError());
    // Persistent in x (each warp strides over its job's tiles), one job per y.
    const int64_t grid = std::min<int64_t>(ctas, (most_tiles + kArrivalWarps - 1) / kArrivalWarps);
    ArrivalMmaKernel<kD><<<dim3(static_cast<unsigned>(grid), static_cast<unsigned>(p.count)),
                           kArrivalThreads, rotate ? kArrivalSmemBytes<kD> : 0, stream>>>(p);
    return static_cast<int>(cudaGetLastError());
  }
  return kArrivalNotFused;
}

template <int kD>
int LaunchArrival(const ArrivalParams& p, CUstream_st* stream) {
  if (p.batch.total_rows == 0) return 0;
  ArrivalJobsParams one{};
  one.job[0] = p;
  one.count = 1;
  const int fused = LaunchArrivalJobs<kD>(one, stream);
  if (fused != kArrivalNotFused) return fused;
  ArrivalRowKernel<kD>
      <<<CodecGrid(p.batch.total_rows, p.geo.kv_heads), kCodecWarpsPerCta * kWarpSize, 0, stream>>>(
          p);
  return static_cast<int>(cudaGetLastError());
}

template <int kD>
int LaunchDequant(const DequantParams& p, CUstream_st* stream) {
  if (p.batch.total_rows == 0) return 0;
  DequantKernel<kD>
      <<<CodecGrid(p.batch.total_rows, p.geo.kv_heads), kCodecWarpsPerCta * kWarpSize, 0, stream>>>(
          p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace kvpool::cuda::internal
