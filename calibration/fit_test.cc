// Tests of the rotation fit: known-answer eigenvectors, the bit-reversal composition,
// orthogonality, the target formulas, the attention-error evaluator, determinism of the whole
// pipeline on synthetic captures, and the C ABI used by the fidelity evaluation.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "Eigen/Core"
#include "Eigen/QR"
#include "calibration/codec_c_api.h"
#include "calibration/fit.h"
#include "calibration/pipeline.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/bf16.h"
#include "kernels/codec_version.h"
#include "kernels/rotation_file.h"
#include "kernels/safetensors.h"
#include "nlohmann/json.hpp"

namespace kvpool::calibration {
namespace {

using MatrixD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

MatrixD RandomOrthogonal(int d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n(0.0, 1.0);
  MatrixD a(d, d);
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < d; ++j) a(i, j) = n(rng);
  }
  Eigen::HouseholderQR<MatrixD> qr(a);
  return qr.householderQ();
}

std::vector<float> RandomValues(size_t count, uint64_t seed, double scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n(0.0, scale);
  std::vector<float> v(count);
  for (float& x : v) x = static_cast<float>(n(rng));
  return v;
}

// A capture whose key target is exactly R diag(lambda) R^T: every query head of token t holds
// sqrt(D * lambda_t) * r_t (r_t = column t of R), N = D tokens.
LayerCapture KnownKeyTargetCapture(const MatrixD& r, const std::vector<double>& lambda, int q_heads,
                                   int kv_heads) {
  const int d = static_cast<int>(r.rows());
  LayerCapture cap;
  cap.num_layers = 1;
  cap.tokens = d;
  cap.q_heads = q_heads;
  cap.kv_heads = kv_heads;
  cap.head_dim = d;
  cap.q.resize(static_cast<size_t>(d) * q_heads * d);
  for (int t = 0; t < d; ++t) {
    for (int h = 0; h < q_heads; ++h) {
      for (int c = 0; c < d; ++c) {
        cap.q[(static_cast<size_t>(t) * q_heads + h) * d + c] =
            static_cast<float>(std::sqrt(d * lambda[t]) * r(c, t));
      }
    }
  }
  cap.k = RandomValues(static_cast<size_t>(d) * kv_heads * d, 1);
  cap.v = RandomValues(static_cast<size_t>(d) * kv_heads * d, 2);
  cap.seq_offsets = {0, d};
  return cap;
}

TEST(BitReversal, SpreadsTopRanksAsSpecified) {
  // docs/oscar-method.md section 3: for D = 128 the top four ranks go to positions 0, 64, 32, 96.
  EXPECT_EQ(BitReverse(0, 7), 0);
  EXPECT_EQ(BitReverse(1, 7), 64);
  EXPECT_EQ(BitReverse(2, 7), 32);
  EXPECT_EQ(BitReverse(3, 7), 96);
  EXPECT_EQ(BitReverse(5, 6), 40);
}

TEST(Hadamard, IsOrthonormalSylvester) {
  const std::vector<double> h = HadamardMatrix(64);
  EXPECT_LT(OrthogonalityError(h, 64), 1e-14);
  EXPECT_DOUBLE_EQ(h[0], 0.125);
  EXPECT_DOUBLE_EQ(h[3 * 64 + 1], -0.125);  // popcount(3 & 1) = 1
  EXPECT_DOUBLE_EQ(h[3 * 64 + 4], 0.125);   // popcount(3 & 4) = 0
}

TEST(KnownAnswerFit, RecoversEigenvectorsAndComposesUHPbr) {
  constexpr int kD = 64;
  const MatrixD r = RandomOrthogonal(kD, 42);
  std::vector<double> lambda(kD);
  for (int i = 0; i < kD; ++i) lambda[i] = 0.5 + 3.0 * ((i * 37) % kD);  // distinct, shuffled
  const LayerCapture cap = KnownKeyTargetCapture(r, lambda, /*q_heads=*/6, /*kv_heads=*/2);

  const std::vector<double> c = KeyTargetMatrix(cap, KeyTarget::kQueryMoment);
  MatrixD expected =
      r * Eigen::Map<const Eigen::VectorXd>(lambda.data(), kD).asDiagonal() * r.transpose();
  for (int i = 0; i < kD * kD; ++i) {
    // The capture holds float32 queries, so the target is exact only to float precision.
    EXPECT_NEAR(c[i], expected.data()[i], 1e-5 * expected.cwiseAbs().maxCoeff());
  }

  absl::StatusOr<SpectralRotation> rot = BuildRotation(c, kD, Composition::kUHPbr);
  ASSERT_TRUE(rot.ok()) << rot.status();
  // Eigenvalues ascending; each eigenvector is +-r_t of the matching lambda.
  std::vector<int> order(kD);
  for (int i = 0; i < kD; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](int a, int b) { return lambda[a] < lambda[b]; });
  for (int i = 0; i < kD; ++i) {
    EXPECT_NEAR(rot->eigenvalues[i], lambda[order[i]], 1e-4 * lambda[order[i]]);
    double dot = 0;
    for (int row = 0; row < kD; ++row) {
      dot += rot->eigenvectors[row * kD + i] * r(row, order[i]);
    }
    EXPECT_NEAR(std::abs(dot), 1.0, 1e-8) << "eigenvector " << i;
  }
  EXPECT_LT(OrthogonalityError(rot->eigenvectors, kD), 1e-10);
  EXPECT_LT(OrthogonalityError(rot->matrix, kD), 1e-10);
  std::vector<float> stored(rot->matrix.begin(), rot->matrix.end());
  EXPECT_LT(OrthogonalityError(absl::Span<const float>(stored), kD), 1e-6);

  // M = U H P_br: column rev(i) of M is column sigma(i) = D - 1 - i of U H.
  const MatrixD u = Eigen::Map<const MatrixD>(rot->eigenvectors.data(), kD, kD);
  const std::vector<double> hv = HadamardMatrix(kD);
  const MatrixD uh = u * Eigen::Map<const MatrixD>(hv.data(), kD, kD);
  const std::vector<int> sigma = DescendingOrder(rot->eigenvalues);
  for (int i = 0; i < kD; ++i) {
    EXPECT_EQ(sigma[i], kD - 1 - i);
    for (int row = 0; row < kD; ++row) {
      EXPECT_DOUBLE_EQ(rot->matrix[row * kD + BitReverse(i, 6)], uh(row, kD - 1 - i));
    }
  }
}

TEST(KnownAnswerFit, AblationCompositions) {
  constexpr int kD = 32;
  const MatrixD r = RandomOrthogonal(kD, 7);
  std::vector<double> lambda(kD);
  for (int i = 0; i < kD; ++i) lambda[i] = 1.0 + i;
  const LayerCapture cap = KnownKeyTargetCapture(r, lambda, 2, 1);
  const std::vector<double> c = KeyTargetMatrix(cap, KeyTarget::kQueryMoment);
  auto u = BuildRotation(c, kD, Composition::kU);
  auto had = BuildRotation(c, kD, Composition::kHadamard);
  ASSERT_TRUE(u.ok() && had.ok());
  EXPECT_EQ(u->matrix, u->eigenvectors);
  EXPECT_EQ(had->matrix, HadamardMatrix(kD));
  EXPECT_EQ(had->eigenvalues, std::vector<double>(kD, 1.0));
  EXPECT_EQ(ObjectiveLabel("qqt", Composition::kUHPbr), "qqt_r_h_pbr");
  EXPECT_EQ(ObjectiveLabel("sst", Composition::kU), "sst_r");
  EXPECT_FALSE(BuildRotation(c, 48, Composition::kU).ok());
}

// The value target against a direct float64 transcription of docs/oscar-method.md section 2.
TEST(Targets, ValueTargetMatchesReferenceFormula) {
  LayerCapture cap;
  cap.tokens = 40;
  cap.q_heads = 4;
  cap.kv_heads = 2;
  cap.head_dim = 32;
  const int n = cap.tokens, d = cap.head_dim, g = 2;
  cap.q = RandomValues(static_cast<size_t>(n) * 4 * d, 3);
  cap.k = RandomValues(static_cast<size_t>(n) * 2 * d, 4);
  cap.v = RandomValues(static_cast<size_t>(n) * 2 * d, 5);
  cap.seq_offsets = {0, n};
  std::vector<double> expected(d * d, 0.0), expected_k(d * d, 0.0);
  for (int h = 0; h < 2; ++h) {
    std::vector<double> a(d * d, 0.0);
    for (int t = 0; t < n; ++t) {
      for (int j = 0; j < g; ++j) {
        const float* q = &cap.q[(t * 4 + h * g + j) * d];
        for (int x = 0; x < d; ++x) {
          for (int y = 0; y < d; ++y) a[x * d + y] += double(q[x]) * q[y] / (g * n);
        }
      }
    }
    std::vector<double> w(n, 0.0);
    double sum = 0;
    for (int t = 0; t < n; ++t) {
      const float* k = &cap.k[(t * 2 + h) * d];
      for (int x = 0; x < d; ++x) {
        for (int y = 0; y < d; ++y) w[t] += double(k[x]) * a[x * d + y] * k[y];
      }
      sum += w[t];
    }
    for (int t = 0; t < n; ++t) {
      const float* v = &cap.v[(t * 2 + h) * d];
      const float* k = &cap.k[(t * 2 + h) * d];
      const double wh = n * w[t] / sum;
      for (int x = 0; x < d; ++x) {
        for (int y = 0; y < d; ++y) {
          expected[x * d + y] += wh * v[x] * v[y] / n / 2;
          expected_k[x * d + y] += double(k[x]) * k[y] / n / 2;
        }
      }
    }
  }
  const std::vector<double> c = ValueTargetMatrix(cap, ValueTarget::kLogitWeighted);
  const std::vector<double> ck = KeyTargetMatrix(cap, KeyTarget::kKeyMoment);
  for (int i = 0; i < d * d; ++i) {
    EXPECT_NEAR(c[i], expected[i], 1e-10);
    EXPECT_NEAR(ck[i], expected_k[i], 1e-10);
  }
}

// --- synthetic captures on disk ------------------------------------------------------------------

std::string BytesOf(const std::vector<Bf16>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(Bf16));
}

// Heavy-tailed post-RoPE-like data: Gaussian plus a few large outlier channels.
std::vector<Bf16> SyntheticRows(int rows, int d, uint64_t seed, double outlier) {
  std::vector<float> v = RandomValues(static_cast<size_t>(rows) * d, seed);
  for (int r = 0; r < rows; ++r) {
    v[static_cast<size_t>(r) * d + 3] *= outlier;
    v[static_cast<size_t>(r) * d + 17] *= outlier * 0.5;
  }
  std::vector<Bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = Bf16::FromFloat(v[i]);
  return out;
}

void WriteSyntheticCaptures(const std::string& dir, int layers, int tokens, int d) {
  std::filesystem::create_directories(dir);
  constexpr int kHq = 4, kHkv = 2;
  for (int layer = 0; layer < layers; ++layer) {
    SafetensorsWriter w;
    w.SetMetadata("model_id", "synthetic");
    w.SetMetadata("layer", std::to_string(layer));
    w.SetMetadata("num_layers", std::to_string(layers));
    w.SetMetadata("tokens", std::to_string(tokens));
    w.SetMetadata("q_heads", std::to_string(kHq));
    w.SetMetadata("kv_heads", std::to_string(kHkv));
    w.SetMetadata("head_dim", std::to_string(d));
    w.AddTensor("q", SafetensorsDtype::kBF16, {tokens, kHq, d},
                BytesOf(SyntheticRows(tokens * kHq, d, 100 + layer, 6.0)));
    w.AddTensor("k", SafetensorsDtype::kBF16, {tokens, kHkv, d},
                BytesOf(SyntheticRows(tokens * kHkv, d, 200 + layer, 10.0)));
    w.AddTensor("v", SafetensorsDtype::kBF16, {tokens, kHkv, d},
                BytesOf(SyntheticRows(tokens * kHkv, d, 300 + layer, 3.0)));
    const std::vector<int64_t> offsets = {0, tokens / 2, tokens};
    w.AddTensor("seq_offsets", SafetensorsDtype::kI64, {3},
                std::string(reinterpret_cast<const char*>(offsets.data()), 3 * sizeof(int64_t)));
    ASSERT_TRUE(w.WriteFile(dir + "/layer_0" + std::to_string(layer) + ".safetensors").ok());
  }
}

class SyntheticCaptures : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/kvpool_fit_test_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir_);
    WriteSyntheticCaptures(dir_, /*layers=*/2, /*tokens=*/320, /*d=*/32);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  CalibrateOptions Options() const {
    CalibrateOptions o;
    o.captures_dir = dir_;
    o.quant.sink_tokens = 8;
    o.quant.recent_tokens = 32;
    o.fit_queries = 64;
    o.clip_grid_min = 0.75;
    return o;
  }
  std::string dir_;
};

TEST_F(SyntheticCaptures, ReadsAndListsCaptures) {
  auto files = ListCaptureFiles(dir_);
  ASSERT_TRUE(files.ok()) << files.status();
  ASSERT_EQ(files->size(), 2u);
  auto cap = ReadLayerCapture((*files)[1]);
  ASSERT_TRUE(cap.ok()) << cap.status();
  EXPECT_EQ(cap->layer, 1);
  EXPECT_EQ(cap->tokens, 320);
  EXPECT_EQ(cap->seq_offsets, (std::vector<int64_t>{0, 160, 320}));
  EXPECT_FALSE(ListCaptureFiles(dir_ + "/missing").ok());
}

TEST_F(SyntheticCaptures, EvaluatorErrorIsZeroForBypassAndOrdersBits) {
  auto cap = ReadLayerCapture(*ListCaptureFiles(dir_).value().begin());
  ASSERT_TRUE(cap.ok());
  auto set = RotationSet::Hadamard(1, 32);
  ASSERT_TRUE(set.ok());
  ErrorOptions opt{8, 32, 64};
  auto ev = LayerEvaluator::Create(*cap, *set, opt);
  ASSERT_TRUE(ev.ok()) << ev.status();
  EXPECT_EQ((*ev)->measured_queries(), 64);
  QuantConfig bypass;
  bypass.method = QuantMethod::kBypass;
  auto e0 = (*ev)->OutputError(bypass, true, true);
  ASSERT_TRUE(e0.ok()) << e0.status();
  EXPECT_LT(*e0, 1e-12);  // the same K/V; only the summation order differs
  QuantConfig int2, int4;
  int4.bits = 4;
  auto e2 = (*ev)->OutputError(int2, true, true);
  auto e4 = (*ev)->OutputError(int4, true, true);
  ASSERT_TRUE(e2.ok() && e4.ok());
  EXPECT_GT(*e2, 0.0);
  EXPECT_LT(*e4, *e2 / 4);
  auto stats = (*ev)->Stats(int2);
  ASSERT_TRUE(stats.ok());
  // c = floor(0.96 * 32) = 30: tau is the magnitude of rank 30 (0-based), so D - 1 - c = 1
  // element per row exceeds it (fewer when BF16 magnitudes tie); V: c = 29, 2 elements.
  EXPECT_NEAR(stats->k_clip_rate, 1.0 / 32, 0.003);
  EXPECT_NEAR(stats->v_clip_rate, 2.0 / 32, 0.003);
  EXPECT_GT(stats->k_rel_error, 0.0);
  EXPECT_NEAR(stats->attn_out_rel_error, *e2, 1e-12);
}

TEST_F(SyntheticCaptures, PipelineIsDeterministicAndWritesALoadableFile) {
  auto a = RunCalibration(Options());
  auto b = RunCalibration(Options());
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  auto bytes_a = SerializeCalibrationFile(*a);
  auto bytes_b = SerializeCalibrationFile(*b);
  ASSERT_TRUE(bytes_a.ok() && bytes_b.ok());
  EXPECT_EQ(*bytes_a, *bytes_b);

  const std::string path = dir_ + "/out.safetensors";
  ASSERT_TRUE(WriteCalibrationFile(*a, path).ok());
  auto model = ReadRotationFile(path);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->rotations.kind(), RotationKind::kDense);
  EXPECT_EQ(model->rotations.num_layers(), 2);
  EXPECT_EQ(model->objective, "qqt_r_h_pbr/sst_r_h_pbr");
  EXPECT_EQ(CodecVersionHex(*model), CodecVersionHex(a->codec));
  auto again = ReadRotationFile(path);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(CodecVersionHex(*again), CodecVersionHex(*model));
  // The fitted ratios are grid points and the statistics are in the file.
  const std::vector<float> grid = ClipRatioGrid(32, 0.75);
  EXPECT_THAT(grid, ::testing::Contains(model->quant.clip_ratio_k));
  EXPECT_THAT(grid, ::testing::Contains(model->quant.clip_ratio_v));
  auto st = SafetensorsFile::ReadFile(path);
  ASSERT_TRUE(st.ok());
  const auto json = nlohmann::json::parse(st->metadata().at("calibration"));
  ASSERT_EQ(json["layers"].size(), 2u);
  EXPECT_GT(json["layers"][1]["attn_out_rel_error"].get<double>(), 0.0);
  EXPECT_EQ(json["clip_fit"]["grid"].size(), grid.size());
}

TEST_F(SyntheticCaptures, FixedClipAndAblationOptions) {
  CalibrateOptions o = Options();
  o.fit_clip = false;
  o.key_target = KeyTarget::kKeyMoment;
  o.value_target = ValueTarget::kValueMoment;
  o.composition = Composition::kU;
  auto r = RunCalibration(o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FLOAT_EQ(r->codec.quant.clip_ratio_k, 0.96f);
  EXPECT_FLOAT_EQ(r->codec.quant.clip_ratio_v, 0.92f);
  EXPECT_EQ(r->codec.objective, "ktk_r/vtv_r");
  EXPECT_TRUE(r->clip_grid.empty());
}

TEST(ClipRatioGrid, IsExactInFloat) {
  for (float r : ClipRatioGrid(64, 0.7)) {
    const float c = std::floor(r * 64.0f);
    EXPECT_EQ(c, r * 64.0f);
  }
  EXPECT_EQ(ClipRatioGrid(64, 0.7).size(), 64u - 45u);
}

// --- the C ABI --------------------------------------------------------------------------------

TEST(CodecCApi, IdentityBypassIsBf16AndHistoryIsQuantized) {
  char err[256];
  void* bypass =
      kvpool_eval_codec_create("identity", 2, 32, 2, "bypass", "fp16", 0, 0, 0, err, sizeof(err));
  ASSERT_NE(bypass, nullptr) << err;
  const std::vector<float> in = RandomValues(4 * 32, 9);
  std::vector<float> tier(in.size()), hist(in.size());
  ASSERT_EQ(kvpool_eval_codec_roundtrip(bypass, 1, 1, 4, in.data(), tier.data(), hist.data(), err,
                                        sizeof(err)),
            0)
      << err;
  for (size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(tier[i], Bf16::FromFloat(in[i]).ToFloat());
    EXPECT_EQ(hist[i], tier[i]);
  }
  EXPECT_NE(kvpool_eval_codec_roundtrip(bypass, 2, 0, 4, in.data(), nullptr, hist.data(), err,
                                        sizeof(err)),
            0);
  kvpool_eval_codec_destroy(bypass);

  void* int2 = kvpool_eval_codec_create("hadamard", 1, 32, 2, "uniform", "fp16", 0.96f, 0.92f, 0,
                                        err, sizeof(err));
  ASSERT_NE(int2, nullptr) << err;
  ASSERT_EQ(kvpool_eval_codec_roundtrip(int2, 0, 0, 4, in.data(), tier.data(), hist.data(), err,
                                        sizeof(err)),
            0);
  double tier_err = 0, hist_err = 0, norm = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    tier_err += (tier[i] - in[i]) * (tier[i] - in[i]);
    hist_err += (hist[i] - in[i]) * (hist[i] - in[i]);
    norm += in[i] * in[i];
  }
  EXPECT_LT(tier_err / norm, 1e-4);
  EXPECT_GT(hist_err / norm, 0.01);
  EXPECT_LT(hist_err / norm, 0.5);
  char version[65];
  float ck = 0, cv = 0;
  int bits = 0, d = 0, layers = 0;
  kvpool_eval_codec_info(int2, &ck, &cv, &bits, &d, &layers, version);
  EXPECT_FLOAT_EQ(ck, 0.96f);
  EXPECT_EQ(bits, 2);
  EXPECT_EQ(d, 32);
  EXPECT_EQ(std::string(version).size(), 64u);
  kvpool_eval_codec_destroy(int2);

  EXPECT_EQ(kvpool_eval_codec_create("/no/such/file", 0, 0, 2, "uniform", "fp16", 0, 0, 1, err,
                                     sizeof(err)),
            nullptr);
  EXPECT_GT(std::string(err).size(), 0u);
}

}  // namespace
}  // namespace kvpool::calibration
