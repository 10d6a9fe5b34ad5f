// The credentials kvpoold's gRPC port serves with, from its config (docs/security.md):
//   --tls_cert/--tls_key          TLS, files re-read every --tls_refresh_seconds (rotation)
//   + --tls_client_ca             clients may present a certificate chained to that CA
//   --tenants_file without TLS    plaintext restricted to loopback peers (gRPC's local
//                                 credentials), so that the auth processor can run
//   neither                       plaintext, no authentication (the default tenant)
// With a tenants file the auth processor (auth_processor.h) is attached.
//
//   KVPOOL_ASSIGN_OR_RETURN(auto creds, ServerCredentialsFor(config, processor));
//
// Thread-safe (no shared state).
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "grpcpp/security/auth_metadata_processor.h"
#include "grpcpp/security/server_credentials.h"
#include "server/config.h"

namespace kvpool::server {

// InvalidArgument when a TLS file cannot be read or holds no PEM block (checked here, because
// gRPC's file watcher would only log it and fail every handshake).
[[nodiscard]] absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(
    const ServerConfig& config, std::shared_ptr<grpc::AuthMetadataProcessor> processor);

}  // namespace kvpool::server
