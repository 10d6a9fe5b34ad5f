// End to end: the published Qwen3-4B-Thinking-2507 RotationZoo files are converted by
// rotationzoo_convert.py, read back by ReadRotationFile, and stamped by kvpool-rotation. The
// repository keeps their first layers (tests/fixtures/README.md), with the published structure
// and bytes.
#include <sys/stat.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/codec_version.h"
#include "kernels/rotation_file.h"
#include "kernels/safetensors.h"

namespace kvpool {
namespace {

using ::testing::HasSubstr;

const std::string kRotationZooDir =
    std::string(KVPOOL_FIXTURES_DIR) + "/oscar-reference/rotationzoo-qwen3-4b-thinking-2507";

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

std::string Quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Runs a shell command; returns its exit status and its stdout (stderr goes to the test log).
int RunCommand(const std::string& cmd, std::string* out) {
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return -1;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out->append(buf, n);
  const int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

double OrthogonalityError(const std::vector<float>& m, int d) {
  double err = 0.0;
  for (int i = 0; i < d; ++i) {
    for (int j = i; j < d; ++j) {
      double dot = 0.0;
      for (int k = 0; k < d; ++k) dot += static_cast<double>(m[i * d + k]) * m[j * d + k];
      err = std::max(err, std::abs(dot - (i == j ? 1.0 : 0.0)));
    }
  }
  return err;
}

class RotationZooConvertTest : public ::testing::Test {
 protected:
  void SetUp() override {
    k_pt_ = kRotationZooDir + "/k_rotation_qqt_r_h_pbr.pt";
    v_pt_ = kRotationZooDir + "/v_rotation_sst_r_h_pbr.pt";
    ASSERT_TRUE(Exists(k_pt_)) << "missing fixture " << k_pt_;
    ASSERT_TRUE(Exists(v_pt_)) << "missing fixture " << v_pt_;
    out_ = ::testing::TempDir() + "/rotationzoo_qwen3_4b.safetensors";
    stamped_ = ::testing::TempDir() + "/rotationzoo_qwen3_4b.stamped.safetensors";
  }
  void TearDown() override {
    std::remove(out_.c_str());
    std::remove(stamped_.c_str());
  }

  int Convert(std::string* log) {
    const std::string cmd = std::string(Quote(KVPOOL_PYTHON3)) + " " +
                            Quote(KVPOOL_ROTATIONZOO_CONVERTER) + " --k " + Quote(k_pt_) + " --v " +
                            Quote(v_pt_) + " --model-id qwen3-4b-thinking-2507" + " --out " +
                            Quote(out_);
    return RunCommand(cmd, log);
  }

  std::string k_pt_, v_pt_, out_, stamped_;
};

TEST_F(RotationZooConvertTest, ConvertedFileLoadsWithOrthogonalMatricesAndAscendingEigenvalues) {
  std::string log;
  ASSERT_EQ(Convert(&log), 0) << log;

  // The converter leaves the version to C++.
  absl::StatusOr<SafetensorsFile> raw = SafetensorsFile::ReadFile(out_);
  ASSERT_TRUE(raw.ok()) << raw.status();
  EXPECT_EQ(raw->metadata().count("codec_version"), 0u);

  absl::StatusOr<ModelCodec> model = ReadRotationFile(out_);
  ASSERT_TRUE(model.ok()) << model.status();
  const RotationSet& r = model->rotations;
  EXPECT_EQ(model->model_id, "qwen3-4b-thinking-2507");
  EXPECT_EQ(r.kind(), RotationKind::kDense);
  const int layers = r.num_layers();
  ASSERT_GE(layers, 2);
  ASSERT_EQ(r.head_dim(), 128);
  EXPECT_EQ(model->objective, "qqt_r_h_pbr/sst_r_h_pbr");
  EXPECT_EQ(model->quant.clip_ratio_k, 0.96f);
  EXPECT_EQ(model->quant.clip_ratio_v, 0.92f);
  EXPECT_FALSE(model->v_prerotated);

  double worst = 0.0;
  for (int layer = 0; layer < layers; ++layer) {
    for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
      const double err = OrthogonalityError(r.Matrix(layer, t), 128);
      EXPECT_LE(err, 1e-6) << "layer " << layer << (t == KvTensor::kKey ? " K" : " V");
      worst = std::max(worst, err);
    }
  }
  std::printf("max |M M^T - I| over %d matrices: %.3g\n", 2 * layers, worst);

  ASSERT_EQ(model->k_eigenvalues.size(), static_cast<size_t>(layers));
  ASSERT_EQ(model->v_eigenvalues.size(), static_cast<size_t>(layers));
  for (int layer = 0; layer < layers; ++layer) {
    for (const auto* e : {&model->k_eigenvalues[layer], &model->v_eigenvalues[layer]}) {
      ASSERT_EQ(e->size(), 128u);
      for (int i = 1; i < 128; ++i) {
        ASSERT_LE((*e)[i - 1], (*e)[i]) << "layer " << layer << " index " << i;
      }
    }
  }
  // The K target (query second moment) is far more anisotropic than the V target in layer 0.
  const auto spread = [](const std::vector<float>& e) {
    return e.back() / std::max(e.front(), 1e-30f);
  };
  EXPECT_GT(spread(model->k_eigenvalues[0]), spread(model->v_eigenvalues[0]));
}

TEST_F(RotationZooConvertTest, StampAndInspect) {
  std::string log;
  ASSERT_EQ(Convert(&log), 0) << log;
  const ModelCodec unstamped = *ReadRotationFile(out_);
  const std::string version = CodecVersionHex(unstamped);

  std::string stamp_out;
  ASSERT_EQ(
      RunCommand(Quote(KVPOOL_ROTATION_TOOL) + " stamp " + Quote(out_) + " " + Quote(stamped_),
                 &stamp_out),
      0)
      << stamp_out;
  EXPECT_THAT(stamp_out, HasSubstr(version));

  absl::StatusOr<SafetensorsFile> raw = SafetensorsFile::ReadFile(stamped_);
  ASSERT_TRUE(raw.ok()) << raw.status();
  EXPECT_EQ(raw->metadata().at("codec_version"), version);
  absl::StatusOr<ModelCodec> stamped = ReadRotationFile(stamped_);
  ASSERT_TRUE(stamped.ok()) << stamped.status();
  EXPECT_EQ(CodecVersionHex(*stamped), version);
  const int layers = unstamped.rotations.num_layers();
  for (int layer : {0, layers / 2, layers - 1}) {
    EXPECT_EQ(stamped->rotations.Matrix(layer, KvTensor::kKey),
              unstamped.rotations.Matrix(layer, KvTensor::kKey));
    EXPECT_EQ(stamped->v_eigenvalues[layer], unstamped.v_eigenvalues[layer]);
  }

  std::string inspect_out;
  ASSERT_EQ(RunCommand(Quote(KVPOOL_ROTATION_TOOL) + " inspect " + Quote(stamped_), &inspect_out),
            0)
      << inspect_out;
  EXPECT_THAT(inspect_out, HasSubstr("qwen3-4b-thinking-2507"));
  EXPECT_THAT(inspect_out, HasSubstr("num_layers      " + std::to_string(layers)));
  EXPECT_THAT(inspect_out, HasSubstr("head_dim        128"));
  EXPECT_THAT(inspect_out, HasSubstr(version + " (stored and verified)"));
  std::printf("%s", inspect_out.c_str());

  std::string usage;
  EXPECT_EQ(RunCommand(Quote(KVPOOL_ROTATION_TOOL) + " frobnicate 2>&1", &usage), 2);
  std::string missing;
  EXPECT_EQ(RunCommand(Quote(KVPOOL_ROTATION_TOOL) + " inspect /nonexistent/file 2>&1", &missing),
            1);
}

}  // namespace
}  // namespace kvpool
