// The caller of a call that the auth processor (auth_processor.h) already let through, as the
// service handlers see it.
//
// Resolved once per call: the daemon's port serves every callback call with a CallContext
// (CallContextAllocator), which keeps the caller its first lookup resolved for as long as the
// tenants file in force is the one it was resolved against; after a reload the next lookup
// resolves it again, so a call whose tenant left the file runs in nobody's namespace from then
// on. (The processor cannot hand its own answer over: the AuthContext gRPC gives it is the
// connection's, shared by every call on it, not the call's.)
//
//   builder.SetContextAllocator(std::make_unique<CallContextAllocator>());
//   Caller who = CallerOfCall(tenants, *context);   // tenants null: no tenants file
//
// Thread-safe.
#pragma once

#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "server/auth/authenticate.h"
#include "server/auth/tenants_source.h"

namespace kvpool::server {

// The namespace of a call whose credentials no longer resolve (its tenant was removed between
// the processor's check and the handler, or an in-process call without credentials while a
// tenants file is in force). Not a valid tenant name, so it is nobody's namespace.
inline const TenantId kUnresolvedTenant = "!unresolved";

// The default tenant as admin when `tenants` is null (no tenants file: one user owns the
// daemon); otherwise the tenant the call's credentials name in the tenants file in force, or
// kUnresolvedTenant with ROLE_UNSPECIFIED.
Caller CallerOfCall(const TenantsSource* tenants, const grpc::ServerContextBase& context);

// A callback call's context that remembers its caller (see above).
class CallContext final : public grpc::CallbackServerContext {
 public:
  Caller CallerOf(const TenantsSource& tenants) const;

 private:
  mutable absl::Mutex mu_;
  // The directory caller_ was resolved against (held, so that a new one never shares its
  // address); null before the first lookup.
  mutable std::shared_ptr<const TenantDirectory> resolved_against_ ABSL_GUARDED_BY(mu_);
  mutable Caller caller_ ABSL_GUARDED_BY(mu_);
};

// Gives gRPC a CallContext for every callback call. gRPC releases a context when its call is
// done; the few it allocated for calls that never started (shutdown) go with the allocator.
class CallContextAllocator final : public grpc::ContextAllocator {
 public:
  ~CallContextAllocator() override;
  grpc::CallbackServerContext* NewCallbackServerContext() override;
  void Release(grpc::CallbackServerContext* context) override;

 private:
  absl::Mutex mu_;
  absl::flat_hash_set<grpc::CallbackServerContext*> live_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvpool::server
