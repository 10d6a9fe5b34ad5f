// The C API's host path, through libkvpool_attention.so: equal bit for bit to
// kernels/paged_attention (the function kvpoold's CPU backend runs) and near a float64 reference
// on random batches made with kvpool's codec; every bad descriptor, io or block table answers
// its code and message and writes nothing; the device path answers UNAVAILABLE where it cannot
// run; errors are per thread.
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/capi/attention_batch_test_util.h"
#include "kernels/capi/kvpool_attention.h"
#include "kernels/paged_attention.h"
#include "kernels/row_codec.h"

namespace kvpool {
namespace {

using testing::BatchSpec;
using testing::TestBatch;

struct Outputs {
  std::vector<float> out, lse;
};

Outputs Poisoned(const TestBatch& b, float fill) {
  Outputs o;
  o.out.assign(b.queries.size(), fill);
  o.lse.assign(b.queries.size() / b.spec.head_dim, fill);
  return o;
}

kvpool_attention_io IoFor(const TestBatch& b, Outputs& o) {
  kvpool_attention_io io;
  kvpool_attention_io_init(&io);
  io.queries = b.queries.data();
  io.rotation_k = b.rotation_k();
  io.rotation_v = b.rotation_v();
  io.out = o.out.data();
  io.lse = o.lse.data();
  return io;
}

// kernels/paged_attention on the same batch, rotations and queries.
Outputs Direct(TestBatch& b) {
  auto codec = RowCodec::Create(b.cfg, b.spec.head_dim);
  EXPECT_TRUE(codec.ok());
  Outputs o = Poisoned(b, std::numeric_limits<float>::quiet_NaN());
  PagedAttentionRotation rotation;
  rotation.k = b.rotation_k();
  rotation.v = b.rotation_v();
  const absl::Status s =
      PagedDecodeAttention({{b.spec.q_heads, b.spec.kv_heads, b.spec.head_dim}, &*codec}, b.Batch(),
                           rotation, {b.queries.data(), o.out.data(), o.lse.data()});
  EXPECT_TRUE(s.ok()) << s;
  return o;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(AttentionCApiTest, VersionAndBuild) {
  EXPECT_EQ(kvpool_attention_version(), KVPOOL_ATTENTION_VERSION);
  const int32_t cuda = kvpool_attention_has_cuda();
  EXPECT_TRUE(cuda == 0 || cuda == 1);
}

TEST(AttentionCApiTest, HostPathEqualsPagedAttentionBitForBitAndTheReference) {
  struct Case {
    int q_heads, kv_heads, head_dim, bits;
    QuantMethod method;
    ScaleDtype scale;
    bool rotate;
  };
  const Case cases[] = {
      {64, 8, 128, 2, QuantMethod::kUniform, ScaleDtype::kFp16, true},  // 70B-class heads
      {9, 3, 64, 2, QuantMethod::kUniform, ScaleDtype::kFp16, true},    // SmolLM2-135M heads
      {8, 2, 64, 2, QuantMethod::kLloydMax, ScaleDtype::kBf16, true},
      {4, 1, 128, 4, QuantMethod::kUniform, ScaleDtype::kFp16, false},
  };
  for (const Case& c : cases) {
    BatchSpec spec;
    spec.q_heads = c.q_heads;
    spec.kv_heads = c.kv_heads;
    spec.head_dim = c.head_dim;
    spec.bits = c.bits;
    spec.method = c.method;
    spec.scale_dtype = c.scale;
    spec.rotate = c.rotate;
    spec.seqs = {{64, 300, 17}, {0, 0, 1}, {16, 31, 256}, {0, 0, 0}, {5, 1, 0}};
    spec.seed = static_cast<uint64_t>(c.q_heads * 7 + c.bits);
    SCOPED_TRACE(::testing::Message() << "Hq " << c.q_heads << " D " << c.head_dim);
    TestBatch b = TestBatch::Build(spec);
    const kvpool_attention_desc desc = b.Desc(b.HostPointers());

    uint64_t bytes = 99;
    ASSERT_EQ(kvpool_attention_workspace_bytes(&desc, &bytes), KVPOOL_ATTENTION_OK);
    EXPECT_EQ(bytes, 0u);  // the host path needs none

    Outputs got = Poisoned(b, std::numeric_limits<float>::quiet_NaN());
    const kvpool_attention_io io = IoFor(b, got);
    ASSERT_EQ(kvpool_attention_decode(&desc, &io), KVPOOL_ATTENTION_OK)
        << kvpool_attention_last_error();
    EXPECT_STREQ(kvpool_attention_last_error(), "");
    const Outputs want = Direct(b);
    EXPECT_TRUE(SameBits(got.out, want.out));
    EXPECT_TRUE(SameBits(got.lse, want.lse));

    ExpectNearReference(b, got.out, got.lse);
  }
}

// Pools whose block ids step by block_stride bytes (kvpoold's slab arena) read the same blocks.
TEST(AttentionCApiTest, BlockStrideAddressesTheSameBlocks) {
  BatchSpec spec;
  spec.seqs = {{16, 50, 9}, {3, 17, 30}};
  TestBatch b = TestBatch::Build(spec);
  const kvpool_attention_desc dense = b.Desc(b.HostPointers());
  Outputs want = Poisoned(b, 0.0f);
  kvpool_attention_io io = IoFor(b, want);
  ASSERT_EQ(kvpool_attention_decode(&dense, &io), KVPOOL_ATTENTION_OK);

  // Every block moved to id * stride, stride = 3 blocks rounded up to 16 bytes; gaps poisoned.
  const size_t history_bytes = b.history_layout.block_bytes();
  const size_t bf16_bytes = b.bf16_layout.block_bytes();
  const int64_t history_stride = static_cast<int64_t>(3 * history_bytes + 15) / 16 * 16;
  const int64_t bf16_stride = static_cast<int64_t>(3 * bf16_bytes + 15) / 16 * 16;
  std::vector<uint8_t> history(b.history_blocks * history_stride, 0xff);
  std::vector<uint8_t> bf16(b.bf16_blocks * bf16_stride, 0xff);
  for (int64_t i = 0; i < b.history_blocks; ++i) {
    std::memcpy(history.data() + i * history_stride, b.history_pool.data() + i * history_bytes,
                history_bytes);
  }
  for (int64_t i = 0; i < b.bf16_blocks; ++i) {
    std::memcpy(bf16.data() + i * bf16_stride, b.bf16_pool.data() + i * bf16_bytes, bf16_bytes);
  }
  kvpool_attention_desc strided = dense;
  strided.history_pool = {history.data(), b.history_blocks, history_stride};
  strided.bf16_pool = {bf16.data(), b.bf16_blocks, bf16_stride};
  Outputs got = Poisoned(b, 0.0f);
  io = IoFor(b, got);
  ASSERT_EQ(kvpool_attention_decode(&strided, &io), KVPOOL_ATTENTION_OK)
      << kvpool_attention_last_error();
  EXPECT_TRUE(SameBits(got.out, want.out));
  EXPECT_TRUE(SameBits(got.lse, want.lse));
}

class AttentionCApiErrorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    BatchSpec spec;
    spec.seqs = {{16, 40, 9}, {4, 20, 3}};
    batch_ = TestBatch::Build(spec);
    desc_ = batch_.Desc(batch_.HostPointers());
    outputs_ = Poisoned(batch_, 7.0f);
    io_ = IoFor(batch_, outputs_);
  }

  // `desc` / `io` fail with `code`, a message, and leave the outputs as they were.
  void ExpectFails(const kvpool_attention_desc* desc, const kvpool_attention_io* io, int32_t code,
                   const char* what) {
    EXPECT_EQ(kvpool_attention_decode(desc, io), code) << what;
    EXPECT_STRNE(kvpool_attention_last_error(), "") << what;
    for (float x : outputs_.out) ASSERT_EQ(x, 7.0f) << what;
    for (float x : outputs_.lse) ASSERT_EQ(x, 7.0f) << what;
  }
  void ExpectInvalid(const kvpool_attention_desc& desc, const char* what) {
    ExpectFails(&desc, &io_, KVPOOL_ATTENTION_INVALID_ARGUMENT, what);
    uint64_t bytes = 0;
    if (std::string(what).find("[tables]") == std::string::npos) {
      // The descriptor's own values are checked by the workspace query too.
      EXPECT_EQ(kvpool_attention_workspace_bytes(&desc, &bytes), KVPOOL_ATTENTION_INVALID_ARGUMENT)
          << what;
    }
  }

  TestBatch batch_;
  kvpool_attention_desc desc_;
  Outputs outputs_;
  kvpool_attention_io io_;
};

TEST_F(AttentionCApiErrorsTest, BadDescriptorValues) {
  ExpectFails(nullptr, &io_, KVPOOL_ATTENTION_INVALID_ARGUMENT, "NULL desc");
  ExpectFails(&desc_, nullptr, KVPOOL_ATTENTION_INVALID_ARGUMENT, "NULL io");
  uint64_t bytes = 0;
  EXPECT_EQ(kvpool_attention_workspace_bytes(&desc_, nullptr), KVPOOL_ATTENTION_INVALID_ARGUMENT);
  EXPECT_EQ(kvpool_attention_workspace_bytes(nullptr, &bytes), KVPOOL_ATTENTION_INVALID_ARGUMENT);

  const auto with = [&](auto change) {
    kvpool_attention_desc d = desc_;
    change(d);
    return d;
  };
  ExpectInvalid(with([](auto& d) { d.struct_size = 8; }), "struct_size too small");
  ExpectInvalid(with([](auto& d) { d.q_heads = 9; }), "q_heads not a multiple of kv_heads");
  ExpectInvalid(with([](auto& d) { d.kv_heads = 0; }), "kv_heads 0");
  ExpectInvalid(with([](auto& d) { d.head_dim = 96; }), "head_dim 96");
  ExpectInvalid(with([](auto& d) { d.head_dim = -64; }), "negative head_dim");
  ExpectInvalid(with([](auto& d) { d.bits = 3; }), "bits 3");
  ExpectInvalid(with([](auto& d) { d.group_size = 48; }), "group size 48");
  ExpectInvalid(with([](auto& d) { d.quant_method = 7; }), "quant method 7");
  ExpectInvalid(with([](auto& d) { d.scale_dtype = 2; }), "scale dtype 2");
  ExpectInvalid(with([](auto& d) { d.block_tokens = 12; }), "block tokens 12");
  ExpectInvalid(with([](auto& d) { d.num_seqs = 0; }), "num_seqs 0");
  ExpectInvalid(with([](auto& d) { d.max_history_tokens = -1; }), "negative bound");
  ExpectInvalid(with([](auto& d) { d.device = -2; }), "device -2");
  ExpectInvalid(with([](auto& d) { d.history_pool.base = nullptr; }), "NULL history pool");
  ExpectInvalid(with([](auto& d) { d.bf16_pool.num_blocks = -1; }), "negative num_blocks");
  ExpectInvalid(with([](auto& d) { d.bf16_pool.block_stride = 40; }), "stride not 16k");
  ExpectInvalid(with([](auto& d) {
                  d.history_pool.base = static_cast<const char*>(d.history_pool.base) + 4;
                }),
                "misaligned pool");
  ExpectInvalid(with([](auto& d) { d.recent.num_tokens = nullptr; }), "NULL counts");
  ExpectInvalid(with([](auto& d) { d.sink.block_tables = nullptr; }), "NULL block table");
  ExpectInvalid(with([](auto& d) { d.history.block_table_stride = -1; }), "negative stride");
}

TEST_F(AttentionCApiErrorsTest, BadBlockTablesAreCaughtOnTheHost) {
  TestBatch& b = batch_;
  b.history.tables[b.history.stride + 1] = static_cast<int32_t>(b.history_blocks);
  ExpectInvalid(desc_, "[tables] history block id == num_blocks");
  b.history.tables[b.history.stride + 1] = 0;
  b.sink.tables[0] = -5;
  ExpectInvalid(desc_, "[tables] negative sink block id");
  b.sink.tables[0] = 0;
  b.recent.count[1] = -1;
  ExpectInvalid(desc_, "[tables] negative count");
  b.recent.count[1] = 3;
  b.history.count[0] = 41;
  ExpectInvalid(desc_, "[tables] count above the history bound");
  b.history.count[0] = 40;
  kvpool_attention_desc short_rows = desc_;
  short_rows.history.block_table_stride = 1;
  ExpectInvalid(short_rows, "[tables] tokens beyond the table row");
  // The fixed batch runs again.
  EXPECT_EQ(kvpool_attention_decode(&desc_, &io_), KVPOOL_ATTENTION_OK)
      << kvpool_attention_last_error();
}

TEST_F(AttentionCApiErrorsTest, BadIo) {
  for (int which = 0; which < 3; ++which) {
    kvpool_attention_io io = io_;
    if (which == 0) io.queries = nullptr;
    if (which == 1) io.out = nullptr;
    if (which == 2) io.lse = nullptr;
    ExpectFails(&desc_, &io, KVPOOL_ATTENTION_INVALID_ARGUMENT, "NULL io buffer");
  }
  kvpool_attention_io io = io_;
  io.struct_size = 4;
  ExpectFails(&desc_, &io, KVPOOL_ATTENTION_INVALID_ARGUMENT, "io.struct_size too small");
}

TEST_F(AttentionCApiErrorsTest, LargerStructsOfALaterVersionAreRead) {
  struct {
    kvpool_attention_desc desc;
    int64_t later_field;
  } bigger{desc_, 0};
  bigger.desc.struct_size = sizeof(bigger);
  EXPECT_EQ(kvpool_attention_decode(&bigger.desc, &io_), KVPOOL_ATTENTION_OK)
      << kvpool_attention_last_error();
  EXPECT_NE(outputs_.lse[0], 7.0f);
}

TEST_F(AttentionCApiErrorsTest, DevicePathUnavailableWithoutTheDevice) {
  // No machine has device 1000; a build without CUDA has no device at all.
  kvpool_attention_desc d = desc_;
  d.device = kvpool_attention_has_cuda() ? 1000 : 0;
  uint64_t bytes = 0;
  EXPECT_EQ(kvpool_attention_workspace_bytes(&d, &bytes), KVPOOL_ATTENTION_UNAVAILABLE)
      << kvpool_attention_last_error();
  ExpectFails(&d, &io_, KVPOOL_ATTENTION_UNAVAILABLE, "no device");
}

TEST_F(AttentionCApiErrorsTest, LastErrorIsPerThread) {
  kvpool_attention_desc bad = desc_;
  bad.q_heads = 0;
  ASSERT_EQ(kvpool_attention_decode(&bad, &io_), KVPOOL_ATTENTION_INVALID_ARGUMENT);
  const std::string mine = kvpool_attention_last_error();
  std::string other = "unset";
  std::thread t([&] {
    other = kvpool_attention_last_error();  // this thread has made no call
    EXPECT_EQ(kvpool_attention_decode(&desc_, nullptr), KVPOOL_ATTENTION_INVALID_ARGUMENT);
  });
  t.join();
  EXPECT_EQ(other, "");
  EXPECT_EQ(kvpool_attention_last_error(), mine);
  // A success clears it.
  ASSERT_EQ(kvpool_attention_decode(&desc_, &io_), KVPOOL_ATTENTION_OK);
  EXPECT_STREQ(kvpool_attention_last_error(), "");
}

}  // namespace
}  // namespace kvpool
