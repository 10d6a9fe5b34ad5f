#include "calibration/codec_c_api.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/bf16.h"
#include "kernels/codec_version.h"
#include "common/status_macros.h"
#include "kernels/rotation_file.h"
#include "kernels/row_codec.h"

namespace kvpool::calibration {
namespace {

struct EvalCodec {
  ModelCodec model;
  RowCodec codec;
};

void SetError(const absl::Status& s, char* err, int err_len) {
  if (err == nullptr || err_len <= 0) return;
  const std::string msg = s.ToString();
  const size_t n = std::min(msg.size(), static_cast<size_t>(err_len - 1));
  std::memcpy(err, msg.data(), n);
  err[n] = '\0';
}

absl::StatusOr<std::unique_ptr<EvalCodec>> Create(const std::string& rotation, int num_layers,
                                                  int head_dim, int bits,
                                                  const std::string& quantizer,
                                                  const std::string& scale_dtype, float clip_k,
                                                  float clip_v, bool use_file_quant) {
  QuantConfig quant;
  quant.bits = bits;
  quant.group_size = 0;
  KVPOOL_ASSIGN_OR_RETURN(quant.method, ParseQuantMethod(quantizer));
  KVPOOL_ASSIGN_OR_RETURN(quant.scale_dtype, ParseScaleDtype(scale_dtype));
  quant.clip_ratio_k = clip_k;
  quant.clip_ratio_v = clip_v;
  if (rotation == "identity" || rotation == "hadamard") {
    if (use_file_quant) return absl::InvalidArgumentError("use_file_quant needs a rotation file");
    KVPOOL_ASSIGN_OR_RETURN(RotationSet set, rotation == "identity"
                                                 ? RotationSet::Identity(num_layers, head_dim)
                                                 : RotationSet::Hadamard(num_layers, head_dim));
    KVPOOL_RETURN_IF_ERROR(quant.Validate(head_dim));
    KVPOOL_ASSIGN_OR_RETURN(RowCodec codec, RowCodec::Create(quant, head_dim));
    return std::make_unique<EvalCodec>(
        EvalCodec{ModelCodec{"eval", std::move(set), quant, false, rotation, {}, {}}, codec});
  }
  KVPOOL_ASSIGN_OR_RETURN(ModelCodec model, ReadRotationFile(rotation));
  if (!use_file_quant) {
    quant.block_tokens = model.quant.block_tokens;
    quant.sink_tokens = model.quant.sink_tokens;
    quant.recent_tokens = model.quant.recent_tokens;
    quant.demotion_batch = model.quant.demotion_batch;
    KVPOOL_RETURN_IF_ERROR(quant.Validate(model.rotations.head_dim()));
    model.quant = quant;
  }
  KVPOOL_ASSIGN_OR_RETURN(RowCodec codec,
                          RowCodec::Create(model.quant, model.rotations.head_dim()));
  return std::make_unique<EvalCodec>(EvalCodec{std::move(model), codec});
}

absl::Status RoundTrip(const EvalCodec& c, int layer, int tensor, int64_t rows, const float* in,
                       float* tier, float* history) {
  const RotationSet& rot = c.model.rotations;
  const int d = rot.head_dim();
  if (layer < 0 || layer >= rot.num_layers() || (tensor != 0 && tensor != 1) || rows < 0 ||
      in == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("roundtrip: bad layer ", layer, ", tensor ", tensor, " or rows ", rows));
  }
  const KvTensor t = tensor == 0 ? KvTensor::kKey : KvTensor::kValue;
  const size_t n = static_cast<size_t>(rows) * d;
  std::vector<Bf16> arrived(n), rotated(n);
  for (size_t i = 0; i < n; ++i) arrived[i] = Bf16::FromFloat(in[i]);
  KVPOOL_RETURN_IF_ERROR(rot.RotateBf16(layer, t, arrived, absl::MakeSpan(rotated)));
  std::vector<float> buf(n);
  if (tier != nullptr) {
    for (size_t i = 0; i < n; ++i) buf[i] = rotated[i].ToFloat();
    KVPOOL_RETURN_IF_ERROR(rot.Unrotate(layer, t, buf, absl::MakeSpan(tier, n)));
  }
  if (history != nullptr) {
    std::vector<uint8_t> codes(c.codec.layout().code_bytes_per_row());
    std::vector<GroupMeta> meta(std::max<size_t>(1, c.codec.layout().groups_per_row()));
    for (int64_t r = 0; r < rows; ++r) {
      const size_t off = static_cast<size_t>(r) * d;
      KVPOOL_RETURN_IF_ERROR(
          c.codec.Encode(t, absl::MakeConstSpan(&rotated[off], d), codes.data(), meta.data()));
      c.codec.Decode(codes.data(), meta.data(), absl::MakeSpan(&buf[off], d));
    }
    KVPOOL_RETURN_IF_ERROR(rot.Unrotate(layer, t, buf, absl::MakeSpan(history, n)));
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvpool::calibration

extern "C" {

void* kvpool_eval_codec_create(const char* rotation, int num_layers, int head_dim, int bits,
                               const char* quantizer, const char* scale_dtype, float clip_k,
                               float clip_v, int use_file_quant, char* err, int err_len) {
  if (rotation == nullptr || quantizer == nullptr || scale_dtype == nullptr) {
    kvpool::calibration::SetError(absl::InvalidArgumentError("null argument"), err, err_len);
    return nullptr;
  }
  auto c = kvpool::calibration::Create(rotation, num_layers, head_dim, bits, quantizer, scale_dtype,
                                       clip_k, clip_v, use_file_quant != 0);
  if (!c.ok()) {
    kvpool::calibration::SetError(c.status(), err, err_len);
    return nullptr;
  }
  return c->release();
}

int kvpool_eval_codec_roundtrip(const void* codec, int layer, int tensor, int64_t rows,
                                const float* in, float* tier, float* history, char* err,
                                int err_len) {
  if (codec == nullptr) {
    kvpool::calibration::SetError(absl::InvalidArgumentError("null codec"), err, err_len);
    return -1;
  }
  const absl::Status s =
      kvpool::calibration::RoundTrip(*static_cast<const kvpool::calibration::EvalCodec*>(codec),
                                     layer, tensor, rows, in, tier, history);
  if (!s.ok()) {
    kvpool::calibration::SetError(s, err, err_len);
    return -1;
  }
  return 0;
}

void kvpool_eval_codec_info(const void* codec, float* clip_k, float* clip_v, int* bits,
                            int* head_dim, int* num_layers, char* version) {
  const auto& c = *static_cast<const kvpool::calibration::EvalCodec*>(codec);
  if (clip_k) *clip_k = c.model.quant.clip_ratio_k;
  if (clip_v) *clip_v = c.model.quant.clip_ratio_v;
  if (bits) *bits = c.model.quant.bits;
  if (head_dim) *head_dim = c.model.rotations.head_dim();
  if (num_layers) *num_layers = c.model.rotations.num_layers();
  if (version) {
    const std::string hex = kvpool::CodecVersionHex(c.model);
    std::memcpy(version, hex.c_str(), hex.size() + 1);
  }
}

void kvpool_eval_codec_destroy(void* codec) {
  delete static_cast<kvpool::calibration::EvalCodec*>(codec);
}

}  // extern "C"
