// Many clients at once against one real kvpoold: 16 clients, each on its own connection, push
// prefills in small chunks, decode, attend, read back and release concurrently; afterwards the
// daemon's accounting (GetStats) is exact: tokens per tier, sequences, ingest and attention
// counters, pool bytes and pages, and an empty pool once everything is released.
#include <atomic>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/mixed_sequence.h"
#include "tests/integration/integration_util.h"

namespace kvpool::integration {
namespace {

class ConcurrencyTest : public DaemonTest {
 protected:
  static void SetUpTestSuite() {
    StartSuiteDaemon({"--pool_bytes=536870912", "--worker_threads=2"});
  }
};

constexpr Shape kShape{/*num_layers=*/2, /*q_heads=*/8, /*kv_heads=*/2, /*head_dim=*/64};
constexpr int kClients = 16;

struct ClientResult {
  std::string sequence_id;
  std::string model_id;
  bool released = false;
  int appended_tokens = 0;
  int attention_calls = 0;
  MixedSequenceLayout layout{TierConfig{64, 256, 16}};
};

size_t CeilDiv(size_t a, size_t b) { return (a + b - 1) / b; }

void RunClient(const std::string& target, int i, ClientResult* result) {
  client::ClientOptions options;
  options.chunk_bytes = 16 << 10;  // many small messages per stream
  options.deadline = absl::Seconds(600);
  absl::StatusOr<std::unique_ptr<KvpoolClient>> connected = KvpoolClient::Connect(target, options);
  ASSERT_TRUE(connected.ok());
  const KvpoolClient& c = **connected;
  const bool exact = i % 2 == 0;
  result->model_id = exact ? "cc-exact" : "cc-int2";
  result->sequence_id = absl::StrCat("cc-", i);
  const std::string& id = result->sequence_id;
  const int first = 150 + 13 * i, second = 200 + 29 * i, decode = 20 + i;
  const int total = first + second + decode;
  const SequenceKv kv = MakeSequenceKv(kShape, total, 100 + i);
  const size_t row_bytes = static_cast<size_t>(kShape.kv_heads) * kShape.head_dim * 2;

  ASSERT_TRUE(c.CreateSequence(result->model_id, id).ok());
  int at = 0;
  for (const auto& [n, final] : {std::pair<int, bool>{first, false}, {second, true}}) {
    v1::AppendKvHeader header;
    header.set_sequence_id(id);
    header.set_token_start(at);
    header.set_num_tokens(n);
    header.set_dtype(v1::DTYPE_BF16);
    header.set_end_of_prefill(final);
    auto stream = c.OpenAppend(header);
    ASSERT_TRUE(stream.ok()) << stream.status();
    for (int l = 0; l < kShape.num_layers; ++l) {
      ASSERT_TRUE((*stream)
                      ->WriteLayer(l, 0, n, AsBytes(kv.k[l]).substr(at * row_bytes, n * row_bytes),
                                   AsBytes(kv.v[l]).substr(at * row_bytes, n * row_bytes))
                      .ok());
    }
    absl::StatusOr<v1::AppendKvResponse> r = (*stream)->Finish();
    ASSERT_TRUE(r.ok()) << id << ": " << r.status();
    result->layout.Commit(
        *result->layout.PlanAppend(n, final ? AppendKind::kFinalPrefill : AppendKind::kPrefill),
        final ? AppendKind::kFinalPrefill : AppendKind::kPrefill);
    result->appended_tokens += n;
    at += n;
  }
  for (; at < total; ++at) {
    v1::AppendDecodeRequest d;
    d.set_sequence_id(id);
    d.set_token_start(at);
    d.set_num_tokens(1);
    d.set_dtype(v1::DTYPE_BF16);
    std::string k, v;
    for (int l = 0; l < kShape.num_layers; ++l) {
      absl::StrAppend(&k, AsBytes(kv.k[l]).substr(at * row_bytes, row_bytes));
      absl::StrAppend(&v, AsBytes(kv.v[l]).substr(at * row_bytes, row_bytes));
    }
    d.set_k(k);
    d.set_v(v);
    absl::StatusOr<v1::AppendDecodeResponse> r = c.AppendDecode(d);
    ASSERT_TRUE(r.ok()) << id << ": " << r.status();
    result->layout.Commit(*result->layout.PlanAppend(1, AppendKind::kDecode), AppendKind::kDecode);
    ++result->appended_tokens;
  }

  v1::AttendRequest attend;
  attend.set_model_id(result->model_id);
  attend.set_layer(i % kShape.num_layers);
  v1::SequenceQuery* q = attend.add_queries();
  q->set_sequence_id(id);
  const std::vector<float> zeros(static_cast<size_t>(kShape.q_heads) * kShape.head_dim, 0.0f);
  q->set_q(std::string(AsBytes(zeros)));  // uniform attention over every token
  absl::StatusOr<v1::AttendResponse> a = c.Attend(attend);
  ASSERT_TRUE(a.ok()) << id << ": " << a.status();
  ++result->attention_calls;
  EXPECT_EQ(a->results(0).attended_tokens(), static_cast<uint32_t>(total));

  v1::ReadKvRequest read;
  read.set_sequence_id(id);
  absl::StatusOr<client::KvRead> back = c.ReadKv(read);
  ASSERT_TRUE(back.ok()) << id << ": " << back.status();
  EXPECT_EQ(back->header.num_tokens(), static_cast<uint32_t>(total));
  if (exact) {
    for (int l = 0; l < kShape.num_layers; ++l) {
      EXPECT_TRUE(back->layers[l].k == AsBytes(kv.k[l])) << id << " layer " << l;
      EXPECT_TRUE(back->layers[l].v == AsBytes(kv.v[l])) << id << " layer " << l;
    }
  }
  if (i % 4 == 3) {
    ASSERT_TRUE(c.ReleaseSequence(id).ok());
    result->released = true;
  }
}

TEST_F(ConcurrencyTest, SixteenClientsThenExactAccounting) {
  v1::QuantConfig bypass;
  bypass.set_method(v1::QUANT_METHOD_BYPASS);
  absl::StatusOr<v1::ModelInfo> exact =
      RegisterDataFree(client(), "cc-exact", kShape, v1::ROTATION_KIND_IDENTITY, 0, bypass);
  absl::StatusOr<v1::ModelInfo> int2 =
      RegisterDataFree(client(), "cc-int2", kShape, v1::ROTATION_KIND_RANDOMIZED_HADAMARD, 5);
  ASSERT_TRUE(exact.ok() && int2.ok());

  std::vector<ClientResult> results(kClients);
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back(RunClient, daemon().target(), i, &results[i]);
  }
  // Meanwhile, four more clients race to append the same tokens to one sequence: exactly one
  // wins; the others get ABORTED (append in progress) or FAILED_PRECONDITION (token_start is no
  // longer the length), and leave nothing behind.
  ASSERT_TRUE(client().CreateSequence("cc-int2", "cc-race").ok());
  const SequenceKv race_kv = MakeSequenceKv(kShape, 300, 77);
  std::atomic<int> winners{0};
  std::vector<std::thread> racers;
  for (int r = 0; r < 4; ++r) {
    racers.emplace_back([&] {
      auto c = KvpoolClient::Connect(daemon().target());
      ASSERT_TRUE(c.ok());
      v1::AppendKvHeader header;
      header.set_sequence_id("cc-race");
      header.set_num_tokens(race_kv.tokens);
      header.set_dtype(v1::DTYPE_BF16);
      std::vector<client::LayerKv> layers;
      for (int l = 0; l < kShape.num_layers; ++l) {
        layers.push_back({l, AsBytes(race_kv.k[l]), AsBytes(race_kv.v[l])});
      }
      absl::StatusOr<v1::AppendKvResponse> got = (*c)->AppendKv(header, layers);
      if (got.ok()) {
        ++winners;
      } else {
        EXPECT_TRUE(got.status().code() == absl::StatusCode::kAborted ||
                    got.status().code() == absl::StatusCode::kFailedPrecondition)
            << got.status();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (std::thread& t : racers) t.join();
  if (HasFailure()) return;
  EXPECT_EQ(winners.load(), 1);
  ClientResult race;
  race.sequence_id = "cc-race";
  race.model_id = "cc-int2";
  race.appended_tokens = race_kv.tokens;
  race.layout.Commit(*race.layout.PlanAppend(race_kv.tokens, AppendKind::kPrefill),
                     AppendKind::kPrefill);
  results.push_back(race);

  // Expected totals from the kernels' tier rules and what every client did.
  struct Totals {
    uint64_t sequences = 0, sink = 0, history = 0, recent = 0, bytes = 0;
  };
  std::map<std::string, Totals> want;
  uint64_t ingested_tokens = 0, attention_calls = 0, live_bytes = 0;
  std::map<std::string, const v1::ModelInfo*> models = {{"cc-exact", &*exact}, {"cc-int2", &*int2}};
  for (const ClientResult& r : results) {
    ingested_tokens += r.appended_tokens;
    attention_calls += r.attention_calls;
    if (r.released) continue;
    const v1::ModelInfo& m = *models[r.model_id];
    const int bt = m.quant().block_tokens();
    // Per layer: BF16 pages for the sink and the recent window (the window starts page-aligned
    // and demotes whole pages, since the demotion batch equals the block size), INT2 blocks for
    // the history.
    const uint64_t bytes =
        m.shape().num_layers() *
        ((CeilDiv(r.layout.sink(), bt) + CeilDiv(r.layout.recent(), bt)) * m.bf16_page_bytes() +
         CeilDiv(r.layout.history(), bt) * m.block_layout().block_bytes());
    Totals& t = want[r.model_id];
    ++t.sequences;
    t.sink += r.layout.sink();
    t.history += r.layout.history();
    t.recent += r.layout.recent();
    t.bytes += bytes;
    live_bytes += bytes;
    absl::StatusOr<v1::SequenceInfo> info = client().DescribeSequence(r.sequence_id);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->sink_tokens(), static_cast<uint32_t>(r.layout.sink())) << r.sequence_id;
    EXPECT_EQ(info->history_tokens(), static_cast<uint32_t>(r.layout.history())) << r.sequence_id;
    EXPECT_EQ(info->recent_tokens(), static_cast<uint32_t>(r.layout.recent())) << r.sequence_id;
    EXPECT_EQ(info->pool_bytes(), bytes) << r.sequence_id;
    EXPECT_EQ(info->shared_bytes(), 0u) << r.sequence_id;
    EXPECT_EQ(info->bf16_equivalent_bytes(), static_cast<uint64_t>(r.layout.total()) *
                                                 m.shape().num_layers() * m.shape().kv_heads() *
                                                 m.shape().head_dim() * 2 * 2)
        << r.sequence_id;
  }

  absl::StatusOr<v1::GetStatsResponse> stats = client().GetStats(/*include_sequences=*/true);
  ASSERT_TRUE(stats.ok()) << stats.status();
  for (const v1::ModelStats& m : stats->models()) {
    const Totals& t = want[m.model_id()];
    EXPECT_EQ(m.sequences(), t.sequences) << m.model_id();
    EXPECT_EQ(m.sink_tokens(), t.sink) << m.model_id();
    EXPECT_EQ(m.history_tokens(), t.history) << m.model_id();
    EXPECT_EQ(m.recent_tokens(), t.recent) << m.model_id();
    EXPECT_EQ(m.pool_bytes(), t.bytes) << m.model_id();
  }
  EXPECT_EQ(stats->sequences_size(),
            static_cast<int>(want["cc-exact"].sequences + want["cc-int2"].sequences));
  const v1::PoolStats& pool = stats->pool();
  EXPECT_EQ(pool.used_bytes(), live_bytes);
  EXPECT_EQ(pool.capacity_bytes() - pool.used_bytes(), pool.free_bytes());
  EXPECT_EQ(pool.shared_bytes(), 0u);
  EXPECT_EQ(pool.cached_bytes(), 0u);
  uint64_t class_bytes = 0;
  for (const v1::PageClassStats& c : pool.classes()) {
    EXPECT_EQ(c.bytes_in_use(), c.page_bytes() * c.pages_in_use());
    class_bytes += c.bytes_in_use();
  }
  EXPECT_EQ(class_bytes, pool.used_bytes());
  const v1::ServiceStats& svc = stats->service();
  EXPECT_EQ(svc.ingested_tokens(), ingested_tokens);
  EXPECT_EQ(svc.ingested_bytes(),
            ingested_tokens * kShape.num_layers * kShape.kv_heads * kShape.head_dim * 2 * 2);
  EXPECT_EQ(svc.attention_calls(), attention_calls);
  EXPECT_EQ(svc.attention_sequences(), attention_calls);
  EXPECT_EQ(svc.rejected_busy(), 0u);

  // Releasing everything empties the pool.
  for (const ClientResult& r : results) {
    if (r.released) continue;
    ASSERT_TRUE(client().ReleaseSequence(r.sequence_id).ok()) << r.sequence_id;
  }
  stats = client().GetStats(true);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->pool().used_bytes(), 0u);
  for (const v1::PageClassStats& c : stats->pool().classes()) EXPECT_EQ(c.pages_in_use(), 0u);
  EXPECT_EQ(stats->sequences_size(), 0);
  for (const v1::ModelStats& m : stats->models()) EXPECT_EQ(m.sequences(), 0u);
}

}  // namespace
}  // namespace kvpool::integration
