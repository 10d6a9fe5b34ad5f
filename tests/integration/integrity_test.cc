// Stored-page checksums against the real daemon: kvpoold-fault-injection (built with
// KVPOOL_FAULT_INJECTION) flips a bit of a stored page; ReadBlocks and ReadKv, and the scrubber,
// find it; exactly that sequence answers DATA_LOSS with reason CORRUPT until it is released.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kvpool/testing/fault_injection.grpc.pb.h"
#include "proto/status.h"
#include "tests/integration/integration_util.h"

namespace kvpool::integration {
namespace {

namespace t = ::kvpool::testing;

const Shape kShape{2, 4, 2, 64};
constexpr int kTokens = 400;  // sink 64, history blocks, a recent window of 256

std::string FaultDaemonPath() {
  return BinaryPath("KVPOOL_FAULT_INJECTION_DAEMON", KVPOOL_FAULT_INJECTION_DAEMON_PATH);
}

class IntegrityTest : public ::testing::Test {
 protected:
  void StartWith(std::vector<std::string> flags, bool test_device = false) {
    // Host memory even where KVPOOL_TEST_DEVICE names a GPU, unless `test_device`: CorruptPage
    // writes the pool from the host (a GPU pool's checksums are the same sums,
    // kernels/cuda/cuda_codec_test and page_checksum_cuda_test).
    flags.insert(flags.end(), {"--pool_bytes=268435456", "--worker_threads=2"});
    if (!test_device) flags.push_back("--device=cpu");
    absl::StatusOr<std::unique_ptr<LocalDaemon>> d = StartDaemonBinary(FaultDaemonPath(), flags);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    absl::StatusOr<std::unique_ptr<KvpoolClient>> c = KvpoolClient::Connect(daemon_->target());
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
    faults_ = t::FaultInjection::NewStub(client_->channel());
    ASSERT_TRUE(RegisterDataFree(*client_, "m", kShape, v1::ROTATION_KIND_HADAMARD, 1).ok());
  }

  void TearDown() override {
    if (daemon_ != nullptr) {
      const absl::Status stopped = daemon_->Stop(absl::Seconds(120));
      EXPECT_TRUE(stopped.ok()) << stopped;
    }
  }

  void Push(const std::string& id, uint64_t seed) {
    absl::StatusOr<v1::AppendKvResponse> r =
        CreateAndAppend(*client_, "m", id, MakeSequenceKv(kShape, kTokens, seed), true);
    ASSERT_TRUE(r.ok()) << r.status();
  }

  void Corrupt(const std::string& id, t::PageTier tier, uint32_t layer) {
    t::CorruptPageRequest r;
    r.set_sequence_id(id);
    r.set_layer(layer);
    r.set_tier(tier);
    r.set_page_index(0);
    r.set_byte_offset(5);  // K codes (or BF16 words) of head 0, slot 0: always written
    r.set_bit(3);
    t::CorruptPageResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    const grpc::Status s = faults_->CorruptPage(&context, r, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }

  absl::Status ReadBlocks(const std::string& id) {
    v1::ReadBlocksRequest r;
    r.set_sequence_id(id);
    return client_->ReadBlocks(r).status();
  }
  absl::Status ReadKv(const std::string& id) {
    v1::ReadKvRequest r;
    r.set_sequence_id(id);
    return client_->ReadKv(r).status();
  }

  // `steps` decode appends of one token to `id` (which holds kTokens), each with every layer.
  void Decode(const std::string& id, int steps, uint64_t seed) {
    const SequenceKv kv = MakeSequenceKv(kShape, steps, seed);
    const size_t row_bytes = static_cast<size_t>(kShape.kv_heads) * kShape.head_dim * 2;
    for (int i = 0; i < steps; ++i) {
      v1::AppendDecodeRequest d;
      d.set_sequence_id(id);
      d.set_token_start(kTokens + i);
      d.set_num_tokens(1);
      d.set_dtype(v1::DTYPE_BF16);
      std::string k, v;
      for (int l = 0; l < kShape.num_layers; ++l) {
        absl::StrAppend(&k, AsBytes(kv.k[l]).substr(i * row_bytes, row_bytes));
        absl::StrAppend(&v, AsBytes(kv.v[l]).substr(i * row_bytes, row_bytes));
      }
      d.set_k(k);
      d.set_v(v);
      const absl::StatusOr<v1::AppendDecodeResponse> r = client_->AppendDecode(d);
      ASSERT_TRUE(r.ok()) << "decode step " << i << ": " << r.status();
    }
  }

  v1::IntegrityStats Integrity() {
    absl::StatusOr<v1::GetStatsResponse> s = client_->GetStats();
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->integrity() : v1::IntegrityStats{};
  }

  // Polls GetStats until `done` holds (no timing asserted: a generous deadline on a loaded
  // machine).
  template <typename Pred>
  bool WaitFor(Pred done) {
    const absl::Time deadline = absl::Now() + absl::Seconds(300);
    while (absl::Now() < deadline) {
      if (done(Integrity())) return true;
      absl::SleepFor(absl::Milliseconds(50));
    }
    return false;
  }

  static void ExpectCorrupt(const absl::Status& s) {
    EXPECT_EQ(absl::StatusCode::kDataLoss, s.code()) << s;
    EXPECT_EQ(ErrorReason::kCorrupt, ReasonOf(s)) << s;
  }

  std::unique_ptr<LocalDaemon> daemon_;
  std::unique_ptr<KvpoolClient> client_;
  std::unique_ptr<t::FaultInjection::Stub> faults_;
};

TEST_F(IntegrityTest, ReadsFindAFlippedBitForThatSequenceOnlyUntilReleased) {
  StartWith({"--scrub_period=0"});
  if (HasFatalFailure()) return;
  Push("a", 1);
  Push("b", 2);
  if (HasFatalFailure()) return;
  KV_ASSERT_OK(ReadBlocks("a"));
  KV_ASSERT_OK(ReadKv("a"));

  Corrupt("a", t::PAGE_TIER_HISTORY, 1);  // an INT2 block: ReadBlocks checks the copy it sends
  ExpectCorrupt(ReadBlocks("a"));
  ExpectCorrupt(ReadKv("a"));
  KV_ASSERT_OK(ReadBlocks("b"));
  KV_ASSERT_OK(ReadKv("b"));
  v1::IntegrityStats stats = Integrity();
  EXPECT_EQ(1u, stats.corrupt_sequences());
  EXPECT_EQ(0u, stats.sweeps_completed());
  EXPECT_EQ(0u, stats.pages_scrubbed());

  Corrupt("b", t::PAGE_TIER_RECENT, 0);  // a BF16 page: ReadKv checks it before decoding
  ExpectCorrupt(ReadKv("b"));
  ExpectCorrupt(ReadBlocks("b"));
  EXPECT_EQ(2u, Integrity().corrupt_sequences());

  // Release ends it: the id is free and a new sequence under it reads fine.
  KV_ASSERT_OK(client_->ReleaseSequence("a").status());
  Push("a", 3);
  if (HasFatalFailure()) return;
  KV_ASSERT_OK(ReadBlocks("a"));
  KV_ASSERT_OK(ReadKv("a"));
  ExpectCorrupt(ReadKv("b"));
  EXPECT_EQ(2u, Integrity().corrupt_sequences());
}

TEST_F(IntegrityTest, ScrubberFindsAFlippedBitNobodyReads) {
  StartWith({"--scrub_period=0.1s"});
  if (HasFatalFailure()) return;
  Push("a", 1);
  Push("b", 2);
  if (HasFatalFailure()) return;
  // A sweep that started after both appends has read every page of both.
  const uint64_t start = Integrity().sweeps_completed();
  ASSERT_TRUE(
      WaitFor([&](const v1::IntegrityStats& s) { return s.sweeps_completed() >= start + 2; }));
  EXPECT_EQ(0u, Integrity().corrupt_sequences());
  EXPECT_GT(Integrity().pages_scrubbed(), 0u);

  Corrupt("a", t::PAGE_TIER_SINK, 0);
  ASSERT_TRUE(WaitFor([](const v1::IntegrityStats& s) { return s.corrupt_sequences() >= 1; }));
  ExpectCorrupt(ReadKv("a"));
  ExpectCorrupt(ReadBlocks("a"));
  KV_ASSERT_OK(ReadKv("b"));
  // Further sweeps find nothing new.
  const uint64_t after = Integrity().sweeps_completed();
  ASSERT_TRUE(
      WaitFor([&](const v1::IntegrityStats& s) { return s.sweeps_completed() >= after + 2; }));
  EXPECT_EQ(1u, Integrity().corrupt_sequences());
  KV_ASSERT_OK(client_->ReleaseSequence("a").status());
  KV_ASSERT_OK(ReadBlocks("b"));
}

// Pages only the prefix cache holds, once their sequence is released, are swept too: a flipped
// bit drops its unit and the units chained after it, so a lookup stops before it instead of
// handing out bad bytes.
TEST_F(IntegrityTest, ScrubberDropsACorruptUnitOnlyThePrefixCacheHolds) {
  StartWith({"--scrub_period=0.1s"});
  if (HasFatalFailure()) return;
  std::vector<uint32_t> ids(kTokens);
  for (int i = 0; i < kTokens; ++i) ids[i] = static_cast<uint32_t>(1000 + i);
  absl::StatusOr<v1::AppendKvResponse> pushed =
      CreateAndAppend(*client_, "m", "a", MakeSequenceKv(kShape, kTokens, 1), true, ids);
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  absl::StatusOr<v1::LookupPrefixResponse> before = client_->LookupPrefix("m", ids);
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_GE(before->units_size(), 3);  // the sink and history blocks
  ASSERT_EQ(v1::PREFIX_UNIT_KIND_SINK, before->units(0).kind());

  // History block 0 of layer 1 is the first block unit's page; the cache alone holds it next.
  Corrupt("a", t::PAGE_TIER_HISTORY, 1);
  KV_ASSERT_OK(client_->ReleaseSequence("a").status());
  ASSERT_TRUE(WaitFor([](const v1::IntegrityStats& s) { return s.corrupt_prefix_units() >= 1; }));
  const v1::IntegrityStats found = Integrity();
  EXPECT_EQ(1u, found.corrupt_prefix_units());
  EXPECT_EQ(static_cast<uint64_t>(before->units_size() - 1), found.prefix_units_dropped());
  absl::StatusOr<v1::LookupPrefixResponse> after = client_->LookupPrefix("m", ids);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(1, after->units_size());
  EXPECT_EQ(before->units(0).token_count(), after->matched_tokens());

  // A new sequence from the same prompt starts from the sink only, and reads fine.
  absl::StatusOr<v1::AppendKvResponse> again =
      CreateAndAppend(*client_, "m", "b", MakeSequenceKv(kShape, kTokens, 1), true, ids);
  ASSERT_TRUE(again.ok()) << again.status();
  KV_ASSERT_OK(ReadKv("b"));
  KV_ASSERT_OK(ReadBlocks("b"));
  const uint64_t sweeps = Integrity().sweeps_completed();
  ASSERT_TRUE(
      WaitFor([&](const v1::IntegrityStats& s) { return s.sweeps_completed() >= sweeps + 2; }));
  EXPECT_EQ(1u, Integrity().corrupt_prefix_units());
  // "a" itself, if a sweep read it between the flip and its release.
  EXPECT_LE(Integrity().corrupt_sequences(), 1u);
}

// On a GPU daemon (KVPOOL_TEST_DEVICE=cuda:N; skipped otherwise) the checksums that the arrival
// and demotion kernels compute as they write (kernels/cuda/page_checksum_accumulate.cuh) agree
// with what reads and the scrubber's verification pass compute: every page of sequences written
// by prefill (sink, history, recent) and by decode steps that demote verifies.
TEST_F(IntegrityTest, ChecksumsWrittenOnTheGpuVerify) {
  if (!TestingOnGpu()) GTEST_SKIP() << "needs KVPOOL_TEST_DEVICE=cuda:N";
  StartWith({"--scrub_period=0.1s"}, /*test_device=*/true);
  if (HasFatalFailure()) return;
  Push("a", 1);
  Push("b", 2);
  if (HasFatalFailure()) return;
  Decode("a", 48, 7);  // the recent window overflows: demotions into history blocks
  if (HasFatalFailure()) return;
  KV_ASSERT_OK(ReadBlocks("a"));
  KV_ASSERT_OK(ReadKv("a"));
  KV_ASSERT_OK(ReadBlocks("b"));
  KV_ASSERT_OK(ReadKv("b"));
  const uint64_t start = Integrity().sweeps_completed();
  ASSERT_TRUE(
      WaitFor([&](const v1::IntegrityStats& s) { return s.sweeps_completed() >= start + 2; }));
  EXPECT_EQ(0u, Integrity().corrupt_sequences());
  EXPECT_GT(Integrity().pages_scrubbed(), 0u);
}

}  // namespace
}  // namespace kvpool::integration
