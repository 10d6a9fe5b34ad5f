#include "kernels/row_codec.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/support/test_data.h"

namespace kvpool {
namespace {

using ::kvpool::testing::GaussianValues;
using ::kvpool::testing::RealLikeRows;
using ::kvpool::testing::ToBf16;

constexpr float kInf = std::numeric_limits<float>::infinity();

QuantConfig Config(int bits, int group_size, QuantMethod method = QuantMethod::kUniform,
                   ScaleDtype dtype = ScaleDtype::kFp16) {
  QuantConfig cfg;
  cfg.bits = bits;
  cfg.group_size = group_size;
  cfg.method = method;
  cfg.scale_dtype = dtype;
  return cfg;
}

RowCodec MakeCodec(const QuantConfig& cfg, int d) {
  absl::StatusOr<RowCodec> codec = RowCodec::Create(cfg, d);
  EXPECT_TRUE(codec.ok()) << codec.status();
  return *codec;
}

// Logical codes (one per dim) from kvpool's sequential packing.
std::vector<int> UnpackCodes(const uint8_t* codes, int d, int bits) {
  std::vector<int> out(d);
  for (int j = 0; j < d; ++j) {
    const int per_byte = 8 / bits;
    out[j] = (codes[j / per_byte] >> (bits * (j % per_byte))) & ((1 << bits) - 1);
  }
  return out;
}

// One row encoded by the codec under test.
struct Encoded {
  std::vector<uint8_t> codes;
  std::vector<GroupMeta> meta;
};

Encoded EncodeOrDie(const RowCodec& codec, KvTensor t, const std::vector<Bf16>& row) {
  Encoded e;
  e.codes.assign(codec.layout().code_bytes_per_row(), 0);
  e.meta.resize(std::max<size_t>(1, codec.layout().groups_per_row()));
  const absl::Status s = codec.Encode(t, row, e.codes.data(), e.meta.data());
  EXPECT_TRUE(s.ok()) << s;
  return e;
}

// Rows of several shapes: real-like (outlier channels, offsets), Gaussians of several scales,
// rows with many ties and exact zeros.
std::vector<std::vector<Bf16>> TestRows(int d, int count, uint64_t seed) {
  std::vector<std::vector<Bf16>> rows;
  const std::vector<float> real = RealLikeRows(count, d, seed);
  std::mt19937_64 rng(seed);
  for (int r = 0; r < count; ++r) {
    std::vector<float> row(real.begin() + static_cast<size_t>(r) * d,
                           real.begin() + static_cast<size_t>(r + 1) * d);
    switch (r % 5) {
      case 1: {
        const float scale = std::pow(10.0f, static_cast<float>(r % 7) - 3.0f);
        row = GaussianValues(d, seed * 131 + r, scale);
        break;
      }
      case 2:  // ties: values from a small set
        for (float& v : row) v = static_cast<float>(static_cast<int>(rng() % 7) - 3) * 0.25f;
        break;
      case 3:  // sparse: mostly exact zeros
        for (int j = 0; j < d; ++j) {
          if (rng() % 4 != 0) row[j] = 0.0f;
        }
        break;
      default:
        break;
    }
    rows.push_back(ToBf16(row));
  }
  return rows;
}

// --- The literal fp32 formulas of row_codec.h, written as plainly as possible. RowCodec must
// match them bit for bit (the CUDA kernels are held to the same formulas).
struct LiteralResult {
  std::vector<int> codes;
  std::vector<GroupMeta> meta;
};

float LiteralHalvingSum(std::vector<float> v) {
  for (size_t n = v.size(); n > 1; n /= 2) {
    for (size_t i = 0; i < n / 2; ++i) v[i] = v[i] + v[i + n / 2];
  }
  return v[0];
}

LiteralResult LiteralEncode(const QuantConfig& cfg, int d, KvTensor t,
                            const std::vector<Bf16>& row) {
  std::vector<float> x(d);
  for (int j = 0; j < d; ++j) x[j] = row[j].ToFloat();
  const float r = cfg.ClipRatio(t);
  if (r > 0.0f) {
    int c = static_cast<int>(std::floor(std::min(r * static_cast<float>(d), 1e6f)));
    c = std::min(std::max(c, 0), d - 1);
    std::vector<float> mags(d);
    for (int j = 0; j < d; ++j) mags[j] = std::fabs(x[j]);
    std::sort(mags.begin(), mags.end());
    const float tau = mags[c];
    for (float& v : x) v = std::min(std::max(v, -tau), tau);
  }
  const int g = cfg.EffectiveGroupSize(d);
  const int levels = (1 << cfg.bits) - 1;
  LiteralResult out;
  out.codes.resize(d);
  if (cfg.method == QuantMethod::kLloydMax) {
    const float mu = LiteralHalvingSum(x) / static_cast<float>(d);
    std::vector<float> sq(d);
    for (int j = 0; j < d; ++j) sq[j] = (x[j] - mu) * (x[j] - mu);
    const float sigma = std::sqrt(LiteralHalvingSum(sq) / static_cast<float>(d) + 1e-8f);
    const float step = (2.0f * 1.50956f / 3.0f) * 1.16f;
    for (int j = 0; j < d; ++j) {
      const float tn = (x[j] - mu) / sigma;
      out.codes[j] = (tn >= -0.98107f) + (tn >= 0.0f) + (tn >= 0.98107f);
    }
    const float s32 = step * sigma;
    out.meta.push_back(GroupMeta{FloatToScaleWord(s32, cfg.scale_dtype),
                                 FloatToScaleWord(mu - 1.5f * s32, cfg.scale_dtype)});
    return out;
  }
  for (int k = 0; k < d / g; ++k) {
    float mn = x[k * g], mx = x[k * g];
    for (int j = k * g; j < (k + 1) * g; ++j) {
      mn = std::min(mn, x[j]);
      mx = std::max(mx, x[j]);
    }
    const float s32 = (mx - mn) / static_cast<float>(levels);
    const GroupMeta meta{FloatToScaleWord(s32, cfg.scale_dtype),
                         FloatToScaleWord(mn, cfg.scale_dtype)};
    const float s = ScaleWordToFloat(meta.scale, cfg.scale_dtype);
    const float m = ScaleWordToFloat(meta.min, cfg.scale_dtype);
    for (int j = k * g; j < (k + 1) * g; ++j) {
      if (s == 0.0f) {
        out.codes[j] = 0;
      } else {
        const float q = std::floor((x[j] - m) / s + 0.5f);
        out.codes[j] = static_cast<int>(std::min(std::max(q, 0.0f), static_cast<float>(levels)));
      }
    }
    out.meta.push_back(meta);
  }
  return out;
}

// --- float64 reference: clip and the unrounded quantizer parameters.
struct DoubleRef {
  std::vector<double> clipped;
  std::vector<double> mn, s32;  // per group (uniform) or mu - 1.5 s, s (Lloyd-Max)
  double mu = 0, sigma = 0;
};

DoubleRef DoubleEncode(const QuantConfig& cfg, int d, KvTensor t, const std::vector<Bf16>& row) {
  DoubleRef ref;
  ref.clipped.resize(d);
  for (int j = 0; j < d; ++j) ref.clipped[j] = row[j].ToFloat();
  const double r = cfg.ClipRatio(t);
  if (r > 0) {
    const int c = std::min(std::max(static_cast<int>(std::floor(r * d)), 0), d - 1);
    std::vector<double> mags(d);
    for (int j = 0; j < d; ++j) mags[j] = std::fabs(ref.clipped[j]);
    std::sort(mags.begin(), mags.end());
    for (double& v : ref.clipped) v = std::min(std::max(v, -mags[c]), mags[c]);
  }
  const int g = cfg.EffectiveGroupSize(d);
  if (cfg.method == QuantMethod::kLloydMax) {
    long double sum = 0, sq = 0;
    for (double v : ref.clipped) sum += v;
    ref.mu = static_cast<double>(sum / d);
    for (double v : ref.clipped) sq += (v - ref.mu) * (v - ref.mu);
    ref.sigma = std::sqrt(static_cast<double>(sq / d) + 1e-8);
    const double step = (2.0 * 1.50956 / 3.0) * 1.16;
    ref.s32.push_back(step * ref.sigma);
    ref.mn.push_back(ref.mu - 1.5 * step * ref.sigma);
    return ref;
  }
  for (int k = 0; k < d / g; ++k) {
    const auto first = ref.clipped.begin() + k * g;
    const double mn = *std::min_element(first, first + g);
    const double mx = *std::max_element(first, first + g);
    ref.mn.push_back(mn);
    ref.s32.push_back((mx - mn) / ((1 << cfg.bits) - 1));
  }
  return ref;
}

// Spacing of the 16-bit type around |v| (one ulp).
double Ulp16(double v, ScaleDtype dtype) {
  const uint16_t w = FloatToScaleWord(static_cast<float>(std::fabs(v)), dtype);
  const double lo = ScaleWordToFloat(w, dtype);
  const double hi = ScaleWordToFloat(static_cast<uint16_t>(w + 1), dtype);
  return hi - lo;
}

struct Case {
  int d;
  int g;
  int bits;
  QuantMethod method;
  ScaleDtype dtype;
  float clip_k = 0.96f;
  float clip_v = 0.92f;
};

std::string CaseName(const Case& c) {
  return "D=" + std::to_string(c.d) + " G=" + std::to_string(c.g) +
         " bits=" + std::to_string(c.bits) + " " + std::string(QuantMethodName(c.method)) + " " +
         std::string(ScaleDtypeName(c.dtype)) + " clip " + std::to_string(c.clip_k) + "/" +
         std::to_string(c.clip_v);
}

std::vector<Case> PropertyCases() {
  std::vector<Case> cases;
  for (int d : {64, 128, 256}) {
    for (ScaleDtype dtype : {ScaleDtype::kFp16, ScaleDtype::kBf16}) {
      for (int g : {32, 64, d}) {
        if (g == 64 && d == 64) continue;
        for (int bits : {2, 4}) cases.push_back({d, g, bits, QuantMethod::kUniform, dtype});
      }
      cases.push_back({d, d, 2, QuantMethod::kLloydMax, dtype});
    }
    // Clip ratios that keep many values (the selection's nth_element path) or none.
    cases.push_back({d, d, 2, QuantMethod::kUniform, ScaleDtype::kFp16, 0.5f, 0.8f});
    cases.push_back({d, 32, 4, QuantMethod::kUniform, ScaleDtype::kFp16, 1.0f, 0.0f});
    cases.push_back({d, d, 2, QuantMethod::kLloydMax, ScaleDtype::kFp16, 0.7f, 0.999f});
  }
  return cases;
}

// ---------------------------------------------------------------------------------------------

TEST(ClipThresholdTest, EqualsTheSortedOrderStatistic) {
  std::vector<float> scratch(256);
  for (int d : {32, 64, 128, 256}) {
    for (const std::vector<Bf16>& row : TestRows(d, 40, 11 + d)) {
      std::vector<float> x = testing::ToFloat(row);
      std::vector<double> mags(d);
      for (int j = 0; j < d; ++j) mags[j] = std::fabs(static_cast<double>(x[j]));
      std::sort(mags.begin(), mags.end());
      for (float r : {0.01f, 0.5f, 0.9f, 0.92f, 0.96f, 0.99f, 0.999f}) {
        const int c = static_cast<int>(std::floor(static_cast<double>(r) * d));
        EXPECT_EQ(ClipThreshold(x, r, absl::MakeSpan(scratch)), mags[c]) << d << " " << r;
      }
      // ratio >= 1 clamps to the largest magnitude: nothing is clipped.
      for (float r : {1.0f, 1.5f, 1e30f}) {
        EXPECT_EQ(ClipThreshold(x, r, absl::MakeSpan(scratch)), mags[d - 1]);
      }
      for (float r : {0.0f, -0.0f, -0.5f, -kInf, std::nanf("")}) {
        EXPECT_EQ(ClipThreshold(x, r, absl::MakeSpan(scratch)), kInf) << r;
      }
    }
  }
}

TEST(ClipThresholdTest, DefaultRatiosPickTheDocumentedRanks) {
  // docs/oscar-method.md section 6: D = 128 gives c = 122 (K, 0.96) and c = 117 (V, 0.92).
  std::vector<float> x(128), scratch(128);
  for (int j = 0; j < 128; ++j) x[j] = (j % 2 ? -1.0f : 1.0f) * static_cast<float>(j);
  EXPECT_EQ(ClipThreshold(x, 0.96f, absl::MakeSpan(scratch)), 122.0f);
  EXPECT_EQ(ClipThreshold(x, 0.92f, absl::MakeSpan(scratch)), 117.0f);
}

TEST(ScaleWordTest, RoundsToNearestEvenAgainstFloat64) {
  std::mt19937_64 rng(5);
  for (ScaleDtype dtype : {ScaleDtype::kFp16, ScaleDtype::kBf16}) {
    // Every finite word round-trips.
    for (uint32_t w = 0; w < 0x10000; ++w) {
      const float f = ScaleWordToFloat(static_cast<uint16_t>(w), dtype);
      if (!std::isfinite(f)) continue;
      EXPECT_EQ(FloatToScaleWord(f, dtype), w) << std::hex << w;
    }
    // Random floats across the range: the result is a nearest word, ties to even.
    for (int i = 0; i < 200000; ++i) {
      const uint32_t bits = static_cast<uint32_t>(rng());
      float v;
      std::memcpy(&v, &bits, sizeof(v));
      if (!std::isfinite(v)) continue;
      if (i % 2 == 0) v = std::ldexp(std::fmod(v, 2.0f), static_cast<int>(rng() % 60) - 30);
      const uint16_t w = FloatToScaleWord(v, dtype);
      const double got = ScaleWordToFloat(w, dtype);
      const double err = std::fabs(got - static_cast<double>(v));
      if (std::isinf(got)) {  // overflow: v is at least half an ulp past the largest finite
        const double max_finite = dtype == ScaleDtype::kFp16 ? 65504.0 : 3.3895313892515355e38;
        const double half_ulp = dtype == ScaleDtype::kFp16 ? 16.0 : std::ldexp(1.0, 119);
        EXPECT_GE(std::fabs(static_cast<double>(v)), max_finite + half_ulp) << v;
        continue;
      }
      for (int delta : {-1, 1}) {
        const uint16_t n = static_cast<uint16_t>(w + delta);
        const double other = ScaleWordToFloat(n, dtype);
        if (!std::isfinite(other) || (n & 0x7fff) == 0x7fff || ((n ^ w) & 0x8000)) continue;
        const double other_err = std::fabs(other - static_cast<double>(v));
        EXPECT_LE(err, other_err) << v;
        if (err == other_err) {
          EXPECT_EQ(w & 1, 0) << "tie not to even: " << v;
        }
      }
    }
  }
  EXPECT_EQ(FloatToScaleWord(1.0f, ScaleDtype::kFp16), 0x3c00);
  EXPECT_EQ(FloatToScaleWord(1.0f, ScaleDtype::kBf16), 0x3f80);
  EXPECT_EQ(FloatToScaleWord(65520.0f, ScaleDtype::kFp16), 0x7c00);  // rounds to +inf
  EXPECT_EQ(FloatToScaleWord(65519.0f, ScaleDtype::kFp16), 0x7bff);
  EXPECT_EQ(ScaleWordToFloat(0x0001, ScaleDtype::kFp16), std::ldexp(1.0f, -24));
}

TEST(RowCodecTest, CreateValidatesTheConfig) {
  QuantConfig cfg;
  cfg.bits = 3;
  EXPECT_EQ(RowCodec::Create(cfg, 128).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RowCodec::Create(QuantConfig(), 100).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<RowCodec> codec = RowCodec::Create(QuantConfig(), 128);
  ASSERT_TRUE(codec.ok());
  EXPECT_EQ(codec->head_dim(), 128);
  EXPECT_EQ(codec->layout().kv_heads, 1);
  EXPECT_EQ(codec->layout().code_bytes_per_row(), 32u);
  EXPECT_EQ(codec->layout().groups_per_row(), 1u);
}

// The core property test: for every shape, RowCodec equals the literal fp32 formulas bit for
// bit, agrees with a float64 reference up to rounding-boundary ties, and honours the
// quantizer's error bound.
TEST(RowCodecTest, MatchesLiteralFormulasAndFloat64Reference) {
  for (const Case& c : PropertyCases()) {
    SCOPED_TRACE(CaseName(c));
    QuantConfig cfg = Config(c.bits, c.g, c.method, c.dtype);
    cfg.clip_ratio_k = c.clip_k;
    cfg.clip_ratio_v = c.clip_v;
    const RowCodec codec = MakeCodec(cfg, c.d);
    const int levels = (1 << c.bits) - 1;
    int boundary_ties = 0;
    for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
      for (const std::vector<Bf16>& row : TestRows(c.d, 60, 1000 + c.d + c.g + c.bits)) {
        const Encoded e = EncodeOrDie(codec, t, row);
        const std::vector<int> codes = UnpackCodes(e.codes.data(), c.d, c.bits);

        const LiteralResult lit = LiteralEncode(cfg, c.d, t, row);
        ASSERT_EQ(codes, lit.codes);
        for (size_t k = 0; k < lit.meta.size(); ++k) {
          ASSERT_EQ(e.meta[k].scale, lit.meta[k].scale) << k;
          ASSERT_EQ(e.meta[k].min, lit.meta[k].min) << k;
        }

        std::vector<float> out(c.d);
        codec.Decode(e.codes.data(), e.meta.data(), absl::MakeSpan(out));
        const DoubleRef ref = DoubleEncode(cfg, c.d, t, row);
        for (int k = 0; k < c.d / c.g; ++k) {
          const double s16 = ScaleWordToFloat(e.meta[k].scale, c.dtype);
          const double m16 = ScaleWordToFloat(e.meta[k].min, c.dtype);
          // Stored words are the 16-bit roundings of the exact values (one ulp covers fp32).
          const double tiny = 1e-6 * (std::fabs(ref.mn[k]) + ref.s32[k]);
          ASSERT_LE(std::fabs(s16 - ref.s32[k]), Ulp16(ref.s32[k], c.dtype) + tiny);
          ASSERT_LE(std::fabs(m16 - ref.mn[k]), Ulp16(ref.mn[k], c.dtype) + tiny);
          for (int j = k * c.g; j < (k + 1) * c.g; ++j) {
            const double x = ref.clipped[j];
            const int q = codes[j];
            // Decode is m + code * s rounded once to fp32.
            ASSERT_EQ(out[j], static_cast<float>(m16 + q * s16)) << j;
            if (c.method == QuantMethod::kLloydMax) {
              const double tn = (x - ref.mu) / ref.sigma;
              const int want = (tn >= -0.98107) + (tn >= 0) + (tn >= 0.98107);
              if (q != want) {
                ++boundary_ties;
                ASSERT_EQ(std::abs(q - want), 1);
                ASSERT_LT(
                    std::min({std::fabs(tn - 0.98107), std::fabs(tn + 0.98107), std::fabs(tn)}),
                    1e-5)
                    << "Lloyd-Max code off away from a bucket edge";
              }
              // Levels are mu + (q - 1.5) * step * sigma up to the 16-bit rounding.
              const double level = ref.mn[k] + q * ref.s32[k];
              ASSERT_LE(std::fabs(out[j] - level), std::fabs(m16 - ref.mn[k]) +
                                                       q * std::fabs(s16 - ref.s32[k]) +
                                                       1e-6 * (std::fabs(level) + ref.s32[k]));
              continue;
            }
            // Uniform: the code is round-half-up of (x - m16) / s16, clamped.
            if (s16 == 0) {
              ASSERT_EQ(q, 0);
            } else {
              const double u = (x - m16) / s16 + 0.5;
              const int want =
                  static_cast<int>(std::min(std::max(std::floor(u), 0.0), double(levels)));
              if (q != want) {
                ++boundary_ties;
                ASSERT_EQ(std::abs(q - want), 1);
                ASSERT_LT(std::fabs(u - std::round(u)), 1e-5 * (1 + std::fabs(u)))
                    << "code off away from a rounding boundary";
              }
            }
            // The quantizer bound: half a step plus what 16-bit storage moved.
            const double bound = s16 / 2 + std::fabs(ref.mn[k] - m16) +
                                 levels * std::fabs(ref.s32[k] - s16) +
                                 1e-6 * (std::fabs(x) + std::fabs(m16) + levels * s16) + 1e-37;
            ASSERT_LE(std::fabs(out[j] - x), bound) << "j=" << j << " x=" << x;
          }
        }
      }
    }
    // fp32 vs float64 ties are rare; many would mean a formula drifted.
    EXPECT_LE(boundary_ties, 5);
  }
}

// Encode selects tau on BF16 magnitude bits; every ratio must give the sorted order statistic.
TEST(RowCodecTest, ClipMatchesTheOrderStatisticForEveryRatio) {
  for (int d : {32, 64, 256}) {
    for (float r : {0.01f, 0.05f, 0.3f, 0.5f, 0.75f, 0.9f, 0.97f, 0.99f, 0.999f, 1.0f}) {
      QuantConfig cfg = Config(4, 0);
      cfg.clip_ratio_k = r;
      const RowCodec codec = MakeCodec(cfg, d);
      for (const std::vector<Bf16>& row : TestRows(d, 25, 40 + d)) {
        const Encoded e = EncodeOrDie(codec, KvTensor::kKey, row);
        const LiteralResult lit = LiteralEncode(cfg, d, KvTensor::kKey, row);
        ASSERT_EQ(UnpackCodes(e.codes.data(), d, 4), lit.codes) << d << " " << r;
        ASSERT_EQ(e.meta[0].scale, lit.meta[0].scale);
        ASSERT_EQ(e.meta[0].min, lit.meta[0].min);
      }
    }
  }
}

TEST(RowCodecTest, EncodeFloatRoundsToBf16First) {
  const RowCodec codec = MakeCodec(QuantConfig(), 128);
  const std::vector<float> row = RealLikeRows(1, 128, 21);
  const Encoded want = EncodeOrDie(codec, KvTensor::kKey, ToBf16(row));
  Encoded got = want;
  std::fill(got.codes.begin(), got.codes.end(), 0);
  got.meta[0] = GroupMeta{};
  ASSERT_TRUE(codec.EncodeFloat(KvTensor::kKey, row, got.codes.data(), got.meta.data()).ok());
  EXPECT_EQ(got.codes, want.codes);
  EXPECT_EQ(got.meta[0].scale, want.meta[0].scale);
  EXPECT_EQ(got.meta[0].min, want.meta[0].min);
}

TEST(RowCodecTest, BypassReturnsTheInputBitsExactly) {
  QuantConfig cfg;
  cfg.method = QuantMethod::kBypass;
  const RowCodec codec = MakeCodec(cfg, 128);
  EXPECT_EQ(codec.layout().code_bytes_per_row(), 256u);
  EXPECT_EQ(codec.layout().groups_per_row(), 0u);
  std::vector<Bf16> row = ToBf16(RealLikeRows(1, 128, 4));
  row[0] = Bf16::FromBits(0x8000);  // -0
  row[1] = Bf16::FromBits(0x0001);  // smallest subnormal
  row[2] = Bf16::FromBits(0x477f);  // largest value in range (65280)
  row[3] = Bf16::FromBits(0xc77f);
  std::vector<uint8_t> codes(256);
  ASSERT_TRUE(codec.Encode(KvTensor::kValue, row, codes.data(), nullptr).ok());
  EXPECT_EQ(std::memcmp(codes.data(), row.data(), 256), 0);
  std::vector<float> out(128);
  codec.Decode(codes.data(), nullptr, absl::MakeSpan(out));
  for (int j = 0; j < 128; ++j) {
    uint32_t got, want;
    const float w = row[j].ToFloat();
    std::memcpy(&got, &out[j], 4);
    std::memcpy(&want, &w, 4);
    EXPECT_EQ(got, want) << j;
  }
}

TEST(RowCodecTest, ConstantRowHasZeroScaleAndExactMin) {
  for (ScaleDtype dtype : {ScaleDtype::kFp16, ScaleDtype::kBf16}) {
    for (int g : {32, 128}) {
      const RowCodec codec = MakeCodec(Config(2, g, QuantMethod::kUniform, dtype), 128);
      for (float value : {0.0f, 1.0f, -3.25f, 1000.5f, 1e-3f}) {
        const std::vector<Bf16> row(128, Bf16::FromFloat(value));
        const Encoded e = EncodeOrDie(codec, KvTensor::kKey, row);
        std::vector<float> out(128);
        codec.Decode(e.codes.data(), e.meta.data(), absl::MakeSpan(out));
        const float stored_min = ScaleWordToFloat(FloatToScaleWord(row[0].ToFloat(), dtype), dtype);
        for (int k = 0; k < 128 / g; ++k) {
          EXPECT_EQ(ScaleWordToFloat(e.meta[k].scale, dtype), 0.0f);
          EXPECT_EQ(ScaleWordToFloat(e.meta[k].min, dtype), stored_min);
        }
        for (uint8_t b : e.codes) EXPECT_EQ(b, 0);
        for (float v : out) EXPECT_EQ(v, stored_min);
        // Exact wherever the value fits the 16-bit type (all of these do for bf16).
        if (dtype == ScaleDtype::kBf16 || value == 0.0f || value == 1.0f || value == -3.25f ||
            value == 1000.5f) {
          for (float v : out) EXPECT_EQ(v, row[0].ToFloat());
        }
      }
    }
  }
}

// Min and max follow a sequential scan in dim order (`if (x < mn) mn = x`), which matters only
// for the sign of a zero minimum: the first zero wins. The CUDA kernels reproduce this.
TEST(RowCodecTest, ZeroMinTakesTheSignOfTheFirstZero) {
  for (int g : {8, 32, 128}) {
    QuantConfig cfg = Config(2, g);
    cfg.clip_ratio_k = 0.0f;
    const RowCodec codec = MakeCodec(cfg, 128);
    for (bool negative_first : {false, true}) {
      std::vector<Bf16> row = ToBf16(GaussianValues(128, 3, 1.0f));
      for (Bf16& b : row) b.bits &= 0x7fff;  // all >= 0
      for (int k = 0; k < 128 / g; ++k) {
        // Zeros of both signs late in the group; the first one decides.
        row[k * g + g - 5] = Bf16::FromBits(negative_first ? 0x8000 : 0x0000);
        row[k * g + g - 2] = Bf16::FromBits(negative_first ? 0x0000 : 0x8000);
        row[k * g + g - 1] = Bf16::FromBits(0x8000);
      }
      const Encoded e = EncodeOrDie(codec, KvTensor::kKey, row);
      for (int k = 0; k < 128 / g; ++k) {
        EXPECT_EQ(e.meta[k].min, negative_first ? 0x8000 : 0x0000) << g << " " << k;
      }
    }
  }
}

TEST(RowCodecTest, LloydMaxConstantRowIsFinite) {
  const RowCodec codec = MakeCodec(Config(2, 0, QuantMethod::kLloydMax), 64);
  const std::vector<Bf16> row(64, Bf16::FromFloat(2.5f));
  const Encoded e = EncodeOrDie(codec, KvTensor::kKey, row);
  std::vector<float> out(64);
  codec.Decode(e.codes.data(), e.meta.data(), absl::MakeSpan(out));
  for (float v : out) EXPECT_NEAR(v, 2.5f, 2e-3f);  // sigma is sqrt(1e-8)
}

TEST(RowCodecTest, SubnormalRowsQuantizeWithoutError) {
  for (ScaleDtype dtype : {ScaleDtype::kFp16, ScaleDtype::kBf16}) {
    const RowCodec codec = MakeCodec(Config(2, 0, QuantMethod::kUniform, dtype), 64);
    std::vector<Bf16> row(64);
    for (int j = 0; j < 64; ++j) row[j] = Bf16::FromBits(static_cast<uint16_t>(j * 3 + 1));
    const Encoded e = EncodeOrDie(codec, KvTensor::kValue, row);
    std::vector<float> out(64);
    codec.Decode(e.codes.data(), e.meta.data(), absl::MakeSpan(out));
    for (int j = 0; j < 64; ++j) EXPECT_LE(std::fabs(out[j] - row[j].ToFloat()), 1e-37f);
  }
}

TEST(RowCodecTest, ValuesOfMagnitudeTwoToTheSixteenAreOutOfRangeForEveryFormat) {
  // kernels/value_range.h: one bound for every model, quantized or bypass, before any clipping.
  std::vector<float> values = GaussianValues(128, 8, 1.0f);
  values[7] = -65536.0f;
  const std::vector<Bf16> row = ToBf16(values);
  for (QuantMethod method : {QuantMethod::kUniform, QuantMethod::kLloydMax, QuantMethod::kBypass}) {
    for (ScaleDtype dtype : {ScaleDtype::kFp16, ScaleDtype::kBf16}) {
      const RowCodec codec = MakeCodec(Config(2, 0, method, dtype), 128);
      std::vector<uint8_t> codes(256, 0xab);
      GroupMeta meta{0x1234, 0x5678};
      const absl::Status s = codec.Encode(KvTensor::kKey, row, codes.data(), &meta);
      EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
      EXPECT_EQ(codes, std::vector<uint8_t>(256, 0xab)) << "nothing written";
      EXPECT_EQ(meta.scale, 0x1234);
      EXPECT_EQ(meta.min, 0x5678);
    }
  }
}

TEST(RowCodecTest, LargestValuesInRangeEncodeWithEitherScaleType) {
  // The extremes of the range fit both 16-bit scale types: max - min = 2 x 65280, / 3 < 65504.
  std::vector<float> wide = GaussianValues(128, 8, 1.0f);
  wide[0] = 65280.0f;
  wide[1] = -65280.0f;
  for (ScaleDtype dtype : {ScaleDtype::kFp16, ScaleDtype::kBf16}) {
    QuantConfig no_clip = Config(2, 0, QuantMethod::kUniform, dtype);
    no_clip.clip_ratio_k = 0.0f;
    const RowCodec codec = MakeCodec(no_clip, 128);
    const Encoded e = EncodeOrDie(codec, KvTensor::kKey, ToBf16(wide));
    std::vector<float> out(128);
    codec.Decode(e.codes.data(), e.meta.data(), absl::MakeSpan(out));
    EXPECT_NEAR(out[0], 65280.0f, 256.0f);
    EXPECT_NEAR(out[1], -65280.0f, 256.0f);
  }
}

TEST(RowCodecTest, LloydMaxScaleOverflowingFp16IsOutOfRangeAndWritesNothing) {
  // Lloyd-Max's step is 1.16 x ~1.0 sigma: a row of values near the range's edge has a scale
  // beyond fp16 (but not beyond BF16).
  std::vector<float> values(128);
  for (int j = 0; j < 128; ++j) values[j] = (j % 2 == 0 ? 1.0f : -1.0f) * 65000.0f;
  const std::vector<Bf16> row = ToBf16(values);
  const RowCodec fp16 = MakeCodec(Config(2, 0, QuantMethod::kLloydMax, ScaleDtype::kFp16), 128);
  std::vector<uint8_t> codes(32, 0xab);
  GroupMeta meta{0x1234, 0x5678};
  const absl::Status s = fp16.Encode(KvTensor::kKey, row, codes.data(), &meta);
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
  EXPECT_EQ(codes, std::vector<uint8_t>(32, 0xab));
  EXPECT_EQ(meta.scale, 0x1234);
  const RowCodec bf16 = MakeCodec(Config(2, 0, QuantMethod::kLloydMax, ScaleDtype::kBf16), 128);
  EXPECT_TRUE(bf16.Encode(KvTensor::kKey, row, codes.data(), &meta).ok());
}

TEST(RowCodecTest, ClipRatioAtOrBelowZeroAndAtOrAboveOneDoesNotClip) {
  const std::vector<Bf16> row = ToBf16(RealLikeRows(1, 128, 9));
  float max_abs = 0;
  for (Bf16 b : row) max_abs = std::max(max_abs, std::fabs(b.ToFloat()));
  for (float r : {-1.0f, 0.0f, 1.0f}) {
    QuantConfig cfg;
    cfg.clip_ratio_k = r;
    const RowCodec codec = MakeCodec(cfg, 128);
    const Encoded e = EncodeOrDie(codec, KvTensor::kKey, row);
    std::vector<float> out(128);
    codec.Decode(e.codes.data(), e.meta.data(), absl::MakeSpan(out));
    float got_max = 0;
    for (float v : out) got_max = std::max(got_max, std::fabs(v));
    // The extreme levels reach the unclipped extremes (up to fp16 storage).
    EXPECT_NEAR(got_max, max_abs, max_abs * 2e-3f) << r;
  }
  // The default clips: the outlier channels saturate well below max |x|.
  const RowCodec clipped = MakeCodec(QuantConfig(), 128);
  const Encoded e = EncodeOrDie(clipped, KvTensor::kKey, row);
  std::vector<float> out(128);
  clipped.Decode(e.codes.data(), e.meta.data(), absl::MakeSpan(out));
  float got_max = 0;
  for (float v : out) got_max = std::max(got_max, std::fabs(v));
  EXPECT_LT(got_max, 0.5f * max_abs);
}

TEST(RowCodecTest, RejectsNonFiniteRowsAndLeavesOutputsUntouched) {
  for (QuantMethod method : {QuantMethod::kUniform, QuantMethod::kLloydMax, QuantMethod::kBypass}) {
    const RowCodec codec = MakeCodec(Config(2, 0, method), 64);
    for (float bad : {std::nanf(""), kInf, -kInf}) {
      for (int pos : {0, 31, 63}) {
        std::vector<float> values = GaussianValues(64, pos, 1.0f);
        values[pos] = bad;
        const std::vector<Bf16> row = ToBf16(values);
        std::vector<uint8_t> codes(128, 0xcd);
        GroupMeta meta{0xaaaa, 0xbbbb};
        EXPECT_EQ(codec.Encode(KvTensor::kKey, row, codes.data(), &meta).code(),
                  absl::StatusCode::kInvalidArgument);
        EXPECT_EQ(codec.EncodeFloat(KvTensor::kValue, values, codes.data(), &meta).code(),
                  absl::StatusCode::kInvalidArgument);
        EXPECT_EQ(codes, std::vector<uint8_t>(128, 0xcd));
        EXPECT_EQ(meta.scale, 0xaaaa);
        EXPECT_EQ(meta.min, 0xbbbb);
      }
    }
  }
  // A finite float that rounds past the largest BF16 is out of range.
  const RowCodec codec = MakeCodec(QuantConfig(), 64);
  std::vector<float> values(64, 1.0f);
  values[5] = std::numeric_limits<float>::max();
  std::vector<uint8_t> codes(16, 0xcd);
  GroupMeta meta{0xaaaa, 0xbbbb};
  EXPECT_EQ(codec.EncodeFloat(KvTensor::kKey, values, codes.data(), &meta).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(codes, std::vector<uint8_t>(16, 0xcd));
}

TEST(RowCodecTest, RejectsWrongRowLength) {
  const RowCodec codec = MakeCodec(QuantConfig(), 128);
  std::vector<uint8_t> codes(32);
  GroupMeta meta;
  const std::vector<Bf16> row(64);
  EXPECT_EQ(codec.Encode(KvTensor::kKey, row, codes.data(), &meta).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(codec.EncodeFloat(KvTensor::kKey, std::vector<float>(129), codes.data(), &meta).code(),
            absl::StatusCode::kInvalidArgument);
}

// ----- Blocks -------------------------------------------------------------------------------

struct BlockCase {
  QuantConfig cfg;
  int heads;
  int d;
};

std::vector<BlockCase> BlockCases() {
  std::vector<BlockCase> cases;
  for (QuantMethod method : {QuantMethod::kUniform, QuantMethod::kLloydMax, QuantMethod::kBypass}) {
    QuantConfig cfg = Config(2, 0, method);
    cases.push_back({cfg, 3, 128});
  }
  QuantConfig int4 = Config(4, 32);
  int4.block_tokens = 32;
  int4.demotion_batch = 8;
  cases.push_back({int4, 2, 64});
  QuantConfig bf16 = Config(2, 64, QuantMethod::kUniform, ScaleDtype::kBf16);
  cases.push_back({bf16, 4, 256});
  return cases;
}

TEST(RowCodecBlockTest, RoundTripsAtTokenOffsetsAndMatchesPerRowEncode) {
  for (const BlockCase& bc : BlockCases()) {
    SCOPED_TRACE(std::string(QuantMethodName(bc.cfg.method)) + " D=" + std::to_string(bc.d));
    const RowCodec codec = MakeCodec(bc.cfg, bc.d);
    const BlockLayout layout = BlockLayout::ForModel(bc.cfg, bc.heads, bc.d);
    const int tokens = layout.tokens;
    const std::vector<Bf16> all_k = ToBf16(RealLikeRows(tokens * bc.heads, bc.d, 77));
    const std::vector<Bf16> all_v = ToBf16(RealLikeRows(tokens * bc.heads, bc.d, 78));
    std::vector<uint8_t> block(layout.block_bytes(), 0x5a);
    // Fill the block in three uneven calls per tensor, V first for K to follow.
    const size_t token_values = static_cast<size_t>(bc.heads) * bc.d;
    for (KvTensor t : {KvTensor::kValue, KvTensor::kKey}) {
      const std::vector<Bf16>& all = t == KvTensor::kKey ? all_k : all_v;
      for (auto [first, count] :
           {std::pair{0, 3}, std::pair{3, tokens - 8}, std::pair{tokens - 5, 5}}) {
        ASSERT_TRUE(codec
                        .EncodeIntoBlock(t, layout,
                                         absl::MakeConstSpan(all).subspan(first * token_values,
                                                                          count * token_values),
                                         first, block.data())
                        .ok());
      }
    }
    for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
      const std::vector<Bf16>& all = t == KvTensor::kKey ? all_k : all_v;
      // Every row sits at its documented offsets and equals a per-row Encode.
      for (int tok = 0; tok < tokens; ++tok) {
        for (int h = 0; h < bc.heads; ++h) {
          const std::vector<Bf16> row(all.begin() + (tok * bc.heads + h) * bc.d,
                                      all.begin() + (tok * bc.heads + h + 1) * bc.d);
          const Encoded e = EncodeOrDie(codec, t, row);
          const uint8_t* codes =
              block.data() + layout.CodesOffset(t, h) + tok * layout.code_bytes_per_row();
          ASSERT_EQ(std::memcmp(codes, e.codes.data(), e.codes.size()), 0) << tok << " " << h;
          const uint8_t* meta =
              block.data() + layout.MetaOffset(t, h) + tok * layout.meta_bytes_per_row();
          ASSERT_EQ(std::memcmp(meta, e.meta.data(), layout.meta_bytes_per_row()), 0);
        }
      }
      // Decode a range at an offset; equals per-row decode.
      const int first = 2, count = tokens - 4;
      std::vector<float> out(count * token_values);
      codec.DecodeFromBlock(t, layout, block.data(), first, count, absl::MakeSpan(out));
      for (int r = 0; r < count; ++r) {
        for (int h = 0; h < bc.heads; ++h) {
          const std::vector<Bf16> row(all.begin() + ((first + r) * bc.heads + h) * bc.d,
                                      all.begin() + ((first + r) * bc.heads + h + 1) * bc.d);
          const Encoded e = EncodeOrDie(codec, t, row);
          std::vector<float> want(bc.d);
          codec.Decode(e.codes.data(), e.meta.data(), absl::MakeSpan(want));
          for (int j = 0; j < bc.d; ++j) {
            ASSERT_EQ(out[(r * bc.heads + h) * bc.d + j], want[j]);
            if (bc.cfg.method == QuantMethod::kBypass) {
              ASSERT_EQ(want[j], row[j].ToFloat());
            }
          }
        }
      }
    }
    // Padding at the end of each head segment is never written.
    const size_t raw = 2 * layout.codes_bytes() + 2 * layout.meta_bytes();
    for (int h = 0; h < bc.heads; ++h) {
      for (size_t i = raw; i < layout.head_segment_bytes(); ++i) {
        ASSERT_EQ(block[h * layout.head_segment_bytes() + i], 0x5a);
      }
    }
  }
}

TEST(RowCodecBlockTest, WritesOnlyItsTokensOfItsTensorAndHead) {
  for (const BlockCase& bc : BlockCases()) {
    SCOPED_TRACE(std::string(QuantMethodName(bc.cfg.method)) + " D=" + std::to_string(bc.d));
    const RowCodec codec = MakeCodec(bc.cfg, bc.d);
    const BlockLayout layout = BlockLayout::ForModel(bc.cfg, bc.heads, bc.d);
    const int first = 5, count = 4;
    const size_t token_values = static_cast<size_t>(bc.heads) * bc.d;
    std::vector<Bf16> rows = ToBf16(RealLikeRows(count * bc.heads, bc.d, 5));
    std::vector<uint8_t> a(layout.block_bytes(), 0x3c);
    ASSERT_TRUE(codec.EncodeIntoBlock(KvTensor::kKey, layout, rows, first, a.data()).ok());
    // Bytes that may change: the K codes and K meta of tokens [first, first+count), per head.
    auto owner = [&](size_t byte) -> int {  // head whose written range holds `byte`, or -1
      for (int h = 0; h < bc.heads; ++h) {
        const size_t c0 =
            layout.CodesOffset(KvTensor::kKey, h) + first * layout.code_bytes_per_row();
        const size_t m0 =
            layout.MetaOffset(KvTensor::kKey, h) + first * layout.meta_bytes_per_row();
        if (byte >= c0 && byte < c0 + count * layout.code_bytes_per_row()) return h;
        if (byte >= m0 && byte < m0 + count * layout.meta_bytes_per_row()) return h;
      }
      return -1;
    };
    for (size_t i = 0; i < a.size(); ++i) {
      if (owner(i) < 0) {
        ASSERT_EQ(a[i], 0x3c) << "byte " << i << " outside the written rows";
      }
    }
    // Change only head h's rows: only head h's bytes may differ.
    for (int h = 0; h < bc.heads; ++h) {
      std::vector<Bf16> changed = rows;
      const std::vector<Bf16> other = ToBf16(RealLikeRows(count, bc.d, 100 + h));
      for (int r = 0; r < count; ++r) {
        std::copy(other.begin() + r * bc.d, other.begin() + (r + 1) * bc.d,
                  changed.begin() + r * token_values + h * bc.d);
      }
      std::vector<uint8_t> b(layout.block_bytes(), 0x3c);
      ASSERT_TRUE(codec.EncodeIntoBlock(KvTensor::kKey, layout, changed, first, b.data()).ok());
      int differing = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        if (a[i] != b[i]) {
          ++differing;
          ASSERT_EQ(owner(i), h) << "byte " << i;
        }
      }
      EXPECT_GT(differing, 0);
    }
  }
}

TEST(RowCodecBlockTest, RejectsBadInputsAndWritesNothing) {
  const QuantConfig cfg;  // fp16 meta
  const RowCodec codec = MakeCodec(cfg, 64);
  const BlockLayout layout = BlockLayout::ForModel(cfg, 2, 64);
  const std::vector<uint8_t> pristine(layout.block_bytes(), 0x77);
  std::vector<uint8_t> block = pristine;
  std::vector<Bf16> rows = ToBf16(RealLikeRows(4 * 2, 64, 6));

  // NaN in the last row: nothing at all is written, not even the good rows before it.
  std::vector<Bf16> nan_rows = rows;
  nan_rows.back() = Bf16::FromFloat(std::nanf(""));
  absl::Status s = codec.EncodeIntoBlock(KvTensor::kKey, layout, nan_rows, 0, block.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(block, pristine);

  // Overflow of the fp16 min in the last row: staged, so nothing is written either.
  std::vector<Bf16> huge_rows = rows;
  for (int j = 0; j < 64; ++j) huge_rows[huge_rows.size() - 1 - j] = Bf16::FromFloat(-7e4f);
  s = codec.EncodeIntoBlock(KvTensor::kKey, layout, huge_rows, 0, block.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
  EXPECT_EQ(block, pristine);

  // Large but representable rows take the staged path and still land correctly.
  std::vector<Bf16> large_rows = rows;
  for (int j = 0; j < 64; ++j) large_rows[64 + j] = Bf16::FromFloat(20000.0f - 300.0f * j);
  ASSERT_TRUE(codec.EncodeIntoBlock(KvTensor::kValue, layout, large_rows, 4, block.data()).ok());
  const Encoded e =
      EncodeOrDie(codec, KvTensor::kValue,
                  std::vector<Bf16>(large_rows.begin() + 64, large_rows.begin() + 128));
  EXPECT_EQ(std::memcmp(block.data() + layout.CodesOffset(KvTensor::kValue, 1) +
                            4 * layout.code_bytes_per_row(),
                        e.codes.data(), e.codes.size()),
            0);
  EXPECT_EQ(std::memcmp(block.data() + layout.MetaOffset(KvTensor::kValue, 1) +
                            4 * layout.meta_bytes_per_row(),
                        e.meta.data(), 4),
            0);

  block = pristine;
  // Tokens past the end, negative offsets, partial rows, a layout of another codec.
  EXPECT_EQ(codec.EncodeIntoBlock(KvTensor::kKey, layout, rows, 13, block.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(codec.EncodeIntoBlock(KvTensor::kKey, layout, rows, -1, block.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(codec
                .EncodeIntoBlock(KvTensor::kKey, layout, absl::MakeConstSpan(rows).subspan(1), 0,
                                 block.data())
                .code(),
            absl::StatusCode::kInvalidArgument);
  BlockLayout other = layout;
  other.bits = 4;
  EXPECT_EQ(codec.EncodeIntoBlock(KvTensor::kKey, other, rows, 0, block.data()).code(),
            absl::StatusCode::kInvalidArgument);
  other = layout;
  other.head_dim = 128;
  EXPECT_EQ(codec.EncodeIntoBlock(KvTensor::kKey, other, rows, 0, block.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(block, pristine);
  // Zero rows is a no-op.
  EXPECT_TRUE(codec.EncodeIntoBlock(KvTensor::kKey, layout, {}, 16, block.data()).ok());
  EXPECT_EQ(block, pristine);
}

// ----- Measurement: 16-bit scale/min storage against fp32 ------------------------------------

// Mean squared dequantization error on real-like rows with scale and min kept in fp32 (the
// reference serving format), fp16 (kvpool's default) and bf16.
TEST(ScaleDtypeMeasurementTest, Fp16IsAtLeastAsAccurateAsBf16) {
  constexpr int kD = 128, kRows = 4096;
  const std::vector<Bf16> rows = ToBf16(RealLikeRows(kRows, kD, 2024));
  for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
    double mse_fp32 = 0, mse_fp16 = 0, mse_bf16 = 0;
    for (ScaleDtype dtype : {ScaleDtype::kFp16, ScaleDtype::kBf16}) {
      const RowCodec codec = MakeCodec(Config(2, 0, QuantMethod::kUniform, dtype), kD);
      double& mse = dtype == ScaleDtype::kFp16 ? mse_fp16 : mse_bf16;
      std::vector<float> out(kD);
      for (int r = 0; r < kRows; ++r) {
        const std::vector<Bf16> row(rows.begin() + r * kD, rows.begin() + (r + 1) * kD);
        const Encoded e = EncodeOrDie(codec, t, row);
        codec.Decode(e.codes.data(), e.meta.data(), absl::MakeSpan(out));
        const DoubleRef ref = DoubleEncode(codec.config(), kD, t, row);
        for (int j = 0; j < kD; ++j) mse += (out[j] - ref.clipped[j]) * (out[j] - ref.clipped[j]);
      }
    }
    // fp32 scale and min: the same formula without the 16-bit rounding.
    const QuantConfig cfg;
    for (int r = 0; r < kRows; ++r) {
      const std::vector<Bf16> row(rows.begin() + r * kD, rows.begin() + (r + 1) * kD);
      const DoubleRef ref = DoubleEncode(cfg, kD, t, row);
      std::vector<float> x(ref.clipped.begin(), ref.clipped.end());
      const float mn = *std::min_element(x.begin(), x.end());
      const float mx = *std::max_element(x.begin(), x.end());
      const float s = (mx - mn) / 3.0f;
      for (int j = 0; j < kD; ++j) {
        const float q =
            s == 0 ? 0 : std::min(std::max(std::floor((x[j] - mn) / s + 0.5f), 0.0f), 3.0f);
        const float xh = mn + q * s;
        mse_fp32 += (xh - ref.clipped[j]) * (xh - ref.clipped[j]);
      }
    }
    const double n = static_cast<double>(kRows) * kD;
    mse_fp32 /= n;
    mse_fp16 /= n;
    mse_bf16 /= n;
    std::printf(
        "[measure] %s D=%d INT2 G=D clip %.2f, MSE vs clipped row: fp32 %.6e  fp16 %.6e "
        "(%+.3f%%)  bf16 %.6e (%+.3f%%)\n",
        t == KvTensor::kKey ? "K" : "V", kD, cfg.ClipRatio(t), mse_fp32, mse_fp16,
        100 * (mse_fp16 / mse_fp32 - 1), mse_bf16, 100 * (mse_bf16 / mse_fp32 - 1));
    ::testing::Test::RecordProperty(t == KvTensor::kKey ? "k_mse_fp16" : "v_mse_fp16",
                                    std::to_string(mse_fp16));
    ::testing::Test::RecordProperty(t == KvTensor::kKey ? "k_mse_bf16" : "v_mse_bf16",
                                    std::to_string(mse_bf16));
    EXPECT_LE(mse_fp16, mse_bf16);
    EXPECT_LE(mse_fp16, mse_fp32 * 1.01);  // fp16 storage costs at most 1% here
  }
}

}  // namespace
}  // namespace kvpool
