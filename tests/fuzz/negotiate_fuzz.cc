// Fuzz target: transport negotiation (server/transport/transport_service.h). The input is a
// kvpool.v1.NegotiateRequest in protobuf bytes, whatever its fields, sent to the Negotiate
// handler of an in-process kvpoold without UCX (fuzz_daemon.h): offer parsing and the
// grpc_inline fallback. An answer is OK with a transport the daemon hosts, or a precise error.
#include <cstddef>
#include <cstdint>

#include "kvpool/v1/transport_service.grpc.pb.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/fuzz_daemon.h"
#include "tests/fuzz/quiet_protobuf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace v1 = ::kvpool::v1;
  using kvpool::fuzz::FuzzDaemon;
  static const bool quiet = (kvpool::fuzz::QuietProtobufLogs(), true);
  (void)quiet;
  static auto* stub = v1::TransportService::NewStub(FuzzDaemon::Get("").channel()).release();
  v1::NegotiateRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  grpc::ClientContext ctx;
  FuzzDaemon::SetDeadline(&ctx);
  v1::NegotiateResponse response;
  const grpc::Status s = stub->Negotiate(&ctx, request, &response);
  FUZZ_CHECK(s.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED &&
                 s.error_code() != grpc::StatusCode::UNKNOWN &&
                 s.error_code() != grpc::StatusCode::INTERNAL,
             s.error_message());
  if (s.ok()) {
    FUZZ_CHECK(response.kind() == v1::TRANSPORT_KIND_GRPC_INLINE,
               "a daemon without UCX negotiated " + v1::TransportKind_Name(response.kind()));
  }
  return 0;
}
