// kvpoold on the GPU end to end (issue "kvpoold on the GPU"): a real kvpoold --device=cuda:N,
// a client on the same machine over inline gRPC, one layer of a 64/8/128-head model (randomized
// Hadamard rotation, INT2 history, BF16 sink and recent window). Writes the JSON of
// docs/operations.md.
//
//   ingest             MB/s of BF16 K/V accepted into the GPU pool (4 AppendKv streams at once,
//                      one prefill per sequence)   vs  the arrival kernels' own device time for
//                      the same appends (the daemon's arrival_device_seconds)
//   remote attention   p50 / p99 ms of Attend, batch 1..32, context 8K..128K   vs  the decode
//                      attention kernel's own device time per call (attention_device_seconds)
//
// Usage: kvpool-gpu-daemon-bench --kvpoold PATH [--device cuda:0] [--out FILE] [--quick]
// Nothing here is a pass/fail assertion, apart from the answers having the right token counts.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/kvpool_client.h"
#include "client/local_daemon.h"
#include "common/status_macros.h"
#include "tests/bench/bench_prefill.h"
#include "tests/bench/bench_report.h"
#include "tests/bench/bench_timing.h"
#include "tests/support/test_data.h"

namespace kvpool::bench {
namespace {

namespace v1 = ::kvpool::v1;
using client::KvpoolClient;
using Clock = SteadyClock;

constexpr int kQHeads = 64, kKvHeads = 8, kHeadDim = 128;
constexpr size_t kRow = size_t{kKvHeads} * kHeadDim;

using Options = DaemonBenchOptions;

absl::Status Run(const Options& opt) {
  const std::vector<int> contexts =
      opt.quick ? std::vector<int>{8192, 32768} : std::vector<int>{8192, 32768, 131072};
  const std::vector<int> batches = opt.quick ? std::vector<int>{1, 8} : std::vector<int>{1, 8, 32};
  const int max_batch = batches.back();
  const int max_context = contexts.back();

  client::LocalDaemonOptions dopt;
  dopt.binary = opt.kvpoold;
  dopt.flags = {absl::StrCat("--device=", opt.device), "--pool_bytes=8589934592",
                "--slab_bytes=16777216", "--worker_threads=8", "--log_level=warn"};
  dopt.startup_timeout = absl::Seconds(120);
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<client::LocalDaemon> daemon,
                          client::LocalDaemon::Start(dopt));
  client::ClientOptions copt;
  copt.deadline = absl::Seconds(600);
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<KvpoolClient> c,
                          KvpoolClient::Connect(daemon->target(), copt));
  KVPOOL_ASSIGN_OR_RETURN(v1::GetStatsResponse st0, c->GetStats());
  std::cerr << "kvpoold on " << daemon->target() << ", backend " << st0.service().backend() << "\n";

  v1::ModelSpec spec;
  spec.set_model_id("bench");
  spec.mutable_shape()->set_num_layers(1);
  spec.mutable_shape()->set_q_heads(kQHeads);
  spec.mutable_shape()->set_kv_heads(kKvHeads);
  spec.mutable_shape()->set_head_dim(kHeadDim);
  spec.mutable_data_free()->set_kind(v1::ROTATION_KIND_RANDOMIZED_HADAMARD);
  spec.mutable_data_free()->set_seed(4242);
  KVPOOL_RETURN_IF_ERROR(c->RegisterModel(spec).status());

  // One buffer of real-like K and outlier-heavy V, shared by every sequence (each stores its own
  // copy: no token ids, so no prefix sharing).
  const std::vector<Bf16> k =
      testing::ToBf16(testing::RealLikeRows(max_context * kKvHeads, kHeadDim, 1));
  std::vector<float> vf = testing::GaussianValues(static_cast<size_t>(max_context) * kRow, 2);
  for (size_t i = 7; i < vf.size(); i += kHeadDim) vf[i] *= 6.0f;
  const std::vector<Bf16> v = testing::ToBf16(vf);

  BenchReport report("gpu-daemon");
  auto params = [&](std::vector<std::pair<std::string, std::string>> extra) {
    std::map<std::string, std::string> p{{"Hq", "64"},
                                         {"Hkv", "8"},
                                         {"D", "128"},
                                         {"device", opt.device},
                                         {"transport", "grpc_inline_loopback"}};
    for (auto& [key, value] : extra) p[key] = value;
    return p;
  };

  constexpr int kStreams = 4;
  std::map<int, std::vector<std::string>> ids;
  for (int context : contexts) {
    for (int i = 0; i < max_batch; ++i) {
      ids[context].push_back(absl::StrCat("ctx", context, "-", i));
      KVPOOL_RETURN_IF_ERROR(c->CreateSequence("bench", ids[context].back()).status());
    }
    KVPOOL_ASSIGN_OR_RETURN(v1::GetStatsResponse before, c->GetStats());
    KVPOOL_ASSIGN_OR_RETURN(
        const double secs, RunParallel(kStreams, [&](int s) {
          for (int i = s; i < max_batch; i += kStreams) {
            KVPOOL_RETURN_IF_ERROR(PrefillLayer0(*c, ids[context][i], k, v, context, kRow));
          }
          return absl::OkStatus();
        }));
    KVPOOL_ASSIGN_OR_RETURN(v1::GetStatsResponse after, c->GetStats());
    const double bytes = 2.0 * max_batch * context * kRow * sizeof(Bf16);
    const double kernel_secs =
        after.service().arrival_device_seconds() - before.service().arrival_device_seconds();
    const double mbs = bytes / secs / 1e6;
    report.Add({"ingest_grpc_inline",
                params({{"context", std::to_string(context)},
                        {"sequences", std::to_string(max_batch)},
                        {"streams", std::to_string(kStreams)}}),
                mbs,
                "MB/s",
                {"arrival_kernels_alone", kernel_secs > 0 ? bytes / kernel_secs / 1e6 : 0.0}});
    std::cerr << "ingest " << max_batch << " x " << context << " tokens: " << mbs
              << " MB/s (arrival kernels " << kernel_secs << " s of " << secs << " s)\n";
  }

  const int reps = opt.quick ? 10 : 30;
  std::vector<float> q(static_cast<size_t>(kQHeads) * kHeadDim);
  for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>((i * 37) % 101) / 50.0f - 1.0f;
  std::map<int, double> one_client_p50;  // batch 1, by context
  for (int context : contexts) {
    for (int batch : batches) {
      v1::AttendRequest request;
      request.set_model_id("bench");
      request.set_layer(0);
      request.set_dtype(v1::DTYPE_FP32);
      for (int i = 0; i < batch; ++i) {
        v1::SequenceQuery* sq = request.add_queries();
        sq->set_sequence_id(ids[context][i]);
        sq->set_q(reinterpret_cast<const char*>(q.data()), q.size() * sizeof(float));
      }
      for (int w = 0; w < 3; ++w) KVPOOL_RETURN_IF_ERROR(c->Attend(request).status());
      KVPOOL_ASSIGN_OR_RETURN(v1::GetStatsResponse before, c->GetStats());
      std::vector<double> ms;
      for (int rep = 0; rep < reps; ++rep) {
        const auto t0 = Clock::now();
        KVPOOL_ASSIGN_OR_RETURN(v1::AttendResponse r, c->Attend(request));
        ms.push_back(1e3 * SecondsSince(t0));
        if (r.results_size() != batch ||
            r.results(batch - 1).attended_tokens() != static_cast<uint32_t>(context)) {
          return absl::InternalError("attended the wrong number of tokens");
        }
      }
      KVPOOL_ASSIGN_OR_RETURN(v1::GetStatsResponse after, c->GetStats());
      const double kernel_ms = 1e3 *
                               (after.service().attention_device_seconds() -
                                before.service().attention_device_seconds()) /
                               reps;
      const auto p = params({{"batch", std::to_string(batch)},
                             {"context", std::to_string(context)},
                             {"reps", std::to_string(reps)}});
      if (batch == 1) one_client_p50[context] = Percentile(ms, 0.5);
      report.Add({"remote_attention_p50",
                  p,
                  Percentile(ms, 0.5),
                  "ms",
                  {"attention_kernel_alone", kernel_ms}});
      report.Add({"remote_attention_p99",
                  p,
                  Percentile(ms, 0.99),
                  "ms",
                  {"attention_kernel_alone", kernel_ms}});
      std::cerr << "attend batch " << batch << " context " << context << ": p50 "
                << Percentile(ms, 0.5) << " ms, p99 " << Percentile(ms, 0.99) << " ms (kernel "
                << kernel_ms << " ms)\n";
    }
  }
  // Concurrent decode workers: 8 clients, each attending one sequence at a time; the daemon
  // coalesces their requests into shared device calls.
  {
    const int context = contexts[1];
    constexpr int kClients = 8;
    std::vector<std::unique_ptr<KvpoolClient>> clients;
    for (int i = 0; i < kClients; ++i) {
      KVPOOL_ASSIGN_OR_RETURN(auto k, KvpoolClient::Connect(daemon->target(), copt));
      clients.push_back(std::move(k));
    }
    std::vector<std::vector<double>> ms(kClients);
    KVPOOL_ASSIGN_OR_RETURN(const double secs, RunParallel(kClients, [&](int i) {
                              v1::AttendRequest request;
                              request.set_model_id("bench");
                              request.set_dtype(v1::DTYPE_FP32);
                              v1::SequenceQuery* sq = request.add_queries();
                              sq->set_sequence_id(ids[context][i % ids[context].size()]);
                              sq->set_q(reinterpret_cast<const char*>(q.data()),
                                        q.size() * sizeof(float));
                              for (int rep = 0; rep < reps * 4; ++rep) {
                                const auto t = Clock::now();
                                KVPOOL_RETURN_IF_ERROR(clients[i]->Attend(request).status());
                                ms[i].push_back(1e3 * SecondsSince(t));
                              }
                              return absl::OkStatus();
                            }));
    std::vector<double> all;
    for (const auto& v : ms) all.insert(all.end(), v.begin(), v.end());
    const double rate = all.size() / secs;
    const auto p = params({{"clients", std::to_string(kClients)},
                           {"batch_per_call", "1"},
                           {"context", std::to_string(context)}});
    report.Add({"concurrent_attention_rate",
                p,
                rate,
                "calls/s",
                {"one_client_sequential_rate", 1e3 / one_client_p50[context]}});
    report.Add({"concurrent_attention_p50", p, Percentile(all, 0.5), "ms", {"", 0.0}});
    std::cerr << kClients << " concurrent clients, context " << context << ": " << rate
              << " calls/s, p50 " << Percentile(all, 0.5) << " ms\n";
  }
  for (auto& [context, list] : ids) {
    for (const std::string& id : list) KVPOOL_RETURN_IF_ERROR(c->ReleaseSequence(id).status());
  }
  KVPOOL_RETURN_IF_ERROR(daemon->Stop());
  return report.Publish(opt.out);
}

}  // namespace
}  // namespace kvpool::bench

int main(int argc, char** argv) {
  kvpool::bench::DaemonBenchOptions opt;
  opt.out = "bench-results/gpu-daemon.json";
  if (!kvpool::bench::ParseDaemonBenchArgs(argc, argv, &opt)) return 2;
  return kvpool::bench::ExitCode(kvpool::bench::Run(opt));
}
