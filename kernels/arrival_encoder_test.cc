#include "kernels/arrival_encoder.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/support/test_data.h"

namespace kvpool {
namespace {

using ::kvpool::testing::GaussianValues;
using ::kvpool::testing::RealLikeRows;
using ::kvpool::testing::ToBf16;

// A dense random orthogonal matrix: the product of a few Householder reflections
// I - 2 v v^T / (v^T v) of Gaussian vectors, in float64, rounded once to float.
std::vector<float> HouseholderOrthogonal(int d, uint64_t seed) {
  std::vector<double> m(static_cast<size_t>(d) * d, 0.0);
  for (int i = 0; i < d; ++i) m[static_cast<size_t>(i) * d + i] = 1.0;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> v(d), mv(d);
  for (int reflection = 0; reflection < 4; ++reflection) {
    double vv = 0.0;
    for (double& x : v) {
      x = normal(rng);
      vv += x * x;
    }
    // m <- m (I - 2 v v^T / vv)
    for (int r = 0; r < d; ++r) {
      double dot = 0.0;
      for (int k = 0; k < d; ++k) dot += m[static_cast<size_t>(r) * d + k] * v[k];
      for (int k = 0; k < d; ++k) m[static_cast<size_t>(r) * d + k] -= 2.0 * dot / vv * v[k];
    }
  }
  return std::vector<float>(m.begin(), m.end());
}

std::vector<RotationSet> AllRotationKinds(int d) {
  std::vector<RotationSet> sets;
  sets.push_back(*RotationSet::Identity(3, d));
  sets.push_back(*RotationSet::Hadamard(3, d));
  sets.push_back(*RotationSet::RandomizedHadamard(3, d, 0x5eed5eedull));
  std::vector<std::vector<float>> k, v;
  for (int layer = 0; layer < 3; ++layer) {
    k.push_back(HouseholderOrthogonal(d, 11 + 2 * layer));
    v.push_back(HouseholderOrthogonal(d, 12 + 2 * layer));
  }
  absl::StatusOr<RotationSet> dense = RotationSet::Dense(3, d, std::move(k), std::move(v));
  EXPECT_TRUE(dense.ok()) << dense.status();
  sets.push_back(*std::move(dense));
  return sets;
}

struct CodecCase {
  std::string name;
  QuantConfig cfg;
};

std::vector<CodecCase> CodecCases() {
  std::vector<CodecCase> cases;
  QuantConfig int2;  // the OSCAR default: INT2 uniform, G = D, fp16 scale/min
  cases.push_back({"int2", int2});
  QuantConfig int2_g32 = int2;
  int2_g32.group_size = 32;
  cases.push_back({"int2_g32", int2_g32});
  QuantConfig int4 = int2;
  int4.bits = 4;
  cases.push_back({"int4", int4});
  QuantConfig int4_bf16 = int4;
  int4_bf16.group_size = 16;
  int4_bf16.scale_dtype = ScaleDtype::kBf16;
  cases.push_back({"int4_g16_bf16", int4_bf16});
  QuantConfig lloyd = int2;
  lloyd.method = QuantMethod::kLloydMax;
  cases.push_back({"lloyd_max", lloyd});
  QuantConfig noclip = int2;
  noclip.clip_ratio_k = 0.0f;
  noclip.clip_ratio_v = 1.0f;
  cases.push_back({"int2_noclip", noclip});
  QuantConfig bypass = int2;
  bypass.method = QuantMethod::kBypass;
  cases.push_back({"bypass", bypass});
  return cases;
}

// `tokens` x `heads` unrotated rows of one of several shapes.
std::vector<Bf16> InputRows(int tokens, int heads, int d, int shape, uint64_t seed) {
  const int n = tokens * heads;
  std::vector<float> x;
  std::mt19937_64 rng(seed);
  switch (shape) {
    case 0:  // real-like: Gaussian with a few outlier channels and row offsets
      x = RealLikeRows(n, d, seed);
      break;
    case 1:  // Gaussian of a random scale per call
      x = GaussianValues(static_cast<size_t>(n) * d, seed,
                         std::pow(10.0f, static_cast<float>(seed % 5) - 3.0f));
      break;
    case 2: {  // outlier-heavy: large spikes on some dims, exact zeros, ties, tiny values
      x = RealLikeRows(n, d, seed);
      for (size_t i = 0; i < x.size(); ++i) {
        const uint64_t u = rng() % 16;
        if (u == 0) x[i] = (rng() % 2 ? 1.0f : -1.0f) * static_cast<float>(100 + rng() % 300);
        if (u == 1) x[i] = 0.0f;
        if (u == 2) x[i] = -0.0f;
        if (u == 3) x[i] = 0.5f;
        if (u == 4) x[i] *= 1e-30f;
      }
      break;
    }
    default: {  // constant rows and rows with one nonzero
      x.assign(static_cast<size_t>(n) * d, 0.0f);
      for (int r = 0; r < n; ++r) {
        float* row = &x[static_cast<size_t>(r) * d];
        if (r % 2 == 0) {
          for (int j = 0; j < d; ++j) row[j] = 1.25f;
        } else {
          row[rng() % d] = -3.0f;
        }
      }
      break;
    }
  }
  return ToBf16(x);
}

std::vector<uint8_t> RandomBlock(const BlockLayout& layout, uint64_t seed) {
  std::vector<uint8_t> b(layout.block_bytes());
  std::mt19937_64 rng(seed);
  for (uint8_t& x : b) x = static_cast<uint8_t>(rng());
  return b;
}

// The two-step path the encoder must reproduce.
absl::Status TwoStep(const RotationSet& rot, const RowCodec& codec, int layer, KvTensor t,
                     const BlockLayout& layout, absl::Span<const Bf16> rows, int first_token,
                     uint8_t* block) {
  std::vector<Bf16> rotated(rows.size());
  if (absl::Status s = rot.RotateBf16(layer, t, rows, absl::MakeSpan(rotated)); !s.ok()) return s;
  return codec.EncodeIntoBlock(t, layout, rotated, first_token, block);
}

// Runs both paths on copies of one block; expects the same status code and the same bytes.
void ExpectSameAsTwoStep(const ArrivalEncoder& enc, int layer, KvTensor t,
                         const BlockLayout& layout, absl::Span<const Bf16> rows, int first_token,
                         uint64_t block_seed, absl::StatusCode want = absl::StatusCode::kOk) {
  const std::vector<uint8_t> before = RandomBlock(layout, block_seed);
  std::vector<uint8_t> two = before, fused = before;
  const absl::Status s2 =
      TwoStep(enc.rotations(), enc.codec(), layer, t, layout, rows, first_token, two.data());
  const absl::Status sf = enc.EncodeIntoBlock(layer, t, layout, rows, first_token, fused.data());
  ASSERT_EQ(s2.code(), want) << s2;
  ASSERT_EQ(sf.code(), s2.code()) << "fused: " << sf << " two-step: " << s2;
  if (!sf.ok()) {
    ASSERT_TRUE(fused == before) << "an error must leave the block unchanged";
  }
  ASSERT_EQ(fused.size(), two.size());
  for (size_t i = 0; i < fused.size(); ++i) {
    ASSERT_EQ(fused[i], two[i]) << "byte " << i << " of " << fused.size();
  }
}

TEST(ArrivalEncoderTest, MatchesRotateThenEncodeBitForBit) {
  for (int d : {32, 64, 128, 256}) {
    const std::vector<RotationSet> kinds = AllRotationKinds(d);
    for (const CodecCase& cc : CodecCases()) {
      if (cc.cfg.group_size > d) continue;
      const RowCodec codec = *RowCodec::Create(cc.cfg, d);
      for (const RotationSet& rot : kinds) {
        const ArrivalEncoder enc = *ArrivalEncoder::Create(&rot, codec);
        // (heads, block tokens, first token, count): whole blocks, partial ranges, and calls of
        // more rows than one rotation chunk (16 x 64 = 1024 > 512).
        const int shapes[][4] = {{8, 16, 0, 16}, {1, 8, 3, 1}, {3, 16, 5, 7}, {16, 64, 0, 64}};
        for (const auto& sh : shapes) {
          QuantConfig block_cfg = cc.cfg;
          block_cfg.block_tokens = sh[1];
          const BlockLayout layout = BlockLayout::ForModel(block_cfg, sh[0], d);
          for (int shape = 0; shape < 4; ++shape) {
            for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
              SCOPED_TRACE(absl::StrCat("D=", d, " ", cc.name, " ", RotationKindName(rot.kind()),
                                        " heads=", sh[0], " tokens=", sh[1], " first=", sh[2],
                                        " count=", sh[3], " shape=", shape,
                                        " t=", static_cast<int>(t)));
              const std::vector<Bf16> rows =
                  InputRows(sh[3], sh[0], d, shape, 1000 * d + 10 * shape + sh[0]);
              ExpectSameAsTwoStep(enc, /*layer=*/2, t, layout, rows, sh[2], 77 + shape);
            }
          }
        }
      }
    }
  }
}

TEST(ArrivalEncoderTest, IdentityStoresTheInputBitsUnderBypass) {
  QuantConfig cfg;
  cfg.method = QuantMethod::kBypass;
  const RowCodec codec = *RowCodec::Create(cfg, 64);
  const RotationSet id = *RotationSet::Identity(1, 64);
  const ArrivalEncoder enc = *ArrivalEncoder::Create(&id, codec);
  const BlockLayout layout = BlockLayout::ForModel(cfg, 2, 64);
  std::vector<Bf16> rows = InputRows(layout.tokens, 2, 64, 2, 5);
  rows[3] = Bf16::FromBits(0x8000);  // -0 must survive (a product with I would give +0)
  rows[4] = Bf16::FromBits(0x0001);  // and the smallest subnormal
  std::vector<uint8_t> block(layout.block_bytes(), 0xab);
  ASSERT_TRUE(enc.EncodeIntoBlock(0, KvTensor::kValue, layout, rows, 0, block.data()).ok());
  for (int tok = 0; tok < layout.tokens; ++tok) {
    for (int h = 0; h < 2; ++h) {
      const uint8_t* stored = block.data() + layout.CodesOffset(KvTensor::kValue, h) +
                              tok * layout.code_bytes_per_row();
      ASSERT_EQ(std::memcmp(stored, &rows[(static_cast<size_t>(tok) * 2 + h) * 64], 128), 0)
          << tok << " " << h;
    }
  }
}

TEST(ArrivalEncoderTest, ErrorsMatchTheTwoStepPathAndLeaveTheBlockUnchanged) {
  const int d = 128;
  for (const CodecCase& cc : CodecCases()) {
    const RowCodec codec = *RowCodec::Create(cc.cfg, d);
    for (const RotationSet& rot : AllRotationKinds(d)) {
      SCOPED_TRACE(absl::StrCat(cc.name, " ", RotationKindName(rot.kind())));
      const ArrivalEncoder enc = *ArrivalEncoder::Create(&rot, codec);
      const BlockLayout layout = BlockLayout::ForModel(cc.cfg, 4, d);
      const std::vector<Bf16> good = InputRows(layout.tokens, 4, d, 0, 3);

      // NaN and Inf anywhere, even in the last row: InvalidArgument.
      for (float bad :
           {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
        std::vector<Bf16> rows = good;
        rows[rows.size() - 5] = Bf16::FromFloat(bad);
        ExpectSameAsTwoStep(enc, 1, KvTensor::kKey, layout, rows, 0, 9,
                            absl::StatusCode::kInvalidArgument);
      }
      // Values outside kvpool's range after rotation (a Gaussian row of scale 1e5 keeps values
      // of magnitude >= 2^16 in every basis): OutOfRange for every format, and the rows before
      // it are not written either.
      {
        std::vector<Bf16> rows = good;
        const std::vector<float> big = GaussianValues(d, 4, 1e5f);
        for (int j = 0; j < d; ++j) rows[static_cast<size_t>(40) * d + j] = Bf16::FromFloat(big[j]);
        ExpectSameAsTwoStep(enc, 1, KvTensor::kValue, layout, rows, 0, 10,
                            absl::StatusCode::kOutOfRange);
      }
      // Large but fine values (above the codec's in-place bound of 8192 after rotation).
      {
        std::vector<Bf16> rows = good;
        rows[7] = Bf16::FromFloat(2000.0f);
        ExpectSameAsTwoStep(enc, 0, KvTensor::kKey, layout, rows, 0, 11);
      }
      // A rotated value that overflows BF16 itself: InvalidArgument from the rotation (identity
      // copies the bits, and the codec decides).
      {
        std::vector<Bf16> rows = good;
        for (int j = 0; j < d; ++j) rows[static_cast<size_t>(9) * d + j] = Bf16::FromFloat(3e38f);
        std::vector<uint8_t> scratch = RandomBlock(layout, 12);
        const absl::Status s2 =
            TwoStep(rot, codec, 2, KvTensor::kKey, layout, rows, 0, scratch.data());
        if (rot.kind() == RotationKind::kHadamard ||
            rot.kind() == RotationKind::kRandomizedHadamard) {
          EXPECT_EQ(s2.code(), absl::StatusCode::kInvalidArgument) << s2;
        }
        ExpectSameAsTwoStep(enc, 2, KvTensor::kKey, layout, rows, 0, 12, s2.code());
      }
      // Bad arguments: InvalidArgument, nothing written.
      ExpectSameAsTwoStep(enc, 3, KvTensor::kKey, layout, good, 0, 13,
                          absl::StatusCode::kInvalidArgument);  // layer out of range
      ExpectSameAsTwoStep(enc, 0, KvTensor::kKey, layout,
                          absl::MakeConstSpan(good).subspan(0, good.size() - d), 0, 14,
                          absl::StatusCode::kInvalidArgument);  // not whole tokens
      ExpectSameAsTwoStep(enc, 0, KvTensor::kKey, layout, good, 1, 15,
                          absl::StatusCode::kInvalidArgument);  // does not fit the block
    }
  }
}

TEST(ArrivalEncoderTest, CreateChecksTheHeadDim) {
  const RowCodec codec = *RowCodec::Create(QuantConfig{}, 128);
  const RotationSet rot = *RotationSet::Hadamard(1, 64);
  EXPECT_EQ(ArrivalEncoder::Create(&rot, codec).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ArrivalEncoder::Create(nullptr, codec).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvpool
