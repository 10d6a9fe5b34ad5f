// GPU decode attention against a float64 reference on the same (dequantized) data: batches of
// sequences with different tier lengths (not multiples of the block or chunk size), shuffled
// non-contiguous block tables, GQA groups of 3, 8 and 16, empty tiers, one-hot attention on the
// first and last token of every tier, and batch 32 at 128K tokens. Skips without a device.
#include "kernels/cuda/cuda_attention.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/bf16.h"
#include "kernels/block_layout.h"
#include "kernels/codec_config.h"
#include "kernels/cuda/cuda_codec.h"
#include "kernels/cuda/testing_fill.h"
#include "kernels/rotation.h"
#include "kernels/row_codec.h"
#include "tests/support/test_data.h"

namespace kvpool::cuda {
namespace {

#define CUDA_ASSERT(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(size_t n) { Resize(n); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  void Resize(size_t n) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = nullptr;
    n_ = n;
    void* p = nullptr;
    if (cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)) == cudaSuccess) {
      ptr_ = static_cast<T*>(p);
    }
  }
  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  cudaError_t Upload(const std::vector<T>& v) {
    return cudaMemcpy(ptr_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  std::vector<T> Download() const {
    std::vector<T> v(n_);
    if (cudaMemcpy(v.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost) != cudaSuccess) {
      v.clear();
    }
    return v;
  }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

class CudaAttentionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

struct SeqSpec {
  int sink;
  int history;
  int recent;
};

// Which token of a sequence the one-hot query targets.
struct OneHot {
  int seq = -1;   // -1: none
  int tier = 0;   // 0 sink, 1 history, 2 recent
  int index = 0;  // token index inside the tier
};

struct Scenario {
  int head_dim = 128;
  int q_heads = 16;
  int kv_heads = 2;
  ScaleDtype scale = ScaleDtype::kFp16;
  QuantMethod method = QuantMethod::kUniform;
  bool rotate = true;
  int block_tokens = 16;
  std::vector<SeqSpec> seqs;
  uint64_t seed = 1;
  OneHot one_hot;
  AttentionTuning tuning;  // the measured defaults unless a test picks another path
};

// Host copy of one tier of every sequence: blocks in a pool, tables, and the fp32 values the
// reference sees (dequantized for INT2).
struct HostTier {
  std::vector<int32_t> tables;
  std::vector<int32_t> first;
  std::vector<int32_t> count;
  int stride = 1;
  std::vector<std::vector<float>> k, v;  // per sequence [n][Hkv][D]
};

// Assigns blocks for `count[i]` tokens starting at position `first[i]` from a shuffled id list.
void AssignBlocks(HostTier& tier, int tokens_per_block, std::vector<int32_t>& free_ids,
                  size_t& next) {
  int max_blocks = 1;
  for (size_t i = 0; i < tier.count.size(); ++i) {
    max_blocks = std::max(
        max_blocks, (tier.first[i] + tier.count[i] + tokens_per_block - 1) / tokens_per_block);
  }
  tier.stride = max_blocks;
  tier.tables.assign(tier.count.size() * max_blocks, -1);
  for (size_t i = 0; i < tier.count.size(); ++i) {
    const int used = (tier.first[i] + tier.count[i] + tokens_per_block - 1) / tokens_per_block;
    for (int b = tier.first[i] / tokens_per_block; b < used; ++b) {
      tier.tables[i * max_blocks + b] = free_ids[next++];
    }
  }
}

struct Reference {
  std::vector<double> out;  // [B][Hq][D]
  std::vector<double> lse;  // [B][Hq]
};

void MatVecRows(const std::vector<double>& in, const std::vector<float>& m, int d, bool transpose,
                std::vector<double>& out) {
  out.assign(d, 0.0);
  for (int j = 0; j < d; ++j) {
    double acc = 0;
    for (int i = 0; i < d; ++i) acc += in[i] * (transpose ? m[j * d + i] : m[i * d + j]);
    out[j] = acc;
  }
}

class AttentionRun {
 public:
  void Build(const Scenario& sc) {
    sc_ = sc;
    const int d = sc.head_dim;
    const int b = static_cast<int>(sc.seqs.size());
    cfg_.method = sc.method;
    cfg_.scale_dtype = sc.scale;
    cfg_.block_tokens = sc.block_tokens;
    cfg_.demotion_batch = sc.block_tokens;
    ASSERT_TRUE(cfg_.Validate(d).ok());
    auto codec = RowCodec::Create(cfg_, d);
    ASSERT_TRUE(codec.ok()) << codec.status();
    QuantConfig bypass = cfg_;
    bypass.method = QuantMethod::kBypass;
    int2_layout_ = BlockLayout::ForModel(cfg_, sc.kv_heads, d);
    bf16_layout_ = BlockLayout::ForModel(bypass, sc.kv_heads, d);

    // Tiers: odd first positions make tiles straddle blocks.
    HostTier* tiers[3] = {&sink_, &history_, &recent_};
    for (int i = 0; i < b; ++i) {
      const int counts[3] = {sc.seqs[i].sink, sc.seqs[i].history, sc.seqs[i].recent};
      const int firsts[3] = {0, (i * 5) % sc.block_tokens, (i * 3 + 1) % sc.block_tokens};
      for (int t = 0; t < 3; ++t) {
        tiers[t]->count.push_back(counts[t]);
        tiers[t]->first.push_back(firsts[t]);
      }
    }
    std::mt19937_64 rng(sc.seed);
    int int2_blocks = 4;
    int bf16_blocks = 4;
    for (int i = 0; i < b; ++i) {
      int2_blocks += (history_.first[i] + history_.count[i]) / sc.block_tokens + 1;
      bf16_blocks += (sink_.first[i] + sink_.count[i]) / sc.block_tokens + 1;
      bf16_blocks += (recent_.first[i] + recent_.count[i]) / sc.block_tokens + 1;
    }
    std::vector<int32_t> int2_ids(int2_blocks), bf16_ids(bf16_blocks);
    std::iota(int2_ids.begin(), int2_ids.end(), 0);
    std::iota(bf16_ids.begin(), bf16_ids.end(), 0);
    std::shuffle(int2_ids.begin(), int2_ids.end(), rng);
    std::shuffle(bf16_ids.begin(), bf16_ids.end(), rng);
    size_t next_int2 = 0, next_bf16 = 0;
    AssignBlocks(history_, sc.block_tokens, int2_ids, next_int2);
    AssignBlocks(sink_, sc.block_tokens, bf16_ids, next_bf16);
    AssignBlocks(recent_, sc.block_tokens, bf16_ids, next_bf16);
    int2_num_blocks_ = int2_blocks;
    bf16_num_blocks_ = bf16_blocks;
    int2_host_.assign(int2_blocks * int2_layout_.block_bytes(), 0);
    bf16_host_.assign(bf16_blocks * bf16_layout_.block_bytes(), 0);

    // Rows: real-like values; INT2 rows through the CPU codec.
    std::vector<uint8_t> codes(int2_layout_.code_bytes_per_row());
    std::vector<GroupMeta> meta(1);
    std::vector<float> decoded(d);
    for (int t = 0; t < 3; ++t) {
      HostTier& tier = *tiers[t];
      tier.k.resize(b);
      tier.v.resize(b);
      for (int i = 0; i < b; ++i) {
        const int n = tier.count[i];
        for (int kv = 0; kv < 2; ++kv) {
          const KvTensor tensor = kv == 0 ? KvTensor::kKey : KvTensor::kValue;
          const std::vector<Bf16> rows = kvpool::testing::ToBf16(kvpool::testing::RealLikeRows(
              n * sc.kv_heads, d, sc.seed * 1000 + 100 * t + 10 * i + kv));
          std::vector<float>& dst = kv == 0 ? tier.k[i] : tier.v[i];
          dst.assign(static_cast<size_t>(n) * sc.kv_heads * d, 0.f);
          for (int r = 0; r < n; ++r) {
            const int pos = tier.first[i] + r;
            const int block = tier.tables[i * tier.stride + pos / sc.block_tokens];
            const int slot = pos % sc.block_tokens;
            for (int h = 0; h < sc.kv_heads; ++h) {
              const Bf16* row = rows.data() + (static_cast<size_t>(r) * sc.kv_heads + h) * d;
              float* ref = dst.data() + (static_cast<size_t>(r) * sc.kv_heads + h) * d;
              if (t == 1) {
                ASSERT_TRUE(
                    codec->Encode(tensor, absl::MakeConstSpan(row, d), codes.data(), meta.data())
                        .ok());
                codec->Decode(codes.data(), meta.data(), absl::MakeSpan(decoded));
                std::memcpy(ref, decoded.data(), d * sizeof(float));
                uint8_t* base = int2_host_.data() + block * int2_layout_.block_bytes();
                std::memcpy(base + int2_layout_.CodesOffset(tensor, h) +
                                slot * int2_layout_.code_bytes_per_row(),
                            codes.data(), codes.size());
                std::memcpy(base + int2_layout_.MetaOffset(tensor, h) +
                                slot * int2_layout_.meta_bytes_per_row(),
                            meta.data(), sizeof(GroupMeta));
              } else {
                for (int j = 0; j < d; ++j) ref[j] = row[j].ToFloat();
                uint8_t* base = bf16_host_.data() + block * bf16_layout_.block_bytes();
                std::memcpy(base + bf16_layout_.CodesOffset(tensor, h) +
                                slot * bf16_layout_.code_bytes_per_row(),
                            row, d * sizeof(Bf16));
              }
            }
          }
        }
      }
    }

    // Rotations and queries.
    if (sc.rotate) {
      auto set = RotationSet::RandomizedHadamard(1, d, sc.seed + 77);
      ASSERT_TRUE(set.ok()) << set.status();
      mk_ = set->Matrix(0, KvTensor::kKey);
      mv_ = set->Matrix(0, KvTensor::kValue);
    } else {
      mk_.assign(d * d, 0.f);
      for (int i = 0; i < d; ++i) mk_[i * d + i] = 1.f;
      mv_ = mk_;
    }
    queries_ = kvpool::testing::RealLikeRows(b * sc.q_heads, d, sc.seed + 5);
    for (float& x : queries_) x *= 0.5f;
    if (sc.one_hot.seq >= 0) {
      // Every query head of the target sequence points at one key: q' = alpha * k_target.
      const OneHot& oh = sc.one_hot;
      const HostTier& tier = *tiers[oh.tier];
      const int group = sc.q_heads / sc.kv_heads;
      for (int hq = 0; hq < sc.q_heads; ++hq) {
        const float* k =
            tier.k[oh.seq].data() + (static_cast<size_t>(oh.index) * sc.kv_heads + hq / group) * d;
        double norm2 = 0;
        for (int j = 0; j < d; ++j) norm2 += static_cast<double>(k[j]) * k[j];
        const double alpha = 400.0 * std::sqrt(static_cast<double>(d)) / norm2;
        std::vector<double> qrot(d), q;
        for (int j = 0; j < d; ++j) qrot[j] = alpha * k[j];
        MatVecRows(qrot, mk_, d, /*transpose=*/true, q);  // q = q' * M_K^T
        for (int j = 0; j < d; ++j) {
          queries_[(static_cast<size_t>(oh.seq) * sc.q_heads + hq) * d + j] =
              static_cast<float>(q[j]);
        }
      }
    }
  }

  Reference ComputeReference() const {
    const int d = sc_.head_dim;
    const int b = static_cast<int>(sc_.seqs.size());
    const int group = sc_.q_heads / sc_.kv_heads;
    Reference ref;
    ref.out.assign(static_cast<size_t>(b) * sc_.q_heads * d, 0.0);
    ref.lse.assign(static_cast<size_t>(b) * sc_.q_heads, -INFINITY);
    const HostTier* tiers[3] = {&sink_, &history_, &recent_};
    std::vector<double> q(d), qrot, orot(d), o;
    for (int i = 0; i < b; ++i) {
      for (int hq = 0; hq < sc_.q_heads; ++hq) {
        const int h = hq / group;
        for (int j = 0; j < d; ++j)
          q[j] = queries_[(static_cast<size_t>(i) * sc_.q_heads + hq) * d + j];
        MatVecRows(q, mk_, d, false, qrot);
        std::vector<double> logits;
        std::vector<const float*> vrows;
        for (const HostTier* tier : tiers) {
          for (int r = 0; r < tier->count[i]; ++r) {
            const float* k = tier->k[i].data() + (static_cast<size_t>(r) * sc_.kv_heads + h) * d;
            double dot = 0;
            for (int j = 0; j < d; ++j) dot += qrot[j] * k[j];
            logits.push_back(dot / std::sqrt(static_cast<double>(d)));
            vrows.push_back(tier->v[i].data() + (static_cast<size_t>(r) * sc_.kv_heads + h) * d);
          }
        }
        if (logits.empty()) continue;
        const double mx = *std::max_element(logits.begin(), logits.end());
        double sum = 0;
        std::fill(orot.begin(), orot.end(), 0.0);
        for (size_t t = 0; t < logits.size(); ++t) {
          const double w = std::exp(logits[t] - mx);
          sum += w;
          for (int j = 0; j < d; ++j) orot[j] += w * vrows[t][j];
        }
        for (int j = 0; j < d; ++j) orot[j] /= sum;
        MatVecRows(orot, mv_, d, true, o);
        for (int j = 0; j < d; ++j)
          ref.out[(static_cast<size_t>(i) * sc_.q_heads + hq) * d + j] = o[j];
        ref.lse[static_cast<size_t>(i) * sc_.q_heads + hq] = mx + std::log(sum);
      }
    }
    return ref;
  }

  // Runs the GPU attention; fills out/lse.
  void Run(std::vector<float>& out, std::vector<float>& lse) {
    const int d = sc_.head_dim;
    const int b = static_cast<int>(sc_.seqs.size());
    DeviceArray<uint8_t> int2_pool(int2_host_.size()), bf16_pool(bf16_host_.size());
    CUDA_ASSERT(int2_pool.Upload(int2_host_));
    CUDA_ASSERT(bf16_pool.Upload(bf16_host_));
    DeviceArray<int32_t> arrays[9];
    const HostTier* tiers[3] = {&sink_, &history_, &recent_};
    PagedKvTier dt[3];
    for (int t = 0; t < 3; ++t) {
      arrays[3 * t].Resize(tiers[t]->tables.size());
      arrays[3 * t + 1].Resize(b);
      arrays[3 * t + 2].Resize(b);
      CUDA_ASSERT(arrays[3 * t].Upload(tiers[t]->tables));
      CUDA_ASSERT(arrays[3 * t + 1].Upload(tiers[t]->first));
      CUDA_ASSERT(arrays[3 * t + 2].Upload(tiers[t]->count));
      dt[t] = PagedKvTier{arrays[3 * t].get(), tiers[t]->stride, arrays[3 * t + 1].get(),
                          arrays[3 * t + 2].get()};
    }
    DeviceArray<float> q(queries_.size()), mk(mk_.size()), mv(mv_.size());
    CUDA_ASSERT(q.Upload(queries_));
    CUDA_ASSERT(mk.Upload(mk_));
    CUDA_ASSERT(mv.Upload(mv_));
    DeviceArray<float> d_out(static_cast<size_t>(b) * sc_.q_heads * d);
    DeviceArray<float> d_lse(static_cast<size_t>(b) * sc_.q_heads);
    // Poison the outputs: every element must be written.
    CUDA_ASSERT(cudaMemset(d_out.get(), 0xff, d_out.size() * sizeof(float)));
    CUDA_ASSERT(cudaMemset(d_lse.get(), 0xff, d_lse.size() * sizeof(float)));

    DecodeAttentionShape shape;
    shape.cfg = cfg_;
    shape.q_heads = sc_.q_heads;
    shape.tuning = sc_.tuning;
    PagedKvBatch batch;
    batch.history_pool =
        PagedKvView{int2_pool.get(), int2_layout_, cfg_.scale_dtype, int2_num_blocks_};
    batch.bf16_pool =
        PagedKvView{bf16_pool.get(), bf16_layout_, cfg_.scale_dtype, bf16_num_blocks_};
    batch.num_seqs = b;
    for (int i = 0; i < b; ++i) {
      batch.max_history_tokens = std::max(batch.max_history_tokens, history_.count[i]);
      batch.max_bf16_tokens = std::max(batch.max_bf16_tokens, sink_.count[i] + recent_.count[i]);
    }
    batch.sink = dt[0];
    batch.history = dt[1];
    batch.recent = dt[2];
    auto bytes = DecodeAttentionWorkspaceBytes(shape, batch);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    DeviceArray<uint8_t> workspace(*bytes);
    // Poison the workspace too: nothing may read scratch it did not write.
    CUDA_ASSERT(cudaMemset(workspace.get(), 0xff, workspace.size()));
    const DecodeIo io{q.get(), sc_.rotate ? mk.get() : nullptr, sc_.rotate ? mv.get() : nullptr,
                      d_out.get(), d_lse.get()};
    const absl::Status s = DecodeAttention(shape, batch, io, workspace.get(), *bytes, nullptr);
    ASSERT_TRUE(s.ok()) << s;
    CUDA_ASSERT(cudaDeviceSynchronize());
    out = d_out.Download();
    lse = d_lse.Download();
  }

  const Scenario& scenario() const { return sc_; }

 private:
  Scenario sc_;
  QuantConfig cfg_;
  BlockLayout int2_layout_, bf16_layout_;
  int64_t int2_num_blocks_ = 0, bf16_num_blocks_ = 0;
  std::vector<uint8_t> int2_host_, bf16_host_;
  HostTier sink_, history_, recent_;
  std::vector<float> mk_, mv_, queries_;
};

// Relative error per (sequence, head) and LSE error against the float64 reference.
void ExpectMatches(const Scenario& sc, const Reference& ref, const std::vector<float>& out,
                   const std::vector<float>& lse, double max_rel = 1e-2, double max_lse = 1e-4) {
  const int d = sc.head_dim;
  double worst_rel = 0, worst_lse = 0;
  for (size_t row = 0; row < ref.lse.size(); ++row) {
    if (std::isinf(ref.lse[row])) {
      EXPECT_TRUE(std::isinf(lse[row]) && lse[row] < 0) << "row " << row << " lse " << lse[row];
      for (int j = 0; j < d; ++j) EXPECT_EQ(out[row * d + j], 0.f) << "row " << row;
      continue;
    }
    double num = 0, den = 0;
    for (int j = 0; j < d; ++j) {
      const double e = out[row * d + j] - ref.out[row * d + j];
      ASSERT_TRUE(std::isfinite(out[row * d + j])) << "row " << row << " dim " << j;
      num += e * e;
      den += ref.out[row * d + j] * ref.out[row * d + j];
    }
    const double rel = std::sqrt(num / std::max(den, 1e-30));
    const double lse_err = std::fabs(lse[row] - ref.lse[row]);
    worst_rel = std::max(worst_rel, rel);
    worst_lse = std::max(worst_lse, lse_err);
    EXPECT_LT(rel, max_rel) << "row " << row;
    EXPECT_LT(lse_err, max_lse * std::max(1.0, std::fabs(ref.lse[row]))) << "row " << row;
  }
  std::printf("    worst relative error %.3g, worst |lse error| %.3g\n", worst_rel, worst_lse);
}

void RunScenario(const Scenario& sc) {
  AttentionRun run;
  run.Build(sc);
  if (::testing::Test::HasFatalFailure()) return;
  const Reference ref = run.ComputeReference();
  std::vector<float> out, lse;
  run.Run(out, lse);
  if (::testing::Test::HasFatalFailure()) return;
  ExpectMatches(sc, ref, out, lse);
}

TEST_F(CudaAttentionTest, TensorCoresTakeSubnormalCodesAndTranspose) {
  const absl::Status s = cuda::testing::ProbeTensorCoreAssumptions();
  EXPECT_TRUE(s.ok()) << s;
}

TEST_F(CudaAttentionTest, MixedBatchHead128Group8) {
  Scenario sc;
  sc.seqs = {{64, 1000, 256}, {64, 37, 300}, {5, 0, 17}, {64, 2100, 263}};
  RunScenario(sc);
}

// The paths of the INT2 history kernel that the default tuning gives only some layouts: ordinary
// loads for 16-token blocks (AttentionTuning::history_async_copies off; the default takes them
// only for histories that do not start at a multiple of 16 or blocks of other sizes) and, for
// groups of up to 4, the wide layout (narrow_layout off).
AttentionTuning OrdinaryLoads() {
  AttentionTuning t;
  t.history_async_copies = false;
  return t;
}

AttentionTuning WideLayout() {
  AttentionTuning t;
  t.narrow_layout = false;
  return t;
}

// Runs `sc` once under each tuning.
void RunScenarioUnderEach(Scenario sc, std::initializer_list<AttentionTuning> tunings) {
  for (const AttentionTuning& t : tunings) {
    sc.tuning = t;
    RunScenario(sc);
  }
}

TEST_F(CudaAttentionTest, OrdinaryLoadsAndWideLayout) {
  Scenario sc;
  sc.seqs = std::vector<SeqSpec>{{64, 1000, 256}, {64, 37, 300}, {64, 2100, 263}};
  RunScenarioUnderEach(sc, {OrdinaryLoads()});
  // Groups of 4 and 3: the narrow layout (default) with ordinary loads, and the wide layout.
  sc.q_heads = 8;
  RunScenarioUnderEach(sc, {OrdinaryLoads(), WideLayout()});
  sc.head_dim = 64;
  sc.q_heads = 9;
  sc.kv_heads = 3;
  RunScenarioUnderEach(sc, {OrdinaryLoads(), WideLayout()});
}

// The BF16 tier kernel before the INT2 history (tiers_beside_history off) instead of beside it,
// and with no programmatic dependent launch at all (programmatic_launch off).
TEST_F(CudaAttentionTest, TiersInSequence) {
  Scenario sc;
  sc.seqs = std::vector<SeqSpec>{{64, 1000, 256}, {5, 0, 17}, {64, 2100, 263}};
  AttentionTuning in_sequence;
  in_sequence.tiers_beside_history = false;
  AttentionTuning no_pdl;
  no_pdl.programmatic_launch = false;
  RunScenarioUnderEach(sc, {in_sequence, no_pdl});
}

// Every way to merge the parts: the tail merge (the attention CTA that writes a KV head group's
// last part merges it; by default only with at least as many groups as SMs, forced here) and the
// two merge kernels (a CTA per query head, the default for these small batches, and a CTA per
// KV head group reading M_V once), for both head sizes, groups of 8, 4 and 3, and an identity
// rotation.
TEST_F(CudaAttentionTest, TailMergeAndMergeKernels) {
  AttentionTuning tail, per_head, per_group;
  tail.tail_merge = PathChoice::kAlways;
  per_head.tail_merge = PathChoice::kNever;
  per_head.group_merge = PathChoice::kNever;
  per_group.tail_merge = PathChoice::kNever;
  per_group.group_merge = PathChoice::kAlways;
  for (const AttentionTuning& tuning : {tail, per_head, per_group}) {
    Scenario sc;
    sc.tuning = tuning;
    sc.seqs = std::vector<SeqSpec>{{64, 1000, 256}, {5, 0, 17}, {64, 2100, 263}};
    RunScenario(sc);
    sc.q_heads = 8;  // group 4
    RunScenario(sc);
    sc.rotate = false;
    RunScenario(sc);
    sc.rotate = true;
    sc.head_dim = 64;
    sc.q_heads = 9;
    sc.kv_heads = 3;
    RunScenario(sc);
  }
}

// D = 64 through the INT2 history kernel's asynchronous copies (sequence 0 starts at slot 0),
// both scale dtypes.
TEST_F(CudaAttentionTest, Head64Group3BlockSize16BothScaleDtypes) {
  Scenario sc;
  sc.head_dim = 64;
  sc.q_heads = 9;
  sc.kv_heads = 3;
  sc.seqs = {{64, 777, 256}, {0, 129, 0}, {64, 3001, 100}};
  RunScenario(sc);
  sc.scale = ScaleDtype::kBf16;
  RunScenario(sc);
}

TEST_F(CudaAttentionTest, Head64Group3BlockSize8Bf16Scales) {
  Scenario sc;
  sc.head_dim = 64;
  sc.q_heads = 9;
  sc.kv_heads = 3;
  sc.block_tokens = 8;
  sc.scale = ScaleDtype::kBf16;
  sc.seqs = {{64, 777, 256}, {0, 129, 0}, {64, 3001, 100}};
  RunScenario(sc);
}

TEST_F(CudaAttentionTest, Group16AndGroup4) {
  Scenario sc;
  sc.q_heads = 32;
  sc.kv_heads = 2;
  sc.seqs = {{64, 500, 256}, {32, 1500, 64}};
  RunScenario(sc);
  sc.q_heads = 8;
  sc.seed = 9;
  RunScenario(sc);
}

TEST_F(CudaAttentionTest, LloydMaxHistoryAndIdentityRotation) {
  Scenario sc;
  sc.method = QuantMethod::kLloydMax;
  sc.rotate = false;
  sc.seqs = {{64, 999, 255}, {1, 15, 1}};
  RunScenario(sc);
}

TEST_F(CudaAttentionTest, EmptyTiersAndEmptySequences) {
  Scenario sc;
  sc.seqs = std::vector<SeqSpec>{{0, 0, 0}, {0, 700, 0}, {64, 0, 256}, {0, 0, 3}, {0, 1, 0}};
  RunScenario(sc);
  sc.tuning.tail_merge = PathChoice::kAlways;  // empty parts through the tail merge
  RunScenario(sc);
}

TEST_F(CudaAttentionTest, OneHotOnFirstAndLastTokenOfEachTier) {
  Scenario base;
  base.seqs = {{64, 1234, 256}, {40, 517, 201}};
  for (int seq = 0; seq < 2; ++seq) {
    for (int tier = 0; tier < 3; ++tier) {
      const SeqSpec& s = base.seqs[seq];
      const int n = tier == 0 ? s.sink : tier == 1 ? s.history : s.recent;
      for (int index : {0, n - 1}) {
        SCOPED_TRACE(absl::StrCat("seq ", seq, " tier ", tier, " token ", index));
        Scenario sc = base;
        sc.one_hot = OneHot{seq, tier, index};
        sc.seed = 100 + 10 * seq + tier;
        RunScenario(sc);
      }
    }
  }
}

// Batch 32 at 128K history tokens (+ 64 sink, 256 recent), Hkv 8, D 128: data made and
// quantized on the GPU; a sample of (sequence, head) pairs is checked against float64. The
// output bound is 1e-2 relative for every history kernel (long contexts are where the tensor
// cores' accumulation bias shows: kernels/cuda/NOTES.md, runs 3 and 7). q_heads 64 (groups of 8:
// the wide layout), 32 (groups of 4: the narrow layout) or 128 (groups of 16:
// Int2HistoryLargeGroupKernel).
void CheckBatch32At128K(int q_heads = 64) {
  constexpr int kB = 32, kHistory = 128 * 1024, kSink = 64, kRecent = 256;
  constexpr int kHkv = 8, kD = 128, kT = 16;
  QuantConfig cfg;
  cfg.block_tokens = kT;
  QuantConfig bypass = cfg;
  bypass.method = QuantMethod::kBypass;
  const BlockLayout int2_layout = BlockLayout::ForModel(cfg, kHkv, kD);
  const BlockLayout bf16_layout = BlockLayout::ForModel(bypass, kHkv, kD);
  const int hist_blocks_per_seq = kHistory / kT;
  const int bf16_blocks_per_seq = (kSink + kRecent) / kT;
  DeviceArray<uint8_t> int2_pool(static_cast<size_t>(kB) * hist_blocks_per_seq *
                                 int2_layout.block_bytes());
  DeviceArray<uint8_t> bf16_pool(static_cast<size_t>(kB) * bf16_blocks_per_seq *
                                 bf16_layout.block_bytes());
  ASSERT_NE(int2_pool.get(), nullptr);
  ASSERT_NE(bf16_pool.get(), nullptr);
  // BF16 tiers: the whole BF16 arena is K/V words (no meta in the bypass layout).
  ASSERT_TRUE(cuda::testing::FillRealLikeBf16(reinterpret_cast<uint16_t*>(bf16_pool.get()),
                                              bf16_pool.size() / 2, kD, 42, 1.0f, nullptr)
                  .ok());
  // Block tables: history of sequence i uses blocks i * per_seq + perm(j), reversed order.
  std::vector<int32_t> hist_tables(static_cast<size_t>(kB) * hist_blocks_per_seq);
  std::vector<int32_t> sink_tables(kB * 4), recent_tables(kB * 16);
  for (int i = 0; i < kB; ++i) {
    for (int j = 0; j < hist_blocks_per_seq; ++j) {
      hist_tables[i * hist_blocks_per_seq + j] =
          i * hist_blocks_per_seq + (hist_blocks_per_seq - 1 - j);
    }
    for (int j = 0; j < 4; ++j) sink_tables[i * 4 + j] = i * bf16_blocks_per_seq + j;
    for (int j = 0; j < 16; ++j) recent_tables[i * 16 + j] = i * bf16_blocks_per_seq + 4 + j;
  }
  DeviceArray<int32_t> d_hist(hist_tables.size()), d_sink(sink_tables.size()),
      d_recent(recent_tables.size());
  CUDA_ASSERT(d_hist.Upload(hist_tables));
  CUDA_ASSERT(d_sink.Upload(sink_tables));
  CUDA_ASSERT(d_recent.Upload(recent_tables));
  std::vector<int32_t> zeros(kB, 0), hist_n(kB), sink_n(kB, kSink), recent_n(kB, kRecent);
  for (int i = 0; i < kB; ++i) hist_n[i] = kHistory - 37 * i;  // different lengths
  DeviceArray<int32_t> d_zero(kB), d_hist_n(kB), d_sink_n(kB), d_recent_n(kB);
  CUDA_ASSERT(d_zero.Upload(zeros));
  CUDA_ASSERT(d_hist_n.Upload(hist_n));
  CUDA_ASSERT(d_sink_n.Upload(sink_n));
  CUDA_ASSERT(d_recent_n.Upload(recent_n));

  // History: random rows per sequence, quantized on arrival by the GPU codec.
  {
    DeviceArray<uint16_t> rows(static_cast<size_t>(kHistory) * kHkv * kD);
    DeviceArray<uint32_t> err(1);
    CUDA_ASSERT(cudaMemset(err.get(), 0, 4));
    std::vector<int32_t> offsets = {0, kHistory};
    DeviceArray<int32_t> d_offsets(2);
    CUDA_ASSERT(d_offsets.Upload(offsets));
    const PagedKvView kv{int2_pool.get(), int2_layout, cfg.scale_dtype,
                         static_cast<int64_t>(kB) * hist_blocks_per_seq};
    for (int i = 0; i < kB; ++i) {
      const SequenceBatch batch{1,
                                d_offsets.get(),
                                d_zero.get(),
                                d_hist.get() + static_cast<size_t>(i) * hist_blocks_per_seq,
                                hist_blocks_per_seq,
                                kHistory};
      for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
        ASSERT_TRUE(cuda::testing::FillRealLikeBf16(rows.get(), rows.size(), kD,
                                                    1000 + 2 * i + static_cast<int>(t), 1.0f,
                                                    nullptr)
                        .ok());
        ASSERT_TRUE(QuantizeOnArrival(cfg, kv, batch, t, ArrivalRows{rows.get(), nullptr, nullptr},
                                      err.get(), nullptr)
                        .ok());
      }
    }
    const absl::Status st = TakeCodecErrors(err.get(), nullptr);
    ASSERT_TRUE(st.ok()) << st;
  }
  DeviceArray<float> q(static_cast<size_t>(kB) * q_heads * kD), out(q.size()), lse(kB * q_heads);
  ASSERT_TRUE(cuda::testing::FillGaussianF32(q.get(), q.size(), 7, 1.0f, nullptr).ok());
  DecodeAttentionShape shape;
  shape.cfg = cfg;
  shape.q_heads = q_heads;
  PagedKvBatch batch;
  batch.history_pool = PagedKvView{int2_pool.get(), int2_layout, cfg.scale_dtype,
                                   static_cast<int64_t>(kB) * hist_blocks_per_seq};
  batch.bf16_pool = PagedKvView{bf16_pool.get(), bf16_layout, cfg.scale_dtype,
                                static_cast<int64_t>(kB) * bf16_blocks_per_seq};
  batch.num_seqs = kB;
  batch.max_history_tokens = kHistory;
  batch.max_bf16_tokens = kSink + kRecent;
  batch.sink = PagedKvTier{d_sink.get(), 4, d_zero.get(), d_sink_n.get()};
  batch.history = PagedKvTier{d_hist.get(), hist_blocks_per_seq, d_zero.get(), d_hist_n.get()};
  batch.recent = PagedKvTier{d_recent.get(), 16, d_zero.get(), d_recent_n.get()};
  auto bytes = DecodeAttentionWorkspaceBytes(shape, batch);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  DeviceArray<uint8_t> workspace(*bytes);
  const DecodeIo io{q.get(), nullptr, nullptr, out.get(), lse.get()};
  const absl::Status s = DecodeAttention(shape, batch, io, workspace.get(), *bytes, nullptr);
  ASSERT_TRUE(s.ok()) << s;
  CUDA_ASSERT(cudaDeviceSynchronize());
  const std::vector<float> h_out = out.Download();
  const std::vector<float> h_lse = lse.Download();
  const std::vector<float> h_q = q.Download();
  const std::vector<uint8_t> h_bf16 = bf16_pool.Download();
  auto codec = RowCodec::Create(cfg, kD);
  ASSERT_TRUE(codec.ok());

  for (int i : {0, 13, 31}) {
    // The sequence's history blocks, downloaded once.
    std::vector<uint8_t> blocks(static_cast<size_t>(hist_blocks_per_seq) *
                                int2_layout.block_bytes());
    CUDA_ASSERT(cudaMemcpy(
        blocks.data(),
        int2_pool.get() + static_cast<size_t>(i) * hist_blocks_per_seq * int2_layout.block_bytes(),
        blocks.size(), cudaMemcpyDeviceToHost));
    for (int hq : {0, 9, q_heads - 1}) {
      const int h = hq / (q_heads / kHkv);
      const float* qv = h_q.data() + (static_cast<size_t>(i) * q_heads + hq) * kD;
      std::vector<double> logits;
      std::vector<std::vector<float>> vrows;
      std::vector<float> kr(kD), vr(kD);
      auto add = [&](const std::vector<float>& k, const std::vector<float>& v) {
        double dot = 0;
        for (int j = 0; j < kD; ++j) dot += static_cast<double>(qv[j]) * k[j];
        logits.push_back(dot / std::sqrt(static_cast<double>(kD)));
        vrows.push_back(v);
      };
      auto bf16_row = [&](int table_block, int slot, KvTensor t, std::vector<float>& dst) {
        const uint8_t* base =
            h_bf16.data() + static_cast<size_t>(table_block) * bf16_layout.block_bytes();
        const uint8_t* row =
            base + bf16_layout.CodesOffset(t, h) + slot * bf16_layout.code_bytes_per_row();
        for (int j = 0; j < kD; ++j) {
          uint16_t w;
          std::memcpy(&w, row + 2 * j, 2);
          dst[j] = Bf16::FromBits(w).ToFloat();
        }
      };
      for (int r = 0; r < kSink; ++r) {
        bf16_row(sink_tables[i * 4 + r / kT], r % kT, KvTensor::kKey, kr);
        bf16_row(sink_tables[i * 4 + r / kT], r % kT, KvTensor::kValue, vr);
        add(kr, vr);
      }
      for (int r = 0; r < hist_n[i]; ++r) {
        const int local = hist_tables[i * hist_blocks_per_seq + r / kT] - i * hist_blocks_per_seq;
        const uint8_t* base =
            blocks.data() + static_cast<size_t>(local) * int2_layout.block_bytes();
        const int slot = r % kT;
        for (int kv = 0; kv < 2; ++kv) {
          const KvTensor t = kv == 0 ? KvTensor::kKey : KvTensor::kValue;
          GroupMeta meta;
          std::memcpy(&meta, base + int2_layout.MetaOffset(t, h) + slot * 4, 4);
          codec->Decode(
              base + int2_layout.CodesOffset(t, h) + slot * int2_layout.code_bytes_per_row(), &meta,
              absl::MakeSpan(kv == 0 ? kr : vr));
        }
        add(kr, vr);
      }
      for (int r = 0; r < kRecent; ++r) {
        bf16_row(recent_tables[i * 16 + r / kT], r % kT, KvTensor::kKey, kr);
        bf16_row(recent_tables[i * 16 + r / kT], r % kT, KvTensor::kValue, vr);
        add(kr, vr);
      }
      const double mx = *std::max_element(logits.begin(), logits.end());
      double sum = 0;
      std::vector<double> o(kD, 0.0);
      for (size_t t = 0; t < logits.size(); ++t) {
        const double w = std::exp(logits[t] - mx);
        sum += w;
        for (int j = 0; j < kD; ++j) o[j] += w * vrows[t][j];
      }
      double num = 0, den = 0;
      const float* got = h_out.data() + (static_cast<size_t>(i) * q_heads + hq) * kD;
      for (int j = 0; j < kD; ++j) {
        o[j] /= sum;
        num += (got[j] - o[j]) * (got[j] - o[j]);
        den += o[j] * o[j];
      }
      const double ref_lse = mx + std::log(sum);
      const double rel = std::sqrt(num / den);
      std::printf("    seq %d head %d: relative error %.3g, lse %.6f vs %.6f\n", i, hq, rel,
                  h_lse[i * q_heads + hq], ref_lse);
      EXPECT_LT(rel, 1e-2);
      EXPECT_LT(std::fabs(h_lse[i * q_heads + hq] - ref_lse),
                1e-4 * std::max(1.0, std::fabs(ref_lse)));
    }
  }
}

TEST_F(CudaAttentionTest, Batch32At128K) { CheckBatch32At128K(); }

TEST_F(CudaAttentionTest, Batch32At128KGroup16LargeGroupKernel) { CheckBatch32At128K(128); }

TEST_F(CudaAttentionTest, Batch32At128KGroup4NarrowLayout) { CheckBatch32At128K(32); }

// The split covers every history token within the part and length bounds, and the benchmark's
// bounds force a length (NOTES.md, run 12's sweep relies on it).
TEST_F(CudaAttentionTest, SplitCoversTheHistoryWithinItsBounds) {
  QuantConfig cfg;
  cfg.block_tokens = 16;
  QuantConfig bypass = cfg;
  bypass.method = QuantMethod::kBypass;
  DeviceArray<uint8_t> pool(4096);
  PagedKvBatch batch;
  batch.history_pool =
      PagedKvView{pool.get(), BlockLayout::ForModel(cfg, 8, 128), cfg.scale_dtype, 1};
  batch.bf16_pool =
      PagedKvView{pool.get(), BlockLayout::ForModel(bypass, 8, 128), cfg.scale_dtype, 1};
  batch.max_bf16_tokens = 320;
  DecodeAttentionShape shape;
  shape.cfg = cfg;
  shape.q_heads = 64;
  for (const int seqs : {1, 8, 32}) {
    for (const int tokens : {100, 7872, 32448, 130752, 4000000}) {
      batch.num_seqs = seqs;
      batch.max_history_tokens = tokens;
      auto split = DecodeAttentionSplitOf(shape, batch);
      ASSERT_TRUE(split.ok()) << split.status();
      const std::string at = absl::StrCat(seqs, " x ", tokens);
      EXPECT_GE(static_cast<int64_t>(split->history_chunks) * split->history_chunk_tokens, tokens)
          << at;
      EXPECT_LT(static_cast<int64_t>(split->history_chunks - 1) * split->history_chunk_tokens,
                tokens)
          << at;
      EXPECT_EQ(split->history_chunk_tokens % 128, 0) << at;
      EXPECT_LE(split->history_chunks + split->bf16_chunks, 256) << at;
      if (static_cast<int64_t>(split->history_chunks) * 16384 >= tokens) {
        EXPECT_LE(split->history_chunk_tokens, 16384) << at;
      }
      EXPECT_GE(static_cast<int64_t>(split->bf16_chunks) * split->bf16_chunk_tokens, 320) << at;
    }
  }
  batch.num_seqs = 1;
  batch.max_history_tokens = 7872;
  shape.tuning.min_history_chunk_tokens = shape.tuning.max_history_chunk_tokens = 640;
  auto forced = DecodeAttentionSplitOf(shape, batch);
  ASSERT_TRUE(forced.ok()) << forced.status();
  EXPECT_EQ(forced->history_chunk_tokens, 640);
  EXPECT_EQ(forced->history_chunks, 13);
  for (const int bad : {-1, (1 << 24) + 1, std::numeric_limits<int>::max()}) {
    shape.tuning.min_history_chunk_tokens = bad;
    EXPECT_EQ(DecodeAttentionSplitOf(shape, batch).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

}  // namespace
}  // namespace kvpool::cuda
