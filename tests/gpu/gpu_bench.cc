// GPU benchmark of the CUDA codec and the INT2 decode attention (no gRPC; run by
// tests/gpu/run.sh on the GPU machine). Times with CUDA events (median of many runs after
// warm-up), cycling through input sets larger than the L2, and compares each kernel with the
// byte floor: the bytes it must move over the device copy bandwidth measured in the same run.
// tests/gpu/sdpa_bench.py adds torch SDPA BF16 on the same shapes.
//
//   gpu_bench --out bench-results/gpu-kernels.json [--quick]
//       [--skip-codec] [--model NAME] [--batch B]... [--context TOKENS]...   (a subset, e.g. for
//       ncu)
//       [--scrub_cost]   (adds decode attention while the scrubber runs, at batch 8 x 32K and
//                         32 x 128K: seconds of sustained load, so not in A/B runs)
//       [--chunk_sweep=N,N,...]   (adds variant rows "chunk=N": every history chunk N tokens)
//       [--programmatic_launch=0|1] [--history_chunk_tokens=N] [--min_history_chunk_tokens=N]
//       [--tiers_beside_history=0|1]
//       [--history_async_copies=0|1] [--narrow_layout=0|1] [--group_merge=by_shape|always|never]
//       [--tail_merge=by_shape|always|never] [--arrival_mma_kernel=0|1] [--arrival_fuse_jobs=0|1]
//
// The tuning flags set the fields of kernels/cuda/kernel_tuning.h for every row (tests/gpu/run.sh
// ab passes them for its A/B variants); the variant rows below change one field on top of them.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "kernels/block_layout.h"
#include "kernels/codec_config.h"
#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_codec.h"
#include "kernels/cuda/kernel_tuning.h"
#include "kernels/cuda/page_checksum_cuda.h"
#include "kernels/cuda/testing_fill.h"
#include "kernels/rotation.h"

namespace kvpool::cuda {
namespace {

void Die(const std::string& what) {
  std::fprintf(stderr, "gpu_bench: %s\n", what.c_str());
  std::exit(1);
}

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) Die(std::string(what) + ": " + cudaGetErrorString(e));
}

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) Die(std::string(what) + ": " + s.ToString());
}

template <typename T>
T* DeviceAlloc(size_t n) {
  void* p = nullptr;
  Check(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)), "cudaMalloc");
  return static_cast<T*>(p);
}

template <typename T>
T* Upload(const std::vector<T>& v) {
  T* p = DeviceAlloc<T>(v.size());
  Check(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  return p;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Times `fn(i)` (enqueueing work for iteration i on `stream`) with CUDA events: `warmup`
// untimed calls, then `iters` timed ones. Returns the median in microseconds.
template <typename Fn>
double TimeUs(cudaStream_t stream, int warmup, int iters, Fn fn) {
  for (int i = 0; i < warmup; ++i) fn(i);
  std::vector<cudaEvent_t> ev(2 * iters);
  for (auto& e : ev) Check(cudaEventCreate(&e), "event");
  for (int i = 0; i < iters; ++i) {
    Check(cudaEventRecord(ev[2 * i], stream), "record");
    fn(warmup + i);
    Check(cudaEventRecord(ev[2 * i + 1], stream), "record");
  }
  Check(cudaStreamSynchronize(stream), "sync");
  std::vector<double> us(iters);
  for (int i = 0; i < iters; ++i) {
    float ms = 0;
    Check(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]), "elapsed");
    us[i] = 1000.0 * ms;
  }
  for (auto& e : ev) cudaEventDestroy(e);
  return Median(us);
}

// Medians of `a` and `b` timed in alternation (a, b, a, b, ...), so that clock and thermal drift
// over the run falls on both alike: the form for a with/without pair whose ratio is the result.
template <typename FnA, typename FnB>
std::pair<double, double> TimeInterleavedUs(cudaStream_t stream, int warmup, int iters, FnA a,
                                            FnB b) {
  for (int i = 0; i < warmup; ++i) a(i), b(i);
  std::vector<cudaEvent_t> ev(4 * iters);
  for (auto& e : ev) Check(cudaEventCreate(&e), "event");
  for (int i = 0; i < iters; ++i) {
    Check(cudaEventRecord(ev[4 * i], stream), "record");
    a(warmup + i);
    Check(cudaEventRecord(ev[4 * i + 1], stream), "record");
    b(warmup + i);
    Check(cudaEventRecord(ev[4 * i + 2], stream), "record");
  }
  Check(cudaStreamSynchronize(stream), "sync");
  std::vector<double> us_a(iters), us_b(iters);
  for (int i = 0; i < iters; ++i) {
    float ms = 0;
    Check(cudaEventElapsedTime(&ms, ev[4 * i], ev[4 * i + 1]), "elapsed");
    us_a[i] = 1000.0 * ms;
    Check(cudaEventElapsedTime(&ms, ev[4 * i + 1], ev[4 * i + 2]), "elapsed");
    us_b[i] = 1000.0 * ms;
  }
  for (auto& e : ev) cudaEventDestroy(e);
  return {Median(us_a), Median(us_b)};
}

// The daemon's --scrub_max_bytes_per_second default.
constexpr double kDefaultScrubBytesPerSecond = 128.0 * (1 << 20);

struct Result {
  std::string name;
  std::string params;  // JSON object text
  double value;        // microseconds or GB/s
  std::string unit;
  std::string baseline_name;
  double baseline_value;
  double ratio;
};

std::vector<Result> g_results;

// Device copy bandwidth, bytes read + written per second, on a 2 GiB copy.
double CopyBandwidthGBs(cudaStream_t stream) {
  const size_t bytes = size_t{2} << 30;
  uint8_t* a = DeviceAlloc<uint8_t>(bytes);
  uint8_t* b = DeviceAlloc<uint8_t>(bytes);
  Check(cudaMemset(a, 1, bytes), "memset");
  const double us = TimeUs(stream, 3, 15, [&](int) {
    Check(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream), "copy");
  });
  cudaFree(a);
  cudaFree(b);
  return 2.0 * bytes / (us * 1e-6) / 1e9;
}

// Rotate + clip + quantize on arrival, and dequantize, for Hkv = 8, D = 128.
void BenchCodec(cudaStream_t stream, double copy_gbs, const ArrivalTuning& base) {
  constexpr int kHkv = 8, kD = 128, kTokens = 64 * 1024, kSets = 4;
  QuantConfig cfg;
  const BlockLayout layout = BlockLayout::ForModel(cfg, kHkv, kD);
  const int blocks = kTokens / layout.tokens;
  const size_t rows_per_set = static_cast<size_t>(kTokens) * kHkv * kD;
  uint16_t* rows = DeviceAlloc<uint16_t>(rows_per_set * kSets);
  Check(testing::FillRealLikeBf16(rows, rows_per_set * kSets, kD, 3, 1.0f, stream), "fill");
  uint8_t* pool = DeviceAlloc<uint8_t>(static_cast<size_t>(blocks) * kSets * layout.block_bytes());
  std::vector<int32_t> table(static_cast<size_t>(blocks) * kSets);
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>(i);
  int32_t* d_table = Upload(table);
  int32_t* d_offsets = Upload(std::vector<int32_t>{0, kTokens});
  int32_t* d_first = Upload(std::vector<int32_t>{0});
  auto set = RotationSet::RandomizedHadamard(1, kD, 11);
  Check(set.status(), "rotation");
  const std::vector<float> m_k = set->Matrix(0, KvTensor::kKey);
  float* rotation = Upload(m_k);
  std::vector<float> m_k_t(m_k.size());  // M^T: the dequantization back to the original basis
  for (int i = 0; i < kD; ++i) {
    for (int j = 0; j < kD; ++j) m_k_t[j * kD + i] = m_k[i * kD + j];
  }
  float* unrotation = Upload(m_k_t);
  uint32_t* err = DeviceAlloc<uint32_t>(1);
  Check(cudaMemset(err, 0, 4), "memset");
  uint16_t* out = DeviceAlloc<uint16_t>(rows_per_set);
  const PagedKvView kv{pool, layout, cfg.scale_dtype, static_cast<int64_t>(blocks) * kSets};
  auto batch_for = [&](int s) {
    return SequenceBatch{1,      d_offsets, d_first, d_table + static_cast<size_t>(s) * blocks,
                         blocks, kTokens};
  };
  const double in_bytes = rows_per_set * 2.0;
  const double out_bytes = static_cast<double>(kTokens) * kHkv *
                           (layout.code_bytes_per_row() + layout.meta_bytes_per_row());
  // Rotated and identity with the given tuning, then rotated on the warp-per-row kernel (the
  // tensor-core kernel off) as an A/B row.
  for (const int variant : {0, 1, 2}) {
    const bool rotate = variant != 1;
    const bool row_kernel = variant == 2;
    ArrivalTuning tuning = base;
    if (row_kernel) tuning.mma_kernel = false;
    const double us = TimeUs(stream, 5, 40, [&](int i) {
      const int s = i % kSets;
      Check(QuantizeOnArrival(
                cfg, kv, batch_for(s), KvTensor::kKey,
                ArrivalRows{rows + s * rows_per_set, rotate ? rotation : nullptr, nullptr}, err,
                stream, tuning),
            "quantize");
    });
    const double floor_us = (in_bytes + out_bytes) / (copy_gbs * 1e9) * 1e6;
    g_results.push_back({row_kernel ? "quantize_on_arrival_rotated_row_kernel"
                         : rotate   ? "quantize_on_arrival_rotated"
                                    : "quantize_on_arrival_identity",
                         "{\"Hkv\": 8, \"D\": 128, \"tokens\": 65536, \"bits\": 2}",
                         in_bytes / (us * 1e-6) / 1e9, "GB/s of BF16 input", "copy_bandwidth_GBs",
                         copy_gbs, in_bytes / (us * 1e-6) / 1e9 / copy_gbs});
    std::printf("%-34s %10.1f us  %8.1f GB/s in   (floor %.1f us)\n", g_results.back().name.c_str(),
                us, g_results.back().value, floor_us);
  }
  Check(TakeCodecErrors(err, stream), "codec errors");
  // Page checksums: arrival of K and V with the checksums fused in (ArrivalRows::page_checksums,
  // zeroed first, as the CUDA backend does) against the same kernels with them off, in the same
  // run; then the verification pass (kernels/cuda/page_checksum_cuda.h) alone over one set's
  // pages, whose sums must equal the fused ones.
  {
    std::vector<ChecksumRange> ranges(static_cast<size_t>(blocks) * kSets);
    for (size_t b = 0; b < ranges.size(); ++b) {
      ranges[b] = {static_cast<int32_t>(b * layout.block_bytes() / 16), 0, layout.tokens, 1};
    }
    ChecksumRange* d_ranges = Upload(ranges);
    uint32_t* d_sums = DeviceAlloc<uint32_t>(ranges.size());
    uint32_t* d_pass = DeviceAlloc<uint32_t>(ranges.size());
    const PageChecksumGeometry geo = PageChecksumGeometry::Of(layout);
    // The timed calls leave the sums unzeroed: the CUDA backend zeroes them in the upload of the
    // batch's tables that it makes anyway, so a memset launch here would be the benchmark's cost,
    // not the checksums'. One untimed round with zeroed sums then feeds the comparison below.
    auto arrival = [&](int i, bool checksum, bool zero) {
      const int s = i % kSets;
      uint32_t* sums = checksum ? d_sums + static_cast<size_t>(s) * blocks : nullptr;
      if (zero) Check(cudaMemsetAsync(sums, 0, blocks * sizeof(uint32_t), stream), "memset");
      for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
        ArrivalRows in{rows + s * rows_per_set, rotation, nullptr};
        in.page_checksums = sums;
        Check(QuantizeOnArrival(cfg, kv, batch_for(s), t, in, err, stream, base), "quantize");
      }
    };
    const auto [without_us, with_us] = TimeInterleavedUs(
        stream, 5, 60, [&](int i) { arrival(i, false, false); },
        [&](int i) { arrival(i, true, false); });
    for (int s = 0; s < kSets; ++s) arrival(s, true, true);
    g_results.push_back({"arrival_kv_with_checksums_us",
                         "{\"Hkv\": 8, \"D\": 128, \"tokens\": 65536, \"bits\": 2}", with_us, "us",
                         "arrival_kv_without_checksums_us", without_us, without_us / with_us});
    std::printf("%-34s %10.1f us  vs %.1f us without (%.2f%% more)\n", "arrival_kv_with_checksums",
                with_us, without_us, (with_us / without_us - 1) * 100);
    Check(TakeCodecErrors(err, stream), "codec errors");
    const double pass_us = TimeUs(stream, 5, 40, [&](int i) {
      const size_t s = static_cast<size_t>(i % kSets) * blocks;
      Check(PageChecksums(pool, geo, geo, d_ranges + s, blocks, d_pass + s, stream), "checksums");
    });
    const double page_bytes = static_cast<double>(blocks) * (layout.block_bytes());
    g_results.push_back(
        {"page_checksums_pass", "{\"Hkv\": 8, \"D\": 128, \"pages\": 4096, \"bits\": 2}",
         page_bytes / (pass_us * 1e-6) / 1e9, "GB/s of pages read", "copy_bandwidth_GBs", copy_gbs,
         page_bytes / (pass_us * 1e-6) / 1e9 / copy_gbs});
    std::printf("%-34s %10.1f us  %8.1f GB/s read (floor %.1f us)\n", "page_checksums_pass",
                pass_us, g_results.back().value, page_bytes / (copy_gbs * 1e9) * 1e6);
    // Every set was last written by a timed arrival with checksums and then summed by the pass.
    std::vector<uint32_t> fused(ranges.size()), pass(ranges.size());
    Check(cudaMemcpy(fused.data(), d_sums, fused.size() * 4, cudaMemcpyDeviceToHost), "D2H");
    Check(cudaMemcpy(pass.data(), d_pass, pass.size() * 4, cudaMemcpyDeviceToHost), "D2H");
    if (fused != pass) Die("fused page checksums differ from the verification pass");
    cudaFree(d_ranges);
    cudaFree(d_sums);
    cudaFree(d_pass);
  }
  const double us = TimeUs(stream, 5, 40, [&](int i) {
    const int s = i % kSets;
    Check(DequantizeToBf16(cfg, kv, batch_for(s), KvTensor::kKey, out, err, stream), "dequant");
  });
  g_results.push_back({"dequantize_to_bf16", "{\"Hkv\": 8, \"D\": 128, \"tokens\": 65536}",
                       in_bytes / (us * 1e-6) / 1e9, "GB/s of BF16 output", "copy_bandwidth_GBs",
                       copy_gbs, in_bytes / (us * 1e-6) / 1e9 / copy_gbs});
  std::printf("%-34s %10.1f us  %8.1f GB/s out\n", "dequantize_to_bf16", us,
              g_results.back().value);
  Check(TakeCodecErrors(err, stream), "codec errors");
  // The same rows back in the original basis (x_rot * M^T on the CUDA cores).
  const double back_us = TimeUs(stream, 5, 40, [&](int i) {
    const int s = i % kSets;
    Check(DequantizeToOriginalBf16(cfg, kv, batch_for(s), KvTensor::kKey, unrotation, out, err,
                                   stream),
          "dequant original");
  });
  g_results.push_back(
      {"dequantize_to_bf16_original_basis", "{\"Hkv\": 8, \"D\": 128, \"tokens\": 65536}",
       in_bytes / (back_us * 1e-6) / 1e9, "GB/s of BF16 output", "copy_bandwidth_GBs", copy_gbs,
       in_bytes / (back_us * 1e-6) / 1e9 / copy_gbs});
  std::printf("%-34s %10.1f us  %8.1f GB/s out\n", "dequantize_to_bf16_original_basis", back_us,
              g_results.back().value);
  Check(TakeCodecErrors(err, stream), "codec errors");
  for (void* p : std::vector<void*>{rows, pool, d_table, d_offsets, d_first, rotation, unrotation,
                                    err, out}) {
    cudaFree(p);
  }
}

// Demotion of one decode step: every (sequence, layer) moves its 16 oldest recent tokens from a
// BF16 page into an INT2 history block (32 sequences x 80 layers, Hkv = 8, D = 128, shuffled
// blocks), K and V. One DemoteToHistory launch against the path it replaced in the same run:
// dequantize the pages to a staging buffer, then quantize it, per tensor (four launches); and
// with the page checksums fused in against without.
void BenchDemotion(cudaStream_t stream, double copy_gbs, const ArrivalTuning& tuning) {
  constexpr int kHkv = 8, kD = 128, kRuns = 32 * 80, kTokens = 16;
  QuantConfig cfg;
  QuantConfig bypass = cfg;
  bypass.method = QuantMethod::kBypass;
  const BlockLayout hist = BlockLayout::ForModel(cfg, kHkv, kD);
  const BlockLayout bf16 = BlockLayout::ForModel(bypass, kHkv, kD);
  const int rows = kRuns * kTokens;
  uint8_t* pages = DeviceAlloc<uint8_t>(static_cast<size_t>(kRuns) * bf16.block_bytes());
  uint8_t* history = DeviceAlloc<uint8_t>(static_cast<size_t>(kRuns) * hist.block_bytes());
  const size_t values = static_cast<size_t>(rows) * kHkv * kD;
  uint16_t* staging = DeviceAlloc<uint16_t>(values);
  Check(testing::FillRealLikeBf16(staging, values, kD, 5, 1.0f, stream), "fill");
  std::vector<int32_t> offsets(kRuns + 1), first(kRuns, 0), src_table(kRuns), dst_table(kRuns);
  for (int i = 0; i <= kRuns; ++i) offsets[i] = i * kTokens;
  std::iota(src_table.begin(), src_table.end(), 0);
  std::iota(dst_table.begin(), dst_table.end(), 0);
  std::mt19937 rng(3);
  std::shuffle(src_table.begin(), src_table.end(), rng);
  std::shuffle(dst_table.begin(), dst_table.end(), rng);
  int32_t* d_offsets = Upload(offsets);
  int32_t* d_first = Upload(first);
  int32_t* d_src = Upload(src_table);
  int32_t* d_dst = Upload(dst_table);
  uint32_t* err = DeviceAlloc<uint32_t>(1);
  Check(cudaMemset(err, 0, 4), "memset");
  const PagedKvView page_view{pages, bf16, cfg.scale_dtype, kRuns};
  const PagedKvView hist_view{history, hist, cfg.scale_dtype, kRuns};
  const SequenceBatch from_batch{kRuns, d_offsets, d_first, d_src, 1, rows};
  const SequenceBatch to_batch{kRuns, d_offsets, d_first, d_dst, 1, rows};
  for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {  // the recent pages
    Check(QuantizeOnArrival(bypass, page_view, from_batch, t, ArrivalRows{staging}, err, stream),
          "fill pages");
  }
  const PagedRows from{page_view, d_first, d_src, 1};
  // Without and with the page checksums fused in, in alternation (the sums are not zeroed in
  // the timed calls: the CUDA backend zeroes them in a table upload it makes anyway).
  uint32_t* sums = DeviceAlloc<uint32_t>(kRuns);
  const auto [fused_us, checksums_us] = TimeInterleavedUs(
      stream, 5, 60,
      [&](int) {
        Check(DemoteToHistory(cfg, hist_view, to_batch, from, err, stream, tuning), "demote");
      },
      [&](int) {
        Check(DemoteToHistory(cfg, hist_view, to_batch, from, err, stream, tuning, sums), "demote");
      });
  const double staged_us = TimeUs(stream, 5, 40, [&](int) {
    for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
      Check(DequantizeToBf16(bypass, page_view, from_batch, t, staging, err, stream), "dequant");
      Check(
          QuantizeOnArrival(cfg, hist_view, to_batch, t, ArrivalRows{staging}, err, stream, tuning),
          "quantize");
    }
  });
  Check(TakeCodecErrors(err, stream), "codec errors");
  const double in_bytes = 2.0 * values * 2;  // K and V, BF16
  const double out_bytes =
      2.0 * rows * kHkv * (hist.code_bytes_per_row() + hist.meta_bytes_per_row());
  const double floor_us = (in_bytes + out_bytes) / (copy_gbs * 1e9) * 1e6;
  g_results.push_back(
      {"demote_to_history_one_launch",
       "{\"sequences\": 32, \"layers\": 80, \"tokens\": 16, \"Hkv\": 8, \"D\": 128}", fused_us,
       "us", "dequantize_then_quantize_us", staged_us, fused_us / staged_us});
  std::printf("%-34s %10.1f us  %8.1f GB/s in   (staged path %.1f us, floor %.1f us)\n",
              "demote_to_history_one_launch", fused_us, in_bytes / (fused_us * 1e-6) / 1e9,
              staged_us, floor_us);
  g_results.push_back(
      {"demote_with_checksums_us",
       "{\"sequences\": 32, \"layers\": 80, \"tokens\": 16, \"Hkv\": 8, \"D\": 128}", checksums_us,
       "us", "demote_without_checksums_us", fused_us, fused_us / checksums_us});
  std::printf("%-34s %10.1f us  vs %.1f us without (%.2f%% more)\n", "demote_with_checksums",
              checksums_us, fused_us, (checksums_us / fused_us - 1) * 100);
  for (void* p :
       std::vector<void*>{pages, history, staging, d_offsets, d_first, d_src, d_dst, err, sums}) {
    cudaFree(p);
  }
}

struct Model {
  const char* name;
  int q_heads, kv_heads, head_dim;
};

// One model's pools, filled once (32 sequences of 128K history tokens of capacity), shared by
// all batch sizes and contexts of that model. Every row runs with `base`; some shapes also run
// variants that change one field of it (results named int2_decode_attention_variant):
// "tiers_in_sequence" (the BF16 tier kernel before the INT2 history instead of beside it) at
// batch 1 and at batch 8 x 32K, "merge_kernel" (a merge kernel after the attention kernels
// instead of the tail merge, which runs from as many KV head groups as SMs) at batch 32, and,
// with `ab`, at batch 1 x 8K and batch 32 x 128K: "no_pdl" (no programmatic dependent launch)
// and "ordinary_loads" (the INT2 history kernel without asynchronous copies).
// Decode attention alone and while a scrubber checks the pool's pages from its own thread and
// stream, as the daemon's does: at `bytes_per_second` (the daemon's default pace), or flat out
// when 0. Rounds of launches of `graphs` (at least 40 ms each) alternate between the two; the
// result is the mean time per launch of each.
std::pair<double, double> AttentionWhileScrubbing(cudaStream_t stream,
                                                  const std::vector<cudaGraphExec_t>& graphs,
                                                  double us_per_launch, const uint8_t* pool,
                                                  const BlockLayout& layout, int64_t blocks,
                                                  double bytes_per_second) {
  constexpr int kChunkBlocks = 256;
  std::vector<ChecksumRange> ranges(blocks);
  for (int64_t b = 0; b < blocks; ++b) {
    ranges[b] = {static_cast<int32_t>(b * layout.block_bytes() / 16), 0, layout.tokens, 1};
  }
  ChecksumRange* d_ranges = Upload(ranges);
  uint32_t* d_out = DeviceAlloc<uint32_t>(kChunkBlocks);
  const PageChecksumGeometry geo = PageChecksumGeometry::Of(layout);
  cudaStream_t scrub_stream;
  Check(cudaStreamCreateWithFlags(&scrub_stream, cudaStreamNonBlocking), "stream");
  std::atomic<bool> active{false}, stop{false};
  std::atomic<int64_t> chunks{0};
  std::thread scrubber([&] {
    const auto period = std::chrono::duration<double>(
        bytes_per_second > 0 ? kChunkBlocks * layout.block_bytes() / bytes_per_second : 0.0);
    int64_t next = 0;
    while (!stop.load()) {
      if (!active.load()) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        continue;
      }
      const auto start = std::chrono::steady_clock::now();
      Check(PageChecksums(pool, geo, geo, d_ranges + next, kChunkBlocks, d_out, scrub_stream),
            "scrub");
      Check(cudaStreamSynchronize(scrub_stream), "scrub sync");
      next = (next + kChunkBlocks) % (blocks - kChunkBlocks);
      ++chunks;
      std::this_thread::sleep_until(start + period);
    }
  });
  const int launches = std::max(20, static_cast<int>(40000 / us_per_launch));
  double total_ms[2] = {0, 0};
  cudaEvent_t begin, end;
  Check(cudaEventCreate(&begin), "event");
  Check(cudaEventCreate(&end), "event");
  for (int round = 0; round < 12; ++round) {
    const int on = round % 2;
    active = on == 1;
    if (on == 1) {  // the scrubber is running before the round starts
      const int64_t seen = chunks.load();
      while (chunks.load() == seen) std::this_thread::yield();
    }
    Check(cudaEventRecord(begin, stream), "record");
    for (int i = 0; i < launches; ++i) {
      Check(cudaGraphLaunch(graphs[i % graphs.size()], stream), "graph launch");
    }
    Check(cudaEventRecord(end, stream), "record");
    Check(cudaEventSynchronize(end), "sync");
    float ms = 0;
    Check(cudaEventElapsedTime(&ms, begin, end), "elapsed");
    total_ms[on] += ms;
  }
  stop = true;
  scrubber.join();
  cudaEventDestroy(begin);
  cudaEventDestroy(end);
  cudaStreamDestroy(scrub_stream);
  cudaFree(d_ranges);
  cudaFree(d_out);
  const double per = 1000.0 / (6.0 * launches);
  return {total_ms[0] * per, total_ms[1] * per};
}

void BenchAttention(cudaStream_t stream, double copy_gbs, const Model& m,
                    const std::vector<int>& batches, const std::vector<int>& contexts,
                    const AttentionTuning& base, bool ab, bool scrub_cost,
                    const std::vector<int>& chunk_sweep) {
  constexpr int kSink = 64, kRecent = 256, kT = 16;
  constexpr int64_t kCapacityTokens = int64_t{32} * 128 * 1024;
  constexpr int kMaxSets = 32;
  QuantConfig cfg;
  cfg.block_tokens = kT;
  QuantConfig bypass = cfg;
  bypass.method = QuantMethod::kBypass;
  const BlockLayout int2 = BlockLayout::ForModel(cfg, m.kv_heads, m.head_dim);
  const BlockLayout bf16 = BlockLayout::ForModel(bypass, m.kv_heads, m.head_dim);
  const int64_t int2_blocks = kCapacityTokens / kT;
  uint8_t* int2_pool = DeviceAlloc<uint8_t>(int2_blocks * int2.block_bytes());
  // Fill: random rows quantized by the GPU codec, 128K tokens at a time.
  {
    constexpr int kChunk = 128 * 1024;
    uint16_t* rows = DeviceAlloc<uint16_t>(static_cast<size_t>(kChunk) * m.kv_heads * m.head_dim);
    int32_t* offsets = Upload(std::vector<int32_t>{0, kChunk});
    int32_t* first = Upload(std::vector<int32_t>{0});
    std::vector<int32_t> table(int2_blocks);
    for (int64_t i = 0; i < int2_blocks; ++i) table[i] = static_cast<int32_t>(i);
    int32_t* d_table = Upload(table);
    uint32_t* err = DeviceAlloc<uint32_t>(1);
    Check(cudaMemset(err, 0, 4), "memset");
    const PagedKvView kv{int2_pool, int2, cfg.scale_dtype, int2_blocks};
    for (int64_t c = 0; c < kCapacityTokens / kChunk; ++c) {
      const SequenceBatch batch{1,           offsets, first, d_table + c * (kChunk / kT),
                                kChunk / kT, kChunk};
      for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
        Check(
            testing::FillRealLikeBf16(rows, static_cast<size_t>(kChunk) * m.kv_heads * m.head_dim,
                                      m.head_dim, 100 + 2 * c + static_cast<int>(t), 1.0f, stream),
            "fill");
        Check(
            QuantizeOnArrival(cfg, kv, batch, t, ArrivalRows{rows, nullptr, nullptr}, err, stream),
            "quantize");
      }
    }
    Check(TakeCodecErrors(err, stream), "fill errors");
    for (void* p : std::vector<void*>{rows, offsets, first, d_table, err}) cudaFree(p);
  }
  const int bf16_blocks_per_seq = (kSink + kRecent) / kT;
  const int64_t bf16_blocks = int64_t{kMaxSets} * 32 * bf16_blocks_per_seq;
  uint8_t* bf16_pool = DeviceAlloc<uint8_t>(bf16_blocks * bf16.block_bytes());
  Check(
      testing::FillRealLikeBf16(reinterpret_cast<uint16_t*>(bf16_pool),
                                bf16_blocks * bf16.block_bytes() / 2, m.head_dim, 5, 1.0f, stream),
      "fill bf16");
  auto rotations = RotationSet::RandomizedHadamard(1, m.head_dim, 21);
  Check(rotations.status(), "rotation");
  float* mk = Upload(rotations->Matrix(0, KvTensor::kKey));
  float* mv = Upload(rotations->Matrix(0, KvTensor::kValue));

  for (int b : batches) {
    for (int ctx : contexts) {
      const int hist = ctx - kSink - kRecent;
      const int hist_blocks = (hist + kT - 1) / kT;
      const double set_bytes =
          static_cast<double>(b) * m.kv_heads *
          (static_cast<double>(hist) * (int2.code_bytes_per_row() + int2.meta_bytes_per_row()) * 2 +
           (kSink + kRecent) * 2.0 * m.head_dim * 2);
      const int64_t fit = kCapacityTokens / (static_cast<int64_t>(b) * hist_blocks * kT);
      const int sets = static_cast<int>(std::clamp<int64_t>(
          static_cast<int64_t>(std::ceil(256e6 / set_bytes)), 1, std::min<int64_t>(kMaxSets, fit)));
      // Tables of all sets: set s, sequence i uses history region s * b + i.
      std::vector<int32_t> hist_tables(static_cast<size_t>(sets) * b * hist_blocks);
      std::vector<int32_t> sink_tables(static_cast<size_t>(sets) * b * 4);
      std::vector<int32_t> recent_tables(static_cast<size_t>(sets) * b * 16);
      for (int s = 0; s < sets; ++s) {
        for (int i = 0; i < b; ++i) {
          const int64_t region = static_cast<int64_t>(s) * b + i;
          for (int j = 0; j < hist_blocks; ++j) {
            hist_tables[region * hist_blocks + j] = static_cast<int32_t>(region * hist_blocks + j);
          }
          const int64_t bf16_region = region % (int64_t{kMaxSets} * 32);
          for (int j = 0; j < 4; ++j) {
            sink_tables[region * 4 + j] =
                static_cast<int32_t>(bf16_region * bf16_blocks_per_seq + j);
          }
          for (int j = 0; j < 16; ++j) {
            recent_tables[region * 16 + j] =
                static_cast<int32_t>(bf16_region * bf16_blocks_per_seq + 4 + j);
          }
        }
      }
      int32_t* d_hist = Upload(hist_tables);
      int32_t* d_sink = Upload(sink_tables);
      int32_t* d_recent = Upload(recent_tables);
      int32_t* d_zero = Upload(std::vector<int32_t>(b, 0));
      int32_t* d_hist_n = Upload(std::vector<int32_t>(b, hist));
      int32_t* d_sink_n = Upload(std::vector<int32_t>(b, kSink));
      int32_t* d_recent_n = Upload(std::vector<int32_t>(b, kRecent));
      const size_t qn = static_cast<size_t>(b) * m.q_heads * m.head_dim;
      float* q = DeviceAlloc<float>(qn * sets);
      Check(testing::FillGaussianF32(q, qn * sets, 9, 1.0f, stream), "fill q");
      float* out = DeviceAlloc<float>(qn);
      float* lse = DeviceAlloc<float>(static_cast<size_t>(b) * m.q_heads);

      DecodeAttentionShape shape;
      shape.cfg = cfg;
      shape.q_heads = m.q_heads;
      PagedKvBatch pools;  // the pools and bounds every set shares
      pools.history_pool = PagedKvView{int2_pool, int2, cfg.scale_dtype, int2_blocks};
      pools.bf16_pool = PagedKvView{bf16_pool, bf16, cfg.scale_dtype, bf16_blocks};
      pools.num_seqs = b;
      pools.max_history_tokens = hist;
      pools.max_bf16_tokens = kSink + kRecent;
      std::vector<std::string> variants{""};
      if (ab && ((b == 1 && ctx == 8192) || (b == 32 && ctx == 131072))) {
        variants.push_back("no_pdl");
        variants.push_back("ordinary_loads");
      }
      if (b == 32) variants.push_back("merge_kernel");
      if (b == 1 || (b == 8 && ctx == 32768)) variants.push_back("tiers_in_sequence");
      for (const int x : chunk_sweep) {
        if (x < hist) variants.push_back("chunk=" + std::to_string(x));
      }
      // Every variant's graphs are captured first and then timed in alternation (default,
      // variant, default, ...): a row measured later in the same process ran up to 15 % slower
      // than the same configuration measured first (kernels/cuda/NOTES.md, run 10), so rows
      // timed one after the other would compare the order, not the variants.
      struct VariantGraphs {
        std::string name;
        DecodeAttentionSplit split;
        uint8_t* ws = nullptr;
        std::vector<cudaGraphExec_t> graphs;
        std::vector<double> us;
      };
      std::vector<VariantGraphs> runs;
      for (const std::string& variant : variants) {
        shape.tuning = base;
        if (variant == "no_pdl") shape.tuning.programmatic_launch = false;
        if (variant == "ordinary_loads") shape.tuning.history_async_copies = false;
        if (variant == "merge_kernel") shape.tuning.tail_merge = PathChoice::kNever;
        if (variant == "tiers_in_sequence") shape.tuning.tiers_beside_history = false;
        if (variant.rfind("chunk=", 0) == 0) {  // exactly this chunk length, where the parts allow
          const int x = std::atoi(variant.c_str() + 6);
          shape.tuning.min_history_chunk_tokens = x;
          shape.tuning.max_history_chunk_tokens = x;
        }
        auto split = DecodeAttentionSplitOf(shape, pools);
        Check(split.status(), "split");
        auto ws_bytes = DecodeAttentionWorkspaceBytes(shape, pools);
        Check(ws_bytes.status(), "workspace");
        VariantGraphs run{variant,
                          *split,
                          DeviceAlloc<uint8_t>(*ws_bytes),
                          std::vector<cudaGraphExec_t>(sets),
                          {}};
        for (int s = 0; s < sets; ++s) {
          const size_t off = static_cast<size_t>(s) * b;
          PagedKvBatch batch = pools;
          batch.sink = PagedKvTier{d_sink + off * 4, 4, d_zero, d_sink_n};
          batch.history = PagedKvTier{d_hist + off * hist_blocks, hist_blocks, d_zero, d_hist_n};
          batch.recent = PagedKvTier{d_recent + off * 16, 16, d_zero, d_recent_n};
          const DecodeIo io{q + s * qn, mk, mv, out, lse};
          cudaGraph_t graph;
          Check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "capture");
          Check(DecodeAttention(shape, batch, io, run.ws, *ws_bytes, stream), "attention");
          Check(cudaStreamEndCapture(stream, &graph), "capture end");
          Check(cudaGraphInstantiate(&run.graphs[s], graph, 0), "instantiate");
          cudaGraphDestroy(graph);
        }
        runs.push_back(std::move(run));
      }
      const int iters = set_bytes > 1e9 ? 30 : 100;
      for (int i = 0; i < 10; ++i) {
        for (VariantGraphs& r : runs) Check(cudaGraphLaunch(r.graphs[i % sets], stream), "warm");
      }
      std::vector<cudaEvent_t> ev(runs.size() * iters + 1);
      for (auto& e : ev) Check(cudaEventCreate(&e), "event");
      Check(cudaEventRecord(ev[0], stream), "record");
      for (int i = 0, k = 1; i < iters; ++i) {
        for (VariantGraphs& r : runs) {
          Check(cudaGraphLaunch(r.graphs[(10 + i) % sets], stream), "graph launch");
          Check(cudaEventRecord(ev[k++], stream), "record");
        }
      }
      Check(cudaStreamSynchronize(stream), "sync");
      for (size_t k = 1; k < ev.size(); ++k) {
        float ms = 0;
        Check(cudaEventElapsedTime(&ms, ev[k - 1], ev[k]), "elapsed");
        runs[(k - 1) % runs.size()].us.push_back(1000.0 * ms);
      }
      for (auto& e : ev) cudaEventDestroy(e);
      for (VariantGraphs& run : runs) {
        const std::string& variant = run.name;
        const double us = Median(run.us);
        const double bytes =
            set_bytes + 2.0 * qn * sizeof(float) + 2.0 * m.head_dim * m.head_dim * sizeof(float);
        const double floor_us = bytes / (copy_gbs * 1e9) * 1e6;
        char params[512];
        std::snprintf(params, sizeof(params),
                      "{\"model\": \"%s\", \"Hq\": %d, \"Hkv\": %d, \"D\": %d, \"batch\": %d, "
                      "\"context\": %d, \"history\": %d, \"sink\": %d, \"recent\": %d, "
                      "\"bytes\": %.0f, \"input_sets\": %d, \"variant\": \"%s\"}",
                      m.name, m.q_heads, m.kv_heads, m.head_dim, b, ctx, hist, kSink, kRecent,
                      bytes, sets, variant.c_str());
        g_results.push_back(
            {variant.empty() ? "int2_decode_attention" : "int2_decode_attention_variant", params,
             us, "us", "byte_floor_us", floor_us, us / floor_us});
        std::printf(
            "%-10s Hq=%-2d Hkv=%d D=%-3d B=%-2d ctx=%-6d %9.1f us  floor %8.1f us  (%.2fx) "
            "history %d x %d %s\n",
            m.name, m.q_heads, m.kv_heads, m.head_dim, b, ctx, us, floor_us, us / floor_us,
            run.split.history_chunks, run.split.history_chunk_tokens, variant.c_str());
        std::fflush(stdout);
        // What the scrubber costs attention (the bound: at most 1 % at the default pace). Only
        // with --scrub_cost: its seconds of sustained load would slow the rows timed after it.
        if (scrub_cost && variant.empty() &&
            ((b == 8 && ctx == 32768) || (b == 32 && ctx == 131072))) {
          for (const double pace : {kDefaultScrubBytesPerSecond, 0.0}) {
            const auto [alone, scrubbing] =
                AttentionWhileScrubbing(stream, run.graphs, us, int2_pool, int2, int2_blocks, pace);
            g_results.push_back({pace > 0 ? "int2_decode_attention_while_scrubbing"
                                          : "int2_decode_attention_while_scrubbing_flat_out",
                                 params, scrubbing, "us", "int2_decode_attention_alone_us", alone,
                                 alone / scrubbing});
            std::printf(
                "%-10s B=%-2d ctx=%-6d while scrubbing (%s): %.1f us vs %.1f us alone "
                "(%.2f%% more)\n",
                m.name, b, ctx, pace > 0 ? "default pace" : "flat out", scrubbing, alone,
                (scrubbing / alone - 1) * 100);
          }
        }
      }
      for (VariantGraphs& run : runs) {
        for (auto g : run.graphs) cudaGraphExecDestroy(g);
        cudaFree(run.ws);
      }
      for (void* p : std::vector<void*>{d_hist, d_sink, d_recent, d_zero, d_hist_n, d_sink_n,
                                        d_recent_n, q, out, lse}) {
        cudaFree(p);
      }
    }
  }
  for (void* p : std::vector<void*>{int2_pool, bf16_pool, mk, mv}) cudaFree(p);
}

// The value of `arg` if it is `--name=VALUE`, else nullptr.
const char* FlagValue(const char* arg, const char* name) {
  const size_t n = std::strlen(name);
  if (std::strncmp(arg, "--", 2) != 0 || std::strncmp(arg + 2, name, n) != 0 || arg[2 + n] != '=') {
    return nullptr;
  }
  return arg + 3 + n;
}

bool ParseBool(const char* name, const char* v) {
  if (std::strcmp(v, "1") == 0 || std::strcmp(v, "true") == 0) return true;
  if (std::strcmp(v, "0") == 0 || std::strcmp(v, "false") == 0) return false;
  Die(std::string("--") + name + " takes 0 or 1, not " + v);
  return false;
}

PathChoice ParseChoice(const char* name, const char* v) {
  if (std::strcmp(v, "by_shape") == 0) return PathChoice::kByShape;
  if (std::strcmp(v, "always") == 0) return PathChoice::kAlways;
  if (std::strcmp(v, "never") == 0) return PathChoice::kNever;
  Die(std::string("--") + name + " takes by_shape, always or never, not " + v);
  return PathChoice::kByShape;
}

// Applies `arg` to `t` if it is one of the tuning flags; false if it is none.
bool ApplyTuningFlag(const char* arg, KernelTuning& t) {
  const char* v = nullptr;
  if ((v = FlagValue(arg, "programmatic_launch"))) {
    t.attention.programmatic_launch = ParseBool("programmatic_launch", v);
  } else if ((v = FlagValue(arg, "history_chunk_tokens"))) {
    t.attention.max_history_chunk_tokens = std::atoi(v);
  } else if ((v = FlagValue(arg, "min_history_chunk_tokens"))) {
    t.attention.min_history_chunk_tokens = std::atoi(v);
  } else if ((v = FlagValue(arg, "tiers_beside_history"))) {
    t.attention.tiers_beside_history = ParseBool("tiers_beside_history", v);
  } else if ((v = FlagValue(arg, "history_async_copies"))) {
    t.attention.history_async_copies = ParseBool("history_async_copies", v);
  } else if ((v = FlagValue(arg, "narrow_layout"))) {
    t.attention.narrow_layout = ParseBool("narrow_layout", v);
  } else if ((v = FlagValue(arg, "group_merge"))) {
    t.attention.group_merge = ParseChoice("group_merge", v);
  } else if ((v = FlagValue(arg, "tail_merge"))) {
    t.attention.tail_merge = ParseChoice("tail_merge", v);
  } else if ((v = FlagValue(arg, "arrival_mma_kernel"))) {
    t.arrival.mma_kernel = ParseBool("arrival_mma_kernel", v);
  } else if ((v = FlagValue(arg, "arrival_fuse_jobs"))) {
    t.arrival.fuse_jobs = ParseBool("arrival_fuse_jobs", v);
  } else {
    return false;
  }
  return true;
}

int Main(int argc, char** argv) {
  std::string out_path = "bench-results/gpu-kernels.json";
  KernelTuning tuning;
  bool quick = false;
  bool codec = true;
  bool scrub_cost = false;
  std::string only_model;
  std::vector<int> chunk_sweep;
  std::vector<int> only_batches, only_contexts;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--out") == 0 && i + 1 < argc) {
      out_path = argv[++i];
    } else if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--scrub_cost") == 0) {
      scrub_cost = true;
    } else if (std::strcmp(argv[i], "--skip-codec") == 0) {
      codec = false;
    } else if (std::strcmp(argv[i], "--model") == 0 && i + 1 < argc) {
      only_model = argv[++i];
    } else if (std::strcmp(argv[i], "--batch") == 0 && i + 1 < argc) {
      only_batches.push_back(std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--context") == 0 && i + 1 < argc) {
      only_contexts.push_back(std::atoi(argv[++i]));
    } else if (const char* v = FlagValue(argv[i], "chunk_sweep")) {
      for (const absl::string_view n : absl::StrSplit(v, ',')) {
        int x = 0;
        if (!absl::SimpleAtoi(n, &x) || x <= 0) Die("--chunk_sweep takes positive token counts");
        chunk_sweep.push_back(x);
      }
    } else if (ApplyTuningFlag(argv[i], tuning)) {
      continue;
    } else {
      Die(std::string("unknown argument ") + argv[i]);
    }
  }
  if (CudaDeviceCount() == 0) Die("no CUDA device");
  cudaDeviceProp prop;
  Check(cudaGetDeviceProperties(&prop, 0), "properties");
  cudaStream_t stream;
  Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  const double copy_gbs = CopyBandwidthGBs(stream);
  std::printf("device %s, %d SMs, L2 %.0f MB, copy bandwidth %.0f GB/s (read + write)\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize / 1e6, copy_gbs);
  if (codec) {
    BenchCodec(stream, copy_gbs, tuning.arrival);
    BenchDemotion(stream, copy_gbs, tuning.arrival);
  }
  std::vector<int> batches = quick ? std::vector<int>{1, 8} : std::vector<int>{1, 8, 32};
  std::vector<int> contexts =
      quick ? std::vector<int>{32768} : std::vector<int>{8192, 32768, 131072};
  if (!only_batches.empty()) batches = only_batches;
  if (!only_contexts.empty()) contexts = only_contexts;
  for (const Model& m :
       {Model{"llama70b", 64, 8, 128}, Model{"hq32", 32, 8, 128}, Model{"smollm2", 9, 3, 64}}) {
    if (!only_model.empty() && only_model != m.name) continue;
    BenchAttention(stream, copy_gbs, m, batches, contexts, tuning.attention,
                   /*ab=*/std::strcmp(m.name, "llama70b") == 0, scrub_cost, chunk_sweep);
  }
  FILE* f = std::fopen(out_path.c_str(), "w");
  if (f == nullptr) Die("cannot write " + out_path);
  std::fprintf(f,
               "{\"machine\": {\"gpu\": \"%s\", \"sms\": %d, \"l2_bytes\": %d, "
               "\"copy_bandwidth_GBs\": %.1f},\n \"results\": [\n",
               prop.name, prop.multiProcessorCount, prop.l2CacheSize, copy_gbs);
  for (size_t i = 0; i < g_results.size(); ++i) {
    const Result& r = g_results[i];
    std::fprintf(f,
                 "  {\"name\": \"%s\", \"params\": %s, \"value\": %.3f, \"unit\": \"%s\", "
                 "\"baseline\": {\"name\": \"%s\", \"value\": %.3f}, \"ratio\": %.4f}%s\n",
                 r.name.c_str(), r.params.c_str(), r.value, r.unit.c_str(), r.baseline_name.c_str(),
                 r.baseline_value, r.ratio, i + 1 < g_results.size() ? "," : "");
  }
  std::fprintf(f, " ]}\n");
  std::fclose(f);
  std::printf("wrote %s\n", out_path.c_str());
  return 0;
}

}  // namespace
}  // namespace kvpool::cuda

int main(int argc, char** argv) { return kvpool::cuda::Main(argc, argv); }
