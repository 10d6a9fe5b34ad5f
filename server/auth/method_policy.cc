#include "server/auth/method_policy.h"

#include "absl/strings/str_cat.h"
#include "common/quote.h"

namespace kvpool::server {

const std::vector<MethodRule>& MethodRules() {
  // path, public, tenant, admin, router
  static const std::vector<MethodRule> kRules = {
      {"/grpc.health.v1.Health/Check", true, true, true, true},
      {"/grpc.health.v1.Health/Watch", true, true, true, true},
      {"/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", false, true, true, true},
      {"/kvpool.v1.ModelService/RegisterModel", false, true, true, false},
      {"/kvpool.v1.ModelService/ListModels", false, true, true, false},
      {"/kvpool.v1.ModelService/DescribeModel", false, true, true, false},
      {"/kvpool.v1.ModelService/DeleteModel", false, true, true, false},
      {"/kvpool.v1.SequenceService/CreateSequence", false, true, true, false},
      {"/kvpool.v1.SequenceService/AppendKv", false, true, true, false},
      {"/kvpool.v1.SequenceService/AppendDecode", false, true, true, false},
      {"/kvpool.v1.SequenceService/SealSequence", false, true, true, false},
      {"/kvpool.v1.SequenceService/ReleaseSequence", false, true, true, false},
      {"/kvpool.v1.SequenceService/DescribeSequence", false, true, true, false},
      {"/kvpool.v1.SequenceService/LookupPrefix", false, true, true, false},
      {"/kvpool.v1.ReadService/ReadBlocks", false, true, true, false},
      {"/kvpool.v1.ReadService/ReadKv", false, true, true, false},
      {"/kvpool.v1.AttentionService/Attend", false, true, true, false},
      {"/kvpool.v1.StatsService/GetStats", false, true, true, true},
      {"/kvpool.v1.KvEventService/SubscribeKvEvents", false, true, true, true},
      {"/kvpool.v1.TransportService/Negotiate", false, true, true, false},
      {"/kvpool.v1.TransportService/CloseSession", false, true, true, false},
      {"/kvpool.v1.TransportService/PushKv", false, true, true, false},
      {"/kvpool.v1.TransportService/WatchSession", false, true, true, false},
      {"/kvpool.v1.TransportService/SetAttentionPlan", false, true, true, false},
      {"/kvpool.v1.TransportService/DropAttentionPlan", false, true, true, false},
      {"/kvpool.v1.TransportService/FetchToDevice", false, true, true, false},
      // Operating the daemon: drain (as SIGTERM) and tenants reload (as SIGHUP).
      {"/kvpool.v1.AdminService/Drain", false, false, true, false},
      {"/kvpool.v1.AdminService/ReloadTenants", false, false, true, false},
      // The test daemon's page-damaging service (kvpoold-fault-injection only).
      {"/kvpool.testing.FaultInjection/CorruptPage", false, false, true, false},
      {"/kvpool.testing.FaultInjection/PoisonDevice", false, false, true, false},
  };
  return kRules;
}

namespace {

const MethodRule* RuleOf(absl::string_view path) {
  for (const MethodRule& r : MethodRules()) {
    if (path == r.path) return &r;
  }
  return nullptr;
}

}  // namespace

bool IsPublicMethod(absl::string_view path) {
  const MethodRule* r = RuleOf(path);
  return r != nullptr && r->is_public;
}

absl::Status AuthorizeMethod(absl::string_view path, v1::TenantRole role) {
  const MethodRule* r = RuleOf(path);
  if (r == nullptr) {
    return absl::PermissionDeniedError(absl::StrCat("no caller may call ", Quote(path)));
  }
  const bool allowed = r->is_public || (role == v1::ROLE_TENANT && r->tenant) ||
                       (role == v1::ROLE_ADMIN && r->admin) ||
                       (role == v1::ROLE_ROUTER && r->router);
  if (allowed) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat("role ", v1::TenantRole_Name(role), " may not call ", Quote(path)));
}

}  // namespace kvpool::server
