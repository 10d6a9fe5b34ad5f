// The UCX data plane end to end on loopback: an in-process kvpoold (KvpoolServer) and a client
// UcxChannel in the same process, each with its own ucp worker, over shared memory
// (posix,sysv,cma) and over tcp on lo. Deadlines are generous and nothing is timed.
#include "server/transport/ucx/ucx_transport.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/transport/ucx_channel.h"
#include "gtest/gtest.h"
#include "kvpool/v1/transport_service.grpc.pb.h"
#include "tests/support/ucx_test_daemon.h"

namespace kvpool::server {
namespace {

using client::UcxChannel;
using client::UcxChannelOptions;
using client::UcxLayerPush;
using client::UcxPushResult;
using client::UcxPushSpec;
using testing::ModelShapeSpec;
using testing::TestDaemon;
using testing::TestDaemonOptions;
using testing::TestRowBytes;
using testing::UcxTls;

class UcxTransportTest : public ::testing::TestWithParam<UcxTls> {
 protected:
  void StartDaemon(TestDaemonOptions o = {}) {
    o.ucx_tls = GetParam().tls;
    auto d = TestDaemon::Start(o);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
  }

  // 16 KiB messages and one staging slot (32 KiB: a message's K and V halves), so a layer takes
  // many chunks and pushes wait for the slot.
  void StartDaemonWithOneStagingSlot() {
    TestDaemonOptions o;
    o.message_bytes = 16 << 10;
    o.staging_bytes = 32 << 10;
    StartDaemon(o);
  }

  // Model "m" stored exactly (identity rotation, bypass quantizer): reads return what was sent.
  static ModelShapeSpec ExactModel() {
    ModelShapeSpec m;
    m.rotation = v1::ROTATION_KIND_IDENTITY;
    m.method = v1::QUANT_METHOD_BYPASS;
    return m;
  }

  std::unique_ptr<UcxChannel> Connect() {
    UcxChannelOptions o;
    o.runtime.tls = GetParam().tls;
    o.runtime.net_devices = "lo";
    o.runtime.keepalive = absl::Milliseconds(500);
    o.deadline = absl::Seconds(120);
    auto ch = UcxChannel::Connect(daemon_->channel(), o);
    EXPECT_TRUE(ch.ok()) << ch.status();
    return ch.ok() ? *std::move(ch) : nullptr;
  }

  // Every layer's K and V bytes for `tokens` tokens.
  static void MakeKv(const ModelShapeSpec& m, int tokens, uint64_t seed,
                     std::vector<std::string>* k, std::vector<std::string>* v) {
    const size_t row = static_cast<size_t>(m.kv_heads) * m.head_dim;
    k->clear();
    v->clear();
    for (int l = 0; l < m.num_layers; ++l) {
      k->push_back(TestRowBytes(tokens, row, seed + 2 * l));
      v->push_back(TestRowBytes(tokens, row, seed + 2 * l + 1));
    }
  }

  // A 64-token push into sequence "s" of model `m` whose layer 0 is sent and acknowledged and
  // whose other layers never come, so the push stays open. `push` is null when it did not begin.
  struct OpenPush {
    std::unique_ptr<UcxChannel> channel;
    std::unique_ptr<UcxLayerPush> push;
  };
  OpenPush PushFirstLayerOnly(const ModelShapeSpec& m) {
    OpenPush open;
    open.channel = Connect();
    if (open.channel == nullptr) return open;
    std::vector<std::string> k, v;
    MakeKv(m, 64, 5, &k, &v);
    auto push = open.channel->BeginPush(UcxPushSpec{"s", 0, 64, true, {}});
    EXPECT_TRUE(push.ok()) << push.status();
    if (!push.ok()) return open;
    EXPECT_TRUE((*push)->PushLayer(0, 0, 64, k[0], v[0]).ok());
    EXPECT_TRUE((*push)->WaitLayer(0).ok());
    open.push = *std::move(push);
    return open;
  }

  v1::TransportStats TransportStats() {
    auto s = daemon_->Stats();
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->transport() : v1::TransportStats();
  }
  uint64_t UsedBytes() {
    auto s = daemon_->Stats();
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->pool().used_bytes() : 0;
  }

  // Polls until `pred` holds (true) or a generous deadline passes (false).
  template <typename Pred>
  static bool Eventually(Pred pred, absl::Duration limit = absl::Seconds(90)) {
    const absl::Time end = absl::Now() + limit;
    while (absl::Now() < end) {
      if (pred()) return true;
      absl::SleepFor(absl::Milliseconds(50));
    }
    return pred();
  }

  std::unique_ptr<TestDaemon> daemon_;
};

TEST_P(UcxTransportTest, NegotiatesUcxAndReportsIt) {
  StartDaemon();
  auto ch = Connect();
  ASSERT_NE(ch, nullptr);
  EXPECT_NE(ch->session().session_id(), 0u);
  EXPECT_FALSE(ch->session().listener_host().empty());
  EXPECT_NE(ch->session().listener_port(), 0u);
  EXPECT_EQ(ch->session().session_secret().size(), 16u);
  EXPECT_GT(ch->session().max_inflight_messages(), 0u);
  auto stats = daemon_->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->transport().sessions(), 1u);
  ASSERT_EQ(stats->transport().available_size(), 3);
  EXPECT_EQ(stats->transport().available(0), "grpc_inline");
  EXPECT_EQ(stats->transport().available(1), "ucx");
  EXPECT_EQ(stats->transport().available(2), "shared_memory");
  EXPECT_EQ(stats->transport().ucx_transports(), GetParam().tls);
  ch.reset();  // CloseSession
  EXPECT_TRUE(Eventually([&] { return TransportStats().sessions() == 0; }));
}

TEST_P(UcxTransportTest, FallsBackToGrpcInlineWithoutUcx) {
  TestDaemonOptions o;
  o.transports = "";
  StartDaemon(o);
  UcxChannelOptions co;
  co.runtime.tls = GetParam().tls;
  auto ch = UcxChannel::Connect(daemon_->channel(), co);
  EXPECT_EQ(ch.status().code(), absl::StatusCode::kFailedPrecondition) << ch.status();
  // No offers at all: grpc_inline, the fallback that always works.
  auto stub = v1::TransportService::NewStub(daemon_->channel());
  grpc::ClientContext ctx;
  v1::NegotiateResponse resp;
  ASSERT_TRUE(stub->Negotiate(&ctx, v1::NegotiateRequest(), &resp).ok());
  EXPECT_EQ(resp.kind(), v1::TRANSPORT_KIND_GRPC_INLINE);
}

TEST_P(UcxTransportTest, LayerwisePushStoresExactlyWhatWasSent) {
  StartDaemon();
  const ModelShapeSpec m = ExactModel();
  ASSERT_TRUE(daemon_->RegisterModel(m).ok());
  ASSERT_TRUE(daemon_->CreateSequence("m", "s").ok());
  auto ch = Connect();
  ASSERT_NE(ch, nullptr);
  const int tokens = 300;
  std::vector<std::string> k, v;
  MakeKv(m, tokens, 7, &k, &v);
  auto push = ch->BeginPush(UcxPushSpec{"s", 0, tokens, /*end_of_prefill=*/true, {}});
  ASSERT_TRUE(push.ok()) << push.status();
  for (int l = 0; l < m.num_layers; ++l) {
    ASSERT_TRUE((*push)->PushLayer(l, 0, tokens, k[l], v[l]).ok());
  }
  for (int l = 0; l < m.num_layers; ++l) EXPECT_TRUE((*push)->WaitLayer(l).ok()) << l;
  auto r = (*push)->Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->total_tokens, static_cast<uint32_t>(tokens));
  EXPECT_EQ(r->to_sink + r->to_history + r->to_recent, static_cast<uint32_t>(tokens));
  std::vector<std::string> rk, rv;
  ASSERT_TRUE(daemon_->ReadAll("s", &rk, &rv).ok());
  ASSERT_EQ(rk.size(), k.size());
  for (int l = 0; l < m.num_layers; ++l) {
    EXPECT_TRUE(rk[l] == k[l]) << "layer " << l;
    EXPECT_TRUE(rv[l] == v[l]) << "layer " << l;
  }
  auto stats = TransportStats();
  EXPECT_EQ(stats.pushes_committed(), 1u);
  EXPECT_EQ(stats.open_pushes(), 0u);
  EXPECT_EQ(stats.staging_bytes_in_use(), 0u);
}

TEST_P(UcxTransportTest, QuantizedPushEqualsInlineAppend) {
  // Small messages and staging: many chunks per layer, out-of-order layers, backpressure.
  StartDaemonWithOneStagingSlot();
  ModelShapeSpec m;
  ASSERT_TRUE(daemon_->RegisterModel(m).ok());
  ASSERT_TRUE(daemon_->CreateSequence("m", "ucx").ok());
  ASSERT_TRUE(daemon_->CreateSequence("m", "grpc").ok());
  const int tokens = 517;
  std::vector<std::string> k, v;
  MakeKv(m, tokens, 11, &k, &v);
  auto inline_append = daemon_->AppendInline("grpc", 0, tokens, false, k, v, 64);
  ASSERT_TRUE(inline_append.ok()) << inline_append.status();
  auto ch = Connect();
  ASSERT_NE(ch, nullptr);
  auto push = ch->BeginPush(UcxPushSpec{"ucx", 0, tokens, false, {}});
  ASSERT_TRUE(push.ok());
  for (int l = m.num_layers - 1; l >= 0; --l) {
    // Two token ranges per layer, the layer's halves pushed separately.
    const size_t half = static_cast<size_t>(tokens / 2) * (k[l].size() / tokens);
    std::string k1 = k[l].substr(0, half), v1 = v[l].substr(0, half);
    ASSERT_TRUE((*push)->PushLayer(l, 0, tokens / 2, k1, v1).ok());
    std::string k2 = k[l].substr(half), v2 = v[l].substr(half);
    ASSERT_TRUE((*push)->PushLayer(l, tokens / 2, tokens - tokens / 2, k2, v2).ok());
    ASSERT_TRUE((*push)->WaitLayer(l).ok());
  }
  auto r = (*push)->Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->to_history, inline_append->to_history());
  EXPECT_EQ(r->to_sink, inline_append->to_sink());
  std::vector<std::string> ka, va, kb, vb;
  ASSERT_TRUE(daemon_->ReadAll("ucx", &ka, &va).ok());
  ASSERT_TRUE(daemon_->ReadAll("grpc", &kb, &vb).ok());
  EXPECT_TRUE(ka == kb);
  EXPECT_TRUE(va == vb);
}

TEST_P(UcxTransportTest, ConcurrentPushesShareOneStagingSlot) {
  // One staging slot (K and V halves of 16 KiB) and eight pushes at once from four sessions, so
  // that chunks of different pushes queue for the slot: each K lands beside its own V, every
  // push stores exactly what was sent, and the slot comes back. (Whether another session's K
  // lands between a chunk's K and V depends on timing; the rule that a chunk's second half
  // never queues behind it is in UcxTransport::OnLayerData and ServePending.)
  StartDaemonWithOneStagingSlot();
  const ModelShapeSpec m = ExactModel();
  ASSERT_TRUE(daemon_->RegisterModel(m).ok());
  const int tokens = 700;  // several chunks per layer (256 tokens per 16 KiB message)
  std::vector<std::unique_ptr<UcxChannel>> channels;
  for (int c = 0; c < 4; ++c) {
    channels.push_back(Connect());
    ASSERT_NE(channels.back(), nullptr);
  }
  constexpr int kPushes = 8;
  std::vector<std::vector<std::string>> k(kPushes), v(kPushes);
  std::vector<absl::Status> results(kPushes);
  for (int p = 0; p < kPushes; ++p) {
    ASSERT_TRUE(daemon_->CreateSequence("m", absl::StrCat("s", p)).ok());
    MakeKv(m, tokens, 100 + p, &k[p], &v[p]);
  }
  std::vector<std::thread> threads;
  for (int p = 0; p < kPushes; ++p) {
    threads.emplace_back([&, p] {
      auto push = channels[p % 4]->BeginPush(
          UcxPushSpec{absl::StrCat("s", p), 0, tokens, /*end_of_prefill=*/true, {}});
      if (!push.ok()) {
        results[p] = push.status();
        return;
      }
      for (int l = 0; l < m.num_layers && results[p].ok(); ++l) {
        results[p] = (*push)->PushLayer(l, 0, tokens, k[p][l], v[p][l]);
      }
      absl::StatusOr<UcxPushResult> r = (*push)->Finish();
      if (results[p].ok()) results[p] = r.status();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int p = 0; p < kPushes; ++p) {
    ASSERT_TRUE(results[p].ok()) << "push " << p << ": " << results[p];
    std::vector<std::string> rk, rv;
    ASSERT_TRUE(daemon_->ReadAll(absl::StrCat("s", p), &rk, &rv).ok());
    EXPECT_TRUE(rk == k[p]) << "push " << p;
    EXPECT_TRUE(rv == v[p]) << "push " << p;
  }
  auto stats = TransportStats();
  EXPECT_EQ(stats.pushes_committed(), static_cast<uint64_t>(kPushes));
  EXPECT_EQ(stats.staging_bytes_in_use(), 0u);
}

TEST_P(UcxTransportTest, RemoteAttentionMatchesGrpc) {
  StartDaemon();
  ModelShapeSpec m;
  m.q_heads = 8;
  ASSERT_TRUE(daemon_->RegisterModel(m).ok());
  const int batch = 3;
  std::vector<std::string> k, v;
  for (int b = 0; b < batch; ++b) {
    const std::string id = "s" + std::to_string(b);
    ASSERT_TRUE(daemon_->CreateSequence("m", id).ok());
    MakeKv(m, 90 + 17 * b, 100 + b, &k, &v);
    ASSERT_TRUE(daemon_->AppendInline(id, 0, 90 + 17 * b, true, k, v).ok());
  }
  const size_t qv = static_cast<size_t>(m.q_heads) * m.head_dim;
  std::vector<std::vector<float>> q(batch);
  v1::AttendRequest req;
  req.set_model_id("m");
  req.set_layer(2);
  req.set_dtype(v1::DTYPE_FP32);
  std::vector<client::UcxSequenceQuery> uq;
  for (int b = 0; b < batch; ++b) {
    const int nq = b + 1;
    q[b].resize(qv * nq);
    for (size_t i = 0; i < q[b].size(); ++i) q[b][i] = std::sin(0.37f * i + b);
    v1::SequenceQuery* sq = req.add_queries();
    sq->set_sequence_id("s" + std::to_string(b));
    sq->set_num_queries(nq);
    sq->set_q(reinterpret_cast<const char*>(q[b].data()), q[b].size() * 4);
    uq.push_back({"s" + std::to_string(b), static_cast<uint32_t>(nq), q[b].data()});
  }
  auto g = daemon_->AttendInline(req);
  ASSERT_TRUE(g.ok()) << g.status();
  auto ch = Connect();
  ASSERT_NE(ch, nullptr);
  for (int repeat = 0; repeat < 3; ++repeat) {  // the channel persists across calls
    std::vector<client::UcxAttentionResult> out;
    absl::Status s = ch->Attend("m", 2, qv, uq, &out);
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_EQ(out.size(), static_cast<size_t>(batch));
    for (int b = 0; b < batch; ++b) {
      const v1::SequenceAttention& ga = g->results(b);
      EXPECT_EQ(out[b].attended_tokens, ga.attended_tokens());
      ASSERT_EQ(out[b].out.size() * 4, ga.out().size());
      EXPECT_EQ(std::memcmp(out[b].out.data(), ga.out().data(), ga.out().size()), 0);
      ASSERT_EQ(out[b].lse.size(), static_cast<size_t>(ga.lse_size()));
      for (int i = 0; i < ga.lse_size(); ++i) EXPECT_EQ(out[b].lse[i], ga.lse(i));
    }
  }
  // Errors come back as statuses: an unknown sequence, an unknown model.
  std::vector<client::UcxAttentionResult> out;
  uq[1].sequence_id = "nope";
  EXPECT_EQ(ch->Attend("m", 2, qv, uq, &out).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ch->Attend("nope", 2, qv, uq, &out).code(), absl::StatusCode::kNotFound);
}

TEST_P(UcxTransportTest, FailedPushLeavesThePoolUnchanged) {
  StartDaemon();
  ModelShapeSpec m;
  ASSERT_TRUE(daemon_->RegisterModel(m).ok());
  ASSERT_TRUE(daemon_->CreateSequence("m", "s").ok());
  const uint64_t before = UsedBytes();
  auto ch = Connect();
  ASSERT_NE(ch, nullptr);
  const int tokens = 200;
  std::vector<std::string> k, v;
  MakeKv(m, tokens, 3, &k, &v);
  {  // NaN in layer 2: the whole push fails and rolls back.
    std::string bad = k[2];
    const uint16_t nan = 0x7fc0;
    std::memcpy(bad.data() + 100, &nan, 2);
    auto push = ch->BeginPush(UcxPushSpec{"s", 0, tokens, true, {}});
    ASSERT_TRUE(push.ok());
    for (int l = 0; l < m.num_layers; ++l) {
      (void)(*push)->PushLayer(l, 0, tokens, l == 2 ? bad : k[l], v[l]);
    }
    auto r = (*push)->Finish();
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  }
  {  // A commit with a layer missing.
    auto push = ch->BeginPush(UcxPushSpec{"s", 0, tokens, true, {}});
    ASSERT_TRUE(push.ok());
    for (int l = 0; l < m.num_layers - 1; ++l) {
      ASSERT_TRUE((*push)->PushLayer(l, 0, tokens, k[l], v[l]).ok());
    }
    auto r = (*push)->Finish();
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  }
  {  // Begin errors reach the client: unknown sequence, wrong token_start.
    auto push = ch->BeginPush(UcxPushSpec{"nope", 0, tokens, true, {}});
    ASSERT_TRUE(push.ok());
    EXPECT_EQ((*push)->Finish().status().code(), absl::StatusCode::kNotFound);
    auto push2 = ch->BeginPush(UcxPushSpec{"s", 5, tokens, true, {}});
    ASSERT_TRUE(push2.ok());
    EXPECT_EQ((*push2)->Finish().status().code(), absl::StatusCode::kFailedPrecondition);
  }
  {  // An abort by the client (destroying an open push).
    auto push = ch->BeginPush(UcxPushSpec{"s", 0, tokens, true, {}});
    ASSERT_TRUE(push.ok());
    ASSERT_TRUE((*push)->PushLayer(0, 0, tokens, k[0], v[0]).ok());
    ASSERT_TRUE((*push)->WaitLayer(0).ok());
  }
  EXPECT_TRUE(Eventually([&] {
    auto t = TransportStats();
    return t.open_pushes() == 0 && t.staging_bytes_in_use() == 0 && UsedBytes() == before;
  }));
  auto info = daemon_->Describe("s");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->total_tokens(), 0u);
  // The sequence is not left locked: a correct push now succeeds.
  auto push = ch->BeginPush(UcxPushSpec{"s", 0, tokens, true, {}});
  ASSERT_TRUE(push.ok());
  for (int l = 0; l < m.num_layers; ++l) {
    ASSERT_TRUE((*push)->PushLayer(l, 0, tokens, k[l], v[l]).ok());
  }
  auto r = (*push)->Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->total_tokens, static_cast<uint32_t>(tokens));
}

TEST_P(UcxTransportTest, IdlePushTimesOutAndRollsBack) {
  TestDaemonOptions o;
  o.idle_timeout_ms = 1000;
  StartDaemon(o);
  ModelShapeSpec m;
  ASSERT_TRUE(daemon_->RegisterModel(m).ok());
  ASSERT_TRUE(daemon_->CreateSequence("m", "s").ok());
  const uint64_t before = UsedBytes();
  OpenPush open = PushFirstLayerOnly(m);
  ASSERT_NE(open.push, nullptr);
  // The prefill "stalls": the daemon rolls the push back on its own.
  EXPECT_TRUE(Eventually([&] { return TransportStats().timeouts() == 1; }));
  EXPECT_TRUE(Eventually([&] {
    auto t = TransportStats();
    return t.open_pushes() == 0 && UsedBytes() == before;
  }));
  auto r = open.push->Finish();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
}

TEST_P(UcxTransportTest, ClientSeesDaemonGoneWithinDeadline) {
  StartDaemon();
  ModelShapeSpec m;
  ASSERT_TRUE(daemon_->RegisterModel(m).ok());
  ASSERT_TRUE(daemon_->CreateSequence("m", "s").ok());
  OpenPush open = PushFirstLayerOnly(m);
  ASSERT_NE(open.push, nullptr);
  daemon_->Kill();
  // The push ends with an error (the daemon rolled it back while shutting down and said so),
  // not a hang.
  auto r = open.push->Finish();
  EXPECT_FALSE(r.ok());
  EXPECT_TRUE(absl::IsUnavailable(r.status()) || absl::IsDeadlineExceeded(r.status()))
      << r.status();
}

INSTANTIATE_TEST_SUITE_P(Loopback, UcxTransportTest, ::testing::ValuesIn(testing::kLoopbackTls),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace kvpool::server
