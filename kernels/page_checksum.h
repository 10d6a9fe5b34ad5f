// The checksum of stored pool pages (INT2 history blocks and BF16 sink/recent pages), one
// implementation for the CPU and the CUDA kernels, so both backends compute the same value.
//
// A page's checksum covers its written slots [first, first + count): every 32-bit word of those
// slots' rows (K codes, V codes, K meta, V meta of every KV head; block_layout.h), each mixed
// with its byte offset in the page and summed mod 2^32. The sum is order-free, so a GPU reduces
// it in any order and a writer adds the term of the slots it wrote to the page's running value
// without reading the rest; a changed word always changes its term (the mix is a bijection of
// the word for a fixed offset), and a word moved to another offset changes it with high
// probability. A library hash (xxHash, CRC32C) would not run inside a CUDA kernel and is not
// additive over slots, hence this small function.
//
//   const PageChecksumGeometry geo = PageChecksumGeometry::Of(model.block_layout);
//   uint32_t sum = PageSlotsChecksum(page, geo, /*first_slot=*/0, /*count=*/16);
//
// Thread-safe (pure functions). Rows are whole 32-bit words: head_dim is a power of two >= 32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/block_layout.h"

#if defined(__CUDACC__)
#define KVPOOL_HOST_DEVICE __host__ __device__
#else
#define KVPOOL_HOST_DEVICE
#endif

namespace kvpool {

// Where a slot's rows lie in a page: plain numbers, usable in device code.
struct PageChecksumGeometry {
  uint32_t kv_heads = 0;
  uint32_t segment_bytes = 0;   // one head's segment
  uint32_t code_row_bytes = 0;  // one token, one tensor
  uint32_t meta_row_bytes = 0;  // 0 for BF16 pages
  uint32_t tokens = 0;          // slots per page

  static PageChecksumGeometry Of(const BlockLayout& l) {
    PageChecksumGeometry g;
    g.kv_heads = static_cast<uint32_t>(l.kv_heads);
    g.segment_bytes = static_cast<uint32_t>(l.head_segment_bytes());
    g.code_row_bytes = static_cast<uint32_t>(l.code_bytes_per_row());
    g.meta_row_bytes = static_cast<uint32_t>(l.meta_bytes_per_row());
    g.tokens = static_cast<uint32_t>(l.tokens);
    return g;
  }

  // The 4 * kv_heads contiguous byte spans that hold slots [first, first + count): span i is
  // head i / 4, part i % 4 (K codes, V codes, K meta, V meta).
  KVPOOL_HOST_DEVICE uint32_t num_spans() const { return 4 * kv_heads; }
  KVPOOL_HOST_DEVICE uint32_t SpanOffset(uint32_t span, uint32_t first) const {
    const uint32_t head = span / 4, part = span % 4;
    const uint32_t row = part < 2 ? code_row_bytes : meta_row_bytes;
    const uint32_t part_base =
        part < 2 ? part * tokens * code_row_bytes
                 : 2 * tokens * code_row_bytes + (part - 2) * tokens * meta_row_bytes;
    return head * segment_bytes + part_base + first * row;
  }
  KVPOOL_HOST_DEVICE uint32_t SpanBytes(uint32_t span, uint32_t count) const {
    return (span % 4 < 2 ? code_row_bytes : meta_row_bytes) * count;
  }
};

// The term of the 32-bit `word` at byte `offset` of a page: an xor with the offset's odd
// multiple, a multiplication by an odd constant and an xor-shift, each a bijection of the word,
// so a changed word always changes its term; the multiplication between the two xors makes the
// term nonlinear in (word, offset), so words that trade places change the sum. Five integer
// instructions: the arrival kernels add one term per word they store.
KVPOOL_HOST_DEVICE inline uint32_t PageChecksumTerm(uint32_t word, uint32_t offset) {
  const uint32_t h = (word ^ (offset * 0x9E3779B1u)) * 0x85EBCA6Bu;
  return h ^ (h >> 15);
}

// The checksum of slots [first_slot, first_slot + count) of the page at `page` (host memory).
inline uint32_t PageSlotsChecksum(const uint8_t* page, const PageChecksumGeometry& geo,
                                  int first_slot, int count) {
  uint32_t sum = 0;
  if (count <= 0) return sum;
  for (uint32_t span = 0; span < geo.num_spans(); ++span) {
    const uint32_t begin = geo.SpanOffset(span, static_cast<uint32_t>(first_slot));
    const uint32_t words = geo.SpanBytes(span, static_cast<uint32_t>(count)) / 4;
    const uint8_t* p = page + begin;
    for (uint32_t i = 0; i < words; ++i) {
      uint32_t w;
      std::memcpy(&w, p + 4 * i, 4);
      sum += PageChecksumTerm(w, begin + 4 * i);
    }
  }
  return sum;
}

}  // namespace kvpool
