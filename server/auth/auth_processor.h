// AuthProcessor: the one place every call on kvpoold's port is authenticated and authorized,
// before any handler runs. gRPC hands it each call's metadata (":path" and "authorization"
// among them) and the connection's auth context (the verified client certificate, if any).
// Public methods (health) pass; otherwise the caller must prove a tenant of the tenants file
// (UNAUTHENTICATED if not) whose role may call the method (method_policy.h; PERMISSION_DENIED
// if not).
//
//   auto processor = std::make_shared<AuthProcessor>(tenants, &counters);
//   credentials->SetAuthMetadataProcessor(processor);
//
// Thread-safe; never blocks (a hash and a lookup), so gRPC runs it inline.
#pragma once

#include <atomic>
#include <cstdint>

#include "grpcpp/security/auth_metadata_processor.h"
#include "server/auth/tenants_source.h"

namespace kvpool::server {

struct AuthCounters {
  std::atomic<uint64_t> unauthenticated{0};  // calls refused UNAUTHENTICATED
  std::atomic<uint64_t> permission_denied{0};
};

class AuthProcessor : public grpc::AuthMetadataProcessor {
 public:
  AuthProcessor(const TenantsSource* tenants, AuthCounters* counters)
      : tenants_(tenants), counters_(counters) {}

  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed_auth_metadata,
                       OutputMetadata* response_metadata) override;

 private:
  const TenantsSource* const tenants_;
  AuthCounters* const counters_;
};

}  // namespace kvpool::server
