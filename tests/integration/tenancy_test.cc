// Multi-tenancy through a real kvpoold with TLS, client certificates and bearer tokens, all
// generated at test time (make_test_certs.sh): the isolation matrix (every RPC x {own tenant,
// other tenant, no credentials, wrong token, certificate of another CA, expired certificate}),
// roles, prefix reuse never crossing tenants, a tenant removed while its stream runs, reloads
// that fail, certificate rotation while serving, and the safe defaults at start.
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/transport/ucx_channel.h"
#include "kvpool/v1/kv_event_service.grpc.pb.h"
#include "kvpool/v1/transport_service.grpc.pb.h"
#include "server/auth/token_hash.h"
#include "tests/integration/integration_util.h"

namespace kvpool::integration {
namespace {

using client::ChannelSecurity;
using client::ClientOptions;
using C = absl::StatusCode;

constexpr Shape kShape{/*num_layers=*/2, /*q_heads=*/8, /*kv_heads=*/2, /*head_dim=*/64};
constexpr char kTokA[] = "tok-a-8f1e2d3c4b5a";
constexpr char kTokB[] = "tok-b-0a9b8c7d6e5f";
constexpr char kTokAdmin[] = "tok-admin-77aa88bb";
constexpr char kTokRouter[] = "tok-router-1234abcd";
constexpr char kTokDoomed[] = "tok-doomed-5566ccdd";

std::string Hash(const std::string& token) { return server::HexOf(server::Sha256Of(token)); }

std::string TenantsText(bool with_doomed) {
  std::string t = absl::StrCat(
      "tenant { name: \"team-a\" role: ROLE_TENANT token_sha256: \"", Hash(kTokA),
      "\" certificate_name: \"team-a\" }\n",
      "tenant { name: \"team-b\" role: ROLE_TENANT token_sha256: \"", Hash(kTokB),
      "\" certificate_name: \"team-b-cert\" }\n",
      "tenant { name: \"ops\" role: ROLE_ADMIN token_sha256: \"", Hash(kTokAdmin), "\" }\n",
      "tenant { name: \"router\" role: ROLE_ROUTER token_sha256: \"", Hash(kTokRouter), "\" }\n");
  if (with_doomed) {
    absl::StrAppend(&t, "tenant { name: \"doomed\" role: ROLE_TENANT token_sha256: \"",
                    Hash(kTokDoomed), "\" }\n");
  }
  return t;
}

// Replaces `path` atomically (the daemon never reads half a file).
void WriteFile(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
  }
  ASSERT_EQ(std::rename(tmp.c_str(), path.c_str()), 0) << path;
}

void CopyFile(const std::string& from, const std::string& to) {
  std::ifstream in(from);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_FALSE(text.empty()) << from;
  WriteFile(to, text);
}

// Polls `done` for up to two minutes (loaded machines); the answer, never a timing.
bool Eventually(const std::function<bool()>& done) {
  const absl::Time give_up = absl::Now() + absl::Minutes(2);
  while (absl::Now() < give_up) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return done();
}

class TenancyTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    char tmpl[] = "/tmp/kvpool-tenancy-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = new std::string(tmpl);
    const std::string script =
        std::string(KVPOOL_SOURCE_DIR) + "/tests/integration/make_test_certs.sh";
    ASSERT_EQ(std::system((script + " " + *dir_ + "/certs").c_str()), 0);
    ASSERT_EQ(std::system(("mkdir -p " + *dir_ + "/live").c_str()), 0);
    CopyFile(Cert("server.pem"), *dir_ + "/live/server.pem");
    CopyFile(Cert("server.key"), *dir_ + "/live/server.key");
    WriteFile(TenantsPath(), TenantsText(/*with_doomed=*/true));
    ClientOptions health;
    health.security.tls_root_ca_file = Cert("ca.pem");
    auto d = StartDaemon(
        {"--pool_bytes=268435456", "--worker_threads=2", "--shutdown_grace_ms=10000",
         "--tenants_file=" + TenantsPath(), "--tenants_poll_ms=100",
         "--tls_cert=" + *dir_ + "/live/server.pem", "--tls_key=" + *dir_ + "/live/server.key",
         "--tls_client_ca=" + Cert("ca.pem"), "--tls_refresh_seconds=1"},
        health);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = d->release();
  }
  static void TearDownTestSuite() {
    if (daemon_ != nullptr) {
      EXPECT_TRUE(daemon_->Stop(absl::Seconds(120)).ok());
      delete daemon_;
      daemon_ = nullptr;
    }
    if (dir_ != nullptr) {
      (void)std::system(("rm -rf " + *dir_).c_str());
      delete dir_;
      dir_ = nullptr;
    }
  }
  void SetUp() override { ASSERT_NE(daemon_, nullptr) << "kvpoold did not start"; }

  static std::string Cert(const std::string& name) { return *dir_ + "/certs/" + name; }
  static std::string TenantsPath() { return *dir_ + "/tenants.txtpb"; }

  static ChannelSecurity Token(const std::string& token) {
    ChannelSecurity s;
    s.tls_root_ca_file = Cert("ca.pem");
    s.token = token;
    return s;
  }
  static ChannelSecurity Certificate(const std::string& stem) {
    ChannelSecurity s;
    s.tls_root_ca_file = Cert("ca.pem");
    s.tls_cert_file = Cert(stem + ".pem");
    s.tls_key_file = Cert(stem + ".key");
    return s;
  }
  static std::unique_ptr<KvpoolClient> As(const ChannelSecurity& security) {
    ClientOptions o;
    o.deadline = absl::Seconds(120);
    o.security = security;
    auto c = KvpoolClient::Connect(daemon_->target(), o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  static std::string* dir_;
  static LocalDaemon* daemon_;
};

std::string* TenancyTest::dir_ = nullptr;
LocalDaemon* TenancyTest::daemon_ = nullptr;

std::vector<uint32_t> Prompt(int n, uint32_t salt) {
  std::vector<uint32_t> ids(n);
  for (int i = 0; i < n; ++i) ids[i] = (static_cast<uint32_t>(i) * 2654435761u + salt) % 50000;
  return ids;
}

// What a caller names when it touches tenant A's objects.
struct Target {
  std::string model = "m-a";
  std::string sequence = "s-a";
  uint64_t session = 0;
  std::vector<uint32_t> prompt;
};

absl::Status Transport(const KvpoolClient& c, const std::string& method, uint64_t session) {
  auto stub = v1::TransportService::NewStub(c.channel());
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
  grpc::Status s;
  if (method == "CloseSession") {
    v1::CloseSessionRequest r;
    r.set_session_id(session);
    v1::CloseSessionResponse out;
    s = stub->CloseSession(&ctx, r, &out);
  } else if (method == "WatchSession") {
    v1::WatchSessionRequest r;
    r.set_session_id(session);
    auto reader = stub->WatchSession(&ctx, r);
    v1::WatchSessionResponse out;
    while (reader->Read(&out)) ctx.TryCancel();  // a live watch: stop after its first message
    s = reader->Finish();
  } else if (method == "SetAttentionPlan") {
    v1::SetAttentionPlanRequest r;
    r.set_session_id(session);
    r.set_model_id("m-a");
    r.add_sequence_ids("s-a");
    r.set_num_queries(1);
    v1::SetAttentionPlanResponse out;
    s = stub->SetAttentionPlan(&ctx, r, &out);
  } else if (method == "DropAttentionPlan") {
    v1::DropAttentionPlanRequest r;
    r.set_session_id(session);
    r.set_plan_id(1);
    v1::DropAttentionPlanResponse out;
    s = stub->DropAttentionPlan(&ctx, r, &out);
  } else if (method == "PushKv") {
    v1::AppendKvResponse out;
    auto writer = stub->PushKv(&ctx, &out);
    v1::DevicePushRequest r;
    r.mutable_header()->set_session_id(session);
    v1::AppendKvHeader* h = r.mutable_header()->mutable_append();
    h->set_sequence_id("s-a");
    h->set_num_tokens(1);
    h->set_dtype(v1::DTYPE_BF16);
    writer->Write(r);
    writer->WritesDone();
    s = writer->Finish();
  } else if (method == "FetchToDevice") {
    v1::FetchToDeviceRequest r;
    r.set_session_id(session);
    r.mutable_read()->set_sequence_id("s-a");
    v1::FetchToDeviceResponse out;
    s = stub->FetchToDevice(&ctx, r, &out);
  } else {  // Negotiate: grpc_inline only
    v1::NegotiateRequest r;
    r.add_offers()->set_kind(v1::TRANSPORT_KIND_GRPC_INLINE);
    v1::NegotiateResponse out;
    s = stub->Negotiate(&ctx, r, &out);
  }
  return FromGrpcStatus(s, method);
}

// Every RPC of the API, each naming tenant A's objects where it names any.
struct Rpc {
  std::string name;
  std::function<absl::Status(const KvpoolClient&, const Target&)> call;
};

std::vector<Rpc> AllRpcs() {
  std::vector<Rpc> r;
  r.push_back(
      {"RegisterModel", [](const KvpoolClient& c, const Target& t) {
         return RegisterDataFree(c, t.model, kShape, v1::ROTATION_KIND_HADAMARD, 1).status();
       }});
  r.push_back(
      {"ListModels", [](const KvpoolClient& c, const Target&) { return c.ListModels().status(); }});
  r.push_back({"DescribeModel", [](const KvpoolClient& c, const Target& t) {
                 return c.DescribeModel(t.model, false).status();
               }});
  r.push_back({"DeleteModel", [](const KvpoolClient& c, const Target& t) {
                 return c.DeleteModel(t.model, /*force=*/true).status();
               }});
  r.push_back({"CreateSequence", [](const KvpoolClient& c, const Target& t) {
                 return c.CreateSequence(t.model, t.sequence + "-new").status();
               }});
  r.push_back({"AppendKv", [](const KvpoolClient& c, const Target& t) {
                 const SequenceKv kv = MakeSequenceKv(kShape, 4, 9);
                 v1::AppendKvHeader h;
                 h.set_sequence_id(t.sequence);
                 h.set_token_start(1 << 20);  // never valid: nothing may be appended
                 h.set_num_tokens(4);
                 h.set_dtype(v1::DTYPE_BF16);
                 std::vector<client::LayerKv> layers;
                 for (int l = 0; l < kShape.num_layers; ++l) {
                   layers.push_back({l, AsBytes(kv.k[l]), AsBytes(kv.v[l])});
                 }
                 return c.AppendKv(h, layers).status();
               }});
  r.push_back({"AppendDecode", [](const KvpoolClient& c, const Target& t) {
                 v1::AppendDecodeRequest d;
                 d.set_sequence_id(t.sequence);
                 d.set_token_start(1 << 20);
                 d.set_num_tokens(1);
                 d.set_dtype(v1::DTYPE_BF16);
                 const std::string bytes(kShape.num_layers * kShape.kv_heads * kShape.head_dim * 2,
                                         '\0');
                 d.set_k(bytes);
                 d.set_v(bytes);
                 return c.AppendDecode(d).status();
               }});
  r.push_back({"SealSequence", [](const KvpoolClient& c, const Target& t) {
                 return c.SealSequence(t.sequence).status();
               }});
  r.push_back({"ReleaseSequence", [](const KvpoolClient& c, const Target& t) {
                 return c.ReleaseSequence(t.sequence).status();
               }});
  r.push_back({"DescribeSequence", [](const KvpoolClient& c, const Target& t) {
                 return c.DescribeSequence(t.sequence).status();
               }});
  r.push_back({"LookupPrefix", [](const KvpoolClient& c, const Target& t) {
                 return c.LookupPrefix(t.model, t.prompt).status();
               }});
  r.push_back({"ReadBlocks", [](const KvpoolClient& c, const Target& t) {
                 v1::ReadBlocksRequest q;
                 q.set_sequence_id(t.sequence);
                 return c.ReadBlocks(q).status();
               }});
  r.push_back({"ReadKv", [](const KvpoolClient& c, const Target& t) {
                 v1::ReadKvRequest q;
                 q.set_sequence_id(t.sequence);
                 return c.ReadKv(q).status();
               }});
  r.push_back({"Attend", [](const KvpoolClient& c, const Target& t) {
                 v1::AttendRequest q;
                 q.set_model_id(t.model);
                 q.set_layer(0);
                 q.set_dtype(v1::DTYPE_FP32);
                 v1::SequenceQuery* sq = q.add_queries();
                 sq->set_sequence_id(t.sequence);
                 sq->set_q(std::string(kShape.q_heads * kShape.head_dim * 4, '\0'));
                 return c.Attend(q).status();
               }});
  r.push_back({"GetStats", [](const KvpoolClient& c, const Target&) {
                 return c.GetStats(/*include_sequences=*/true).status();
               }});
  r.push_back({"SubscribeKvEvents", [](const KvpoolClient& c, const Target&) {
                 auto stub = v1::KvEventService::NewStub(c.channel());
                 grpc::ClientContext ctx;
                 ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
                 auto reader = stub->SubscribeKvEvents(&ctx, v1::SubscribeKvEventsRequest());
                 // A live feed: its first event (the replay's start) says it was accepted.
                 v1::KvEvent first;
                 const bool accepted = reader->Read(&first);
                 if (accepted) ctx.TryCancel();
                 const grpc::Status s = reader->Finish();
                 return accepted ? absl::OkStatus() : FromGrpcStatus(s, "SubscribeKvEvents");
               }});
  for (const char* m : {"Negotiate", "CloseSession", "PushKv", "WatchSession", "SetAttentionPlan",
                        "DropAttentionPlan", "FetchToDevice"}) {
    r.push_back(
        {m, [m](const KvpoolClient& c, const Target& t) { return Transport(c, m, t.session); }});
  }
  return r;
}

// Tenant A's objects: a model, a sequence holding a prompt's K/V (prefix units published).
Target MakeTenantAObjects(const KvpoolClient& a) {
  Target t;
  t.prompt = Prompt(64 + 3 * 16 + 256, 5);
  EXPECT_TRUE(RegisterDataFree(a, t.model, kShape, v1::ROTATION_KIND_HADAMARD, 1).ok());
  const SequenceKv kv = MakeSequenceKv(kShape, static_cast<int>(t.prompt.size()), 3);
  auto r = CreateAndAppend(a, t.model, t.sequence, kv, /*end_of_prefill=*/true, t.prompt);
  EXPECT_TRUE(r.ok()) << r.status();
  t.session = 0x5eed5eed5eed5eedull;  // grpc_inline has no sessions: any id is nobody's
  return t;
}

TEST_F(TenancyTest, IsolationMatrixOverEveryRpc) {
  auto a = As(Token(kTokA));
  auto b = As(Certificate("client-cn"));  // team-b by its certificate's CN
  auto none = As(Token(""));
  auto wrong = As(Token("tok-a-8f1e2d3c4b5b"));
  auto other_ca = As(Certificate("client-other-ca"));
  auto expired = As(Certificate("client-expired"));
  ASSERT_TRUE(a && b && none && wrong && other_ca && expired);
  const Target target = MakeTenantAObjects(*a);
  Target missing = target;
  missing.model = "m-missing";
  missing.sequence = "s-missing";

  const std::vector<Rpc> rpcs = AllRpcs();
  ASSERT_EQ(rpcs.size(), 23u);
  for (const Rpc& rpc : rpcs) {
    SCOPED_TRACE(rpc.name);
    // No credentials, a wrong token: UNAUTHENTICATED before any handler. A certificate of
    // another CA or an expired one: the TLS handshake fails, so no call is made at all.
    ExpectRejectedAndPoolUnchanged(*a, C::kUnauthenticated, rpc.name + " without credentials",
                                   [&] { return rpc.call(*none, target); });
    ExpectRejectedAndPoolUnchanged(*a, C::kUnauthenticated, rpc.name + " with a wrong token",
                                   [&] { return rpc.call(*wrong, target); });
    ExpectRejectedAndPoolUnchanged(*a, C::kUnavailable, rpc.name + " with another CA's cert",
                                   [&] { return rpc.call(*other_ca, target); });
    ExpectRejectedAndPoolUnchanged(*a, C::kUnavailable, rpc.name + " with an expired cert",
                                   [&] { return rpc.call(*expired, target); });
  }

  // Tenant B naming A's objects gets exactly what A gets for objects that do not exist.
  for (const Rpc& rpc : rpcs) {
    SCOPED_TRACE(rpc.name);
    if (rpc.name == "RegisterModel" || rpc.name == "ListModels" || rpc.name == "GetStats" ||
        rpc.name == "Negotiate" || rpc.name == "SubscribeKvEvents") {
      continue;  // they name nothing of A's: below
    }
    const absl::Status as_missing = rpc.call(*a, missing);
    ASSERT_FALSE(as_missing.ok()) << as_missing;
    ExpectRejectedAndPoolUnchanged(*a, as_missing.code(), rpc.name + " on A's objects by B",
                                   [&] { return rpc.call(*b, target); });
  }
  // B registering A's model id makes B's own model (no ALREADY_EXISTS that would tell it A's
  // ids); B's lists and stats show nothing of A's.
  ASSERT_TRUE(RegisterDataFree(*b, "m-a", kShape, v1::ROTATION_KIND_HADAMARD, 1).ok());
  auto b_models = b->ListModels();
  ASSERT_TRUE(b_models.ok());
  ASSERT_EQ(b_models->size(), 1u);
  auto b_stats = b->GetStats(/*include_sequences=*/true);
  ASSERT_TRUE(b_stats.ok());
  EXPECT_EQ(b_stats->sequences_size(), 0);
  EXPECT_EQ(b_stats->tenant(), "team-b");
  EXPECT_EQ(b_stats->security().role(), v1::ROLE_TENANT);
  EXPECT_EQ(b_stats->security().tenants_size(), 0);  // a tenant sees no other tenant
  EXPECT_TRUE(b->DescribeSequence("s-a").status().code() == C::kNotFound);
  EXPECT_TRUE(Transport(*b, "Negotiate", 0).ok());
  ASSERT_TRUE(b->DeleteModel("m-a", true).ok());

  // A still owns everything it made: own-tenant rows.
  EXPECT_TRUE(a->DescribeModel("m-a", false).ok());
  auto info = a->DescribeSequence("s-a");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->total_tokens(), target.prompt.size());
  v1::ReadKvRequest read;
  read.set_sequence_id("s-a");
  EXPECT_TRUE(a->ReadKv(read).ok());
  EXPECT_TRUE(rpcs[13].call(*a, target).ok());  // Attend
  EXPECT_TRUE(a->LookupPrefix("m-a", target.prompt).ok());
  EXPECT_TRUE(Transport(*a, "Negotiate", 0).ok());
  auto a_stats = a->GetStats(true);
  ASSERT_TRUE(a_stats.ok());
  EXPECT_EQ(a_stats->tenant(), "team-a");
  EXPECT_EQ(a_stats->sequences_size(), 1);
  EXPECT_GT(a_stats->security().unauthenticated_calls(), 0u);
  EXPECT_TRUE(a->SealSequence("s-a").ok());
  EXPECT_TRUE(a->ReleaseSequence("s-a").ok());
  EXPECT_TRUE(a->DeleteModel("m-a", true).ok());
}

TEST_F(TenancyTest, CertificateIdentitiesUriSanFirstThenCommonName) {
  auto by_uri = As(Certificate("client-uri"));  // CN "not-a-tenant", URI SAN team-a
  auto by_cn = As(Certificate("client-cn"));
  auto uri_stats = by_uri->GetStats();
  ASSERT_TRUE(uri_stats.ok()) << uri_stats.status();
  EXPECT_EQ(uri_stats->tenant(), "team-a");
  auto cn_stats = by_cn->GetStats();
  ASSERT_TRUE(cn_stats.ok()) << cn_stats.status();
  EXPECT_EQ(cn_stats->tenant(), "team-b");
  // A certificate and a token of two different tenants prove nothing.
  ChannelSecurity mixed = Certificate("client-uri");
  mixed.token = kTokB;
  EXPECT_EQ(As(mixed)->GetStats().status().code(), C::kUnauthenticated);
}

TEST_F(TenancyTest, RolesAuthorizeMethodByMethod) {
  auto router = As(Token(kTokRouter));
  auto admin = As(Token(kTokAdmin));
  auto none = As(Token(""));
  const Target target;
  for (const Rpc& rpc : AllRpcs()) {
    const absl::Status s = rpc.call(*router, target);
    if (rpc.name == "GetStats" || rpc.name == "SubscribeKvEvents") {
      EXPECT_TRUE(s.ok()) << s;
    } else {
      EXPECT_EQ(s.code(), C::kPermissionDenied) << rpc.name << ": " << s;
    }
  }
  // Health needs no credentials.
  auto health = none->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);
  // An admin and a router see every tenant with its role; counters of refusals are there.
  for (KvpoolClient* c : {admin.get(), router.get()}) {
    auto stats = c->GetStats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_TRUE(stats->security().tenants_file());
    EXPECT_GE(stats->security().tenants_size(), 4);
    EXPECT_GT(stats->security().permission_denied_calls(), 0u);
    bool saw_router = false;
    for (const v1::TenantStats& t : stats->security().tenants()) {
      if (t.name() == "router") saw_router = t.role() == v1::ROLE_ROUTER;
    }
    EXPECT_TRUE(saw_router);
  }
}

TEST_F(TenancyTest, DaemonPickedSequenceIdsAreUnguessable) {
  auto a = As(Token(kTokA));
  ASSERT_TRUE(RegisterDataFree(*a, "m-ids", kShape, v1::ROTATION_KIND_HADAMARD, 1).ok());
  std::vector<std::string> ids;
  for (int i = 0; i < 4; ++i) {
    auto r = a->CreateSequence("m-ids", "");
    ASSERT_TRUE(r.ok()) << r.status();
    ids.push_back(r->sequence().sequence_id());
    EXPECT_EQ(ids.back().size(), 32u) << ids.back();  // 128 random bits in hex
    EXPECT_FALSE(absl::StartsWith(ids.back(), "seq-"));
  }
  for (size_t i = 1; i < ids.size(); ++i) EXPECT_NE(ids[i], ids[i - 1]);
  ASSERT_TRUE(a->DeleteModel("m-ids", true).ok());
}

TEST_F(TenancyTest, PrefixReuseNeverCrossesTenants) {
  auto a = As(Token(kTokA));
  auto b = As(Token(kTokB));
  // The same model (same codec version) and the same prompt in both tenants.
  ASSERT_TRUE(RegisterDataFree(*a, "m-pfx", kShape, v1::ROTATION_KIND_HADAMARD, 1).ok());
  ASSERT_TRUE(RegisterDataFree(*b, "m-pfx", kShape, v1::ROTATION_KIND_HADAMARD, 1).ok());
  const std::vector<uint32_t> prompt = Prompt(64 + 4 * 16 + 256, 11);
  const SequenceKv kv = MakeSequenceKv(kShape, static_cast<int>(prompt.size()), 4);
  ASSERT_TRUE(CreateAndAppend(*a, "m-pfx", "pfx-a", kv, true, prompt).ok());
  auto hit = a->LookupPrefix("m-pfx", prompt);
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_GT(hit->matched_tokens(), 0u);
  auto miss = b->LookupPrefix("m-pfx", prompt);
  ASSERT_TRUE(miss.ok()) << miss.status();
  EXPECT_EQ(miss->matched_tokens(), 0u);
  EXPECT_EQ(miss->units_size(), 0);
  // B creating a sequence from the same prompt attaches nothing of A's.
  v1::CreateSequenceRequest create;
  create.set_model_id("m-pfx");
  create.set_sequence_id("pfx-b");
  for (uint32_t id : prompt) create.add_prefix_token_ids(id);
  auto created = b->CreateSequence(create);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->sequence().total_tokens(), 0u);
  ASSERT_TRUE(a->DeleteModel("m-pfx", true).ok());
  ASSERT_TRUE(b->DeleteModel("m-pfx", true).ok());
}

TEST_F(TenancyTest, RemovedTenantLosesItsObjectsAndItsRunningStream) {
  auto doomed = As(Token(kTokDoomed));
  auto admin = As(Token(kTokAdmin));
  ASSERT_TRUE(RegisterDataFree(*doomed, "m-d", kShape, v1::ROTATION_KIND_HADAMARD, 1).ok());
  const SequenceKv kv = MakeSequenceKv(kShape, 300, 6);
  ASSERT_TRUE(CreateAndAppend(*doomed, "m-d", "kept", kv, true).ok());
  ASSERT_TRUE(doomed->CreateSequence("m-d", "streaming").ok());
  v1::AppendKvHeader h;
  h.set_sequence_id("streaming");
  h.set_num_tokens(300);
  h.set_dtype(v1::DTYPE_BF16);
  h.set_end_of_prefill(true);
  auto stream = doomed->OpenAppend(h);
  ASSERT_TRUE(stream.ok()) << stream.status();
  ASSERT_TRUE((*stream)->WriteLayer(0, 0, 300, AsBytes(kv.k[0]), AsBytes(kv.v[0])).ok());

  WriteFile(TenantsPath(), TenantsText(/*with_doomed=*/false));
  ASSERT_TRUE(
      Eventually([&] { return doomed->GetStats().status().code() == C::kUnauthenticated; }));
  auto stats = admin->GetStats();
  ASSERT_TRUE(stats.ok());
  for (const v1::TenantStats& t : stats->security().tenants()) EXPECT_NE(t.name(), "doomed");
  // The open stream cannot commit into a released namespace.
  (void)(*stream)->WriteLayer(1, 0, 300, AsBytes(kv.k[1]), AsBytes(kv.v[1]));
  EXPECT_FALSE((*stream)->Finish().ok());

  // Back in the file, the tenant finds its namespace empty.
  WriteFile(TenantsPath(), TenantsText(/*with_doomed=*/true));
  ASSERT_TRUE(Eventually([&] { return doomed->GetStats().ok(); }));
  EXPECT_EQ(doomed->DescribeSequence("kept").status().code(), C::kNotFound);
  auto models = doomed->ListModels();
  ASSERT_TRUE(models.ok());
  EXPECT_TRUE(models->empty());
}

TEST_F(TenancyTest, BadReloadKeepsTheFileInForceAndIsCounted) {
  auto admin = As(Token(kTokAdmin));
  auto before = admin->GetStats();
  ASSERT_TRUE(before.ok());
  WriteFile(TenantsPath(), "tenant { name: \"broken\" role: ROLE_TENANT token_sha256: \"00\" }");
  ASSERT_TRUE(Eventually([&] {
    auto s = admin->GetStats();
    return s.ok() &&
           s->security().tenants_reload_failures() > before->security().tenants_reload_failures();
  }));
  EXPECT_TRUE(As(Token(kTokA))->GetStats().ok());  // the old file still decides
  // Back to a good file (not byte-equal to the one in force, so that it counts as a reload).
  WriteFile(TenantsPath(), "# restored\n" + TenantsText(/*with_doomed=*/true));
  ASSERT_EQ(kill(daemon_->pid(), SIGHUP), 0);  // a reload on demand, too
  ASSERT_TRUE(Eventually([&] {
    auto s = admin->GetStats();
    return s.ok() && s->security().tenants_reloads() > before->security().tenants_reloads();
  }));
  EXPECT_TRUE(daemon_->Running());
}

// The common name of the daemon's certificate as a new connection sees it.
std::string ServerCommonName(const KvpoolClient& c) {
  auto stub = grpc::health::v1::Health::NewStub(c.channel());
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  if (!stub->Check(&ctx, req, &resp).ok()) return "";
  std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
  if (auth == nullptr) return "";
  for (const grpc::string_ref& cn : auth->FindPropertyValues("x509_common_name")) {
    return std::string(cn.data(), cn.size());
  }
  return "";
}

TEST_F(TenancyTest, RotatedServerCertificateServesNewConnections) {
  auto a = As(Token(kTokA));
  ASSERT_EQ(ServerCommonName(*a), "kvpoold");
  CopyFile(Cert("server2.key"), *dir_ + "/live/server.key");
  CopyFile(Cert("server2.pem"), *dir_ + "/live/server.pem");
  ASSERT_TRUE(Eventually([&] { return ServerCommonName(*As(Token(kTokA))) == "kvpoold rotated"; }));
  EXPECT_TRUE(a->GetStats().ok());  // the connection made before still serves
  CopyFile(Cert("server.key"), *dir_ + "/live/server.key");
  CopyFile(Cert("server.pem"), *dir_ + "/live/server.pem");
  ASSERT_TRUE(Eventually([&] { return ServerCommonName(*As(Token(kTokA))) == "kvpoold"; }));
}

// The UCX data plane under TLS and tokens: a session belongs to the tenant that negotiated it;
// it pushes only into that tenant's sequences, and another tenant cannot close or watch it.
TEST_F(TenancyTest, UcxSessionsAreBoundToTheNegotiatingTenant) {
  ClientOptions health;
  health.security.tls_root_ca_file = Cert("ca.pem");
  auto d =
      StartDaemon({"--pool_bytes=67108864", "--worker_threads=2", "--tenants_file=" + TenantsPath(),
                   "--tls_cert=" + Cert("server.pem"), "--tls_key=" + Cert("server.key"),
                   "--transports=ucx", "--ucx_tls=tcp", "--ucx_net_devices=lo"},
                  health);
  ASSERT_TRUE(d.ok()) << d.status();
  auto connect = [&](const char* token) {
    ClientOptions o;
    o.deadline = absl::Seconds(120);
    o.security = Token(token);
    auto c = KvpoolClient::Connect((*d)->target(), o);
    EXPECT_TRUE(c.ok());
    return *std::move(c);
  };
  auto a = connect(kTokA);
  auto b = connect(kTokB);
  ASSERT_TRUE(RegisterDataFree(*a, "m-u", kShape, v1::ROTATION_KIND_HADAMARD, 1).ok());
  ASSERT_TRUE(RegisterDataFree(*b, "m-u", kShape, v1::ROTATION_KIND_HADAMARD, 1).ok());
  ASSERT_TRUE(a->CreateSequence("m-u", "u-a").ok());
  ASSERT_TRUE(b->CreateSequence("m-u", "u-b").ok());
  client::UcxChannelOptions uo;
  uo.runtime.tls = "tcp";
  uo.runtime.net_devices = "lo";
  uo.deadline = absl::Seconds(120);
  auto ch = client::UcxChannel::Connect(a->channel(), uo);
  ASSERT_TRUE(ch.ok()) << ch.status();
  const uint64_t session = (*ch)->session().session_id();
  const SequenceKv kv = MakeSequenceKv(kShape, 40, 8);
  auto push = [&](const std::string& id) -> absl::Status {
    auto p = (*ch)->BeginPush({id, 0, static_cast<uint32_t>(kv.tokens), true, {}});
    if (!p.ok()) return p.status();
    for (int l = 0; l < kShape.num_layers; ++l) {
      absl::Status s = (*p)->PushLayer(l, 0, kv.tokens, AsBytes(kv.k[l]), AsBytes(kv.v[l]));
      if (!s.ok()) return s;
    }
    return (*p)->Finish().status();
  };
  KV_ASSERT_OK(push("u-a"));
  // A's session naming B's sequence finds nothing, exactly as a sequence that does not exist.
  const absl::Status foreign = push("u-b");
  EXPECT_EQ(foreign.code(), push("u-missing").code()) << foreign;
  EXPECT_FALSE(foreign.ok());
  auto described = b->DescribeSequence("u-b");
  ASSERT_TRUE(described.ok());
  EXPECT_EQ(described->total_tokens(), 0u);
  // B cannot close or watch A's session: NOT_FOUND, as for a session that does not exist, and
  // each attempt is counted (a session that does not exist is no attempt on anyone's).
  auto security = [&] {
    auto stats = a->GetStats();
    EXPECT_TRUE(stats.ok()) << stats.status();
    return stats.ok() ? stats->security() : v1::SecurityStats();
  };
  const uint64_t attempts = security().foreign_session_attempts();
  EXPECT_EQ(Transport(*b, "CloseSession", session).code(), C::kNotFound);
  EXPECT_EQ(Transport(*b, "WatchSession", session).code(), C::kNotFound);
  EXPECT_EQ(security().foreign_session_attempts(), attempts + 2);
  EXPECT_EQ(Transport(*a, "CloseSession", session ^ 1).code(), C::kNotFound);
  EXPECT_EQ(Transport(*b, "WatchSession", session ^ 1).code(), C::kNotFound);
  EXPECT_EQ(security().foreign_session_attempts(), attempts + 2);
  // A's session is intact.
  ASSERT_TRUE(a->CreateSequence("m-u", "u-a2").ok());
  KV_ASSERT_OK(push("u-a2"));
  // A's own watch holds (its first message), and the session ends with the watch (a lease).
  EXPECT_EQ(Transport(*a, "WatchSession", session).code(), C::kCancelled);
  EXPECT_TRUE(Eventually([&] {
    auto stats = a->GetStats();
    return stats.ok() && stats->transport().sessions() == 0;
  }));
  EXPECT_EQ(Transport(*a, "CloseSession", session).code(), C::kNotFound);
  EXPECT_EQ(security().foreign_session_attempts(), attempts + 2);
  ch->reset();
  EXPECT_TRUE((*d)->Stop().ok());
}

// The kvpool CLI over TLS: the token from $KVPOOL_TOKEN or --token_file, never the command line.
TEST_F(TenancyTest, CliSpeaksTlsWithATokenFromTheEnvironmentOrAFile) {
  const std::string out = *dir_ + "/cli.out";
  auto cli = [&](const std::string& env, const std::string& flags) {
    const std::string cmd = env + " " + KVPOOL_CLI_PATH + " --target=" + daemon_->target() +
                            " --tls_ca=" + Cert("ca.pem") + " " + flags + " models >" + out +
                            " 2>&1";
    const int status = std::system(cmd.c_str());
    std::ifstream in(out);
    return std::make_pair(
        WIFEXITED(status) ? WEXITSTATUS(status) : -1,
        std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()));
  };
  auto [code, text] = cli(std::string("KVPOOL_TOKEN=") + kTokA, "");
  EXPECT_EQ(code, 0) << text;
  const std::string token_file = *dir_ + "/token-b";
  WriteFile(token_file, std::string(kTokB) + "\n");
  std::tie(code, text) = cli("KVPOOL_TOKEN=", "--token_file=" + token_file);
  EXPECT_EQ(code, 0) << text;
  std::tie(code, text) = cli("KVPOOL_TOKEN=", "");
  EXPECT_NE(code, 0);
  EXPECT_TRUE(absl::StrContains(text, "UNAUTHENTICATED")) << text;
}

// Runs kvpoold with `flags` to its exit; its status and output.
std::pair<int, std::string> RunDaemonToExit(const std::string& dir, const std::string& flags) {
  const std::string log = dir + "/refused.log";
  const int status = std::system(
      (KvpooldPath() + " --pool_bytes=67108864 " + flags + " >" + log + " 2>&1").c_str());
  std::ifstream in(log);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1,
          std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>())};
}

TEST_F(TenancyTest, SafeDefaultsRefuseToStartAndSayWhy) {
  auto [code, out] = RunDaemonToExit(*dir_, "--listen=0.0.0.0:0");
  EXPECT_NE(code, 0);
  EXPECT_TRUE(absl::StrContains(out, "--insecure")) << out;
  EXPECT_TRUE(absl::StrContains(out, "not a loopback address")) << out;
  std::tie(code, out) =
      RunDaemonToExit(*dir_, "--listen=0.0.0.0:0 --tenants_file=" + TenantsPath());
  EXPECT_NE(code, 0);
  EXPECT_TRUE(absl::StrContains(out, "in clear")) << out;
  const std::string bad = *dir_ + "/bad-tenants.txtpb";
  WriteFile(bad, "tenant { name: \"a b\" role: ROLE_TENANT token_sha256: \"x\" }\n");
  std::tie(code, out) = RunDaemonToExit(*dir_, "--listen=127.0.0.1:0 --tenants_file=" + bad);
  EXPECT_NE(code, 0);
  EXPECT_TRUE(absl::StrContains(out, "name must match")) << out;
}

// Tokens without TLS on loopback (gRPC's local credentials): the processor still decides.
TEST(TenancyPlaintextTest, TokensOnLoopbackWithoutTls) {
  char tmpl[] = "/tmp/kvpool-tenancy-plain-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  WriteFile(dir + "/tenants.txtpb", TenantsText(false));
  auto d = StartDaemon(
      {"--pool_bytes=67108864", "--worker_threads=2", "--tenants_file=" + dir + "/tenants.txtpb"});
  ASSERT_TRUE(d.ok()) << d.status();
  ClientOptions o;
  o.security.token = kTokA;
  auto a = KvpoolClient::Connect((*d)->target(), o);
  ASSERT_TRUE(a.ok());
  auto stats = (*a)->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->tenant(), "team-a");
  auto none = KvpoolClient::Connect((*d)->target());
  ASSERT_TRUE(none.ok());
  EXPECT_EQ((*none)->GetStats().status().code(), C::kUnauthenticated);
  EXPECT_TRUE((*none)->Health().ok());
  EXPECT_TRUE((*d)->Stop().ok());
  (void)std::system(("rm -rf " + dir).c_str());
}

}  // namespace
}  // namespace kvpool::integration
