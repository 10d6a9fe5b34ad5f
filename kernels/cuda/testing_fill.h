// Test and benchmark helper: fills device memory with real-like random BF16 values on the GPU
// (hash-based, deterministic for a seed), so that large inputs (batch 32 at 128K tokens) need
// no host round trip. Not for production code.
//
//   KVPOOL_RETURN_IF_ERROR(FillRealLikeBf16(d_rows, rows * head_dim, head_dim, seed, stream));
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_codec.h"

namespace kvpool::cuda::testing {

// dst[i], i < count, viewed as rows of `row_len` values: N(0, 1) plus 4 outlier channels
// (i % row_len in {3, 17, 40, 61} scaled by 10), times `scale`. Enqueued on `stream`.
[[nodiscard]] absl::Status FillRealLikeBf16(uint16_t* dst, size_t count, int row_len, uint64_t seed,
                                            float scale, Stream stream);

// dst[i] = N(0, 1) * scale in fp32.
[[nodiscard]] absl::Status FillGaussianF32(float* dst, size_t count, uint64_t seed, float scale,
                                           Stream stream);

// Checks, on the current device, the two hardware facts the INT2 attention relies on:
// mma.m16n8k16 takes subnormal fp16 inputs exactly (codes are fed as c * 2^-24), and
// movmatrix transposes an 8x8 fragment. OK, or Internal naming the fact that failed.
[[nodiscard]] absl::Status ProbeTensorCoreAssumptions();

}  // namespace kvpool::cuda::testing
