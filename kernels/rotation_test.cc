#include "kernels/rotation.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/bf16.h"

namespace kvpool {
namespace {

using ::testing::HasSubstr;

constexpr int kHeadDims[] = {32, 64, 128, 256};

// Row-major D x D in float64.
using MatD = std::vector<double>;

// The Sylvester Hadamard matrix built by its recursion H_2n = [[H, H], [H, -H]] / sqrt(2),
// independently of the popcount formula the implementation uses.
MatD SylvesterHadamard(int d) {
  MatD h = {1.0};
  for (int n = 1; n < d; n *= 2) {
    MatD next(static_cast<size_t>(4) * n * n);
    const double s = 1.0 / std::sqrt(2.0);
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) {
        const double v = h[i * n + j] * s;
        next[i * 2 * n + j] = v;
        next[i * 2 * n + j + n] = v;
        next[(i + n) * 2 * n + j] = v;
        next[(i + n) * 2 * n + j + n] = -v;
      }
    }
    h = std::move(next);
  }
  return h;
}

MatD ToDouble(const std::vector<float>& m) { return MatD(m.begin(), m.end()); }

// max |M M^T - I|.
double OrthogonalityError(const MatD& m, int d) {
  double err = 0.0;
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < d; ++j) {
      double dot = 0.0;
      for (int k = 0; k < d; ++k) dot += m[i * d + k] * m[j * d + k];
      err = std::max(err, std::abs(dot - (i == j ? 1.0 : 0.0)));
    }
  }
  return err;
}

// y = x * M (transpose_m: x * M^T) in float64 for `rows` rows.
std::vector<double> ReferenceApply(const std::vector<float>& x, const MatD& m, int d,
                                   bool transpose_m) {
  const size_t rows = x.size() / d;
  std::vector<double> y(x.size(), 0.0);
  for (size_t r = 0; r < rows; ++r) {
    for (int j = 0; j < d; ++j) {
      double acc = 0.0;
      for (int k = 0; k < d; ++k) {
        acc += static_cast<double>(x[r * d + k]) * (transpose_m ? m[j * d + k] : m[k * d + j]);
      }
      y[r * d + j] = acc;
    }
  }
  return y;
}

std::vector<float> Gaussian(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// A random orthogonal matrix: Gram-Schmidt (twice, for accuracy) on Gaussian rows in float64.
std::vector<float> RandomOrthogonal(int d, uint64_t seed) {
  std::vector<float> g = Gaussian(static_cast<size_t>(d) * d, seed);
  MatD q(g.begin(), g.end());
  for (int i = 0; i < d; ++i) {
    for (int pass = 0; pass < 2; ++pass) {
      for (int j = 0; j < i; ++j) {
        double dot = 0.0;
        for (int k = 0; k < d; ++k) dot += q[i * d + k] * q[j * d + k];
        for (int k = 0; k < d; ++k) q[i * d + k] -= dot * q[j * d + k];
      }
    }
    double norm = 0.0;
    for (int k = 0; k < d; ++k) norm += q[i * d + k] * q[i * d + k];
    norm = std::sqrt(norm);
    for (int k = 0; k < d; ++k) q[i * d + k] /= norm;
  }
  return std::vector<float>(q.begin(), q.end());
}

RotationSet MakeDense(int layers, int d, uint64_t seed) {
  std::vector<std::vector<float>> k, v;
  for (int l = 0; l < layers; ++l) {
    k.push_back(RandomOrthogonal(d, seed + 2 * l));
    v.push_back(RandomOrthogonal(d, seed + 2 * l + 1));
  }
  absl::StatusOr<RotationSet> r = RotationSet::Dense(layers, d, std::move(k), std::move(v));
  EXPECT_TRUE(r.ok()) << r.status();
  return *std::move(r);
}

// All four kinds for one head_dim, two layers each.
std::vector<RotationSet> AllKinds(int d) {
  std::vector<RotationSet> sets;
  sets.push_back(*RotationSet::Identity(2, d));
  sets.push_back(*RotationSet::Hadamard(2, d));
  sets.push_back(*RotationSet::RandomizedHadamard(2, d, 0x1234abcdull));
  sets.push_back(MakeDense(2, d, 99));
  return sets;
}

// An independent SplitMix64 for checking the sign rule of rotation.h.
uint64_t ReferenceSplitMix64(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

TEST(RotationTest, KindNamesRoundTrip) {
  for (RotationKind k : {RotationKind::kIdentity, RotationKind::kHadamard,
                         RotationKind::kRandomizedHadamard, RotationKind::kDense}) {
    absl::StatusOr<RotationKind> parsed = ParseRotationKind(RotationKindName(k));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, k);
  }
  EXPECT_EQ(RotationKindName(RotationKind::kRandomizedHadamard), "randomized_hadamard");
  EXPECT_EQ(ParseRotationKind("givens").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RotationTest, HadamardEqualsSylvesterMatrix) {
  for (int d : kHeadDims) {
    SCOPED_TRACE(d);
    const RotationSet h = *RotationSet::Hadamard(3, d);
    const MatD ref = SylvesterHadamard(d);
    for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
      const std::vector<float> m = h.Matrix(2, t);
      ASSERT_EQ(m.size(), ref.size());
      for (size_t i = 0; i < m.size(); ++i) ASSERT_NEAR(m[i], ref[i], 1e-7) << i;
      // Rotating the identity's rows gives M's rows: the transform is the matrix.
      std::vector<float> eye(static_cast<size_t>(d) * d, 0.0f), out(eye.size());
      for (int i = 0; i < d; ++i) eye[i * d + i] = 1.0f;
      ASSERT_TRUE(h.Rotate(2, t, eye, absl::MakeSpan(out)).ok());
      for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref[i], 1e-7) << i;
    }
  }
}

TEST(RotationTest, EveryKindIsOrthogonal) {
  for (int d : kHeadDims) {
    for (const RotationSet& r : AllKinds(d)) {
      SCOPED_TRACE(absl::StrCat(RotationKindName(r.kind()), " D=", d));
      for (int layer = 0; layer < r.num_layers(); ++layer) {
        for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
          EXPECT_LT(OrthogonalityError(ToDouble(r.Matrix(layer, t)), d), 1e-6);
        }
      }
    }
  }
}

TEST(RotationTest, RotateAndUnrotateMatchFloat64Reference) {
  for (int d : kHeadDims) {
    for (const RotationSet& r : AllKinds(d)) {
      SCOPED_TRACE(absl::StrCat(RotationKindName(r.kind()), " D=", d));
      const int rows = 37;
      const std::vector<float> x = Gaussian(static_cast<size_t>(rows) * d, d + 5);
      for (int layer = 0; layer < r.num_layers(); ++layer) {
        for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
          const MatD m = ToDouble(r.Matrix(layer, t));
          std::vector<float> y(x.size()), back(x.size()), inv(x.size());
          ASSERT_TRUE(r.Rotate(layer, t, x, absl::MakeSpan(y)).ok());
          ASSERT_TRUE(r.Unrotate(layer, t, x, absl::MakeSpan(inv)).ok());
          ASSERT_TRUE(r.Unrotate(layer, t, y, absl::MakeSpan(back)).ok());
          const std::vector<double> y_ref = ReferenceApply(x, m, d, false);
          const std::vector<double> inv_ref = ReferenceApply(x, m, d, true);
          for (size_t i = 0; i < x.size(); ++i) {
            ASSERT_NEAR(y[i], y_ref[i], 2e-5) << i;
            ASSERT_NEAR(inv[i], inv_ref[i], 2e-5) << i;
            ASSERT_NEAR(back[i], x[i], 2e-5) << i;  // Unrotate undoes Rotate
          }
        }
      }
    }
  }
}

TEST(RotationTest, IdentityIsExact) {
  const RotationSet id = *RotationSet::Identity(4, 128);
  std::vector<float> x = Gaussian(128 * 9, 3);
  x[5] = -0.0f;
  x[6] = std::numeric_limits<float>::denorm_min();
  std::vector<float> y(x.size());
  ASSERT_TRUE(id.Rotate(3, KvTensor::kValue, x, absl::MakeSpan(y)).ok());
  EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * sizeof(float)), 0);

  std::vector<Bf16> xb(x.size()), yb(x.size());
  for (size_t i = 0; i < x.size(); ++i) xb[i] = Bf16::FromFloat(x[i] * 1000.0f);
  ASSERT_TRUE(id.RotateBf16(1, KvTensor::kKey, xb, absl::MakeSpan(yb)).ok());
  EXPECT_EQ(std::memcmp(xb.data(), yb.data(), xb.size() * sizeof(Bf16)), 0);
}

TEST(RotationTest, RotateBf16IsRotateThenRoundToNearestEven) {
  for (int d : kHeadDims) {
    for (const RotationSet& r : AllKinds(d)) {
      SCOPED_TRACE(absl::StrCat(RotationKindName(r.kind()), " D=", d));
      // More rows than one internal chunk, and a ragged last chunk.
      const size_t rows = 1100;
      const std::vector<float> g = Gaussian(rows * d, 17);
      std::vector<Bf16> xb(g.size());
      std::vector<float> xf(g.size());
      for (size_t i = 0; i < g.size(); ++i) {
        xb[i] = Bf16::FromFloat(g[i] * 3.0f);
        xf[i] = xb[i].ToFloat();
      }
      std::vector<float> yf(g.size());
      std::vector<Bf16> yb(g.size());
      ASSERT_TRUE(r.Rotate(1, KvTensor::kKey, xf, absl::MakeSpan(yf)).ok());
      ASSERT_TRUE(r.RotateBf16(1, KvTensor::kKey, xb, absl::MakeSpan(yb)).ok());
      for (size_t i = 0; i < g.size(); ++i) {
        ASSERT_EQ(yb[i].bits, Bf16::FromFloat(yf[i]).bits) << i;
      }
    }
  }
}

TEST(RotationTest, RandomizedSignsFollowTheHeaderRule) {
  const uint64_t seed = 0xfeedfacecafebeefull;
  for (int layer : {0, 1, 35}) {
    for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
      const std::vector<float> s = RandomizedHadamardSigns(seed, layer, t, 256);
      uint64_t state = seed ^ (0x9E3779B97F4A7C15ull *
                               static_cast<uint64_t>(2 * layer + static_cast<int>(t) + 1));
      uint64_t word = 0;
      for (int i = 0; i < 256; ++i) {
        if (i % 64 == 0) word = ReferenceSplitMix64(&state);
        EXPECT_EQ(s[i], ((word >> (i % 64)) & 1) ? -1.0f : 1.0f) << i;
      }
    }
  }
}

TEST(RotationTest, RandomizedSignsAreDeterministicAndDistinct) {
  const auto a = RandomizedHadamardSigns(7, 3, KvTensor::kKey, 128);
  EXPECT_EQ(a, RandomizedHadamardSigns(7, 3, KvTensor::kKey, 128));
  EXPECT_NE(a, RandomizedHadamardSigns(7, 3, KvTensor::kValue, 128));
  EXPECT_NE(a, RandomizedHadamardSigns(7, 4, KvTensor::kKey, 128));
  EXPECT_NE(a, RandomizedHadamardSigns(8, 3, KvTensor::kKey, 128));
  // Balanced-ish and only +-1.
  int neg = 0;
  for (float s : a) {
    ASSERT_TRUE(s == 1.0f || s == -1.0f);
    neg += s < 0;
  }
  EXPECT_GT(neg, 32);
  EXPECT_LT(neg, 96);

  // The set applies exactly diag(s) H.
  const RotationSet r = *RotationSet::RandomizedHadamard(5, 64, 7);
  EXPECT_EQ(r.seed(), 7u);
  const MatD h = SylvesterHadamard(64);
  const auto s = RandomizedHadamardSigns(7, 4, KvTensor::kValue, 64);
  const std::vector<float> m = r.Matrix(4, KvTensor::kValue);
  for (int i = 0; i < 64; ++i) {
    for (int j = 0; j < 64; ++j) ASSERT_NEAR(m[i * 64 + j], s[i] * h[i * 64 + j], 1e-7);
  }
  // Two rotation sets with the same seed agree, another seed does not.
  const RotationSet same = *RotationSet::RandomizedHadamard(5, 64, 7);
  const RotationSet other = *RotationSet::RandomizedHadamard(5, 64, 8);
  EXPECT_EQ(same.Matrix(2, KvTensor::kKey), r.Matrix(2, KvTensor::kKey));
  EXPECT_NE(other.Matrix(2, KvTensor::kKey), r.Matrix(2, KvTensor::kKey));
  EXPECT_NE(r.Matrix(2, KvTensor::kKey), r.Matrix(3, KvTensor::kKey));
}

TEST(RotationTest, DenseKeepsMatricesAsGiven) {
  const std::vector<float> k = RandomOrthogonal(32, 1), v = RandomOrthogonal(32, 2);
  const RotationSet r = *RotationSet::Dense(1, 32, {k}, {v});
  EXPECT_EQ(r.kind(), RotationKind::kDense);
  EXPECT_EQ(r.num_layers(), 1);
  EXPECT_EQ(r.head_dim(), 32);
  EXPECT_EQ(r.Matrix(0, KvTensor::kKey), k);
  EXPECT_EQ(r.Matrix(0, KvTensor::kValue), v);
  EXPECT_TRUE(r.Matrix(1, KvTensor::kKey).empty());
  EXPECT_TRUE(r.Matrix(-1, KvTensor::kKey).empty());
}

void ExpectInvalid(const absl::Status& s, const std::string& needle) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(needle));
}

TEST(RotationTest, RejectsBadConstruction) {
  for (int d : {0, 16, 48, 100, 512, -128}) {
    ExpectInvalid(RotationSet::Identity(2, d).status(), "head_dim");
    ExpectInvalid(RotationSet::Hadamard(2, d).status(), "head_dim");
    ExpectInvalid(RotationSet::RandomizedHadamard(2, d, 1).status(), "head_dim");
  }
  ExpectInvalid(RotationSet::Hadamard(0, 64).status(), "num_layers");
  ExpectInvalid(RotationSet::Hadamard(-1, 64).status(), "num_layers");

  const std::vector<float> good = RandomOrthogonal(32, 5);
  ExpectInvalid(RotationSet::Dense(2, 32, {good}, {good, good}).status(), "1 K matrices");
  ExpectInvalid(RotationSet::Dense(1, 32, {good}, {}).status(), "0 V matrices");
  ExpectInvalid(
      RotationSet::Dense(1, 32, {std::vector<float>(good.begin(), good.end() - 1)}, {good})
          .status(),
      "values, expected");
  std::vector<float> nan = good;
  nan[17] = std::nanf("");
  ExpectInvalid(RotationSet::Dense(1, 32, {good}, {nan}).status(), "non-finite");
  std::vector<float> inf = good;
  inf[3] = std::numeric_limits<float>::infinity();
  ExpectInvalid(RotationSet::Dense(1, 32, {inf}, {good}).status(), "non-finite");
  std::vector<float> skewed = good;
  skewed[0] += 1e-3f;
  ExpectInvalid(RotationSet::Dense(1, 32, {skewed}, {good}).status(), "not orthogonal");
  std::vector<float> scaled = good;
  for (float& x : scaled) x *= 2.0f;
  ExpectInvalid(RotationSet::Dense(1, 32, {good}, {scaled}).status(), "not orthogonal");
  // Within a loose tolerance the perturbed matrix is accepted.
  EXPECT_TRUE(RotationSet::Dense(1, 32, {skewed}, {good}, /*tolerance=*/1e-2f).ok());
  ExpectInvalid(RotationSet::Dense(1, 32, {good}, {good}, /*tolerance=*/0.0f).status(),
                "tolerance");
  ExpectInvalid(RotationSet::Dense(1, 32, {good}, {good}, std::nanf("")).status(), "tolerance");
}

TEST(RotationTest, RejectsBadApplyArguments) {
  for (const RotationSet& r : AllKinds(64)) {
    SCOPED_TRACE(RotationKindName(r.kind()));
    std::vector<float> x = Gaussian(64 * 4, 1), y(x.size());
    ExpectInvalid(r.Rotate(2, KvTensor::kKey, x, absl::MakeSpan(y)), "layer 2 out of range");
    ExpectInvalid(r.Unrotate(-1, KvTensor::kKey, x, absl::MakeSpan(y)), "out of range");
    ExpectInvalid(r.Rotate(0, KvTensor::kKey, absl::MakeConstSpan(x).subspan(0, 100),
                           absl::MakeSpan(y).subspan(0, 100)),
                  "whole number of rows");
    ExpectInvalid(r.Rotate(0, KvTensor::kKey, x, absl::MakeSpan(y).subspan(0, 128)),
                  "output has 128");
    ExpectInvalid(r.Rotate(0, KvTensor::kKey, x, absl::MakeSpan(x)), "overlap");
    ExpectInvalid(r.Rotate(0, KvTensor::kKey, absl::MakeConstSpan(x).subspan(0, 128),
                           absl::MakeSpan(x).subspan(64, 128)),
                  "overlap");
    std::vector<float> bad = x;
    bad[77] = std::nanf("");
    ExpectInvalid(r.Rotate(1, KvTensor::kValue, bad, absl::MakeSpan(y)), "non-finite");
    ExpectInvalid(r.Unrotate(1, KvTensor::kValue, bad, absl::MakeSpan(y)), "non-finite");
    bad[77] = -std::numeric_limits<float>::infinity();
    ExpectInvalid(r.Rotate(1, KvTensor::kValue, bad, absl::MakeSpan(y)), "non-finite");

    std::vector<Bf16> xb(x.size()), yb(x.size());
    for (size_t i = 0; i < x.size(); ++i) xb[i] = Bf16::FromFloat(x[i]);
    ASSERT_TRUE(r.RotateBf16(1, KvTensor::kKey, xb, absl::MakeSpan(yb)).ok());
    ExpectInvalid(r.RotateBf16(5, KvTensor::kKey, xb, absl::MakeSpan(yb)), "out of range");
    ExpectInvalid(r.RotateBf16(0, KvTensor::kKey, xb, absl::MakeSpan(yb).subspan(1)), "output has");
    xb[3] = Bf16::FromFloat(std::nanf(""));
    ExpectInvalid(r.RotateBf16(0, KvTensor::kKey, xb, absl::MakeSpan(yb)), "non-finite");
    xb[3] = Bf16::FromBits(0x7f80);  // +inf
    ExpectInvalid(r.RotateBf16(0, KvTensor::kKey, xb, absl::MakeSpan(yb)), "non-finite");

    // Empty input is a valid no-op.
    EXPECT_TRUE(r.Rotate(0, KvTensor::kKey, {}, {}).ok());
  }
}

TEST(RotationTest, RejectsOverflowingOutput) {
  // Equal huge values: the Hadamard sums them into one coordinate, sqrt(D) times larger.
  const RotationSet h = *RotationSet::Hadamard(1, 64);
  std::vector<float> x(64, 3e38f), y(64);
  ExpectInvalid(h.Rotate(0, KvTensor::kKey, x, absl::MakeSpan(y)), "overflows");
  std::vector<Bf16> xb(64, Bf16::FromFloat(3e38f)), yb(64);
  ExpectInvalid(h.RotateBf16(0, KvTensor::kKey, xb, absl::MakeSpan(yb)), "overflows");
}

}  // namespace
}  // namespace kvpool
