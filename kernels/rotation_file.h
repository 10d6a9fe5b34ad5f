// Rotation files: what kvpoold loads per model (kvpool rotation format 1 or 2, a safetensors file).
//
// Tensors (float32):
//   layers.<i>.k_rotation   [D, D]   row-major, applied as x * M       (dense kind only)
//   layers.<i>.v_rotation   [D, D]
//   layers.<i>.k_eigenvalues, layers.<i>.v_eigenvalues   [D]   optional calibration statistics
//   layers.<i>.clip_ratios  [2]      optional (format 2 only, all layers or none): layer i's
//                                    (K, V) clip ratios, replacing clip_ratio_k/v for its rows
// Metadata (all strings):
//   format = "kvpool-rotation", format_version = "1" ("2" exactly when the file holds per-layer
//   clip ratios, so files without them stay readable by older builds), model_id, num_layers,
//   head_dim, rotation_kind (identity | hadamard | randomized_hadamard | dense), hadamard_seed
//   (decimal, randomized_hadamard only), objective (free text, e.g. "qqt_r_h_pbr/sst_r_h_pbr"),
//   v_prerotated ("true" when the engine folds M_V into its V projection),
//   bits, group_size, quantizer, scale_dtype, clip_ratio_k, clip_ratio_v (shortest round-trip
//   decimal), block_tokens, sink_tokens, recent_tokens, demotion_batch,
//   codec_version (64 hex digits, see codec_version.h; checked on load when present).
//
//   KVPOOL_ASSIGN_OR_RETURN(ModelCodec model, ReadRotationFile(path));
//   std::string bytes = SerializeRotationFile(model);
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/codec_config.h"
#include "kernels/rotation.h"

namespace kvpool {

// Everything that decides how one model's KV is stored: its rotations and quant config.
struct ModelCodec {
  std::string model_id;
  RotationSet rotations;
  QuantConfig quant;
  bool v_prerotated = false;
  std::string objective;
  // Optional per-layer eigenvalues from calibration (empty when absent).
  std::vector<std::vector<float>> k_eigenvalues;
  std::vector<std::vector<float>> v_eigenvalues;
  // Optional per-layer clip ratios: both empty (every layer uses quant.clip_ratio_k/v), or one
  // entry per layer each. They are part of the codec version.
  std::vector<float> layer_clip_ratio_k{};
  std::vector<float> layer_clip_ratio_v{};

  bool has_layer_clips() const { return !layer_clip_ratio_k.empty(); }
  // The quant config of layer `layer`'s rows: `quant` with that layer's clip ratios when the
  // model has per-layer ones. `layer` must be in [0, num_layers).
  QuantConfig LayerQuant(int layer) const;
  // InvalidArgument unless the per-layer clip ratios are absent, or one per layer each with
  // every layer's quant config valid.
  absl::Status ValidateLayerClips() const;
};

// Parses a rotation file. InvalidArgument naming the problem: missing or malformed metadata,
// a missing layer, a wrong shape, a non-orthogonal matrix, an invalid quant config, or a stored
// codec_version that does not match the content.
absl::StatusOr<ModelCodec> ParseRotationFile(std::string bytes);
absl::StatusOr<ModelCodec> ReadRotationFile(const std::string& path);

// Serializes `model` (with its codec_version) to the bytes of a rotation file.
std::string SerializeRotationFile(const ModelCodec& model);
absl::Status WriteRotationFile(const ModelCodec& model, const std::string& path);

}  // namespace kvpool
