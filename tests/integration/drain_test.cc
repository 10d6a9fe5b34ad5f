// Operations through a real kvpoold (docs/operations.md): models loaded from --model_config at
// start, a bad config refusing the start with the entry and the reason, the one drain begun by
// SIGTERM and by AdminService.Drain (health NOT_SERVING, new work refused with reason DRAINING,
// the append in flight finishing, exit status 0), Drain and ReloadTenants admin-only, and the
// plaintext health port beside a TLS-only main port.
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "kernels/rotation_file.h"
#include "proto/status.h"
#include "server/auth/token_hash.h"
#include "tests/integration/integration_util.h"
#include "tests/support/api_requests.h"

namespace kvpool::integration {
namespace {

using client::ClientOptions;
using testing::AppendChunkMessage;
using testing::AppendHeaderMessage;

constexpr Shape kShape{/*num_layers=*/2, /*q_heads=*/8, /*kv_heads=*/2, /*head_dim=*/64};
constexpr char kTokTenant[] = "tenant-token-0123456789";
constexpr char kTokAdmin[] = "admin-token-0123456789";

std::string Hash(const std::string& token) { return server::HexOf(server::Sha256Of(token)); }

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  ASSERT_TRUE(out.good()) << path;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Polls `done` for up to two minutes (loaded machines); the answer, never a timing.
bool Eventually(const std::function<bool()>& done) {
  const absl::Time give_up = absl::Now() + absl::Minutes(2);
  while (absl::Now() < give_up) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return done();
}

std::string TempDir(const std::string& prefix) {
  absl::StatusOr<std::string> dir = client::MakeTempDir(prefix);
  EXPECT_TRUE(dir.ok()) << dir.status();
  return dir.ok() ? *dir : "/tmp";
}

std::unique_ptr<KvpoolClient> Connect(const std::string& target, const std::string& token = "",
                                      const std::string& tls_ca = "") {
  ClientOptions o;
  o.deadline = absl::Seconds(120);
  o.security.token = token;
  o.security.tls_root_ca_file = tls_ca;
  auto c = KvpoolClient::Connect(target, o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

void ExpectDraining(const absl::Status& s, const std::string& what) {
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << what << ": " << s;
  EXPECT_EQ(ReasonOf(s), ErrorReason::kDraining) << what << ": " << s;
}

// ---------------------------------------------------------------------------------------------
// --model_config

std::string ModelConfigText(const std::string& tenant_line) {
  return absl::StrCat(
      "model {\n", tenant_line,
      "  spec { model_id: \"free\" shape { num_layers: 2 q_heads: 8 kv_heads: 2 head_dim: 64 }\n"
      "         data_free { kind: ROTATION_KIND_RANDOMIZED_HADAMARD seed: 11 } }\n"
      "}\n"
      "model {\n",
      tenant_line,
      "  spec { model_id: \"from-file\" shape { q_heads: 8 kv_heads: 2 }\n"
      "         server_path: \"hadamard.safetensors\" }\n"
      "}\n");
}

class ModelConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = TempDir("kvpool-model-config");
    const ModelCodec codec{
        "file-model", *RotationSet::Hadamard(2, 64), QuantConfig{}, false, "hadamard", {}, {}};
    ASSERT_TRUE(WriteRotationFile(codec, dir_ + "/hadamard.safetensors").ok());
  }
  void TearDown() override { client::RemoveTree(dir_); }

  // Starts kvpoold with `config` as its --model_config.
  absl::StatusOr<std::unique_ptr<LocalDaemon>> StartWith(const std::string& config) {
    WriteFile(dir_ + "/models.txtpb", config);
    return StartDaemon({"--pool_bytes=33554432", "--worker_threads=2", "--model_dir=" + dir_,
                        "--model_config=" + dir_ + "/models.txtpb"});
  }

  // The start fails and the daemon's log says `expected`.
  void ExpectRefused(const std::string& config, const std::vector<std::string>& expected) {
    absl::StatusOr<std::unique_ptr<LocalDaemon>> d = StartWith(config);
    ASSERT_FALSE(d.ok()) << "started with a bad --model_config:\n" << config;
    for (const std::string& e : expected) {
      EXPECT_TRUE(absl::StrContains(d.status().message(), e))
          << "expected '" << e << "' in: " << d.status();
    }
  }

  std::string dir_;
};

TEST_F(ModelConfigTest, DataFreeAndRotationFileModelsServeFromTheStart) {
  absl::StatusOr<std::unique_ptr<LocalDaemon>> d = StartWith(ModelConfigText(""));
  ASSERT_TRUE(d.ok()) << d.status();
  std::unique_ptr<KvpoolClient> c = Connect((*d)->target());
  ASSERT_NE(c, nullptr);
  absl::StatusOr<std::vector<v1::ModelInfo>> models = c->ListModels();
  ASSERT_TRUE(models.ok()) << models.status();
  ASSERT_EQ(models->size(), 2u);
  const v1::ModelInfo& free = (*models)[0];
  const v1::ModelInfo& file = (*models)[1];
  EXPECT_EQ(free.model_id(), "free");
  EXPECT_EQ(free.rotation_kind(), v1::ROTATION_KIND_RANDOMIZED_HADAMARD);
  EXPECT_EQ(free.rotation_seed(), 11u);
  EXPECT_EQ(file.model_id(), "from-file");
  EXPECT_EQ(file.rotation_kind(), v1::ROTATION_KIND_HADAMARD);
  EXPECT_EQ(file.shape().num_layers(), 2);  // from the file
  EXPECT_EQ(file.shape().head_dim(), 64);
  // Both serve K/V without anyone registering them.
  for (const char* model : {"free", "from-file"}) {
    const std::string seq = absl::StrCat("s-", model);
    auto r = CreateAndAppend(*c, model, seq, MakeSequenceKv(kShape, 40, 3), true);
    EXPECT_TRUE(r.ok()) << model << ": " << r.status();
  }
  // Registering the same spec again is the idempotent registration of RegisterModel.
  absl::StatusOr<v1::ModelInfo> again =
      RegisterDataFree(*c, "free", kShape, v1::ROTATION_KIND_RANDOMIZED_HADAMARD, 11);
  EXPECT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE((*d)->Stop(absl::Seconds(120)).ok());
}

TEST_F(ModelConfigTest, BadConfigRefusesTheStartNamingTheEntryAndWhy) {
  // Text that is not a ModelConfig: the position.
  ExpectRefused("model { spec { model_id: \"a\" }\n  shape: 3 }\n", {"--model_config", "line 2:"});
  // A spec the registry refuses (no kv_heads): the entry by number and id, and the reason.
  ExpectRefused(
      "model { spec { model_id: \"ok\" shape { num_layers: 2 q_heads: 8 kv_heads: 2 "
      "head_dim: 64 } data_free { kind: ROTATION_KIND_HADAMARD } } }\n"
      "model { spec { model_id: \"bad\" shape { num_layers: 2 q_heads: 8 head_dim: 64 } "
      "data_free { kind: ROTATION_KIND_HADAMARD } } }\n",
      {"model #2 'bad'", "kv_heads"});
  // A rotation file that is not there.
  ExpectRefused(
      "model { spec { model_id: \"gone\" shape { q_heads: 8 kv_heads: 2 } "
      "server_path: \"missing.safetensors\" } }\n",
      {"model #1 'gone'", "missing.safetensors"});
  // An upload has no meaning in a file; a tenant without a tenants file is nobody.
  ExpectRefused(
      "model { spec { model_id: \"up\" shape { q_heads: 8 kv_heads: 2 } upload_size: 10 } }\n",
      {"model #1 'up'", "upload_size"});
  ExpectRefused(ModelConfigText("  tenant: \"team-a\"\n"),
                {"model #1 'free' of tenant 'team-a'", "--tenants_file"});
  // The same id twice for one tenant.
  ExpectRefused(
      "model { spec { model_id: \"x\" shape { num_layers: 2 q_heads: 8 kv_heads: 2 head_dim: 64 }"
      " data_free { kind: ROTATION_KIND_IDENTITY } } }\n"
      "model { spec { model_id: \"x\" shape { num_layers: 2 q_heads: 8 kv_heads: 2 head_dim: 64 }"
      " data_free { kind: ROTATION_KIND_HADAMARD } } }\n",
      {"model #2 'x'", "twice"});
}

// ---------------------------------------------------------------------------------------------
// Drain

// A daemon with two tenants (a tenant and an admin, by token, on loopback), a long grace, the
// model config's models for the tenant, and a plaintext health port.
struct DrainFixture {
  std::string dir;
  std::unique_ptr<LocalDaemon> daemon;
  std::unique_ptr<KvpoolClient> tenant, admin;

  void Start(const std::vector<std::string>& extra = {}) {
    dir = TempDir("kvpool-drain");
    WriteFile(dir + "/tenants.txtpb",
              absl::StrCat("tenant { name: \"team-a\" role: ROLE_TENANT token_sha256: \"",
                           Hash(kTokTenant), "\" }\n",
                           "tenant { name: \"ops\" role: ROLE_ADMIN token_sha256: \"",
                           Hash(kTokAdmin), "\" }\n"));
    WriteFile(dir + "/models.txtpb",
              "model { tenant: \"team-a\" spec { model_id: \"m\" shape { num_layers: 2 q_heads: 8 "
              "kv_heads: 2 head_dim: 64 } data_free { kind: ROTATION_KIND_HADAMARD } } }\n");
    std::vector<std::string> flags = {"--pool_bytes=33554432",
                                      "--worker_threads=2",
                                      "--shutdown_grace_ms=600000",
                                      "--tenants_file=" + dir + "/tenants.txtpb",
                                      "--model_config=" + dir + "/models.txtpb",
                                      "--health_listen=127.0.0.1:0",
                                      "--health_port_file=" + dir + "/health.port"};
    flags.insert(flags.end(), extra.begin(), extra.end());
    ClientOptions health;
    health.security.token = kTokTenant;
    auto d = StartDaemon(flags, health);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon = *std::move(d);
    tenant = Connect(daemon->target(), kTokTenant);
    admin = Connect(daemon->target(), kTokAdmin);
    ASSERT_NE(tenant, nullptr);
    ASSERT_NE(admin, nullptr);
  }
  ~DrainFixture() {
    tenant.reset();
    admin.reset();
    daemon.reset();  // kills it if a test left it running
    if (!dir.empty()) client::RemoveTree(dir);
  }
  std::string HealthTarget() const {
    return absl::StrCat("127.0.0.1:", std::atoi(ReadFile(dir + "/health.port").c_str()));
  }
  v1::ServingState Serving() const {
    absl::StatusOr<v1::GetStatsResponse> s = admin->GetStats();
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->serving() : v1::ServingState();
  }
};

// Opens an AppendKv stream on `sequence` and sends its header and layer 0; the caller finishes it.
struct OpenAppend {
  grpc::ClientContext ctx;
  v1::AppendKvResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::AppendKvRequest>> writer;
  SequenceKv kv = MakeSequenceKv(kShape, 32, 5);

  explicit OpenAppend(const KvpoolClient& c, const std::string& sequence) {
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Minutes(5)));
    writer = c.sequences()->AppendKv(&ctx, &response);
    EXPECT_TRUE(writer->Write(AppendHeaderMessage(sequence, 0, kv.tokens, v1::DTYPE_BF16, true)));
    EXPECT_TRUE(Chunk(0));
  }
  bool Chunk(int layer) {
    return writer->Write(AppendChunkMessage(layer, 0, kv.tokens, std::string(AsBytes(kv.k[layer])),
                                            std::string(AsBytes(kv.v[layer]))));
  }
  grpc::Status Finish() {
    EXPECT_TRUE(Chunk(1));
    EXPECT_TRUE(writer->WritesDone());
    return writer->Finish();
  }
};

// The drain every way it starts: `begin` starts it while an append is in flight.
void DrainWithAppendInFlight(DrainFixture& f, const std::function<void()>& begin) {
  v1::CreateSequenceRequest create;
  create.set_model_id("m");
  for (const char* id : {"in-flight", "idle"}) {
    create.set_sequence_id(id);
    ASSERT_TRUE(f.tenant->CreateSequence(create).ok());
  }
  std::unique_ptr<KvpoolClient> plain_health = Connect(f.HealthTarget());
  ASSERT_NE(plain_health, nullptr);
  ASSERT_TRUE(plain_health->WaitForServing(absl::Minutes(2)).ok());

  OpenAppend append(*f.tenant, "in-flight");
  // The stream holds its admission ticket: it began before the drain.
  ASSERT_TRUE(Eventually([&] {
    absl::StatusOr<v1::GetStatsResponse> s = f.admin->GetStats();
    return s.ok() && s->admission().open_streams() == 1;
  }));
  EXPECT_EQ(f.Serving().state(), v1::ServingState::SERVING);

  begin();

  // Health NOT_SERVING on the daemon's port and on the health port (set before `begin` returns
  // for the RPC; a signal is asynchronous).
  ASSERT_TRUE(Eventually([&] {
    auto h = f.tenant->Health();
    return h.ok() && *h == grpc::health::v1::HealthCheckResponse::NOT_SERVING;
  }));
  auto h = plain_health->Health();
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(*h, grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  const v1::ServingState serving = f.Serving();
  EXPECT_EQ(serving.state(), v1::ServingState::DRAINING);
  EXPECT_GT(serving.drain_started_unix_ms(), 0);
  EXPECT_GT(serving.drain_deadline_unix_ms(), serving.drain_started_unix_ms());
  EXPECT_GE(serving.in_flight_calls(), 2u);  // the append and this GetStats

  // New work: refused, naming the reason.
  create.set_sequence_id("new");
  ExpectDraining(f.tenant->CreateSequence(create).status(), "CreateSequence");
  ExpectDraining(AppendSequence(*f.tenant, "idle", MakeSequenceKv(kShape, 16, 9)).status(),
                 "a new AppendKv");
  // Reading what is there still works.
  EXPECT_TRUE(f.tenant->DescribeSequence("in-flight").ok());

  // The append in flight finishes, whole.
  const grpc::Status done = append.Finish();
  EXPECT_TRUE(done.ok()) << done.error_message();
  EXPECT_EQ(append.response.sequence().total_tokens(), 32u);

  // Then the daemon exits by itself, with status 0.
  int wait_status = 0;
  ASSERT_TRUE(f.daemon->WaitExit(absl::Minutes(2), &wait_status)) << f.daemon->LogTail();
  EXPECT_TRUE(WIFEXITED(wait_status)) << wait_status;
  EXPECT_EQ(WEXITSTATUS(wait_status), 0) << f.daemon->LogTail();
}

TEST(DrainTest, SigtermDrainsLettingTheAppendInFlightFinishThenExitsZero) {
  DrainFixture f;
  ASSERT_NO_FATAL_FAILURE(f.Start());
  DrainWithAppendInFlight(f, [&] { ASSERT_EQ(kill(f.daemon->pid(), SIGTERM), 0); });
}

TEST(DrainTest, AdminDrainRpcIsTheSameDrain) {
  DrainFixture f;
  ASSERT_NO_FATAL_FAILURE(f.Start());
  DrainWithAppendInFlight(f, [&] {
    absl::StatusOr<v1::DrainResponse> r = f.admin->Drain();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->started());
    EXPECT_EQ(r->serving().state(), v1::ServingState::DRAINING);
    // Health is NOT_SERVING by the time the call answers.
    auto h = f.tenant->Health();
    ASSERT_TRUE(h.ok()) << h.status();
    EXPECT_EQ(*h, grpc::health::v1::HealthCheckResponse::NOT_SERVING);
    // A second drain changes nothing.
    absl::StatusOr<v1::DrainResponse> again = f.admin->Drain();
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_FALSE(again->started());
  });
}

TEST(DrainTest, DrainAndReloadAreAdminOnly) {
  DrainFixture f;
  ASSERT_NO_FATAL_FAILURE(f.Start());
  EXPECT_EQ(f.tenant->Drain().status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(f.tenant->ReloadTenants().status().code(), absl::StatusCode::kPermissionDenied);
  std::unique_ptr<KvpoolClient> anonymous = Connect(f.daemon->target());
  EXPECT_EQ(anonymous->Drain().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(f.Serving().state(), v1::ServingState::SERVING);  // nothing changed

  absl::StatusOr<v1::ReloadTenantsResponse> reloaded = f.admin->ReloadTenants();
  ASSERT_TRUE(reloaded.ok()) << reloaded.status();
  EXPECT_EQ(reloaded->tenants(), 2u);
  // A broken file: the precise error, and the tenants in force stay.
  WriteFile(f.dir + "/tenants.txtpb", "tenant { name: \"x\" role: ROLE_NOPE }\n");
  absl::Status bad = f.admin->ReloadTenants().status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
  EXPECT_TRUE(absl::StrContains(bad.message(), "line 1:")) << bad;
  EXPECT_TRUE(f.tenant->ListModels().ok());
  EXPECT_TRUE(f.daemon->Stop(absl::Seconds(120)).ok());
}

// ---------------------------------------------------------------------------------------------
// The plaintext health port beside a TLS-only daemon port

TEST(HealthPortTest, AnswersWithoutCredentialsWhileTheMainPortNeedsTls) {
  DrainFixture f;
  const std::string certs = TempDir("kvpool-health-certs");
  const std::string script =
      std::string(KVPOOL_SOURCE_DIR) + "/tests/integration/make_test_certs.sh";
  ASSERT_EQ(std::system((script + " " + certs).c_str()), 0);
  // The daemon's port: TLS and tokens (Start's health check presents both).
  f.dir = TempDir("kvpool-drain");
  WriteFile(f.dir + "/tenants.txtpb",
            absl::StrCat("tenant { name: \"ops\" role: ROLE_ADMIN token_sha256: \"",
                         Hash(kTokAdmin), "\" }\n"));
  ClientOptions health;
  health.security.token = kTokAdmin;
  health.security.tls_root_ca_file = certs + "/ca.pem";
  auto d = StartDaemon(
      {"--pool_bytes=33554432", "--worker_threads=2", "--tenants_file=" + f.dir + "/tenants.txtpb",
       "--tls_cert=" + certs + "/server.pem", "--tls_key=" + certs + "/server.key",
       "--health_listen=127.0.0.1:0", "--health_port_file=" + f.dir + "/health.port"},
      health);
  ASSERT_TRUE(d.ok()) << d.status();
  f.daemon = *std::move(d);

  // No credentials, no TLS: health answers on the health port, and nothing else is there.
  std::unique_ptr<KvpoolClient> plain = Connect(f.HealthTarget());
  ASSERT_NE(plain, nullptr);
  auto h = plain->Health();
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(*h, grpc::health::v1::HealthCheckResponse::SERVING);
  auto per_service = plain->Health("kvpool.v1.SequenceService");
  ASSERT_TRUE(per_service.ok()) << per_service.status();
  EXPECT_EQ(*per_service, grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(plain->GetStats().status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(plain->ListModels().status().code(), absl::StatusCode::kUnimplemented);
  // Anybody can reach this port: Watch calls that never end are capped, Check still answers,
  // and an oversized request is refused.
  {
    auto channel = grpc::CreateChannel(f.HealthTarget(), grpc::InsecureChannelCredentials());
    auto stub = grpc::health::v1::Health::NewStub(channel);
    std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
    std::vector<std::unique_ptr<grpc::ClientReader<grpc::health::v1::HealthCheckResponse>>> watches;
    grpc::health::v1::HealthCheckRequest req;
    for (int i = 0; i < 8; ++i) {
      contexts.push_back(std::make_unique<grpc::ClientContext>());
      watches.push_back(stub->Watch(contexts.back().get(), req));
      grpc::health::v1::HealthCheckResponse first;
      ASSERT_TRUE(watches.back()->Read(&first)) << "watch " << i;  // it holds a thread now
    }
    grpc::ClientContext extra;  // without the cap it would wait for a change: give it a deadline
    extra.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    auto refused_watch = stub->Watch(&extra, req);
    grpc::health::v1::HealthCheckResponse none;
    EXPECT_FALSE(refused_watch->Read(&none));
    EXPECT_EQ(refused_watch->Finish().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    auto during = plain->Health();
    ASSERT_TRUE(during.ok()) << during.status();
    EXPECT_EQ(*during, grpc::health::v1::HealthCheckResponse::SERVING);
    grpc::ClientContext big_ctx;
    grpc::health::v1::HealthCheckRequest big;
    big.set_service(std::string(64 << 10, 'x'));
    grpc::health::v1::HealthCheckResponse big_resp;
    EXPECT_EQ(stub->Check(&big_ctx, big, &big_resp).error_code(),
              grpc::StatusCode::RESOURCE_EXHAUSTED);
    for (auto& c : contexts) c->TryCancel();
    for (auto& w : watches) w->Finish();
  }
  // The daemon's own port refuses a plaintext caller.
  ClientOptions quick;
  quick.deadline = absl::Seconds(5);
  auto refused = KvpoolClient::Connect(f.daemon->target(), quick);
  ASSERT_TRUE(refused.ok());
  EXPECT_FALSE((*refused)->Health().ok());

  // The drain shows on the health port too; the daemon exits 0.
  std::unique_ptr<KvpoolClient> admin = Connect(f.daemon->target(), kTokAdmin, certs + "/ca.pem");
  ASSERT_TRUE(admin->Drain().ok());
  auto after = plain->Health();
  EXPECT_TRUE(!after.ok() || *after == grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  int wait_status = 0;
  ASSERT_TRUE(f.daemon->WaitExit(absl::Minutes(2), &wait_status)) << f.daemon->LogTail();
  EXPECT_TRUE(WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0) << f.daemon->LogTail();
  client::RemoveTree(certs);
}

}  // namespace
}  // namespace kvpool::integration
