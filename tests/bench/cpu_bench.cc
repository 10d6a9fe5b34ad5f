// make bench-cpu: the CPU codec's throughput beside the machine's own bounds, measured in the
// same run (Google Benchmark), written as bench-results/cpu.json in the form of docs/operations.md.
//
//   rotate+clip+quantize  GB/s of BF16 input   vs  the rate a single-thread sgemm's FLOP rate
//                                                   implies for the rotation's D FLOP per byte
//   INT2 decode attention GB/s of stored cache  vs  memcpy bandwidth (and BF16 attention time)
//   page checksums        arrival (prefill blocks, decode appends) and INT2 attention with
//                         checksums vs without, interleaved in one run; the checksum's own rate
//
// Usage: kvpool-bench-cpu [--out bench-results/cpu.json] [--context 32768] [benchmark flags]
#include <benchmark/benchmark.h>

#include <Eigen/Dense>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "common/status_macros.h"
#include "kernels/arrival_encoder.h"
#include "kernels/attention.h"
#include "kernels/block_layout.h"
#include "kernels/page_checksum.h"
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

// CPU seconds of the calling thread in `fn`: the with/without pairs below differ by a few
// percent, less than wall-clock noise on a shared machine; memory stalls still count.
template <typename Fn>
double Seconds(Fn&& fn) {
  auto now = [] {
    timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
  };
  const double t0 = now();
  fn();
  return now() - t0;
}

// Times of `run(false)` and `run(true)` back to back per iteration; the medians (a pair's two
// runs see the same machine load, the median drops the pairs another process disturbed).
template <typename Run>
std::pair<double, double> MedianPairSeconds(benchmark::State& state, Run&& run) {
  std::vector<double> without, with;
  for (auto _ : state) {
    without.push_back(Seconds([&] { run(false); }));
    with.push_back(Seconds([&] { run(true); }));
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };
  return {median(without), median(with)};
}

// Arrival as the CPU backend runs it (server/cpu_backend.cc): per block, rotate + quantize K and
// V, then (with checksums) the checksum of the block's slots while they are in cache. Each
// iteration runs both variants back to back, so drift on a shared machine hits both alike.
void BM_ArrivalChecksumCost(benchmark::State& state) {
  const RotationSet rotation = DenseRotation();
  const QuantConfig cfg = BenchQuantConfig();
  const RowCodec codec = *RowCodec::Create(cfg, kHeadDim);
  const ArrivalEncoder encoder = *ArrivalEncoder::Create(&rotation, codec);
  const BlockLayout layout = BlockLayout::ForModel(cfg, kKvHeads, kHeadDim);
  const PageChecksumGeometry geo = PageChecksumGeometry::Of(layout);
  const size_t rows = size_t{kIngestTokens} * kKvHeads;
  const std::vector<Bf16> k_in =
      testing::ToBf16(testing::RealLikeRows(static_cast<int>(rows), kHeadDim, 1));
  const std::vector<Bf16> v_in =
      testing::ToBf16(testing::RealLikeRows(static_cast<int>(rows), kHeadDim, 2));
  const int num_blocks = kIngestTokens / layout.tokens;
  std::vector<uint8_t> blocks(layout.block_bytes() * num_blocks);
  std::vector<uint32_t> sums(num_blocks);
  const size_t block_rows = static_cast<size_t>(layout.tokens) * kKvHeads * kHeadDim;
  auto run = [&](bool checksum) {
    for (int b = 0; b < num_blocks; ++b) {
      uint8_t* block = &blocks[b * layout.block_bytes()];
      for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
        const std::vector<Bf16>& in = t == KvTensor::kKey ? k_in : v_in;
        const absl::Span<const Bf16> block_in(in.data() + b * block_rows, block_rows);
        if (!encoder.EncodeIntoBlock(0, t, layout, block_in, 0, block).ok()) std::abort();
      }
      if (checksum) sums[b] = PageSlotsChecksum(block, geo, 0, layout.tokens);
    }
    benchmark::DoNotOptimize(blocks.data());
    benchmark::DoNotOptimize(sums.data());
  };
  const auto [without, with] = MedianPairSeconds(state, run);
  const double bytes = 2.0 * rows * kHeadDim * sizeof(Bf16);
  state.counters["with_bytes_per_second"] = bytes / with;
  state.counters["without_bytes_per_second"] = bytes / without;
}

// Decode appends: one token (every KV head, K and V) rotated into a BF16 recent page, plus (with
// checksums) that slot's checksum; 4096 steps cycling over 256 pages.
void BM_DecodeAppendChecksumCost(benchmark::State& state) {
  const RotationSet rotation = DenseRotation();
  QuantConfig cfg = BenchQuantConfig();
  cfg.method = QuantMethod::kBypass;
  const RowCodec codec = *RowCodec::Create(cfg, kHeadDim);
  const ArrivalEncoder encoder = *ArrivalEncoder::Create(&rotation, codec);
  const BlockLayout layout = BlockLayout::ForModel(cfg, kKvHeads, kHeadDim);
  const PageChecksumGeometry geo = PageChecksumGeometry::Of(layout);
  constexpr int kSteps = 4096, kPages = 256;
  const std::vector<Bf16> k_in =
      testing::ToBf16(testing::RealLikeRows(kSteps * kKvHeads, kHeadDim, 5));
  const std::vector<Bf16> v_in =
      testing::ToBf16(testing::RealLikeRows(kSteps * kKvHeads, kHeadDim, 6));
  std::vector<uint8_t> pages(layout.block_bytes() * kPages);
  std::vector<uint32_t> sums(kPages, 0);
  const size_t row = size_t{kKvHeads} * kHeadDim;
  auto run = [&](bool checksum) {
    for (int step = 0; step < kSteps; ++step) {
      const int page = (step / layout.tokens) % kPages, slot = step % layout.tokens;
      uint8_t* p = &pages[page * layout.block_bytes()];
      for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
        const std::vector<Bf16>& in = t == KvTensor::kKey ? k_in : v_in;
        if (!encoder
                 .EncodeIntoBlock(0, t, layout, absl::MakeConstSpan(&in[step * row], row), slot, p)
                 .ok())
          std::abort();
      }
      if (checksum) sums[page] += PageSlotsChecksum(p, geo, slot, 1);
    }
    benchmark::DoNotOptimize(pages.data());
    benchmark::DoNotOptimize(sums.data());
  };
  const auto [without, with] = MedianPairSeconds(state, run);
  state.counters["with_steps_per_second"] = kSteps / with;
  state.counters["without_steps_per_second"] = kSteps / without;
}

// The checksum alone over 64 MiB of INT2 blocks (the scrubber's work per byte).
void BM_PageChecksum(benchmark::State& state) {
  const BlockLayout layout = BlockLayout::ForModel(BenchQuantConfig(), kKvHeads, kHeadDim);
  const PageChecksumGeometry geo = PageChecksumGeometry::Of(layout);
  const size_t num_blocks = (size_t{64} << 20) / layout.block_bytes();
  std::vector<uint8_t> blocks(num_blocks * layout.block_bytes(), 0x5a);
  uint32_t sum = 0;
  for (auto _ : state) {
    for (size_t b = 0; b < num_blocks; ++b) {
      sum += PageSlotsChecksum(&blocks[b * layout.block_bytes()], geo, 0, layout.tokens);
    }
    benchmark::DoNotOptimize(sum);
  }
  state.counters["bytes_per_second"] = benchmark::Counter(
      static_cast<double>(blocks.size()), benchmark::Counter::kIsIterationInvariantRate);
}

// kvpoold's default scrubber pace (--scrub_max_bytes_per_second).
constexpr double kScrubBytesPerSecond = 128.0 * (1 << 20);

// INT2 decode attention alone, and while a thread verifies other blocks at the scrubber's default
// pace (its only effect on attention, which verifies nothing per call: memory bandwidth),
// interleaved.
void BM_AttentionWhileScrubbing(benchmark::State& state) {
  const RowCodec codec = *RowCodec::Create(BenchQuantConfig(), kHeadDim);
  const Int2History h = MakeHistory(codec, g_context);
  const Int2History other = MakeHistory(codec, g_context);
  const PageChecksumGeometry geo = PageChecksumGeometry::Of(other.layout);
  const AttentionShape shape{kQHeads, kKvHeads, kHeadDim};
  const std::vector<float> q = testing::GaussianValues(size_t{kQHeads} * kHeadDim, 9);
  std::atomic<bool> scrub{false}, stop{false};
  std::atomic<uint32_t> sink{0};
  std::thread scrubber([&] {
    size_t b = 0;
    double budget = 0;
    auto last = std::chrono::steady_clock::now();
    while (!stop.load()) {
      const auto now = std::chrono::steady_clock::now();
      budget += std::chrono::duration<double>(now - last).count() * kScrubBytesPerSecond;
      last = now;
      if (!scrub.load() || budget < other.layout.block_bytes()) {
        if (!scrub.load()) budget = 0;
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        continue;
      }
      sink += PageSlotsChecksum(other.blocks[b], geo, 0, other.layout.tokens);
      budget -= other.layout.block_bytes();
      b = (b + 1) % other.blocks.size();
    }
  });
  const auto [without, with] = MedianPairSeconds(state, [&](bool scrubbing) {
    scrub = scrubbing;
    benchmark::DoNotOptimize(AttendBlocks(shape, codec, h.layout, h.blocks, g_context, q));
    scrub = false;
  });
  stop = true;
  scrubber.join();
  state.counters["with_seconds_per_call"] = with;
  state.counters["without_seconds_per_call"] = without;
}

BENCHMARK(BM_Memcpy)->Unit(benchmark::kMillisecond)->MinTime(0.5)->UseRealTime();
BENCHMARK(BM_Sgemm1024)->Unit(benchmark::kMillisecond)->MinTime(0.5)->UseRealTime();
BENCHMARK(BM_RotateClipQuantize)->Unit(benchmark::kMillisecond)->MinTime(0.5)->UseRealTime();
BENCHMARK(BM_AttentionInt2)->Unit(benchmark::kMillisecond)->MinTime(0.5)->UseRealTime();
BENCHMARK(BM_AttentionBf16)->Unit(benchmark::kMillisecond)->MinTime(0.5)->UseRealTime();
BENCHMARK(BM_ArrivalChecksumCost)->Unit(benchmark::kMillisecond)->MinTime(2)->UseRealTime();
BENCHMARK(BM_DecodeAppendChecksumCost)->Unit(benchmark::kMillisecond)->MinTime(2)->UseRealTime();
BENCHMARK(BM_PageChecksum)->Unit(benchmark::kMillisecond)->MinTime(0.5)->UseRealTime();
BENCHMARK(BM_AttentionWhileScrubbing)->Unit(benchmark::kMillisecond)->MinTime(2)->UseRealTime();

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
  // Page checksums: the rate with checksums over the rate without (the bound: >= 0.97 on
  // arrival, >= 0.99 on attention).
  auto with_over_without = [&](const char* bench, const char* unit_counter) {
    const double with = reporter.Get(bench, std::string("with_") + unit_counter);
    const double without = reporter.Get(bench, std::string("without_") + unit_counter);
    return std::make_pair(with, without);
  };
  const auto [arr_with, arr_without] =
      with_over_without("BM_ArrivalChecksumCost", "bytes_per_second");
  report.Add({"arrival_int2_with_checksums",
              codec_params,
              arr_with / 1e9,
              "GB/s",
              {"arrival_int2_without_checksums", arr_without / 1e9}});
  const auto [dec_with, dec_without] =
      with_over_without("BM_DecodeAppendChecksumCost", "steps_per_second");
  report.Add({"decode_append_bf16_with_checksums",
              codec_params,
              dec_with,
              "tokens/s",
              {"decode_append_bf16_without_checksums", dec_without}});
  const auto [att_with, att_without] =
      with_over_without("BM_AttentionWhileScrubbing", "seconds_per_call");
  report.Add({"int2_attention_while_scrubbing_ms",
              attn_params,
              att_with * 1e3,
              "ms",
              {"int2_attention_alone_ms", att_without * 1e3},
              att_with > 0 ? att_without / att_with : 0});
  const double checksum_gbs = reporter.Get("BM_PageChecksum", "bytes_per_second") / 1e9;
  report.Add({"page_checksum_rate",
              {{"threads", "1"}},
              checksum_gbs,
              "GB/s",
              {"memcpy_bandwidth", memcpy_gbs}});
  report.Add({"scrub_default_pace_share_of_memcpy",
              {{"scrub_max_bytes_per_second", "134217728"}},
              kScrubBytesPerSecond / 1e9 / memcpy_gbs * 100,
              "%",
              {"memcpy_bandwidth", memcpy_gbs},
              0});
  report.PrintTable(std::cout);
  const absl::Status st = report.WriteJson(out_path);
  if (!st.ok()) {
    std::cerr << st << "\n";
    return 1;
  }
  std::cout << "wrote " << out_path << "\n";
  return 0;
}
