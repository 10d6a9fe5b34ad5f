// The CUDA page checksum equals the CPU one (kernels/page_checksum.h) for INT2 and BF16 pages,
// any slot range. Skips without a GPU.
#include "kernels/cuda/page_checksum_cuda.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvpool::cuda {
namespace {

BlockLayout Layout(int bits) {
  BlockLayout l;
  l.tokens = 16;
  l.kv_heads = 8;
  l.head_dim = 128;
  l.group_size = bits == 16 ? 128 : 32;
  l.bits = bits;
  return l;
}

TEST(PageChecksumCudaTest, EqualsTheCpuChecksum) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const BlockLayout history = Layout(2), bf16 = Layout(16);
  // Pages of either kind at 16-byte strides of one arena, as in the pool.
  const size_t pages = 64;
  const size_t page_bytes = bf16.block_bytes();  // the larger
  std::vector<uint8_t> host(pages * page_bytes);
  std::mt19937 rng(5);
  for (uint8_t& b : host) b = static_cast<uint8_t>(rng());
  std::vector<ChecksumRange> ranges;
  std::vector<uint32_t> want;
  for (size_t p = 0; p < pages; ++p) {
    const bool is_history = p % 2 == 0;
    const BlockLayout& l = is_history ? history : bf16;
    const int first = static_cast<int>(p % 7), count = static_cast<int>(1 + p % (16 - first));
    ranges.push_back({static_cast<int32_t>(p * page_bytes / 16), first, count, is_history});
    want.push_back(
        PageSlotsChecksum(&host[p * page_bytes], PageChecksumGeometry::Of(l), first, count));
  }
  uint8_t* pool = nullptr;
  ChecksumRange* d_ranges = nullptr;
  uint32_t* d_out = nullptr;
  ASSERT_EQ(cudaSuccess, cudaMalloc(reinterpret_cast<void**>(&pool), host.size()));
  ASSERT_EQ(cudaSuccess,
            cudaMalloc(reinterpret_cast<void**>(&d_ranges), ranges.size() * sizeof(ChecksumRange)));
  ASSERT_EQ(cudaSuccess,
            cudaMalloc(reinterpret_cast<void**>(&d_out), ranges.size() * sizeof(uint32_t)));
  ASSERT_EQ(cudaSuccess, cudaMemcpy(pool, host.data(), host.size(), cudaMemcpyHostToDevice));
  ASSERT_EQ(cudaSuccess, cudaMemcpy(d_ranges, ranges.data(), ranges.size() * sizeof(ChecksumRange),
                                    cudaMemcpyHostToDevice));
  ASSERT_TRUE(PageChecksums(pool, PageChecksumGeometry::Of(history), PageChecksumGeometry::Of(bf16),
                            d_ranges, static_cast<int>(ranges.size()), d_out, nullptr)
                  .ok());
  std::vector<uint32_t> got(ranges.size());
  ASSERT_EQ(cudaSuccess,
            cudaMemcpy(got.data(), d_out, got.size() * sizeof(uint32_t), cudaMemcpyDeviceToHost));
  EXPECT_EQ(want, got);
  cudaFree(pool);
  cudaFree(d_ranges);
  cudaFree(d_out);
}

}  // namespace
}  // namespace kvpool::cuda
