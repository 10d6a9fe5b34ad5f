#include "kernels/rotation_file.h"

#include <charconv>
#include <cmath>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/codec_version.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "kernels/safetensors.h"

namespace kvpool {
namespace {

constexpr char kFormat[] = "kvpool-rotation";
constexpr char kFormatVersion[] = "1";
// Far above any real model; bounds what a hostile file can make us allocate for data-free kinds.
constexpr int kMaxLayers = 4096;

absl::Status Invalid(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("rotation file: ", what));
}

// Prefixes a status from a lower layer with "rotation file: ", keeping the message.
absl::Status Wrap(const absl::Status& s) {
  return absl::InvalidArgumentError(absl::StrCat("rotation file: ", s.message()));
}

std::string FormatFloat(float f) {
  char buf[64];
  const std::to_chars_result r = std::to_chars(buf, buf + sizeof(buf), f);  // shortest round trip
  return std::string(buf, r.ptr);
}

std::string LayerTensorName(int layer, absl::string_view what) {
  return absl::StrCat("layers.", layer, ".", what);
}

// Typed access to the string metadata, each error naming the key.
class Metadata {
 public:
  explicit Metadata(const std::map<std::string, std::string>& m) : m_(m) {}

  absl::StatusOr<std::string> String(const std::string& key) const {
    auto it = m_.find(key);
    if (it == m_.end()) return Invalid(absl::StrCat("missing metadata ", Quote(key)));
    return it->second;
  }
  bool Has(const std::string& key) const { return m_.count(key) > 0; }

  absl::StatusOr<int> Int(const std::string& key, int min, int max) const {
    KVPOOL_ASSIGN_OR_RETURN(std::string s, String(key));
    int v = 0;
    const char* end = s.data() + s.size();
    const std::from_chars_result r = std::from_chars(s.data(), end, v);
    if (s.empty() || r.ec != std::errc() || r.ptr != end) {
      return Invalid(absl::StrCat("metadata ", Quote(key), " = ", Quote(s), " is not an integer"));
    }
    if (v < min || v > max) {
      return Invalid(
          absl::StrCat("metadata ", Quote(key), " = ", v, " is outside [", min, ", ", max, "]"));
    }
    return v;
  }

  absl::StatusOr<uint64_t> Uint64(const std::string& key) const {
    KVPOOL_ASSIGN_OR_RETURN(std::string s, String(key));
    uint64_t v = 0;
    const char* end = s.data() + s.size();
    const std::from_chars_result r = std::from_chars(s.data(), end, v);
    if (s.empty() || r.ec != std::errc() || r.ptr != end) {
      return Invalid(absl::StrCat("metadata ", Quote(key), " = ", Quote(s),
                                  " is not an unsigned 64-bit integer"));
    }
    return v;
  }

  absl::StatusOr<float> Float(const std::string& key) const {
    KVPOOL_ASSIGN_OR_RETURN(std::string s, String(key));
    float v = 0.0f;
    const char* end = s.data() + s.size();
    const std::from_chars_result r = std::from_chars(s.data(), end, v);
    if (s.empty() || r.ec != std::errc() || r.ptr != end || !std::isfinite(v)) {
      return Invalid(
          absl::StrCat("metadata ", Quote(key), " = ", Quote(s), " is not a finite number"));
    }
    return v;
  }

  absl::StatusOr<bool> Bool(const std::string& key) const {
    KVPOOL_ASSIGN_OR_RETURN(std::string s, String(key));
    if (s == "true") return true;
    if (s == "false") return false;
    return Invalid(absl::StrCat("metadata ", Quote(key), " = ", Quote(s), " is not true or false"));
  }

 private:
  const std::map<std::string, std::string>& m_;
};

// A [shape] float32 tensor that must exist. `shape` is D x D or D.
absl::StatusOr<std::vector<float>> ReadF32Tensor(const SafetensorsFile& file,
                                                 const std::string& name,
                                                 const std::vector<int64_t>& shape) {
  const SafetensorsTensor* t = file.Find(name);
  if (t == nullptr) return Invalid(absl::StrCat("missing tensor ", Quote(name)));
  if (t->dtype != SafetensorsDtype::kF32) {
    return Invalid(absl::StrCat("tensor ", Quote(name), " has dtype ",
                                SafetensorsDtypeName(t->dtype), ", expected F32"));
  }
  if (t->shape != shape) {
    std::string got, want;
    for (int64_t s : t->shape) absl::StrAppend(&got, got.empty() ? "" : ",", s);
    for (int64_t s : shape) absl::StrAppend(&want, want.empty() ? "" : ",", s);
    return Invalid(
        absl::StrCat("tensor ", Quote(name), " has shape [", got, "], expected [", want, "]"));
  }
  absl::StatusOr<std::vector<float>> v = file.ReadFloat32(name);
  if (!v.ok()) return Wrap(v.status());
  for (float x : *v) {
    if (!std::isfinite(x))
      return Invalid(absl::StrCat("tensor ", Quote(name), " has a non-finite value"));
  }
  return v;
}

// Optional per-layer eigenvalues of one tensor: all layers or none.
absl::StatusOr<std::vector<std::vector<float>>> ReadEigenvalues(const SafetensorsFile& file,
                                                                int num_layers, int head_dim,
                                                                absl::string_view what) {
  std::vector<std::vector<float>> out;
  int present = 0;
  for (int layer = 0; layer < num_layers; ++layer) {
    present += file.Find(LayerTensorName(layer, what)) != nullptr;
  }
  if (present == 0) return out;
  if (present != num_layers) {
    return Invalid(
        absl::StrCat(what, " present for ", present, " of ", num_layers, " layers (all or none)"));
  }
  for (int layer = 0; layer < num_layers; ++layer) {
    KVPOOL_ASSIGN_OR_RETURN(std::vector<float> e,
                            ReadF32Tensor(file, LayerTensorName(layer, what), {head_dim}));
    out.push_back(std::move(e));
  }
  return out;
}

absl::StatusOr<ModelCodec> FromSafetensors(const SafetensorsFile& file) {
  const Metadata meta(file.metadata());
  KVPOOL_ASSIGN_OR_RETURN(std::string format, meta.String("format"));
  if (format != kFormat) {
    return Invalid(absl::StrCat("format is ", Quote(format), ", expected ", Quote(kFormat)));
  }
  KVPOOL_ASSIGN_OR_RETURN(std::string version, meta.String("format_version"));
  if (version != kFormatVersion) {
    return Invalid(absl::StrCat("format_version '", version,
                                "' is not supported (this build "
                                "reads version ",
                                kFormatVersion, ")"));
  }
  KVPOOL_ASSIGN_OR_RETURN(std::string model_id, meta.String("model_id"));
  if (model_id.empty()) return Invalid("model_id is empty");
  KVPOOL_ASSIGN_OR_RETURN(int num_layers, meta.Int("num_layers", 1, kMaxLayers));
  KVPOOL_ASSIGN_OR_RETURN(int head_dim, meta.Int("head_dim", 1, 1 << 16));
  KVPOOL_ASSIGN_OR_RETURN(std::string kind_name, meta.String("rotation_kind"));
  absl::StatusOr<RotationKind> kind = ParseRotationKind(kind_name);
  if (!kind.ok()) return Wrap(kind.status());

  // Quant config: every field is required, so a file never silently takes a default.
  QuantConfig q;
  KVPOOL_ASSIGN_OR_RETURN(q.bits, meta.Int("bits", 0, 64));
  KVPOOL_ASSIGN_OR_RETURN(q.group_size, meta.Int("group_size", 0, 1 << 16));
  KVPOOL_ASSIGN_OR_RETURN(std::string quantizer, meta.String("quantizer"));
  absl::StatusOr<QuantMethod> method = ParseQuantMethod(quantizer);
  if (!method.ok()) return Wrap(method.status());
  q.method = *method;
  KVPOOL_ASSIGN_OR_RETURN(std::string scale_dtype, meta.String("scale_dtype"));
  absl::StatusOr<ScaleDtype> sd = ParseScaleDtype(scale_dtype);
  if (!sd.ok()) return Wrap(sd.status());
  q.scale_dtype = *sd;
  KVPOOL_ASSIGN_OR_RETURN(q.clip_ratio_k, meta.Float("clip_ratio_k"));
  KVPOOL_ASSIGN_OR_RETURN(q.clip_ratio_v, meta.Float("clip_ratio_v"));
  KVPOOL_ASSIGN_OR_RETURN(q.block_tokens, meta.Int("block_tokens", 0, 1 << 20));
  KVPOOL_ASSIGN_OR_RETURN(q.sink_tokens, meta.Int("sink_tokens", 0, 1 << 30));
  KVPOOL_ASSIGN_OR_RETURN(q.recent_tokens, meta.Int("recent_tokens", 0, 1 << 30));
  KVPOOL_ASSIGN_OR_RETURN(q.demotion_batch, meta.Int("demotion_batch", 0, 1 << 20));
  if (absl::Status s = q.Validate(head_dim); !s.ok()) return Wrap(s);
  KVPOOL_ASSIGN_OR_RETURN(bool v_prerotated, meta.Bool("v_prerotated"));
  std::string objective;
  if (meta.Has("objective")) objective = *meta.String("objective");

  // Every tensor must be one this kind stores, so a mislabelled file cannot pass.
  std::set<std::string> expected;
  const char* kMatrices[] = {"k_rotation", "v_rotation"};
  const char* kEigen[] = {"k_eigenvalues", "v_eigenvalues"};
  for (int layer = 0; layer < num_layers; ++layer) {
    if (*kind == RotationKind::kDense) {
      for (const char* m : kMatrices) expected.insert(LayerTensorName(layer, m));
    }
    for (const char* e : kEigen) expected.insert(LayerTensorName(layer, e));
  }
  for (const SafetensorsTensor& t : file.tensors()) {
    if (expected.count(t.name) == 0) {
      return Invalid(absl::StrCat("unexpected tensor ", Quote(t.name), " for a ", kind_name,
                                  " rotation of ", num_layers, " layers"));
    }
  }

  absl::StatusOr<RotationSet> rotations = absl::InternalError("unset");
  switch (*kind) {
    case RotationKind::kIdentity:
      rotations = RotationSet::Identity(num_layers, head_dim);
      break;
    case RotationKind::kHadamard:
      rotations = RotationSet::Hadamard(num_layers, head_dim);
      break;
    case RotationKind::kRandomizedHadamard: {
      KVPOOL_ASSIGN_OR_RETURN(uint64_t seed, meta.Uint64("hadamard_seed"));
      rotations = RotationSet::RandomizedHadamard(num_layers, head_dim, seed);
      break;
    }
    case RotationKind::kDense: {
      std::vector<std::vector<float>> k, v;
      const std::vector<int64_t> shape = {head_dim, head_dim};
      for (int layer = 0; layer < num_layers; ++layer) {
        KVPOOL_ASSIGN_OR_RETURN(std::vector<float> mk,
                                ReadF32Tensor(file, LayerTensorName(layer, "k_rotation"), shape));
        KVPOOL_ASSIGN_OR_RETURN(std::vector<float> mv,
                                ReadF32Tensor(file, LayerTensorName(layer, "v_rotation"), shape));
        k.push_back(std::move(mk));
        v.push_back(std::move(mv));
      }
      rotations = RotationSet::Dense(num_layers, head_dim, std::move(k), std::move(v));
      break;
    }
  }
  if (!rotations.ok()) return Wrap(rotations.status());

  KVPOOL_ASSIGN_OR_RETURN(auto k_eigen, ReadEigenvalues(file, num_layers, head_dim, kEigen[0]));
  KVPOOL_ASSIGN_OR_RETURN(auto v_eigen, ReadEigenvalues(file, num_layers, head_dim, kEigen[1]));

  ModelCodec model{std::move(model_id), *std::move(rotations), q,
                   v_prerotated,        std::move(objective),  std::move(k_eigen),
                   std::move(v_eigen)};

  if (meta.Has("codec_version")) {
    const std::string stored = *meta.String("codec_version");
    const std::string computed = CodecVersionHex(model);
    if (stored != computed) {
      return Invalid(absl::StrCat("codec_version mismatch: the file says '", stored,
                                  "' but its content hashes to '", computed,
                                  "' (file edited or corrupted?)"));
    }
  }
  return model;
}

// Eigenvalues are written only when they are complete (one length-D vector per layer).
bool CompleteEigenvalues(const std::vector<std::vector<float>>& e, int num_layers, int d) {
  if (e.size() != static_cast<size_t>(num_layers)) return false;
  for (const std::vector<float>& v : e) {
    if (v.size() != static_cast<size_t>(d)) return false;
  }
  return true;
}

SafetensorsWriter ToWriter(const ModelCodec& model) {
  const RotationSet& r = model.rotations;
  const QuantConfig& q = model.quant;
  SafetensorsWriter w;
  w.SetMetadata("format", kFormat);
  w.SetMetadata("format_version", kFormatVersion);
  w.SetMetadata("model_id", model.model_id);
  w.SetMetadata("num_layers", absl::StrCat(r.num_layers()));
  w.SetMetadata("head_dim", absl::StrCat(r.head_dim()));
  w.SetMetadata("rotation_kind", std::string(RotationKindName(r.kind())));
  if (r.kind() == RotationKind::kRandomizedHadamard) {
    w.SetMetadata("hadamard_seed", absl::StrCat(r.seed()));
  }
  if (!model.objective.empty()) w.SetMetadata("objective", model.objective);
  w.SetMetadata("v_prerotated", model.v_prerotated ? "true" : "false");
  w.SetMetadata("bits", absl::StrCat(q.bits));
  w.SetMetadata("group_size", absl::StrCat(q.group_size));
  w.SetMetadata("quantizer", std::string(QuantMethodName(q.method)));
  w.SetMetadata("scale_dtype", std::string(ScaleDtypeName(q.scale_dtype)));
  w.SetMetadata("clip_ratio_k", FormatFloat(q.clip_ratio_k));
  w.SetMetadata("clip_ratio_v", FormatFloat(q.clip_ratio_v));
  w.SetMetadata("block_tokens", absl::StrCat(q.block_tokens));
  w.SetMetadata("sink_tokens", absl::StrCat(q.sink_tokens));
  w.SetMetadata("recent_tokens", absl::StrCat(q.recent_tokens));
  w.SetMetadata("demotion_batch", absl::StrCat(q.demotion_batch));
  w.SetMetadata("codec_version", CodecVersionHex(model));

  const int d = r.head_dim();
  const bool k_eigen = CompleteEigenvalues(model.k_eigenvalues, r.num_layers(), d);
  const bool v_eigen = CompleteEigenvalues(model.v_eigenvalues, r.num_layers(), d);
  for (int layer = 0; layer < r.num_layers(); ++layer) {
    if (r.kind() == RotationKind::kDense) {
      w.AddFloat32(LayerTensorName(layer, "k_rotation"), {d, d}, r.Matrix(layer, KvTensor::kKey));
      w.AddFloat32(LayerTensorName(layer, "v_rotation"), {d, d}, r.Matrix(layer, KvTensor::kValue));
    }
    if (k_eigen) {
      w.AddFloat32(LayerTensorName(layer, "k_eigenvalues"), {d}, model.k_eigenvalues[layer]);
    }
    if (v_eigen) {
      w.AddFloat32(LayerTensorName(layer, "v_eigenvalues"), {d}, model.v_eigenvalues[layer]);
    }
  }
  return w;
}

}  // namespace

absl::StatusOr<ModelCodec> ParseRotationFile(std::string bytes) {
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Parse(std::move(bytes));
  if (!file.ok()) return Wrap(file.status());
  return FromSafetensors(*file);
}

absl::StatusOr<ModelCodec> ReadRotationFile(const std::string& path) {
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::ReadFile(path);
  if (!file.ok()) {
    // A missing file keeps its NotFound code; malformed content is InvalidArgument.
    if (file.status().code() == absl::StatusCode::kInvalidArgument) return Wrap(file.status());
    return file.status();
  }
  absl::StatusOr<ModelCodec> model = FromSafetensors(*file);
  if (!model.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(model.status().message(), " (in '", path, "')"));
  }
  return model;
}

std::string SerializeRotationFile(const ModelCodec& model) { return ToWriter(model).Serialize(); }

absl::Status WriteRotationFile(const ModelCodec& model, const std::string& path) {
  return ToWriter(model).WriteFile(path);
}

}  // namespace kvpool
