// make bench-scaleout: the routing layer's per-call cost (docs/scale-out.md). Four kvpoold on
// 127.0.0.2-5 form one pool; the same small call (DescribeSequence) is made through the
// RoutingClient and straight to the sequence's owner with a plain KvpoolClient, interleaved, and
// the placement arithmetic alone is timed in process. Writes bench-results/scaleout.json.
// On a 2-core machine the daemons and the client share the cores: the numbers compare the two
// paths under the same contention, they do not measure scaling.

#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/kvpool_client.h"
#include "client/local_daemon.h"
#include "client/routing_client.h"
#include "common/placement.h"
#include "common/status_macros.h"
#include "tests/bench/bench_report.h"
#include "tests/bench/bench_timing.h"
#include "tests/support/api_requests.h"
#include "tests/support/loopback_hosts.h"

namespace kvpool::bench {
namespace {

using client::KvpoolClient;
using client::LocalDaemon;
using client::RoutingClient;

using ::kvpool::testing::FreePortOnAllHosts;
constexpr auto& kHosts = ::kvpool::testing::kLoopbackHosts;
struct Shape {
  int num_layers = 1, q_heads = 2, kv_heads = 1, head_dim = 64;
};

absl::Status Run(const std::string& out, const std::string& kvpoold, int calls) {
  const int port = FreePortOnAllHosts(kHosts);
  if (port == 0) return absl::UnavailableError("no port free on 127.0.0.2-5");
  std::vector<std::string> endpoints;
  for (const char* h : kHosts) endpoints.push_back(absl::StrCat(h, ":", port));
  const std::string peers = absl::StrJoin(endpoints, ",");
  std::vector<std::unique_ptr<LocalDaemon>> daemons;
  std::map<std::string, std::unique_ptr<KvpoolClient>> direct;
  for (int i = 0; i < 4; ++i) {
    client::LocalDaemonOptions options;
    options.binary = kvpoold;
    options.listen_host = kHosts[i];
    options.listen_port = port;
    options.flags = {"--pool_bytes=134217728", "--worker_threads=1", "--log_level=warn",
                     "--advertise=" + endpoints[i], "--peers=" + peers};
    KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<LocalDaemon> d, LocalDaemon::Start(options));
    KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<KvpoolClient> c, KvpoolClient::Connect(d->target()));
    KVPOOL_RETURN_IF_ERROR(
        c->RegisterModel(testing::DataFreeModelSpec("m", Shape{}, v1::ROTATION_KIND_HADAMARD, 0))
            .status());
    direct[endpoints[i]] = std::move(c);
    daemons.push_back(std::move(d));
  }
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<RoutingClient> router, RoutingClient::Connect(peers));
  for (int wait = 0; router->membership()->members().size() < 4 && wait < 100; ++wait) {
    absl::SleepFor(absl::Milliseconds(100));
    KVPOOL_RETURN_IF_ERROR(router->Refresh());
  }
  if (router->membership()->members().size() < 4) {
    return absl::UnavailableError("the four daemons did not all answer");
  }
  constexpr int kSequences = 256;
  std::vector<std::string> ids, owners;
  for (int n = 0; n < kSequences; ++n) {
    v1::CreateSequenceRequest request;
    request.set_model_id("m");
    request.set_sequence_id(absl::StrCat("bench-", n));
    KVPOOL_RETURN_IF_ERROR(router->CreateSequence(request).status());
    ids.push_back(request.sequence_id());
    KVPOOL_ASSIGN_OR_RETURN(std::string owner, router->OwnerOf(request.sequence_id()));
    owners.push_back(owner);
  }
  // Warm both paths, then interleave them so that both see the same load, each going first
  // every other time (a call right after another one finds the daemon's threads awake).
  std::vector<double> routed, plain;
  for (int i = 0; i < calls + 200; ++i) {
    const int s = i % kSequences;
    double r = 0, d = 0;
    for (int turn = 0; turn < 2; ++turn) {
      const bool routed_turn = (turn == 0) == (i % 2 == 0);
      const auto t0 = SteadyClock::now();
      if (routed_turn) {
        KVPOOL_RETURN_IF_ERROR(router->DescribeSequence(ids[s]).status());
        r = SecondsSince(t0);
      } else {
        KVPOOL_RETURN_IF_ERROR(direct[owners[s]]->DescribeSequence(ids[s]).status());
        d = SecondsSince(t0);
      }
    }
    if (i >= 200) {
      routed.push_back(r * 1e6);
      plain.push_back(d * 1e6);
    }
  }
  // The placement arithmetic alone (key and owner among four).
  const std::shared_ptr<const Membership> members = router->membership();
  const auto t0 = SteadyClock::now();
  size_t sink = 0;
  constexpr int kPlacements = 20000;
  for (int i = 0; i < kPlacements; ++i) {
    const PlacementKey key = PlacementKeyOfSequence("default", "m", ids[i % kSequences]);
    sink += members->OwnerOf(key).endpoint.size();
  }
  const double placement_us = SecondsSince(t0) / kPlacements * 1e6;
  if (sink == 0) return absl::InternalError("no owner");

  BenchReport report("scaleout");
  const std::map<std::string, std::string> params = {
      {"daemons", "4"},
      {"calls", absl::StrCat(calls)},
      {"rpc", "DescribeSequence"},
      {"note", "2-core machine: daemons and client share the cores (contention, not scaling)"}};
  report.Add({"routed_call_p50", params, Median(routed), "us", {"direct_call_p50", Median(plain)}});
  report.Add({"routed_call_p99",
              params,
              Percentile(routed, 0.99),
              "us",
              {"direct_call_p99", Percentile(plain, 0.99)}});
  report.Add({"routing_overhead_p50",
              params,
              Median(routed) - Median(plain),
              "us",
              {"direct_call_p50", Median(plain)}});
  report.Add({"placement_key_and_owner",
              {{"members", "4"}},
              placement_us,
              "us",
              {"direct_call_p50", Median(plain)}});
  for (auto& d : daemons) KVPOOL_RETURN_IF_ERROR(d->Stop());
  return report.Publish(out);
}

}  // namespace
}  // namespace kvpool::bench

int main(int argc, char** argv) {
  std::string out = "bench-results/scaleout.json", kvpoold = KVPOOL_KVPOOLD_PATH, calls = "3000";
  if (!kvpool::bench::ParseBenchArgs(
          argc, argv, {{"--out", &out}, {"--kvpoold", &kvpoold}, {"--calls", &calls}}, {},
          "[--out FILE] [--kvpoold PATH] [--calls N]")) {
    return 2;
  }
  return kvpool::bench::ExitCode(kvpool::bench::Run(out, kvpoold, std::stoi(calls)));
}
