#include "kernels/codec_version.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/block_layout.h"
#include "kernels/rotation_file.h"

namespace kvpool {
namespace {

ModelCodec MakeModel(RotationSet rotations) {
  return ModelCodec{"test-model", std::move(rotations), QuantConfig{}, false, "", {}, {}};
}

// A dense set built from the randomized Hadamard matrices (exactly orthogonal in float).
RotationSet DenseFromRandomizedHadamard(int layers, int d, uint64_t seed) {
  const RotationSet rh = *RotationSet::RandomizedHadamard(layers, d, seed);
  std::vector<std::vector<float>> k, v;
  for (int l = 0; l < layers; ++l) {
    k.push_back(rh.Matrix(l, KvTensor::kKey));
    v.push_back(rh.Matrix(l, KvTensor::kValue));
  }
  return *RotationSet::Dense(layers, d, std::move(k), std::move(v));
}

void AppendU32(uint32_t v, std::string* s) {
  for (int i = 0; i < 4; ++i) s->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

TEST(CodecVersionTest, Sha256KnownAnswers) {
  EXPECT_EQ(ToHex(Sha256("", 0)),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(ToHex(Sha256("abc", 3)),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  const std::string million(1000000, 'a');
  EXPECT_EQ(ToHex(Sha256(million.data(), million.size())),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(CodecVersionTest, HashesTheCanonicalFieldsInBannerOrder) {
  // Rebuild the canonical byte string by hand from codec_version.h's banner.
  ModelCodec m = MakeModel(DenseFromRandomizedHadamard(2, 32, 5));
  m.quant.bits = 4;
  m.quant.group_size = 16;
  m.quant.method = QuantMethod::kUniform;
  m.quant.scale_dtype = ScaleDtype::kBf16;
  m.quant.clip_ratio_k = 0.9f;
  m.quant.clip_ratio_v = 0.875f;
  m.quant.block_tokens = 32;
  m.v_prerotated = true;

  std::string s("kvpool-codec", 12);
  s.push_back('\0');
  AppendU32(kBlockFormatVersion, &s);
  AppendU32(2, &s);   // num_layers
  AppendU32(32, &s);  // head_dim
  AppendU32(static_cast<uint32_t>(RotationKind::kDense), &s);
  AppendU32(0, &s);  // u64 seed, low then high half: 0 for dense
  AppendU32(0, &s);
  AppendU32(4, &s);   // bits
  AppendU32(16, &s);  // effective group size
  AppendU32(static_cast<uint32_t>(QuantMethod::kUniform), &s);
  AppendU32(static_cast<uint32_t>(ScaleDtype::kBf16), &s);
  for (float f : {0.9f, 0.875f}) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    AppendU32(u, &s);
  }
  AppendU32(32, &s);  // block_tokens
  AppendU32(1, &s);   // v_prerotated
  for (int l = 0; l < 2; ++l) {
    for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
      for (float f : m.rotations.Matrix(l, t)) {
        uint32_t u;
        std::memcpy(&u, &f, 4);
        AppendU32(u, &s);
      }
    }
  }
  EXPECT_EQ(ComputeCodecVersion(m), Sha256(s.data(), s.size()));
  EXPECT_EQ(CodecVersionHex(m), ToHex(Sha256(s.data(), s.size())));
  EXPECT_EQ(CodecVersionHex(m).size(), 64u);
}

TEST(CodecVersionTest, RandomizedHadamardHashesItsSeedButNoMatrices) {
  ModelCodec m = MakeModel(*RotationSet::RandomizedHadamard(3, 64, 0x0123456789abcdefull));
  std::string s("kvpool-codec", 13);
  AppendU32(kBlockFormatVersion, &s);
  AppendU32(3, &s);
  AppendU32(64, &s);
  AppendU32(static_cast<uint32_t>(RotationKind::kRandomizedHadamard), &s);
  AppendU32(0x89abcdefu, &s);
  AppendU32(0x01234567u, &s);
  AppendU32(2, &s);
  AppendU32(64, &s);  // group_size 0 means D
  AppendU32(0, &s);
  AppendU32(0, &s);
  for (float f : {0.96f, 0.92f}) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    AppendU32(u, &s);
  }
  AppendU32(16, &s);
  AppendU32(0, &s);
  EXPECT_EQ(ComputeCodecVersion(m), Sha256(s.data(), s.size()));
}

// Every setting that changes the codes changes the version; the rest do not.
TEST(CodecVersionTest, ChangesExactlyWithCodeAffectingSettings) {
  const ModelCodec base = MakeModel(DenseFromRandomizedHadamard(2, 64, 9));
  const CodecVersion v0 = ComputeCodecVersion(base);

  auto version_after = [&](const std::function<void(ModelCodec&)>& change) {
    ModelCodec m = base;
    change(m);
    return ComputeCodecVersion(m);
  };

  EXPECT_NE(v0, version_after([](ModelCodec& m) { m.quant.bits = 4; }));
  EXPECT_NE(v0, version_after([](ModelCodec& m) { m.quant.group_size = 32; }));
  EXPECT_NE(v0, version_after([](ModelCodec& m) { m.quant.method = QuantMethod::kLloydMax; }));
  EXPECT_NE(v0, version_after([](ModelCodec& m) { m.quant.method = QuantMethod::kBypass; }));
  EXPECT_NE(v0, version_after([](ModelCodec& m) { m.quant.scale_dtype = ScaleDtype::kBf16; }));
  EXPECT_NE(v0, version_after([](ModelCodec& m) { m.quant.clip_ratio_k = 0.95f; }));
  EXPECT_NE(v0, version_after([](ModelCodec& m) {
              m.quant.clip_ratio_v = std::nextafter(0.92f, 1.0f);  // one ulp
            }));
  EXPECT_NE(v0, version_after([](ModelCodec& m) { m.quant.block_tokens = 32; }));
  EXPECT_NE(v0, version_after([](ModelCodec& m) { m.v_prerotated = true; }));
  // Swapping K and V matrices, or perturbing one entry by an ulp, changes it.
  EXPECT_NE(v0, version_after([](ModelCodec& m) {
              std::vector<std::vector<float>> k, v;
              for (int l = 0; l < 2; ++l) {
                k.push_back(m.rotations.Matrix(l, KvTensor::kValue));
                v.push_back(m.rotations.Matrix(l, KvTensor::kKey));
              }
              m.rotations = *RotationSet::Dense(2, 64, std::move(k), std::move(v));
            }));
  EXPECT_NE(v0, version_after([](ModelCodec& m) {
              std::vector<std::vector<float>> k, v;
              for (int l = 0; l < 2; ++l) {
                k.push_back(m.rotations.Matrix(l, KvTensor::kKey));
                v.push_back(m.rotations.Matrix(l, KvTensor::kValue));
              }
              v[1][77] = std::nextafter(v[1][77], 2.0f);
              m.rotations = *RotationSet::Dense(2, 64, std::move(k), std::move(v));
            }));

  // Not part of the version: which tokens are quantized, names and calibration statistics.
  EXPECT_EQ(v0, version_after([](ModelCodec& m) { m.quant.sink_tokens = 32; }));
  EXPECT_EQ(v0, version_after([](ModelCodec& m) { m.quant.recent_tokens = 128; }));
  EXPECT_EQ(v0, version_after([](ModelCodec& m) { m.quant.demotion_batch = 8; }));
  EXPECT_EQ(v0, version_after([](ModelCodec& m) { m.model_id = "other"; }));
  EXPECT_EQ(v0, version_after([](ModelCodec& m) { m.objective = "qqt_r_h_pbr"; }));
  EXPECT_EQ(v0, version_after([](ModelCodec& m) {
              m.k_eigenvalues.assign(2, std::vector<float>(64, 1.0f));
            }));
  // group_size 0 is G = D: the same codes, the same version.
  EXPECT_EQ(v0, version_after([](ModelCodec& m) { m.quant.group_size = 64; }));
}

TEST(CodecVersionTest, DistinguishesRotationKindsShapesAndSeeds) {
  std::vector<CodecVersion> seen;
  for (int d : {32, 64}) {
    for (int layers : {1, 2}) {
      seen.push_back(ComputeCodecVersion(MakeModel(*RotationSet::Identity(layers, d))));
      seen.push_back(ComputeCodecVersion(MakeModel(*RotationSet::Hadamard(layers, d))));
      seen.push_back(
          ComputeCodecVersion(MakeModel(*RotationSet::RandomizedHadamard(layers, d, 1))));
      seen.push_back(
          ComputeCodecVersion(MakeModel(*RotationSet::RandomizedHadamard(layers, d, 2))));
      // Dense equal in value to the randomized Hadamard: still its own codec.
      seen.push_back(ComputeCodecVersion(MakeModel(DenseFromRandomizedHadamard(layers, d, 1))));
    }
  }
  for (size_t i = 0; i < seen.size(); ++i) {
    for (size_t j = i + 1; j < seen.size(); ++j) EXPECT_NE(seen[i], seen[j]) << i << " " << j;
  }
  // Deterministic.
  EXPECT_EQ(ComputeCodecVersion(MakeModel(*RotationSet::RandomizedHadamard(2, 64, 1))),
            ComputeCodecVersion(MakeModel(*RotationSet::RandomizedHadamard(2, 64, 1))));
}

}  // namespace
}  // namespace kvpool
