// CopyRanges writes exactly what cudaMemcpy2D would for each range (aligned blocks, unaligned
// pitched rows, empty ranges), more ranges than the kernel has blocks, and nothing else. Skips
// without a GPU.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/copy_ranges.h"

namespace kvpool::cuda {
namespace {

TEST(CopyRangesCudaTest, WritesEveryRangeAndNothingElse) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  constexpr size_t kBytes = size_t{8} << 20;
  std::mt19937 rng(11);
  std::vector<uint8_t> src(kBytes), dst(kBytes);
  for (uint8_t& b : src) b = static_cast<uint8_t>(rng());
  for (uint8_t& b : dst) b = static_cast<uint8_t>(rng());
  uint8_t *d_src = nullptr, *d_dst = nullptr;
  ASSERT_EQ(cudaSuccess, cudaMalloc(reinterpret_cast<void**>(&d_src), kBytes));
  ASSERT_EQ(cudaSuccess, cudaMalloc(reinterpret_cast<void**>(&d_dst), kBytes));
  ASSERT_EQ(cudaSuccess, cudaMemcpy(d_src, src.data(), kBytes, cudaMemcpyHostToDevice));
  ASSERT_EQ(cudaSuccess, cudaMemcpy(d_dst, dst.data(), kBytes, cudaMemcpyHostToDevice));

  // Ranges laid out one after another in the destination (never overlapping), of three kinds:
  // 16-byte aligned blocks, pitched rows at odd offsets and lengths, and empty ranges. More of
  // them than the kernel's grid, so blocks take several each.
  std::vector<DeviceCopy> ranges;
  std::vector<uint8_t> want = dst;
  size_t at = 0;
  for (int i = 0; i < 5000; ++i) {
    DeviceCopy c;
    const int kind = i % 3;
    if (kind == 0) {
      c.bytes = 16 * (1 + rng() % 96);
      at = (at + 15) / 16 * 16;
      c.src = d_src + (rng() % (kBytes / 2)) / 16 * 16;
    } else if (kind == 1) {
      c.bytes = 1 + rng() % 300;
      c.rows = 1 + rng() % 8;
      c.src_pitch = c.bytes + rng() % 64;
      c.dst_pitch = c.bytes + rng() % 64;
      at += rng() % 7;
      c.src = d_src + rng() % (kBytes / 2);
    } else {
      c.bytes = rng() % 2 ? 0 : 64;
      c.rows = c.bytes == 0 ? 3 : 0;
      c.src = d_src;
    }
    c.dst = d_dst + at;
    const size_t span = c.rows == 0 ? 0 : (c.rows - 1) * (c.rows > 1 ? c.dst_pitch : 0) + c.bytes;
    if (at + span > kBytes) break;
    for (uint64_t r = 0; r < c.rows; ++r) {
      const size_t s_off = (c.src - d_src) + r * (c.rows > 1 ? c.src_pitch : 0);
      const size_t d_off = at + r * (c.rows > 1 ? c.dst_pitch : 0);
      for (uint64_t b = 0; b < c.bytes; ++b) want[d_off + b] = src[s_off + b];
    }
    if (c.rows == 1) c.src_pitch = c.dst_pitch = 0;  // one row: pitches unused
    ranges.push_back(c);
    at += span;
  }
  ASSERT_GT(ranges.size(), 3000u);
  DeviceCopy* d_ranges = nullptr;
  ASSERT_EQ(cudaSuccess,
            cudaMalloc(reinterpret_cast<void**>(&d_ranges), ranges.size() * sizeof(DeviceCopy)));
  ASSERT_EQ(cudaSuccess, cudaMemcpy(d_ranges, ranges.data(), ranges.size() * sizeof(DeviceCopy),
                                    cudaMemcpyHostToDevice));
  ASSERT_TRUE(CopyRanges(d_ranges, static_cast<int>(ranges.size()), nullptr).ok());
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  std::vector<uint8_t> got(kBytes);
  ASSERT_EQ(cudaSuccess, cudaMemcpy(got.data(), d_dst, kBytes, cudaMemcpyDeviceToHost));
  size_t wrong = 0;
  for (size_t i = 0; i < kBytes; ++i) wrong += got[i] != want[i];
  EXPECT_EQ(wrong, 0u);
  EXPECT_TRUE(CopyRanges(d_ranges, 0, nullptr).ok());  // nothing to do
  cudaFree(d_ranges);
  cudaFree(d_src);
  cudaFree(d_dst);
}

}  // namespace
}  // namespace kvpool::cuda
