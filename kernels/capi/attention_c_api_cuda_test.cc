// The C API's device path on a CUDA device, through libkvpool_attention.so: the same bits as
// kvpool::cuda::DecodeAttention on the same batch, workspace size and stream; near the C API's
// host path (within the GPU kernel's documented precision); host pointers, a short workspace and
// unsupported codecs answer their codes and write nothing; the caller's current device is kept.
// Skips without a device.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/capi/attention_batch_test_util.h"
#include "kernels/capi/kvpool_attention.h"
#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_codec.h"

namespace kvpool {
namespace {

using testing::BatchSpec;
using testing::TestBatch;

#define CUDA_ASSERT(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// Device memory freed on destruction.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (cudaMalloc(&ptr_, std::max<size_t>(bytes, 16)) != cudaSuccess) ptr_ = nullptr;
  }
  template <typename T>
  static DeviceBuffer Of(const std::vector<T>& v) {
    DeviceBuffer b(v.size() * sizeof(T));
    if (b.ptr_ != nullptr && !v.empty()) {
      cudaMemcpy(b.ptr_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
    }
    return b;
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  template <typename T>
  std::vector<T> Download() const {
    std::vector<T> v(bytes_ / sizeof(T));
    if (cudaMemcpy(v.data(), ptr_, bytes_, cudaMemcpyDeviceToHost) != cudaSuccess) v.clear();
    return v;
  }
  void Poison() { cudaMemset(ptr_, 0xff, bytes_); }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// A batch's arrays, queries and rotations on device 0.
struct DeviceBatch {
  explicit DeviceBatch(const TestBatch& b)
      : history_pool(DeviceBuffer::Of(b.history_pool)),
        bf16_pool(DeviceBuffer::Of(b.bf16_pool)),
        queries(DeviceBuffer::Of(b.queries)),
        mk(DeviceBuffer::Of(b.mk)),
        mv(DeviceBuffer::Of(b.mv)) {
    const TestBatch::Tier* tiers[3] = {&b.sink, &b.history, &b.recent};
    for (int t = 0; t < 3; ++t) {
      arrays.push_back(DeviceBuffer::Of(tiers[t]->tables));
      arrays.push_back(DeviceBuffer::Of(tiers[t]->first));
      arrays.push_back(DeviceBuffer::Of(tiers[t]->count));
    }
    pointers.history_pool = history_pool.as<void>();
    pointers.bf16_pool = bf16_pool.as<void>();
    for (int t = 0; t < 3; ++t) {
      for (int a = 0; a < 3; ++a) pointers.tier_arrays[t][a] = arrays[3 * t + a].as<int32_t>();
    }
  }
  // The same batch as kvpool's description (device arrays).
  PagedKvBatch Batch(TestBatch& b) const {
    PagedKvBatch batch = b.Batch();
    batch.history_pool.pool = history_pool.as<uint8_t>();
    batch.bf16_pool.pool = bf16_pool.as<uint8_t>();
    PagedKvTier* tiers[3] = {&batch.sink, &batch.history, &batch.recent};
    for (int t = 0; t < 3; ++t) {
      tiers[t]->block_tables = pointers.tier_arrays[t][0];
      tiers[t]->first_token = pointers.tier_arrays[t][1];
      tiers[t]->num_tokens = pointers.tier_arrays[t][2];
    }
    return batch;
  }

  DeviceBuffer history_pool, bf16_pool, queries, mk, mv;
  std::vector<DeviceBuffer> arrays;
  testing::BatchPointers pointers;
};

class AttentionCApiCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (kvpool_attention_has_cuda() == 0) GTEST_SKIP() << "library built without CUDA";
    if (cuda::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

BatchSpec Spec(int q_heads, int kv_heads, int head_dim, QuantMethod method, uint64_t seed) {
  BatchSpec spec;
  spec.q_heads = q_heads;
  spec.kv_heads = kv_heads;
  spec.head_dim = head_dim;
  spec.method = method;
  spec.seqs = {{64, 1000, 256}, {0, 0, 1}, {16, 77, 270}, {0, 0, 0}, {5, 4096, 3}, {64, 0, 0}};
  spec.seed = seed;
  return spec;
}

TEST_F(AttentionCApiCudaTest, DevicePathEqualsDecodeAttentionAndNearsTheHostPath) {
  const BatchSpec specs[] = {
      Spec(64, 8, 128, QuantMethod::kUniform, 11),  // 70B-class heads
      Spec(9, 3, 64, QuantMethod::kUniform, 12),    // SmolLM2-135M heads
      Spec(16, 1, 128, QuantMethod::kLloydMax, 13),
  };
  for (const BatchSpec& spec : specs) {
    SCOPED_TRACE(::testing::Message() << "Hq " << spec.q_heads << " D " << spec.head_dim);
    TestBatch b = TestBatch::Build(spec);
    DeviceBatch dev(b);
    const kvpool_attention_desc desc = b.Desc(dev.pointers, /*device=*/0);
    const size_t rows = b.queries.size() / spec.head_dim;

    uint64_t bytes = 0;
    ASSERT_EQ(kvpool_attention_workspace_bytes(&desc, &bytes), KVPOOL_ATTENTION_OK)
        << kvpool_attention_last_error();
    cuda::DecodeAttentionShape shape;
    shape.cfg = b.cfg;
    shape.q_heads = spec.q_heads;
    const PagedKvBatch batch = dev.Batch(b);
    auto direct_bytes = cuda::DecodeAttentionWorkspaceBytes(shape, batch);
    ASSERT_TRUE(direct_bytes.ok()) << direct_bytes.status();
    EXPECT_EQ(bytes, *direct_bytes);

    cudaStream_t stream = nullptr;
    CUDA_ASSERT(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    DeviceBuffer workspace(bytes), out(b.queries.size() * 4), lse(rows * 4);
    DeviceBuffer direct_workspace(bytes), direct_out(b.queries.size() * 4), direct_lse(rows * 4);
    for (DeviceBuffer* p : {&workspace, &out, &lse, &direct_workspace, &direct_out, &direct_lse}) {
      p->Poison();
    }
    kvpool_attention_io io;
    kvpool_attention_io_init(&io);
    io.queries = dev.queries.as<float>();
    io.rotation_k = dev.mk.as<float>();
    io.rotation_v = dev.mv.as<float>();
    io.out = out.as<float>();
    io.lse = lse.as<float>();
    io.workspace = workspace.as<void>();
    io.workspace_bytes = bytes;
    io.stream = stream;
    ASSERT_EQ(kvpool_attention_decode(&desc, &io), KVPOOL_ATTENTION_OK)
        << kvpool_attention_last_error();
    const cuda::DecodeIo dio{dev.queries.as<float>(), dev.mk.as<float>(), dev.mv.as<float>(),
                             direct_out.as<float>(), direct_lse.as<float>()};
    const absl::Status s =
        cuda::DecodeAttention(shape, batch, dio, direct_workspace.as<void>(), bytes, stream);
    ASSERT_TRUE(s.ok()) << s;
    CUDA_ASSERT(cudaStreamSynchronize(stream));
    CUDA_ASSERT(cudaStreamDestroy(stream));

    const std::vector<float> got_out = out.Download<float>();
    const std::vector<float> got_lse = lse.Download<float>();
    const std::vector<float> want_out = direct_out.Download<float>();
    const std::vector<float> want_lse = direct_lse.Download<float>();
    ASSERT_EQ(got_out.size(), want_out.size());
    EXPECT_EQ(std::memcmp(got_out.data(), want_out.data(), got_out.size() * 4), 0);
    EXPECT_EQ(std::memcmp(got_lse.data(), want_lse.data(), got_lse.size() * 4), 0);

    // The host path on the same batch (host arrays).
    const kvpool_attention_desc host_desc = b.Desc(b.HostPointers());
    std::vector<float> host_out(b.queries.size()), host_lse(rows);
    kvpool_attention_io host_io;
    kvpool_attention_io_init(&host_io);
    host_io.queries = b.queries.data();
    host_io.rotation_k = b.rotation_k();
    host_io.rotation_v = b.rotation_v();
    host_io.out = host_out.data();
    host_io.lse = host_lse.data();
    ASSERT_EQ(kvpool_attention_decode(&host_desc, &host_io), KVPOOL_ATTENTION_OK)
        << kvpool_attention_last_error();
    // cuda_attention.h: relative output error well under 1e-2; fp32-like logits and LSE.
    const int d = spec.head_dim;
    double worst = 0;
    for (size_t row = 0; row < rows; ++row) {
      if (std::isinf(host_lse[row])) {
        EXPECT_TRUE(std::isinf(got_lse[row]) && got_lse[row] < 0) << "row " << row;
        for (int j = 0; j < d; ++j) ASSERT_EQ(got_out[row * d + j], 0.0f) << "row " << row;
        continue;
      }
      EXPECT_NEAR(got_lse[row], host_lse[row], 1e-3 * std::max(1.0f, std::fabs(host_lse[row])))
          << "row " << row;
      double scale = 0;
      for (int j = 0; j < d; ++j) scale = std::max<double>(scale, std::fabs(host_out[row * d + j]));
      for (int j = 0; j < d; ++j) {
        const double err = std::fabs(got_out[row * d + j] - host_out[row * d + j]) / scale;
        worst = std::max(worst, err);
      }
    }
    EXPECT_LT(worst, 1e-2);
    std::printf("Hq %d D %d: device vs host worst relative output error %.2e\n", spec.q_heads, d,
                worst);
  }
}

TEST_F(AttentionCApiCudaTest, RejectionsWriteNothingAndKeepTheCurrentDevice) {
  TestBatch b = TestBatch::Build(Spec(8, 2, 128, QuantMethod::kUniform, 21));
  DeviceBatch dev(b);
  const kvpool_attention_desc desc = b.Desc(dev.pointers, /*device=*/0);
  uint64_t bytes = 0;
  ASSERT_EQ(kvpool_attention_workspace_bytes(&desc, &bytes), KVPOOL_ATTENTION_OK);
  const size_t rows = b.queries.size() / b.spec.head_dim;
  DeviceBuffer workspace(bytes), out(b.queries.size() * 4), lse(rows * 4);
  out.Poison();
  lse.Poison();
  kvpool_attention_io io;
  kvpool_attention_io_init(&io);
  io.queries = dev.queries.as<float>();
  io.out = out.as<float>();
  io.lse = lse.as<float>();
  io.workspace = workspace.as<void>();
  io.workspace_bytes = bytes;
  int before = -1;
  CUDA_ASSERT(cudaGetDevice(&before));

  kvpool_attention_io host_queries = io;
  host_queries.queries = b.queries.data();  // host memory on the device path
  EXPECT_EQ(kvpool_attention_decode(&desc, &host_queries), KVPOOL_ATTENTION_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvpool_attention_last_error()).find("queries"), std::string::npos)
      << kvpool_attention_last_error();

  kvpool_attention_desc host_pool = desc;
  host_pool.history_pool.base = b.history_pool.data();
  EXPECT_EQ(kvpool_attention_decode(&host_pool, &io), KVPOOL_ATTENTION_INVALID_ARGUMENT);

  kvpool_attention_io short_workspace = io;
  short_workspace.workspace_bytes = bytes - 1;
  EXPECT_EQ(kvpool_attention_decode(&desc, &short_workspace), KVPOOL_ATTENTION_FAILED_PRECONDITION);

  kvpool_attention_desc int4 = desc;
  int4.bits = 4;  // the GPU kernel reads 2-bit history only (the host path reads any)
  EXPECT_EQ(kvpool_attention_decode(&int4, &io), KVPOOL_ATTENTION_UNIMPLEMENTED);

  CUDA_ASSERT(cudaDeviceSynchronize());
  for (uint32_t w : out.Download<uint32_t>()) ASSERT_EQ(w, 0xffffffffu);
  for (uint32_t w : lse.Download<uint32_t>()) ASSERT_EQ(w, 0xffffffffu);
  int after = -1;
  CUDA_ASSERT(cudaGetDevice(&after));
  EXPECT_EQ(after, before);
}

}  // namespace
}  // namespace kvpool
