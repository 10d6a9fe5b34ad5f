// Interoperability with the OSCAR reference implementation's INT2 format.
//
// The reference stores, per (token, head) row, D/4 code bytes in the planar-quarter order
// (byte j holds logical dims j, j+D/4, j+D/2, j+3D/4 in bits 1:0, 3:2, 5:4, 7:6) and fp32
// (scale, zero) per group, dequantized as (code - zero) * scale. Its quantizer (uniform):
//
//   s = max(mx - mn, 1e-8f) / 3;  z = -mn / s;  code = clamp(floor(x / s + z + 0.5f), 0, 3)
//
// and its Lloyd-Max variant (docs/oscar-method.md section 8) stores s = 1.16739 * sigma,
// z = 1.5 - mu/s.
// QuantizeReferenceRow evaluates "/ 3" as a multiply by fp32(1/3), as the reference kernel does
// (bit-exact scales on the golden data), and the Lloyd-Max step as RowCodec's kLloydMaxStep.
//
//   ReferenceRow r = *QuantizeReferenceRow(row, /*group_size=*/128, 0.96f, QuantMethod::kUniform);
//   PackPlanarQuarter(r.codes, planar_bytes);
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/bf16.h"
#include "kernels/codec_config.h"

namespace kvpool {

// One row quantized the reference's way: codes in logical order (one per dim, 0..3) and fp32
// (scale, zero) per group.
struct ReferenceRow {
  std::vector<uint8_t> codes;     // D
  std::vector<float> scale_zero;  // 2 * D/G, interleaved [s0, z0, s1, z1, ...]
};

// Clips (exact order statistic) and quantizes one rotated BF16 row with the reference's fp32
// formulas. `method` is kUniform or kLloydMax. InvalidArgument on NaN/Inf or a bad group size.
absl::StatusOr<ReferenceRow> QuantizeReferenceRow(absl::Span<const Bf16> row, int group_size,
                                                  float clip_ratio, QuantMethod method);

// Planar-quarter packing of one row's logical codes (D codes -> D/4 bytes) and back.
void PackPlanarQuarter(absl::Span<const uint8_t> codes, absl::Span<uint8_t> packed);
void UnpackPlanarQuarter(absl::Span<const uint8_t> packed, absl::Span<uint8_t> codes);

// Converts one row between kvpool's 2-bit packing (sequential, see block_layout.h) and the
// reference's planar-quarter packing. D/4 bytes in, D/4 bytes out.
void KvpoolToPlanarQuarter(absl::Span<const uint8_t> kvpool_codes, absl::Span<uint8_t> planar);
void PlanarQuarterToKvpool(absl::Span<const uint8_t> planar, absl::Span<uint8_t> kvpool_codes);

}  // namespace kvpool
