// Tenants: who owns a model or sequence. Multi-tenancy (auth tokens, quotas) comes later; today
// every request belongs to the default tenant "". Every store is keyed by tenant already, and
// the prefix hash includes it, so nothing will be shared across tenants once they exist.
//
//   TenantId t = kDefaultTenant;
//
// Plain value types; thread-safe.
#pragma once

#include <string>

namespace kvpool::server {

using TenantId = std::string;

inline const TenantId kDefaultTenant = "";

}  // namespace kvpool::server
