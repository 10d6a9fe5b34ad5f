// make bench-service: kvpoold over inline gRPC on loopback beside the codec and the attention
// kernel alone, measured in the same run on the same data, written as bench-results/service.json
// in the form of docs/operations.md ("Benchmarks").
//
//   ingest             MB/s of BF16 K/V accepted, rotated and quantized by the daemon (AppendKv
//                      streams of 8K tokens, 1 and 2 at once)   vs  the daemon's own arrival
//                      arithmetic (ArrivalEncoder: rotate + clip + quantize per block) on the
//                      same rows in this process (1 and 2 threads)               target >= 70%
//                      (also the daemon's CPU per MB beside the codec threads' own)
//   remote attention   p50 / p99 ms of Attend, batch 1..16, context 4K..32K    vs  the kernels'
//                      own time for the same work (rotate, AttendBf16Rows + AttendBlocks + merge,
//                      un-rotate on the same blocks, read back from the daemon), the batch
//                      spread over as many threads as the daemon has workers
//   small RPCs         GetStats and LookupPrefix calls/s and p99 (1 client, then 4)  vs  the
//                      gRPC health check, the cheapest RPC
//
// The daemon and this process share the machine (on the 2-core machines: both cores). Nothing
// here is a pass/fail assertion.
//
// Usage: kvpool-bench-service [--out bench-results/service.json] [--kvpoold PATH] [--quick]
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/kvpool_client.h"
#include "client/local_daemon.h"
#include "kernels/arrival_encoder.h"
#include "kernels/attention.h"
#include "kernels/block_layout.h"
#include "common/status_macros.h"
#include "kernels/rotation.h"
#include "kernels/row_codec.h"
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
constexpr uint64_t kSeed = 4242;

struct Options {
  std::string out = "bench-results/service.json";
  std::string kvpoold = KVPOOL_KVPOOLD_PATH;
  bool quick = false;  // smaller sizes, for a smoke run
  bool ingest_only = false;
  size_t chunk_bytes = client::ClientOptions().chunk_bytes;
};

absl::string_view Bytes(const std::vector<Bf16>& v, size_t start_row, size_t rows) {
  return absl::string_view(reinterpret_cast<const char*>(v.data() + start_row * kRow),
                           rows * kRow * sizeof(Bf16));
}

// One layer of K/V rows, [tokens][Hkv][D] BF16.
struct LayerData {
  int tokens = 0;
  std::vector<Bf16> k, v;
};

LayerData MakeData(int tokens) {
  LayerData d;
  d.tokens = tokens;
  d.k = testing::ToBf16(testing::RealLikeRows(tokens * kKvHeads, kHeadDim, 1));
  std::vector<float> v = testing::GaussianValues(static_cast<size_t>(tokens) * kRow, 2);
  for (size_t i = 7; i < v.size(); i += kHeadDim) v[i] *= 6.0f;
  d.v = testing::ToBf16(v);
  return d;
}

// Appends tokens [start, start + n) of `data` (cycled) to `id` as one non-final prefill:
// everything after the sink is quantized to INT2, the heaviest ingest path.
absl::Status Append(const KvpoolClient& c, const std::string& id, const LayerData& data,
                    uint32_t token_start, int n) {
  v1::AppendKvHeader header;
  header.set_sequence_id(id);
  header.set_token_start(token_start);
  header.set_num_tokens(n);
  header.set_dtype(v1::DTYPE_BF16);
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<client::AppendStream> stream, c.OpenAppend(header));
  for (int at = 0; at < n;) {
    const int take = std::min(n - at, data.tokens);
    KVPOOL_RETURN_IF_ERROR(
        stream->WriteLayer(0, at, take, Bytes(data.k, 0, take), Bytes(data.v, 0, take)));
    at += take;
  }
  return stream->Finish().status();
}

// The codec alone, as the daemon's arrival path runs it (ArrivalEncoder: rotate each block's
// rows to BF16 in a cache-resident tile, clip, quantize and pack), over `data`'s tokens
// [begin, end), into distinct blocks of `out` (allocated by the caller, as the daemon's pool
// pages are), K then V per block.
absl::Status CodecIngest(const ArrivalEncoder& enc, const BlockLayout& layout,
                         const LayerData& data, int begin, int end, std::vector<uint8_t>* out) {
  const int blocks = (end - begin + layout.tokens - 1) / layout.tokens;
  if (out->size() < static_cast<size_t>(blocks) * layout.block_bytes()) {
    return absl::InternalError("CodecIngest: output too small");
  }
  for (int b = 0; b < blocks; ++b) {
    const int t = begin + b * layout.tokens;
    const size_t n = static_cast<size_t>(std::min(layout.tokens, end - t)) * kRow;
    uint8_t* block = out->data() + static_cast<size_t>(b) * layout.block_bytes();
    KVPOOL_RETURN_IF_ERROR(enc.EncodeIntoBlock(
        0, KvTensor::kKey, layout, absl::MakeConstSpan(data.k).subspan(t * kRow, n), 0, block));
    KVPOOL_RETURN_IF_ERROR(enc.EncodeIntoBlock(
        0, KvTensor::kValue, layout, absl::MakeConstSpan(data.v).subspan(t * kRow, n), 0, block));
  }
  return absl::OkStatus();
}

// CPU time (user + system) of process `pid` so far, at the kernel's tick resolution.
double ProcessCpuSeconds(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  std::getline(in, line);
  const size_t end = line.rfind(')');  // the name may hold spaces
  if (end == std::string::npos) return 0;
  std::istringstream fields(line.substr(end + 2));
  std::string skip;
  for (int i = 0; i < 11; ++i) fields >> skip;  // state .. cmajflt
  double utime = 0, stime = 0;
  fields >> utime >> stime;
  return (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// CPU time of the calling thread so far.
double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Runs `fn(i)` on `threads` threads at once; returns the wall time and the first error.
absl::Status Run(const Options& opt) {
  const int workers = std::max(1u, std::thread::hardware_concurrency());
  const uint64_t pool_bytes = uint64_t{3} << 29;  // 1.5 GiB
  client::LocalDaemonOptions dopt;
  dopt.binary = opt.kvpoold;
  dopt.flags = {absl::StrCat("--pool_bytes=", pool_bytes), "--log_level=warn",
                absl::StrCat("--worker_threads=", workers)};
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<client::LocalDaemon> daemon,
                          client::LocalDaemon::Start(dopt));
  client::ClientOptions copt;
  copt.chunk_bytes = opt.chunk_bytes;
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<KvpoolClient> c,
                          KvpoolClient::Connect(daemon->target(), copt));
  std::cerr << "kvpoold on " << daemon->target() << " (" << workers << " workers)\n";

  v1::ModelSpec spec;
  spec.set_model_id("bench");
  spec.mutable_shape()->set_num_layers(1);
  spec.mutable_shape()->set_q_heads(kQHeads);
  spec.mutable_shape()->set_kv_heads(kKvHeads);
  spec.mutable_shape()->set_head_dim(kHeadDim);
  spec.mutable_data_free()->set_kind(v1::ROTATION_KIND_RANDOMIZED_HADAMARD);
  spec.mutable_data_free()->set_seed(kSeed);
  KVPOOL_ASSIGN_OR_RETURN(v1::RegisterModelResponse reg, c->RegisterModel(spec));
  KVPOOL_ASSIGN_OR_RETURN(RotationSet rot, RotationSet::RandomizedHadamard(1, kHeadDim, kSeed));
  QuantConfig quant;  // the daemon's defaults: INT2 uniform, G = D, clip 0.96 / 0.92, 16 tokens
  KVPOOL_ASSIGN_OR_RETURN(RowCodec codec, RowCodec::Create(quant, kHeadDim));
  KVPOOL_ASSIGN_OR_RETURN(ArrivalEncoder encoder, ArrivalEncoder::Create(&rot, codec));
  const BlockLayout layout = BlockLayout::ForModel(quant, kKvHeads, kHeadDim);
  if (reg.model().block_layout().block_bytes() != layout.block_bytes()) {
    return absl::InternalError("the daemon's block layout differs from the kernels' defaults");
  }

  const int ingest_tokens = opt.quick ? 2048 : 8192;
  const LayerData data = MakeData(ingest_tokens);
  const double stream_bytes = 2.0 * ingest_tokens * kRow * sizeof(Bf16);
  BenchReport report("service");
  const std::map<std::string, std::string> shape{
      {"Hq", "64"},  {"Hkv", "8"},
      {"D", "128"},  {"rotation", "randomized_hadamard"},
      {"bits", "2"}, {"transport", "grpc_inline_loopback"}};
  auto with = [&](std::map<std::string, std::string> extra) {
    std::map<std::string, std::string> p = shape;
    p.insert(extra.begin(), extra.end());
    return p;
  };

  // --- ingest: the daemon vs the codec alone, same rows, interleaved, best of 5 ---
  // Also the transport alone: the same streams into an identity + bypass model (the daemon
  // copies rows, no rotation or quantization), which bounds what overlap could reach.
  v1::ModelSpec bypass_spec = spec;
  bypass_spec.set_model_id("bench-bypass");
  bypass_spec.mutable_data_free()->set_kind(v1::ROTATION_KIND_IDENTITY);
  bypass_spec.mutable_quant()->set_method(v1::QUANT_METHOD_BYPASS);
  KVPOOL_RETURN_IF_ERROR(c->RegisterModel(bypass_spec).status());
  int seq_counter = 0;
  // The codec's output blocks, one set per thread, touched once before any timing (as the
  // daemon's pool pages are after the first append).
  std::vector<std::vector<uint8_t>> codec_out(
      2, std::vector<uint8_t>(static_cast<size_t>(ingest_tokens / layout.tokens + 1) *
                              layout.block_bytes()));
  auto push = [&](const std::string& model, int streams) -> absl::StatusOr<double> {
    std::vector<std::string> ids;
    for (int i = 0; i < streams; ++i) {
      ids.push_back(absl::StrCat("ingest-", seq_counter++));
      KVPOOL_RETURN_IF_ERROR(c->CreateSequence(model, ids.back()).status());
    }
    KVPOOL_ASSIGN_OR_RETURN(double s, RunParallel(streams, [&](int i) {
                              return Append(*c, ids[i], data, 0, ingest_tokens);
                            }));
    for (const std::string& id : ids) KVPOOL_RETURN_IF_ERROR(c->ReleaseSequence(id).status());
    return s;
  };
  for (int streams : {1, 2}) {
    std::vector<double> service_s, codec_s, transport_s;
    // CPU seconds, summed over the repetitions: the daemon's during its quantizing pushes
    // (it is idle otherwise), the codec threads' own. Unlike the wall times they hardly depend
    // on what else runs on the machine.
    double daemon_cpu = 0, codec_cpu = 0;
    std::vector<double> codec_thread_cpu(streams);
    for (int rep = 0; rep < 5; ++rep) {
      const double cpu0 = ProcessCpuSeconds(daemon->pid());
      KVPOOL_ASSIGN_OR_RETURN(double s, push("bench", streams));
      daemon_cpu += ProcessCpuSeconds(daemon->pid()) - cpu0;
      service_s.push_back(s);
      KVPOOL_ASSIGN_OR_RETURN(double t, push("bench-bypass", streams));
      transport_s.push_back(t);
      // The codec: the same rows, `streams` copies over as many threads.
      KVPOOL_ASSIGN_OR_RETURN(double cs, RunParallel(streams, [&](int i) {
                                const double t0 = ThreadCpuSeconds();
                                absl::Status st = CodecIngest(encoder, layout, data, 0,
                                                              ingest_tokens, &codec_out[i]);
                                codec_thread_cpu[i] = ThreadCpuSeconds() - t0;
                                return st;
                              }));
      codec_s.push_back(cs);
      for (double c : codec_thread_cpu) codec_cpu += c;
    }
    const double total_mb = 5 * streams * stream_bytes / 1e6;
    auto best_mbs = [&](const std::vector<double>& secs) {
      return streams * stream_bytes / *std::min_element(secs.begin(), secs.end()) / 1e6;
    };
    const double service_mbs = best_mbs(service_s), codec_mbs = best_mbs(codec_s);
    const double transport_mbs = best_mbs(transport_s);
    const auto params = with({{"streams", std::to_string(streams)},
                              {"tokens_per_stream", std::to_string(ingest_tokens)},
                              {"chunk_bytes", std::to_string(c->chunk_bytes())},
                              {"codec_threads", std::to_string(streams)}});
    report.Add({"ingest_grpc_inline",
                params,
                service_mbs,
                "MB/s",
                {"codec_arrival_encoder_same_rows", codec_mbs}});
    report.Add({"ingest_grpc_inline_no_quantizer",
                params,
                transport_mbs,
                "MB/s",
                {"codec_arrival_encoder_same_rows", codec_mbs}});
    // Receiving and quantizing one message after the other (no overlap) reaches at most
    // 1 / (1 / transport + 1 / codec).
    report.Add({"ingest_serial_bound",
                params,
                1.0 / (1.0 / transport_mbs + 1.0 / codec_mbs),
                "MB/s",
                {"codec_arrival_encoder_same_rows", codec_mbs}});
    // CPU per MB: the codec's arithmetic against everything the daemon spends (receiving,
    // parsing, checking, staging, committing); ratio = the codec's share.
    const double daemon_ms = 1e3 * daemon_cpu / total_mb, codec_ms = 1e3 * codec_cpu / total_mb;
    report.Add({"ingest_grpc_inline_daemon_cpu",
                params,
                daemon_ms,
                "ms/MB",
                {"codec_arrival_encoder_cpu", codec_ms},
                daemon_ms > 0 ? codec_ms / daemon_ms : 0});
    std::cerr << "ingest, " << streams << " stream(s): " << service_mbs << " MB/s vs codec "
              << codec_mbs << " MB/s (transport alone " << transport_mbs << " MB/s); CPU "
              << daemon_ms << " ms/MB in the daemon vs " << codec_ms << " ms/MB in the codec\n";
  }

  if (opt.ingest_only) {
    report.PrintTable(std::cout);
    return daemon->Stop();
  }

  // --- remote attention latency: 16 sequences grown 4K -> 8K -> 16K -> 32K ---
  const std::vector<int> contexts =
      opt.quick ? std::vector<int>{4096} : std::vector<int>{4096, 8192, 16384, 32768};
  const std::vector<int> batches = {1, 2, 4, 8, 16};
  const int num_seqs = batches.back();
  const int reps = opt.quick ? 5 : 15;
  std::vector<std::string> ids;
  for (int i = 0; i < num_seqs; ++i) {
    ids.push_back(absl::StrCat("ctx-", i));
    KVPOOL_RETURN_IF_ERROR(c->CreateSequence("bench", ids.back()).status());
  }
  const AttentionShape ashape{kQHeads, kKvHeads, kHeadDim};
  std::vector<float> q = testing::GaussianValues(size_t{kQHeads} * kHeadDim, 9, 0.5f);
  int length = 0;
  for (int context : contexts) {
    const int grow = context - length;
    // Grow every sequence (two streams at a time, as the cores allow).
    KVPOOL_RETURN_IF_ERROR(RunParallel(2, [&](int half) {
                             for (int i = half; i < num_seqs; i += 2) {
                               KVPOOL_RETURN_IF_ERROR(Append(*c, ids[i], data, length, grow));
                             }
                             return absl::OkStatus();
                           }).status());
    length = context;

    // The kernels' own work on the same storage (read back from the daemon): rotate the query,
    // attend over the BF16 sink and the INT2 history, merge, un-rotate.
    v1::ReadBlocksRequest rb;
    rb.set_sequence_id(ids[0]);
    KVPOOL_ASSIGN_OR_RETURN(client::BlocksRead read, c->ReadBlocks(rb));
    const client::LayerBlocks& lb = read.layers[0];
    std::vector<const uint8_t*> blocks;
    for (const v1::KvBlock& b : lb.blocks) {
      blocks.push_back(reinterpret_cast<const uint8_t*>(b.data().data()));
    }
    std::vector<Bf16> sink_k(lb.sink_k.size() / 2), sink_v(lb.sink_v.size() / 2);
    std::memcpy(sink_k.data(), lb.sink_k.data(), lb.sink_k.size());
    std::memcpy(sink_v.data(), lb.sink_v.data(), lb.sink_v.size());
    auto kernel_one = [&]() -> absl::Status {
      std::vector<float> q_rot(q.size()), out(q.size());
      KVPOOL_RETURN_IF_ERROR(rot.Rotate(0, KvTensor::kKey, q, absl::MakeSpan(q_rot)));
      AttentionOutput acc =
          AttendBf16Rows(ashape, q_rot, sink_k, sink_v, read.header.sink_tokens());
      MergeAttention(
          ashape, AttendBlocks(ashape, codec, layout, blocks, read.header.history_tokens(), q_rot),
          &acc);
      return rot.Unrotate(0, KvTensor::kValue, acc.out, absl::MakeSpan(out));
    };
    // A batch as the daemon runs it: its sequences spread over `workers` threads.
    auto kernel_batch = [&](int batch) -> absl::StatusOr<double> {
      std::vector<double> secs;
      for (int rep = 0; rep < 5; ++rep) {
        KVPOOL_ASSIGN_OR_RETURN(double s, RunParallel(std::min(batch, workers), [&](int t) {
                                  for (int i = t; i < batch; i += workers) {
                                    KVPOOL_RETURN_IF_ERROR(kernel_one());
                                  }
                                  return absl::OkStatus();
                                }));
        secs.push_back(s);
      }
      return 1e3 * Median(secs);
    };
    KVPOOL_ASSIGN_OR_RETURN(const double kernel_ms, kernel_batch(1));
    report.Add({"kernel_attention_one_sequence",
                with({{"context", std::to_string(context)}, {"threads", "1"}}),
                kernel_ms,
                "ms",
                {"", 0},
                0});

    for (int batch : batches) {
      v1::AttendRequest request;
      request.set_model_id("bench");
      request.set_layer(0);
      request.set_dtype(v1::DTYPE_FP32);
      for (int i = 0; i < batch; ++i) {
        v1::SequenceQuery* sq = request.add_queries();
        sq->set_sequence_id(ids[i]);
        sq->set_q(reinterpret_cast<const char*>(q.data()), q.size() * sizeof(float));
      }
      KVPOOL_RETURN_IF_ERROR(c->Attend(request).status());  // warm-up
      std::vector<double> ms;
      for (int rep = 0; rep < reps; ++rep) {
        const auto t0 = Clock::now();
        KVPOOL_ASSIGN_OR_RETURN(v1::AttendResponse r, c->Attend(request));
        ms.push_back(1e3 * SecondsSince(t0));
        if (r.results(0).attended_tokens() != static_cast<uint32_t>(context)) {
          return absl::InternalError("attended the wrong number of tokens");
        }
      }
      // The kernels' own time for the batch on as many threads as the daemon has workers,
      // measured now, under the same machine load.
      KVPOOL_ASSIGN_OR_RETURN(const double kernel_batch_ms, kernel_batch(batch));
      const auto params = with({{"batch", std::to_string(batch)},
                                {"context", std::to_string(context)},
                                {"workers", std::to_string(workers)},
                                {"reps", std::to_string(reps)}});
      report.Add({"remote_attention_p50",
                  params,
                  Percentile(ms, 0.5),
                  "ms",
                  {"kernel_same_batch_same_threads", kernel_batch_ms}});
      report.Add({"remote_attention_p99",
                  params,
                  Percentile(ms, 0.99),
                  "ms",
                  {"kernel_same_batch_same_threads", kernel_batch_ms}});
      std::cerr << "attend batch " << batch << " context " << context << ": p50 "
                << Percentile(ms, 0.5) << " ms, p99 " << Percentile(ms, 0.99)
                << " ms (kernels alone " << kernel_batch_ms << " ms)\n";
    }
  }
  for (const std::string& id : ids) KVPOOL_RETURN_IF_ERROR(c->ReleaseSequence(id).status());

  // --- small RPCs: GetStats and LookupPrefix vs the health check ---
  std::vector<uint32_t> prompt(256);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<uint32_t>(i * 7 + 1);
  const int calls = opt.quick ? 300 : 2000;
  struct SmallRpc {
    std::string name;
    std::function<absl::Status(const KvpoolClient&)> call;
  };
  const std::vector<SmallRpc> rpcs = {
      {"health_check", [](const KvpoolClient& k) { return k.Health().status(); }},
      {"get_stats", [](const KvpoolClient& k) { return k.GetStats().status(); }},
      {"lookup_prefix_256",
       [&](const KvpoolClient& k) { return k.LookupPrefix("bench", prompt).status(); }},
  };
  for (int clients : {1, 4}) {
    double health_rate = 0, health_p99 = 0;
    for (const SmallRpc& rpc : rpcs) {
      std::vector<std::unique_ptr<KvpoolClient>> conns;
      for (int i = 0; i < clients; ++i) {
        KVPOOL_ASSIGN_OR_RETURN(auto k, KvpoolClient::Connect(daemon->target()));
        KVPOOL_RETURN_IF_ERROR(rpc.call(*k));  // connect and warm up
        conns.push_back(std::move(k));
      }
      std::vector<std::vector<double>> lat(clients);
      KVPOOL_ASSIGN_OR_RETURN(double secs, RunParallel(clients, [&](int i) {
                                for (int n = 0; n < calls / clients; ++n) {
                                  const auto t0 = Clock::now();
                                  KVPOOL_RETURN_IF_ERROR(rpc.call(*conns[i]));
                                  lat[i].push_back(1e6 * SecondsSince(t0));
                                }
                                return absl::OkStatus();
                              }));
      std::vector<double> all;
      for (const auto& l : lat) all.insert(all.end(), l.begin(), l.end());
      const double rate = all.size() / secs, p99 = Percentile(all, 0.99);
      if (rpc.name == "health_check") {
        health_rate = rate;
        health_p99 = p99;
      }
      const auto params = std::map<std::string, std::string>{{"clients", std::to_string(clients)},
                                                             {"calls", std::to_string(all.size())}};
      report.Add({rpc.name + "_rate", params, rate, "calls/s", {"health_check_rate", health_rate}});
      report.Add({rpc.name + "_p99", params, p99, "us", {"health_check_p99", health_p99}});
      std::cerr << rpc.name << ", " << clients << " client(s): " << rate << " calls/s, p99 " << p99
                << " us\n";
    }
  }

  KVPOOL_RETURN_IF_ERROR(daemon->Stop());
  return report.Publish(opt.out);
}

}  // namespace
}  // namespace kvpool::bench

int main(int argc, char** argv) {
  kvpool::bench::Options opt;
  std::string chunk_bytes;
  if (!kvpool::bench::ParseBenchArgs(
          argc, argv,
          {{"--out", &opt.out}, {"--kvpoold", &opt.kvpoold}, {"--chunk_bytes", &chunk_bytes}},
          {{"--quick", &opt.quick}, {"--ingest_only", &opt.ingest_only}},
          "[--out FILE] [--kvpoold PATH] [--quick] [--ingest_only] [--chunk_bytes N]")) {
    return 2;
  }
  if (!chunk_bytes.empty()) opt.chunk_bytes = std::stoul(chunk_bytes);
  return kvpool::bench::ExitCode(kvpool::bench::Run(opt));
}
