// The model config file (--model_config, proto/kvpool/v1/model_config.proto): models registered
// at start, before the daemon serves, through the same code path as ModelService.RegisterModel
// (server/model_registration.h).
//
//   KVPOOL_RETURN_IF_ERROR(LoadModelConfig(config.model_config, ctx));   // refuses the start
//
// Not thread-safe with itself; call once at start.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvpool/v1/model_config.pb.h"
#include "server/service_context.h"

namespace kvpool::server {

// Parses and checks `text` without registering anything: text format, every entry has a spec
// with server_path or data_free, no model id twice for one tenant, and each tenant known (""
// without a tenants file; a tenant of `tenants` with one). InvalidArgument naming `source`, the
// entry ("model #2 'llama' of tenant 'a'") and the reason.
[[nodiscard]] absl::StatusOr<::kvpool::v1::ModelConfig> ParseModelConfig(
    absl::string_view text, absl::string_view source, const TenantsSource* tenants);

// Reads `path`, parses it (ParseModelConfig) and registers every entry for its tenant. The
// first failure, naming the file and the entry, with the registration's code (InvalidArgument,
// NotFound for a missing rotation file, ...); entries registered before it stay registered.
[[nodiscard]] absl::Status LoadModelConfig(const std::string& path, const ServiceContext& ctx);

}  // namespace kvpool::server
