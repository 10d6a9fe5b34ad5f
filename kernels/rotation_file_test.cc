#include "kernels/rotation_file.h"

#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/codec_version.h"
#include "kernels/safetensors.h"

namespace kvpool {
namespace {

using ::testing::HasSubstr;

RotationSet DenseFromRandomizedHadamard(int layers, int d, uint64_t seed) {
  const RotationSet rh = *RotationSet::RandomizedHadamard(layers, d, seed);
  std::vector<std::vector<float>> k, v;
  for (int l = 0; l < layers; ++l) {
    k.push_back(rh.Matrix(l, KvTensor::kKey));
    v.push_back(rh.Matrix(l, KvTensor::kValue));
  }
  return *RotationSet::Dense(layers, d, std::move(k), std::move(v));
}

// A dense model with every field set away from its default.
ModelCodec DenseModel() {
  ModelCodec m{"smollm2-135m",
               DenseFromRandomizedHadamard(3, 64, 11),
               QuantConfig{},
               true,
               "qqt_r_h_pbr/sst_r_h_pbr",
               {},
               {}};
  m.quant.bits = 4;
  m.quant.group_size = 32;
  m.quant.scale_dtype = ScaleDtype::kBf16;
  m.quant.clip_ratio_k = 0.97f;
  m.quant.clip_ratio_v = 0.1f + 0.2f;  // not exactly representable in short decimal form
  m.quant.block_tokens = 32;
  m.quant.sink_tokens = 32;
  m.quant.recent_tokens = 128;
  m.quant.demotion_batch = 8;
  for (int l = 0; l < 3; ++l) {
    std::vector<float> ke(64), ve(64);
    for (int i = 0; i < 64; ++i) {
      ke[i] = std::ldexp(1.0f + i, l) / 3.0f;
      ve[i] = 0.01f * static_cast<float>(i * i) + 1e-7f;
    }
    m.k_eigenvalues.push_back(ke);
    m.v_eigenvalues.push_back(ve);
  }
  return m;
}

std::vector<ModelCodec> AllKindModels() {
  std::vector<ModelCodec> models;
  models.push_back(DenseModel());
  models.push_back(
      ModelCodec{"id", *RotationSet::Identity(2, 128), QuantConfig{}, false, "", {}, {}});
  models.push_back(
      ModelCodec{"h", *RotationSet::Hadamard(4, 32), QuantConfig{}, false, "hadamard", {}, {}});
  models.push_back(ModelCodec{
      "rh", *RotationSet::RandomizedHadamard(5, 256, ~0ull - 5), QuantConfig{}, false, "", {}, {}});
  return models;
}

void ExpectSameModel(const ModelCodec& a, const ModelCodec& b) {
  EXPECT_EQ(a.model_id, b.model_id);
  EXPECT_EQ(a.rotations.kind(), b.rotations.kind());
  EXPECT_EQ(a.rotations.num_layers(), b.rotations.num_layers());
  EXPECT_EQ(a.rotations.head_dim(), b.rotations.head_dim());
  EXPECT_EQ(a.rotations.seed(), b.rotations.seed());
  for (int l = 0; l < a.rotations.num_layers(); ++l) {
    for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
      EXPECT_EQ(a.rotations.Matrix(l, t), b.rotations.Matrix(l, t)) << l;
    }
  }
  EXPECT_EQ(a.quant.bits, b.quant.bits);
  EXPECT_EQ(a.quant.group_size, b.quant.group_size);
  EXPECT_EQ(a.quant.method, b.quant.method);
  EXPECT_EQ(a.quant.scale_dtype, b.quant.scale_dtype);
  EXPECT_EQ(a.quant.clip_ratio_k, b.quant.clip_ratio_k);  // bit exact through the decimal
  EXPECT_EQ(a.quant.clip_ratio_v, b.quant.clip_ratio_v);
  EXPECT_EQ(a.quant.block_tokens, b.quant.block_tokens);
  EXPECT_EQ(a.quant.sink_tokens, b.quant.sink_tokens);
  EXPECT_EQ(a.quant.recent_tokens, b.quant.recent_tokens);
  EXPECT_EQ(a.quant.demotion_batch, b.quant.demotion_batch);
  EXPECT_EQ(a.v_prerotated, b.v_prerotated);
  EXPECT_EQ(a.objective, b.objective);
  EXPECT_EQ(a.k_eigenvalues, b.k_eigenvalues);
  EXPECT_EQ(a.v_eigenvalues, b.v_eigenvalues);
  EXPECT_EQ(ComputeCodecVersion(a), ComputeCodecVersion(b));
}

TEST(RotationFileTest, RoundTripPreservesEverything) {
  for (const ModelCodec& m : AllKindModels()) {
    SCOPED_TRACE(m.model_id);
    const std::string bytes = SerializeRotationFile(m);
    absl::StatusOr<ModelCodec> back = ParseRotationFile(bytes);
    ASSERT_TRUE(back.ok()) << back.status();
    ExpectSameModel(m, *back);
    // Re-serializing gives the same bytes, so the same version.
    EXPECT_EQ(SerializeRotationFile(*back), bytes);

    const SafetensorsFile f = *SafetensorsFile::Parse(bytes);
    EXPECT_EQ(f.metadata().at("codec_version"), CodecVersionHex(m));
    EXPECT_EQ(f.metadata().at("format"), "kvpool-rotation");
    EXPECT_EQ(f.metadata().at("format_version"), "1");
    EXPECT_EQ(f.metadata().at("rotation_kind"), RotationKindName(m.rotations.kind()));
    EXPECT_EQ(f.metadata().count("hadamard_seed"),
              m.rotations.kind() == RotationKind::kRandomizedHadamard ? 1u : 0u);
    if (m.rotations.kind() != RotationKind::kDense) {
      EXPECT_TRUE(f.tensors().empty()) << "data-free kinds store no matrices";
    }
  }
}

TEST(RotationFileTest, DenseFileLayout) {
  const ModelCodec m = DenseModel();
  const SafetensorsFile f = *SafetensorsFile::Parse(SerializeRotationFile(m));
  EXPECT_EQ(f.tensors().size(), 3u * 4u);
  const SafetensorsTensor* t = f.Find("layers.2.v_rotation");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype, SafetensorsDtype::kF32);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{64, 64}));
  EXPECT_EQ(*f.ReadFloat32("layers.2.v_rotation"), m.rotations.Matrix(2, KvTensor::kValue));
  EXPECT_EQ(*f.ReadFloat32("layers.1.k_eigenvalues"), m.k_eigenvalues[1]);
  EXPECT_EQ(f.metadata().at("v_prerotated"), "true");
  EXPECT_EQ(f.metadata().at("clip_ratio_k"), "0.97");
  EXPECT_EQ(f.metadata().at("quantizer"), "uniform");
  EXPECT_EQ(f.metadata().at("scale_dtype"), "bf16");
  EXPECT_EQ(f.metadata().at("sink_tokens"), "32");
}

TEST(RotationFileTest, FileRoundTripAndMissingFile) {
  const ModelCodec m = DenseModel();
  const std::string path = ::testing::TempDir() + "/rotation_file_test.safetensors";
  ASSERT_TRUE(WriteRotationFile(m, path).ok());
  absl::StatusOr<ModelCodec> back = ReadRotationFile(path);
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSameModel(m, *back);
  std::remove(path.c_str());
  EXPECT_EQ(ReadRotationFile(path).status().code(), absl::StatusCode::kNotFound);
}

// Rebuilds `bytes` with edits to the metadata and tensors, to make malformed files.
struct Edit {
  std::function<void(std::map<std::string, std::string>&)> meta;
  std::string drop_tensor;
  std::string replace_tensor;  // replaced by `replacement` with `replacement_shape`
  std::vector<float> replacement;
  std::vector<int64_t> replacement_shape;
  std::string add_tensor;
  SafetensorsDtype replacement_dtype = SafetensorsDtype::kF32;
};

std::string Rewrite(const std::string& bytes, const Edit& e) {
  const SafetensorsFile f = *SafetensorsFile::Parse(bytes);
  std::map<std::string, std::string> meta = f.metadata();
  if (e.meta) e.meta(meta);
  SafetensorsWriter w;
  for (const auto& [k, v] : meta) w.SetMetadata(k, v);
  auto add_replacement = [&](const std::string& name) {
    if (e.replacement_dtype == SafetensorsDtype::kF32) {
      w.AddFloat32(name, e.replacement_shape, e.replacement);
    } else {
      std::vector<double> d(e.replacement.begin(), e.replacement.end());
      w.AddTensor(name, SafetensorsDtype::kF64, e.replacement_shape,
                  absl::string_view(reinterpret_cast<const char*>(d.data()), d.size() * 8));
    }
  };
  for (const SafetensorsTensor& t : f.tensors()) {
    if (t.name == e.drop_tensor) continue;
    if (t.name == e.replace_tensor) {
      add_replacement(t.name);
      continue;
    }
    w.AddTensor(t.name, t.dtype, t.shape, t.bytes);
  }
  if (!e.add_tensor.empty()) add_replacement(e.add_tensor);
  return w.Serialize();
}

void ExpectRejected(const std::string& bytes, const std::string& needle) {
  absl::StatusOr<ModelCodec> m = ParseRotationFile(bytes);
  ASSERT_FALSE(m.ok()) << "accepted; expected: " << needle;
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_THAT(std::string(m.status().message()), HasSubstr(needle));
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("rotation file"));
}

Edit MetaEdit(std::function<void(std::map<std::string, std::string>&)> f) {
  Edit e;
  e.meta = std::move(f);
  return e;
}

TEST(RotationFileTest, CodecVersionIsVerifiedWhenPresent) {
  const std::string bytes = SerializeRotationFile(DenseModel());
  // Tampered version string.
  ExpectRejected(Rewrite(bytes, MetaEdit([](auto& m) {
                           std::string& v = m["codec_version"];
                           v[0] = v[0] == '0' ? '1' : '0';
                         })),
                 "codec_version mismatch");
  ExpectRejected(Rewrite(bytes, MetaEdit([](auto& m) { m["codec_version"] = "abc"; })),
                 "codec_version mismatch");
  // A code-affecting setting edited without re-stamping.
  ExpectRejected(Rewrite(bytes, MetaEdit([](auto& m) { m["clip_ratio_v"] = "0.92"; })),
                 "codec_version mismatch");
  // One matrix entry changed by an ulp (still orthogonal to tolerance).
  const SafetensorsFile f = *SafetensorsFile::Parse(bytes);
  Edit e;
  e.replace_tensor = "layers.1.k_rotation";
  e.replacement = *f.ReadFloat32("layers.1.k_rotation");
  e.replacement[5] = std::nextafter(e.replacement[5], 1.0f);
  e.replacement_shape = {64, 64};
  ExpectRejected(Rewrite(bytes, e), "codec_version mismatch");
  // Not code-affecting: sink size and the model id may change under the same version.
  EXPECT_TRUE(ParseRotationFile(Rewrite(bytes, MetaEdit([](auto& m) {
                                          m["sink_tokens"] = "64";
                                          m["recent_tokens"] = "512";
                                          m["model_id"] = "renamed";
                                        })))
                  .ok());
  // Without a codec_version the file loads, and the version is computed.
  absl::StatusOr<ModelCodec> unstamped =
      ParseRotationFile(Rewrite(bytes, MetaEdit([](auto& m) { m.erase("codec_version"); })));
  ASSERT_TRUE(unstamped.ok()) << unstamped.status();
  EXPECT_EQ(CodecVersionHex(*unstamped), f.metadata().at("codec_version"));
}

TEST(RotationFileTest, RejectsBadMetadata) {
  const std::string bytes = SerializeRotationFile(DenseModel());
  for (const char* key :
       {"format", "format_version", "model_id", "num_layers", "head_dim", "rotation_kind", "bits",
        "group_size", "quantizer", "scale_dtype", "clip_ratio_k", "clip_ratio_v", "block_tokens",
        "sink_tokens", "recent_tokens", "demotion_batch", "v_prerotated"}) {
    SCOPED_TRACE(key);
    ExpectRejected(Rewrite(bytes, MetaEdit([&](auto& m) { m.erase(key); })),
                   absl::StrCat("missing metadata '", key, "'"));
  }
  auto set = [&](const std::string& key, const std::string& value) {
    return Rewrite(bytes, MetaEdit([&](auto& m) { m[key] = value; }));
  };
  ExpectRejected(set("format", "something-else"), "format is 'something-else'");
  ExpectRejected(set("format_version", "2"), "format_version '2' is not supported");
  ExpectRejected(set("model_id", ""), "model_id is empty");
  ExpectRejected(set("num_layers", "three"), "'num_layers' = 'three' is not an integer");
  ExpectRejected(set("num_layers", "3 "), "is not an integer");
  ExpectRejected(set("num_layers", "0"), "outside");
  ExpectRejected(set("num_layers", "99999999999"), "not an integer");
  ExpectRejected(set("num_layers", "2"), "unexpected tensor 'layers.2.");
  ExpectRejected(set("num_layers", "4"), "missing tensor 'layers.3.k_rotation'");
  ExpectRejected(set("head_dim", "128"), "shape [64,64], expected [128,128]");
  ExpectRejected(set("head_dim", "48"), "head_dim");
  ExpectRejected(set("rotation_kind", "givens"), "unknown rotation kind 'givens'");
  ExpectRejected(set("rotation_kind", "hadamard"), "unexpected tensor 'layers.0.k_rotation'");
  ExpectRejected(set("bits", "3"), "bits must be 2 or 4");
  ExpectRejected(set("quantizer", "gptq"), "unknown quantizer");
  ExpectRejected(set("scale_dtype", "fp8"), "unknown scale dtype");
  ExpectRejected(set("clip_ratio_k", "nan"), "'clip_ratio_k' = 'nan' is not a finite number");
  ExpectRejected(set("clip_ratio_k", "0.9x"), "not a finite number");
  ExpectRejected(set("clip_ratio_v", "7"), "clip_ratio_v");
  ExpectRejected(set("block_tokens", "12"), "block_tokens");
  ExpectRejected(set("v_prerotated", "yes"), "'v_prerotated' = 'yes' is not true or false");

  const std::string rh = SerializeRotationFile(ModelCodec{
      "rh", *RotationSet::RandomizedHadamard(2, 64, 3), QuantConfig{}, false, "", {}, {}});
  ExpectRejected(Rewrite(rh, MetaEdit([](auto& m) { m.erase("hadamard_seed"); })),
                 "missing metadata 'hadamard_seed'");
  ExpectRejected(Rewrite(rh, MetaEdit([](auto& m) { m["hadamard_seed"] = "-1"; })),
                 "not an unsigned 64-bit integer");
  ExpectRejected(Rewrite(rh, MetaEdit([](auto& m) { m["hadamard_seed"] = "4"; })),
                 "codec_version mismatch");
}

TEST(RotationFileTest, RejectsBadTensors) {
  const ModelCodec model = DenseModel();
  const std::string bytes = SerializeRotationFile(model);
  Edit drop;
  drop.drop_tensor = "layers.1.v_rotation";
  ExpectRejected(Rewrite(bytes, drop), "missing tensor 'layers.1.v_rotation'");

  Edit wrong_shape;
  wrong_shape.replace_tensor = "layers.0.k_rotation";
  wrong_shape.replacement = model.rotations.Matrix(0, KvTensor::kKey);
  wrong_shape.replacement_shape = {32, 128};
  ExpectRejected(Rewrite(bytes, wrong_shape), "shape [32,128], expected [64,64]");

  Edit wrong_dtype = wrong_shape;
  wrong_dtype.replacement_shape = {64, 64};
  wrong_dtype.replacement_dtype = SafetensorsDtype::kF64;
  ExpectRejected(Rewrite(bytes, wrong_dtype), "dtype F64, expected F32");

  Edit not_orthogonal = wrong_dtype;
  not_orthogonal.replacement_dtype = SafetensorsDtype::kF32;
  not_orthogonal.replacement[0] += 0.01f;
  ExpectRejected(Rewrite(bytes, not_orthogonal), "not orthogonal");

  Edit non_finite = not_orthogonal;
  non_finite.replacement[0] = std::nanf("");
  ExpectRejected(Rewrite(bytes, non_finite), "non-finite");

  Edit extra;
  extra.add_tensor = "layers.0.q_rotation";
  extra.replacement = model.rotations.Matrix(0, KvTensor::kKey);
  extra.replacement_shape = {64, 64};
  ExpectRejected(Rewrite(bytes, extra), "unexpected tensor 'layers.0.q_rotation'");

  Edit partial_eigen;
  partial_eigen.drop_tensor = "layers.2.k_eigenvalues";
  ExpectRejected(Rewrite(bytes, partial_eigen), "k_eigenvalues present for 2 of 3 layers");

  Edit eigen_shape;
  eigen_shape.replace_tensor = "layers.0.v_eigenvalues";
  eigen_shape.replacement = std::vector<float>(63, 1.0f);
  eigen_shape.replacement_shape = {63};
  ExpectRejected(Rewrite(bytes, eigen_shape), "shape [63], expected [64]");

  // Not a safetensors file at all.
  ExpectRejected("definitely not a rotation file", "safetensors");
  ExpectRejected(std::string(), "safetensors");
}

TEST(RotationFileTest, DataFreeKindsMayCarryEigenvaluesButNoMatrices) {
  ModelCodec m{"h", *RotationSet::Hadamard(2, 32), QuantConfig{}, false, "hadamard", {}, {}};
  m.k_eigenvalues.assign(2, std::vector<float>(32, 1.0f));
  m.v_eigenvalues.assign(2, std::vector<float>(32, 1.0f));
  const std::string bytes = SerializeRotationFile(m);
  absl::StatusOr<ModelCodec> back = ParseRotationFile(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSameModel(m, *back);
  EXPECT_EQ(SafetensorsFile::Parse(bytes)->tensors().size(), 4u);
}

// Random byte mutations of a valid file: a status or a model, never a crash.
TEST(RotationFileTest, FuzzedFilesNeverCrash) {
  const std::string base = SerializeRotationFile(
      ModelCodec{"m", DenseFromRandomizedHadamard(1, 32, 2), QuantConfig{}, false, "", {}, {}});
  uint64_t state = 88172645463325252ull;
  auto next = [&state] {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  for (int i = 0; i < 3000; ++i) {
    std::string bytes = base;
    const int n = 1 + static_cast<int>(next() % 3);
    for (int j = 0; j < n; ++j) {
      // Mostly the header, where the structure is.
      const size_t limit = (next() % 4 == 0) ? bytes.size() : std::min<size_t>(bytes.size(), 900);
      bytes[next() % limit] = static_cast<char>(next());
    }
    absl::StatusOr<ModelCodec> m = ParseRotationFile(bytes);
    if (!m.ok()) {
      EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
}

}  // namespace
}  // namespace kvpool
