#include "server/model_registration.h"

#include <utility>

#include "common/status_macros.h"
#include "kernels/rotation_file.h"
#include "server/proto_convert.h"
#include "spdlog/spdlog.h"

namespace kvpool::server {
namespace {

absl::StatusOr<ModelCodec> LoadCodec(const ServiceContext& ctx, const v1::ModelSpec& spec,
                                     std::string uploaded) {
  const bool from_file = spec.rotation_source_case() != v1::ModelSpec::kDataFree;
  if (from_file && spec.has_quant()) {
    return absl::InvalidArgumentError(
        "quant must not be set with a rotation file: the file carries its own quant config");
  }
  if (from_file && spec.v_prerotated()) {
    return absl::InvalidArgumentError(
        "v_prerotated must not be set with a rotation file: the file carries its own flag");
  }
  switch (spec.rotation_source_case()) {
    case v1::ModelSpec::kUploadSize:
      return ParseRotationFile(std::move(uploaded));
    case v1::ModelSpec::kServerPath: {
      KVPOOL_ASSIGN_OR_RETURN(std::string bytes,
                              ReadModelFile(ctx.config->model_dir, spec.server_path(),
                                            ctx.config->max_rotation_file_bytes));
      return ParseRotationFile(std::move(bytes));
    }
    case v1::ModelSpec::kDataFree: {
      KVPOOL_ASSIGN_OR_RETURN(QuantConfig quant, QuantFromProto(spec.quant()));
      KVPOOL_ASSIGN_OR_RETURN(RotationKind kind, RotationKindFromProto(spec.data_free().kind()));
      return DataFreeCodec(kind, spec.data_free().seed(), spec.shape().num_layers(),
                           spec.shape().head_dim(), quant, spec.v_prerotated());
    }
    default:
      return absl::InvalidArgumentError(
          "spec needs a rotation source: upload_size, server_path or data_free");
  }
}

}  // namespace

absl::StatusOr<RegisterResult> RegisterModelSpec(const ServiceContext& ctx, const TenantId& tenant,
                                                 const v1::ModelSpec& spec, std::string uploaded) {
  KVPOOL_ASSIGN_OR_RETURN(ModelCodec codec, LoadCodec(ctx, spec, std::move(uploaded)));
  ModelRegistration req(std::move(codec));
  req.model_id = spec.model_id();
  req.num_layers = spec.shape().num_layers();
  req.q_heads = spec.shape().q_heads();
  req.kv_heads = spec.shape().kv_heads();
  req.head_dim = spec.shape().head_dim();
  req.expected_codec_version = spec.expected_codec_version();
  KVPOOL_ASSIGN_OR_RETURN(RegisterResult r, ctx.registry->Register(tenant, std::move(req)));
  if (!r.already_registered) {
    spdlog::info("registered model '{}': {} layers, Hq {}, Hkv {}, D {}, rotation {}, codec {}",
                 r.model->id, r.model->num_layers, r.model->q_heads, r.model->kv_heads,
                 r.model->head_dim, std::string(RotationKindName(r.model->codec.rotations.kind())),
                 r.model->version_hex.substr(0, 16));
  }
  return r;
}

}  // namespace kvpool::server
