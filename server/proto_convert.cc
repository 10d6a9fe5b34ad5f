#include "server/proto_convert.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvpool::server {

absl::Status CheckPayload(v1::DType dtype, absl::string_view bytes, size_t values,
                          const char* what) {
  const size_t elem = DTypeSize(dtype);
  if (elem == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype of ", what, " must be DTYPE_BF16, DTYPE_FP16 or DTYPE_FP32, got ",
                     v1::DType_Name(dtype).empty() ? std::to_string(static_cast<int>(dtype))
                                                   : v1::DType_Name(dtype)));
  }
  if (bytes.size() != values * elem) {
    return absl::InvalidArgumentError(absl::StrCat(what, " has ", bytes.size(), " bytes, expected ",
                                                   values, " values x ", elem,
                                                   " bytes = ", values * elem));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<Bf16>> DecodeToBf16(v1::DType dtype, absl::string_view bytes,
                                               size_t values, const char* what) {
  if (absl::Status s = CheckPayload(dtype, bytes, values, what); !s.ok()) return s;
  std::vector<Bf16> out(values);
  // Payloads are little-endian, as is every machine kvpoold runs on.
  if (dtype == v1::DTYPE_BF16) {
    std::memcpy(out.data(), bytes.data(), bytes.size());
  } else if (dtype == v1::DTYPE_FP16) {
    for (size_t i = 0; i < values; ++i) {
      uint16_t w;
      std::memcpy(&w, bytes.data() + 2 * i, 2);
      out[i] = Bf16::FromFloat(Fp16::FromBits(w).ToFloat());
    }
  } else {
    for (size_t i = 0; i < values; ++i) {
      float f;
      std::memcpy(&f, bytes.data() + 4 * i, 4);
      out[i] = Bf16::FromFloat(f);
    }
  }
  return out;
}

absl::Status DecodeToFloat(v1::DType dtype, absl::string_view bytes, absl::Span<float> out,
                           const char* what) {
  const size_t values = out.size();
  if (absl::Status s = CheckPayload(dtype, bytes, values, what); !s.ok()) return s;
  if (dtype == v1::DTYPE_FP32) {
    if (values > 0) std::memcpy(out.data(), bytes.data(), bytes.size());
  } else {
    for (size_t i = 0; i < values; ++i) {
      uint16_t w;
      std::memcpy(&w, bytes.data() + 2 * i, 2);
      out[i] = dtype == v1::DTYPE_BF16 ? Bf16::FromBits(w).ToFloat() : Fp16::FromBits(w).ToFloat();
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<QuantConfig> QuantFromProto(const v1::QuantConfig& q) {
  QuantConfig c;
  if (q.has_bits()) c.bits = q.bits();
  if (q.has_group_size()) c.group_size = q.group_size();
  switch (q.method()) {
    case v1::QUANT_METHOD_UNSPECIFIED:
    case v1::QUANT_METHOD_UNIFORM:
      c.method = QuantMethod::kUniform;
      break;
    case v1::QUANT_METHOD_LLOYD_MAX:
      c.method = QuantMethod::kLloydMax;
      break;
    case v1::QUANT_METHOD_BYPASS:
      c.method = QuantMethod::kBypass;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown quant method ", static_cast<int>(q.method())));
  }
  switch (q.scale_dtype()) {
    case v1::SCALE_DTYPE_UNSPECIFIED:
    case v1::SCALE_DTYPE_FP16:
      c.scale_dtype = ScaleDtype::kFp16;
      break;
    case v1::SCALE_DTYPE_BF16:
      c.scale_dtype = ScaleDtype::kBf16;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown scale dtype ", static_cast<int>(q.scale_dtype())));
  }
  if (q.has_clip_ratio_k()) c.clip_ratio_k = q.clip_ratio_k();
  if (q.has_clip_ratio_v()) c.clip_ratio_v = q.clip_ratio_v();
  if (q.has_block_tokens()) c.block_tokens = q.block_tokens();
  if (q.has_sink_tokens()) c.sink_tokens = q.sink_tokens();
  if (q.has_recent_tokens()) c.recent_tokens = q.recent_tokens();
  if (q.has_demotion_batch()) c.demotion_batch = q.demotion_batch();
  return c;
}

void QuantToProto(const QuantConfig& q, v1::QuantConfig* out) {
  out->set_bits(q.bits);
  out->set_group_size(q.group_size);
  switch (q.method) {
    case QuantMethod::kUniform:
      out->set_method(v1::QUANT_METHOD_UNIFORM);
      break;
    case QuantMethod::kLloydMax:
      out->set_method(v1::QUANT_METHOD_LLOYD_MAX);
      break;
    case QuantMethod::kBypass:
      out->set_method(v1::QUANT_METHOD_BYPASS);
      break;
  }
  out->set_scale_dtype(q.scale_dtype == ScaleDtype::kBf16 ? v1::SCALE_DTYPE_BF16
                                                          : v1::SCALE_DTYPE_FP16);
  out->set_clip_ratio_k(q.clip_ratio_k);
  out->set_clip_ratio_v(q.clip_ratio_v);
  out->set_block_tokens(q.block_tokens);
  out->set_sink_tokens(q.sink_tokens);
  out->set_recent_tokens(q.recent_tokens);
  out->set_demotion_batch(q.demotion_batch);
}

absl::StatusOr<RotationKind> RotationKindFromProto(v1::RotationKind k) {
  switch (k) {
    case v1::ROTATION_KIND_IDENTITY:
      return RotationKind::kIdentity;
    case v1::ROTATION_KIND_HADAMARD:
      return RotationKind::kHadamard;
    case v1::ROTATION_KIND_RANDOMIZED_HADAMARD:
      return RotationKind::kRandomizedHadamard;
    case v1::ROTATION_KIND_DENSE:
      return RotationKind::kDense;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("rotation kind must be set (identity, hadamard, randomized_hadamard), got ",
                       static_cast<int>(k)));
  }
}

v1::RotationKind RotationKindToProto(RotationKind k) {
  switch (k) {
    case RotationKind::kIdentity:
      return v1::ROTATION_KIND_IDENTITY;
    case RotationKind::kHadamard:
      return v1::ROTATION_KIND_HADAMARD;
    case RotationKind::kRandomizedHadamard:
      return v1::ROTATION_KIND_RANDOMIZED_HADAMARD;
    case RotationKind::kDense:
      return v1::ROTATION_KIND_DENSE;
  }
  return v1::ROTATION_KIND_UNSPECIFIED;
}

void FillBlockLayout(const Model& m, v1::BlockLayoutDescriptor* out) {
  const BlockLayout& l = m.block_layout;
  out->set_format_version(kBlockFormatVersion);
  out->set_tokens(l.tokens);
  out->set_kv_heads(l.kv_heads);
  out->set_head_dim(l.head_dim);
  out->set_group_size(l.group_size);
  out->set_bits(l.bits);
  out->set_scale_dtype(m.codec.quant.scale_dtype == ScaleDtype::kBf16 ? v1::SCALE_DTYPE_BF16
                                                                      : v1::SCALE_DTYPE_FP16);
  out->set_code_bytes_per_row(l.code_bytes_per_row());
  out->set_groups_per_row(l.groups_per_row());
  out->set_meta_bytes_per_row(l.meta_bytes_per_row());
  out->set_head_segment_bytes(l.head_segment_bytes());
  out->set_block_bytes(l.block_bytes());
}

void FillModelInfo(const Model& m, uint64_t sequences, uint64_t pool_bytes, v1::ModelInfo* out) {
  out->set_model_id(m.id);
  v1::ModelShape* shape = out->mutable_shape();
  shape->set_num_layers(m.num_layers);
  shape->set_q_heads(m.q_heads);
  shape->set_kv_heads(m.kv_heads);
  shape->set_head_dim(m.head_dim);
  out->set_codec_version(m.version_hex);
  QuantToProto(m.codec.quant, out->mutable_quant());
  // Responses carry the effective G (the config's 0 means G = D).
  out->mutable_quant()->set_group_size(m.codec.quant.EffectiveGroupSize(m.head_dim));
  out->set_rotation_kind(RotationKindToProto(m.codec.rotations.kind()));
  out->set_rotation_seed(m.codec.rotations.seed());
  out->set_objective(m.codec.objective);
  out->set_v_prerotated(m.codec.v_prerotated);
  FillBlockLayout(m, out->mutable_block_layout());
  out->set_bf16_page_bytes(m.bf16_page_bytes);
  out->set_sequences(sequences);
  out->set_pool_bytes(pool_bytes);
  out->set_registered_unix_micros(m.registered_unix_micros);
}

void FillSequenceInfo(const SequenceInfo& s, v1::SequenceInfo* out) {
  out->set_sequence_id(s.id);
  out->set_model_id(s.model_id);
  out->set_tenant(s.tenant);
  switch (s.state) {
    case SequenceState::kPrefill:
      out->set_state(v1::SEQUENCE_STATE_PREFILL);
      break;
    case SequenceState::kDecode:
      out->set_state(v1::SEQUENCE_STATE_DECODE);
      break;
    case SequenceState::kSealed:
      out->set_state(v1::SEQUENCE_STATE_SEALED);
      break;
  }
  out->set_total_tokens(s.total());
  out->set_sink_tokens(s.sink);
  out->set_history_tokens(s.history);
  out->set_recent_tokens(s.recent);
  out->set_reused_tokens(s.reused_tokens);
  out->set_has_token_ids(s.has_token_ids);
  out->set_pool_bytes(s.pool_bytes);
  out->set_shared_bytes(s.shared_bytes);
  out->set_bf16_equivalent_bytes(s.bf16_equivalent_bytes);
}

void FillPrefixUnit(const PrefixUnitKey& k, v1::PrefixUnit* out) {
  out->set_hash(PrefixHashHex(k.hash));
  out->set_kind(k.kind == PrefixUnitKind::kSink ? v1::PREFIX_UNIT_KIND_SINK
                                                : v1::PREFIX_UNIT_KIND_BLOCK);
  out->set_token_start(k.token_start);
  out->set_token_count(k.token_count);
}

}  // namespace kvpool::server
