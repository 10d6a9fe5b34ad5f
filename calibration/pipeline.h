// The calibration pipeline behind `kvpool-calibrate`: captures in, a rotation file out.
//
// For each layer: the key and value targets (fit.h), their float64 eigendecompositions and the
// composed rotations. Then, optionally, the offline clip-ratio fit: for every candidate ratio
// r = c / D on a grid, the relative attention-output error on the calibration data with only K
// (resp. only V) passed through kvpool's codec (sink and recent tiers in BF16, as served); the
// model's K and V ratios are the ones with the lowest error averaged over layers (the codec
// holds one pair per model; the per-layer optimum is recorded in the statistics). Finally the
// per-layer calibration statistics at the chosen configuration.
//
// The rotation file is kernels/rotation_file.h's format (dense kind) plus one extra metadata
// entry, "calibration": a JSON object with the settings, the fit's error curves and, under
// "layers", per layer: k_clip_rate, v_clip_rate, k_rel_error, v_rel_error,
// attn_out_rel_error, k_eig_ratio, v_eig_ratio (largest / smallest eigenvalue).
//
//   CalibrateOptions opt;
//   opt.captures_dir = "build/calibration/captures";
//   KVPOOL_ASSIGN_OR_RETURN(CalibrationResult r, RunCalibration(opt));
//   KVPOOL_RETURN_IF_ERROR(WriteCalibrationFile(r, "smollm2.rotation.safetensors"));
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "calibration/fit.h"
#include "kernels/rotation_file.h"

namespace kvpool::calibration {

struct CalibrateOptions {
  std::string captures_dir;
  std::string model_id;  // empty: the captures' model_id
  KeyTarget key_target = KeyTarget::kQueryMoment;
  ValueTarget value_target = ValueTarget::kLogitWeighted;
  Composition composition = Composition::kUHPbr;
  QuantConfig quant;  // bits, quantizer, scale dtype, tiers; clip ratios unless fitted
  bool fit_clip = true;
  double clip_grid_min = 0.70;  // smallest candidate ratio
  int fit_queries = 256;        // measured query positions per layer
  int max_layers = 0;           // > 0: only the first max_layers layers (tests)
  // Progress lines (one per layer and phase); may be empty.
  std::function<void(const std::string&)> log;
};

struct LayerReport {
  int layer = 0;
  double k_eig_ratio = 0, v_eig_ratio = 0;
  double k_orthogonality = 0, v_orthogonality = 0;  // max |M M^T - I| as stored (float32)
  float best_clip_k = 0, best_clip_v = 0;           // per-layer optimum of the fit
  LayerQuantStats stats;                            // at the model's chosen configuration
};

struct CalibrationResult {
  ModelCodec codec;
  std::vector<LayerReport> layers;
  std::vector<float> clip_grid;
  std::vector<double> k_error_by_ratio, v_error_by_ratio;  // mean over layers, per grid entry
  int tokens = 0, sequences = 0;
  std::string calibration_json;  // the "calibration" metadata entry
};

// Runs the whole fit. Errors from reading captures, the eigensolver or the codec pass through.
absl::StatusOr<CalibrationResult> RunCalibration(const CalibrateOptions& options);

// The rotation file's bytes (SerializeRotationFile plus the "calibration" metadata entry).
absl::StatusOr<std::string> SerializeCalibrationFile(const CalibrationResult& result);
// Writes it atomically (temporary file + rename) and checks that ReadRotationFile accepts it.
absl::Status WriteCalibrationFile(const CalibrationResult& result, const std::string& path);

// A human-readable per-layer table of the result.
std::string FormatReport(const CalibrationResult& result);

}  // namespace kvpool::calibration
