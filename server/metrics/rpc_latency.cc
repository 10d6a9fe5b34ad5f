#include "server/metrics/rpc_latency.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/string_view.h"
#include "google/protobuf/descriptor.h"

namespace kvpool::server {
namespace {

// "/pkg.Service/Method" -> "pkg.Service/Method" when the generated descriptor pool or gRPC's
// own services know it; "unknown" otherwise.
std::string MethodLabel(absl::string_view path) {
  static constexpr absl::string_view kGrpcOwn[] = {
      "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch",
      "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"};
  for (absl::string_view own : kGrpcOwn) {
    if (path == own) return std::string(path.substr(1));
  }
  if (path.size() < 4 || path.size() > 256 || path[0] != '/') return "unknown";
  const size_t slash = path.rfind('/');
  if (slash == 0) return "unknown";
  std::string full(path.substr(1));
  full[slash - 1] = '.';
  if (google::protobuf::DescriptorPool::generated_pool()->FindMethodByName(full) == nullptr) {
    return "unknown";
  }
  return std::string(path.substr(1));
}

class RpcLatencyInterceptor final : public grpc::experimental::Interceptor {
 public:
  RpcLatencyInterceptor(RpcLatency* latency, std::string method)
      : latency_(latency), method_(std::move(method)), start_(std::chrono::steady_clock::now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
      latency_->Record(method_, static_cast<int>(methods->GetSendStatus().error_code()), seconds);
    }
    methods->Proceed();
  }

 private:
  RpcLatency* const latency_;
  const std::string method_;
  const std::chrono::steady_clock::time_point start_;
};

class RpcLatencyInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RpcLatencyInterceptorFactory(RpcLatency* latency) : latency_(latency) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new RpcLatencyInterceptor(
        latency_, info->method() == nullptr ? std::string("unknown") : MethodLabel(info->method()));
  }

 private:
  RpcLatency* const latency_;
};

}  // namespace

const char* GrpcCodeName(int code) {
  static constexpr const char* kNames[] = {"OK",
                                           "CANCELLED",
                                           "UNKNOWN",
                                           "INVALID_ARGUMENT",
                                           "DEADLINE_EXCEEDED",
                                           "NOT_FOUND",
                                           "ALREADY_EXISTS",
                                           "PERMISSION_DENIED",
                                           "RESOURCE_EXHAUSTED",
                                           "FAILED_PRECONDITION",
                                           "ABORTED",
                                           "OUT_OF_RANGE",
                                           "UNIMPLEMENTED",
                                           "INTERNAL",
                                           "UNAVAILABLE",
                                           "DATA_LOSS",
                                           "UNAUTHENTICATED"};
  if (code < 0 || code >= static_cast<int>(std::size(kNames))) return "UNKNOWN";
  return kNames[code];
}

void RpcLatency::Record(const std::string& method, int code, double seconds) {
  if (code < 0 || code > grpc::StatusCode::UNAUTHENTICATED) code = grpc::StatusCode::UNKNOWN;
  const size_t bucket = static_cast<size_t>(
      std::lower_bound(kRpcLatencyBuckets.begin(), kRpcLatencyBuckets.end(), seconds) -
      kRpcLatencyBuckets.begin());
  absl::MutexLock lock(&mu_);
  RpcLatencySeries& s = series_[{method, code}];
  if (s.count == 0) {
    s.method = method;
    s.code = GrpcCodeName(code);
  }
  ++s.buckets[bucket];
  ++s.count;
  s.sum_seconds += seconds;
}

std::vector<RpcLatencySeries> RpcLatency::Snapshot() const {
  absl::MutexLock lock(&mu_);
  std::vector<RpcLatencySeries> out;
  out.reserve(series_.size());
  for (const auto& [key, s] : series_) out.push_back(s);
  return out;
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
NewRpcLatencyInterceptorFactory(RpcLatency* latency) {
  return std::make_unique<RpcLatencyInterceptorFactory>(latency);
}

}  // namespace kvpool::server
