// What decides how a model's K/V rows become stored codes: the quantizer settings and the
// paged block geometry. One QuantConfig per model; it is part of the codec version.
//
//   QuantConfig cfg;                 // OSCAR defaults: INT2 uniform, G = D, clip 0.96 / 0.92
//   KVPOOL_RETURN_IF_ERROR(cfg.Validate(/*head_dim=*/128));
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvpool {

// Which of the two tensors of a KV cache a row belongs to.
enum class KvTensor : uint8_t { kKey = 0, kValue = 1 };

// How a clipped row is turned into codes.
enum class QuantMethod : uint8_t {
  kUniform = 0,   // asymmetric min/max affine, round half up (docs/oscar-method.md section 7)
  kLloydMax = 1,  // Gaussian Lloyd-Max buckets, uniform stretched levels (section 8); G = D only
  kBypass = 2,    // no quantization: history blocks keep the rotated BF16 rows (exactness path)
};

// Storage type of the per-group scale and minimum.
enum class ScaleDtype : uint8_t { kFp16 = 0, kBf16 = 1 };

struct QuantConfig {
  int bits = 2;        // 2 or 4 (ignored by kBypass, which stores 16-bit BF16 rows)
  int group_size = 0;  // G, dims per (scale, min) pair; 0 means G = D
  QuantMethod method = QuantMethod::kUniform;
  ScaleDtype scale_dtype = ScaleDtype::kFp16;
  float clip_ratio_k = 0.96f;  // <= 0 disables clipping (section 6)
  float clip_ratio_v = 0.92f;
  int block_tokens = 16;    // tokens per paged block: power of two >= 8
  int sink_tokens = 64;     // S0: BF16 prefix, multiple of 8, at most 8192
  int recent_tokens = 256;  // W: BF16 recent window, multiple of 8, at most 8192
  int demotion_batch = 16;  // recent tokens demoted at once; divides block_tokens

  // Effective group size for rows of `head_dim` dims.
  int EffectiveGroupSize(int head_dim) const { return group_size == 0 ? head_dim : group_size; }
  // Bits stored per element: 16 for kBypass, else `bits`.
  int StoredBits() const { return method == QuantMethod::kBypass ? 16 : bits; }
  float ClipRatio(KvTensor t) const { return t == KvTensor::kKey ? clip_ratio_k : clip_ratio_v; }

  // Checks every field against `head_dim` (a power of two in [32, 256]). InvalidArgument with
  // a message naming the offending field otherwise.
  absl::Status Validate(int head_dim) const;
};

// Head dims kvpool supports: powers of two from 32 to 256.
bool IsSupportedHeadDim(int head_dim);

absl::string_view QuantMethodName(QuantMethod m);  // "uniform", "lloyd_max", "bypass"
absl::StatusOr<QuantMethod> ParseQuantMethod(absl::string_view name);
absl::string_view ScaleDtypeName(ScaleDtype d);  // "fp16", "bf16"
absl::StatusOr<ScaleDtype> ParseScaleDtype(absl::string_view name);

}  // namespace kvpool
