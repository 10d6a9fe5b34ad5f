// The authorization table, method by method: every method of the API has a row, health is the
// only public one, routers only read stats, tenants and admins call the data methods.
#include "server/auth/method_policy.h"

#include <set>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"
#include "kvpool/v1/admin_service.grpc.pb.h"
#include "kvpool/v1/attention_service.grpc.pb.h"
#include "kvpool/v1/kv_event_service.grpc.pb.h"
#include "kvpool/v1/model_service.grpc.pb.h"
#include "kvpool/v1/read_service.grpc.pb.h"
#include "kvpool/v1/sequence_service.grpc.pb.h"
#include "kvpool/v1/stats_service.grpc.pb.h"
#include "kvpool/v1/transport_service.grpc.pb.h"

namespace kvpool::server {
namespace {

std::vector<std::string> ApiMethods() {
  // Each service from its file's descriptor (reached through a message of the file, which also
  // links the generated code in).
  const google::protobuf::ServiceDescriptor* services[] = {
      v1::RegisterModelRequest::descriptor()->file()->FindServiceByName("ModelService"),
      v1::CreateSequenceRequest::descriptor()->file()->FindServiceByName("SequenceService"),
      v1::ReadKvRequest::descriptor()->file()->FindServiceByName("ReadService"),
      v1::AttendRequest::descriptor()->file()->FindServiceByName("AttentionService"),
      v1::GetStatsRequest::descriptor()->file()->FindServiceByName("StatsService"),
      v1::NegotiateRequest::descriptor()->file()->FindServiceByName("TransportService"),
      v1::SubscribeKvEventsRequest::descriptor()->file()->FindServiceByName("KvEventService"),
      v1::DrainRequest::descriptor()->file()->FindServiceByName("AdminService")};
  std::vector<std::string> out;
  for (const auto* s : services) {
    EXPECT_NE(s, nullptr);
    if (s == nullptr) continue;
    for (int i = 0; i < s->method_count(); ++i) {
      out.push_back(absl::StrCat("/", s->full_name(), "/", s->method(i)->name()));
    }
  }
  return out;
}

TEST(MethodPolicyTest, EveryApiMethodHasARowAndNoRowIsDuplicated) {
  std::set<std::string> rows;
  for (const MethodRule& r : MethodRules()) EXPECT_TRUE(rows.insert(r.path).second) << r.path;
  const std::vector<std::string> methods = ApiMethods();
  EXPECT_EQ(methods.size(), 25u);  // a new method needs a row here and in the table
  for (const std::string& m : methods) EXPECT_EQ(rows.count(m), 1u) << m;
}

TEST(MethodPolicyTest, OnlyHealthIsPublic) {
  for (const MethodRule& r : MethodRules()) {
    EXPECT_EQ(r.is_public, absl::string_view(r.path).substr(0, 23) == "/grpc.health.v1.Health/")
        << r.path;
  }
  EXPECT_TRUE(IsPublicMethod("/grpc.health.v1.Health/Check"));
  EXPECT_TRUE(IsPublicMethod("/grpc.health.v1.Health/Watch"));
  EXPECT_FALSE(IsPublicMethod("/kvpool.v1.StatsService/GetStats"));
  EXPECT_FALSE(IsPublicMethod("/grpc.health.v1.Health/Other"));
  EXPECT_FALSE(IsPublicMethod(""));
}

bool IsAdminMethod(const std::string& m) { return absl::StartsWith(m, "/kvpool.v1.AdminService/"); }

TEST(MethodPolicyTest, TenantsCallEveryApiMethodButAdministrationAdminsAll) {
  for (const std::string& m : ApiMethods()) {
    EXPECT_EQ(AuthorizeMethod(m, v1::ROLE_TENANT).ok(), !IsAdminMethod(m)) << m;
    EXPECT_TRUE(AuthorizeMethod(m, v1::ROLE_ADMIN).ok()) << m;
  }
}

TEST(MethodPolicyTest, DrainAndReloadAreAdminOnly) {
  for (const char* m : {"/kvpool.v1.AdminService/Drain", "/kvpool.v1.AdminService/ReloadTenants"}) {
    EXPECT_TRUE(AuthorizeMethod(m, v1::ROLE_ADMIN).ok()) << m;
    EXPECT_TRUE(absl::IsPermissionDenied(AuthorizeMethod(m, v1::ROLE_TENANT))) << m;
    EXPECT_TRUE(absl::IsPermissionDenied(AuthorizeMethod(m, v1::ROLE_ROUTER))) << m;
    EXPECT_TRUE(absl::IsPermissionDenied(AuthorizeMethod(m, v1::ROLE_UNSPECIFIED))) << m;
  }
}

TEST(MethodPolicyTest, RoutersOnlyReadStatsAndKvEvents) {
  for (const std::string& m : ApiMethods()) {
    const absl::Status s = AuthorizeMethod(m, v1::ROLE_ROUTER);
    if (m == "/kvpool.v1.StatsService/GetStats" ||
        m == "/kvpool.v1.KvEventService/SubscribeKvEvents") {
      EXPECT_TRUE(s.ok()) << m;
    } else {
      EXPECT_TRUE(absl::IsPermissionDenied(s)) << m << ": " << s;
    }
  }
}

TEST(MethodPolicyTest, NoRoleCallsAnythingButHealth) {
  for (const MethodRule& r : MethodRules()) {
    EXPECT_EQ(AuthorizeMethod(r.path, v1::ROLE_UNSPECIFIED).ok(), r.is_public) << r.path;
  }
}

TEST(MethodPolicyTest, UnknownMethodsAreRefusedEvenToAdmins) {
  EXPECT_TRUE(absl::IsPermissionDenied(AuthorizeMethod("/kvpool.v1.X/Y", v1::ROLE_ADMIN)));
  EXPECT_TRUE(absl::IsPermissionDenied(AuthorizeMethod("", v1::ROLE_ADMIN)));
}

TEST(MethodPolicyTest, FaultInjectionIsAdminOnly) {
  const char* m = "/kvpool.testing.FaultInjection/CorruptPage";
  EXPECT_TRUE(AuthorizeMethod(m, v1::ROLE_ADMIN).ok());
  EXPECT_TRUE(absl::IsPermissionDenied(AuthorizeMethod(m, v1::ROLE_TENANT)));
  EXPECT_TRUE(absl::IsPermissionDenied(AuthorizeMethod(m, v1::ROLE_ROUTER)));
}

TEST(MethodPolicyTest, ReflectionNeedsAnyRole) {
  const char* m = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo";
  EXPECT_FALSE(IsPublicMethod(m));
  for (auto role : {v1::ROLE_TENANT, v1::ROLE_ADMIN, v1::ROLE_ROUTER}) {
    EXPECT_TRUE(AuthorizeMethod(m, role).ok());
  }
}

}  // namespace
}  // namespace kvpool::server
