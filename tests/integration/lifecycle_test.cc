// Work the daemon gives up or takes back on its own, against a real kvpoold:
//  - cancellation: an Attend whose caller gave up stops between sequences (GetStats counts the
//    skipped work) and frees the workers; a ReadKv cancelled mid-stream stops between layers;
//  - eviction only when it makes the append fit, least recently used prefixes first, and a
//    refused append leaves the prefix cache exactly as it was;
//  - leases: an unused sequence is released (counted, NOT_FOUND with reason EXPIRED), a used
//    one is kept while it is used.
// Nothing here is timed: every wait polls the daemon's counters or state with a generous bound.
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "proto/status.h"
#include "tests/integration/integration_util.h"

namespace kvpool::integration {
namespace {

constexpr Shape kShape{/*num_layers=*/2, /*q_heads=*/8, /*kv_heads=*/2, /*head_dim=*/64};
constexpr absl::Duration kPatience = absl::Seconds(120);

std::vector<uint32_t> Prompt(int n, uint32_t salt) {
  std::vector<uint32_t> ids(n);
  for (int i = 0; i < n; ++i) ids[i] = (static_cast<uint32_t>(i) * 2654435761u + salt) % 50000;
  return ids;
}

absl::StatusOr<v1::LifecycleStats> Lifecycle(const KvpoolClient& c) {
  absl::StatusOr<v1::GetStatsResponse> s = c.GetStats();
  if (!s.ok()) return s.status();
  return s->lifecycle();
}

// Queries of `rows` rows for `kShape`, small enough for any key.
std::string Queries(int rows, uint64_t seed) {
  const std::vector<Bf16> q =
      GaussianBf16(static_cast<size_t>(rows) * kShape.q_heads * kShape.head_dim, seed, 0.5f);
  std::vector<float> f(q.size());
  for (size_t i = 0; i < q.size(); ++i) f[i] = q[i].ToFloat();
  return std::string(AsBytes(f));
}

// ---------------------------------------------------------------------------------------------

class CancellationTest : public DaemonTest {};

TEST_F(CancellationTest, AbandonedAttendStopsBetweenSequencesAndFreesTheWorkers) {
  if (TestingOnGpu()) {
    // A GPU daemon attends a whole request in one device call, well within the deadline: there
    // is no point between units at which a caller's departure could be seen.
    GTEST_SKIP() << "one device call per request on a GPU daemon";
  }
  ASSERT_TRUE(
      RegisterDataFree(client(), "cancel", kShape, v1::ROTATION_KIND_RANDOMIZED_HADAMARD, 3).ok());
  constexpr int kTokens = 32768;
  const SequenceKv kv = MakeSequenceKv(kShape, kTokens, 5);
  ASSERT_TRUE(CreateAndAppend(client(), "cancel", "long", kv, true).ok());
  absl::StatusOr<v1::LifecycleStats> before = Lifecycle(client());
  ASSERT_TRUE(before.ok()) << before.status();

  // 256 sequences of 16 queries over 32768 tokens each: far more work than a deadline of one
  // second leaves time for.
  v1::AttendRequest request;
  request.set_model_id("cancel");
  request.set_layer(0);
  request.set_dtype(v1::DTYPE_FP32);
  const std::string q = Queries(16, 9);
  for (int i = 0; i < 256; ++i) {
    v1::SequenceQuery* sq = request.add_queries();
    sq->set_sequence_id("long");
    sq->set_num_queries(16);
    sq->set_q(q);
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  v1::AttendResponse response;
  const grpc::Status s = client().attention()->Attend(&ctx, request, &response);
  ASSERT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();

  // The daemon stops the call between sequences: the skipped work shows up in its counters and
  // the worker queue drains.
  const absl::Time give_up = absl::Now() + kPatience;
  absl::StatusOr<v1::GetStatsResponse> stats = client().GetStats();
  while (stats.ok() && absl::Now() < give_up &&
         (stats->lifecycle().units_skipped() == before->units_skipped() ||
          stats->service().worker_queue_depth() > 0)) {
    absl::SleepFor(absl::Milliseconds(20));
    stats = client().GetStats();
  }
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_GT(stats->lifecycle().units_skipped(), before->units_skipped());
  EXPECT_LE(stats->lifecycle().units_skipped() - before->units_skipped(), 256u);
  EXPECT_EQ(stats->lifecycle().calls_cancelled(), before->calls_cancelled() + 1);
  EXPECT_EQ(stats->service().worker_queue_depth(), 0u);

  // Another caller's small call is served.
  v1::AttendRequest small;
  small.set_model_id("cancel");
  small.set_layer(1);
  small.set_dtype(v1::DTYPE_FP32);
  v1::SequenceQuery* sq = small.add_queries();
  sq->set_sequence_id("long");
  sq->set_q(Queries(1, 11));
  absl::StatusOr<v1::AttendResponse> answer = client().Attend(small);
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(answer->results(0).attended_tokens(), static_cast<uint32_t>(kTokens));
}

TEST_F(CancellationTest, ReadKvCancelledMidStreamStopsBetweenLayers) {
  ASSERT_TRUE(
      RegisterDataFree(client(), "cancel-read", kShape, v1::ROTATION_KIND_RANDOMIZED_HADAMARD, 3)
          .ok());
  // 2 layers x 16384 tokens of FP32 K and V: 16 MiB per layer, far more than flow control lets
  // the daemon write before the client reads.
  const SequenceKv kv = MakeSequenceKv(kShape, 16384, 6);
  ASSERT_TRUE(CreateAndAppend(client(), "cancel-read", "wide", kv, true).ok());
  absl::StatusOr<v1::LifecycleStats> before = Lifecycle(client());
  ASSERT_TRUE(before.ok()) << before.status();

  v1::ReadKvRequest request;
  request.set_sequence_id("wide");
  request.set_dtype(v1::DTYPE_FP32);
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<v1::ReadKvResponse>> reader =
      client().reads()->ReadKv(&ctx, request);
  v1::ReadKvResponse message;
  ASSERT_TRUE(reader->Read(&message));  // the header
  ASSERT_TRUE(reader->Read(&message));  // the first rows of layer 0
  ctx.TryCancel();
  while (reader->Read(&message)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);

  const absl::Time give_up = absl::Now() + kPatience;
  absl::StatusOr<v1::LifecycleStats> after = Lifecycle(client());
  while (after.ok() && after->calls_cancelled() == before->calls_cancelled() &&
         absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(20));
    after = Lifecycle(client());
  }
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->calls_cancelled(), before->calls_cancelled() + 1);
  // At least the second layer was never read.
  EXPECT_GE(after->units_skipped() - before->units_skipped(), 1u);
  EXPECT_LE(after->units_skipped() - before->units_skipped(), 2u);
  // The sequence is intact and readable.
  absl::StatusOr<client::KvRead> read = client().ReadKv(request);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->layers.size(), 2u);
}

// ---------------------------------------------------------------------------------------------

// A small pool in small slabs, so that a few hundred KiB of appends fill it.
class EvictionTest : public DaemonTest {
 protected:
  static void SetUpTestSuite() {
    StartSuiteDaemon({"--pool_bytes=4194304", "--slab_bytes=262144", "--worker_threads=2"});
  }
};

constexpr int kUnitTokens = 16;  // sink, block and recent window alike

v1::QuantConfig SmallTiers() {
  v1::QuantConfig q;
  q.set_block_tokens(kUnitTokens);
  q.set_sink_tokens(kUnitTokens);
  q.set_recent_tokens(kUnitTokens);
  q.set_demotion_batch(kUnitTokens);
  return q;
}

TEST_F(EvictionTest, EvictsOnlyWhatMakesTheAppendFitLeastRecentlyUsedFirstElseChangesNothing) {
  ASSERT_TRUE(RegisterDataFree(client(), "evict", kShape, v1::ROTATION_KIND_RANDOMIZED_HADAMARD, 3,
                               SmallTiers())
                  .ok());
  // Four cached prompts (sink + 8 whole blocks each), their sequences released.
  constexpr int kBlocks = 8;
  constexpr uint32_t kCached = kUnitTokens * (1 + kBlocks);
  const int tokens = static_cast<int>(kCached) + kUnitTokens;  // + the recent window
  std::vector<std::vector<uint32_t>> prompts;
  for (int p = 0; p < 4; ++p) {
    prompts.push_back(Prompt(tokens, 100 + p));
    const std::string id = "prompt-" + std::to_string(p);
    absl::StatusOr<v1::AppendKvResponse> r =
        CreateAndAppend(client(), "evict", id, MakeSequenceKv(kShape, tokens, p), true, prompts[p]);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->published_units_size(), 1 + kBlocks);
    ASSERT_TRUE(client().ReleaseSequence(id).ok());
  }
  auto matched = [&](int p) -> uint32_t {
    absl::StatusOr<v1::LookupPrefixResponse> hit = client().LookupPrefix("evict", prompts[p]);
    EXPECT_TRUE(hit.ok()) << hit.status();
    return hit.ok() ? hit->matched_tokens() : 0;
  };
  // Use order, least recent first: prompt 1, 2, 3, 0.
  for (int p : {1, 2, 3, 0}) ASSERT_EQ(matched(p), kCached);

  // Live sequences (no token ids: nothing published) until one append needs the cache's memory.
  const SequenceKv live = MakeSequenceKv(kShape, 4 * kUnitTokens, 50);
  uint64_t evicted = 0;
  for (int i = 0; evicted == 0; ++i) {
    ASSERT_LT(i, 4000) << "the pool never filled";
    absl::StatusOr<v1::AppendKvResponse> r =
        CreateAndAppend(client(), "evict", "live-" + std::to_string(i), live, true);
    ASSERT_TRUE(r.ok()) << "append " << i << ": " << r.status();
    absl::StatusOr<v1::GetStatsResponse> stats = client().GetStats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    evicted = stats->pool().evicted_units();
  }
  // The append evicted the least recently used prompt's units first (a chain from its last
  // block back to its sink): a more recently used prompt lost units only once every older one was
  // gone, and the most recently used one kept all of them.
  const std::vector<int> lru_order = {1, 2, 3, 0};
  std::vector<uint32_t> left;
  for (int p : lru_order) left.push_back(matched(p));
  EXPECT_LT(left[0], kCached);
  EXPECT_EQ(left[3], kCached);
  for (size_t i = 1; i < left.size(); ++i) {
    if (left[i] < kCached) {
      EXPECT_EQ(left[i - 1], 0u) << "prompt " << lru_order[i];
    }
  }

  // An append that cannot fit even with every cached unit evicted: refused, and the pool and
  // the prefix cache stay exactly as they were (every lookup still hits as far as before).
  ASSERT_TRUE(client().CreateSequence("evict", "too-big").ok());
  std::vector<uint32_t> hits_before;
  for (int p : lru_order) hits_before.push_back(matched(p));
  absl::StatusOr<v1::GetStatsResponse> before = client().GetStats();
  ASSERT_TRUE(before.ok()) << before.status();
  ExpectRejectedAndPoolUnchanged(client(), absl::StatusCode::kResourceExhausted, "oversized append",
                                 [&]() -> absl::Status {
                                   v1::AppendKvHeader header;
                                   header.set_sequence_id("too-big");
                                   header.set_num_tokens(1 << 19);  // ~80 MiB of INT2 blocks
                                   header.set_dtype(v1::DTYPE_BF16);
                                   header.set_end_of_prefill(true);
                                   auto stream = client().OpenAppend(header);
                                   if (!stream.ok()) return stream.status();
                                   return (*stream)->Finish().status();
                                 });
  absl::StatusOr<v1::GetStatsResponse> after = client().GetStats();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->pool().evicted_units(), before->pool().evicted_units());
  EXPECT_EQ(after->pool().prefix_units(), before->pool().prefix_units());
  EXPECT_EQ(after->pool().cached_bytes(), before->pool().cached_bytes());
  std::vector<uint32_t> hits_after;
  for (int p : lru_order) hits_after.push_back(matched(p));
  EXPECT_EQ(hits_after, hits_before);
}

// ---------------------------------------------------------------------------------------------

class LeaseTest : public DaemonTest {
 protected:
  static void SetUpTestSuite() {
    StartSuiteDaemon({"--pool_bytes=67108864", "--worker_threads=2", "--sequence_ttl=3s"});
  }
};

TEST_F(LeaseTest, UnusedSequenceIsReleasedAndCountedUsedOneIsKept) {
  ASSERT_TRUE(
      RegisterDataFree(client(), "lease", kShape, v1::ROTATION_KIND_RANDOMIZED_HADAMARD, 3).ok());
  const SequenceKv kv = MakeSequenceKv(kShape, 64, 7);
  ASSERT_TRUE(CreateAndAppend(client(), "lease", "idle", kv, true).ok());
  ASSERT_TRUE(CreateAndAppend(client(), "lease", "busy", kv, true).ok());
  // A lease of its own, shorter than the daemon's.
  v1::CreateSequenceRequest own;
  own.set_model_id("lease");
  own.set_sequence_id("own");
  own.set_ttl_ms(1000);
  ASSERT_TRUE(client().CreateSequence(own).ok());
  absl::StatusOr<v1::GetStatsResponse> stats = client().GetStats(/*include_sequences=*/true);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->lifecycle().sequence_ttl_seconds(), 3.0);
  EXPECT_EQ(stats->lifecycle().leased_sequences(), 3u);
  for (const v1::SequenceStats& s : stats->sequences()) {
    EXPECT_EQ(s.ttl_ms(), s.sequence_id() == "own" ? 1000u : 3000u) << s.sequence_id();
  }
  const uint64_t expired_before = stats->lifecycle().expired_sequences();

  v1::ReadKvRequest use;
  use.set_sequence_id("busy");
  use.set_num_tokens(1);
  auto use_busy = [&] {
    absl::StatusOr<client::KvRead> read = client().ReadKv(use);
    ASSERT_TRUE(read.ok()) << "the used sequence was released: " << read.status();
  };
  // Until the idle one is gone, the busy one is read every 100 ms (its lease is 3 s).
  const absl::Time give_up = absl::Now() + kPatience;
  absl::StatusOr<v1::SequenceInfo> idle = client().DescribeSequence("idle");
  while (idle.ok() && absl::Now() < give_up) {
    use_busy();
    absl::SleepFor(absl::Milliseconds(100));
    idle = client().DescribeSequence("idle");
  }
  ASSERT_EQ(idle.status().code(), absl::StatusCode::kNotFound) << idle.status();
  EXPECT_EQ(ReasonOf(idle.status()), ErrorReason::kExpired) << idle.status();
  absl::StatusOr<v1::SequenceInfo> own_info = client().DescribeSequence("own");
  EXPECT_EQ(ReasonOf(own_info.status()), ErrorReason::kExpired) << own_info.status();
  // Every later call on it says so: an append, a read, a release.
  v1::AppendKvHeader header;
  header.set_sequence_id("idle");
  header.set_token_start(64);
  header.set_num_tokens(1);
  header.set_dtype(v1::DTYPE_BF16);
  absl::StatusOr<std::unique_ptr<client::AppendStream>> stream = client().OpenAppend(header);
  absl::Status appended = stream.ok() ? (*stream)->Finish().status() : stream.status();
  EXPECT_EQ(ReasonOf(appended), ErrorReason::kExpired) << appended;
  v1::ReadKvRequest read_idle;
  read_idle.set_sequence_id("idle");
  EXPECT_EQ(ReasonOf(client().ReadKv(read_idle).status()), ErrorReason::kExpired);
  EXPECT_EQ(ReasonOf(client().ReleaseSequence("idle").status()), ErrorReason::kExpired);

  // Used on for more than another lease, the busy one stays.
  const absl::Time keep_until = absl::Now() + absl::Seconds(4);
  while (absl::Now() < keep_until) {
    use_busy();
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(client().DescribeSequence("busy").ok());
  stats = client().GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->lifecycle().expired_sequences(), expired_before + 2);
  EXPECT_EQ(stats->lifecycle().leased_sequences(), 1u);

  // Left alone, it goes too; its id can then be created afresh.
  absl::StatusOr<v1::SequenceInfo> busy = client().DescribeSequence("busy");
  while (busy.ok() && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(100));
    busy = client().DescribeSequence("busy");
  }
  EXPECT_EQ(ReasonOf(busy.status()), ErrorReason::kExpired) << busy.status();
  ASSERT_TRUE(CreateAndAppend(client(), "lease", "busy", kv, true).ok());
  EXPECT_TRUE(client().DescribeSequence("busy").ok());
  ASSERT_TRUE(client().ReleaseSequence("busy").ok());
  EXPECT_EQ(client().DescribeSequence("busy").status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(ReasonOf(client().DescribeSequence("busy").status()).has_value());
}

}  // namespace
}  // namespace kvpool::integration
