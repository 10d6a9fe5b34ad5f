// The hook every sequence-scoped handler calls first (docs/scale-out.md): the call's scale-out
// metadata against this daemon's ownership (server/scaleout/ownership_guard.h), with "held
// here" meaning every named sequence is already in this daemon's store for the caller's tenant.
//
//   KVPOOL_RETURN_IF_ERROR(CheckOwnership(*ctx_, context, tenant, {request->sequence_id()}));
#pragma once

#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/scaleout/ownership_guard.h"
#include "server/service_context.h"

namespace kvpool::server {

[[nodiscard]] inline absl::Status CheckOwnership(
    const ServiceContext& ctx, const grpc::CallbackServerContext* call, const TenantId& tenant,
    const std::vector<absl::string_view>& sequence_ids) {
  if (ctx.ownership == nullptr) return absl::OkStatus();
  return ctx.ownership->Check(call, [&] {
    if (sequence_ids.empty()) return false;
    for (absl::string_view id : sequence_ids) {
      if (!ctx.store->Describe(tenant, std::string(id)).ok()) return false;
    }
    return true;
  });
}

}  // namespace kvpool::server
