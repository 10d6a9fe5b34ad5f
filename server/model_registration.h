// RegisterModelSpec: registers the model a kvpool.v1.ModelSpec describes for a tenant, the one
// implementation behind ModelService.RegisterModel and the model config file (--model_config).
//
//   KVPOOL_ASSIGN_OR_RETURN(RegisterResult r,
//                           RegisterModelSpec(ctx, tenant, spec, std::move(uploaded_bytes)));
//
// Thread-safe (the registry is); parsing a rotation file is heavy: call it from a worker.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "kvpool/v1/model_service.pb.h"
#include "server/model_registry.h"
#include "server/service_context.h"
#include "server/tenant.h"

namespace kvpool::server {

// Loads the spec's codec (the uploaded rotation file `uploaded`, a file inside --model_dir, or
// a data-free rotation) and registers it for `tenant`. InvalidArgument (bad spec, malformed
// file, quant or v_prerotated beside a rotation file), PermissionDenied / NotFound /
// FailedPrecondition (server_path), then ModelRegistry::Register's errors.
[[nodiscard]] absl::StatusOr<RegisterResult> RegisterModelSpec(const ServiceContext& ctx,
                                                               const TenantId& tenant,
                                                               const ::kvpool::v1::ModelSpec& spec,
                                                               std::string uploaded);

}  // namespace kvpool::server
