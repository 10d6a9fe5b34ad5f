#include "kernels/reference_codec.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/row_codec.h"

namespace kvpool {
namespace {

// The reference's compiled kernel multiplies by the fp32 constant 1/3 rather than dividing by
// 3 (bit-exact on every fixture row; a true division is 1 ulp off on a third of them).
constexpr float kOneThird = 1.0f / 3.0f;
constexpr float kRangeFloor = 1e-8f;
// Same constants as RowCodec's Lloyd-Max (row_codec.h).
constexpr float kLloydMaxStep = (2.0f * 1.50956f / 3.0f) * 1.16f;
constexpr float kLloydMaxThreshold = 0.98107f;
constexpr float kLloydMaxEps = 1e-8f;

// Pairwise halving sum, the same order RowCodec uses. Destroys v; n is a power of two.
float HalvingSum(std::vector<float>& v) {
  for (size_t h = v.size() / 2; h >= 1; h /= 2) {
    for (size_t i = 0; i < h; ++i) v[i] = v[i] + v[i + h];
  }
  return v[0];
}

uint8_t ClampCode(float r) { return static_cast<uint8_t>(std::min(std::max(r, 0.0f), 3.0f)); }

}  // namespace

absl::StatusOr<ReferenceRow> QuantizeReferenceRow(absl::Span<const Bf16> row, int group_size,
                                                  float clip_ratio, QuantMethod method) {
  const int d = static_cast<int>(row.size());
  if (d == 0 || d % 4 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("row length must be a positive multiple of 4, got ", d));
  }
  const int g = group_size == 0 ? d : group_size;
  if (g < 0 || d % g != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("group_size ", group_size, " does not divide the row length ", d));
  }
  if (method != QuantMethod::kUniform && method != QuantMethod::kLloydMax) {
    return absl::InvalidArgumentError("the reference quantizer is uniform or lloyd_max");
  }
  if (method == QuantMethod::kLloydMax && g != d) {
    return absl::InvalidArgumentError(
        absl::StrCat("lloyd_max needs one group per row, got group_size ", group_size));
  }
  if (method == QuantMethod::kLloydMax && (d & (d - 1)) != 0) {
    return absl::InvalidArgumentError("lloyd_max needs a power-of-two row length");
  }
  std::vector<float> x(d);
  for (int j = 0; j < d; ++j) {
    x[j] = row[j].ToFloat();
    if (!std::isfinite(x[j])) {
      return absl::InvalidArgumentError(absl::StrCat("row contains NaN or Inf at dim ", j));
    }
  }
  std::vector<float> scratch(d);
  const float tau = ClipThreshold(x, clip_ratio, absl::MakeSpan(scratch));
  if (std::isfinite(tau)) {
    for (float& v : x) v = std::min(std::max(v, -tau), tau);
  }

  ReferenceRow out;
  out.codes.resize(d);
  if (method == QuantMethod::kLloydMax) {
    scratch = x;
    const float mu = HalvingSum(scratch) / static_cast<float>(d);
    for (int j = 0; j < d; ++j) {
      const float dev = x[j] - mu;
      scratch[j] = dev * dev;
    }
    const float var = HalvingSum(scratch) / static_cast<float>(d);
    const float sigma = std::sqrt(var + kLloydMaxEps);
    for (int j = 0; j < d; ++j) {
      const float t = (x[j] - mu) / sigma;
      out.codes[j] = static_cast<uint8_t>((t >= -kLloydMaxThreshold) + (t >= 0.0f) +
                                          (t >= kLloydMaxThreshold));
    }
    const float s = kLloydMaxStep * sigma;
    const float z = 1.5f - mu / s;
    out.scale_zero = {s, z};
    return out;
  }
  out.scale_zero.resize(2 * (d / g));
  for (int k = 0; k < d / g; ++k) {
    const float* xg = x.data() + k * g;
    float mn = xg[0], mx = xg[0];
    for (int j = 1; j < g; ++j) {
      mn = std::min(mn, xg[j]);
      mx = std::max(mx, xg[j]);
    }
    const float s = std::max(mx - mn, kRangeFloor) * kOneThird;
    const float z = -mn / s;
    for (int j = 0; j < g; ++j) {
      out.codes[k * g + j] = ClampCode(std::floor(xg[j] / s + z + 0.5f));
    }
    out.scale_zero[2 * k] = s;
    out.scale_zero[2 * k + 1] = z;
  }
  return out;
}

void PackPlanarQuarter(absl::Span<const uint8_t> codes, absl::Span<uint8_t> packed) {
  const size_t q4 = codes.size() / 4;
  assert(codes.size() % 4 == 0 && packed.size() >= q4);
  for (size_t j = 0; j < q4; ++j) {
    packed[j] = static_cast<uint8_t>((codes[j] & 3) | (codes[j + q4] & 3) << 2 |
                                     (codes[j + 2 * q4] & 3) << 4 | (codes[j + 3 * q4] & 3) << 6);
  }
}

void UnpackPlanarQuarter(absl::Span<const uint8_t> packed, absl::Span<uint8_t> codes) {
  const size_t q4 = packed.size();
  assert(codes.size() >= 4 * q4);
  for (size_t j = 0; j < q4; ++j) {
    for (size_t c = 0; c < 4; ++c) codes[j + c * q4] = (packed[j] >> (2 * c)) & 3;
  }
}

void KvpoolToPlanarQuarter(absl::Span<const uint8_t> kvpool_codes, absl::Span<uint8_t> planar) {
  const size_t q4 = kvpool_codes.size();
  assert(planar.size() >= q4);
  // Logical dim i sits at kvpool byte i/4, bits 2*(i%4); at planar byte i%Q4, bits 2*(i/Q4).
  for (size_t j = 0; j < q4; ++j) {
    uint8_t b = 0;
    for (size_t c = 0; c < 4; ++c) {
      const size_t dim = j + c * q4;
      b |= static_cast<uint8_t>(((kvpool_codes[dim / 4] >> (2 * (dim % 4))) & 3) << (2 * c));
    }
    planar[j] = b;
  }
}

void PlanarQuarterToKvpool(absl::Span<const uint8_t> planar, absl::Span<uint8_t> kvpool_codes) {
  const size_t q4 = planar.size();
  assert(kvpool_codes.size() >= q4);
  for (size_t j = 0; j < q4; ++j) {
    uint8_t b = 0;
    for (size_t i = 0; i < 4; ++i) {
      const size_t dim = 4 * j + i;
      b |= static_cast<uint8_t>(((planar[dim % q4] >> (2 * (dim / q4))) & 3) << (2 * i));
    }
    kvpool_codes[j] = b;
  }
}

}  // namespace kvpool
