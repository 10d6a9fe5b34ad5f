// The paged block format: byte layout of one block of one layer (kvpool codec format 1).
//
// A block holds `tokens` consecutive tokens of ONE layer, for all KV heads, K and V. Per KV head
// h, one contiguous, 16-byte aligned segment (so a GPU CTA working on a head streams one range):
//
//   segment(h) = [ K codes  : tokens x code_bytes_per_row ]
//                [ V codes  : tokens x code_bytes_per_row ]
//                [ K meta   : tokens x groups x {u16 scale, u16 min} ]
//                [ V meta   : tokens x groups x {u16 scale, u16 min} ]
//   block      = segment(0) segment(1) ... segment(Hkv-1)
//
// Codes of a row, 2-bit: byte j holds dims 4j..4j+3, dim 4j+i in bits [2i, 2i+1] (little end
// first). 4-bit: byte j holds dims 2j, 2j+1 in bits [0,3], [4,7]. Bypass (16-bit): the row's BF16
// words in dim order, and no meta. The code order inside a group is the identity (the dims of
// the rotated row in order); a kernel that wants another order permutes q and the output in
// registers instead. Dequantization: x = min + code * scale, with scale and min 16-bit floats of
// the model's ScaleDtype, group g covering dims [g*G, (g+1)*G).
//
//   BlockLayout layout = BlockLayout::ForModel(cfg, /*kv_heads=*/8, /*head_dim=*/128);
//   uint8_t* k_codes = block + layout.CodesOffset(KvTensor::kKey, head) +
//                      token * layout.code_bytes_per_row();
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/codec_config.h"

namespace kvpool {

inline constexpr int kBlockFormatVersion = 1;

struct BlockLayout {
  int tokens = 16;      // tokens per block (power of two >= 8)
  int kv_heads = 1;     // Hkv
  int head_dim = 128;   // D
  int group_size = 128; // G (== D for bypass)
  int bits = 2;         // 2, 4, or 16 (BF16 bypass)

  static BlockLayout ForModel(const QuantConfig& cfg, int kv_heads, int head_dim) {
    BlockLayout l;
    l.tokens = cfg.block_tokens;
    l.kv_heads = kv_heads;
    l.head_dim = head_dim;
    l.group_size = cfg.EffectiveGroupSize(head_dim);
    l.bits = cfg.StoredBits();
    return l;
  }

  size_t code_bytes_per_row() const { return static_cast<size_t>(head_dim) * bits / 8; }
  size_t groups_per_row() const { return bits == 16 ? 0 : static_cast<size_t>(head_dim / group_size); }
  size_t meta_bytes_per_row() const { return groups_per_row() * 4; }
  size_t codes_bytes() const { return tokens * code_bytes_per_row(); }    // one tensor, one head
  size_t meta_bytes() const { return tokens * meta_bytes_per_row(); }     // one tensor, one head
  size_t head_segment_bytes() const {
    const size_t raw = 2 * codes_bytes() + 2 * meta_bytes();
    return (raw + 15) / 16 * 16;
  }
  size_t block_bytes() const { return kv_heads * head_segment_bytes(); }

  size_t CodesOffset(KvTensor t, int head) const {
    return head * head_segment_bytes() + (t == KvTensor::kValue ? codes_bytes() : 0);
  }
  size_t MetaOffset(KvTensor t, int head) const {
    return head * head_segment_bytes() + 2 * codes_bytes() +
           (t == KvTensor::kValue ? meta_bytes() : 0);
  }
};

}  // namespace kvpool
