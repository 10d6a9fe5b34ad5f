#include "calibration/pipeline.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/codec_version.h"
#include "common/status_macros.h"
#include "kernels/safetensors.h"
#include "nlohmann/json.hpp"

namespace kvpool::calibration {
namespace {

using Json = nlohmann::json;

std::vector<float> ToFloat(const std::vector<double>& x) {
  return std::vector<float>(x.begin(), x.end());
}

double EigRatio(const std::vector<double>& ascending) {
  const double lo = ascending.front(), hi = ascending.back();
  return lo > 0 ? hi / lo : std::numeric_limits<double>::infinity();
}

// One layer's fitted rotations, as stored (float32).
struct LayerRotation {
  std::vector<float> k, v;
  std::vector<float> k_eig, v_eig;
  double k_eig_ratio = 0, v_eig_ratio = 0;
};

// A one-layer rotation set holding layer `layer`'s matrices, for evaluating that layer alone.
absl::StatusOr<RotationSet> SingleLayerSet(const LayerRotation& r, int head_dim) {
  return RotationSet::Dense(1, head_dim, {r.k}, {r.v});
}

void Log(const CalibrateOptions& o, const std::string& line) {
  if (o.log) o.log(line);
}

int ArgMin(const std::vector<double>& x) {
  return static_cast<int>(std::min_element(x.begin(), x.end()) - x.begin());
}

Json FiniteOrNull(double x) { return std::isfinite(x) ? Json(x) : Json(nullptr); }

}  // namespace

absl::StatusOr<CalibrationResult> RunCalibration(const CalibrateOptions& options) {
  KVPOOL_ASSIGN_OR_RETURN(std::vector<std::string> files, ListCaptureFiles(options.captures_dir));
  if (options.max_layers > 0 && static_cast<int>(files.size()) > options.max_layers) {
    files.resize(options.max_layers);
  }
  const int num_layers = static_cast<int>(files.size());
  // Filled as the fit goes; the ModelCodec (not default-constructible) is built at the end.
  struct Partial {
    std::vector<LayerReport> layers;
    std::vector<float> clip_grid;
    std::vector<double> k_error_by_ratio, v_error_by_ratio;
    int tokens = 0, sequences = 0;
  } result;
  std::vector<LayerRotation> rotations(num_layers);
  int head_dim = 0;
  std::string model_id = options.model_id;

  // 1. Targets, eigendecompositions, rotations.
  for (int layer = 0; layer < num_layers; ++layer) {
    KVPOOL_ASSIGN_OR_RETURN(LayerCapture cap, ReadLayerCapture(files[layer]));
    if (cap.layer != layer) {
      return absl::InvalidArgumentError(
          absl::StrCat("capture ", files[layer], " holds layer ", cap.layer));
    }
    if (layer == 0) {
      head_dim = cap.head_dim;
      result.tokens = cap.tokens;
      result.sequences = static_cast<int>(cap.seq_offsets.size()) - 1;
      if (model_id.empty()) model_id = cap.model_id;
      KVPOOL_RETURN_IF_ERROR(options.quant.Validate(head_dim));
    } else if (cap.head_dim != head_dim || cap.tokens != result.tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("capture ", files[layer], " disagrees with layer 0 on shape"));
    }
    const std::vector<double> c_k = KeyTargetMatrix(cap, options.key_target);
    const std::vector<double> c_v = ValueTargetMatrix(cap, options.value_target);
    KVPOOL_ASSIGN_OR_RETURN(SpectralRotation rk, BuildRotation(c_k, head_dim, options.composition));
    KVPOOL_ASSIGN_OR_RETURN(SpectralRotation rv, BuildRotation(c_v, head_dim, options.composition));
    LayerRotation& r = rotations[layer];
    r.k = ToFloat(rk.matrix);
    r.v = ToFloat(rv.matrix);
    r.k_eig = ToFloat(rk.eigenvalues);
    r.v_eig = ToFloat(rv.eigenvalues);
    r.k_eig_ratio = EigRatio(rk.eigenvalues);
    r.v_eig_ratio = EigRatio(rv.eigenvalues);
    LayerReport rep;
    rep.layer = layer;
    rep.k_eig_ratio = r.k_eig_ratio;
    rep.v_eig_ratio = r.v_eig_ratio;
    rep.k_orthogonality = OrthogonalityError(absl::Span<const float>(r.k), head_dim);
    rep.v_orthogonality = OrthogonalityError(absl::Span<const float>(r.v), head_dim);
    result.layers.push_back(rep);
    Log(options, absl::StrFormat("layer %2d: rotations fitted (eigenvalue spread K %.3g, V %.3g)",
                                 layer, r.k_eig_ratio, r.v_eig_ratio));
  }

  QuantConfig quant = options.quant;
  ErrorOptions err_opt;
  err_opt.sink_tokens = quant.sink_tokens;
  err_opt.recent_tokens = quant.recent_tokens;
  err_opt.max_queries = options.fit_queries;

  // 2. The clip-ratio fit.
  if (options.fit_clip) {
    result.clip_grid = ClipRatioGrid(head_dim, options.clip_grid_min);
    const size_t n = result.clip_grid.size();
    result.k_error_by_ratio.assign(n, 0.0);
    result.v_error_by_ratio.assign(n, 0.0);
    for (int layer = 0; layer < num_layers; ++layer) {
      KVPOOL_ASSIGN_OR_RETURN(LayerCapture cap, ReadLayerCapture(files[layer]));
      cap.layer = 0;  // evaluated against a one-layer rotation set
      KVPOOL_ASSIGN_OR_RETURN(RotationSet set, SingleLayerSet(rotations[layer], head_dim));
      KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<LayerEvaluator> ev,
                              LayerEvaluator::Create(cap, set, err_opt));
      std::vector<double> ek(n), ev_err(n);
      for (size_t i = 0; i < n; ++i) {
        QuantConfig qk = quant, qv = quant;
        qk.clip_ratio_k = result.clip_grid[i];
        qv.clip_ratio_v = result.clip_grid[i];
        KVPOOL_ASSIGN_OR_RETURN(ek[i], ev->OutputError(qk, true, false));
        KVPOOL_ASSIGN_OR_RETURN(ev_err[i], ev->OutputError(qv, false, true));
        result.k_error_by_ratio[i] += ek[i] / num_layers;
        result.v_error_by_ratio[i] += ev_err[i] / num_layers;
      }
      result.layers[layer].best_clip_k = result.clip_grid[ArgMin(ek)];
      result.layers[layer].best_clip_v = result.clip_grid[ArgMin(ev_err)];
      Log(options,
          absl::StrFormat("layer %2d: clip fit over %d ratios, %d queries: best K %.4f "
                          "V %.4f",
                          layer, static_cast<int>(n), ev->measured_queries(),
                          result.layers[layer].best_clip_k, result.layers[layer].best_clip_v));
    }
    quant.clip_ratio_k = result.clip_grid[ArgMin(result.k_error_by_ratio)];
    quant.clip_ratio_v = result.clip_grid[ArgMin(result.v_error_by_ratio)];
    Log(options, absl::StrFormat("clip ratios fitted: K %.6g, V %.6g", quant.clip_ratio_k,
                                 quant.clip_ratio_v));
  }

  // 3. Statistics at the chosen configuration.
  for (int layer = 0; layer < num_layers; ++layer) {
    KVPOOL_ASSIGN_OR_RETURN(LayerCapture cap, ReadLayerCapture(files[layer]));
    cap.layer = 0;
    KVPOOL_ASSIGN_OR_RETURN(RotationSet set, SingleLayerSet(rotations[layer], head_dim));
    KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<LayerEvaluator> ev,
                            LayerEvaluator::Create(cap, set, err_opt));
    KVPOOL_ASSIGN_OR_RETURN(result.layers[layer].stats, ev->Stats(quant));
  }

  // 4. The model codec.
  std::vector<std::vector<float>> k, v, k_eig, v_eig;
  for (LayerRotation& r : rotations) {
    k.push_back(r.k);
    v.push_back(r.v);
    k_eig.push_back(r.k_eig);
    v_eig.push_back(r.v_eig);
  }
  KVPOOL_ASSIGN_OR_RETURN(RotationSet set,
                          RotationSet::Dense(num_layers, head_dim, std::move(k), std::move(v)));
  std::string objective =
      absl::StrCat(ObjectiveLabel(KeyTargetName(options.key_target), options.composition), "/",
                   ObjectiveLabel(ValueTargetName(options.value_target), options.composition));

  Json j;
  j["tool"] = "kvpool-calibrate";
  j["tokens"] = result.tokens;
  j["sequences"] = result.sequences;
  j["key_target"] = std::string(KeyTargetName(options.key_target));
  j["value_target"] = std::string(ValueTargetName(options.value_target));
  j["composition"] = std::string(CompositionName(options.composition));
  j["error_view"] = {{"sink_tokens", err_opt.sink_tokens},
                     {"recent_tokens", err_opt.recent_tokens},
                     {"queries_per_layer", err_opt.max_queries}};
  if (options.fit_clip) {
    j["clip_fit"] = {{"objective", "mean over layers of relative attention-output error"},
                     {"grid", result.clip_grid},
                     {"k_error", result.k_error_by_ratio},
                     {"v_error", result.v_error_by_ratio},
                     {"clip_ratio_k", quant.clip_ratio_k},
                     {"clip_ratio_v", quant.clip_ratio_v}};
  } else {
    j["clip_fit"] = nullptr;
  }
  Json layers = Json::array();
  for (const LayerReport& r : result.layers) {
    Json l = {{"layer", r.layer},
              {"k_clip_rate", r.stats.k_clip_rate},
              {"v_clip_rate", r.stats.v_clip_rate},
              {"k_rel_error", r.stats.k_rel_error},
              {"v_rel_error", r.stats.v_rel_error},
              {"attn_out_rel_error", r.stats.attn_out_rel_error},
              {"k_eig_ratio", FiniteOrNull(r.k_eig_ratio)},
              {"v_eig_ratio", FiniteOrNull(r.v_eig_ratio)}};
    if (options.fit_clip) {
      l["best_clip_k"] = r.best_clip_k;
      l["best_clip_v"] = r.best_clip_v;
    }
    layers.push_back(std::move(l));
  }
  j["layers"] = std::move(layers);
  return CalibrationResult{ModelCodec{model_id, std::move(set), quant, /*v_prerotated=*/false,
                                      std::move(objective), std::move(k_eig), std::move(v_eig)},
                           std::move(result.layers),
                           std::move(result.clip_grid),
                           std::move(result.k_error_by_ratio),
                           std::move(result.v_error_by_ratio),
                           result.tokens,
                           result.sequences,
                           j.dump()};
}

absl::StatusOr<std::string> SerializeCalibrationFile(const CalibrationResult& result) {
  KVPOOL_ASSIGN_OR_RETURN(SafetensorsFile base,
                          SafetensorsFile::Parse(SerializeRotationFile(result.codec)));
  SafetensorsWriter w;
  for (const auto& [key, value] : base.metadata()) w.SetMetadata(key, value);
  w.SetMetadata("calibration", result.calibration_json);
  for (const SafetensorsTensor& t : base.tensors()) w.AddTensor(t.name, t.dtype, t.shape, t.bytes);
  return w.Serialize();
}

absl::Status WriteCalibrationFile(const CalibrationResult& result, const std::string& path) {
  KVPOOL_ASSIGN_OR_RETURN(std::string bytes, SerializeCalibrationFile(result));
  KVPOOL_ASSIGN_OR_RETURN(ModelCodec check, ParseRotationFile(bytes));
  if (CodecVersionHex(check) != CodecVersionHex(result.codec)) {
    return absl::InternalError("calibration: the written file reads back a different codec");
  }
  const std::string tmp = path + ".tmp";
  {
    std::FILE* f = std::fopen(tmp.c_str(), "wb");
    if (f == nullptr) return absl::PermissionDeniedError(absl::StrCat("cannot write ", tmp));
    const size_t wrote = std::fwrite(bytes.data(), 1, bytes.size(), f);
    const bool ok = std::fclose(f) == 0 && wrote == bytes.size();
    if (!ok) return absl::DataLossError(absl::StrCat("short write to ", tmp));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot rename ", tmp, ": ", ec.message()));
  return absl::OkStatus();
}

std::string FormatReport(const CalibrationResult& r) {
  std::string out = absl::StrFormat(
      "model %s, %d layers, D %d, %d calibration tokens in %d sequences, objective %s\n"
      "quant: %d-bit %s, G=D, clip K %.6g V %.6g%s, codec %s\n",
      r.codec.model_id, r.codec.rotations.num_layers(), r.codec.rotations.head_dim(), r.tokens,
      r.sequences, r.codec.objective, r.codec.quant.bits, QuantMethodName(r.codec.quant.method),
      r.codec.quant.clip_ratio_k, r.codec.quant.clip_ratio_v,
      r.clip_grid.empty() ? " (given)" : " (fitted)", CodecVersionHex(r.codec));
  absl::StrAppend(&out,
                  "layer  eig K      eig V      clip K  clip V  relerr K  relerr V  "
                  "attn-out err  best K  best V  orth K   orth V\n");
  for (const LayerReport& l : r.layers) {
    absl::StrAppend(
        &out, absl::StrFormat("%5d  %-9.3g  %-9.3g  %6.4f  %6.4f  %8.5f  %8.5f  %12.6f  %6.4f  "
                              "%6.4f  %.1e  %.1e\n",
                              l.layer, l.k_eig_ratio, l.v_eig_ratio, l.stats.k_clip_rate,
                              l.stats.v_clip_rate, l.stats.k_rel_error, l.stats.v_rel_error,
                              l.stats.attn_out_rel_error, l.best_clip_k, l.best_clip_v,
                              l.k_orthogonality, l.v_orthogonality));
  }
  if (!r.clip_grid.empty()) {
    absl::StrAppend(&out,
                    "clip fit (mean relative attention-output error over layers):\n"
                    "ratio     K only      V only\n");
    for (size_t i = 0; i < r.clip_grid.size(); ++i) {
      absl::StrAppend(&out, absl::StrFormat("%.4f  %10.6f  %10.6f\n", r.clip_grid[i],
                                            r.k_error_by_ratio[i], r.v_error_by_ratio[i]));
    }
  }
  return out;
}

}  // namespace kvpool::calibration
