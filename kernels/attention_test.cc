#include "kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "gtest/gtest.h"
#include "kernels/bf16.h"
#include "kernels/block_layout.h"
#include "kernels/codec_config.h"
#include "kernels/reference_codec.h"
#include "kernels/row_codec.h"
#include "kernels/safetensors.h"
#include "tests/support/test_data.h"

namespace kvpool {
namespace {

using ::kvpool::testing::GaussianValues;
using ::kvpool::testing::OscarFixturesDir;
using ::kvpool::testing::RealLikeRows;
using ::kvpool::testing::ToBf16;
using ::kvpool::testing::ToFloat;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Largest per-head relative L2 error of `got.out` against `want.out`.
double MaxRelError(const AttentionShape& s, const AttentionOutput& got,
                   const AttentionOutput& want) {
  double worst = 0.0;
  for (int h = 0; h < s.q_heads; ++h) {
    double num = 0.0, den = 0.0;
    for (int d = 0; d < s.head_dim; ++d) {
      const size_t i = static_cast<size_t>(h) * s.head_dim + d;
      const double diff = static_cast<double>(got.out[i]) - want.out[i];
      num += diff * diff;
      den += static_cast<double>(want.out[i]) * want.out[i];
    }
    worst = std::max(worst, std::sqrt(num / std::max(den, 1e-300)));
  }
  return worst;
}

// Relative L2 error over all heads together.
double RelError(absl::Span<const float> got, absl::Span<const float> want) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double diff = static_cast<double>(got[i]) - want[i];
    num += diff * diff;
    den += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

void ExpectClose(const AttentionShape& s, const AttentionOutput& got, const AttentionOutput& want,
                 double out_tol, double lse_tol, const std::string& what) {
  ASSERT_EQ(got.out.size(), static_cast<size_t>(s.q_heads) * s.head_dim) << what;
  ASSERT_EQ(got.lse.size(), static_cast<size_t>(s.q_heads)) << what;
  EXPECT_LT(MaxRelError(s, got, want), out_tol) << what;
  for (int h = 0; h < s.q_heads; ++h) {
    EXPECT_LE(std::abs(got.lse[h] - want.lse[h]),
              lse_tol * std::max(1.0, std::abs(static_cast<double>(want.lse[h]))))
        << what << " head " << h << " lse " << got.lse[h] << " vs " << want.lse[h];
  }
}

void ExpectEmpty(const AttentionShape& s, const AttentionOutput& r) {
  ASSERT_EQ(r.out.size(), static_cast<size_t>(s.q_heads) * s.head_dim);
  ASSERT_EQ(r.lse.size(), static_cast<size_t>(s.q_heads));
  for (float x : r.out) EXPECT_EQ(x, 0.0f);
  for (float x : r.lse) EXPECT_EQ(x, kNegInf);
}

// BF16-exact fp32 copies of rows (what the BF16 tier stores).
std::vector<float> RoundToBf16(const std::vector<float>& v) { return ToFloat(ToBf16(v)); }

// K/V rows [n][Hkv][D] of one tier, as BF16 and as their exact fp32 values.
struct Rows {
  std::vector<Bf16> k, v;
  std::vector<float> kf, vf;
};

Rows MakeRows(int n, const AttentionShape& s, uint64_t seed) {
  Rows r;
  r.kf = RoundToBf16(RealLikeRows(n * s.kv_heads, s.head_dim, seed));
  r.vf = RoundToBf16(RealLikeRows(n * s.kv_heads, s.head_dim, seed + 1000));
  r.k = ToBf16(r.kf);
  r.v = ToBf16(r.vf);
  return r;
}

// A sequence's tokens in paged blocks of one layer, plus what a decoder gives back for them.
struct PagedRows {
  BlockLayout layout;
  std::vector<std::vector<uint8_t>> storage;
  std::vector<const uint8_t*> blocks;
  std::vector<float> k_deq, v_deq;  // [n][Hkv][D]
};

PagedRows Page(const RowCodec& codec, const AttentionShape& s, const Rows& rows, int n) {
  PagedRows p;
  p.layout = BlockLayout::ForModel(codec.config(), s.kv_heads, s.head_dim);
  const int bt = p.layout.tokens;
  const size_t row = static_cast<size_t>(s.kv_heads) * s.head_dim;
  p.k_deq.resize(row * n);
  p.v_deq.resize(row * n);
  for (int start = 0; start < n; start += bt) {
    const int count = std::min(bt, n - start);
    // Poison the unused tail so a kernel reading past `tokens` would show.
    p.storage.emplace_back(p.layout.block_bytes(), uint8_t{0xA5});
    uint8_t* data = p.storage.back().data();
    const absl::Span<const Bf16> k(rows.k.data() + start * row, count * row);
    const absl::Span<const Bf16> v(rows.v.data() + start * row, count * row);
    EXPECT_TRUE(codec.EncodeIntoBlock(KvTensor::kKey, p.layout, k, 0, data).ok());
    EXPECT_TRUE(codec.EncodeIntoBlock(KvTensor::kValue, p.layout, v, 0, data).ok());
    codec.DecodeFromBlock(KvTensor::kKey, p.layout, data, 0, count,
                          absl::Span<float>(p.k_deq.data() + start * row, count * row));
    codec.DecodeFromBlock(KvTensor::kValue, p.layout, data, 0, count,
                          absl::Span<float>(p.v_deq.data() + start * row, count * row));
  }
  for (const auto& b : p.storage) p.blocks.push_back(b.data());
  return p;
}

RowCodec MakeCodec(const QuantConfig& cfg, int head_dim) {
  absl::StatusOr<RowCodec> codec = RowCodec::Create(cfg, head_dim);
  EXPECT_TRUE(codec.ok()) << codec.status();
  return *std::move(codec);
}

QuantConfig Config(QuantMethod method, int bits, int group_size, ScaleDtype dtype) {
  QuantConfig cfg;
  cfg.method = method;
  cfg.bits = bits;
  cfg.group_size = group_size;
  cfg.scale_dtype = dtype;
  cfg.block_tokens = 16;
  cfg.demotion_batch = 16;
  return cfg;
}

TEST(AttentionTest, Bf16RowsMatchDenseReference) {
  for (int d : {64, 128, 256}) {
    for (int g = 1; g <= 8; ++g) {
      for (int n : {1, 37, 300}) {
        const AttentionShape s{/*q_heads=*/2 * g, /*kv_heads=*/2, d};
        const Rows rows = MakeRows(n, s, 10 * d + g + n);
        const std::vector<float> q = GaussianValues(static_cast<size_t>(s.q_heads) * d, n + g);
        const AttentionOutput got = AttendBf16Rows(s, q, rows.k, rows.v, n);
        const AttentionOutput want = DenseAttentionReference(s, q, rows.kf, rows.vf, n);
        ExpectClose(
            s, got, want, 1e-5, 1e-5,
            "D=" + std::to_string(d) + " g=" + std::to_string(g) + " n=" + std::to_string(n));
      }
    }
  }
}

TEST(AttentionTest, SingleTokenReturnsItsValue) {
  const AttentionShape s{8, 2, 64};
  const Rows rows = MakeRows(1, s, 5);
  const std::vector<float> q = GaussianValues(8 * 64, 6);
  const AttentionOutput r = AttendBf16Rows(s, q, rows.k, rows.v, 1);
  for (int j = 0; j < s.q_heads; ++j) {
    const int h = j / 4;
    for (int d = 0; d < s.head_dim; ++d) {
      EXPECT_FLOAT_EQ(r.out[j * 64 + d], rows.vf[h * 64 + d]);
    }
  }
}

TEST(AttentionTest, EmptyTokenSetsGiveNegInfLseAndZeroOutput) {
  const AttentionShape s{8, 2, 128};
  const std::vector<float> q = GaussianValues(8 * 128, 1);
  ExpectEmpty(s, AttendBf16Rows(s, q, {}, {}, 0));
  ExpectEmpty(s, DenseAttentionReference(s, q, {}, {}, 0));
  const RowCodec codec = MakeCodec(QuantConfig{}, 128);
  const BlockLayout layout = BlockLayout::ForModel(codec.config(), 2, 128);
  ExpectEmpty(s, AttendBlocks(s, codec, layout, {}, 0, q));
}

TEST(AttentionTest, MergeOfSplitEqualsUnsplit) {
  std::mt19937 rng(77);
  for (int trial = 0; trial < 60; ++trial) {
    const int g = 1 + trial % 8;
    const int d = trial % 3 == 0 ? 64 : (trial % 3 == 1 ? 128 : 256);
    const AttentionShape s{g * 2, 2, d};
    const int n = std::uniform_int_distribution<int>(1, 400)(rng);
    const Rows rows = MakeRows(n, s, 500 + trial);
    const std::vector<float> q = GaussianValues(static_cast<size_t>(s.q_heads) * d, 900 + trial);
    // Two random cut points (either may be 0 or n, giving empty parts).
    int a = std::uniform_int_distribution<int>(0, n)(rng);
    int b = std::uniform_int_distribution<int>(0, n)(rng);
    if (trial % 5 == 0) a = 0;
    if (trial % 7 == 0) b = n;
    if (a > b) std::swap(a, b);
    const size_t row = static_cast<size_t>(s.kv_heads) * d;
    auto part = [&](int lo, int hi) {
      return AttendBf16Rows(s, q, absl::MakeConstSpan(rows.k).subspan(lo * row, (hi - lo) * row),
                            absl::MakeConstSpan(rows.v).subspan(lo * row, (hi - lo) * row),
                            hi - lo);
    };
    const AttentionOutput whole = DenseAttentionReference(s, q, rows.kf, rows.vf, n);
    // Merge in a trial-dependent order, starting from a default (empty) accumulator.
    std::vector<AttentionOutput> parts = {part(0, a), part(a, b), part(b, n)};
    std::shuffle(parts.begin(), parts.end(), rng);
    AttentionOutput acc;
    for (const AttentionOutput& p : parts) MergeAttention(s, p, &acc);
    ExpectClose(s, acc, whole, 1e-5, 1e-5,
                "split " + std::to_string(a) + "/" + std::to_string(b) + "/" + std::to_string(n));
  }
}

TEST(AttentionTest, MergeHandlesEmptySidesWithoutNaN) {
  const AttentionShape s{4, 1, 64};
  const Rows rows = MakeRows(10, s, 3);
  const std::vector<float> q = GaussianValues(4 * 64, 4);
  const AttentionOutput full = AttendBf16Rows(s, q, rows.k, rows.v, 10);
  const AttentionOutput empty = AttendBf16Rows(s, q, {}, {}, 0);

  AttentionOutput acc = empty;
  MergeAttention(s, empty, &acc);  // empty + empty
  ExpectEmpty(s, acc);
  MergeAttention(s, full, &acc);  // empty + full
  EXPECT_EQ(acc.out, full.out);
  EXPECT_EQ(acc.lse, full.lse);
  MergeAttention(s, empty, &acc);  // full + empty
  EXPECT_EQ(acc.out, full.out);
  EXPECT_EQ(acc.lse, full.lse);
  AttentionOutput fresh;
  MergeAttention(s, empty, &fresh);  // default accumulator stays empty
  ExpectEmpty(s, fresh);
}

TEST(AttentionTest, MergeOfFarApartLseIsFinite) {
  const AttentionShape s{1, 1, 4};
  AttentionOutput a{{1, 2, 3, 4}, {1000.0f}};
  const AttentionOutput b{{-1, -2, -3, -4}, {-1000.0f}};
  MergeAttention(s, b, &a);
  EXPECT_EQ(a.out, (std::vector<float>{1, 2, 3, 4}));
  EXPECT_FLOAT_EQ(a.lse[0], 1000.0f);
  AttentionOutput c{{5, 5, 5, 5}, {3.0f}};
  const AttentionOutput e{{7, 7, 7, 7}, {3.0f}};
  MergeAttention(s, e, &c);  // equal weights: the mean, lse + ln 2
  for (float x : c.out) EXPECT_FLOAT_EQ(x, 6.0f);
  EXPECT_FLOAT_EQ(c.lse[0], 3.0f + std::log(2.0f));
}

TEST(AttentionTest, BypassBlocksMatchDenseAttention) {
  const QuantConfig cfg = Config(QuantMethod::kBypass, 2, 0, ScaleDtype::kFp16);
  for (int d : {64, 128, 256}) {
    const RowCodec codec = MakeCodec(cfg, d);
    for (int g : {1, 3, 8}) {
      const AttentionShape s{2 * g, 2, d};
      for (int n : {1, 16, 45, 203}) {
        const Rows rows = MakeRows(n, s, 31 * n + d + g);
        const std::vector<float> q = GaussianValues(static_cast<size_t>(s.q_heads) * d, n);
        const PagedRows paged = Page(codec, s, rows, n);
        // The bypass stores the BF16 rows themselves.
        EXPECT_EQ(paged.k_deq, rows.kf);
        EXPECT_EQ(paged.v_deq, rows.vf);
        const AttentionOutput got = AttendBlocks(s, codec, paged.layout, paged.blocks, n, q);
        const std::string what =
            "D=" + std::to_string(d) + " g=" + std::to_string(g) + " n=" + std::to_string(n);
        ExpectClose(s, got, DenseAttentionReference(s, q, rows.kf, rows.vf, n), 1e-5, 1e-5, what);
        ExpectClose(s, got, AttendBf16Rows(s, q, rows.k, rows.v, n), 1e-5, 1e-5, what);
      }
    }
  }
}

TEST(AttentionTest, QuantizedBlocksMatchDenseAttentionOnDequantizedRows) {
  struct Case {
    QuantMethod method;
    int bits;
    int group_size;
    ScaleDtype dtype;
  };
  const Case cases[] = {
      {QuantMethod::kUniform, 2, 0, ScaleDtype::kFp16},
      {QuantMethod::kUniform, 2, 32, ScaleDtype::kBf16},
      {QuantMethod::kUniform, 4, 0, ScaleDtype::kFp16},
      {QuantMethod::kUniform, 4, 32, ScaleDtype::kFp16},
      {QuantMethod::kLloydMax, 2, 0, ScaleDtype::kFp16},
  };
  for (const Case& c : cases) {
    for (int d : {64, 128, 256}) {
      const RowCodec codec = MakeCodec(Config(c.method, c.bits, c.group_size, c.dtype), d);
      for (int g : {1, 4, 8}) {
        const AttentionShape s{2 * g, 2, d};
        for (int n : {1, 17, 45, 250}) {
          const Rows rows = MakeRows(n, s, 7 * n + d + g + c.bits);
          const std::vector<float> q = GaussianValues(static_cast<size_t>(s.q_heads) * d, n + 1);
          const PagedRows paged = Page(codec, s, rows, n);
          const AttentionOutput got = AttendBlocks(s, codec, paged.layout, paged.blocks, n, q);
          const AttentionOutput want = DenseAttentionReference(s, q, paged.k_deq, paged.v_deq, n);
          ExpectClose(s, got, want, 1e-4, 1e-5,
                      std::string(QuantMethodName(c.method)) + " bits=" + std::to_string(c.bits) +
                          " G=" + std::to_string(c.group_size) + " D=" + std::to_string(d) +
                          " g=" + std::to_string(g) + " n=" + std::to_string(n));
        }
      }
    }
  }
}

// A key aligned with every query of its KV head, far larger than the rest, at the first or last
// token of one tier: the merged output must be that token's value. Catches dropped or shifted
// tokens at tier and block boundaries.
TEST(AttentionTest, HugeLogitTokenDominatesAtEveryTierEdge) {
  const int d = 128;
  const AttentionShape s{8, 2, d};
  const int g = s.q_heads / s.kv_heads;
  const int n_sink = 24, n_hist = 45, n_recent = 19;  // history ends in a partial block
  std::mt19937 rng(11);
  std::vector<float> key_sign(s.kv_heads * d), value_sign(s.kv_heads * d);
  for (float& x : key_sign) x = rng() % 2 ? 1.0f : -1.0f;
  for (float& x : value_sign) x = rng() % 2 ? 1.0f : -1.0f;
  std::vector<float> q(static_cast<size_t>(s.q_heads) * d);
  const std::vector<float> mag = GaussianValues(q.size(), 12);
  for (int j = 0; j < s.q_heads; ++j) {
    for (int i = 0; i < d; ++i) {
      q[j * d + i] = key_sign[(j / g) * d + i] * (0.5f + std::abs(mag[j * d + i]));
    }
  }
  const RowCodec int2 = MakeCodec(Config(QuantMethod::kUniform, 2, 0, ScaleDtype::kFp16), d);
  const size_t row = static_cast<size_t>(s.kv_heads) * d;

  for (int tier = 0; tier < 3; ++tier) {
    const int n = tier == 0 ? n_sink : (tier == 1 ? n_hist : n_recent);
    for (int hot : {0, n - 1}) {
      Rows tiers[3] = {MakeRows(n_sink, s, 100), MakeRows(n_hist, s, 200),
                       MakeRows(n_recent, s, 300)};
      Rows& t = tiers[tier];
      for (size_t i = 0; i < row; ++i) {
        t.kf[hot * row + i] = 30.0f * key_sign[i];
        t.vf[hot * row + i] = 5.0f * value_sign[i];
      }
      t.k = ToBf16(t.kf);
      t.v = ToBf16(t.vf);
      const PagedRows hist = Page(int2, s, tiers[1], n_hist);

      AttentionOutput acc = AttendBf16Rows(s, q, tiers[0].k, tiers[0].v, n_sink);
      MergeAttention(s, AttendBlocks(s, int2, hist.layout, hist.blocks, n_hist, q), &acc);
      MergeAttention(s, AttendBf16Rows(s, q, tiers[2].k, tiers[2].v, n_recent), &acc);

      // The value as the tier stores it (dequantized for the INT2 history).
      const float* want = tier == 1 ? &hist.v_deq[hot * row] : &t.vf[hot * row];
      for (int j = 0; j < s.q_heads; ++j) {
        const int h = j / g;
        double logit = 0.0;
        const float* k = tier == 1 ? &hist.k_deq[hot * row + h * d] : &t.kf[hot * row + h * d];
        for (int i = 0; i < d; ++i) logit += static_cast<double>(q[j * d + i]) * k[i];
        logit /= std::sqrt(static_cast<double>(d));
        EXPECT_NEAR(acc.lse[j], logit, 1e-3 * logit) << "tier " << tier << " hot " << hot;
        for (int i = 0; i < d; ++i) {
          ASSERT_NEAR(acc.out[j * d + i], want[h * d + i], 1e-3)
              << "tier " << tier << " hot " << hot << " head " << j << " dim " << i;
        }
      }
    }
  }
}

TEST(AttentionTest, BlocksIgnoreTokensPastTheEnd) {
  // A partial last block whose unused slots hold garbage must give the same result as a
  // sequence that really ends there.
  const AttentionShape s{4, 2, 64};
  const RowCodec codec = MakeCodec(Config(QuantMethod::kUniform, 2, 0, ScaleDtype::kFp16), 64);
  const Rows rows = MakeRows(32, s, 41);
  const PagedRows paged = Page(codec, s, rows, 32);
  const std::vector<float> q = GaussianValues(4 * 64, 42);
  const AttentionOutput got = AttendBlocks(s, codec, paged.layout, paged.blocks, 21, q);
  const AttentionOutput want = DenseAttentionReference(s, q, paged.k_deq, paged.v_deq, 21);
  ExpectClose(s, got, want, 1e-4, 1e-5, "21 of 32 tokens");
}

bool AllNaN(const AttentionOutput& r) {
  return !r.out.empty() && !r.lse.empty() &&
         std::all_of(r.out.begin(), r.out.end(), [](float x) { return std::isnan(x); }) &&
         std::all_of(r.lse.begin(), r.lse.end(), [](float x) { return std::isnan(x); });
}

// Mismatched shapes are programming errors: debug builds assert, release builds return NaN.
TEST(AttentionDeathTest, MismatchedShapesAssertOrReturnNaN) {
  const AttentionShape s{4, 2, 64};
  const Rows rows = MakeRows(8, s, 1);
  const std::vector<float> q = GaussianValues(4 * 64, 2);
  const std::vector<float> short_q(4 * 64 - 1, 0.0f);
  const RowCodec codec = MakeCodec(Config(QuantMethod::kUniform, 2, 0, ScaleDtype::kFp16), 64);
  const PagedRows paged = Page(codec, s, rows, 8);
  BlockLayout wrong_heads = paged.layout;
  wrong_heads.kv_heads = 1;

  AttentionOutput r;
  EXPECT_DEBUG_DEATH(r = AttendBf16Rows(s, short_q, rows.k, rows.v, 8), "shapes do not agree");
#ifdef NDEBUG
  EXPECT_TRUE(AllNaN(r));
#endif
  EXPECT_DEBUG_DEATH(r = AttendBf16Rows(s, q, rows.k, rows.v, 9), "shapes do not agree");
#ifdef NDEBUG
  EXPECT_TRUE(AllNaN(r));
#endif
  EXPECT_DEBUG_DEATH(r = AttendBf16Rows(AttentionShape{3, 2, 64}, q, rows.k, rows.v, 8),
                     "shapes do not agree");
  EXPECT_DEBUG_DEATH(r = AttendBlocks(s, codec, wrong_heads, paged.blocks, 8, q), "do not agree");
#ifdef NDEBUG
  EXPECT_TRUE(AllNaN(r));
#endif
  EXPECT_DEBUG_DEATH(r = AttendBlocks(s, codec, paged.layout, paged.blocks, 17, q),
                     "do not agree");  // needs 2 blocks, has 1
#ifdef NDEBUG
  EXPECT_TRUE(AllNaN(r));
#endif
  AttentionOutput acc;
  const AttentionOutput bad{{1.0f}, {0.0f}};
  EXPECT_DEBUG_DEATH(MergeAttention(s, bad, &acc), "do not match");
#ifdef NDEBUG
  EXPECT_TRUE(AllNaN(acc));
#endif
}

// Conformance with the OSCAR reference kernel's mixed-precision decode attention. The repository
// keeps one sequence and one KV head (with its query heads) of the reference's case; the file's
// metadata states the shape.
class OscarFixtureTest : public ::testing::Test {
 protected:
  static constexpr int kD = 128;

  void SetUp() override {
    const std::string path = OscarFixturesDir() + "/attention_d128.safetensors";
    absl::StatusOr<SafetensorsFile> f = SafetensorsFile::ReadFile(path);
    ASSERT_TRUE(f.ok()) << "fixture " << path << ": " << f.status();
    file_ = std::make_unique<SafetensorsFile>(*std::move(f));
    int d = 0;
    ASSERT_TRUE(MetaInt("B", &seqs_) && MetaInt("Hq", &hq_) && MetaInt("Hkv", &hkv_) &&
                MetaInt("D", &d) && MetaInt("bf16_tokens_per_seq", &bf16_tokens_) &&
                MetaInt("int2_tokens_per_seq", &int2_tokens_));
    ASSERT_EQ(d, kD);
    ASSERT_GE(seqs_, 1);
    ASSERT_TRUE(hkv_ >= 1 && hq_ % hkv_ == 0) << hq_ << " query heads, " << hkv_ << " KV heads";
  }

  bool MetaInt(const std::string& key, int* out) {
    const auto it = file_->metadata().find(key);
    const bool ok = it != file_->metadata().end() && absl::SimpleAtoi(it->second, out);
    EXPECT_TRUE(ok) << "metadata " << key;
    return ok;
  }

  std::vector<float> Floats(const std::string& name) {
    absl::StatusOr<std::vector<float>> v = file_->ReadFloat32(name);
    EXPECT_TRUE(v.ok()) << name << ": " << v.status();
    return v.ok() ? *std::move(v) : std::vector<float>();
  }

  std::unique_ptr<SafetensorsFile> file_;
  int seqs_ = 0, hq_ = 0, hkv_ = 0, bf16_tokens_ = 0, int2_tokens_ = 0;
};

TEST_F(OscarFixtureTest, MixedAttentionMatchesReference) {
  const AttentionShape s{hq_, hkv_, kD};
  const size_t row = static_cast<size_t>(hkv_) * kD;
  const std::vector<float> q = Floats("q_rotated_bf16");
  const std::vector<float> ref = Floats("output_rotated_bf16");
  const std::vector<float> bf16_k = Floats("bf16_tier_k");
  const std::vector<float> bf16_v = Floats("bf16_tier_v");
  const std::vector<float> src_k = Floats("int2_k_source_bf16");
  const std::vector<float> src_v = Floats("int2_v_source_bf16");
  const std::vector<float> sz_k = Floats("int2_k_scale_zero_f32");
  const std::vector<float> sz_v = Floats("int2_v_scale_zero_f32");
  const SafetensorsTensor* codes_k = file_->Find("int2_k_codes_planar");
  const SafetensorsTensor* codes_v = file_->Find("int2_v_codes_planar");
  ASSERT_NE(codes_k, nullptr);
  ASSERT_NE(codes_v, nullptr);
  ASSERT_EQ(q.size(), static_cast<size_t>(seqs_) * hq_ * kD);
  ASSERT_EQ(ref.size(), q.size());
  ASSERT_EQ(bf16_k.size(), seqs_ * bf16_tokens_ * row);
  ASSERT_EQ(src_k.size(), seqs_ * int2_tokens_ * row);
  ASSERT_EQ(sz_k.size(), seqs_ * int2_tokens_ * hkv_ * 2u);
  ASSERT_EQ(codes_k->bytes.size(), seqs_ * int2_tokens_ * hkv_ * (kD / 4u));

  // The reference's planar codes dequantized as (code - zero) * scale in fp32.
  auto dequant = [&](const SafetensorsTensor* codes, const std::vector<float>& sz) {
    std::vector<float> out(codes->bytes.size() * 4);
    std::vector<uint8_t> logical(kD);
    const auto* bytes = reinterpret_cast<const uint8_t*>(codes->bytes.data());
    for (size_t r = 0; r < sz.size() / 2; ++r) {
      UnpackPlanarQuarter(absl::MakeConstSpan(bytes + r * (kD / 4), kD / 4),
                          absl::MakeSpan(logical));
      for (int i = 0; i < kD; ++i) {
        out[r * kD + i] = (static_cast<float>(logical[i]) - sz[2 * r + 1]) * sz[2 * r];
      }
    }
    return out;
  };
  const std::vector<float> deq_k = dequant(codes_k, sz_k);
  const std::vector<float> deq_v = dequant(codes_v, sz_v);

  QuantConfig cfg;  // kvpool's own INT2: uniform, G = D, fp16 scale/min, clip 0.96 / 0.92
  cfg.block_tokens = 16;
  const RowCodec codec = MakeCodec(cfg, kD);

  double worst_ref_codes = 0.0, worst_ref_codes_bf16 = 0.0, worst_kvpool = 0.0, worst_exact = 0.0;
  for (int b = 0; b < seqs_; ++b) {
    const absl::Span<const float> qb(q.data() + b * hq_ * kD, hq_ * kD);
    const absl::Span<const float> want(ref.data() + b * hq_ * kD, hq_ * kD);
    auto slice = [&](const std::vector<float>& v, int tokens) {
      return std::vector<float>(v.begin() + b * tokens * row, v.begin() + (b + 1) * tokens * row);
    };
    Rows bf16_tier;
    bf16_tier.kf = slice(bf16_k, bf16_tokens_);
    bf16_tier.vf = slice(bf16_v, bf16_tokens_);
    bf16_tier.k = ToBf16(bf16_tier.kf);
    bf16_tier.v = ToBf16(bf16_tier.vf);
    const AttentionOutput bf16_part = AttendBf16Rows(s, qb, bf16_tier.k, bf16_tier.v, bf16_tokens_);

    // (1) The reference's own INT2 codes, dequantized in fp32, attended in float64.
    const std::vector<float> hk = slice(deq_k, int2_tokens_), hv = slice(deq_v, int2_tokens_);
    AttentionOutput acc = bf16_part;
    MergeAttention(s, DenseAttentionReference(s, qb, hk, hv, int2_tokens_), &acc);
    worst_ref_codes = std::max(worst_ref_codes, RelError(acc.out, want));

    // (2) The same codes dequantized then rounded to BF16 (as the reference kernel does),
    // attended by kvpool's fp32 kernel.
    acc = bf16_part;
    MergeAttention(s, AttendBf16Rows(s, qb, ToBf16(hk), ToBf16(hv), int2_tokens_), &acc);
    worst_ref_codes_bf16 = std::max(worst_ref_codes_bf16, RelError(acc.out, want));

    // (3) kvpool's codec on the reference's BF16 source rows, in paged blocks.
    Rows source;
    source.kf = slice(src_k, int2_tokens_);
    source.vf = slice(src_v, int2_tokens_);
    source.k = ToBf16(source.kf);
    source.v = ToBf16(source.vf);
    const PagedRows paged = Page(codec, s, source, int2_tokens_);
    acc = bf16_part;
    MergeAttention(s, AttendBlocks(s, codec, paged.layout, paged.blocks, int2_tokens_, qb), &acc);
    worst_kvpool = std::max(worst_kvpool, RelError(acc.out, want));

    // (4) The INT2 tier's BF16 source without clip or quantization: shows the tier matters.
    acc = bf16_part;
    MergeAttention(s, AttendBf16Rows(s, qb, source.k, source.v, int2_tokens_), &acc);
    worst_exact = std::max(worst_exact, RelError(acc.out, want));
  }
  std::printf(
      "OSCAR attention_d128 relative L2 error vs output_rotated_bf16 (worst of %d seqs):\n"
      "  reference codes, fp32 dequant, float64 attention: %.3e\n"
      "  reference codes, bf16 dequant, kvpool fp32 attention: %.3e\n"
      "  kvpool INT2 codec (uniform, fp16 meta, clip 0.96/0.92): %.3e\n"
      "  INT2-tier source without clip or quantization (sanity): %.3e\n",
      seqs_, worst_ref_codes, worst_ref_codes_bf16, worst_kvpool, worst_exact);
  RecordProperty("rel_err_reference_codes", std::to_string(worst_ref_codes));
  RecordProperty("rel_err_kvpool_codec", std::to_string(worst_kvpool));
  EXPECT_LT(worst_ref_codes, 1e-2);
  EXPECT_LT(worst_ref_codes_bf16, 1e-2);
  EXPECT_LT(worst_kvpool, 1e-2);
  // The comparison has teeth: without clip and quantization the INT2 tier's contribution is
  // far from the reference's (its source rows have outlier channels that clipping removes).
  EXPECT_GT(worst_exact, 10 * worst_kvpool);
}

}  // namespace
}  // namespace kvpool
