// Rotation files: what kvpoold loads per model (kvpool rotation format 1, a safetensors file).
//
// Tensors (float32):
//   layers.<i>.k_rotation   [D, D]   row-major, applied as x * M       (dense kind only)
//   layers.<i>.v_rotation   [D, D]
//   layers.<i>.k_eigenvalues, layers.<i>.v_eigenvalues   [D]   optional calibration statistics
// Metadata (all strings):
//   format = "kvpool-rotation", format_version = "1", model_id, num_layers, head_dim,
//   rotation_kind (identity | hadamard | randomized_hadamard | dense), hadamard_seed (decimal,
//   randomized_hadamard only), objective (free text, e.g. "qqt_r_h_pbr/sst_r_h_pbr"),
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
