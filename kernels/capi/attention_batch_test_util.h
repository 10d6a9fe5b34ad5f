// A random decode batch for the C API's tests, built with kvpool's codec: history blocks encoded
// by RowCodec, BF16 sink and recent pages by the bypass codec, shuffled block ids, tiers that
// start part way into a block, and the dequantized values a float64 reference attends over.
//
//   TestBatch b = TestBatch::Build({.q_heads = 8, .kv_heads = 2, .head_dim = 64,
//                                   .seqs = {{16, 40, 9}, {0, 0, 3}}});
//   kvpool_attention_desc desc = b.Desc(b.HostPointers());
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/attention.h"
#include "kernels/bf16.h"
#include "kernels/block_layout.h"
#include "kernels/capi/kvpool_attention.h"
#include "kernels/codec_config.h"
#include "kernels/paged_kv.h"
#include "kernels/rotation.h"
#include "kernels/row_codec.h"
#include "tests/support/test_data.h"

namespace kvpool::testing {

struct SeqTokens {
  int sink = 0;
  int history = 0;
  int recent = 0;
};

struct BatchSpec {
  int q_heads = 8;
  int kv_heads = 2;
  int head_dim = 64;
  int block_tokens = 16;
  int bits = 2;
  QuantMethod method = QuantMethod::kUniform;
  ScaleDtype scale_dtype = ScaleDtype::kFp16;
  bool rotate = true;  // randomized Hadamard matrices, else identity (NULL)
  std::vector<SeqTokens> seqs;
  uint64_t seed = 1;
};

// Where the arrays of a batch lie (host vectors, or their device copies).
struct BatchPointers {
  const void* history_pool = nullptr;
  const void* bf16_pool = nullptr;
  const int32_t* tier_arrays[3][3] = {};  // [sink, history, recent][tables, first, count]
};

class TestBatch {
 public:
  struct Tier {
    std::vector<int32_t> tables, first, count;
    int stride = 1;
    std::vector<std::vector<float>> k, v;  // per sequence [n][Hkv][D], what attention sees
  };

  static TestBatch Build(const BatchSpec& spec) {
    TestBatch b;
    b.spec = spec;
    b.cfg.bits = spec.bits;
    b.cfg.method = spec.method;
    b.cfg.scale_dtype = spec.scale_dtype;
    b.cfg.block_tokens = spec.block_tokens;
    b.cfg.demotion_batch = spec.block_tokens;
    QuantConfig bypass = b.cfg;
    bypass.method = QuantMethod::kBypass;
    const int d = spec.head_dim;
    const int n = static_cast<int>(spec.seqs.size());
    b.history_layout = BlockLayout::ForModel(b.cfg, spec.kv_heads, d);
    b.bf16_layout = BlockLayout::ForModel(bypass, spec.kv_heads, d);
    auto codec = RowCodec::Create(b.cfg, d);
    auto bf16_codec = RowCodec::Create(bypass, d);
    EXPECT_TRUE(codec.ok() && bf16_codec.ok());
    if (!codec.ok() || !bf16_codec.ok()) return b;

    std::mt19937_64 rng(spec.seed);
    Tier* tiers[3] = {&b.sink, &b.history, &b.recent};
    const int bt = spec.block_tokens;
    for (int i = 0; i < n; ++i) {
      const int counts[3] = {spec.seqs[i].sink, spec.seqs[i].history, spec.seqs[i].recent};
      // The sink starts at 0; the others part way into their first block.
      const int firsts[3] = {0, (i * 5) % bt, (i * 3 + 1) % bt};
      for (int t = 0; t < 3; ++t) {
        tiers[t]->count.push_back(counts[t]);
        tiers[t]->first.push_back(firsts[t]);
      }
      b.max_history = std::max(b.max_history, counts[1]);
      b.max_bf16 = std::max(b.max_bf16, counts[0] + counts[2]);
    }
    // Block ids from shuffled lists, with spare blocks left unused.
    int64_t history_blocks = 3, bf16_blocks = 3;
    for (int i = 0; i < n; ++i) {
      history_blocks += (b.history.first[i] + b.history.count[i]) / bt + 1;
      bf16_blocks += (b.sink.first[i] + b.sink.count[i]) / bt + 1;
      bf16_blocks += (b.recent.first[i] + b.recent.count[i]) / bt + 1;
    }
    std::vector<int32_t> history_ids(history_blocks), bf16_ids(bf16_blocks);
    std::iota(history_ids.begin(), history_ids.end(), 0);
    std::iota(bf16_ids.begin(), bf16_ids.end(), 0);
    std::shuffle(history_ids.begin(), history_ids.end(), rng);
    std::shuffle(bf16_ids.begin(), bf16_ids.end(), rng);
    size_t next_history = 0, next_bf16 = 0;
    Assign(b.sink, bt, bf16_ids, next_bf16);
    Assign(b.history, bt, history_ids, next_history);
    Assign(b.recent, bt, bf16_ids, next_bf16);
    b.history_blocks = history_blocks;
    b.bf16_blocks = bf16_blocks;
    b.history_pool.assign(history_blocks * b.history_layout.block_bytes(), 0);
    b.bf16_pool.assign(bf16_blocks * b.bf16_layout.block_bytes(), 0);

    const size_t width = static_cast<size_t>(spec.kv_heads) * d;
    for (int t = 0; t < 3; ++t) {
      Tier& tier = *tiers[t];
      const RowCodec& c = t == 1 ? *codec : *bf16_codec;
      const BlockLayout& layout = t == 1 ? b.history_layout : b.bf16_layout;
      std::vector<uint8_t>& pool = t == 1 ? b.history_pool : b.bf16_pool;
      tier.k.resize(n);
      tier.v.resize(n);
      for (int i = 0; i < n; ++i) {
        const int count = tier.count[i];
        for (KvTensor tensor : {KvTensor::kKey, KvTensor::kValue}) {
          const std::vector<Bf16> rows = ToBf16(RealLikeRows(
              count * spec.kv_heads, d,
              spec.seed * 1000 + 100 * t + 10 * i + (tensor == KvTensor::kKey ? 0 : 1)));
          std::vector<float>& seen = tensor == KvTensor::kKey ? tier.k[i] : tier.v[i];
          seen.assign(count * width, 0.0f);
          for (int r = 0; r < count; ++r) {
            const int pos = tier.first[i] + r;
            uint8_t* block =
                pool.data() +
                static_cast<size_t>(tier.tables[i * tier.stride + pos / bt]) * layout.block_bytes();
            const absl::Span<const Bf16> row = absl::MakeConstSpan(rows).subspan(r * width, width);
            EXPECT_TRUE(c.EncodeIntoBlock(tensor, layout, row, pos % bt, block).ok());
            c.DecodeFromBlock(tensor, layout, block, pos % bt, 1,
                              absl::MakeSpan(seen).subspan(r * width, width));
          }
        }
      }
    }
    if (spec.rotate) {
      auto set = RotationSet::RandomizedHadamard(1, d, spec.seed + 77);
      EXPECT_TRUE(set.ok());
      b.mk = set->Matrix(0, KvTensor::kKey);
      b.mv = set->Matrix(0, KvTensor::kValue);
    }
    b.queries = RealLikeRows(n * spec.q_heads, d, spec.seed + 5);
    for (float& x : b.queries) x *= 0.5f;
    return b;
  }

  BatchPointers HostPointers() const {
    BatchPointers p;
    p.history_pool = history_pool.data();
    p.bf16_pool = bf16_pool.data();
    const Tier* tiers[3] = {&sink, &history, &recent};
    for (int t = 0; t < 3; ++t) {
      p.tier_arrays[t][0] = tiers[t]->tables.data();
      p.tier_arrays[t][1] = tiers[t]->first.data();
      p.tier_arrays[t][2] = tiers[t]->count.data();
    }
    return p;
  }

  // The C API's description of this batch over arrays at `p`, on `device`.
  kvpool_attention_desc Desc(const BatchPointers& p, int device = KVPOOL_ATTENTION_HOST) const {
    kvpool_attention_desc d;
    kvpool_attention_desc_init(&d);
    d.q_heads = spec.q_heads;
    d.kv_heads = spec.kv_heads;
    d.head_dim = spec.head_dim;
    d.bits = cfg.bits;
    d.group_size = cfg.group_size;
    d.quant_method = static_cast<int32_t>(cfg.method);
    d.scale_dtype = static_cast<int32_t>(cfg.scale_dtype);
    d.block_tokens = cfg.block_tokens;
    d.history_pool = {p.history_pool, history_blocks, 0};
    d.bf16_pool = {p.bf16_pool, bf16_blocks, 0};
    kvpool_attention_tier* tiers[3] = {&d.sink, &d.history, &d.recent};
    const Tier* mine[3] = {&sink, &history, &recent};
    for (int t = 0; t < 3; ++t) {
      *tiers[t] = {p.tier_arrays[t][0], mine[t]->stride, p.tier_arrays[t][1], p.tier_arrays[t][2]};
    }
    d.num_seqs = static_cast<int32_t>(spec.seqs.size());
    d.max_history_tokens = max_history;
    d.max_bf16_tokens = max_bf16;
    d.device = device;
    return d;
  }

  // kvpool's own description of the same batch (host arrays).
  PagedKvBatch Batch() {
    PagedKvBatch b;
    b.history_pool =
        PagedKvView{history_pool.data(), history_layout, cfg.scale_dtype, history_blocks};
    b.bf16_pool = PagedKvView{bf16_pool.data(), bf16_layout, cfg.scale_dtype, bf16_blocks};
    b.num_seqs = static_cast<int32_t>(spec.seqs.size());
    b.max_history_tokens = max_history;
    b.max_bf16_tokens = max_bf16;
    b.sink = {sink.tables.data(), sink.stride, sink.first.data(), sink.count.data()};
    b.history = {history.tables.data(), history.stride, history.first.data(), history.count.data()};
    b.recent = {recent.tables.data(), recent.stride, recent.first.data(), recent.count.data()};
    return b;
  }

  const float* rotation_k() const { return mk.empty() ? nullptr : mk.data(); }
  const float* rotation_v() const { return mv.empty() ? nullptr : mv.data(); }

  // Float64 attention over the values the tiers hold, in the original basis: [B][Hq][D], [B][Hq].
  void Reference(std::vector<double>* out, std::vector<double>* lse) const {
    const int d = spec.head_dim;
    const int n = static_cast<int>(spec.seqs.size());
    const int group = spec.q_heads / spec.kv_heads;
    out->assign(static_cast<size_t>(n) * spec.q_heads * d, 0.0);
    lse->assign(static_cast<size_t>(n) * spec.q_heads, -INFINITY);
    const Tier* tiers[3] = {&sink, &history, &recent};
    std::vector<double> q(d), o(d);
    for (int i = 0; i < n; ++i) {
      for (int hq = 0; hq < spec.q_heads; ++hq) {
        const int h = hq / group;
        const float* qi = &queries[(static_cast<size_t>(i) * spec.q_heads + hq) * d];
        for (int j = 0; j < d; ++j) {
          double acc = 0;
          for (int k = 0; k < d; ++k) acc += qi[k] * (mk.empty() ? (k == j) : mk[k * d + j]);
          q[j] = acc;
        }
        std::vector<double> logits;
        std::vector<const float*> values;
        for (const Tier* tier : tiers) {
          for (int r = 0; r < tier->count[i]; ++r) {
            const size_t at = (static_cast<size_t>(r) * spec.kv_heads + h) * d;
            double dot = 0;
            for (int j = 0; j < d; ++j) dot += q[j] * tier->k[i][at + j];
            logits.push_back(dot / std::sqrt(static_cast<double>(d)));
            values.push_back(&tier->v[i][at]);
          }
        }
        if (logits.empty()) continue;
        const double mx = *std::max_element(logits.begin(), logits.end());
        double sum = 0;
        std::fill(o.begin(), o.end(), 0.0);
        for (size_t t = 0; t < logits.size(); ++t) {
          const double w = std::exp(logits[t] - mx);
          sum += w;
          for (int j = 0; j < d; ++j) o[j] += w * values[t][j];
        }
        double* dst = &(*out)[(static_cast<size_t>(i) * spec.q_heads + hq) * d];
        for (int j = 0; j < d; ++j) {
          double acc = 0;  // (o / sum) * M_V^T
          for (int k = 0; k < d; ++k) acc += o[k] / sum * (mv.empty() ? (j == k) : mv[j * d + k]);
          dst[j] = acc;
        }
        (*lse)[static_cast<size_t>(i) * spec.q_heads + hq] = mx + std::log(sum);
      }
    }
  }

  BatchSpec spec;
  QuantConfig cfg;
  BlockLayout history_layout, bf16_layout;
  int64_t history_blocks = 0, bf16_blocks = 0;
  std::vector<uint8_t> history_pool, bf16_pool;
  Tier sink, history, recent;
  int32_t max_history = 0, max_bf16 = 0;
  std::vector<float> queries, mk, mv;

 private:
  static void Assign(Tier& tier, int bt, const std::vector<int32_t>& ids, size_t& next) {
    const size_t n = tier.count.size();
    int stride = 1;
    for (size_t i = 0; i < n; ++i) {
      stride = std::max(stride, (tier.first[i] + tier.count[i] + bt - 1) / bt);
    }
    tier.stride = stride;
    // Unused entries hold a valid id (block 0): a tier never reads past its tokens.
    tier.tables.assign(n * stride, 0);
    for (size_t i = 0; i < n; ++i) {
      const int used = (tier.first[i] + tier.count[i] + bt - 1) / bt;
      for (int blk = tier.first[i] / bt; blk < used; ++blk)
        tier.tables[i * stride + blk] = ids[next++];
    }
  }
};

// Expects `out` and `lse` ([B][Hq][D], [B][Hq]) within float32 rounding of b's float64
// reference: LSE within 1e-4 relative, outputs within 1e-4 of each row's largest value; an
// empty sequence answers LSE -inf and zeros.
inline void ExpectNearReference(const TestBatch& b, const std::vector<float>& out,
                                const std::vector<float>& lse) {
  std::vector<double> ref_out, ref_lse;
  b.Reference(&ref_out, &ref_lse);
  const int d = b.spec.head_dim;
  for (size_t row = 0; row < ref_lse.size(); ++row) {
    if (std::isinf(ref_lse[row])) {
      EXPECT_TRUE(std::isinf(lse[row]) && lse[row] < 0) << "row " << row;
      for (int j = 0; j < d; ++j) EXPECT_EQ(out[row * d + j], 0.0f);
      continue;
    }
    EXPECT_NEAR(lse[row], ref_lse[row], 1e-4 * std::max(1.0, std::fabs(ref_lse[row]))) << row;
    double scale = 0;
    for (int j = 0; j < d; ++j) scale = std::max(scale, std::fabs(ref_out[row * d + j]));
    for (int j = 0; j < d; ++j) {
      EXPECT_NEAR(out[row * d + j], ref_out[row * d + j], 1e-4 * scale + 1e-6)
          << "row " << row << " dim " << j;
    }
  }
}

}  // namespace kvpool::testing
