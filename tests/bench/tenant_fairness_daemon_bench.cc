// make bench-tenant-fairness, through kvpoold: a small tenant's Attend latency alone and under a
// large tenant's flood of large Attend calls, asked of a real daemon with a tenants file (two
// token tenants, each on its own connections; the flood comes from several client threads).
// Two daemons in one run with the same flags but --fair_compute (weighted fair queueing across
// tenants) on and off. The engine-level run (tenant_fairness_bench.cc) isolates the scheduler;
// this one adds what a client sees: gRPC, authentication, admission and the reply.
//
// The bound for the fair p99, in the same run: the small call's p99 alone plus two large work
// units (one large sequence's Attend, p99, through the same daemon; see tenant_fairness_bench.cc
// for why two). Written as bench-results/tenant_fairness_daemon.json (docs/operations.md,
// "Benchmarks"); nothing here is a pass/fail assertion.
//
// Usage: kvpool-bench-tenant-fairness-daemon [--out FILE.json] [--kvpoold PATH] [--quick]
#include <stdlib.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/kvpool_client.h"
#include "client/local_daemon.h"
#include "common/status_macros.h"
#include "server/auth/token_hash.h"
#include "tests/bench/bench_report.h"
#include "tests/bench/bench_timing.h"
#include "tests/bench/fairness_scenario.h"
#include "tests/support/test_data.h"

namespace kvpool::bench {
namespace {

namespace v1 = ::kvpool::v1;
using client::KvpoolClient;

constexpr int kQHeads = kFairnessQHeads, kKvHeads = kFairnessKvHeads, kHeadDim = kFairnessHeadDim;
constexpr int kWorkers = kFairnessWorkers;
constexpr char kBigToken[] = "bench-fairness-big-6d5c4b3a2918";
constexpr char kSmallToken[] = "bench-fairness-small-0a1b2c3d4e5f";

struct Options {
  std::string out = "bench-results/tenant_fairness_daemon.json";
  std::string kvpoold = KVPOOL_KVPOOLD_PATH;
  bool quick = false;
};

std::string TenantsText() {
  return absl::StrCat("tenant { name: \"big\" role: ROLE_TENANT token_sha256: \"",
                      server::HexOf(server::Sha256Of(kBigToken)), "\" }\n",
                      "tenant { name: \"small\" role: ROLE_TENANT token_sha256: \"",
                      server::HexOf(server::Sha256Of(kSmallToken)), "\" }\n");
}

client::ClientOptions As(const char* token) {
  client::ClientOptions o;
  o.security.token = token;
  o.deadline = absl::Seconds(600);
  return o;
}

absl::Status Register(const KvpoolClient& c) {
  v1::ModelSpec spec;
  spec.set_model_id("m");
  spec.mutable_shape()->set_num_layers(1);
  spec.mutable_shape()->set_q_heads(kQHeads);
  spec.mutable_shape()->set_kv_heads(kKvHeads);
  spec.mutable_shape()->set_head_dim(kHeadDim);
  spec.mutable_data_free()->set_kind(v1::ROTATION_KIND_HADAMARD);
  return c.RegisterModel(spec).status();
}

// A sequence `id` of `tokens` real-like K/V rows, appended in one stream.
absl::Status Fill(const KvpoolClient& c, const std::string& id, int tokens) {
  KVPOOL_RETURN_IF_ERROR(c.CreateSequence("m", id).status());
  const std::vector<Bf16> k =
      testing::ToBf16(testing::RealLikeRows(tokens * kKvHeads, kHeadDim, 1));
  const std::vector<Bf16> v = testing::ToBf16(
      testing::GaussianValues(static_cast<size_t>(tokens) * kKvHeads * kHeadDim, 2));
  v1::AppendKvHeader h;
  h.set_sequence_id(id);
  h.set_num_tokens(tokens);
  h.set_dtype(v1::DTYPE_BF16);
  h.set_end_of_prefill(true);
  auto bytes = [](const std::vector<Bf16>& x) {
    return absl::string_view(reinterpret_cast<const char*>(x.data()), x.size() * sizeof(Bf16));
  };
  return c.AppendKv(h, {{0, bytes(k), bytes(v)}}).status();
}

// An Attend over `sequences` sequences named prefix0.. (or `prefix` alone), one query each.
v1::AttendRequest Request(const std::string& prefix, int sequences, uint64_t seed) {
  v1::AttendRequest r;
  r.set_model_id("m");
  r.set_layer(0);
  r.set_dtype(v1::DTYPE_FP32);
  const std::vector<float> q = testing::GaussianValues(size_t{kQHeads} * kHeadDim, seed);
  const std::string bytes(reinterpret_cast<const char*>(q.data()), q.size() * sizeof(float));
  for (int i = 0; i < sequences; ++i) {
    v1::SequenceQuery* sq = r.add_queries();
    sq->set_sequence_id(sequences == 1 ? prefix : absl::StrCat(prefix, i));
    sq->set_q(bytes);
  }
  return r;
}

// Seconds of each call of `request` made `calls` times in a row.
absl::StatusOr<std::vector<double>> Time(const KvpoolClient& c, const v1::AttendRequest& request,
                                         int calls) {
  std::vector<double> t;
  for (int i = 0; i < calls; ++i) {
    const SteadyClock::time_point t0 = SteadyClock::now();
    KVPOOL_RETURN_IF_ERROR(c.Attend(request).status());
    t.push_back(SecondsSince(t0));
  }
  return t;
}

struct Phase {
  std::vector<double> small;  // seconds per small call
  // The large tenant's work served while the small calls ran (its GetStats row), per second.
  double big_units_per_second = 0;
};

absl::StatusOr<uint64_t> ServedUnits(const KvpoolClient& c) {
  KVPOOL_ASSIGN_OR_RETURN(v1::GetStatsResponse stats, c.GetStats());
  for (const v1::TenantUsage& row : stats.tenants()) {
    if (row.tenant() == stats.tenant()) return row.served_units();
  }
  return absl::InternalError("GetStats has no row for the caller's tenant");
}

// The small tenant's calls one after another while `big_clients` keep large calls in flight.
absl::StatusOr<Phase> RunPhase(const std::string& target, const FairnessSizes& s, int big_clients,
                               int calls) {
  KVPOOL_ASSIGN_OR_RETURN(auto small, KvpoolClient::Connect(target, As(kSmallToken)));
  KVPOOL_ASSIGN_OR_RETURN(auto big, KvpoolClient::Connect(target, As(kBigToken)));
  std::vector<std::unique_ptr<KvpoolClient>> flooders;
  for (int i = 0; i < big_clients; ++i) {
    KVPOOL_ASSIGN_OR_RETURN(auto c, KvpoolClient::Connect(target, As(kBigToken)));
    flooders.push_back(std::move(c));
  }
  std::atomic<bool> stop{false};
  std::vector<absl::Status> flood_status(big_clients);
  std::vector<std::thread> flood;
  for (int i = 0; i < big_clients; ++i) {
    flood.emplace_back([&, i] {
      const v1::AttendRequest r = Request("b", s.big_sequences, 100 + i);
      while (!stop.load()) {
        if (absl::Status st = flooders[i]->Attend(r).status(); !st.ok()) {
          flood_status[i] = st;
          return;
        }
      }
    });
  }
  // Let the flood fill the queue before measuring.
  if (big_clients > 0) std::this_thread::sleep_for(std::chrono::milliseconds(500));
  Phase p;
  absl::StatusOr<uint64_t> units0 = ServedUnits(*big);
  const SteadyClock::time_point t0 = SteadyClock::now();
  absl::StatusOr<std::vector<double>> t = Time(*small, Request("s", 1, 1000), calls);
  const double secs = SecondsSince(t0);
  absl::StatusOr<uint64_t> units1 = ServedUnits(*big);
  stop = true;
  for (std::thread& th : flood) th.join();
  KVPOOL_RETURN_IF_ERROR(t.status());
  for (const absl::Status& st : flood_status) KVPOOL_RETURN_IF_ERROR(st);
  KVPOOL_RETURN_IF_ERROR(units0.status());
  KVPOOL_RETURN_IF_ERROR(units1.status());
  p.small = *std::move(t);
  p.big_units_per_second = static_cast<double>(*units1 - *units0) / secs;
  return p;
}

struct DaemonRun {
  std::vector<double> big_unit;  // seconds of one large sequence's Attend, alone
  Phase alone, flood;
};

// One daemon with the tenants file and --fair_compute=`fair`: its tenants' data, one large work
// unit alone, the small calls alone and under the flood.
absl::StatusOr<DaemonRun> RunDaemon(const Options& opt, const std::string& dir,
                                    const FairnessSizes& s, bool fair) {
  client::LocalDaemonOptions o;
  o.binary = opt.kvpoold;
  o.flags = {"--pool_bytes=1073741824",
             "--log_level=warn",
             "--transports=",
             absl::StrCat("--worker_threads=", kWorkers),
             "--tenants_file=" + dir + "/tenants.txtpb",
             absl::StrCat("--fair_compute=", fair ? "true" : "false")};
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<client::LocalDaemon> d, client::LocalDaemon::Start(o));
  const std::string target = d->target();
  KVPOOL_ASSIGN_OR_RETURN(auto big, KvpoolClient::Connect(target, As(kBigToken)));
  KVPOOL_ASSIGN_OR_RETURN(auto small, KvpoolClient::Connect(target, As(kSmallToken)));
  KVPOOL_RETURN_IF_ERROR(Register(*big));
  KVPOOL_RETURN_IF_ERROR(Register(*small));
  for (int i = 0; i < s.big_sequences; ++i) {
    KVPOOL_RETURN_IF_ERROR(Fill(*big, absl::StrCat("b", i), s.big_tokens));
  }
  KVPOOL_RETURN_IF_ERROR(Fill(*small, "s", s.small_tokens));
  DaemonRun r;
  KVPOOL_ASSIGN_OR_RETURN(r.big_unit, Time(*big, Request("b0", 1, 50), 20));
  KVPOOL_ASSIGN_OR_RETURN(r.alone, RunPhase(target, s, 0, s.small_calls));
  KVPOOL_ASSIGN_OR_RETURN(r.flood,
                          RunPhase(target, s, s.big_clients, fair ? s.small_calls : s.fifo_calls));
  KVPOOL_RETURN_IF_ERROR(d->Stop());
  return r;
}

absl::Status Run(const Options& opt) {
  const FairnessSizes s = FairnessSizes::Of(opt.quick);
  char tmpl[] = "/tmp/kvpool-bench-fairness-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return absl::InternalError("mkdtemp failed");
  const std::string dir = tmpl;
  {
    std::ofstream f(dir + "/tenants.txtpb");
    f << TenantsText();
  }
  absl::StatusOr<DaemonRun> fair = RunDaemon(opt, dir, s, /*fair=*/true);
  absl::StatusOr<DaemonRun> fifo =
      fair.ok() ? RunDaemon(opt, dir, s, /*fair=*/false) : fair.status();
  (void)std::system(("rm -rf " + dir).c_str());
  KVPOOL_RETURN_IF_ERROR(fair.status());
  KVPOOL_RETURN_IF_ERROR(fifo.status());

  std::map<std::string, std::string> shape = s.Params();
  shape["through"] = "kvpoold, tenants file, bearer tokens, loopback";
  auto with = [&](std::map<std::string, std::string> extra) {
    std::map<std::string, std::string> p = shape;
    p.insert(extra.begin(), extra.end());
    return p;
  };
  const double ms = 1e3;
  auto p50 = [&](const std::vector<double>& t) { return Median(t) * ms; };
  auto p99 = [&](const std::vector<double>& t) { return Percentile(t, 0.99) * ms; };
  const double unit_p99 = p99(fair->big_unit);
  const double bound = p99(fair->alone.small) + 2 * unit_p99;

  BenchReport report("tenant_fairness_daemon");
  report.Add({"big_unit_attend_ms",
              with({{"stat", "p99"}, {"daemon", "fair"}}),
              unit_p99,
              "ms",
              {"big_unit_attend_p50_ms", p50(fair->big_unit)}});
  for (const auto& [name, run] : {std::pair{"fair", &*fair}, std::pair{"fifo", &*fifo}}) {
    const std::string phase = absl::StrCat("flood_", name);
    report.Add({"small_attend_p50_ms",
                with({{"phase", "alone"}, {"daemon", name}}),
                p50(run->alone.small),
                "ms",
                {"alone", p50(run->alone.small)}});
    report.Add({"small_attend_p99_ms",
                with({{"phase", "alone"}, {"daemon", name}}),
                p99(run->alone.small),
                "ms",
                {"alone", p99(run->alone.small)}});
    report.Add({"small_attend_p50_ms",
                with({{"phase", phase}, {"daemon", name}}),
                p50(run->flood.small),
                "ms",
                {"alone", p50(run->alone.small)}});
    report.Add({"small_attend_p99_ms",
                with({{"phase", phase}, {"daemon", name}}),
                p99(run->flood.small),
                "ms",
                {"alone", p99(run->alone.small)}});
  }
  report.Add({"small_attend_p99_ms",
              with({{"phase", "flood_fair"}, {"daemon", "fair"}}),
              p99(fair->flood.small),
              "ms",
              {"bound_alone_p99_plus_2_big_units", bound}});
  report.Add({"small_attend_p99_ms",
              with({{"phase", "flood_fifo"}, {"daemon", "fifo"}}),
              p99(fifo->flood.small),
              "ms",
              {"flood_fair", p99(fair->flood.small)}});
  report.Add({"big_units_per_second",
              with({{"phase", "flood_fair"}, {"daemon", "fair"}}),
              fair->flood.big_units_per_second,
              "units/s",
              {"flood_fifo", fifo->flood.big_units_per_second}});
  return report.Publish(opt.out);
}

}  // namespace
}  // namespace kvpool::bench

int main(int argc, char** argv) {
  kvpool::bench::Options opt;
  if (!kvpool::bench::ParseBenchArgs(argc, argv, {{"--out", &opt.out}, {"--kvpoold", &opt.kvpoold}},
                                     {{"--quick", &opt.quick}},
                                     "[--out FILE.json] [--kvpoold PATH] [--quick]")) {
    return 2;
  }
  return kvpool::bench::ExitCode(kvpool::bench::Run(opt));
}
