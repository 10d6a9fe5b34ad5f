#include "kernels/page_checksum.h"

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvpool {
namespace {

std::vector<uint8_t> RandomPage(const BlockLayout& l, uint32_t seed) {
  std::vector<uint8_t> page(l.block_bytes());
  std::mt19937 rng(seed);
  for (uint8_t& b : page) b = static_cast<uint8_t>(rng());
  return page;
}

BlockLayout Int2Layout() {
  BlockLayout l;
  l.tokens = 16;
  l.kv_heads = 2;
  l.head_dim = 64;
  l.group_size = 32;
  l.bits = 2;
  return l;
}

BlockLayout Bf16Layout() {
  BlockLayout l = Int2Layout();
  l.group_size = l.head_dim;
  l.bits = 16;
  return l;
}

TEST(PageChecksumTest, SlotRangesAddUp) {
  for (const BlockLayout& l : {Int2Layout(), Bf16Layout()}) {
    const std::vector<uint8_t> page = RandomPage(l, 1);
    const PageChecksumGeometry geo = PageChecksumGeometry::Of(l);
    const uint32_t whole = PageSlotsChecksum(page.data(), geo, 0, l.tokens);
    EXPECT_EQ(whole, PageSlotsChecksum(page.data(), geo, 0, 5) +
                         PageSlotsChecksum(page.data(), geo, 5, 1) +
                         PageSlotsChecksum(page.data(), geo, 6, l.tokens - 6));
    EXPECT_EQ(0u, PageSlotsChecksum(page.data(), geo, 3, 0));
  }
}

// Every bit of the covered slots' rows changes the checksum; bits of other slots and of the
// segment padding do not.
TEST(PageChecksumTest, EveryCoveredBitCountsAndNothingElse) {
  for (const BlockLayout& l : {Int2Layout(), Bf16Layout()}) {
    std::vector<uint8_t> page = RandomPage(l, 2);
    const PageChecksumGeometry geo = PageChecksumGeometry::Of(l);
    const int first = 3, count = 7;
    const uint32_t sum = PageSlotsChecksum(page.data(), geo, first, count);
    std::vector<bool> covered(page.size(), false);
    for (int h = 0; h < l.kv_heads; ++h) {
      for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
        for (int s = first; s < first + count; ++s) {
          for (size_t b = 0; b < l.code_bytes_per_row(); ++b) {
            covered[l.CodesOffset(t, h) + s * l.code_bytes_per_row() + b] = true;
          }
          for (size_t b = 0; b < l.meta_bytes_per_row(); ++b) {
            covered[l.MetaOffset(t, h) + s * l.meta_bytes_per_row() + b] = true;
          }
        }
      }
    }
    for (size_t byte = 0; byte < page.size(); ++byte) {
      for (int bit = 0; bit < 8; ++bit) {
        page[byte] ^= static_cast<uint8_t>(1u << bit);
        const bool changed = PageSlotsChecksum(page.data(), geo, first, count) != sum;
        page[byte] ^= static_cast<uint8_t>(1u << bit);
        ASSERT_EQ(covered[byte], changed) << "byte " << byte << " bit " << bit;
      }
    }
  }
}

// Two words swapped between positions change the checksum (the mix depends on the offset).
TEST(PageChecksumTest, DependsOnPosition) {
  const BlockLayout l = Int2Layout();
  std::vector<uint8_t> page = RandomPage(l, 3);
  const PageChecksumGeometry geo = PageChecksumGeometry::Of(l);
  const uint32_t sum = PageSlotsChecksum(page.data(), geo, 0, l.tokens);
  for (int i = 0; i < 4; ++i) std::swap(page[i], page[l.code_bytes_per_row() + i]);
  EXPECT_NE(sum, PageSlotsChecksum(page.data(), geo, 0, l.tokens));
}

// Any two different words that trade places change the checksum, wherever they are: 20,000
// random pairs of word offsets over a BF16 and an INT2 page.
TEST(PageChecksumTest, EverySwapOfTwoWordsCounts) {
  for (const BlockLayout& l : {Int2Layout(), Bf16Layout()}) {
    std::vector<uint8_t> page = RandomPage(l, 4);
    const PageChecksumGeometry geo = PageChecksumGeometry::Of(l);
    const uint32_t sum = PageSlotsChecksum(page.data(), geo, 0, l.tokens);
    std::mt19937 rng(5);
    const size_t words = page.size() / 4;
    for (int trial = 0; trial < 10000; ++trial) {
      const size_t a = rng() % words, b = rng() % words;
      if (std::equal(page.begin() + 4 * a, page.begin() + 4 * a + 4, page.begin() + 4 * b)) {
        continue;
      }
      std::swap_ranges(page.begin() + 4 * a, page.begin() + 4 * a + 4, page.begin() + 4 * b);
      const uint32_t swapped = PageSlotsChecksum(page.data(), geo, 0, l.tokens);
      std::swap_ranges(page.begin() + 4 * a, page.begin() + 4 * a + 4, page.begin() + 4 * b);
      ASSERT_NE(swapped, sum) << "words " << a << " and " << b;
    }
  }
}

}  // namespace
}  // namespace kvpool
