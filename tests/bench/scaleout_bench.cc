// make bench-scaleout: the routing layer's per-call cost (docs/scale-out.md). Four kvpoold on
// 127.0.0.2-5 form one pool; the same small call (DescribeSequence) is made through the
// RoutingClient and straight to the sequence's owner with a plain KvpoolClient, interleaved, and
// the placement arithmetic alone is timed in process. Then pools of 1, 2 and 4 daemons, each
// started alone, take the same ingest (AppendKv of whole sequences) and attention (Attend
// batches spread over the pool) load from several client threads through the RoutingClient;
// each size runs twice (1 2 4 4 2 1) and is reported beside the 1-daemon pool of the same run.
// Writes bench-results/scaleout.json. On a 2-core machine the daemons and the client share the
// cores: the numbers compare the paths and pool sizes under the same contention, they do not
// measure scaling.

#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <thread>
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
#include "tests/support/test_data.h"

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

// The throughput load: whole-sequence appends, then Attend batches, from kClientThreads.
constexpr Shape kLoadShape{/*num_layers=*/4, /*q_heads=*/8, /*kv_heads=*/2, /*head_dim=*/128};
constexpr int kClientThreads = 4;
constexpr int kAttendBatch = 8;

struct Throughput {
  double ingest_tokens_per_s = 0;
  double ingest_mb_per_s = 0;  // BF16 K+V bytes sent
  double attend_sequences_per_s = 0;
};

// Runs `work(t)` on kClientThreads threads; the first error, if any.
absl::Status OnClientThreads(const std::function<absl::Status(int)>& work) {
  std::vector<absl::Status> status(kClientThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kClientThreads; ++t) {
    threads.emplace_back([&, t] { status[t] = work(t); });
  }
  for (std::thread& th : threads) th.join();
  for (const absl::Status& s : status) KVPOOL_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

// A pool of `n` daemons (127.0.0.2..), alone, under the ingest and attention load.
absl::StatusOr<Throughput> MeasurePool(const std::string& kvpoold, int n, int sequences, int tokens,
                                       int batches) {
  const int port = FreePortOnAllHosts(kHosts);
  if (port == 0) return absl::UnavailableError("no port free on 127.0.0.2-5");
  std::vector<std::string> endpoints;
  for (int i = 0; i < n; ++i) endpoints.push_back(absl::StrCat(kHosts[i], ":", port));
  const std::string peers = absl::StrJoin(endpoints, ",");
  std::vector<std::unique_ptr<LocalDaemon>> daemons;
  for (int i = 0; i < n; ++i) {
    client::LocalDaemonOptions options;
    options.binary = kvpoold;
    options.listen_host = kHosts[i];
    options.listen_port = port;
    options.flags = {"--pool_bytes=536870912",      "--worker_threads=2", "--log_level=warn",
                     "--advertise=" + endpoints[i], "--peers=" + peers,   "--peers_refresh=200ms"};
    options.startup_timeout = absl::Seconds(180);
    KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<LocalDaemon> d, LocalDaemon::Start(options));
    daemons.push_back(std::move(d));
  }
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<RoutingClient> router, RoutingClient::Connect(peers));
  for (int wait = 0; router->membership()->members().size() < endpoints.size() && wait < 100;
       ++wait) {
    absl::SleepFor(absl::Milliseconds(100));
    KVPOOL_RETURN_IF_ERROR(router->Refresh());
  }
  if (router->membership()->members().size() < endpoints.size()) {
    return absl::UnavailableError("not every daemon answered");
  }
  KVPOOL_RETURN_IF_ERROR(router->ForEachMember([](const KvpoolClient& c) {
    return c
        .RegisterModel(
            testing::DataFreeModelSpec("load", kLoadShape, v1::ROTATION_KIND_HADAMARD, 0))
        .status();
  }));
  // The daemons learn their peers from their own probes: wait until every one sees them all
  // (GetStats.membership) so that no timed call is redirected.
  for (const std::string& e : endpoints) {
    KVPOOL_ASSIGN_OR_RETURN(const KvpoolClient* c, router->ClientFor(e));
    for (int wait = 0;; ++wait) {
      KVPOOL_ASSIGN_OR_RETURN(v1::GetStatsResponse stats, c->GetStats());
      if (stats.membership().members_size() == n) break;
      if (wait >= 600) return absl::DeadlineExceededError(e + " never saw every peer");
      absl::SleepFor(absl::Milliseconds(100));
    }
  }
  const size_t row_values = static_cast<size_t>(kLoadShape.kv_heads) * kLoadShape.head_dim;
  const std::vector<Bf16> k = testing::ToBf16(testing::GaussianValues(tokens * row_values, 1));
  const std::vector<Bf16> v = testing::ToBf16(testing::GaussianValues(tokens * row_values, 2));
  const absl::string_view kb(reinterpret_cast<const char*>(k.data()), k.size() * sizeof(Bf16));
  const absl::string_view vb(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(Bf16));
  std::vector<client::LayerKv> layers;
  for (int l = 0; l < kLoadShape.num_layers; ++l) layers.push_back({l, kb, vb});
  std::vector<std::string> ids;
  for (int i = 0; i < sequences; ++i) {
    v1::CreateSequenceRequest request;
    request.set_model_id("load");
    request.set_sequence_id(absl::StrCat("load-", i));
    KVPOOL_RETURN_IF_ERROR(router->CreateSequence(request).status());
    ids.push_back(request.sequence_id());
  }
  Throughput result;
  auto t0 = SteadyClock::now();
  KVPOOL_RETURN_IF_ERROR(OnClientThreads([&](int t) -> absl::Status {
    for (int i = t; i < sequences; i += kClientThreads) {
      v1::AppendKvHeader header;
      header.set_sequence_id(ids[i]);
      header.set_num_tokens(tokens);
      header.set_dtype(v1::DTYPE_BF16);
      header.set_end_of_prefill(true);
      KVPOOL_RETURN_IF_ERROR(router->AppendKv(header, layers).status());
    }
    return absl::OkStatus();
  }));
  double secs = SecondsSince(t0);
  const double total_tokens = static_cast<double>(sequences) * tokens;
  result.ingest_tokens_per_s = total_tokens / secs;
  result.ingest_mb_per_s =
      total_tokens * kLoadShape.num_layers * 2 * kb.size() / tokens / secs / 1e6;

  const std::vector<float> q =
      testing::GaussianValues(static_cast<size_t>(kLoadShape.q_heads) * kLoadShape.head_dim, 3);
  const std::string qb(reinterpret_cast<const char*>(q.data()), q.size() * sizeof(float));
  t0 = SteadyClock::now();
  KVPOOL_RETURN_IF_ERROR(OnClientThreads([&](int t) -> absl::Status {
    for (int b = 0; b < batches; ++b) {
      v1::AttendRequest request;
      request.set_model_id("load");
      request.set_layer(b % kLoadShape.num_layers);
      request.set_dtype(v1::DTYPE_FP32);
      for (int j = 0; j < kAttendBatch; ++j) {
        v1::SequenceQuery* sq = request.add_queries();
        sq->set_sequence_id(ids[(t * batches * kAttendBatch + b * kAttendBatch + j) % sequences]);
        sq->set_num_queries(1);
        sq->set_q(qb);
      }
      for (absl::StatusOr<v1::SequenceAttention>& r : router->Attend(request)) {
        KVPOOL_RETURN_IF_ERROR(r.status());
      }
    }
    return absl::OkStatus();
  }));
  secs = SecondsSince(t0);
  result.attend_sequences_per_s =
      static_cast<double>(kClientThreads) * batches * kAttendBatch / secs;
  if (router->redirects() != 0) return absl::InternalError("timed calls were redirected");
  router.reset();
  for (auto& d : daemons) KVPOOL_RETURN_IF_ERROR(d->Stop());
  return result;
}

void AddThroughput(BenchReport& report, const std::map<int, Throughput>& pools, int sequences,
                   int tokens, int batches) {
  const Throughput& one = pools.at(1);
  for (const auto& [n, t] : pools) {
    std::map<std::string, std::string> params = {
        {"daemons", absl::StrCat(n)},
        {"client_threads", absl::StrCat(kClientThreads)},
        {"shape", "4 layers, Hq 8, Hkv 2, D 128"},
        {"note", "2-core machine: daemons and clients share the cores (contention, not scaling)"}};
    std::map<std::string, std::string> ingest = params, attend = params;
    ingest["sequences"] = absl::StrCat(sequences);
    ingest["tokens_per_sequence"] = absl::StrCat(tokens);
    attend["batch"] = absl::StrCat(kAttendBatch);
    attend["batches_per_thread"] = absl::StrCat(batches);
    attend["tokens_per_sequence"] = absl::StrCat(tokens);
    report.Add({"ingest_tokens_per_s",
                ingest,
                t.ingest_tokens_per_s,
                "tokens/s",
                {"one_daemon", one.ingest_tokens_per_s}});
    report.Add({"ingest_bf16_mb_per_s",
                ingest,
                t.ingest_mb_per_s,
                "MB/s",
                {"one_daemon", one.ingest_mb_per_s}});
    report.Add({"attend_sequences_per_s",
                attend,
                t.attend_sequences_per_s,
                "sequences/s",
                {"one_daemon", one.attend_sequences_per_s}});
  }
}

absl::Status Run(const std::string& out, const std::string& kvpoold, int calls, int sequences,
                 int tokens, int batches) {
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
  router.reset();
  for (auto& d : daemons) KVPOOL_RETURN_IF_ERROR(d->Stop());
  daemons.clear();
  if (sequences > 0) {
    // Each pool size twice, in the order 1 2 4 4 2 1, averaged: a drift in the machine's load
    // over the run weighs on every size alike.
    std::map<int, Throughput> pools;
    for (int n : {1, 2, 4, 4, 2, 1}) {
      KVPOOL_ASSIGN_OR_RETURN(Throughput t, MeasurePool(kvpoold, n, sequences, tokens, batches));
      Throughput& sum = pools[n];
      sum.ingest_tokens_per_s += t.ingest_tokens_per_s / 2;
      sum.ingest_mb_per_s += t.ingest_mb_per_s / 2;
      sum.attend_sequences_per_s += t.attend_sequences_per_s / 2;
    }
    AddThroughput(report, pools, sequences, tokens, batches);
  }
  return report.Publish(out);
}

}  // namespace
}  // namespace kvpool::bench

int main(int argc, char** argv) {
  std::string out = "bench-results/scaleout.json", kvpoold = KVPOOL_KVPOOLD_PATH, calls = "3000";
  std::string sequences = "64", tokens = "2048", batches = "100";
  if (!kvpool::bench::ParseBenchArgs(
          argc, argv,
          {{"--out", &out},
           {"--kvpoold", &kvpoold},
           {"--calls", &calls},
           {"--sequences", &sequences},
           {"--tokens", &tokens},
           {"--batches", &batches}},
          {},
          "[--out FILE] [--kvpoold PATH] [--calls N] [--sequences N (0: no throughput part)] "
          "[--tokens N] [--batches N]")) {
    return 2;
  }
  return kvpool::bench::ExitCode(kvpool::bench::Run(
      out, kvpoold, std::stoi(calls), std::stoi(sequences), std::stoi(tokens), std::stoi(batches)));
}
