#include "server/logging/request_id_interceptor.h"

#include <chrono>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/string_view.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "server/logging/request_context.h"
#include "server/metrics/rpc_latency.h"
#include "spdlog/spdlog.h"

namespace kvpool::server {
namespace {

constexpr absl::string_view kErrorInfoUrl = "type.googleapis.com/google.rpc.ErrorInfo";

// `details` (a serialized google.rpc.Status) with `id` added to its kvpool ErrorInfo; nullopt
// when there is none.
std::optional<std::string> DetailsWithRequestId(const std::string& details, const std::string& id) {
  google::rpc::Status status;
  if (details.empty() || !status.ParseFromString(details)) return std::nullopt;
  for (google::protobuf::Any& any : *status.mutable_details()) {
    if (any.type_url() != kErrorInfoUrl) continue;
    google::rpc::ErrorInfo info;
    if (!any.UnpackTo(&info) || info.domain() != "kvpool") continue;
    (*info.mutable_metadata())["request_id"] = id;
    any.PackFrom(info);
    return status.SerializeAsString();
  }
  return std::nullopt;
}

bool IsServerFault(grpc::StatusCode code) {
  return code == grpc::StatusCode::INTERNAL || code == grpc::StatusCode::UNKNOWN ||
         code == grpc::StatusCode::DATA_LOSS;
}

class RequestIdInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit RequestIdInterceptor(std::string method)
      : method_(std::move(method)), start_(std::chrono::steady_clock::now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      TakeId(methods->GetRecvInitialMetadata());
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace(kRequestIdMetadataKey, id_);
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      Finish(methods);
    }
    // gRPC runs the next interceptor, and after the last one the handler, inside Proceed.
    ScopedRequestId scope(id_);
    methods->Proceed();
  }

 private:
  void TakeId(const std::multimap<grpc::string_ref, grpc::string_ref>* metadata) {
    std::optional<absl::string_view> sent;
    if (metadata != nullptr) {
      const auto it = metadata->find(kRequestIdMetadataKey);
      if (it != metadata->end()) sent = absl::string_view(it->second.data(), it->second.size());
    }
    id_ = RequestIdFromClient(sent.value_or(""));
    if (sent.has_value() && id_ != *sent) {
      ScopedRequestId scope(id_);
      spdlog::debug(
          "{}: the client's x-request-id ({} bytes) is not 1..{} printable characters; "
          "replaced",
          method_, sent->size(), kMaxRequestIdBytes);
    }
  }

  void Finish(grpc::experimental::InterceptorBatchMethods* methods) {
    const grpc::Status status = methods->GetSendStatus();
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_)
            .count();
    ScopedRequestId scope(id_);
    if (!status.ok()) {
      methods->GetSendTrailingMetadata()->emplace(kRequestIdMetadataKey, id_);
      if (std::optional<std::string> details = DetailsWithRequestId(status.error_details(), id_)) {
        methods->ModifySendStatus(
            grpc::Status(status.error_code(), status.error_message(), *std::move(details)));
      }
    }
    const auto level =
        IsServerFault(status.error_code()) ? spdlog::level::warn : spdlog::level::debug;
    if (!spdlog::should_log(level)) return;
    // The message is the daemon's own (kvpool::ToGrpcStatus bounds it); the log format escapes it.
    spdlog::log(level, "call {} {} in {:.3f} ms{}{}", method_, GrpcCodeName(status.error_code()),
                ms, status.ok() ? "" : ": ", status.error_message());
  }

  const std::string method_;
  const std::chrono::steady_clock::time_point start_;
  std::string id_;
};

class RequestIdInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new RequestIdInterceptor(RpcMethodLabel(info->method()));
  }
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
NewRequestIdInterceptorFactory() {
  return std::make_unique<RequestIdInterceptorFactory>();
}

}  // namespace kvpool::server
