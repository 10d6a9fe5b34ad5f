// Fair compute across tenants: a small tenant's remote-attention latency alone, under a large
// tenant's flood of large Attend calls with weighted fair queueing, and under the same flood with
// fair queueing off (FIFO), in one run, at the engine level (the real CPU backend, the real
// worker pool and attention engine; tenants are explicit ids, as the identity layer would hand
// them over). Writes bench-results/tenant_fairness.json.
//
// The bound for the fair p99: the small call's p99 alone plus two of the large tenant's work
// units (the small call takes two tasks, its snapshot and its attention, and each may find every
// worker busy with one large unit that started just before: tasks are not preempted).
//
// Usage: kvpool-bench-tenant-fairness [--out bench-results/tenant_fairness.json] [--quick]
#include <atomic>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/status_macros.h"
#include "server/attention_engine.h"
#include "server/block_pool.h"
#include "server/cpu_backend.h"
#include "server/model_registry.h"
#include "server/prefix_index.h"
#include "server/sequence_store.h"
#include "server/worker_pool.h"
#include "tests/bench/bench_report.h"
#include "tests/bench/bench_timing.h"
#include "tests/bench/fairness_scenario.h"
#include "tests/support/test_data.h"

namespace kvpool::bench {
namespace {

using server::AttentionAnswer;
using server::AttentionEngine;
using server::AttentionRequest;
using server::Model;
using server::TenantId;

constexpr int kQHeads = kFairnessQHeads, kKvHeads = kFairnessKvHeads, kHeadDim = kFairnessHeadDim;
constexpr int kWorkers = kFairnessWorkers;
const TenantId kBig = "big";
const TenantId kSmall = "small";

// The daemon's core for one model per tenant, sequences filled with real-like K/V.
struct Core {
  std::unique_ptr<server::ComputeBackend> backend;
  std::unique_ptr<server::BlockPool> pool;
  std::unique_ptr<server::PrefixIndex> index;
  std::unique_ptr<server::ModelRegistry> registry;
  std::unique_ptr<server::SequenceStore> store;
  std::unique_ptr<server::WorkerPool> workers;
  std::unique_ptr<AttentionEngine> engine;
  std::shared_ptr<const Model> big_model, small_model;
};

absl::StatusOr<std::shared_ptr<const Model>> Register(Core* c, const TenantId& tenant) {
  KVPOOL_ASSIGN_OR_RETURN(
      ModelCodec codec,
      server::DataFreeCodec(RotationKind::kHadamard, 7, /*num_layers=*/1, kHeadDim, QuantConfig{}));
  server::ModelRegistration req(std::move(codec));
  req.model_id = "m";
  req.q_heads = kQHeads;
  req.kv_heads = kKvHeads;
  KVPOOL_ASSIGN_OR_RETURN(server::RegisterResult r, c->registry->Register(tenant, std::move(req)));
  return r.model;
}

absl::Status Fill(Core* c, const TenantId& tenant, std::shared_ptr<const Model> model,
                  const std::string& id, int tokens) {
  KVPOOL_RETURN_IF_ERROR(c->store->Create(tenant, model, id, {}).status());
  server::AppendSpec spec;
  spec.num_tokens = tokens;
  spec.kind = AppendKind::kFinalPrefill;
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<server::AppendTxn> txn,
                          c->store->BeginAppend(tenant, id, std::move(spec)));
  const std::vector<Bf16> k =
      testing::ToBf16(testing::RealLikeRows(tokens * kKvHeads, kHeadDim, 1));
  const std::vector<Bf16> v = testing::ToBf16(
      testing::GaussianValues(static_cast<size_t>(tokens) * kKvHeads * kHeadDim, 2));
  KVPOOL_RETURN_IF_ERROR(txn->StageLayer(0, 0, k, v));
  return c->store->Commit(std::move(txn)).status();
}

absl::StatusOr<std::unique_ptr<Core>> MakeCore(const FairnessSizes& s) {
  auto c = std::make_unique<Core>();
  c->backend = server::NewCpuBackend();
  const size_t pool_bytes = size_t{512} << 20;
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<server::Arena> arena,
                          c->backend->AllocateArena(pool_bytes));
  KVPOOL_ASSIGN_OR_RETURN(c->pool, server::BlockPool::Create(std::move(arena), 4 << 20));
  c->index = std::make_unique<server::PrefixIndex>(c->pool.get());
  c->registry = std::make_unique<server::ModelRegistry>(c->pool.get());
  c->store =
      std::make_unique<server::SequenceStore>(c->pool.get(), c->index.get(), c->backend.get());
  c->workers = std::make_unique<server::WorkerPool>(kWorkers, 1024);
  c->engine = std::make_unique<AttentionEngine>(c->store.get(), c->backend.get(), c->workers.get());
  KVPOOL_ASSIGN_OR_RETURN(c->big_model, Register(c.get(), kBig));
  KVPOOL_ASSIGN_OR_RETURN(c->small_model, Register(c.get(), kSmall));
  for (int i = 0; i < s.big_sequences; ++i) {
    KVPOOL_RETURN_IF_ERROR(Fill(c.get(), kBig, c->big_model, absl::StrCat("b", i), s.big_tokens));
  }
  KVPOOL_RETURN_IF_ERROR(Fill(c.get(), kSmall, c->small_model, "s", s.small_tokens));
  return c;
}

AttentionRequest Request(const std::string& prefix, int sequences, uint64_t seed) {
  AttentionRequest r;
  for (int i = 0; i < sequences; ++i) {
    r.sequence_ids.push_back(sequences == 1 ? prefix : absl::StrCat(prefix, i));
    r.num_queries.push_back(1);
  }
  r.queries = testing::GaussianValues(static_cast<size_t>(sequences) * kQHeads * kHeadDim, seed);
  return r;
}

// One Attend through the engine (queued on the worker pool), waited for: its seconds.
absl::StatusOr<double> Attend(Core* c, const TenantId& tenant, std::shared_ptr<const Model> model,
                              AttentionRequest request) {
  absl::Notification done;
  absl::Status status;
  const SteadyClock::time_point t0 = SteadyClock::now();
  KVPOOL_RETURN_IF_ERROR(c->engine->Start(tenant, std::move(model), 0, std::move(request),
                                          [&](absl::StatusOr<AttentionAnswer> a) {
                                            status = a.status();
                                            done.Notify();
                                          }));
  done.WaitForNotification();
  const double secs = SecondsSince(t0);
  KVPOOL_RETURN_IF_ERROR(status);
  return secs;
}

struct Phase {
  std::vector<double> small;  // seconds per small call
  // The large tenant's attention served while the small calls ran, in work units per second
  // (the worker pool's count, exact to the task).
  double big_units_per_second = 0;
};

// The small tenant's calls, one after another, while `big_clients` keep large calls in flight.
absl::StatusOr<Phase> RunPhase(Core* c, const FairnessSizes& s, int big_clients, int calls) {
  std::atomic<bool> stop{false};
  std::vector<std::thread> flood;
  std::vector<absl::Status> flood_status(big_clients);
  for (int i = 0; i < big_clients; ++i) {
    flood.emplace_back([&, i] {
      uint64_t seed = 100 + i;
      while (!stop.load()) {
        absl::StatusOr<double> t =
            Attend(c, kBig, c->big_model, Request("b", s.big_sequences, seed++));
        if (!t.ok()) {
          flood_status[i] = t.status();
          return;
        }
      }
    });
  }
  // Let the flood fill the queue before measuring.
  if (big_clients > 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  Phase p;
  const uint64_t big_units0 = c->workers->TenantStats(kBig).served_units;
  const SteadyClock::time_point t0 = SteadyClock::now();
  absl::Status small_status;
  for (int i = 0; i < calls; ++i) {
    absl::StatusOr<double> t = Attend(c, kSmall, c->small_model, Request("s", 1, 1000 + i));
    if (!t.ok()) {
      small_status = t.status();
      break;
    }
    p.small.push_back(*t);
  }
  const double secs = SecondsSince(t0);
  p.big_units_per_second =
      static_cast<double>(c->workers->TenantStats(kBig).served_units - big_units0) / secs;
  stop = true;
  for (std::thread& t : flood) t.join();
  KVPOOL_RETURN_IF_ERROR(small_status);
  for (const absl::Status& st : flood_status) KVPOOL_RETURN_IF_ERROR(st);
  return p;
}

// Seconds of one large work unit (one large sequence's attention), alone: its median and p99.
absl::StatusOr<std::vector<double>> BigUnitTimes(Core* c) {
  std::vector<double> t;
  for (int i = 0; i < 20; ++i) {
    KVPOOL_ASSIGN_OR_RETURN(double secs, Attend(c, kBig, c->big_model, Request("b0", 1, 50 + i)));
    t.push_back(secs);
  }
  return t;
}

absl::Status Run(const std::string& out, bool quick) {
  const FairnessSizes s = FairnessSizes::Of(quick);
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<Core> core, MakeCore(s));
  Core* c = core.get();
  const std::map<std::string, std::string> shape = s.Params();
  auto with = [&](std::map<std::string, std::string> extra) {
    std::map<std::string, std::string> p = shape;
    p.insert(extra.begin(), extra.end());
    return p;
  };

  KVPOOL_ASSIGN_OR_RETURN(std::vector<double> unit, BigUnitTimes(c));
  KVPOOL_ASSIGN_OR_RETURN(Phase alone, RunPhase(c, s, 0, s.small_calls));
  c->workers->SetFairness(true);
  KVPOOL_ASSIGN_OR_RETURN(Phase fair, RunPhase(c, s, s.big_clients, s.small_calls));
  c->workers->SetFairness(false);
  KVPOOL_ASSIGN_OR_RETURN(Phase fifo, RunPhase(c, s, s.big_clients, s.fifo_calls));
  c->workers->SetFairness(true);

  const double ms = 1e3;
  const double alone_p50 = Median(alone.small) * ms, alone_p99 = Percentile(alone.small, 0.99) * ms;
  const double fair_p50 = Median(fair.small) * ms, fair_p99 = Percentile(fair.small, 0.99) * ms;
  const double fifo_p50 = Median(fifo.small) * ms, fifo_p99 = Percentile(fifo.small, 0.99) * ms;
  const double unit_p99 = Percentile(unit, 0.99) * ms;
  const double bound = alone_p99 + 2 * unit_p99;

  BenchReport report("tenant_fairness");
  report.Add({"big_unit_attend_ms",
              with({{"stat", "p99"}}),
              unit_p99,
              "ms",
              {"big_unit_attend_p50_ms", Median(unit) * ms}});
  report.Add(
      {"small_attend_p50_ms", with({{"phase", "alone"}}), alone_p50, "ms", {"alone", alone_p50}});
  report.Add(
      {"small_attend_p99_ms", with({{"phase", "alone"}}), alone_p99, "ms", {"alone", alone_p99}});
  report.Add({"small_attend_p50_ms",
              with({{"phase", "flood_fair"}}),
              fair_p50,
              "ms",
              {"alone", alone_p50}});
  report.Add({"small_attend_p99_ms",
              with({{"phase", "flood_fair"}}),
              fair_p99,
              "ms",
              {"alone", alone_p99}});
  report.Add({"small_attend_p99_ms",
              with({{"phase", "flood_fair"}}),
              fair_p99,
              "ms",
              {"bound_alone_p99_plus_2_big_units", bound}});
  report.Add({"small_attend_p50_ms",
              with({{"phase", "flood_fifo"}}),
              fifo_p50,
              "ms",
              {"alone", alone_p50}});
  report.Add({"small_attend_p99_ms",
              with({{"phase", "flood_fifo"}}),
              fifo_p99,
              "ms",
              {"alone", alone_p99}});
  report.Add({"small_attend_p99_ms",
              with({{"phase", "flood_fifo"}}),
              fifo_p99,
              "ms",
              {"flood_fair", fair_p99}});
  report.Add({"big_units_per_second",
              with({{"phase", "flood_fair"}}),
              fair.big_units_per_second,
              "units/s",
              {"flood_fifo", fifo.big_units_per_second}});
  return report.Publish(out);
}

}  // namespace
}  // namespace kvpool::bench

int main(int argc, char** argv) {
  std::string out = "bench-results/tenant_fairness.json";
  bool quick = false;
  if (!kvpool::bench::ParseBenchArgs(argc, argv, {{"--out", &out}}, {{"--quick", &quick}},
                                     "[--out FILE.json] [--quick]")) {
    return 2;
  }
  return kvpool::bench::ExitCode(kvpool::bench::Run(out, quick));
}
