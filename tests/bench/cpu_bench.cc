// make bench-cpu: the CPU codec's throughput beside the machine's own bounds, measured in the
// same run (Google Benchmark), written as bench-results/cpu.json in the form of docs/operations.md.
//
//   rotate+clip+quantize  GB/s of BF16 input   vs  the rate a single-thread sgemm's FLOP rate
//                                                   implies for the rotation's D FLOP per byte
//   INT2 decode attention GB/s of stored cache  vs  memcpy bandwidth (and BF16 attention time)
//
// Usage: kvpool-bench-cpu [--out bench-results/cpu.json] [--context 32768] [benchmark flags]
#include <benchmark/benchmark.h>

#include <Eigen/Dense>
#include <cmath>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "kernels/arrival_encoder.h"
#include "kernels/attention.h"
#include "kernels/block_layout.h"
#include "common/status_macros.h"
#include "kernels/rotation.h"
#include "kernels/row_codec.h"
#include "tests/bench/bench_report.h"
#include "tests/support/test_data.h"

namespace kvpool::bench {
namespace {

constexpr int kHeadDim = 128;
constexpr int kKvHeads = 8;
constexpr int kQHeads = 64;
constexpr int kIngestTokens = 4096;
int g_context = 32768;

QuantConfig BenchQuantConfig() {
  QuantConfig cfg;  // INT2 uniform, G = D, clip 0.96 / 0.92, fp16 scale/min
  cfg.block_tokens = 16;
  return cfg;
}

RotationSet DenseRotation() {
  // A dense orthogonal matrix (the randomized Hadamard materialized) so the GEMM path is timed.
  auto rh = RotationSet::RandomizedHadamard(1, kHeadDim, 42);
  std::vector<std::vector<float>> k{rh->Matrix(0, KvTensor::kKey)};
  std::vector<std::vector<float>> v{rh->Matrix(0, KvTensor::kValue)};
  return *RotationSet::Dense(1, kHeadDim, std::move(k), std::move(v));
}

void BM_Memcpy(benchmark::State& state) {
  const size_t bytes = size_t{256} << 20;
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.counters["bytes_per_second"] =
      benchmark::Counter(static_cast<double>(bytes), benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Sgemm1024(benchmark::State& state) {
  const int n = 1024;
  Eigen::MatrixXf a = Eigen::MatrixXf::Random(n, n), b = Eigen::MatrixXf::Random(n, n), c(n, n);
  for (auto _ : state) {
    c.noalias() = a * b;
    benchmark::DoNotOptimize(c.data());
  }
  state.counters["flops"] =
      benchmark::Counter(2.0 * n * n * n, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_RotateClipQuantize(benchmark::State& state) {
  const RotationSet rotation = DenseRotation();
  const QuantConfig cfg = BenchQuantConfig();
  const RowCodec codec = *RowCodec::Create(cfg, kHeadDim);
  const ArrivalEncoder encoder = *ArrivalEncoder::Create(&rotation, codec);
  const BlockLayout layout = BlockLayout::ForModel(cfg, kKvHeads, kHeadDim);
  const size_t rows = size_t{kIngestTokens} * kKvHeads;
  const std::vector<Bf16> k_in =
      testing::ToBf16(testing::RealLikeRows(static_cast<int>(rows), kHeadDim, 1));
  const std::vector<Bf16> v_in =
      testing::ToBf16(testing::RealLikeRows(static_cast<int>(rows), kHeadDim, 2));
  std::vector<uint8_t> blocks(layout.block_bytes() * (kIngestTokens / layout.tokens));
  const size_t block_rows = static_cast<size_t>(layout.tokens) * kKvHeads * kHeadDim;
  for (auto _ : state) {
    // Unrotated BF16 rows in, one block at a time (as they arrive), codes in blocks out.
    for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
      const std::vector<Bf16>& in = t == KvTensor::kKey ? k_in : v_in;
      for (int b = 0; b < kIngestTokens / layout.tokens; ++b) {
        const absl::Span<const Bf16> block_in(in.data() + b * block_rows, block_rows);
        if (!encoder.EncodeIntoBlock(0, t, layout, block_in, 0, &blocks[b * layout.block_bytes()])
                 .ok())
          std::abort();
      }
    }
    benchmark::DoNotOptimize(blocks.data());
  }
  state.counters["bytes_per_second"] = benchmark::Counter(
      2.0 * rows * kHeadDim * sizeof(Bf16), benchmark::Counter::kIsIterationInvariantRate);
}

// The stored INT2 history of one layer for `tokens` tokens, quantized from real-like rows.
struct Int2History {
  BlockLayout layout;
  std::vector<uint8_t> storage;
  std::vector<const uint8_t*> blocks;
};

Int2History MakeHistory(const RowCodec& codec, int tokens) {
  Int2History h;
  h.layout = BlockLayout::ForModel(codec.config(), kKvHeads, kHeadDim);
  const int num_blocks = (tokens + h.layout.tokens - 1) / h.layout.tokens;
  h.storage.assign(h.layout.block_bytes() * num_blocks, 0);
  const int rows = h.layout.tokens * kKvHeads;
  for (int b = 0; b < num_blocks; ++b) {
    for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
      const auto in = testing::ToBf16(testing::RealLikeRows(rows, kHeadDim, 100 + 2 * b + (int)t));
      if (!codec.EncodeIntoBlock(t, h.layout, in, 0, &h.storage[b * h.layout.block_bytes()]).ok())
        std::abort();
    }
    h.blocks.push_back(&h.storage[b * h.layout.block_bytes()]);
  }
  return h;
}

void BM_AttentionInt2(benchmark::State& state) {
  const RowCodec codec = *RowCodec::Create(BenchQuantConfig(), kHeadDim);
  const Int2History h = MakeHistory(codec, g_context);
  const AttentionShape shape{kQHeads, kKvHeads, kHeadDim};
  const std::vector<float> q = testing::GaussianValues(size_t{kQHeads} * kHeadDim, 9);
  for (auto _ : state) {
    AttentionOutput out = AttendBlocks(shape, codec, h.layout, h.blocks, g_context, q);
    benchmark::DoNotOptimize(out.out.data());
  }
  state.counters["bytes_per_second"] = benchmark::Counter(
      static_cast<double>(h.storage.size()), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["seconds_per_call"] = benchmark::Counter(
      1.0, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

void BM_AttentionBf16(benchmark::State& state) {
  const size_t rows = size_t{static_cast<size_t>(g_context)} * kKvHeads;
  const auto k = testing::ToBf16(testing::GaussianValues(rows * kHeadDim, 3));
  const auto v = testing::ToBf16(testing::GaussianValues(rows * kHeadDim, 4));
  const AttentionShape shape{kQHeads, kKvHeads, kHeadDim};
  const std::vector<float> q = testing::GaussianValues(size_t{kQHeads} * kHeadDim, 9);
  for (auto _ : state) {
    AttentionOutput out = AttendBf16Rows(shape, q, k, v, g_context);
    benchmark::DoNotOptimize(out.out.data());
  }
  state.counters["bytes_per_second"] = benchmark::Counter(
      2.0 * rows * kHeadDim * sizeof(Bf16), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["seconds_per_call"] = benchmark::Counter(
      1.0, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

BENCHMARK(BM_Memcpy)->Unit(benchmark::kMillisecond)->MinTime(0.5)->UseRealTime();
BENCHMARK(BM_Sgemm1024)->Unit(benchmark::kMillisecond)->MinTime(0.5)->UseRealTime();
BENCHMARK(BM_RotateClipQuantize)->Unit(benchmark::kMillisecond)->MinTime(0.5)->UseRealTime();
BENCHMARK(BM_AttentionInt2)->Unit(benchmark::kMillisecond)->MinTime(0.5)->UseRealTime();
BENCHMARK(BM_AttentionBf16)->Unit(benchmark::kMillisecond)->MinTime(0.5)->UseRealTime();

// Keeps every run's counters so the report can pair each result with its baseline.
class CollectingReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      if (run.run_type != Run::RT_Iteration) continue;
      auto& c = counters_[run.run_name.function_name];
      for (const auto& [name, counter] : run.counters) c[name] = counter.value;
    }
    ConsoleReporter::ReportRuns(runs);
  }
  double Get(const std::string& bench, const std::string& counter) const {
    auto it = counters_.find(bench);
    if (it == counters_.end()) return 0.0;
    auto jt = it->second.find(counter);
    return jt == it->second.end() ? 0.0 : jt->second;
  }

 private:
  std::map<std::string, std::map<std::string, double>> counters_;
};

}  // namespace
}  // namespace kvpool::bench

int main(int argc, char** argv) {
  using namespace kvpool::bench;
  std::string out_path = "bench-results/cpu.json";
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--out" && i + 1 < argc) {
      out_path = argv[++i];
    } else if (a == "--context" && i + 1 < argc) {
      g_context = std::stoi(argv[++i]);
    } else {
      args.push_back(argv[i]);
    }
  }
  int bargc = static_cast<int>(args.size());
  benchmark::Initialize(&bargc, args.data());
  CollectingReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();

  const double memcpy_gbs = reporter.Get("BM_Memcpy", "bytes_per_second") / 1e9;
  const double sgemm_gflops = reporter.Get("BM_Sgemm1024", "flops") / 1e9;
  const double rq_gbs = reporter.Get("BM_RotateClipQuantize", "bytes_per_second") / 1e9;
  const double int2_gbs = reporter.Get("BM_AttentionInt2", "bytes_per_second") / 1e9;
  const double int2_s = reporter.Get("BM_AttentionInt2", "seconds_per_call");
  const double bf16_s = reporter.Get("BM_AttentionBf16", "seconds_per_call");
  const double bf16_gbs = reporter.Get("BM_AttentionBf16", "bytes_per_second") / 1e9;

  // A dense D x D rotation costs 2*D*D FLOP per row of 2*D input bytes: D FLOP per byte.
  const double implied_gbs = sgemm_gflops / kHeadDim;
  const std::map<std::string, std::string> codec_params{
      {"D", "128"}, {"G", "128"},     {"clip_k", "0.96"},   {"clip_v", "0.92"},
      {"Hkv", "8"}, {"threads", "1"}, {"rotation", "dense"}};
  const std::map<std::string, std::string> attn_params{{"Hq", "64"},
                                                       {"Hkv", "8"},
                                                       {"D", "128"},
                                                       {"context", std::to_string(g_context)},
                                                       {"threads", "1"}};

  BenchReport report("cpu");
  report.Add({"memcpy_bandwidth", {{"bytes", "268435456"}}, memcpy_gbs, "GB/s", {"", 0}, 0});
  report.Add(
      {"sgemm_1024_single_thread", {{"impl", "eigen"}}, sgemm_gflops, "GFLOP/s", {"", 0}, 0});
  report.Add({"rotate_clip_quantize_int2",
              codec_params,
              rq_gbs,
              "GB/s",
              {"sgemm_implied_rate", implied_gbs}});
  report.Add(
      {"int2_decode_attention", attn_params, int2_gbs, "GB/s", {"memcpy_bandwidth", memcpy_gbs}});
  report.Add(
      {"bf16_decode_attention", attn_params, bf16_gbs, "GB/s", {"memcpy_bandwidth", memcpy_gbs}});
  report.Add({"int2_attention_speedup_vs_bf16",
              attn_params,
              int2_s > 0 ? bf16_s / int2_s : 0,
              "x",
              {"bf16_decode_attention_ms", bf16_s * 1e3},
              int2_s > 0 ? bf16_s / int2_s : 0});
  report.PrintTable(std::cout);
  const absl::Status st = report.WriteJson(out_path);
  if (!st.ok()) {
    std::cerr << st << "\n";
    return 1;
  }
  std::cout << "wrote " << out_path << "\n";
  return 0;
}
