// RpcLatency: a latency histogram per (gRPC method, status code) of every call the daemon
// serves, recorded in one place: a server interceptor (NewRpcLatencyInterceptorFactory) that
// times each call from its arrival to the status it is sent.
//
//   auto latency = std::make_unique<RpcLatency>();
//   std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> f;
//   f.push_back(NewRpcLatencyInterceptorFactory(latency.get()));
//   builder.experimental().SetInterceptorCreators(std::move(f));
//   for (const RpcLatencySeries& s : latency->Snapshot()) ...
//
// Method names come from the network: a name that is not one of the daemon's registered
// methods is recorded as "unknown", so a caller cannot grow the series. The same interceptor
// also times remote attention (AttentionService.Attend) by batch size, into a second RpcLatency
// whose first label is the batch bucket (AttendBatchBucket). Thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/support/server_interceptor.h"

namespace kvpool::server {

// Upper bounds (seconds) of the histogram buckets; +Inf is implied.
inline constexpr std::array<double, 17> kRpcLatencyBuckets = {
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1,    0.25,    0.5,    1.0,   2.5,    5.0,   10.0, 60.0};

struct RpcLatencySeries {
  // "kvpool.v1.SequenceService/AppendKv" or "unknown"; the batch bucket ("5-8") for Attend's.
  std::string method;
  std::string code;  // "OK", "NOT_FOUND", ...
  // Calls whose latency is at most kRpcLatencyBuckets[i] (not cumulative), then the rest.
  std::array<uint64_t, kRpcLatencyBuckets.size() + 1> buckets{};
  uint64_t count = 0;
  double sum_seconds = 0;
};

class RpcLatency {
 public:
  // `method` is gRPC's path ("/pkg.Service/Method").
  void Record(const std::string& method, int code, double seconds);
  // Every series seen so far, sorted by method and code.
  std::vector<RpcLatencySeries> Snapshot() const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::pair<std::string, int>, RpcLatencySeries> series_ ABSL_GUARDED_BY(mu_);
};

// gRPC's path of a call ("/pkg.Service/Method") as a label, "pkg.Service/Method", when the
// generated descriptor pool or gRPC's own services know it; "unknown" otherwise (also for null).
std::string RpcMethodLabel(const char* method);

// The name of a status code as gRPC spells it ("OK", "DEADLINE_EXCEEDED"); "UNKNOWN" when out
// of range.
const char* GrpcCodeName(int code);

// The bucket of an Attend batch of `sequences`: "1", "2-4", "5-8", ..., "129-256", "257+".
std::string AttendBatchBucket(int sequences);

// An interceptor factory recording every call into `latency`, and Attend calls also into
// `attend_by_batch` (both must outlive the server; `attend_by_batch` may be null).
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
NewRpcLatencyInterceptorFactory(RpcLatency* latency, RpcLatency* attend_by_batch);

}  // namespace kvpool::server
