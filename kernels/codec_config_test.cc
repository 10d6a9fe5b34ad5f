#include "kernels/codec_config.h"

#include <cmath>
#include <limits>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvpool {
namespace {

using ::testing::HasSubstr;

// Expects InvalidArgument whose message names `field`.
void ExpectRejected(const QuantConfig& cfg, int head_dim, const std::string& field) {
  const absl::Status s = cfg.Validate(head_dim);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field << ": " << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(field));
}

TEST(CodecConfigTest, DefaultsAreOscarAndValidForEverySupportedHeadDim) {
  const QuantConfig cfg;
  EXPECT_EQ(cfg.bits, 2);
  EXPECT_EQ(cfg.method, QuantMethod::kUniform);
  EXPECT_EQ(cfg.scale_dtype, ScaleDtype::kFp16);
  EXPECT_FLOAT_EQ(cfg.ClipRatio(KvTensor::kKey), 0.96f);
  EXPECT_FLOAT_EQ(cfg.ClipRatio(KvTensor::kValue), 0.92f);
  for (int d : {32, 64, 128, 256}) {
    EXPECT_TRUE(cfg.Validate(d).ok()) << d;
    EXPECT_EQ(cfg.EffectiveGroupSize(d), d);
  }
}

TEST(CodecConfigTest, SupportedHeadDimsArePowersOfTwoFrom32To256) {
  for (int d : {32, 64, 128, 256}) EXPECT_TRUE(IsSupportedHeadDim(d)) << d;
  for (int d : {-128, 0, 1, 16, 48, 96, 100, 512}) {
    EXPECT_FALSE(IsSupportedHeadDim(d)) << d;
    ExpectRejected(QuantConfig(), d, "head_dim");
  }
}

TEST(CodecConfigTest, BitsMustBeTwoOrFour) {
  QuantConfig cfg;
  for (int bits : {2, 4}) {
    cfg.bits = bits;
    EXPECT_TRUE(cfg.Validate(128).ok());
    EXPECT_EQ(cfg.StoredBits(), bits);
  }
  for (int bits : {-2, 0, 1, 3, 8, 16}) {
    cfg.bits = bits;
    ExpectRejected(cfg, 128, "bits");
  }
  cfg.bits = 2;
  cfg.method = QuantMethod::kBypass;
  EXPECT_EQ(cfg.StoredBits(), 16);
}

TEST(CodecConfigTest, GroupSizeIsZeroOrAPowerOfTwoDividingHeadDim) {
  QuantConfig cfg;
  for (int g : {0, 8, 16, 32, 64, 128}) {
    cfg.group_size = g;
    EXPECT_TRUE(cfg.Validate(128).ok()) << g;
    EXPECT_EQ(cfg.EffectiveGroupSize(128), g == 0 ? 128 : g);
  }
  for (int g : {-8, 1, 2, 4, 12, 48, 256}) {
    cfg.group_size = g;
    ExpectRejected(cfg, 128, "group_size");
  }
  cfg.group_size = 64;
  ExpectRejected(cfg, 32, "group_size");
}

TEST(CodecConfigTest, LloydMaxNeedsInt2OneGroupAndClipping) {
  QuantConfig cfg;
  cfg.method = QuantMethod::kLloydMax;
  EXPECT_TRUE(cfg.Validate(128).ok());
  cfg.group_size = 128;
  EXPECT_TRUE(cfg.Validate(128).ok());
  cfg.group_size = 64;
  ExpectRejected(cfg, 128, "group_size");
  cfg.group_size = 0;
  cfg.bits = 4;
  ExpectRejected(cfg, 128, "bits");
  cfg.bits = 2;
  cfg.clip_ratio_k = 0.0f;
  ExpectRejected(cfg, 128, "clip_ratio");
  cfg.clip_ratio_k = 0.96f;
  cfg.clip_ratio_v = -1.0f;
  ExpectRejected(cfg, 128, "clip_ratio");
}

TEST(CodecConfigTest, ClipRatiosAreFiniteAndAtMostOne) {
  QuantConfig cfg;
  for (float r : {-1.0f, 0.0f, 0.5f, 0.92f, 1.0f}) {
    cfg.clip_ratio_k = r;
    cfg.clip_ratio_v = r;
    EXPECT_TRUE(cfg.Validate(128).ok()) << r;
  }
  for (float r : {1.0001f, 2.0f, std::numeric_limits<float>::infinity(),
                  -std::numeric_limits<float>::infinity(), std::nanf("")}) {
    cfg = QuantConfig();
    cfg.clip_ratio_k = r;
    ExpectRejected(cfg, 128, "clip_ratio_k");
    cfg = QuantConfig();
    cfg.clip_ratio_v = r;
    ExpectRejected(cfg, 128, "clip_ratio_v");
  }
}

TEST(CodecConfigTest, BlockTokensArePowersOfTwoFrom8To1024) {
  QuantConfig cfg;
  cfg.demotion_batch = 8;
  for (int t : {8, 16, 64, 1024}) {
    cfg.block_tokens = t;
    EXPECT_TRUE(cfg.Validate(128).ok()) << t;
  }
  for (int t : {-16, 0, 4, 12, 24, 2048}) {
    cfg.block_tokens = t;
    ExpectRejected(cfg, 128, "block_tokens");
  }
}

TEST(CodecConfigTest, SinkAndRecentAreBoundedMultiplesOfEight) {
  QuantConfig cfg;
  for (int n : {0, 8, 64, 4096, 8192}) {
    cfg.sink_tokens = n;
    cfg.recent_tokens = n;
    EXPECT_TRUE(cfg.Validate(128).ok()) << n;
  }
  for (int n : {-8, 1, 7, 12, 8200, 1 << 30}) {
    cfg = QuantConfig();
    cfg.sink_tokens = n;
    ExpectRejected(cfg, 128, "sink_tokens");
    cfg = QuantConfig();
    cfg.recent_tokens = n;
    ExpectRejected(cfg, 128, "recent_tokens");
  }
}

TEST(CodecConfigTest, DemotionBatchDividesBlockTokens) {
  QuantConfig cfg;
  cfg.block_tokens = 16;
  for (int b : {1, 2, 8, 16}) {
    cfg.demotion_batch = b;
    EXPECT_TRUE(cfg.Validate(128).ok()) << b;
  }
  for (int b : {-16, 0, 3, 32}) {
    cfg.demotion_batch = b;
    ExpectRejected(cfg, 128, "demotion_batch");
  }
}

TEST(CodecConfigTest, RejectsOutOfRangeEnums) {
  QuantConfig cfg;
  cfg.method = static_cast<QuantMethod>(7);
  ExpectRejected(cfg, 128, "method");
  cfg = QuantConfig();
  cfg.scale_dtype = static_cast<ScaleDtype>(9);
  ExpectRejected(cfg, 128, "scale_dtype");
}

TEST(CodecConfigTest, ClipRatioPicksTheTensor) {
  QuantConfig cfg;
  cfg.clip_ratio_k = 0.5f;
  cfg.clip_ratio_v = 0.25f;
  EXPECT_EQ(cfg.ClipRatio(KvTensor::kKey), 0.5f);
  EXPECT_EQ(cfg.ClipRatio(KvTensor::kValue), 0.25f);
}

TEST(CodecConfigTest, NamesRoundTrip) {
  for (QuantMethod m : {QuantMethod::kUniform, QuantMethod::kLloydMax, QuantMethod::kBypass}) {
    absl::StatusOr<QuantMethod> parsed = ParseQuantMethod(QuantMethodName(m));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, m);
  }
  for (ScaleDtype d : {ScaleDtype::kFp16, ScaleDtype::kBf16}) {
    absl::StatusOr<ScaleDtype> parsed = ParseScaleDtype(ScaleDtypeName(d));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, d);
  }
  EXPECT_EQ(QuantMethodName(QuantMethod::kUniform), "uniform");
  EXPECT_EQ(QuantMethodName(QuantMethod::kLloydMax), "lloyd_max");
  EXPECT_EQ(QuantMethodName(QuantMethod::kBypass), "bypass");
  EXPECT_EQ(ScaleDtypeName(ScaleDtype::kFp16), "fp16");
  EXPECT_EQ(ScaleDtypeName(ScaleDtype::kBf16), "bf16");
}

TEST(CodecConfigTest, ParseRejectsUnknownNames) {
  for (const char* name : {"", "Uniform", "lloydmax", "int2", "fp32"}) {
    EXPECT_EQ(ParseQuantMethod(name).status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_EQ(ParseScaleDtype(name).status().code(), absl::StatusCode::kInvalidArgument) << name;
  }
}

}  // namespace
}  // namespace kvpool
