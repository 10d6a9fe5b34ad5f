// The caller of a call that the auth processor (auth_processor.h) already let through, as the
// service handlers see it: resolved again from the call's own metadata and its connection's
// certificate, so nothing per call is kept on the connection.
//
//   Caller who = CallerOfCall(tenants, *context);   // tenants null: no tenants file
//
// Thread-safe.
#pragma once

#include "grpcpp/grpcpp.h"
#include "server/auth/authenticate.h"
#include "server/auth/tenants_source.h"

namespace kvpool::server {

// The namespace of a call whose credentials no longer resolve (its tenant was removed between
// the processor's check and the handler, or an in-process call without credentials while a
// tenants file is in force). Not a valid tenant name, so it is nobody's namespace.
inline const TenantId kUnresolvedTenant = "!unresolved";

// The default tenant as admin when `tenants` is null (no tenants file: one user owns the
// daemon); otherwise the tenant the call's credentials name, or kUnresolvedTenant with
// ROLE_UNSPECIFIED.
Caller CallerOfCall(const TenantsSource* tenants, const grpc::ServerContextBase& context);

}  // namespace kvpool::server
