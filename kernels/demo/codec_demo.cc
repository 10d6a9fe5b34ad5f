// kvpool-codec-demo: the CPU codec on a synthetic KV history with channel outliers.
//
// Stores one layer of a long sequence the way kvpoold does (BF16 sink, INT2 history in paged
// blocks, BF16 recent window) under several rotations, then reports the bytes stored, the
// compression against BF16 and the decode-attention error against BF16 dense attention.
//
// Usage: kvpool-codec-demo [tokens]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kernels/attention.h"
#include "kernels/block_layout.h"
#include "common/status_macros.h"
#include "kernels/mixed_sequence.h"
#include "kernels/rotation.h"
#include "kernels/row_codec.h"
#include "tests/support/test_data.h"

namespace kvpool {
namespace {

constexpr int kQHeads = 64, kKvHeads = 8, kHeadDim = 128;
constexpr double kQueryFocus = 0.3;  // query norm relative to sqrt(D) / |aimed keys|

struct DemoCase {
  std::string name;
  RotationSet rotation;
  QuantConfig quant;
};

struct DemoResult {
  size_t stored_bytes = 0;
  double rel_error = 0, max_lse_error = 0, quantize_mbps = 0;
};

double RelativeL2(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / den);
}

absl::StatusOr<DemoResult> RunCase(const DemoCase& c, int tokens, const std::vector<float>& k,
                                   const std::vector<float>& v, const std::vector<float>& q,
                                   const AttentionOutput& reference) {
  const AttentionShape shape{kQHeads, kKvHeads, kHeadDim};
  const size_t row = size_t{kKvHeads} * kHeadDim;
  KVPOOL_ASSIGN_OR_RETURN(RowCodec codec, RowCodec::Create(c.quant, kHeadDim));
  const BlockLayout layout = BlockLayout::ForModel(c.quant, kKvHeads, kHeadDim);

  MixedSequenceLayout seq(TierConfig::FromQuantConfig(c.quant));
  KVPOOL_ASSIGN_OR_RETURN(AppendPlan plan, seq.PlanAppend(tokens, AppendKind::kFinalPrefill));
  seq.Commit(plan, AppendKind::kFinalPrefill);

  // Rotate every token (rounded to BF16, the normative arrival path).
  std::vector<Bf16> k_rot(k.size()), v_rot(v.size());
  const auto start = std::chrono::steady_clock::now();
  KVPOOL_RETURN_IF_ERROR(c.rotation.RotateBf16(0, KvTensor::kKey, testing::ToBf16(k),
                                               absl::MakeSpan(k_rot)));
  KVPOOL_RETURN_IF_ERROR(c.rotation.RotateBf16(0, KvTensor::kValue, testing::ToBf16(v),
                                               absl::MakeSpan(v_rot)));
  // Quantize the history into blocks.
  const int history = plan.to_history, first = plan.to_sink;
  const int num_blocks = (history + layout.tokens - 1) / layout.tokens;
  std::vector<uint8_t> storage(layout.block_bytes() * num_blocks);
  std::vector<const uint8_t*> blocks;
  for (int b = 0; b < num_blocks; ++b) {
    const int t0 = first + b * layout.tokens;
    const int n = std::min(layout.tokens, first + history - t0);
    uint8_t* block = &storage[b * layout.block_bytes()];
    for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
      const std::vector<Bf16>& src = t == KvTensor::kKey ? k_rot : v_rot;
      KVPOOL_RETURN_IF_ERROR(codec.EncodeIntoBlock(
          t, layout, absl::MakeConstSpan(src.data() + t0 * row, n * row), 0, block));
    }
    blocks.push_back(block);
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  // Attention: rotate q, attend over the BF16 tiers and the INT2 history, merge, un-rotate.
  std::vector<float> q_rot(q.size());
  KVPOOL_RETURN_IF_ERROR(c.rotation.Rotate(0, KvTensor::kKey, q, absl::MakeSpan(q_rot)));
  std::vector<Bf16> bf16_k, bf16_v;  // sink then recent
  const int recent_start = first + history;
  for (int t = 0; t < tokens; ++t) {
    if (t >= first && t < recent_start) continue;
    bf16_k.insert(bf16_k.end(), k_rot.begin() + t * row, k_rot.begin() + (t + 1) * row);
    bf16_v.insert(bf16_v.end(), v_rot.begin() + t * row, v_rot.begin() + (t + 1) * row);
  }
  AttentionOutput acc = AttendBlocks(shape, codec, layout, blocks, history, q_rot);
  MergeAttention(shape, AttendBf16Rows(shape, q_rot, bf16_k, bf16_v, tokens - history), &acc);
  std::vector<float> out(acc.out.size());
  KVPOOL_RETURN_IF_ERROR(c.rotation.Unrotate(0, KvTensor::kValue, acc.out, absl::MakeSpan(out)));

  DemoResult r;
  r.stored_bytes = storage.size() + (bf16_k.size() + bf16_v.size()) * sizeof(Bf16);
  r.rel_error = RelativeL2(out, reference.out);
  for (int h = 0; h < kQHeads; ++h) {
    r.max_lse_error = std::max(r.max_lse_error, std::abs(double(acc.lse[h]) - reference.lse[h]));
  }
  r.quantize_mbps = 2.0 * k.size() * sizeof(Bf16) / secs / 1e6;
  return r;
}

int Main(int tokens) {
  const size_t rows = size_t(tokens) * kKvHeads;
  // Keys with a few strong outlier channels (as post-RoPE keys have), values milder.
  std::vector<float> k = testing::RealLikeRows(static_cast<int>(rows), kHeadDim, 1);
  std::vector<float> v = testing::GaussianValues(rows * kHeadDim, 2);
  for (size_t i = 0; i < v.size(); i += kHeadDim) v[i + 7] *= 6.0f;
  // BF16 is what the prefill worker sends: round the inputs once so BF16 is the baseline.
  for (float& x : k) x = Bf16::FromFloat(x).ToFloat();
  for (float& x : v) x = Bf16::FromFloat(x).ToFloat();
  // Queries that, like real ones, put much of their mass on a few tokens: each head aims at the
  // sum of a few keys of its KV head, plus noise.
  std::vector<float> q = testing::GaussianValues(size_t{kQHeads} * kHeadDim, 3, 0.1f);
  std::mt19937_64 rng(5);
  for (int j = 0; j < kQHeads; ++j) {
    const int kv = j / (kQHeads / kKvHeads);
    std::vector<float> aim(kHeadDim, 0.0f);
    for (int i = 0; i < 3; ++i) {
      const size_t t = rng() % tokens;
      for (int d = 0; d < kHeadDim; ++d) aim[d] += k[(t * kKvHeads + kv) * kHeadDim + d];
    }
    double norm = 0;
    for (float x : aim) norm += double(x) * x;
    const float scale = static_cast<float>(kQueryFocus * std::sqrt(double(kHeadDim)) / std::sqrt(norm));
    for (int d = 0; d < kHeadDim; ++d) q[j * kHeadDim + d] += scale * aim[d];
  }
  const AttentionShape shape{kQHeads, kKvHeads, kHeadDim};
  const AttentionOutput reference = DenseAttentionReference(shape, q, k, v, tokens);

  QuantConfig int2;  // OSCAR defaults: INT2, G = D, clip 0.96 / 0.92, sink 64, recent 256
  QuantConfig int2_noclip = int2;
  int2_noclip.clip_ratio_k = int2_noclip.clip_ratio_v = 0;
  QuantConfig int4 = int2;
  int4.bits = 4;
  std::vector<DemoCase> cases;
  cases.push_back({"INT2, no rotation, no clip", *RotationSet::Identity(1, kHeadDim), int2_noclip});
  cases.push_back({"INT2, no rotation, clip", *RotationSet::Identity(1, kHeadDim), int2});
  cases.push_back({"INT2, Hadamard, clip", *RotationSet::Hadamard(1, kHeadDim), int2});
  cases.push_back(
      {"INT2, randomized Hadamard, clip", *RotationSet::RandomizedHadamard(1, kHeadDim, 7), int2});
  cases.push_back(
      {"INT4, randomized Hadamard, clip", *RotationSet::RandomizedHadamard(1, kHeadDim, 7), int4});

  const double bf16_bytes = 2.0 * rows * kHeadDim * sizeof(Bf16);
  std::printf("kvpool codec demo: one layer, %d tokens, Hq=%d Hkv=%d D=%d, sink 64 + recent 256 "
              "in BF16\n", tokens, kQHeads, kKvHeads, kHeadDim);
  std::printf("BF16 K+V: %.1f MiB\n\n", bf16_bytes / (1 << 20));
  std::printf("%-34s %11s %8s %14s %12s %12s\n", "configuration", "stored MiB", "ratio",
              "attn rel err", "max |dLSE|", "ingest MB/s");
  for (const DemoCase& c : cases) {
    absl::StatusOr<DemoResult> r = RunCase(c, tokens, k, v, q, reference);
    if (!r.ok()) {
      std::fprintf(stderr, "%s: %s\n", c.name.c_str(), r.status().ToString().c_str());
      return 1;
    }
    std::printf("%-34s %11.2f %7.2fx %14.4f %12.5f %12.0f\n", c.name.c_str(),
                r->stored_bytes / double(1 << 20), bf16_bytes / r->stored_bytes, r->rel_error,
                r->max_lse_error, r->quantize_mbps);
  }
  std::printf("\n(attention error: relative L2 of the output against BF16 dense attention; "
              "calibrated OSCAR rotations come from kvpool-calibrate)\n");
  return 0;
}

}  // namespace
}  // namespace kvpool

int main(int argc, char** argv) {
  const int tokens = argc > 1 ? std::atoi(argv[1]) : 8192;
  if (tokens < 1 || tokens > (1 << 20)) {
    std::fprintf(stderr, "usage: kvpool-codec-demo [tokens in 1..1048576]\n");
    return 2;
  }
  return kvpool::Main(tokens);
}
