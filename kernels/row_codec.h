// Clip, quantize and dequantize rotated K/V rows: the CPU reference of kvpool's codec.
//
// Normative arithmetic (docs/oscar-method.md sections 6-9), for one rotated BF16 row x of
// D values and one group [g*G, (g+1)*G) of it, all in fp32 with no FMA contraction:
//
//   clip:     c = clamp(floor(r * D), 0, D-1) (r <= 0: no clip); tau = c-th smallest |x_j| over
//             the WHOLE row; x_j <- min(max(x_j, -tau), tau)
//   uniform:  mn = min, mx = max over the group; s32 = (mx - mn) / L (L = 3 for INT2, 15 INT4);
//             min/max as a sequential scan in dim order (if (x < mn) mn = x; if (mx < x) mx = x),
//             which decides only the sign of a zero result;
//             stored scale s = to16(s32), stored min m = to16(mn) (round to nearest even);
//             if s == 0 every code is 0, else code = clamp(floor((x - m) / s + 0.5f), 0, L)
//   lloyd-max (INT2, G = D): mu = mean, sigma = sqrt(mean((x-mu)^2) + 1e-8);
//             t = (x - mu) / sigma; code = [t >= -0.98107] + [t >= 0] + [t >= 0.98107];
//             s32 = kLloydMaxStep * sigma, kLloydMaxStep = (2 * 1.50956 / 3) * 1.16
//             evaluated in fp32 as the reference does; s = to16(s32), m = to16(mu - 1.5f * s32)
//             sums (for mu and the variance) in one fixed order, pairwise halving: v[i] += v[i+n/2]
//             for n = D, D/2, ..., 2 (a warp's shuffle-down tree); mean = sum / D
//   dequant:  x_hat = m + code * s   (16-bit m and s widened to fp32)
//
// Rows with NaN or Inf are rejected with InvalidArgument and nothing is written. Values outside
// the range of the 16-bit scale/min type are rejected likewise (OutOfRange).
//
//   RowCodec codec = *RowCodec::Create(cfg, /*head_dim=*/128);
//   KVPOOL_RETURN_IF_ERROR(codec.Encode(KvTensor::kKey, row, codes, meta));
//   codec.Decode(codes, meta, out_row);
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/bf16.h"
#include "kernels/block_layout.h"
#include "kernels/codec_config.h"

namespace kvpool {

// The clip threshold tau of a row (the exact order statistic), or +inf when `ratio` <= 0.
// `scratch` must hold row.size() floats.
float ClipThreshold(absl::Span<const float> row, float ratio, absl::Span<float> scratch);

// One stored (scale, min) pair, as 16-bit words of the model's ScaleDtype.
struct GroupMeta {
  uint16_t scale = 0;
  uint16_t min = 0;
};
static_assert(sizeof(GroupMeta) == 4, "GroupMeta is two 16-bit words");

// Widens a stored 16-bit word of `dtype` to float.
float ScaleWordToFloat(uint16_t word, ScaleDtype dtype);
// Rounds a float to the 16-bit word of `dtype` (nearest even).
uint16_t FloatToScaleWord(float value, ScaleDtype dtype);

// Encoder/decoder for rows of one model. Cheap to copy; thread-compatible (const methods may be
// called concurrently).
class RowCodec {
 public:
  // InvalidArgument if `cfg` is not valid for `head_dim`.
  static absl::StatusOr<RowCodec> Create(const QuantConfig& cfg, int head_dim);

  int head_dim() const { return head_dim_; }
  const QuantConfig& config() const { return cfg_; }
  const BlockLayout& layout() const { return layout_; }  // with kv_heads = 1

  // Encodes one rotated row (D values) of tensor `t`: writes layout().code_bytes_per_row()
  // bytes to `codes` and groups_per_row() entries to `meta`. InvalidArgument on NaN/Inf,
  // OutOfRange when a value overflows the 16-bit scale/min type. Writes nothing on error.
  absl::Status Encode(KvTensor t, absl::Span<const Bf16> row, uint8_t* codes,
                      GroupMeta* meta) const;
  // Same for an fp32 row that is first rounded to BF16 (the normative input).
  absl::Status EncodeFloat(KvTensor t, absl::Span<const float> row, uint8_t* codes,
                           GroupMeta* meta) const;

  // Decodes one row to fp32 (in the rotated basis).
  void Decode(const uint8_t* codes, const GroupMeta* meta, absl::Span<float> out) const;

  // Encodes `rows` rotated rows of shape [rows][kv_heads][D] into tokens
  // [first_token, first_token + rows) of one block of layout `block` (K or V part). All rows are
  // checked first: on error nothing is written.
  absl::Status EncodeIntoBlock(KvTensor t, const BlockLayout& block, absl::Span<const Bf16> rows,
                               int first_token, uint8_t* block_data) const;
  // Decodes tokens [first_token, first_token + count) of one block to fp32 [count][kv_heads][D].
  void DecodeFromBlock(KvTensor t, const BlockLayout& block, const uint8_t* block_data,
                       int first_token, int count, absl::Span<float> out) const;

 private:
  RowCodec(const QuantConfig& cfg, int head_dim);

  QuantConfig cfg_;
  int head_dim_;
  BlockLayout layout_;
};

}  // namespace kvpool
