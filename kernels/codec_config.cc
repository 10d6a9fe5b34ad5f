#include "kernels/codec_config.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace kvpool {
namespace {

bool IsPowerOfTwo(int v) { return v > 0 && (v & (v - 1)) == 0; }

constexpr int kMinBlockTokens = 8;
constexpr int kMaxBlockTokens = 1024;
// Sink and recent sizes are multiples of the reference allocator's 8-token INT2 page.
constexpr int kWindowQuantum = 8;
// The BF16 windows are meant to be small beside the INT2 history; a bound keeps a model from
// storing everything in BF16.
constexpr int kMaxWindowTokens = 8192;
// Smallest group: keeps every group byte-aligned for 2- and 4-bit codes.
constexpr int kMinGroupSize = 8;

absl::Status CheckClipRatio(const char* field, float ratio) {
  if (!std::isfinite(ratio)) {
    return absl::InvalidArgumentError(absl::StrCat(field, " must be finite, got ", ratio));
  }
  if (ratio > 1.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be <= 1 (<= 0 disables clipping), got ", ratio));
  }
  return absl::OkStatus();
}

absl::Status CheckWindow(const char* field, int tokens) {
  if (tokens < 0 || tokens > kMaxWindowTokens || tokens % kWindowQuantum != 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, " must be a multiple of ", kWindowQuantum,
                                                   " in [0, ", kMaxWindowTokens, "], got ",
                                                   tokens));
  }
  return absl::OkStatus();
}

}  // namespace

bool IsSupportedHeadDim(int head_dim) {
  return IsPowerOfTwo(head_dim) && head_dim >= 32 && head_dim <= 256;
}

absl::Status QuantConfig::Validate(int head_dim) const {
  if (!IsSupportedHeadDim(head_dim)) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim must be a power of two in [32, 256], got ", head_dim));
  }
  // Enums may come from untrusted integers (config files, RPCs).
  if (method != QuantMethod::kUniform && method != QuantMethod::kLloydMax &&
      method != QuantMethod::kBypass) {
    return absl::InvalidArgumentError(
        absl::StrCat("method: unknown quantizer ", static_cast<int>(method)));
  }
  if (scale_dtype != ScaleDtype::kFp16 && scale_dtype != ScaleDtype::kBf16) {
    return absl::InvalidArgumentError(
        absl::StrCat("scale_dtype: unknown dtype ", static_cast<int>(scale_dtype)));
  }
  // Checked for bypass too, so that every accepted config names a real quantized format.
  if (bits != 2 && bits != 4) {
    return absl::InvalidArgumentError(absl::StrCat("bits must be 2 or 4, got ", bits));
  }
  if (group_size != 0) {
    if (!IsPowerOfTwo(group_size) || group_size < kMinGroupSize) {
      return absl::InvalidArgumentError(
          absl::StrCat("group_size must be 0 (= head_dim) or a power of two >= ", kMinGroupSize,
                       ", got ", group_size));
    }
    if (head_dim % group_size != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("group_size ", group_size, " does not divide head_dim ", head_dim));
    }
  }
  KVPOOL_RETURN_IF_ERROR(CheckClipRatio("clip_ratio_k", clip_ratio_k));
  KVPOOL_RETURN_IF_ERROR(CheckClipRatio("clip_ratio_v", clip_ratio_v));
  if (method == QuantMethod::kLloydMax) {
    // docs/oscar-method.md section 8: one group per row, INT2 only, and the row must be clipped.
    if (bits != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("bits must be 2 for the lloyd_max quantizer, got ", bits));
    }
    if (EffectiveGroupSize(head_dim) != head_dim) {
      return absl::InvalidArgumentError(absl::StrCat("group_size must be 0 or head_dim (", head_dim,
                                                     ") for the lloyd_max quantizer, got ",
                                                     group_size));
    }
    if (!(clip_ratio_k > 0.0f) || !(clip_ratio_v > 0.0f)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "clip_ratio_k and clip_ratio_v must be > 0 for the lloyd_max quantizer, got ",
          clip_ratio_k, " and ", clip_ratio_v));
    }
  }
  if (!IsPowerOfTwo(block_tokens) || block_tokens < kMinBlockTokens ||
      block_tokens > kMaxBlockTokens) {
    return absl::InvalidArgumentError(absl::StrCat("block_tokens must be a power of two in [",
                                                   kMinBlockTokens, ", ", kMaxBlockTokens,
                                                   "], got ", block_tokens));
  }
  KVPOOL_RETURN_IF_ERROR(CheckWindow("sink_tokens", sink_tokens));
  KVPOOL_RETURN_IF_ERROR(CheckWindow("recent_tokens", recent_tokens));
  if (demotion_batch < 1 || block_tokens % demotion_batch != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("demotion_batch must be >= 1 and divide "
                     "block_tokens ",
                     block_tokens, ", got ", demotion_batch));
  }
  return absl::OkStatus();
}

absl::string_view QuantMethodName(QuantMethod m) {
  switch (m) {
    case QuantMethod::kUniform:
      return "uniform";
    case QuantMethod::kLloydMax:
      return "lloyd_max";
    case QuantMethod::kBypass:
      return "bypass";
  }
  return "unknown";
}

absl::StatusOr<QuantMethod> ParseQuantMethod(absl::string_view name) {
  for (QuantMethod m : {QuantMethod::kUniform, QuantMethod::kLloydMax, QuantMethod::kBypass}) {
    if (name == QuantMethodName(m)) return m;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown quantizer method \"", name,
                                                 "\" (expected uniform, lloyd_max or bypass)"));
}

absl::string_view ScaleDtypeName(ScaleDtype d) {
  switch (d) {
    case ScaleDtype::kFp16:
      return "fp16";
    case ScaleDtype::kBf16:
      return "bf16";
  }
  return "unknown";
}

absl::StatusOr<ScaleDtype> ParseScaleDtype(absl::string_view name) {
  for (ScaleDtype d : {ScaleDtype::kFp16, ScaleDtype::kBf16}) {
    if (name == ScaleDtypeName(d)) return d;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown scale dtype \"", name, "\" (expected fp16 or bf16)"));
}

}  // namespace kvpool
