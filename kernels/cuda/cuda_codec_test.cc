// GPU codec against the CPU reference: the codes and scale/min words of every row must equal
// RowCodec's bit for bit when both start from the same rotated BF16 rows (the GPU's own
// rotation output), the GPU rotation must match a float64 rotation to BF16 rounding, and
// dequantized rows must equal the CPU's decode rounded to BF16. Skips without a CUDA device.
#include "kernels/cuda/cuda_codec.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/bf16.h"
#include "kernels/block_layout.h"
#include "kernels/codec_config.h"
#include "kernels/page_checksum.h"
#include "kernels/rotation.h"
#include "kernels/row_codec.h"
#include "tests/support/test_data.h"

namespace kvpool::cuda {
namespace {

#define CUDA_ASSERT(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// A device array freed on destruction.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : n_(n) {
    void* p = nullptr;
    if (cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)) == cudaSuccess) {
      ptr_ = static_cast<T*>(p);
    }
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() {
    if (ptr_ != nullptr) cudaFree(ptr_);
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
  size_t n_;
};

class CudaCodecTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

struct Case {
  int head_dim;
  int kv_heads;
  int bits;        // 2, 4
  int group_size;  // 0 = D
  ScaleDtype scale;
  QuantMethod method;
  bool rotate;
  bool sparse;              // rows mostly (signed) zeros: ties in clip and min/max
  bool long_batch = false;  // add a 6000-token sequence (many row tiles per warp)
  bool row_kernel = false;  // every configuration through ArrivalRowKernel (no mma_kernel)
};

std::string Name(const Case& c) {
  return absl::StrCat("D", c.head_dim, "_H", c.kv_heads, "_b", c.bits, "_G", c.group_size, "_",
                      ScaleDtypeName(c.scale), "_", QuantMethodName(c.method),
                      c.rotate ? "_rot" : "_id", c.sparse ? "_sparse" : "",
                      c.long_batch ? "_long" : "", c.row_kernel ? "_row_kernel" : "");
}

// Three sequences with lengths that are not multiples of the block size, first tokens inside a
// block, and a shuffled, non-contiguous block assignment.
struct BatchPlan {
  std::vector<int32_t> row_offsets;
  std::vector<int32_t> first_token;
  std::vector<int32_t> block_tables;
  int stride = 0;
  int num_blocks = 0;
};

BatchPlan MakePlan(int tokens_per_block, uint64_t seed, bool long_batch, int first_shift = 0) {
  BatchPlan p;
  std::vector<int> lengths = {37, 1, 70};
  std::vector<int> firsts = {5 + first_shift, 0 + first_shift, 19 + first_shift};
  if (long_batch) {
    lengths.push_back(6000);
    firsts.push_back(3);
  }
  p.row_offsets = {0};
  int max_blocks = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    p.row_offsets.push_back(p.row_offsets.back() + lengths[i]);
    p.first_token.push_back(firsts[i]);
    max_blocks =
        std::max(max_blocks, (firsts[i] + lengths[i] + tokens_per_block - 1) / tokens_per_block);
  }
  p.stride = max_blocks + 1;
  p.num_blocks = static_cast<int>(lengths.size()) * p.stride + 3;
  std::vector<int32_t> ids(p.num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  p.block_tables.assign(lengths.size() * p.stride, -1);
  size_t next = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    const int used = (firsts[i] + lengths[i] + tokens_per_block - 1) / tokens_per_block;
    for (int b = 0; b < used; ++b) p.block_tables[i * p.stride + b] = ids[next++];
  }
  return p;
}

// The CPU's page checksum (kernels/page_checksum.h) of the slots that `plan` writes in each page,
// per block table entry (0 for unused entries), from the pool bytes `pool`.
std::vector<uint32_t> CpuPageChecksums(const BatchPlan& plan, const std::vector<uint8_t>& pool,
                                       const BlockLayout& layout) {
  std::vector<uint32_t> sums(plan.block_tables.size(), 0);
  const PageChecksumGeometry geo = PageChecksumGeometry::Of(layout);
  for (size_t s = 0; s + 1 < plan.row_offsets.size(); ++s) {
    const int first = plan.first_token[s];
    const int end = first + plan.row_offsets[s + 1] - plan.row_offsets[s];
    for (int j = 0; j < plan.stride; ++j) {
      const int lo = std::max(first, j * layout.tokens);
      const int hi = std::min(end, (j + 1) * layout.tokens);
      if (lo >= hi) continue;
      const size_t entry = s * plan.stride + j;
      const size_t page = static_cast<size_t>(plan.block_tables[entry]) * layout.block_bytes();
      sums[entry] = PageSlotsChecksum(&pool[page], geo, lo - j * layout.tokens, hi - lo);
    }
  }
  return sums;
}

std::vector<float> InputRows(const Case& c, int rows, uint64_t seed) {
  std::vector<float> v = testing::RealLikeRows(rows * c.kv_heads, c.head_dim, seed);
  if (c.sparse) {
    std::mt19937_64 rng(seed ^ 0x5bd1e995);
    for (size_t i = 0; i < v.size(); ++i) {
      if (rng() % 10 != 0) v[i] = (rng() & 1) ? 0.0f : -0.0f;
    }
  }
  return v;
}

// The case's quant config (16-token blocks, demoted 16 at a time).
QuantConfig ConfigOf(const Case& c) {
  QuantConfig cfg;
  cfg.bits = c.bits;
  cfg.group_size = c.group_size;
  cfg.method = c.method;
  cfg.scale_dtype = c.scale;
  cfg.block_tokens = 16;
  cfg.demotion_batch = 16;
  return cfg;
}

void RunCase(const Case& c) {
  SCOPED_TRACE(Name(c));
  const QuantConfig cfg = ConfigOf(c);
  ASSERT_TRUE(cfg.Validate(c.head_dim).ok());
  auto codec_or = RowCodec::Create(cfg, c.head_dim);
  ASSERT_TRUE(codec_or.ok()) << codec_or.status();
  const RowCodec& codec = *codec_or;
  const BlockLayout layout = BlockLayout::ForModel(cfg, c.kv_heads, c.head_dim);
  const int d = c.head_dim;

  const BatchPlan plan = MakePlan(layout.tokens, 11 + d, c.long_batch);
  const int total_rows = plan.row_offsets.back();
  const size_t row_values = static_cast<size_t>(total_rows) * c.kv_heads * d;

  DeviceArray<uint8_t> pool(plan.num_blocks * layout.block_bytes());
  DeviceArray<int32_t> d_offsets(plan.row_offsets.size());
  DeviceArray<int32_t> d_first(plan.first_token.size());
  DeviceArray<int32_t> d_tables(plan.block_tables.size());
  DeviceArray<uint16_t> d_rows(row_values);
  DeviceArray<uint16_t> d_rotated(row_values);
  DeviceArray<uint16_t> d_dequant(row_values);
  DeviceArray<uint16_t> d_original(row_values);
  DeviceArray<float> d_rotation(static_cast<size_t>(d) * d);
  DeviceArray<float> d_unrotation(static_cast<size_t>(d) * d);
  DeviceArray<uint32_t> d_err(1);
  DeviceArray<uint32_t> d_sums(plan.block_tables.size());
  ASSERT_NE(pool.get(), nullptr);
  CUDA_ASSERT(d_offsets.Upload(plan.row_offsets));
  CUDA_ASSERT(d_first.Upload(plan.first_token));
  CUDA_ASSERT(d_tables.Upload(plan.block_tables));
  CUDA_ASSERT(cudaMemset(d_err.get(), 0, sizeof(uint32_t)));

  const PagedKvView kv{pool.get(), layout, c.scale, plan.num_blocks};
  const SequenceBatch batch{static_cast<int>(plan.first_token.size()),
                            d_offsets.get(),
                            d_first.get(),
                            d_tables.get(),
                            plan.stride,
                            total_rows};

  for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
    SCOPED_TRACE(t == KvTensor::kKey ? "K" : "V");
    const uint64_t seed = 1000 * d + 10 * c.bits + static_cast<int>(t);
    const std::vector<Bf16> input = testing::ToBf16(InputRows(c, total_rows, seed));
    std::vector<uint16_t> input_bits(input.size());
    for (size_t i = 0; i < input.size(); ++i) input_bits[i] = input[i].bits;
    CUDA_ASSERT(d_rows.Upload(input_bits));
    std::vector<float> matrix;
    if (c.rotate) {
      auto set = RotationSet::RandomizedHadamard(/*num_layers=*/1, d, /*seed=*/seed);
      ASSERT_TRUE(set.ok()) << set.status();
      matrix = set->Matrix(0, t);
      CUDA_ASSERT(d_rotation.Upload(matrix));
      std::vector<float> transposed(matrix.size());
      for (int i = 0; i < d; ++i) {
        for (int j = 0; j < d; ++j) transposed[j * d + i] = matrix[i * d + j];
      }
      CUDA_ASSERT(d_unrotation.Upload(transposed));
    }
    // Poison the pool so that unwritten bytes are visible.
    CUDA_ASSERT(cudaMemset(pool.get(), 0xa5, pool.size()));
    CUDA_ASSERT(cudaMemset(d_sums.get(), 0, d_sums.size() * sizeof(uint32_t)));
    ArrivalRows in{d_rows.get(), c.rotate ? d_rotation.get() : nullptr, d_rotated.get()};
    in.page_checksums = d_sums.get();
    ArrivalTuning tuning;
    tuning.mma_kernel = !c.row_kernel;
    ASSERT_TRUE(QuantizeOnArrival(cfg, kv, batch, t, in, d_err.get(), nullptr, tuning).ok());
    const absl::Status arrival = TakeCodecErrors(d_err.get(), nullptr);
    ASSERT_TRUE(arrival.ok()) << arrival;
    ASSERT_TRUE(DequantizeToBf16(cfg, kv, batch, t, d_dequant.get(), d_err.get(), nullptr).ok());
    const absl::Status dequant = TakeCodecErrors(d_err.get(), nullptr);
    ASSERT_TRUE(dequant.ok()) << dequant;
    if (c.rotate) {
      ASSERT_TRUE(DequantizeToOriginalBf16(cfg, kv, batch, t, d_unrotation.get(), d_original.get(),
                                           d_err.get(), nullptr)
                      .ok());
      const absl::Status back = TakeCodecErrors(d_err.get(), nullptr);
      ASSERT_TRUE(back.ok()) << back;
    }

    const std::vector<uint8_t> blocks = pool.Download();
    const std::vector<uint16_t> rotated = d_rotated.Download();
    const std::vector<uint16_t> dequantized = d_dequant.Download();
    const std::vector<uint16_t> original = d_original.Download();
    const std::vector<uint32_t> sums = d_sums.Download();
    ASSERT_EQ(blocks.size(), pool.size());
    // The fused page checksums: per block table entry, the terms of this tensor's stored words.
    std::vector<uint32_t> want_sums(plan.block_tables.size(), 0);

    // 1. Rotation: within BF16 rounding of a float64 rotation.
    for (int r = 0; r < total_rows * c.kv_heads; ++r) {
      double max_abs = 0;
      for (int i = 0; i < d; ++i) {
        max_abs = std::max(max_abs, std::fabs(static_cast<double>(input[r * d + i].ToFloat())));
      }
      for (int j = 0; j < d; ++j) {
        double ref = 0;
        for (int i = 0; i < d; ++i) {
          const double m = c.rotate ? matrix[i * d + j] : (i == j ? 1.0 : 0.0);
          ref += static_cast<double>(input[r * d + i].ToFloat()) * m;
        }
        const float got = Bf16::FromBits(rotated[r * d + j]).ToFloat();
        ASSERT_NEAR(got, ref, std::fabs(ref) * (1.0 / 128) + 1e-5 * max_abs)
            << "row " << r << " dim " << j;
      }
    }

    // 2. Codes and meta, bit for bit, from the same rotated rows; 3. dequantized values.
    std::vector<uint8_t> want_codes(layout.code_bytes_per_row());
    std::vector<GroupMeta> want_meta(std::max<size_t>(layout.groups_per_row(), 1));
    std::vector<float> decoded(d);
    std::vector<Bf16> row(d);
    std::vector<bool> written(blocks.size(), false);
    for (size_t s = 0; s + 1 < plan.row_offsets.size(); ++s) {
      for (int r = plan.row_offsets[s]; r < plan.row_offsets[s + 1]; ++r) {
        const int pos = plan.first_token[s] + (r - plan.row_offsets[s]);
        const int block = plan.block_tables[s * plan.stride + pos / layout.tokens];
        const int slot = pos % layout.tokens;
        for (int h = 0; h < c.kv_heads; ++h) {
          const size_t base = (static_cast<size_t>(r) * c.kv_heads + h) * d;
          for (int i = 0; i < d; ++i) row[i] = Bf16::FromBits(rotated[base + i]);
          ASSERT_TRUE(codec.Encode(t, row, want_codes.data(), want_meta.data()).ok());
          const size_t block_base = static_cast<size_t>(block) * layout.block_bytes();
          const size_t codes_at =
              block_base + layout.CodesOffset(t, h) + slot * layout.code_bytes_per_row();
          const size_t meta_at =
              block_base + layout.MetaOffset(t, h) + slot * layout.meta_bytes_per_row();
          for (size_t i = 0; i < want_codes.size(); ++i) {
            ASSERT_EQ(blocks[codes_at + i], want_codes[i])
                << "seq " << s << " row " << r << " head " << h << " code byte " << i;
            written[codes_at + i] = true;
          }
          const size_t entry = s * plan.stride + pos / layout.tokens;
          auto add_words = [&](size_t at, size_t bytes) {
            for (size_t i = 0; i < bytes; i += 4) {
              uint32_t w;
              std::memcpy(&w, &blocks[at + i], 4);
              want_sums[entry] += PageChecksumTerm(w, static_cast<uint32_t>(at + i - block_base));
            }
          };
          add_words(codes_at, layout.code_bytes_per_row());
          add_words(meta_at, layout.meta_bytes_per_row());
          for (size_t g = 0; g < layout.groups_per_row(); ++g) {
            GroupMeta got;
            std::memcpy(&got, &blocks[meta_at + 4 * g], sizeof(got));
            ASSERT_EQ(got.scale, want_meta[g].scale) << "row " << r << " head " << h << " g " << g;
            ASSERT_EQ(got.min, want_meta[g].min) << "row " << r << " head " << h << " g " << g;
            for (int k = 0; k < 4; ++k) written[meta_at + 4 * g + k] = true;
          }
          codec.Decode(want_codes.data(), want_meta.data(), absl::MakeSpan(decoded));
          for (int i = 0; i < d; ++i) {
            ASSERT_EQ(dequantized[base + i], Bf16::FromFloat(decoded[i]).bits)
                << "row " << r << " head " << h << " dim " << i;
          }
          // 4. Back in the original basis: decoded * M^T, within BF16 rounding.
          if (c.rotate) {
            double max_abs = 0;
            for (int j = 0; j < d; ++j) max_abs = std::max(max_abs, std::fabs(double{decoded[j]}));
            for (int i = 0; i < d; ++i) {
              double ref = 0;
              for (int j = 0; j < d; ++j) ref += double{decoded[j]} * matrix[i * d + j];
              const float got = Bf16::FromBits(original[base + i]).ToFloat();
              ASSERT_NEAR(got, ref, std::fabs(ref) * (1.0 / 128) + 1e-5 * max_abs)
                  << "original basis: row " << r << " head " << h << " dim " << i;
            }
          }
        }
      }
    }
    // Nothing else in the pool was touched.
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (!written[i]) {
        ASSERT_EQ(blocks[i], 0xa5) << "stray write at byte " << i;
      }
    }
    EXPECT_EQ(sums, want_sums) << "fused page checksums";
  }
}

TEST_F(CudaCodecTest, Int2Head128MatchesCpuBitForBit) {
  RunCase({128, 8, 2, 0, ScaleDtype::kFp16, QuantMethod::kUniform, true, false});
  RunCase({128, 2, 2, 0, ScaleDtype::kBf16, QuantMethod::kUniform, false, false});
}

// The tensor-core arrival kernel over many row tiles per warp (persistent grid), and the
// warp-per-row kernel on configurations that the tensor-core kernel takes by default.
TEST_F(CudaCodecTest, Int2LongBatchAndRowKernel) {
  RunCase({128, 8, 2, 0, ScaleDtype::kFp16, QuantMethod::kUniform, true, false, true});
  RunCase({64, 3, 2, 0, ScaleDtype::kBf16, QuantMethod::kUniform, true, false, true});
  RunCase({128, 8, 2, 0, ScaleDtype::kFp16, QuantMethod::kUniform, true, false, false, true});
  RunCase({128, 2, 2, 0, ScaleDtype::kFp16, QuantMethod::kUniform, false, true, false, true});
}

TEST_F(CudaCodecTest, Int2Head64MatchesCpuBitForBit) {
  RunCase({64, 3, 2, 0, ScaleDtype::kFp16, QuantMethod::kUniform, true, false});
  RunCase({64, 3, 2, 32, ScaleDtype::kBf16, QuantMethod::kUniform, true, false});
}

TEST_F(CudaCodecTest, Int4AndSmallGroupsMatchCpuBitForBit) {
  RunCase({128, 4, 4, 0, ScaleDtype::kFp16, QuantMethod::kUniform, true, false});
  RunCase({128, 4, 4, 32, ScaleDtype::kFp16, QuantMethod::kUniform, true, false});
  RunCase({64, 2, 4, 0, ScaleDtype::kBf16, QuantMethod::kUniform, true, false});
}

TEST_F(CudaCodecTest, GenericPathMatchesCpuBitForBit) {
  RunCase({32, 2, 2, 0, ScaleDtype::kFp16, QuantMethod::kUniform, true, false});
  RunCase({256, 2, 2, 0, ScaleDtype::kFp16, QuantMethod::kUniform, true, false});
  RunCase({256, 2, 4, 64, ScaleDtype::kBf16, QuantMethod::kUniform, true, false});
}

TEST_F(CudaCodecTest, LloydMaxMatchesCpuBitForBit) {
  RunCase({128, 4, 2, 0, ScaleDtype::kFp16, QuantMethod::kLloydMax, true, false});
  RunCase({64, 3, 2, 0, ScaleDtype::kBf16, QuantMethod::kLloydMax, true, false});
  RunCase({32, 2, 2, 0, ScaleDtype::kFp16, QuantMethod::kLloydMax, true, false});
  RunCase({256, 2, 2, 0, ScaleDtype::kFp16, QuantMethod::kLloydMax, true, false});
}

TEST_F(CudaCodecTest, BypassStoresRotatedRows) {
  RunCase({128, 2, 2, 0, ScaleDtype::kFp16, QuantMethod::kBypass, true, false});
  RunCase({64, 1, 2, 0, ScaleDtype::kFp16, QuantMethod::kBypass, false, false});
}

// Device copies of a BatchPlan, and the batch they describe.
struct DevicePlan {
  explicit DevicePlan(const BatchPlan& p)
      : offsets(p.row_offsets.size()), first(p.first_token.size()), tables(p.block_tables.size()) {
    ok = offsets.Upload(p.row_offsets) == cudaSuccess &&
         first.Upload(p.first_token) == cudaSuccess && tables.Upload(p.block_tables) == cudaSuccess;
    batch = SequenceBatch{static_cast<int>(p.first_token.size()),
                          offsets.get(),
                          first.get(),
                          tables.get(),
                          p.stride,
                          p.row_offsets.back()};
  }
  DeviceArray<int32_t> offsets, first, tables;
  SequenceBatch batch;
  bool ok = false;
};

// The page checksums fused into arrival: K and V of every configuration's kernel add up, per
// page, to the CPU's PageSlotsChecksum of the slots written (kernels/page_checksum.h), whether
// the two tensors go in one launch (QuantizeOnArrivalJobs) or in two.
TEST_F(CudaCodecTest, FusedPageChecksumsEqualTheCpuChecksum) {
  for (const Case& c :
       {Case{128, 8, 2, 0, ScaleDtype::kFp16, QuantMethod::kUniform, true, false},
        Case{128, 8, 2, 0, ScaleDtype::kFp16, QuantMethod::kUniform, true, false, true, true},
        Case{64, 3, 2, 32, ScaleDtype::kBf16, QuantMethod::kUniform, true, false},
        Case{128, 2, 4, 0, ScaleDtype::kFp16, QuantMethod::kUniform, false, false},
        Case{128, 4, 2, 0, ScaleDtype::kFp16, QuantMethod::kLloydMax, true, false},
        Case{128, 2, 2, 0, ScaleDtype::kFp16, QuantMethod::kBypass, true, false},
        Case{256, 2, 2, 0, ScaleDtype::kFp16, QuantMethod::kBypass, true, false},
        Case{32, 2, 2, 0, ScaleDtype::kFp16, QuantMethod::kUniform, true, true}}) {
    SCOPED_TRACE(Name(c));
    const QuantConfig cfg = ConfigOf(c);
    ASSERT_TRUE(cfg.Validate(c.head_dim).ok());
    const BlockLayout layout = BlockLayout::ForModel(cfg, c.kv_heads, c.head_dim);
    const BatchPlan plan = MakePlan(layout.tokens, 13 + c.head_dim, c.long_batch);
    DevicePlan dev(plan);
    ASSERT_TRUE(dev.ok);
    const int rows = plan.row_offsets.back();
    const size_t values = static_cast<size_t>(rows) * c.kv_heads * c.head_dim;
    DeviceArray<uint8_t> pool(plan.num_blocks * layout.block_bytes());
    DeviceArray<uint16_t> d_k(values), d_v(values);
    DeviceArray<float> d_rot(static_cast<size_t>(c.head_dim) * c.head_dim);
    DeviceArray<uint32_t> d_err(1), d_sums(plan.block_tables.size());
    CUDA_ASSERT(cudaMemset(d_err.get(), 0, sizeof(uint32_t)));
    auto set = RotationSet::RandomizedHadamard(1, c.head_dim, 77);
    ASSERT_TRUE(set.ok()) << set.status();
    CUDA_ASSERT(d_rot.Upload(set->Matrix(0, KvTensor::kKey)));
    for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
      const std::vector<Bf16> input = testing::ToBf16(InputRows(c, rows, 90 + static_cast<int>(t)));
      std::vector<uint16_t> bits(input.size());
      for (size_t i = 0; i < input.size(); ++i) bits[i] = input[i].bits;
      CUDA_ASSERT((t == KvTensor::kKey ? d_k : d_v).Upload(bits));
    }
    const PagedKvView kv{pool.get(), layout, c.scale, plan.num_blocks};
    ArrivalTuning tuning;
    tuning.mma_kernel = !c.row_kernel;
    for (const bool one_launch : {true, false}) {
      SCOPED_TRACE(one_launch ? "one launch" : "a launch per tensor");
      CUDA_ASSERT(cudaMemset(pool.get(), 0xa5, pool.size()));
      CUDA_ASSERT(cudaMemset(d_sums.get(), 0, d_sums.size() * sizeof(uint32_t)));
      std::vector<ArrivalJob> jobs;
      for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
        ArrivalJob j;
        j.cfg = cfg;
        j.kv = kv;
        j.batch = dev.batch;
        j.tensor = t;
        j.in.rows = t == KvTensor::kKey ? d_k.get() : d_v.get();
        j.in.rotation = c.rotate ? d_rot.get() : nullptr;
        j.in.page_checksums = d_sums.get();
        jobs.push_back(j);
      }
      if (one_launch) {
        ASSERT_TRUE(QuantizeOnArrivalJobs(jobs, d_err.get(), nullptr, tuning).ok());
      } else {
        for (const ArrivalJob& j : jobs) {
          ASSERT_TRUE(
              QuantizeOnArrival(cfg, kv, j.batch, j.tensor, j.in, d_err.get(), nullptr, tuning)
                  .ok());
        }
      }
      const absl::Status arrival = TakeCodecErrors(d_err.get(), nullptr);
      ASSERT_TRUE(arrival.ok()) << arrival;
      const std::vector<uint32_t> want = CpuPageChecksums(plan, pool.Download(), layout);
      EXPECT_EQ(d_sums.Download(), want);
      size_t nonzero = 0;
      for (uint32_t w : want) nonzero += w != 0;
      EXPECT_GT(nonzero, plan.block_tables.size() / 4) << "the arrival wrote pages";
    }
    // Misaligned sums are rejected before anything launches.
    ArrivalRows misaligned{d_k.get()};
    misaligned.page_checksums =
        reinterpret_cast<uint32_t*>(reinterpret_cast<uintptr_t>(d_sums.get()) + 2);
    EXPECT_EQ(
        QuantizeOnArrival(cfg, kv, dev.batch, KvTensor::kKey, misaligned, d_err.get(), nullptr)
            .code(),
        absl::StatusCode::kInvalidArgument);
  }
}

// QuantizeOnArrivalJobs (one launch for a chunk's INT2 and BF16-bypass runs, K and V) writes
// exactly what one QuantizeOnArrival call per job writes (those are checked against the CPU
// above), and nothing else.
TEST_F(CudaCodecTest, ArrivalJobsInOneLaunchEqualOneLaunchPerJob) {
  constexpr int kD = 128, kHkv = 2;
  QuantConfig int2;
  int2.block_tokens = 16;
  int2.demotion_batch = 16;
  QuantConfig bypass = int2;
  bypass.method = QuantMethod::kBypass;
  ASSERT_TRUE(int2.Validate(kD).ok());
  ASSERT_TRUE(bypass.Validate(kD).ok());
  const BlockLayout int2_layout = BlockLayout::ForModel(int2, kHkv, kD);
  const BlockLayout bf16_layout = BlockLayout::ForModel(bypass, kHkv, kD);
  const BatchPlan plan = MakePlan(16, 7, /*long_batch=*/true);
  const int rows = plan.row_offsets.back();
  const size_t values = static_cast<size_t>(rows) * kHkv * kD;
  DeviceArray<int32_t> d_offsets(plan.row_offsets.size());
  DeviceArray<int32_t> d_first(plan.first_token.size());
  DeviceArray<int32_t> d_tables(plan.block_tables.size());
  DeviceArray<uint16_t> d_k(values), d_v(values);
  DeviceArray<float> d_rot_k(kD * kD), d_rot_v(kD * kD);
  DeviceArray<uint32_t> d_err(1);
  CUDA_ASSERT(d_offsets.Upload(plan.row_offsets));
  CUDA_ASSERT(d_first.Upload(plan.first_token));
  CUDA_ASSERT(d_tables.Upload(plan.block_tables));
  CUDA_ASSERT(cudaMemset(d_err.get(), 0, sizeof(uint32_t)));
  for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
    const std::vector<Bf16> input =
        testing::ToBf16(testing::RealLikeRows(rows * kHkv, kD, t == KvTensor::kKey ? 21 : 22));
    std::vector<uint16_t> bits(input.size());
    for (size_t i = 0; i < input.size(); ++i) bits[i] = input[i].bits;
    CUDA_ASSERT((t == KvTensor::kKey ? d_k : d_v).Upload(bits));
    auto set = RotationSet::RandomizedHadamard(1, kD, t == KvTensor::kKey ? 31 : 32);
    ASSERT_TRUE(set.ok()) << set.status();
    CUDA_ASSERT((t == KvTensor::kKey ? d_rot_k : d_rot_v).Upload(set->Matrix(0, t)));
  }
  const SequenceBatch batch{static_cast<int>(plan.first_token.size()),
                            d_offsets.get(),
                            d_first.get(),
                            d_tables.get(),
                            plan.stride,
                            rows};
  // Two pool pairs: [INT2, BF16] written by the fused call and by the per-job calls.
  std::vector<std::unique_ptr<DeviceArray<uint8_t>>> pools;
  for (int i = 0; i < 4; ++i) {
    const BlockLayout& l = i % 2 == 0 ? int2_layout : bf16_layout;
    pools.push_back(std::make_unique<DeviceArray<uint8_t>>(plan.num_blocks * l.block_bytes()));
    CUDA_ASSERT(cudaMemset(pools.back()->get(), 0xa5, pools.back()->size()));
  }
  auto jobs_for = [&](int pair) {
    std::vector<ArrivalJob> jobs;
    for (int kind = 0; kind < 2; ++kind) {
      for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
        ArrivalJob j;
        j.cfg = kind == 0 ? int2 : bypass;
        j.kv = PagedKvView{pools[2 * pair + kind]->get(), kind == 0 ? int2_layout : bf16_layout,
                           ScaleDtype::kFp16, plan.num_blocks};
        j.batch = batch;
        j.tensor = t;
        j.in.rows = t == KvTensor::kKey ? d_k.get() : d_v.get();
        j.in.rotation = t == KvTensor::kKey ? d_rot_k.get() : d_rot_v.get();
        jobs.push_back(j);
      }
    }
    return jobs;
  };
  ASSERT_TRUE(QuantizeOnArrivalJobs(jobs_for(0), d_err.get(), nullptr).ok());
  ASSERT_TRUE(TakeCodecErrors(d_err.get(), nullptr).ok());
  for (const ArrivalJob& j : jobs_for(1)) {
    ASSERT_TRUE(QuantizeOnArrival(j.cfg, j.kv, j.batch, j.tensor, j.in, d_err.get(), nullptr).ok());
  }
  ASSERT_TRUE(TakeCodecErrors(d_err.get(), nullptr).ok());
  for (int kind = 0; kind < 2; ++kind) {
    const std::vector<uint8_t> fused = pools[kind]->Download();
    const std::vector<uint8_t> single = pools[2 + kind]->Download();
    ASSERT_EQ(fused.size(), single.size());
    size_t written = 0;
    for (size_t i = 0; i < fused.size(); ++i) {
      ASSERT_EQ(fused[i], single[i]) << (kind == 0 ? "INT2" : "BF16") << " pool byte " << i;
      written += single[i] != 0xa5;
    }
    EXPECT_GT(written, fused.size() / 8) << "the jobs wrote their pools";
  }
  // A bad job fails the call before anything launches.
  std::vector<ArrivalJob> bad = jobs_for(0);
  bad[3].in.rows = nullptr;
  CUDA_ASSERT(cudaMemset(pools[0]->get(), 0xa5, pools[0]->size()));
  EXPECT_EQ(QuantizeOnArrivalJobs(bad, d_err.get(), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  CUDA_ASSERT(cudaDeviceSynchronize());
  for (uint8_t b : pools[0]->Download()) ASSERT_EQ(b, 0xa5) << "nothing written";
}

// DemoteToHistory (K and V of every sequence in one call, read straight from BF16 pages) writes
// exactly what QuantizeOnArrival writes from the same rows as flat input with the identity
// rotation (checked against the CPU codec above), for the tensor-core kernel (INT2, G = D) and
// the warp-per-row kernel (smaller groups, INT4); source and destination slots differ (other
// first tokens, other blocks).
TEST_F(CudaCodecTest, DemotionFromBf16PagesEqualsArrivalOfTheSameRows) {
  struct DemotionCase {
    int d, kv_heads, bits, group;
    ScaleDtype scale;
  };
  for (const DemotionCase& c :
       {DemotionCase{128, 2, 2, 0, ScaleDtype::kFp16}, DemotionCase{64, 3, 2, 0, ScaleDtype::kBf16},
        DemotionCase{64, 2, 2, 16, ScaleDtype::kFp16},
        DemotionCase{128, 1, 4, 32, ScaleDtype::kFp16}}) {
    SCOPED_TRACE(absl::StrCat("D", c.d, " H", c.kv_heads, " b", c.bits, " G", c.group));
    QuantConfig cfg;
    cfg.bits = c.bits;
    cfg.group_size = c.group;
    cfg.scale_dtype = c.scale;
    cfg.block_tokens = 16;
    cfg.demotion_batch = 16;
    QuantConfig bypass = cfg;
    bypass.method = QuantMethod::kBypass;
    ASSERT_TRUE(cfg.Validate(c.d).ok());
    ASSERT_TRUE(bypass.Validate(c.d).ok());
    const BlockLayout hist_layout = BlockLayout::ForModel(cfg, c.kv_heads, c.d);
    const BlockLayout bf16_layout = BlockLayout::ForModel(bypass, c.kv_heads, c.d);
    const BatchPlan src_plan = MakePlan(16, 41, /*long_batch=*/true);
    const BatchPlan dst_plan = MakePlan(16, 42, /*long_batch=*/true, /*first_shift=*/3);
    DevicePlan src(src_plan), dst(dst_plan);
    ASSERT_TRUE(src.ok && dst.ok);
    const int rows = src_plan.row_offsets.back();
    const size_t values = static_cast<size_t>(rows) * c.kv_heads * c.d;
    DeviceArray<uint16_t> d_k(values), d_v(values);
    DeviceArray<uint8_t> pages(src_plan.num_blocks * bf16_layout.block_bytes());
    DeviceArray<uint8_t> demoted(dst_plan.num_blocks * hist_layout.block_bytes());
    DeviceArray<uint8_t> direct(dst_plan.num_blocks * hist_layout.block_bytes());
    DeviceArray<uint32_t> d_err(1);
    CUDA_ASSERT(cudaMemset(d_err.get(), 0, sizeof(uint32_t)));
    CUDA_ASSERT(cudaMemset(demoted.get(), 0xa5, demoted.size()));
    CUDA_ASSERT(cudaMemset(direct.get(), 0xa5, direct.size()));
    const PagedKvView page_view{pages.get(), bf16_layout, c.scale, src_plan.num_blocks};
    const PagedKvView demoted_view{demoted.get(), hist_layout, c.scale, dst_plan.num_blocks};
    const PagedKvView direct_view{direct.get(), hist_layout, c.scale, dst_plan.num_blocks};
    for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
      const std::vector<Bf16> input =
          testing::ToBf16(testing::RealLikeRows(rows * c.kv_heads, c.d, 50 + static_cast<int>(t)));
      std::vector<uint16_t> bits(input.size());
      for (size_t i = 0; i < input.size(); ++i) bits[i] = input[i].bits;
      DeviceArray<uint16_t>& flat = t == KvTensor::kKey ? d_k : d_v;
      CUDA_ASSERT(flat.Upload(bits));
      // The recent window's pages hold the (rotated) rows as they are.
      ASSERT_TRUE(QuantizeOnArrival(bypass, page_view, src.batch, t, ArrivalRows{flat.get()},
                                    d_err.get(), nullptr)
                      .ok());
      ASSERT_TRUE(QuantizeOnArrival(cfg, direct_view, dst.batch, t, ArrivalRows{flat.get()},
                                    d_err.get(), nullptr)
                      .ok());
    }
    ASSERT_TRUE(TakeCodecErrors(d_err.get(), nullptr).ok());
    PagedRows from{page_view, src.first.get(), src.tables.get(), src_plan.stride};
    DeviceArray<uint32_t> d_sums(dst_plan.block_tables.size());
    CUDA_ASSERT(cudaMemset(d_sums.get(), 0, d_sums.size() * sizeof(uint32_t)));
    ASSERT_TRUE(
        DemoteToHistory(cfg, demoted_view, dst.batch, from, d_err.get(), nullptr, {}, d_sums.get())
            .ok());
    const absl::Status demotion = TakeCodecErrors(d_err.get(), nullptr);
    ASSERT_TRUE(demotion.ok()) << demotion;
    const std::vector<uint8_t> got = demoted.Download();
    // The checksums fused into the demotion equal the CPU's of the history slots written.
    EXPECT_EQ(d_sums.Download(), CpuPageChecksums(dst_plan, got, hist_layout));
    const std::vector<uint8_t> want = direct.Download();
    ASSERT_EQ(got.size(), want.size());
    size_t written = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i], want[i]) << "history byte " << i;
      written += want[i] != 0xa5;
    }
    EXPECT_GT(written, got.size() / 8) << "the demotion wrote the history blocks";

    // Bad input: rejected before anything launches, nothing written.
    CUDA_ASSERT(cudaMemset(demoted.get(), 0xa5, demoted.size()));
    PagedRows wrong_layout = from;
    wrong_layout.kv = PagedKvView{pages.get(), hist_layout, c.scale, src_plan.num_blocks};
    EXPECT_EQ(
        DemoteToHistory(cfg, demoted_view, dst.batch, wrong_layout, d_err.get(), nullptr).code(),
        absl::StatusCode::kInvalidArgument);
    PagedRows no_tables = from;
    no_tables.block_tables = nullptr;
    EXPECT_EQ(DemoteToHistory(cfg, demoted_view, dst.batch, no_tables, d_err.get(), nullptr).code(),
              absl::StatusCode::kInvalidArgument);
    ArrivalRows both{d_k.get()};
    both.paged = &from;
    EXPECT_EQ(
        QuantizeOnArrival(cfg, demoted_view, dst.batch, KvTensor::kKey, both, d_err.get(), nullptr)
            .code(),
        absl::StatusCode::kInvalidArgument);
    CUDA_ASSERT(cudaDeviceSynchronize());
    for (uint8_t b : demoted.Download()) ASSERT_EQ(b, 0xa5) << "nothing written";

    // A source block id outside its pool: OutOfRange, and the other rows are still demoted.
    std::vector<int32_t> bad_tables = src_plan.block_tables;
    bad_tables[0] = static_cast<int32_t>(src_plan.num_blocks);
    DeviceArray<int32_t> d_bad(bad_tables.size());
    CUDA_ASSERT(d_bad.Upload(bad_tables));
    PagedRows bad_block = from;
    bad_block.block_tables = d_bad.get();
    ASSERT_TRUE(
        DemoteToHistory(cfg, demoted_view, dst.batch, bad_block, d_err.get(), nullptr).ok());
    EXPECT_EQ(TakeCodecErrors(d_err.get(), nullptr).code(), absl::StatusCode::kOutOfRange);
    const std::vector<uint8_t> partial = demoted.Download();
    size_t same = 0;
    for (size_t i = 0; i < partial.size(); ++i) same += partial[i] == want[i];
    EXPECT_GT(same, partial.size() * 9 / 10) << "rows of valid blocks were demoted";
  }
}

TEST_F(CudaCodecTest, SignedZeroTiesMatchCpu) {
  RunCase({128, 2, 2, 0, ScaleDtype::kFp16, QuantMethod::kUniform, false, true});
  RunCase({64, 2, 2, 16, ScaleDtype::kBf16, QuantMethod::kUniform, false, true});
}

// One sequence, one block, for the error paths.
class CudaCodecErrorTest : public CudaCodecTest {
 protected:
  absl::Status Quantize(const QuantConfig& cfg, const std::vector<float>& values, int block_id) {
    const int d = 64;
    const BlockLayout layout = BlockLayout::ForModel(cfg, 1, d);
    const int rows = static_cast<int>(values.size()) / d;
    DeviceArray<uint8_t> pool(2 * layout.block_bytes());
    DeviceArray<int32_t> offsets(2), first(1), table(1);
    DeviceArray<uint16_t> in(values.size());
    DeviceArray<uint32_t> err(1);
    std::vector<uint16_t> bits(values.size());
    for (size_t i = 0; i < values.size(); ++i) bits[i] = Bf16::FromFloat(values[i]).bits;
    if (in.Upload(bits) != cudaSuccess || offsets.Upload({0, rows}) != cudaSuccess ||
        first.Upload({0}) != cudaSuccess || table.Upload({block_id}) != cudaSuccess ||
        cudaMemset(err.get(), 0, 4) != cudaSuccess) {
      return absl::InternalError("setup");
    }
    const PagedKvView kv{pool.get(), layout, cfg.scale_dtype, 2};
    const SequenceBatch batch{1, offsets.get(), first.get(), table.get(), 1, rows};
    const absl::Status launch =
        QuantizeOnArrival(cfg, kv, batch, KvTensor::kKey, ArrivalRows{in.get(), nullptr, nullptr},
                          err.get(), nullptr);
    if (!launch.ok()) return launch;
    return TakeCodecErrors(err.get(), nullptr);
  }
};

TEST_F(CudaCodecErrorTest, NonFiniteRowIsInvalidArgument) {
  QuantConfig cfg;
  std::vector<float> v = testing::GaussianValues(2 * 64, 3);
  EXPECT_TRUE(Quantize(cfg, v, 0).ok());
  v[70] = std::nanf("");
  EXPECT_EQ(Quantize(cfg, v, 0).code(), absl::StatusCode::kInvalidArgument);
  v[70] = INFINITY;
  EXPECT_EQ(Quantize(cfg, v, 0).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CudaCodecErrorTest, ValuesOutOfRangeAndScaleOverflowAreOutOfRange) {
  // |x| >= 2^16 is outside kvpool's range (kernels/value_range.h) for every format, as on the
  // CPU, on both arrival kernels (the bypass and uniform INT2 rows take the MMA kernel, INT4 and
  // Lloyd-Max the row kernel).
  std::vector<float> v = testing::GaussianValues(64, 4);
  v[3] = -1e6f;
  for (QuantMethod method : {QuantMethod::kUniform, QuantMethod::kBypass}) {
    for (ScaleDtype dtype : {ScaleDtype::kFp16, ScaleDtype::kBf16}) {
      QuantConfig cfg;
      cfg.clip_ratio_k = 0;
      cfg.method = method;
      cfg.scale_dtype = dtype;
      EXPECT_EQ(Quantize(cfg, v, 0).code(), absl::StatusCode::kOutOfRange)
          << QuantMethodName(method) << " " << ScaleDtypeName(dtype);
    }
  }
  QuantConfig int4;
  int4.bits = 4;
  EXPECT_EQ(Quantize(int4, v, 0).code(), absl::StatusCode::kOutOfRange);
  // In range, but Lloyd-Max's step (1.16 x ~sigma) is beyond fp16: the scale overflows.
  std::vector<float> w(64);
  for (int j = 0; j < 64; ++j) w[j] = (j % 2 == 0 ? 1.0f : -1.0f) * 65000.0f;
  QuantConfig lloyd;
  lloyd.method = QuantMethod::kLloydMax;
  EXPECT_EQ(Quantize(lloyd, w, 0).code(), absl::StatusCode::kOutOfRange);
  lloyd.scale_dtype = ScaleDtype::kBf16;
  EXPECT_TRUE(Quantize(lloyd, w, 0).ok());
}

TEST_F(CudaCodecErrorTest, BadBlockIdIsOutOfRange) {
  QuantConfig cfg;
  const std::vector<float> v = testing::GaussianValues(64, 5);
  EXPECT_EQ(Quantize(cfg, v, 2).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(Quantize(cfg, v, -1).code(), absl::StatusCode::kOutOfRange);
}

}  // namespace
}  // namespace kvpool::cuda
