#include "kernels/reference_codec.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/row_codec.h"
#include "kernels/safetensors.h"
#include "tests/support/test_data.h"

namespace kvpool {
namespace {

using ::kvpool::testing::RealLikeRows;
using ::kvpool::testing::ToBf16;

// ----- Fixture access ------------------------------------------------------------------------

// One tensor of the reference golden data: [N, H, ...] rows plus what we recompute from them.
struct TensorSet {
  int rows = 0;  // N * H
  int d = 0;
  float clip = 0;
  std::vector<Bf16> input;              // rows x D
  std::vector<uint8_t> uniform_planar;  // rows x D/4
  std::vector<float> uniform_sz;        // rows x 2
  std::vector<uint8_t> lloydmax_planar;
  std::vector<float> lloydmax_sz;
};

template <typename T>
std::vector<T> TensorAs(const SafetensorsFile& f, const std::string& name) {
  const SafetensorsTensor* t = f.Find(name);
  EXPECT_NE(t, nullptr) << name;
  if (t == nullptr) return {};
  std::vector<T> out(t->bytes.size() / sizeof(T));
  std::memcpy(out.data(), t->bytes.data(), out.size() * sizeof(T));  // little-endian host
  return out;
}

// Loads K (clip 0.96) or V (clip 0.92) of quantizer_d{D}.safetensors ([tokens, heads, D] rows;
// the repository keeps the first tokens of the reference's 512). False, with a test failure,
// when the file is missing or malformed.
bool LoadTensorSet(int d, char kv, TensorSet* set) {
  const std::string path =
      kvpool::testing::OscarFixturesDir() + "/quantizer_d" + std::to_string(d) + ".safetensors";
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::ReadFile(path);
  EXPECT_TRUE(f.ok()) << "fixture " << path << ": " << f.status();
  if (!f.ok()) return false;
  const std::string t(1, kv);
  const SafetensorsTensor* input = f->Find(t + "_rotated_bf16");
  EXPECT_NE(input, nullptr);
  if (input == nullptr) return false;
  EXPECT_EQ(input->dtype, SafetensorsDtype::kBF16);
  EXPECT_EQ(input->shape.size(), 3u);
  if (input->shape.size() != 3) return false;
  EXPECT_GE(input->shape[0] * input->shape[1], 128) << "too few rows to test anything";
  EXPECT_EQ(input->shape[2], d);
  set->d = d;
  set->rows = static_cast<int>(input->shape[0] * input->shape[1]);
  set->clip = kv == 'k' ? 0.96f : 0.92f;
  set->input = TensorAs<Bf16>(*f, t + "_rotated_bf16");
  set->uniform_planar = TensorAs<uint8_t>(*f, "uniform." + t + "_codes_planar");
  set->uniform_sz = TensorAs<float>(*f, "uniform." + t + "_scale_zero_f32");
  set->lloydmax_planar = TensorAs<uint8_t>(*f, "lloydmax." + t + "_codes_planar");
  set->lloydmax_sz = TensorAs<float>(*f, "lloydmax." + t + "_scale_zero_f32");
  EXPECT_EQ(set->uniform_planar.size(), static_cast<size_t>(set->rows) * d / 4);
  EXPECT_EQ(set->uniform_sz.size(), static_cast<size_t>(set->rows) * 2);
  EXPECT_EQ(set->lloydmax_planar.size(), static_cast<size_t>(set->rows) * d / 4);
  EXPECT_EQ(set->lloydmax_sz.size(), static_cast<size_t>(set->rows) * 2);
  return !::testing::Test::HasFailure();
}

std::vector<Bf16> Row(const TensorSet& s, int r) {
  return std::vector<Bf16>(s.input.begin() + static_cast<size_t>(r) * s.d,
                           s.input.begin() + static_cast<size_t>(r + 1) * s.d);
}

std::vector<uint8_t> UnpackFixtureCodes(const std::vector<uint8_t>& planar, int d, int r) {
  std::vector<uint8_t> codes(d);
  UnpackPlanarQuarter(absl::MakeConstSpan(planar).subspan(static_cast<size_t>(r) * d / 4, d / 4),
                      absl::MakeSpan(codes));
  return codes;
}

std::vector<double> ClippedRow(const std::vector<Bf16>& row, float ratio) {
  std::vector<float> x = kvpool::testing::ToFloat(row);
  std::vector<float> scratch(x.size());
  const float tau = ClipThreshold(x, ratio, absl::MakeSpan(scratch));
  std::vector<double> out(x.size());
  for (size_t j = 0; j < x.size(); ++j) out[j] = std::min(std::max(x[j], -tau), tau);
  return out;
}

int64_t UlpDistance(float a, float b) {
  int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  if (ia < 0) ia = INT32_MIN - ia;  // map to a monotonic integer line
  if (ib < 0) ib = INT32_MIN - ib;
  return std::llabs(static_cast<int64_t>(ia) - ib);
}

struct Shape {
  int d;
  char kv;
};
const Shape kShapes[] = {{64, 'k'}, {64, 'v'}, {128, 'k'}, {128, 'v'}};

std::string ShapeName(const Shape& s) { return std::string(1, s.kv) + " D=" + std::to_string(s.d); }

// ----- Golden conformance ---------------------------------------------------------------------

// The reference-compatible mode reproduces the reference's uniform codes from the same BF16
// input; the few differences are off by one exactly at a rounding boundary (the reference
// kernel divides with an approximate division), and scale/zero agree to a few ulp.
TEST(ReferenceGoldenTest, UniformReproducesReferenceCodesAndScales) {
  for (const Shape& shape : kShapes) {
    SCOPED_TRACE(ShapeName(shape));
    TensorSet set;
    ASSERT_TRUE(LoadTensorSet(shape.d, shape.kv, &set));
    int64_t total = 0, mismatches = 0, exact_rows = 0, max_scale_ulp = 0, max_zero_ulp = 0;
    std::map<int64_t, int> zero_ulp_hist;
    for (int r = 0; r < set.rows; ++r) {
      const std::vector<Bf16> row = Row(set, r);
      absl::StatusOr<ReferenceRow> got =
          QuantizeReferenceRow(row, shape.d, set.clip, QuantMethod::kUniform);
      ASSERT_TRUE(got.ok()) << got.status();
      const float s_ref = set.uniform_sz[2 * r], z_ref = set.uniform_sz[2 * r + 1];
      const int64_t s_ulp = UlpDistance(got->scale_zero[0], s_ref);
      const int64_t z_ulp = UlpDistance(got->scale_zero[1], z_ref);
      max_scale_ulp = std::max(max_scale_ulp, s_ulp);
      max_zero_ulp = std::max(max_zero_ulp, z_ulp);
      ++zero_ulp_hist[z_ulp];
      ASSERT_LE(s_ulp, 2) << "row " << r;
      ASSERT_LE(z_ulp, 4) << "row " << r;

      const std::vector<uint8_t> want = UnpackFixtureCodes(set.uniform_planar, shape.d, r);
      const std::vector<double> x = ClippedRow(row, set.clip);
      bool row_exact = true;
      for (int j = 0; j < shape.d; ++j) {
        ++total;
        if (got->codes[j] == want[j]) continue;
        ++mismatches;
        row_exact = false;
        ASSERT_EQ(std::abs(got->codes[j] - want[j]), 1) << "row " << r << " dim " << j;
        // At a rounding boundary: x/s + z + 0.5 is (nearly) an integer.
        const double u = x[j] / s_ref + z_ref + 0.5;
        ASSERT_LT(std::fabs(u - std::round(u)),
                  1e-5 * (1 + std::fabs(x[j] / s_ref) + std::fabs(z_ref)))
            << "row " << r << " dim " << j << " u=" << u;
      }
      exact_rows += row_exact;
      // Rows without code differences pack to the fixture's bytes exactly.
      if (row_exact) {
        std::vector<uint8_t> packed(shape.d / 4);
        PackPlanarQuarter(got->codes, absl::MakeSpan(packed));
        ASSERT_EQ(0, std::memcmp(packed.data(), set.uniform_planar.data() + r * shape.d / 4,
                                 packed.size()));
      }
    }
    const double agreement = 100.0 * (total - mismatches) / total;
    std::printf(
        "[golden] %s uniform reference mode: codes %.4f%% (%lld of %lld differ), rows "
        "byte-exact %lld/%d, scale max %lld ulp, zero max %lld ulp (0 ulp on %d rows)\n",
        ShapeName(shape).c_str(), agreement, static_cast<long long>(mismatches),
        static_cast<long long>(total), static_cast<long long>(exact_rows), set.rows,
        static_cast<long long>(max_scale_ulp), static_cast<long long>(max_zero_ulp),
        zero_ulp_hist[0]);
    EXPECT_GE(agreement, 99.99);
  }
}

// The Lloyd-Max path against lloydmax.*: same buckets (codes), scale and zero to the
// reference's fp32 rounding of its own constants.
TEST(ReferenceGoldenTest, LloydMaxMatchesReferenceWithinItsRules) {
  for (const Shape& shape : kShapes) {
    SCOPED_TRACE(ShapeName(shape));
    TensorSet set;
    ASSERT_TRUE(LoadTensorSet(shape.d, shape.kv, &set));
    int64_t total = 0, mismatches = 0;
    double max_scale_rel = 0, max_zero_abs = 0;
    for (int r = 0; r < set.rows; ++r) {
      const std::vector<Bf16> row = Row(set, r);
      absl::StatusOr<ReferenceRow> got =
          QuantizeReferenceRow(row, shape.d, set.clip, QuantMethod::kLloydMax);
      ASSERT_TRUE(got.ok()) << got.status();
      const double s_ref = set.lloydmax_sz[2 * r], z_ref = set.lloydmax_sz[2 * r + 1];
      max_scale_rel = std::max(max_scale_rel, std::fabs(got->scale_zero[0] - s_ref) / s_ref);
      max_zero_abs = std::max(max_zero_abs, std::fabs(got->scale_zero[1] - z_ref));
      const std::vector<uint8_t> want = UnpackFixtureCodes(set.lloydmax_planar, shape.d, r);
      // Bucket edges in units of sigma, from the reference's own scale and zero.
      const double sigma = s_ref / ((2 * 1.50956 / 3) * 1.16);
      const double mu = (1.5 - z_ref) * s_ref;
      const std::vector<double> x = ClippedRow(row, set.clip);
      for (int j = 0; j < shape.d; ++j) {
        ++total;
        if (got->codes[j] == want[j]) continue;
        ++mismatches;
        ASSERT_EQ(std::abs(got->codes[j] - want[j]), 1);
        const double t = (x[j] - mu) / sigma;
        ASSERT_LT(std::min({std::fabs(t - 0.98107), std::fabs(t), std::fabs(t + 0.98107)}), 1e-4)
            << "row " << r << " dim " << j;
      }
    }
    const double agreement = 100.0 * (total - mismatches) / total;
    std::printf(
        "[golden] %s lloyd-max reference mode: codes %.4f%% (%lld differ), scale max "
        "rel err %.2e, zero max abs err %.2e\n",
        ShapeName(shape).c_str(), agreement, static_cast<long long>(mismatches), max_scale_rel,
        max_zero_abs);
    EXPECT_GE(agreement, 99.99);
    // The reference's scale/sigma is 1.1673919 against our fp32 constant 1.1673930: ~1e-6.
    EXPECT_LT(max_scale_rel, 5e-6);
    EXPECT_LT(max_zero_abs, 1e-5);
  }
}

// kvpool's own default mode (RowCodec: uniform INT2, fp16 scale/min, codes against the stored
// 16-bit values) agrees with the reference codes on almost every entry; also reported for
// bf16 meta and for RowCodec's Lloyd-Max against lloydmax.*.
TEST(ReferenceGoldenTest, DefaultKvpoolModeAgreesWithReferenceCodes) {
  for (const Shape& shape : kShapes) {
    SCOPED_TRACE(ShapeName(shape));
    TensorSet set;
    ASSERT_TRUE(LoadTensorSet(shape.d, shape.kv, &set));
    const KvTensor t = shape.kv == 'k' ? KvTensor::kKey : KvTensor::kValue;
    struct Mode {
      const char* name;
      QuantMethod method;
      ScaleDtype dtype;
      const std::vector<uint8_t>* planar;
      double required;
    };
    const Mode modes[] = {
        {"uniform fp16 (default)", QuantMethod::kUniform, ScaleDtype::kFp16, &set.uniform_planar,
         99.9},
        {"uniform bf16", QuantMethod::kUniform, ScaleDtype::kBf16, &set.uniform_planar, 99.0},
        {"lloyd-max fp16", QuantMethod::kLloydMax, ScaleDtype::kFp16, &set.lloydmax_planar, 99.9},
    };
    for (const Mode& mode : modes) {
      QuantConfig cfg;  // defaults: clip K 0.96, V 0.92, G = D
      cfg.method = mode.method;
      cfg.scale_dtype = mode.dtype;
      absl::StatusOr<RowCodec> codec = RowCodec::Create(cfg, shape.d);
      ASSERT_TRUE(codec.ok());
      int64_t total = 0, mismatches = 0, off_by_more = 0;
      double dequant_diff = 0;
      for (int r = 0; r < set.rows; ++r) {
        const std::vector<Bf16> row = Row(set, r);
        std::vector<uint8_t> codes(shape.d / 4), planar(shape.d / 4), logical(shape.d);
        GroupMeta meta;
        ASSERT_TRUE(codec->Encode(t, row, codes.data(), &meta).ok());
        KvpoolToPlanarQuarter(codes, absl::MakeSpan(planar));
        UnpackPlanarQuarter(planar, absl::MakeSpan(logical));
        const std::vector<uint8_t> want = UnpackFixtureCodes(*mode.planar, shape.d, r);
        std::vector<float> out(shape.d);
        codec->Decode(codes.data(), &meta, absl::MakeSpan(out));
        const std::vector<float>& sz =
            mode.planar == &set.uniform_planar ? set.uniform_sz : set.lloydmax_sz;
        for (int j = 0; j < shape.d; ++j) {
          ++total;
          mismatches += logical[j] != want[j];
          off_by_more += std::abs(logical[j] - want[j]) > 1;
          const double ref = (want[j] - static_cast<double>(sz[2 * r + 1])) * sz[2 * r];
          dequant_diff += std::fabs(out[j] - ref);
        }
      }
      const double agreement = 100.0 * (total - mismatches) / total;
      std::printf(
          "[golden] %s kvpool %s: codes %.4f%% agree (%lld differ, %lld by more than "
          "one), mean |dequant - reference dequant| %.3e\n",
          ShapeName(shape).c_str(), mode.name, agreement, static_cast<long long>(mismatches),
          static_cast<long long>(off_by_more), dequant_diff / total);
      EXPECT_GE(agreement, mode.required) << mode.name;
      EXPECT_EQ(off_by_more, 0) << mode.name;
    }
  }
}

// The fixture's packed bytes survive every conversion exactly.
TEST(ReferenceGoldenTest, PlanarConvertersRoundTripFixtureBytes) {
  for (const Shape& shape : kShapes) {
    SCOPED_TRACE(ShapeName(shape));
    TensorSet set;
    ASSERT_TRUE(LoadTensorSet(shape.d, shape.kv, &set));
    const int q4 = shape.d / 4;
    for (const std::vector<uint8_t>* all : {&set.uniform_planar, &set.lloydmax_planar}) {
      for (int r = 0; r < set.rows; ++r) {
        const auto planar = absl::MakeConstSpan(*all).subspan(static_cast<size_t>(r) * q4, q4);
        std::vector<uint8_t> codes(shape.d), repacked(q4), kvpool(q4), back(q4);
        UnpackPlanarQuarter(planar, absl::MakeSpan(codes));
        PackPlanarQuarter(codes, absl::MakeSpan(repacked));
        ASSERT_TRUE(std::equal(repacked.begin(), repacked.end(), planar.begin()));
        PlanarQuarterToKvpool(planar, absl::MakeSpan(kvpool));
        // kvpool's sequential packing of the same logical codes.
        for (int j = 0; j < shape.d; ++j) {
          ASSERT_EQ((kvpool[j / 4] >> (2 * (j % 4))) & 3, codes[j]) << "dim " << j;
        }
        KvpoolToPlanarQuarter(kvpool, absl::MakeSpan(back));
        ASSERT_TRUE(std::equal(back.begin(), back.end(), planar.begin()));
      }
    }
  }
}

// ----- Without fixtures -----------------------------------------------------------------------

TEST(PlanarQuarterTest, PacksTheDocumentedBitPositions) {
  // D = 8: planar byte j holds dims j, j+2, j+4, j+6; kvpool byte j holds dims 4j..4j+3.
  const std::vector<uint8_t> codes = {0, 1, 2, 3, 3, 2, 1, 0};
  std::vector<uint8_t> planar(2), kvpool(2), unpacked(8);
  PackPlanarQuarter(codes, absl::MakeSpan(planar));
  EXPECT_EQ(planar,
            (std::vector<uint8_t>{0 | 2 << 2 | 3 << 4 | 1 << 6, 1 | 3 << 2 | 2 << 4 | 0 << 6}));
  PlanarQuarterToKvpool(planar, absl::MakeSpan(kvpool));
  EXPECT_EQ(kvpool,
            (std::vector<uint8_t>{0 | 1 << 2 | 2 << 4 | 3 << 6, 3 | 2 << 2 | 1 << 4 | 0 << 6}));
  UnpackPlanarQuarter(planar, absl::MakeSpan(unpacked));
  EXPECT_EQ(unpacked, codes);
}

TEST(PlanarQuarterTest, RandomRoundTrips) {
  std::mt19937 rng(17);
  for (int d : {32, 64, 128, 256}) {
    for (int i = 0; i < 50; ++i) {
      std::vector<uint8_t> codes(d), planar(d / 4), kvpool(d / 4), planar2(d / 4), back(d);
      for (uint8_t& c : codes) c = rng() & 3;
      PackPlanarQuarter(codes, absl::MakeSpan(planar));
      PlanarQuarterToKvpool(planar, absl::MakeSpan(kvpool));
      for (int j = 0; j < d; ++j) ASSERT_EQ((kvpool[j / 4] >> (2 * (j % 4))) & 3, codes[j]);
      KvpoolToPlanarQuarter(kvpool, absl::MakeSpan(planar2));
      EXPECT_EQ(planar2, planar);
      UnpackPlanarQuarter(planar2, absl::MakeSpan(back));
      EXPECT_EQ(back, codes);
    }
  }
}

// The reference formulas against float64: dequantized values within half a step of the
// clipped input, extremes exact-ish, per group.
TEST(ReferenceRowTest, UniformIsWithinHalfAStepOfTheClippedInput) {
  for (int d : {64, 128}) {
    for (int g : {32, d}) {
      const std::vector<Bf16> rows = ToBf16(RealLikeRows(64, d, 3 + d + g));
      for (int r = 0; r < 64; ++r) {
        const std::vector<Bf16> row(rows.begin() + r * d, rows.begin() + (r + 1) * d);
        absl::StatusOr<ReferenceRow> got =
            QuantizeReferenceRow(row, g, 0.92f, QuantMethod::kUniform);
        ASSERT_TRUE(got.ok());
        ASSERT_EQ(got->scale_zero.size(), static_cast<size_t>(2 * (d / g)));
        const std::vector<double> x = ClippedRow(row, 0.92f);
        for (int k = 0; k < d / g; ++k) {
          const double s = got->scale_zero[2 * k], z = got->scale_zero[2 * k + 1];
          const double mn = *std::min_element(x.begin() + k * g, x.begin() + (k + 1) * g);
          const double mx = *std::max_element(x.begin() + k * g, x.begin() + (k + 1) * g);
          EXPECT_NEAR(s, std::max(mx - mn, 1e-8) / 3, 1e-6 * s);
          EXPECT_NEAR(z, -mn / s, 1e-5 * (1 + std::fabs(z)));
          for (int j = k * g; j < (k + 1) * g; ++j) {
            const double xh = (got->codes[j] - z) * s;
            ASSERT_LE(std::fabs(xh - x[j]), s / 2 + 1e-5 * (std::fabs(x[j]) + s)) << j;
          }
        }
      }
    }
  }
}

TEST(ReferenceRowTest, RejectsBadInputs) {
  std::vector<Bf16> row = ToBf16(RealLikeRows(1, 128, 1));
  EXPECT_EQ(QuantizeReferenceRow(row, 48, 0.96f, QuantMethod::kUniform).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(QuantizeReferenceRow(row, -4, 0.96f, QuantMethod::kUniform).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(QuantizeReferenceRow(row, 64, 0.96f, QuantMethod::kLloydMax).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(QuantizeReferenceRow(row, 128, 0.96f, QuantMethod::kBypass).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      QuantizeReferenceRow(absl::MakeConstSpan(row).subspan(0, 6), 6, 0.96f, QuantMethod::kUniform)
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
  row[17] = Bf16::FromFloat(std::nanf(""));
  EXPECT_EQ(QuantizeReferenceRow(row, 128, 0.96f, QuantMethod::kUniform).status().code(),
            absl::StatusCode::kInvalidArgument);
  row[17] = Bf16::FromFloat(-INFINITY);
  EXPECT_EQ(QuantizeReferenceRow(row, 128, 0.96f, QuantMethod::kLloydMax).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvpool
