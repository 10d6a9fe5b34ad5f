// The range of values kvpool stores and attends over, on every path and every backend: keys and
// values (in the rotated basis, as the BF16 rows that are stored or quantized) and queries must
// be finite with |x| < 2^16. One bound for every model, quantized or BF16 bypass: it keeps the
// 16-bit scale and minimum of the INT2 and INT4 formats finite, and q.k / sqrt(D) far inside
// float range, so an answer is never silently overflowed. Rows outside it are OutOfRange.
//
// Plain constants: included by host code and by the CUDA kernels.
#pragma once

#include <cstdint>

namespace kvpool {

// |x| must be below this.
inline constexpr float kValueMagnitudeLimit = 65536.0f;
// The same bound on BF16 magnitude bits (bits & 0x7fff): a value is in range when below it.
inline constexpr uint16_t kValueMagnitudeLimitBf16Bits = 0x4780;  // 65536 as BF16
static_assert(kValueMagnitudeLimitBf16Bits == 0x4780, "2^16 is 0x4780 in BF16");

}  // namespace kvpool
