// PagedDecodeAttention (the CPU decode step of kvpoold and of the C API) against a float64
// reference on the same stored data: GQA groups, INT2 uniform and Lloyd-Max, INT4, the BF16
// bypass, BF16 scales, tiers that start part way into a block, empty tiers and rows; the
// RotationSet path equals the dense-matrix path; every rejected batch leaves out and lse as
// they were.
#include "kernels/paged_attention.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/capi/attention_batch_test_util.h"
#include "kernels/rotation.h"
#include "kernels/row_codec.h"

namespace kvpool {
namespace {

using testing::BatchSpec;
using testing::TestBatch;

struct Result {
  absl::Status status;
  std::vector<float> out, lse;
};

// Runs the batch with outputs poisoned by `fill` beforehand.
Result Attend(TestBatch& b, const PagedAttentionRotation& rotation, PagedKvBatch batch,
              float fill = std::numeric_limits<float>::quiet_NaN()) {
  auto codec = RowCodec::Create(b.cfg, b.spec.head_dim);
  EXPECT_TRUE(codec.ok());
  const PagedAttentionModel model{{b.spec.q_heads, b.spec.kv_heads, b.spec.head_dim}, &*codec};
  Result r;
  r.out.assign(b.queries.size(), fill);
  r.lse.assign(b.queries.size() / b.spec.head_dim, fill);
  r.status =
      PagedDecodeAttention(model, batch, rotation, {b.queries.data(), r.out.data(), r.lse.data()});
  return r;
}

PagedAttentionRotation Matrices(const TestBatch& b) {
  PagedAttentionRotation r;
  r.k = b.rotation_k();
  r.v = b.rotation_v();
  return r;
}

TEST(PagedDecodeAttentionTest, MatchesFloat64ReferenceAcrossCodecs) {
  struct Case {
    int q_heads, kv_heads, head_dim, bits;
    QuantMethod method;
    ScaleDtype scale;
    int block_tokens;
  };
  const Case cases[] = {
      {8, 2, 64, 2, QuantMethod::kUniform, ScaleDtype::kFp16, 16},
      {12, 3, 128, 2, QuantMethod::kLloydMax, ScaleDtype::kFp16, 16},
      {4, 4, 64, 4, QuantMethod::kUniform, ScaleDtype::kBf16, 8},
      {16, 2, 32, 2, QuantMethod::kBypass, ScaleDtype::kFp16, 32},
  };
  for (const Case& c : cases) {
    BatchSpec spec;
    spec.q_heads = c.q_heads;
    spec.kv_heads = c.kv_heads;
    spec.head_dim = c.head_dim;
    spec.bits = c.bits;
    spec.method = c.method;
    spec.scale_dtype = c.scale;
    spec.block_tokens = c.block_tokens;
    spec.seqs = {{16, 70, 9}, {0, 0, 0}, {3, 0, 40}, {0, 33, 0}, {8, 129, 17}};
    spec.seed = static_cast<uint64_t>(c.head_dim * 10 + c.bits);
    TestBatch b = TestBatch::Build(spec);
    const Result r = Attend(b, Matrices(b), b.Batch());
    ASSERT_TRUE(r.status.ok()) << r.status;
    SCOPED_TRACE(::testing::Message() << "D " << c.head_dim << " bits " << c.bits);
    ExpectNearReference(b, r.out, r.lse);
  }
}

TEST(PagedDecodeAttentionTest, IdentityWhenNoMatrices) {
  BatchSpec spec;
  spec.rotate = false;
  spec.seqs = {{5, 20, 3}, {0, 17, 0}};
  TestBatch b = TestBatch::Build(spec);
  const Result r = Attend(b, PagedAttentionRotation{}, b.Batch());
  ASSERT_TRUE(r.status.ok()) << r.status;
  ExpectNearReference(b, r.out, r.lse);
}

TEST(PagedDecodeAttentionTest, RotationSetPathEqualsMatrixPath) {
  BatchSpec spec;
  spec.seqs = {{16, 48, 5}, {2, 3, 1}};
  TestBatch b = TestBatch::Build(spec);
  auto set = RotationSet::Dense(1, spec.head_dim, {b.mk}, {b.mv});
  ASSERT_TRUE(set.ok()) << set.status();
  PagedAttentionRotation by_set;
  by_set.set = &*set;
  by_set.layer = 0;
  const Result a = Attend(b, by_set, b.Batch());
  const Result m = Attend(b, Matrices(b), b.Batch());
  ASSERT_TRUE(a.status.ok() && m.status.ok());
  EXPECT_EQ(std::memcmp(a.out.data(), m.out.data(), a.out.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(a.lse.data(), m.lse.data(), a.lse.size() * sizeof(float)), 0);

  by_set.layer = 1;  // the set has one layer
  EXPECT_EQ(Attend(b, by_set, b.Batch()).status.code(), absl::StatusCode::kInvalidArgument);
}

// Every rejection: InvalidArgument, and out / lse keep their poison.
void ExpectRejected(TestBatch& b, const PagedKvBatch& batch, const char* what) {
  const Result r = Attend(b, Matrices(b), batch, 7.0f);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << what << ": " << r.status;
  for (float x : r.out) ASSERT_EQ(x, 7.0f) << what;
  for (float x : r.lse) ASSERT_EQ(x, 7.0f) << what;
}

TEST(PagedDecodeAttentionTest, RejectsBadBatchesWithoutWriting) {
  BatchSpec spec;
  spec.seqs = {{16, 40, 9}, {4, 20, 3}};
  TestBatch b = TestBatch::Build(spec);
  ASSERT_TRUE(Attend(b, Matrices(b), b.Batch()).status.ok());

  const int32_t history_id = b.history.tables[b.history.stride + 1];
  b.history.tables[b.history.stride + 1] = static_cast<int32_t>(b.history_blocks);
  ExpectRejected(b, b.Batch(), "history block id == num_blocks");
  b.history.tables[b.history.stride + 1] = -1;
  ExpectRejected(b, b.Batch(), "negative history block id");
  b.history.tables[b.history.stride + 1] = history_id;

  const int32_t recent_id = b.recent.tables[0];
  b.recent.tables[0] = static_cast<int32_t>(b.bf16_blocks + 5);
  ExpectRejected(b, b.Batch(), "recent block id past the pool");
  b.recent.tables[0] = recent_id;

  b.sink.count[1] = -1;
  ExpectRejected(b, b.Batch(), "negative count");
  b.sink.count[1] = 4;
  b.recent.first[0] = -3;
  ExpectRejected(b, b.Batch(), "negative first token");
  b.recent.first[0] = 1;

  {
    PagedKvBatch batch = b.Batch();
    batch.history.block_table_stride = 1;  // 40 tokens need 3 or 4 blocks
    ExpectRejected(b, batch, "tokens beyond the table row");
  }
  {
    PagedKvBatch batch = b.Batch();
    batch.max_history_tokens = 39;
    ExpectRejected(b, batch, "history count above its bound");
    batch = b.Batch();
    batch.max_bf16_tokens = 24;
    ExpectRejected(b, batch, "sink + recent above their bound");
  }
  {
    PagedKvBatch batch = b.Batch();
    batch.history_pool.layout.bits = 4;
    ExpectRejected(b, batch, "history layout of another codec");
    batch = b.Batch();
    batch.bf16_pool.layout.kv_heads = 1;
    ExpectRejected(b, batch, "BF16 layout of another model");
    batch = b.Batch();
    batch.recent.num_tokens = nullptr;
    ExpectRejected(b, batch, "null counts");
    batch = b.Batch();
    batch.history_pool.pool = nullptr;
    ExpectRejected(b, batch, "null pool with tokens");
    batch = b.Batch();
    batch.num_seqs = -1;
    ExpectRejected(b, batch, "negative num_seqs");
  }
  {
    auto codec = RowCodec::Create(b.cfg, b.spec.head_dim);
    ASSERT_TRUE(codec.ok());
    std::vector<float> out(b.queries.size(), 7.0f);
    EXPECT_EQ(PagedDecodeAttention({{8, 3, 64}, &*codec}, b.Batch(), {},
                                   {b.queries.data(), out.data(), out.data()})
                  .code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(PagedDecodeAttention({{8, 2, 64}, &*codec}, b.Batch(), {},
                                   {b.queries.data(), nullptr, out.data()})
                  .code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(PagedDecodeAttention({{8, 2, 64}, nullptr}, b.Batch(), {},
                                   {b.queries.data(), out.data(), out.data()})
                  .code(),
              absl::StatusCode::kInvalidArgument);
    for (float x : out) ASSERT_EQ(x, 7.0f);
  }
}

}  // namespace
}  // namespace kvpool
