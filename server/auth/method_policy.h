// Per-method authorization: THE table of which roles may call which gRPC method. The auth
// metadata processor (server/auth/auth_processor.h) consults it for every call on the daemon's
// port, before any handler runs.
//
//   if (IsPublicMethod(path)) ...                          // grpc.health.v1.Health only
//   KVPOOL_RETURN_IF_ERROR(AuthorizeMethod(path, v1::ROLE_ROUTER));   // PermissionDenied
//
// Roles (proto/kvpool/v1/tenants.proto): a tenant works on its own namespace; an admin may do
// what a tenant may (on its own namespace), sees every tenant in GetStats and alone operates the
// daemon (AdminService: drain, tenants reload); a router only reads stats and KV events.
// Server reflection needs credentials of any role: it serves the schema, which is public, but
// an anonymous caller gets nothing but health.
//
// Thread-safe (constant data).
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kvpool/v1/tenants.pb.h"

namespace kvpool::server {

// One row of the table: a full method path ("/package.Service/Method") and who may call it.
struct MethodRule {
  const char* path;
  bool is_public;  // no credentials needed
  bool tenant;
  bool admin;
  bool router;
};

// Every row (for tests and docs).
const std::vector<MethodRule>& MethodRules();

// Whether `path` may be called without credentials.
bool IsPublicMethod(absl::string_view path);

// OK when `role` may call `path`; PermissionDenied naming both otherwise, also for a method
// the table does not know (a method added without a row is refused, never open).
[[nodiscard]] absl::Status AuthorizeMethod(absl::string_view path, v1::TenantRole role);

}  // namespace kvpool::server
