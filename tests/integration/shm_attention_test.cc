// Same-host remote attention through shared memory (a SHARED_MEMORY session) against a real
// kvpoold: the same outputs as Attend over gRPC, per-call errors that leave the channel working,
// the session's binding (socket mode, secret, one connection) and its lease.
#include "client/transport/shm_attention.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "dataplane/fd_passing.h"
#include "dataplane/shm_wire.h"
#include "gtest/gtest.h"
#include "tests/integration/integration_util.h"
#include "tests/support/test_data.h"

namespace kvpool::integration {
namespace {

using client::RemoteAttentionPlan;
using client::ShmAttentionClient;

constexpr Shape kShape{2, 8, 2, 64};

class ShmAttentionTest : public DaemonTest {
 protected:
  void SetUp() override {
    DaemonTest::SetUp();
    static bool registered = false;
    if (!registered) {
      ASSERT_TRUE(RegisterDataFree(client(), "m", kShape, v1::ROTATION_KIND_HADAMARD, 5).ok());
      registered = true;
    }
  }
  std::unique_ptr<ShmAttentionClient> Connect(uint32_t slots = 1) {
    client::ShmAttentionOptions o;
    o.slots = slots;
    auto c = ShmAttentionClient::Connect(client().channel(), o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }
  // A raw shared-memory session (Negotiate alone), as a client that speaks the wire itself.
  v1::SharedMemorySession Negotiate() {
    auto stub = v1::TransportService::NewStub(client().channel());
    v1::NegotiateRequest req;
    req.add_offers()->set_kind(v1::TRANSPORT_KIND_SHARED_MEMORY);
    v1::NegotiateResponse resp;
    grpc::ClientContext ctx;
    const grpc::Status s = stub->Negotiate(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.kind(), v1::TRANSPORT_KIND_SHARED_MEMORY);
    return resp.shared_memory();
  }
  // A connection to the session's Unix socket (-1 when it fails).
  static int ConnectSocket(const v1::SharedMemorySession& m) {
    const int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, m.socket_path().c_str(), sizeof(addr.sun_path) - 1);
    if (connect(s, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
      close(s);
      return -1;
    }
    return s;
  }
  // Attend over gRPC with the same float32 queries: the reference.
  v1::AttendResponse GrpcAttend(const std::vector<std::string>& ids, int nq, int layer,
                                const std::vector<float>& q) {
    v1::AttendRequest r;
    r.set_model_id("m");
    r.set_layer(layer);
    r.set_dtype(v1::DTYPE_FP32);
    const size_t per_seq = static_cast<size_t>(nq) * kShape.q_heads * kShape.head_dim;
    for (size_t i = 0; i < ids.size(); ++i) {
      v1::SequenceQuery* sq = r.add_queries();
      sq->set_sequence_id(ids[i]);
      sq->set_num_queries(nq);
      sq->set_q(std::string(reinterpret_cast<const char*>(q.data() + i * per_seq),
                            per_seq * sizeof(float)));
    }
    absl::StatusOr<v1::AttendResponse> a = client().Attend(r);
    EXPECT_TRUE(a.ok()) << a.status();
    return a.ok() ? *a : v1::AttendResponse();
  }
};

TEST_F(ShmAttentionTest, AnswersBitForBitAsAttendOverGrpc) {
  const std::vector<std::string> ids = {"bits-a", "bits-b", "bits-c"};
  const int tokens[3] = {300, 37, 1};
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(
        CreateAndAppend(client(), "m", ids[i], MakeSequenceKv(kShape, tokens[i], 10 + i), true)
            .ok());
  }
  auto attn = Connect();
  ASSERT_NE(attn, nullptr);
  EXPECT_EQ(attn->daemon_device(), TestingOnGpu() ? 0 : -1);
  for (int nq : {1, 2}) {
    absl::StatusOr<RemoteAttentionPlan> plan = attn->SetPlan("m", ids, nq);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->num_layers, kShape.num_layers);
    const std::vector<float> q =
        kvpool::testing::GaussianValues(plan->query_bytes / sizeof(float), 20 + nq);
    std::vector<float> out(q.size()), lse(plan->lse_bytes / sizeof(float));
    for (int layer = 0; layer < kShape.num_layers; ++layer) {
      for (int repeat = 0; repeat < 3; ++repeat) {  // later calls reuse the resident tables
        absl::StatusOr<std::vector<uint32_t>> got =
            attn->Attend(*plan, layer, q, absl::MakeSpan(out), absl::MakeSpan(lse));
        ASSERT_TRUE(got.ok()) << got.status();
        const v1::AttendResponse want = GrpcAttend(ids, nq, layer, q);
        ASSERT_EQ(want.results_size(), 3);
        const size_t per_seq = static_cast<size_t>(nq) * kShape.q_heads * kShape.head_dim;
        for (int i = 0; i < 3; ++i) {
          const v1::SequenceAttention& r = want.results(i);
          EXPECT_EQ((*got)[i], r.attended_tokens());
          ASSERT_EQ(r.out().size(), per_seq * sizeof(float));
          if (TestingOnGpu()) continue;  // the GPU's plan and gRPC paths may split differently
          EXPECT_EQ(std::memcmp(out.data() + i * per_seq, r.out().data(), r.out().size()), 0)
              << "sequence " << i << " layer " << layer;
          ASSERT_EQ(r.lse_size(), nq * kShape.q_heads);
          EXPECT_EQ(std::memcmp(lse.data() + static_cast<size_t>(i) * nq * kShape.q_heads,
                                r.lse().data(), r.lse_size() * sizeof(float)),
                    0);
        }
      }
    }
    ASSERT_TRUE(attn->DropPlan(*plan).ok());
  }
}

TEST_F(ShmAttentionTest, InPlaceCallsAnswerAsCopyingCallsAndGiveTheirSlotBack) {
  const std::vector<std::string> ids = {"inplace-a", "inplace-b"};
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(
        CreateAndAppend(client(), "m", ids[i], MakeSequenceKv(kShape, 90 + 40 * i, 30 + i), true)
            .ok());
  }
  auto attn = Connect(/*slots=*/1);
  ASSERT_NE(attn, nullptr);
  absl::StatusOr<RemoteAttentionPlan> plan = attn->SetPlan("m", ids, 2);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<std::vector<float>> want_out, want_lse;
  std::vector<std::vector<float>> qs;
  for (int layer = 0; layer < kShape.num_layers; ++layer) {
    qs.push_back(kvpool::testing::GaussianValues(plan->query_bytes / sizeof(float), 40 + layer));
    std::vector<float> out(qs.back().size()), lse(plan->lse_bytes / sizeof(float));
    ASSERT_TRUE(
        attn->Attend(*plan, layer, qs.back(), absl::MakeSpan(out), absl::MakeSpan(lse)).ok());
    want_out.push_back(out);
    want_lse.push_back(lse);
  }
  {
    // One held slot for every layer, as a decode step would use it.
    absl::StatusOr<ShmAttentionClient::InPlaceCall> call = attn->HoldSlot(*plan);
    ASSERT_TRUE(call.ok()) << call.status();
    ASSERT_EQ(call->queries().size(), qs[0].size());
    ASSERT_EQ(call->lse().size(), want_lse[0].size());
    for (int layer = 0; layer < kShape.num_layers; ++layer) {
      std::copy(qs[layer].begin(), qs[layer].end(), call->queries().begin());
      absl::StatusOr<std::vector<uint32_t>> got = attn->AttendInPlace(*call, layer);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(*got, (std::vector<uint32_t>{90, 130}));
      EXPECT_TRUE(std::equal(call->out().begin(), call->out().end(), want_out[layer].begin()))
          << "layer " << layer;
      EXPECT_TRUE(std::equal(call->lse().begin(), call->lse().end(), want_lse[layer].begin()))
          << "layer " << layer;
    }
    // A call object moved from holds nothing; the slot goes back once, with the last owner.
    ShmAttentionClient::InPlaceCall moved = *std::move(call);
    EXPECT_TRUE(absl::IsInvalidArgument(attn->AttendInPlace(*call, 0).status()));
    EXPECT_TRUE(attn->AttendInPlace(moved, 0).ok());
  }
  // The only slot is free again.
  std::vector<float> out(qs[0].size()), lse(plan->lse_bytes / sizeof(float));
  EXPECT_TRUE(attn->Attend(*plan, 0, qs[0], absl::MakeSpan(out), absl::MakeSpan(lse)).ok());
  // A plan whose calls do not fit the slots holds nothing.
  RemoteAttentionPlan too_big = *plan;
  too_big.query_bytes = attn->layout().max_query_bytes + 64;
  EXPECT_TRUE(absl::IsInvalidArgument(attn->HoldSlot(too_big).status()));
}

TEST_F(ShmAttentionTest, PerCallErrorsKeepTheChannelServing) {
  ASSERT_TRUE(CreateAndAppend(client(), "m", "err-a", MakeSequenceKv(kShape, 50, 3), true).ok());
  ASSERT_TRUE(CreateAndAppend(client(), "m", "err-b", MakeSequenceKv(kShape, 20, 4), true).ok());
  auto attn = Connect();
  ASSERT_NE(attn, nullptr);
  absl::StatusOr<RemoteAttentionPlan> plan = attn->SetPlan("m", {"err-a", "err-b"}, 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const std::vector<float> q = kvpool::testing::GaussianValues(plan->query_bytes / 4, 1);
  std::vector<float> out(q.size()), lse(plan->lse_bytes / 4);
  auto call = [&](int layer) {
    return attn->Attend(*plan, layer, q, absl::MakeSpan(out), absl::MakeSpan(lse)).status();
  };
  EXPECT_TRUE(call(0).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(call(kShape.num_layers)));
  EXPECT_TRUE(absl::IsInvalidArgument(call(-1)));
  // Headers no honest client writes: garbage, an unknown plan, sizes that do not match.
  EXPECT_TRUE(absl::IsInvalidArgument(attn->SendRawHeaderForTesting(std::vector<uint8_t>(64, 7))));
  server::CallHeader h{999, 0, 1, plan->query_bytes, plan->lse_bytes};
  EXPECT_TRUE(absl::IsNotFound(attn->SendRawHeaderForTesting(server::EncodeCallHeader(h))));
  h = {plan->id, 0, 1, plan->query_bytes / 2, plan->lse_bytes / 2};
  EXPECT_TRUE(absl::IsInvalidArgument(attn->SendRawHeaderForTesting(server::EncodeCallHeader(h))));
  // A released sequence fails the plan's calls until it exists again.
  ASSERT_TRUE(client().ReleaseSequence("err-b").ok());
  EXPECT_TRUE(absl::IsNotFound(call(1)));
  ASSERT_TRUE(CreateAndAppend(client(), "m", "err-b", MakeSequenceKv(kShape, 9, 4), true).ok());
  absl::StatusOr<std::vector<uint32_t>> again =
      attn->Attend(*plan, 1, q, absl::MakeSpan(out), absl::MakeSpan(lse));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)[1], 9u);
  // Plans the daemon refuses.
  EXPECT_TRUE(absl::IsNotFound(attn->SetPlan("no-such-model", {"err-a"}, 1).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(attn->SetPlan("m", {}, 1).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(attn->SetPlan("m", {""}, 1).status()));
}

TEST_F(ShmAttentionTest, SessionIsBoundToItsSecretAndItsLease) {
  auto stub = v1::TransportService::NewStub(client().channel());
  const v1::SharedMemorySession m = Negotiate();
  ASSERT_NE(m.session_id(), 0u);
  struct stat st {};
  ASSERT_EQ(stat(m.socket_path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // Plans need a connected session.
  {
    v1::SetAttentionPlanRequest p;
    p.set_session_id(m.session_id());
    p.set_model_id("m");
    p.add_sequence_ids("x");
    p.set_num_queries(1);
    v1::SetAttentionPlanResponse pr;
    grpc::ClientContext pc;
    EXPECT_EQ(stub->SetAttentionPlan(&pc, p, &pr).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }
  auto hello = [&](const std::string& secret) -> absl::StatusOr<server::ShmReply> {
    const int s = ConnectSocket(m);
    if (s < 0) return absl::UnavailableError("connect");
    const auto bytes = server::EncodeShmHello({m.session_id(), secret});
    EXPECT_TRUE(server::SendWithFd(s, bytes, -1).ok());
    std::array<uint8_t, server::kShmReplyBytes> reply;
    absl::StatusOr<int> fd = server::ReceiveWithFd(s, absl::MakeSpan(reply), absl::Seconds(30));
    close(s);
    if (!fd.ok()) return fd.status();
    EXPECT_LT(*fd, 0) << "a refused hello gets no region";
    if (*fd >= 0) close(*fd);
    return server::DecodeShmReply(reply);
  };
  std::string wrong = m.session_secret();
  wrong[0] ^= 1;
  absl::StatusOr<server::ShmReply> refused = hello(wrong);
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_TRUE(absl::IsPermissionDenied(refused->status)) << refused->status;
  // The session still waits for its real client; closing it over gRPC ends it.
  grpc::ClientContext cc;
  v1::CloseSessionRequest close_req;
  close_req.set_session_id(m.session_id());
  v1::CloseSessionResponse close_resp;
  EXPECT_TRUE(stub->CloseSession(&cc, close_req, &close_resp).ok());
  absl::StatusOr<server::ShmReply> late = hello(m.session_secret());
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_TRUE(absl::IsPermissionDenied(late->status)) << late->status;

  // A connected client's session ends with its socket (the lease).
  const uint32_t before = Stats().transport().sessions();
  {
    auto attn = Connect();
    ASSERT_NE(attn, nullptr);
    EXPECT_EQ(Stats().transport().sessions(), before + 1);
  }
  EXPECT_TRUE(WaitForStats(
      [&](const v1::GetStatsResponse& s) { return s.transport().sessions() == before; }));
}

TEST_F(ShmAttentionTest, AClientThatVanishesEndsItsSession) {
  const uint32_t before = Stats().transport().sessions();
  const v1::SharedMemorySession m = Negotiate();
  const int s = ConnectSocket(m);
  ASSERT_GE(s, 0);
  ASSERT_TRUE(
      server::SendWithFd(s, server::EncodeShmHello({m.session_id(), m.session_secret()}), -1).ok());
  std::array<uint8_t, server::kShmReplyBytes> reply;
  absl::StatusOr<int> fd = server::ReceiveWithFd(s, absl::MakeSpan(reply), absl::Seconds(30));
  ASSERT_TRUE(fd.ok()) << fd.status();
  ASSERT_GE(*fd, 0);
  absl::StatusOr<server::ShmReply> r = server::DecodeShmReply(reply);
  ASSERT_TRUE(r.ok() && r->status.ok());
  EXPECT_EQ(Stats().transport().sessions(), before + 1);
  // Gone without CloseSession, as a killed process would be: the socket closes.
  close(*fd);
  close(s);
  EXPECT_TRUE(WaitForStats(
      [&](const v1::GetStatsResponse& st) { return st.transport().sessions() == before; }));
  // The daemon serves on.
  auto attn = Connect();
  ASSERT_NE(attn, nullptr);
}

TEST_F(ShmAttentionTest, ConcurrentCallersShareOneChannel) {
  ASSERT_TRUE(CreateAndAppend(client(), "m", "conc-a", MakeSequenceKv(kShape, 120, 8), true).ok());
  auto attn = Connect(/*slots=*/4);
  ASSERT_NE(attn, nullptr);
  absl::StatusOr<RemoteAttentionPlan> plan = attn->SetPlan("m", {"conc-a"}, 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const std::vector<float> q = kvpool::testing::GaussianValues(plan->query_bytes / 4, 9);
  std::vector<float> want(q.size()), want_lse(plan->lse_bytes / 4);
  ASSERT_TRUE(attn->Attend(*plan, 0, q, absl::MakeSpan(want), absl::MakeSpan(want_lse)).ok());
  std::vector<std::thread> threads;
  std::atomic<int> same{0};
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&] {
      std::vector<float> out(q.size()), lse(want_lse.size());
      for (int i = 0; i < 20; ++i) {
        if (attn->Attend(*plan, 0, q, absl::MakeSpan(out), absl::MakeSpan(lse)).ok() &&
            out == want && lse == want_lse)
          ++same;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(same.load(), 6 * 20);
}

}  // namespace
}  // namespace kvpool::integration
