// The UCX data plane's handshake against a real kvpoold (issue 16: no request may kill or wedge
// the daemon). Negotiate offers with garbage in their fields, among them the worker address that
// once aborted the daemon inside UCX (0x09 then 63 zero bytes), get precise statuses; 10,000
// fuzzed offers leave no session behind; a UCX connection joins a session only when its first
// message is a HELLO with the session's id and secret, and every other connection is closed and
// counted. After each, the daemon serves: Health, an inline append read back bit for bit, and a
// push over UCX read back bit for bit. Shared memory and tcp; loopback only; nothing is timed.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/transport/ucx_channel.h"
#include "dataplane/ucx_runtime.h"
#include "dataplane/ucx_wire.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/impl/rpc_method.h"
#include "kvpool/v1/transport_service.grpc.pb.h"
#include "proto/status.h"
#include "tests/integration/integration_util.h"

namespace kvpool::integration {
namespace {

namespace wire = ::kvpool::ucx::wire;

constexpr Shape kShape{/*num_layers=*/2, /*q_heads=*/4, /*kv_heads=*/2, /*head_dim=*/32};
constexpr int kHelloTimeoutMs = 10000;

struct Tls {
  const char* name;
  const char* tls;
};

// Polls until `pred` holds (true) or a generous deadline passes (false).
template <typename Pred>
bool Eventually(Pred pred, absl::Duration limit = absl::Seconds(120)) {
  const absl::Time end = absl::Now() + limit;
  while (absl::Now() < end) {
    if (pred()) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return pred();
}

// The protobuf wire encoding, for offers with arbitrary bytes in their fields (including
// fields this version no longer has, and strings that are not UTF-8).
void PutVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}
void PutVarintField(int field, uint64_t v, std::string* out) {
  PutVarint(static_cast<uint64_t>(field) << 3, out);
  PutVarint(v, out);
}
void PutBytesField(int field, const std::string& bytes, std::string* out) {
  PutVarint((static_cast<uint64_t>(field) << 3) | 2, out);
  PutVarint(bytes.size(), out);
  out->append(bytes);
}

// The worker address that aborted kvpoold inside ucp_address_unpack.
std::string CrashingWorkerAddress() { return std::string(1, '\x09') + std::string(63, '\0'); }

// A UCX peer that speaks the wire format by hand: connects to the daemon's listener and sends
// whatever the test wants first.
class RawPeer {
 public:
  static std::unique_ptr<RawPeer> Connect(const std::string& tls, const v1::UcxSession& s) {
    auto p = std::unique_ptr<RawPeer>(new RawPeer());
    ucx::UcxRuntimeOptions o;
    o.tls = tls;
    o.net_devices = "lo";
    o.keepalive = absl::Milliseconds(500);
    o.name = "raw-peer";
    auto rt = ucx::UcxRuntime::Create(o);
    EXPECT_TRUE(rt.ok()) << rt.status();
    if (!rt.ok()) return nullptr;
    p->rt_ = *std::move(rt);
    RawPeer* raw = p.get();
    EXPECT_TRUE(
        p->rt_
            ->SetAmHandler(wire::kHelloDone,
                           [raw](const void*, size_t, void*, size_t, const ucp_am_recv_param_t*) {
                             absl::MutexLock lock(&raw->mu_);
                             raw->hello_done_ = true;
                             return UCS_OK;
                           })
            .ok());
    p->rt_->Start();
    p->peer_error_handling_ = s.peer_error_handling();
    p->on_error_ = [raw](ucs_status_t) {
      absl::MutexLock lock(&raw->mu_);
      raw->failed_ = true;
    };
    absl::StatusOr<ucp_ep_h> ep = absl::InternalError("not run");
    EXPECT_TRUE(p->rt_
                    ->RunSync([&] {
                      ep = ucx::ConnectToListener(p->rt_.get(), s.listener_host(),
                                                  static_cast<uint16_t>(s.listener_port()),
                                                  s.peer_error_handling(), &p->on_error_);
                    })
                    .ok());
    EXPECT_TRUE(ep.ok()) << ep.status();
    if (!ep.ok()) return nullptr;
    p->ep_ = *ep;
    return p;
  }

  ~RawPeer() {
    (void)rt_->RunSync([this] {
      bool failed;
      {
        absl::MutexLock lock(&mu_);
        failed = failed_;
      }
      ucx::CloseEndpoint(rt_.get(), ep_, failed || peer_error_handling_);
    });
    rt_->Stop(absl::Milliseconds(100));
  }

  // Sends active message `id` (with UCP_AM_SEND_FLAG_REPLY unless `anonymous`), eager.
  void Send(uint16_t id, std::string header, std::string payload = {}, bool anonymous = false) {
    ucx::AmMessage m;
    m.header = std::move(header);
    m.payload = std::move(payload);
    m.flags = UCP_AM_SEND_FLAG_EAGER | (anonymous ? 0 : UCP_AM_SEND_FLAG_REPLY);
    ASSERT_TRUE(rt_->Post([this, id, m = std::move(m)]() mutable {
      ucx::SendAm(rt_.get(), ep_, id, std::move(m), nullptr);
    }));
  }
  void SendHello(uint64_t session_id, const std::string& secret) {
    wire::HelloHeader h{};
    h.session_id = session_id;
    std::copy_n(secret.data(), std::min(secret.size(), sizeof(h.secret)), h.secret);
    h.wire_version = wire::kWireVersion;
    Send(wire::kHello, wire::Encode(h));
  }

  // The daemon answered HELLO_DONE / closed the connection.
  bool accepted() {
    absl::MutexLock lock(&mu_);
    return hello_done_;
  }
  bool closed_by_daemon() {
    absl::MutexLock lock(&mu_);
    return failed_;
  }

 private:
  RawPeer() = default;
  std::unique_ptr<ucx::UcxRuntime> rt_;
  ucp_ep_h ep_ = nullptr;
  bool peer_error_handling_ = true;
  std::function<void(ucs_status_t)> on_error_;
  absl::Mutex mu_;
  bool hello_done_ ABSL_GUARDED_BY(mu_) = false;
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
};

class UcxHandshakeTest : public ::testing::TestWithParam<Tls> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<LocalDaemon>> d = StartDaemon(
        {"--pool_bytes=67108864", "--worker_threads=2", "--shutdown_grace_ms=10000",
         "--transports=ucx", absl::StrCat("--ucx_tls=", GetParam().tls), "--ucx_net_devices=lo",
         "--transport_staging_bytes=4194304", "--transport_message_bytes=262144",
         absl::StrCat("--transport_hello_timeout_ms=", kHelloTimeoutMs)});
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    client::ClientOptions options;
    options.deadline = absl::Seconds(300);
    auto c = KvpoolClient::Connect(daemon_->target(), options);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
    stub_ = v1::TransportService::NewStub(client_->channel());
    raw_negotiate_ = std::make_unique<grpc::internal::RpcMethod>(
        "/kvpool.v1.TransportService/Negotiate", grpc::internal::RpcMethod::NORMAL_RPC,
        client_->channel());
    const v1::TransportStats t = Transport();
    // grpc_inline, ucx, shared_memory: the order the daemon offers them in.
    ASSERT_EQ(t.available_size(), 3) << "kvpoold's UCX did not start";
    ASSERT_EQ(t.available(1), "ucx");
    ASSERT_EQ(t.available(2), "shared_memory");
    v1::QuantConfig bypass;
    bypass.set_method(v1::QUANT_METHOD_BYPASS);
    absl::StatusOr<v1::ModelInfo> m =
        RegisterDataFree(*client_, "exact", kShape, v1::ROTATION_KIND_IDENTITY, 0, bypass);
    ASSERT_TRUE(m.ok()) << m.status();
  }

  void TearDown() override {
    if (daemon_ == nullptr) return;
    client_.reset();
    const absl::Status stopped = daemon_->Stop(absl::Seconds(120));
    EXPECT_TRUE(stopped.ok()) << "kvpoold did not exit cleanly: " << stopped;
  }

  v1::TransportStats Transport() {
    absl::StatusOr<v1::GetStatsResponse> s = client_->GetStats();
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->transport() : v1::TransportStats();
  }

  absl::StatusOr<v1::NegotiateResponse> Negotiate(const v1::NegotiateRequest& request) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
    v1::NegotiateResponse response;
    const grpc::Status s = stub_->Negotiate(&context, request, &response);
    if (!s.ok()) return FromGrpcStatus(s, "Negotiate");
    return response;
  }
  // Negotiate with a request of any bytes.
  absl::StatusOr<v1::NegotiateResponse> NegotiateBytes(const std::string& request) {
    grpc::Slice slice(request);
    grpc::ByteBuffer in(&slice, 1);
    grpc::ByteBuffer out;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
    const grpc::Status s = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
        client_->channel().get(), *raw_negotiate_, &context, in, &out);
    if (!s.ok()) return FromGrpcStatus(s, "Negotiate");
    std::vector<grpc::Slice> slices;
    if (!out.Dump(&slices).ok()) return absl::InternalError("unreadable answer");
    std::string bytes;
    for (const grpc::Slice& sl : slices) {
      bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
    }
    v1::NegotiateResponse response;
    if (!response.ParseFromString(bytes)) return absl::InternalError("unparseable answer");
    return response;
  }

  absl::Status CloseSession(uint64_t id) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
    v1::CloseSessionRequest request;
    request.set_session_id(id);
    v1::CloseSessionResponse response;
    return FromGrpcStatus(stub_->CloseSession(&context, request, &response), "CloseSession");
  }

  // A valid UCX offer from this process.
  v1::TransportOffer GoodOffer() {
    v1::TransportOffer o;
    o.set_kind(v1::TRANSPORT_KIND_UCX);
    o.set_wire_version(wire::kWireVersion);
    o.set_ucx_transports(GetParam().tls);
    const ucx::ProcessIdentity self = ucx::SelfProcess();
    o.set_pid(self.pid);
    o.set_process_start_time(self.start_time);
    o.set_boot_id(self.boot_id);
    return o;
  }
  v1::UcxSession NewSession() {
    v1::NegotiateRequest r;
    *r.add_offers() = GoodOffer();
    absl::StatusOr<v1::NegotiateResponse> a = Negotiate(r);
    EXPECT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a.ok() ? a->kind() : v1::TRANSPORT_KIND_UNSPECIFIED, v1::TRANSPORT_KIND_UCX);
    return a.ok() ? a->ucx() : v1::UcxSession();
  }

  // Health is SERVING, an inline append of a new sequence reads back bit for bit, and so does a
  // layer-wise push over a new UCX channel.
  void ExpectServing(const std::string& tag) {
    absl::StatusOr<KvpoolClient::ServingStatus> h = client_->Health();
    ASSERT_TRUE(h.ok()) << h.status();
    EXPECT_EQ(*h, grpc::health::v1::HealthCheckResponse::SERVING);
    const SequenceKv inline_kv = MakeSequenceKv(kShape, 37, 11);
    ASSERT_TRUE(CreateAndAppend(*client_, "exact", "inline-" + tag, inline_kv, true).ok());
    ExpectStored("inline-" + tag, inline_kv);

    client::UcxChannelOptions o;
    o.runtime.tls = GetParam().tls;
    o.runtime.net_devices = "lo";
    o.runtime.keepalive = absl::Milliseconds(500);
    o.deadline = absl::Seconds(120);
    auto ch = client::UcxChannel::Connect(client_->channel(), o);
    ASSERT_TRUE(ch.ok()) << ch.status();
    const SequenceKv kv = MakeSequenceKv(kShape, 300, 12);
    ASSERT_TRUE(client_->CreateSequence("exact", "ucx-" + tag).ok());
    auto push = (*ch)->BeginPush({"ucx-" + tag, 0, static_cast<uint32_t>(kv.tokens), true, {}});
    ASSERT_TRUE(push.ok()) << push.status();
    for (int l = 0; l < kShape.num_layers; ++l) {
      ASSERT_TRUE((*push)->PushLayer(l, 0, kv.tokens, AsBytes(kv.k[l]), AsBytes(kv.v[l])).ok());
    }
    absl::StatusOr<client::UcxPushResult> r = (*push)->Finish();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->total_tokens, static_cast<uint32_t>(kv.tokens));
    push->reset();
    ch->reset();  // CloseSession
    ExpectStored("ucx-" + tag, kv);
  }

  void ExpectStored(const std::string& id, const SequenceKv& kv) {
    v1::ReadKvRequest all;
    all.set_sequence_id(id);
    absl::StatusOr<client::KvRead> read = client_->ReadKv(all);
    ASSERT_TRUE(read.ok()) << read.status();
    ASSERT_EQ(read->layers.size(), static_cast<size_t>(kShape.num_layers));
    for (int l = 0; l < kShape.num_layers; ++l) {
      EXPECT_TRUE(read->layers[l].k == AsBytes(kv.k[l])) << id << " layer " << l << " keys";
      EXPECT_TRUE(read->layers[l].v == AsBytes(kv.v[l])) << id << " layer " << l << " values";
    }
  }

  std::unique_ptr<LocalDaemon> daemon_;
  std::unique_ptr<KvpoolClient> client_;
  std::unique_ptr<v1::TransportService::Stub> stub_;
  std::unique_ptr<grpc::internal::RpcMethod> raw_negotiate_;
};

TEST_P(UcxHandshakeTest, GarbageOffersGetPreciseStatusesAndTheDaemonServes) {
  const bool shm = ucx::SharedMemoryOnly(GetParam().tls);
  // The request that aborted kvpoold: a UCX offer whose worker address (field 2, now reserved)
  // is 0x09 then 63 zero bytes, nothing else. It names no wire version.
  std::string offer;
  PutVarintField(1, v1::TRANSPORT_KIND_UCX, &offer);
  PutBytesField(2, CrashingWorkerAddress(), &offer);
  std::string request;
  PutBytesField(1, offer, &request);
  absl::StatusOr<v1::NegotiateResponse> a = NegotiateBytes(request);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument) << a.status();

  // The same address beside a valid offer: ignored, never handed to UCX; the session works.
  offer = GoodOffer().SerializeAsString();
  PutBytesField(2, CrashingWorkerAddress(), &offer);
  request.clear();
  PutBytesField(1, offer, &request);
  a = NegotiateBytes(request);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->kind(), v1::TRANSPORT_KIND_UCX);
  EXPECT_EQ(a->ucx().session_secret().size(), 16u);
  EXPECT_TRUE(CloseSession(a->ucx().session_id()).ok());

  // Other wire versions.
  for (uint32_t version : {0u, 1u, 2u, wire::kWireVersion + 1, 0xffffffffu}) {
    v1::NegotiateRequest r;
    *r.add_offers() = GoodOffer();
    r.mutable_offers(0)->set_wire_version(version);
    a = Negotiate(r);
    EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument)
        << version << ": " << a.status();
  }

  // A process this daemon cannot watch: refused by a shared-memory daemon (it could not tell
  // when the client dies), accepted over tcp (UCX peer error handling).
  for (const auto& [pid, boot] : std::vector<std::pair<uint32_t, std::string>>{
           {0u, ""}, {0xffffffffu, "not a boot id"}, {1u, std::string(4096, 'b')}}) {
    v1::NegotiateRequest r;
    *r.add_offers() = GoodOffer();
    r.mutable_offers(0)->set_pid(pid);
    r.mutable_offers(0)->set_boot_id(boot);
    r.mutable_offers(0)->set_process_start_time(0x123456789abcdefull);
    r.mutable_offers(0)->set_ucx_transports(std::string(300, '\n'));
    r.set_client_name("\x1b[31mred\r\nfake log line");
    a = Negotiate(r);
    if (shm) {
      EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument) << pid << ": " << a.status();
    } else {
      ASSERT_TRUE(a.ok()) << pid << ": " << a.status();
      EXPECT_TRUE(CloseSession(a->ucx().session_id()).ok());
    }
  }

  // An unknown kind is skipped: the fallback.
  v1::NegotiateRequest unknown;
  unknown.add_offers()->set_kind(static_cast<v1::TransportKind>(77));
  a = Negotiate(unknown);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->kind(), v1::TRANSPORT_KIND_GRPC_INLINE);

  EXPECT_EQ(Transport().sessions(), 0u);
  ExpectServing("garbage");
  EXPECT_EQ(Transport().sessions(), 0u);
}

TEST_P(UcxHandshakeTest, FuzzedOffersLeaveNoSessionBehind) {
  const uint64_t seed = 0x16u + (ucx::SharedMemoryOnly(GetParam().tls) ? 1 : 0);
  std::printf("fuzzed Negotiate offers: seed %llu\n", static_cast<unsigned long long>(seed));
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  auto chance = [&rng](int percent) { return static_cast<int>(rng() % 100) < percent; };
  auto random_bytes = [&rng](size_t max) {
    std::string s(rng() % (max + 1), '\0');
    for (char& c : s) c = static_cast<char>(rng());
    return s;
  };
  // Random text for string fields: valid UTF-8 (control characters, ASCII, 2- and 3-byte
  // characters) but for one in 20, raw bytes (which gRPC cannot parse into the message).
  auto random_text = [&](size_t max) {
    if (chance(5)) return random_bytes(max);
    std::string s;
    const size_t n = rng() % (max + 1);
    while (s.size() < n) {
      const uint32_t kind = rng() % 8;
      const uint32_t cp =
          kind < 5 ? rng() % 0x80 : (kind < 7 ? 0x80 + rng() % 0x780 : 0x800 + rng() % 0xd000);
      if (cp < 0x80) {
        s.push_back(static_cast<char>(cp));
      } else if (cp < 0x800) {
        s.push_back(static_cast<char>(0xc0 | (cp >> 6)));
        s.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
      } else {
        s.push_back(static_cast<char>(0xe0 | (cp >> 12)));
        s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
        s.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
      }
    }
    return s;
  };
  const ucx::ProcessIdentity self = ucx::SelfProcess();
  std::map<absl::StatusCode, int> outcomes;
  int ucx_sessions = 0;
  for (int i = 0; i < 10000; ++i) {
    std::string request;
    const int offers = static_cast<int>(rng() % 4);
    for (int o = 0; o < offers; ++o) {
      std::string offer;
      if (chance(5)) {
        offer = random_bytes(96);  // not even protobuf
      } else {
        if (chance(70)) PutVarintField(1, chance(60) ? 2 : (chance(50) ? 1 : rng()), &offer);
        if (chance(40)) {
          PutBytesField(2, chance(20) ? CrashingWorkerAddress() : random_bytes(128), &offer);
        }
        if (chance(50)) PutBytesField(3, random_text(40), &offer);
        if (chance(50)) PutVarintField(4, chance(30) ? self.pid : rng(), &offer);
        if (chance(50)) PutVarintField(5, chance(30) ? self.start_time : rng(), &offer);
        if (chance(50)) PutBytesField(6, chance(30) ? self.boot_id : random_text(40), &offer);
        if (chance(60)) PutVarintField(7, chance(60) ? wire::kWireVersion : rng(), &offer);
        if (chance(10)) {  // a field this version does not know
          PutBytesField(8 + static_cast<int>(rng() % 40), random_bytes(32), &offer);
        }
      }
      PutBytesField(1, offer, &request);
    }
    if (chance(30)) PutBytesField(2, random_text(64), &request);  // client_name
    absl::StatusOr<v1::NegotiateResponse> a = NegotiateBytes(request);
    ++outcomes[a.status().code()];
    // A request that parses is answered (OK) or refused (INVALID_ARGUMENT); one that does not
    // (bytes that are not protobuf, strings that are not UTF-8) never reaches the handler, and
    // gRPC's callback API answers it UNIMPLEMENTED. Never anything else.
    v1::NegotiateRequest parsed;
    if (parsed.ParseFromString(request)) {
      ASSERT_TRUE(a.ok() || absl::IsInvalidArgument(a.status()))
          << "offer " << i << " (" << request.size() << " bytes): " << a.status();
    } else {
      ASSERT_TRUE(absl::IsUnimplemented(a.status()))
          << "unparseable offer " << i << " (" << request.size() << " bytes): " << a.status();
    }
    if (a.ok() && a->kind() == v1::TRANSPORT_KIND_UCX) {
      ++ucx_sessions;
      ASSERT_TRUE(CloseSession(a->ucx().session_id()).ok()) << "offer " << i;
    }
  }
  std::printf("outcomes: OK %d (UCX sessions %d), INVALID_ARGUMENT %d, unparseable %d\n",
              outcomes[absl::StatusCode::kOk], ucx_sessions,
              outcomes[absl::StatusCode::kInvalidArgument],
              outcomes[absl::StatusCode::kUnimplemented]);
  EXPECT_GT(ucx_sessions, 0);
  EXPECT_GT(outcomes[absl::StatusCode::kInvalidArgument], 0);
  const v1::TransportStats t = Transport();
  EXPECT_EQ(t.sessions(), 0u);
  EXPECT_EQ(t.open_pushes(), 0u);
  ExpectServing("fuzz");
  EXPECT_EQ(Transport().sessions(), 0u);
}

TEST_P(UcxHandshakeTest, ConnectionsJoinOnlyTheirSessionWithItsSecret) {
  const std::string tls = GetParam().tls;
  const v1::UcxSession a = NewSession();
  const v1::UcxSession b = NewSession();
  ASSERT_NE(a.session_id(), b.session_id());
  ASSERT_NE(a.session_secret(), b.session_secret());
  uint64_t refused = Transport().connections_refused();
  // Each refusal is counted and the daemon closes the connection.
  auto expect_refused = [&](RawPeer* peer, const char* what) {
    EXPECT_TRUE(Eventually([&] { return Transport().connections_refused() == refused + 1; }))
        << what << ": refusals " << Transport().connections_refused() << ", expected "
        << refused + 1;
    refused = Transport().connections_refused();
    EXPECT_TRUE(Eventually([&] { return peer->closed_by_daemon(); })) << what;
    EXPECT_FALSE(peer->accepted()) << what;
  };

  {  // A wrong secret.
    std::unique_ptr<RawPeer> p = RawPeer::Connect(tls, a);
    ASSERT_NE(p, nullptr);
    std::string wrong = a.session_secret();
    wrong[5] ^= 0x40;
    p->SendHello(a.session_id(), wrong);
    expect_refused(p.get(), "wrong secret");
  }
  {  // Another session's id with this one's secret.
    std::unique_ptr<RawPeer> p = RawPeer::Connect(tls, a);
    ASSERT_NE(p, nullptr);
    p->SendHello(b.session_id(), a.session_secret());
    expect_refused(p.get(), "another session's id");
  }
  {  // A session that does not exist.
    std::unique_ptr<RawPeer> p = RawPeer::Connect(tls, a);
    ASSERT_NE(p, nullptr);
    p->SendHello(a.session_id() ^ 0x10000, a.session_secret());
    expect_refused(p.get(), "unknown session");
  }
  {  // Something else first: PUSH_BEGIN naming session a (with its own id).
    std::unique_ptr<RawPeer> p = RawPeer::Connect(tls, a);
    ASSERT_NE(p, nullptr);
    wire::PushBeginHeader h{};
    h.session_id = a.session_id();
    h.push_id = 1;
    h.num_tokens = 1;
    h.sequence_id_bytes = 1;
    p->Send(wire::kPushBegin, wire::Encode(h), "s");
    expect_refused(p.get(), "PUSH_BEGIN first");
  }
  {  // A HELLO of the wrong size.
    std::unique_ptr<RawPeer> p = RawPeer::Connect(tls, a);
    ASSERT_NE(p, nullptr);
    p->Send(wire::kHello, std::string(7, '\x01'));
    expect_refused(p.get(), "short HELLO");
  }
  // None of that harmed session a: its own connection joins it, once.
  std::unique_ptr<RawPeer> bound = RawPeer::Connect(tls, a);
  ASSERT_NE(bound, nullptr);
  bound->SendHello(a.session_id(), a.session_secret());
  EXPECT_TRUE(Eventually([&] { return bound->accepted(); })) << "the right HELLO was not answered";
  {  // A second connection with the same (right) secret.
    std::unique_ptr<RawPeer> p = RawPeer::Connect(tls, a);
    ASSERT_NE(p, nullptr);
    p->SendHello(a.session_id(), a.session_secret());
    expect_refused(p.get(), "second connection of a session");
  }
  {  // Silence (a HELLO without UCP_AM_SEND_FLAG_REPLY names no connection): closed after the
     // hello timeout.
    std::unique_ptr<RawPeer> p = RawPeer::Connect(tls, a);
    ASSERT_NE(p, nullptr);
    wire::HelloHeader h{};
    h.session_id = b.session_id();
    std::copy_n(b.session_secret().data(), sizeof(h.secret), h.secret);
    h.wire_version = wire::kWireVersion;
    p->Send(wire::kHello, wire::Encode(h), {}, /*anonymous=*/true);
    expect_refused(p.get(), "silent connection");
  }
  EXPECT_FALSE(bound->closed_by_daemon());
  EXPECT_TRUE(CloseSession(a.session_id()).ok());
  // Session b was never connected: it ended after the hello timeout (or ends now).
  const absl::Status closed_b = CloseSession(b.session_id());
  EXPECT_TRUE(closed_b.ok() || absl::IsNotFound(closed_b)) << closed_b;
  EXPECT_TRUE(Eventually([&] { return bound->closed_by_daemon(); }));
  bound.reset();
  EXPECT_EQ(Transport().sessions(), 0u);
  ExpectServing("handshake");
  EXPECT_EQ(Transport().connections_refused(), refused) << "the real client was refused";
  EXPECT_EQ(Transport().sessions(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Loopback, UcxHandshakeTest,
                         ::testing::Values(Tls{"shm", "posix,sysv,cma"}, Tls{"tcp", "tcp"}),
                         [](const ::testing::TestParamInfo<Tls>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace kvpool::integration
