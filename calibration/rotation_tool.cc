// kvpool-rotation: inspect and stamp kvpool rotation files (kernels/rotation_file.h).
//
//   kvpool-rotation inspect FILE      model id, kind, layers, D, quant config, codec version and
//                                     the largest orthogonality error max |M M^T - I|
//   kvpool-rotation stamp IN OUT      re-writes IN as OUT with its codec_version
//
// Exit status: 0 on success, 1 when a file cannot be read or written, 2 on a usage error.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/codec_version.h"
#include "kernels/rotation_file.h"
#include "kernels/safetensors.h"

namespace kvpool {
namespace {

// max |M M^T - I| in float64 for one row-major D x D matrix.
double OrthogonalityError(const std::vector<float>& m, int d) {
  double err = 0.0;
  for (int i = 0; i < d; ++i) {
    const float* a = m.data() + static_cast<size_t>(i) * d;
    for (int j = i; j < d; ++j) {
      const float* b = m.data() + static_cast<size_t>(j) * d;
      double dot = 0.0;
      for (int k = 0; k < d; ++k) dot += static_cast<double>(a[k]) * b[k];
      err = std::max(err, std::abs(dot - (i == j ? 1.0 : 0.0)));
    }
  }
  return err;
}

int Usage() {
  std::fprintf(stderr,
               "usage: kvpool-rotation inspect FILE\n"
               "       kvpool-rotation stamp IN OUT\n");
  return 2;
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "kvpool-rotation: %s\n", std::string(s.ToString()).c_str());
  return 1;
}

int Inspect(const std::string& path) {
  absl::StatusOr<ModelCodec> model = ReadRotationFile(path);
  if (!model.ok()) return Fail(model.status());
  // The reader has verified a stored codec_version; report whether there is one.
  absl::StatusOr<SafetensorsFile> raw = SafetensorsFile::ReadFile(path);
  if (!raw.ok()) return Fail(raw.status());
  const bool stamped = raw->metadata().count("codec_version") > 0;

  const RotationSet& r = model->rotations;
  const QuantConfig& q = model->quant;
  double max_err = 0.0;
  for (int layer = 0; layer < r.num_layers(); ++layer) {
    for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
      max_err = std::max(max_err, OrthogonalityError(r.Matrix(layer, t), r.head_dim()));
    }
  }
  std::printf("file            %s\n", path.c_str());
  std::printf("model_id        %s\n", model->model_id.c_str());
  std::printf("rotation_kind   %s\n", std::string(RotationKindName(r.kind())).c_str());
  if (r.kind() == RotationKind::kRandomizedHadamard) {
    std::printf("hadamard_seed   %llu\n", static_cast<unsigned long long>(r.seed()));
  }
  std::printf("num_layers      %d\n", r.num_layers());
  std::printf("head_dim        %d\n", r.head_dim());
  if (!model->objective.empty()) std::printf("objective       %s\n", model->objective.c_str());
  std::printf("v_prerotated    %s\n", model->v_prerotated ? "true" : "false");
  std::printf("eigenvalues     K:%s V:%s\n", model->k_eigenvalues.empty() ? "no" : "yes",
              model->v_eigenvalues.empty() ? "no" : "yes");
  std::printf("quant           %s, %d bits, group %d, scale/min %s, clip K %g V %g\n",
              std::string(QuantMethodName(q.method)).c_str(), q.bits,
              q.EffectiveGroupSize(r.head_dim()),
              std::string(ScaleDtypeName(q.scale_dtype)).c_str(),
              static_cast<double>(q.clip_ratio_k), static_cast<double>(q.clip_ratio_v));
  std::printf("layout          block %d tokens, sink %d, recent %d, demotion batch %d\n",
              q.block_tokens, q.sink_tokens, q.recent_tokens, q.demotion_batch);
  std::printf("codec_version   %s (%s)\n", CodecVersionHex(*model).c_str(),
              stamped ? "stored and verified" : "computed; file not stamped");
  std::printf("max |MM^T - I|  %.3g\n", max_err);
  return 0;
}

int Stamp(const std::string& in, const std::string& out) {
  absl::StatusOr<ModelCodec> model = ReadRotationFile(in);
  if (!model.ok()) return Fail(model.status());
  if (absl::Status s = WriteRotationFile(*model, out); !s.ok()) return Fail(s);
  std::printf("%s: codec_version %s\n", out.c_str(), CodecVersionHex(*model).c_str());
  return 0;
}

}  // namespace
}  // namespace kvpool

int main(int argc, char** argv) {
  if (argc == 3 && std::strcmp(argv[1], "inspect") == 0) return kvpool::Inspect(argv[2]);
  if (argc == 4 && std::strcmp(argv[1], "stamp") == 0) return kvpool::Stamp(argv[2], argv[3]);
  return kvpool::Usage();
}
