// kvpool-service-demo (`make run`): kvpoold end to end on the CPU.
//
// Starts a real kvpoold process on a loopback port with a fixed pool, registers a model with
// the attention shape of a 70B-class layer (Hq 64, Hkv 8, D 128; a few layers; BF16 sink 64 and
// recent window 256; a randomized Hadamard rotation), pushes a realistic KV history (keys with
// strong outlier channels, several sequences of a few thousand tokens) layer by layer over
// gRPC, runs decode steps (remote attention for every layer over a batch of all sequences, then
// one new token per sequence), prints a summary and stops the daemon with SIGTERM.
//
// Usage: kvpool-service-demo [--kvpoold=PATH] [--pool_bytes=N] [--layers=4] [--sequences=4]
//                            [--tokens=3000] [--decode_steps=16] [--target=HOST:PORT]
// With --target it uses a running daemon instead of starting one.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/kvpool_client.h"
#include "client/local_daemon.h"
#include "kernels/attention.h"
#include "kernels/bf16.h"
#include "common/status_macros.h"
#include "tests/support/test_data.h"

ABSL_FLAG(std::string, kvpoold, KVPOOL_KVPOOLD_PATH, "Path of the kvpoold binary to start");
ABSL_FLAG(std::string, target, "", "Use a running kvpoold at HOST:PORT instead of starting one");
ABSL_FLAG(uint64_t, pool_bytes, uint64_t{1} << 30, "Pool size given to the daemon (--pool_bytes)");
ABSL_FLAG(int32_t, layers, 4, "Model layers");
ABSL_FLAG(int32_t, sequences, 4, "Sequences pushed");
ABSL_FLAG(int32_t, tokens, 3000, "Prompt tokens of the first sequence (others differ by +-20%)");
ABSL_FLAG(int32_t, decode_steps, 16, "Decode steps (attention over every layer, then a token)");

namespace kvpool::demo {
namespace {

namespace v1 = ::kvpool::v1;
using client::KvpoolClient;

constexpr int kQHeads = 64, kKvHeads = 8, kHeadDim = 128;
constexpr size_t kRow = size_t{kKvHeads} * kHeadDim;  // values of one token, one tensor
constexpr double kQueryFocus = 0.3;                   // as in the codec demo

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

std::string Mib(double bytes) { return absl::StrFormat("%.1f MiB", bytes / (1 << 20)); }

absl::string_view Bytes(const std::vector<Bf16>& v, size_t start_row, size_t rows) {
  return absl::string_view(reinterpret_cast<const char*>(v.data() + start_row * kRow),
                           rows * kRow * sizeof(Bf16));
}

// One sequence's KV, per layer, [tokens][Hkv][D] BF16, prompt and decode tokens together.
struct Sequence {
  std::string id;
  int prompt = 0;
  int total = 0;
  std::vector<std::vector<Bf16>> k, v;
};

Sequence MakeSequence(int index, int prompt, int decode, int layers) {
  Sequence s;
  s.id = absl::StrCat("demo-seq-", index);
  s.prompt = prompt;
  s.total = prompt + decode;
  const int rows = s.total * kKvHeads;
  for (int l = 0; l < layers; ++l) {
    const uint64_t seed = 1000 * index + 10 * l;
    // Keys: N(0,1) plus a few strong outlier channels and per-row offsets, as post-RoPE keys
    // have. Values: milder, one moderately strong channel.
    s.k.push_back(testing::ToBf16(testing::RealLikeRows(rows, kHeadDim, seed)));
    std::vector<float> v = testing::GaussianValues(static_cast<size_t>(rows) * kHeadDim, seed + 1);
    for (size_t i = 7; i < v.size(); i += kHeadDim) v[i] *= 6.0f;
    s.v.push_back(testing::ToBf16(v));
  }
  return s;
}

// A decode query per head that, like a real one, puts much of its mass on a few earlier keys.
std::vector<float> FocusedQuery(const Sequence& s, int layer, int visible, std::mt19937_64& rng) {
  std::vector<float> q = testing::GaussianValues(size_t{kQHeads} * kHeadDim, rng(), 0.1f);
  for (int j = 0; j < kQHeads; ++j) {
    const int kv = j / (kQHeads / kKvHeads);
    std::vector<double> aim(kHeadDim, 0.0);
    for (int i = 0; i < 3; ++i) {
      const size_t t = rng() % visible;
      for (int d = 0; d < kHeadDim; ++d)
        aim[d] += s.k[layer][(t * kKvHeads + kv) * kHeadDim + d].ToFloat();
    }
    double norm = 0;
    for (double x : aim) norm += x * x;
    const double scale = kQueryFocus * std::sqrt(double(kHeadDim)) / std::sqrt(norm);
    for (int d = 0; d < kHeadDim; ++d) q[j * kHeadDim + d] += static_cast<float>(scale * aim[d]);
  }
  return q;
}

absl::Status Push(const KvpoolClient& c, const std::string& model, const Sequence& s, int layers) {
  KVPOOL_RETURN_IF_ERROR(c.CreateSequence(model, s.id).status());
  v1::AppendKvHeader header;
  header.set_sequence_id(s.id);
  header.set_num_tokens(s.prompt);
  header.set_dtype(v1::DTYPE_BF16);
  header.set_end_of_prefill(true);
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<client::AppendStream> stream, c.OpenAppend(header));
  // Layer by layer, as a prefill worker streams layer i while it computes layer i + 1.
  for (int l = 0; l < layers; ++l) {
    KVPOOL_RETURN_IF_ERROR(
        stream->WriteLayer(l, 0, s.prompt, Bytes(s.k[l], 0, s.prompt), Bytes(s.v[l], 0, s.prompt)));
  }
  return stream->Finish().status();
}

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(std::ceil(p * v.size())) - 1);
  return v[i];
}

absl::Status Run() {
  const int layers = absl::GetFlag(FLAGS_layers);
  const int num_seqs = absl::GetFlag(FLAGS_sequences);
  const int tokens = absl::GetFlag(FLAGS_tokens);
  const int steps = absl::GetFlag(FLAGS_decode_steps);
  if (layers < 1 || num_seqs < 1 || tokens < 1 || steps < 0) {
    return absl::InvalidArgumentError("--layers, --sequences, --tokens must be >= 1");
  }

  // 1. The daemon.
  std::unique_ptr<client::LocalDaemon> daemon;
  std::string target = absl::GetFlag(FLAGS_target);
  const uint64_t pool_bytes = absl::GetFlag(FLAGS_pool_bytes);
  if (target.empty()) {
    client::LocalDaemonOptions options;
    options.binary = absl::GetFlag(FLAGS_kvpoold);
    options.flags = {absl::StrCat("--pool_bytes=", pool_bytes), "--log_level=warn"};
    const auto t0 = std::chrono::steady_clock::now();
    KVPOOL_ASSIGN_OR_RETURN(daemon, client::LocalDaemon::Start(options));
    target = daemon->target();
    std::printf("kvpoold (pid %d) serving on %s, CPU backend, pool %s; up in %.2f s\n",
                static_cast<int>(daemon->pid()), target.c_str(), Mib(pool_bytes).c_str(),
                Seconds(t0));
  }
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<KvpoolClient> c, KvpoolClient::Connect(target));
  KVPOOL_RETURN_IF_ERROR(c->WaitForServing(absl::Seconds(60)));

  // 2. A 70B-class layer shape, randomized Hadamard rotation, OSCAR defaults otherwise.
  const std::string model = "llama-70b-class";
  v1::ModelSpec spec;
  spec.set_model_id(model);
  spec.mutable_shape()->set_num_layers(layers);
  spec.mutable_shape()->set_q_heads(kQHeads);
  spec.mutable_shape()->set_kv_heads(kKvHeads);
  spec.mutable_shape()->set_head_dim(kHeadDim);
  spec.mutable_data_free()->set_kind(v1::ROTATION_KIND_RANDOMIZED_HADAMARD);
  spec.mutable_data_free()->set_seed(2024);
  spec.mutable_quant()->set_sink_tokens(64);
  spec.mutable_quant()->set_recent_tokens(256);
  KVPOOL_ASSIGN_OR_RETURN(v1::RegisterModelResponse reg, c->RegisterModel(spec));
  const v1::ModelInfo& info = reg.model();
  std::printf(
      "registered %s: %d layers, Hq %d, Hkv %d, D %d, randomized Hadamard, INT2 "
      "(group %d, clip K %.2f V %.2f), BF16 sink %d + recent %d, codec %.16s\n",
      model.c_str(), layers, kQHeads, kKvHeads, kHeadDim, kHeadDim, info.quant().clip_ratio_k(),
      info.quant().clip_ratio_v(), info.quant().sink_tokens(), info.quant().recent_tokens(),
      info.codec_version().c_str());

  // 3. A realistic KV history, pushed layer by layer, all sequences at once.
  std::vector<Sequence> seqs;
  for (int i = 0; i < num_seqs; ++i) {
    const int prompt = std::max(1, tokens + (i % 3 - 1) * tokens / 5 + 37 * i);
    seqs.push_back(MakeSequence(i, prompt, steps, layers));
  }
  double pushed_bytes = 0;
  int min_prompt = seqs.front().prompt, max_prompt = min_prompt;
  for (const Sequence& s : seqs) {
    pushed_bytes += 2.0 * s.prompt * kRow * sizeof(Bf16) * layers;
    min_prompt = std::min(min_prompt, s.prompt);
    max_prompt = std::max(max_prompt, s.prompt);
  }
  const auto ingest_start = std::chrono::steady_clock::now();
  std::vector<absl::Status> push_status(num_seqs);
  {
    std::vector<std::thread> pushers;
    for (int i = 0; i < num_seqs; ++i) {
      pushers.emplace_back([&, i] { push_status[i] = Push(*c, model, seqs[i], layers); });
    }
    for (std::thread& t : pushers) t.join();
  }
  const double ingest_s = Seconds(ingest_start);
  for (const absl::Status& s : push_status) KVPOOL_RETURN_IF_ERROR(s);
  std::printf(
      "pushed %d sequences (%d..%d tokens) x %d layers: %s of BF16 K/V in %.2f s over "
      "gRPC (%.0f MB/s, quantized on arrival)\n",
      num_seqs, min_prompt, max_prompt, layers, Mib(pushed_bytes).c_str(), ingest_s,
      pushed_bytes / ingest_s / 1e6);

  // 4. Decode: per step, remote attention for every layer over the batch, then one new token
  // per sequence (the decode worker's AppendDecode).
  std::mt19937_64 rng(7);
  std::vector<double> latency_ms;
  double err_num = 0, err_den = 0, max_dlse = 0;
  int compared = 0;
  const AttentionShape shape{kQHeads, kKvHeads, kHeadDim};
  for (int step = 0; step <= steps; ++step) {
    for (int l = 0; l < layers; ++l) {
      v1::AttendRequest request;
      request.set_model_id(model);
      request.set_layer(l);
      request.set_dtype(v1::DTYPE_FP32);
      std::vector<std::vector<float>> queries;
      for (const Sequence& s : seqs) {
        queries.push_back(FocusedQuery(s, l, s.prompt + step, rng));
        v1::SequenceQuery* q = request.add_queries();
        q->set_sequence_id(s.id);
        q->set_q(reinterpret_cast<const char*>(queries.back().data()),
                 queries.back().size() * sizeof(float));
      }
      const auto t0 = std::chrono::steady_clock::now();
      KVPOOL_ASSIGN_OR_RETURN(v1::AttendResponse r, c->Attend(request));
      latency_ms.push_back(1e3 * Seconds(t0));
      // Accuracy against dense BF16 attention over the same tokens (float64 reference), on the
      // first and the last step.
      if (step != 0 && step != steps) continue;
      for (size_t i = 0; i < seqs.size(); ++i) {
        const Sequence& s = seqs[i];
        const int n = s.prompt + step;
        const std::vector<Bf16> kb(s.k[l].begin(), s.k[l].begin() + n * kRow);
        const std::vector<Bf16> vb(s.v[l].begin(), s.v[l].begin() + n * kRow);
        const AttentionOutput ref = DenseAttentionReference(shape, queries[i], testing::ToFloat(kb),
                                                            testing::ToFloat(vb), n);
        const v1::SequenceAttention& got = r.results(i);
        if (static_cast<int>(got.attended_tokens()) != n) {
          return absl::InternalError(
              absl::StrCat(s.id, ": attended ", got.attended_tokens(), " tokens, expected ", n));
        }
        std::vector<float> out(ref.out.size());
        std::memcpy(out.data(), got.out().data(), std::min(got.out().size(), out.size() * 4));
        for (size_t j = 0; j < out.size(); ++j) {
          err_num += (double(out[j]) - ref.out[j]) * (double(out[j]) - ref.out[j]);
          err_den += double(ref.out[j]) * ref.out[j];
        }
        for (int h = 0; h < kQHeads; ++h) {
          max_dlse = std::max(max_dlse, std::abs(double(got.lse(h)) - ref.lse[h]));
        }
        ++compared;
      }
    }
    if (step == steps) break;
    for (const Sequence& s : seqs) {
      v1::AppendDecodeRequest d;
      d.set_sequence_id(s.id);
      d.set_token_start(s.prompt + step);
      d.set_num_tokens(1);
      d.set_dtype(v1::DTYPE_BF16);
      std::string k, v;
      for (int l = 0; l < layers; ++l) {
        absl::StrAppend(&k, Bytes(s.k[l], s.prompt + step, 1));
        absl::StrAppend(&v, Bytes(s.v[l], s.prompt + step, 1));
      }
      d.set_k(k);
      d.set_v(v);
      KVPOOL_RETURN_IF_ERROR(c->AppendDecode(d).status());
    }
  }
  std::printf(
      "decode: %d steps x %d layers of remote attention over a batch of %d sequences, "
      "%d new tokens each\n",
      steps + 1, layers, num_seqs, steps);

  // 5. What the pool holds.
  KVPOOL_ASSIGN_OR_RETURN(v1::GetStatsResponse stats, c->GetStats());
  uint64_t stored_tokens = 0, bf16_bytes = 0, model_bytes = 0, sink = 0, history = 0, recent = 0;
  for (const v1::ModelStats& m : stats.models()) {
    if (m.model_id() != model) continue;
    sink = m.sink_tokens();
    history = m.history_tokens();
    recent = m.recent_tokens();
    stored_tokens = sink + history + recent;
    bf16_bytes = m.bf16_equivalent_bytes();
    model_bytes = m.pool_bytes();
  }

  std::printf("\n== kvpool service demo: summary ==\n");
  std::printf(
      "tokens stored         %llu tokens in %d sequences, each in %d layers: sink %llu + "
      "INT2 history %llu + recent %llu\n",
      static_cast<unsigned long long>(stored_tokens), num_seqs, layers,
      static_cast<unsigned long long>(sink), static_cast<unsigned long long>(history),
      static_cast<unsigned long long>(recent));
  std::printf(
      "pool bytes            %s in the pool vs %s as BF16: %.2fx smaller (pool used %s "
      "of %s)\n",
      Mib(model_bytes).c_str(), Mib(bf16_bytes).c_str(),
      model_bytes == 0 ? 0.0 : double(bf16_bytes) / model_bytes,
      Mib(stats.pool().used_bytes()).c_str(), Mib(stats.pool().capacity_bytes()).c_str());
  std::printf(
      "attention error       relative L2 %.4f of the output vs BF16 dense attention, "
      "max |dLSE| %.4f (%d sequence-layers)\n",
      std::sqrt(err_num / err_den), max_dlse, compared);
  std::printf(
      "                      (INT2 history with a data-free rotation on synthetic keys "
      "with 8-20x outlier channels; `make fidelity` measures calibrated OSCAR rotations "
      "on a real model)\n");
  std::printf(
      "ingest                %.0f MB/s of BF16 K/V over inline gRPC on loopback "
      "(rotated + quantized on arrival)\n",
      pushed_bytes / ingest_s / 1e6);
  std::printf("attention latency     p50 %.2f ms, p99 %.2f ms per call (batch %d, %d calls)\n",
              Percentile(latency_ms, 0.50), Percentile(latency_ms, 0.99), num_seqs,
              static_cast<int>(latency_ms.size()));

  // 6. Stop the daemon.
  for (const Sequence& s : seqs) KVPOOL_RETURN_IF_ERROR(c->ReleaseSequence(s.id).status());
  if (daemon != nullptr) {
    KVPOOL_RETURN_IF_ERROR(daemon->Stop());
    std::printf("kvpoold stopped (SIGTERM, exit 0)\n");
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvpool::demo

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("kvpoold end to end on the CPU: push, attend, summarize");
  absl::ParseCommandLine(argc, argv);
  const auto t0 = std::chrono::steady_clock::now();
  const absl::Status s = kvpool::demo::Run();
  if (!s.ok()) {
    std::fprintf(stderr, "kvpool-service-demo: %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("done in %.1f s\n", kvpool::demo::Seconds(t0));
  return 0;
}
