#include "server/metrics/rpc_latency.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/descriptor.h"
#include "kvpool/v1/attention_service.pb.h"

namespace kvpool::server {
namespace {

constexpr absl::string_view kAttendMethod = "kvpool.v1.AttentionService/Attend";

class RpcLatencyInterceptor final : public grpc::experimental::Interceptor {
 public:
  RpcLatencyInterceptor(RpcLatency* latency, RpcLatency* attend_by_batch, std::string method)
      : latency_(latency),
        attend_by_batch_(method == kAttendMethod ? attend_by_batch : nullptr),
        method_(std::move(method)),
        start_(std::chrono::steady_clock::now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (attend_by_batch_ != nullptr &&
        methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE)) {
      // The request as gRPC parsed it for the handler (an Attend call carries one).
      if (const auto* request =
              static_cast<const ::kvpool::v1::AttendRequest*>(methods->GetRecvMessage());
          request != nullptr) {
        batch_ = request->queries_size();
      }
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
      const int code = static_cast<int>(methods->GetSendStatus().error_code());
      latency_->Record(method_, code, seconds);
      if (attend_by_batch_ != nullptr && batch_ > 0) {
        attend_by_batch_->Record(AttendBatchBucket(batch_), code, seconds);
      }
    }
    methods->Proceed();
  }

 private:
  RpcLatency* const latency_;
  RpcLatency* const attend_by_batch_;  // null unless this call is an Attend
  const std::string method_;
  const std::chrono::steady_clock::time_point start_;
  int batch_ = 0;
};

class RpcLatencyInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  RpcLatencyInterceptorFactory(RpcLatency* latency, RpcLatency* attend_by_batch)
      : latency_(latency), attend_by_batch_(attend_by_batch) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new RpcLatencyInterceptor(latency_, attend_by_batch_, RpcMethodLabel(info->method()));
  }

 private:
  RpcLatency* const latency_;
  RpcLatency* const attend_by_batch_;
};

}  // namespace

std::string RpcMethodLabel(const char* method) {
  if (method == nullptr) return "unknown";
  const absl::string_view path = method;
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

std::string AttendBatchBucket(int sequences) {
  if (sequences <= 1) return "1";
  int high = 4;
  while (high < sequences && high < 256) high *= 2;
  if (sequences > high) return "257+";
  return absl::StrCat(high == 4 ? 2 : high / 2 + 1, "-", high);
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
NewRpcLatencyInterceptorFactory(RpcLatency* latency, RpcLatency* attend_by_batch) {
  return std::make_unique<RpcLatencyInterceptorFactory>(latency, attend_by_batch);
}

}  // namespace kvpool::server
