#include "tests/integration/integration_util.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "tests/support/api_requests.h"
#include "tests/support/test_data.h"

namespace kvpool::integration {
namespace {

// The logs of the daemons this process started, printed after a failed test (and removed when
// the program ends): a failure in CI is then diagnosed from what the daemon said.
class DaemonLogs : public ::testing::EmptyTestEventListener {
 public:
  static DaemonLogs& Get() {
    static DaemonLogs* logs = [] {
      auto* l = new DaemonLogs();
      ::testing::UnitTest::GetInstance()->listeners().Append(l);  // gtest owns it
      return l;
    }();
    return *logs;
  }

  std::string NewPath() {
    absl::MutexLock lock(&mu_);
    const char* tmp = std::getenv("TMPDIR");
    std::string path = absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/kvpoold-test-",
                                    getpid(), "-", paths_.size(), ".log");
    paths_.push_back(path);
    return path;
  }

  void OnTestEnd(const ::testing::TestInfo& test) override {
    if (!test.result()->Failed()) return;
    absl::MutexLock lock(&mu_);
    for (const std::string& path : paths_) {
      std::ifstream in(path);
      if (!in) continue;
      std::stringstream text;
      text << in.rdbuf();
      const std::string all = text.str();
      constexpr size_t kTail = 6000;
      std::fprintf(stderr, "---- %s (%s, the last %zu bytes) ----\n%s\n---- end ----\n",
                   path.c_str(), test.name(), std::min(all.size(), kTail),
                   all.size() <= kTail ? all.c_str() : all.c_str() + all.size() - kTail);
    }
  }

  void OnTestProgramEnd(const ::testing::UnitTest&) override {
    absl::MutexLock lock(&mu_);
    for (const std::string& path : paths_) std::remove(path.c_str());
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> paths_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<LocalDaemon> DaemonTest::daemon_;

std::string BinaryPath(const char* env, const char* built) {
  const char* v = std::getenv(env);
  return v != nullptr && *v != '\0' ? std::string(v) : std::string(built);
}

bool TestingOnGpu() {
  const char* device = std::getenv("KVPOOL_TEST_DEVICE");
  return device != nullptr && absl::StartsWith(device, "cuda");
}

AttentionTolerance RemoteAttentionTolerance() {
  return TestingOnGpu() ? AttentionTolerance{1e-2, 1e-4} : AttentionTolerance{2e-5, 2e-5};
}

std::string KvpooldPath() { return BinaryPath("KVPOOL_KVPOOLD", KVPOOL_KVPOOLD_PATH); }

absl::StatusOr<std::unique_ptr<LocalDaemon>> StartDaemon(
    std::vector<std::string> flags, const client::ClientOptions& health_client) {
  return StartDaemonBinary(KvpooldPath(), std::move(flags), health_client);
}

absl::StatusOr<std::unique_ptr<LocalDaemon>> StartDaemonBinary(
    const std::string& binary, std::vector<std::string> flags,
    const client::ClientOptions& health_client) {
  client::LocalDaemonOptions options;
  options.client = health_client;
  options.binary = binary;
  const bool has_level = std::any_of(flags.begin(), flags.end(), [](const std::string& f) {
    return absl::StartsWith(f, "--log_level");
  });
  if (!has_level) flags.push_back("--log_level=warn");
  const char* device = std::getenv("KVPOOL_TEST_DEVICE");
  const bool has_device = std::any_of(flags.begin(), flags.end(), [](const std::string& f) {
    return absl::StartsWith(f, "--device");
  });
  if (device != nullptr && *device != '\0' && !has_device) {
    flags.push_back(absl::StrCat("--device=", device));
  }
  options.flags = std::move(flags);
  options.startup_timeout = absl::Seconds(180);
  options.log_file = DaemonLogs::Get().NewPath();
  return LocalDaemon::Start(options);
}

std::vector<std::string> DaemonTest::DefaultFlags() {
  return {"--pool_bytes=268435456", "--worker_threads=2", "--shutdown_grace_ms=10000"};
}

void DaemonTest::StartSuiteDaemon(std::vector<std::string> flags) {
  absl::StatusOr<std::unique_ptr<LocalDaemon>> d = StartDaemon(std::move(flags));
  ASSERT_TRUE(d.ok()) << d.status();
  daemon_ = *std::move(d);
}

void DaemonTest::TearDownTestSuite() {
  if (daemon_ == nullptr) return;
  const absl::Status stopped = daemon_->Stop(absl::Seconds(120));
  EXPECT_TRUE(stopped.ok()) << stopped;
  daemon_.reset();
}

v1::GetStatsResponse DaemonTest::Stats() {
  absl::StatusOr<v1::GetStatsResponse> s = client_->GetStats();
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : v1::GetStatsResponse();
}

bool DaemonTest::WaitForStats(const std::function<bool(const v1::GetStatsResponse&)>& done) {
  const absl::Time deadline = absl::Now() + absl::Seconds(240);
  while (absl::Now() < deadline) {
    if (done(Stats())) return true;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return false;
}

void DaemonTest::SetUp() {
  ASSERT_NE(daemon_, nullptr) << "kvpoold did not start";
  client::ClientOptions options;
  options.deadline = absl::Seconds(300);
  options.wait_for_ready = true;  // a connection attempt that fails transiently is retried
  auto c = KvpoolClient::Connect(daemon_->target(), options);
  ASSERT_TRUE(c.ok()) << c.status();
  client_ = *std::move(c);
}

absl::StatusOr<v1::ModelInfo> RegisterDataFree(const KvpoolClient& c, const std::string& id,
                                               const Shape& shape, v1::RotationKind kind,
                                               uint64_t seed, const v1::QuantConfig& quant) {
  v1::ModelSpec spec = testing::DataFreeModelSpec(id, shape, kind, seed);
  *spec.mutable_quant() = quant;
  absl::StatusOr<v1::RegisterModelResponse> r = c.RegisterModel(spec);
  if (!r.ok()) return r.status();
  return r->model();
}

std::vector<Bf16> RealLikeKeys(int tokens, int kv_heads, int head_dim, uint64_t seed) {
  return testing::ToBf16(testing::RealLikeRows(tokens * kv_heads, head_dim, seed));
}

std::vector<Bf16> GaussianBf16(size_t n, uint64_t seed, float stddev) {
  return testing::ToBf16(testing::GaussianValues(n, seed, stddev));
}

std::vector<Bf16> Bf16FromBytes(absl::string_view bytes) {
  std::vector<Bf16> out(bytes.size() / sizeof(Bf16));
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), out.size() * sizeof(Bf16));
  return out;
}

std::vector<float> FloatFromBytes(absl::string_view bytes) {
  std::vector<float> out(bytes.size() / sizeof(float));
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), out.size() * sizeof(float));
  return out;
}

SequenceKv MakeSequenceKv(const Shape& shape, int tokens, uint64_t seed) {
  SequenceKv kv;
  kv.tokens = tokens;
  const size_t n = static_cast<size_t>(tokens) * shape.kv_heads * shape.head_dim;
  for (int l = 0; l < shape.num_layers; ++l) {
    kv.k.push_back(RealLikeKeys(tokens, shape.kv_heads, shape.head_dim, seed * 1000 + 2 * l));
    std::vector<Bf16> v = GaussianBf16(n, seed * 1000 + 2 * l + 1);
    for (size_t i = 3; i < n; i += shape.head_dim) v[i] = Bf16::FromFloat(v[i].ToFloat() * 5.0f);
    kv.v.push_back(std::move(v));
  }
  return kv;
}

absl::StatusOr<v1::AppendKvResponse> AppendSequence(const KvpoolClient& c, const std::string& id,
                                                    const SequenceKv& kv, bool end_of_prefill,
                                                    const std::vector<uint32_t>& token_ids) {
  v1::AppendKvHeader header;
  header.set_sequence_id(id);
  header.set_token_start(0);
  header.set_num_tokens(kv.tokens);
  header.set_dtype(v1::DTYPE_BF16);
  header.set_end_of_prefill(end_of_prefill);
  header.mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
  std::vector<client::LayerKv> layers;
  for (size_t l = 0; l < kv.k.size(); ++l) {
    layers.push_back({static_cast<int>(l), AsBytes(kv.k[l]), AsBytes(kv.v[l])});
  }
  return c.AppendKv(header, layers);
}

absl::StatusOr<v1::AppendKvResponse> CreateAndAppend(const KvpoolClient& c,
                                                     const std::string& model_id,
                                                     const std::string& id, const SequenceKv& kv,
                                                     bool end_of_prefill,
                                                     const std::vector<uint32_t>& token_ids) {
  absl::StatusOr<v1::CreateSequenceResponse> created = c.CreateSequence(model_id, id);
  if (!created.ok()) return created.status();
  return AppendSequence(c, id, kv, end_of_prefill, token_ids);
}

v1::AttendRequest Bf16QueryRequest(const std::string& model, int layer, const std::string& id,
                                   const Shape& shape, uint64_t seed, int rows) {
  v1::AttendRequest r;
  r.set_model_id(model);
  r.set_layer(layer);
  r.set_dtype(v1::DTYPE_BF16);
  v1::SequenceQuery* q = r.add_queries();
  q->set_sequence_id(id);
  q->set_num_queries(rows);
  q->set_q(std::string(
      AsBytes(GaussianBf16(static_cast<size_t>(rows) * shape.q_heads * shape.head_dim, seed))));
  return r;
}

std::unique_ptr<KvpoolClient> ConnectClient(const std::string& target, absl::Duration deadline) {
  client::ClientOptions options;
  options.deadline = deadline;
  // Many clients connect at once on a loaded machine: a connection attempt that fails
  // transiently waits for the next one instead of failing the call.
  options.wait_for_ready = true;
  absl::StatusOr<std::unique_ptr<KvpoolClient>> c = KvpoolClient::Connect(target, options);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

QuantConfig KernelQuant(const v1::QuantConfig& q) {
  QuantConfig k;
  k.bits = q.bits();
  k.group_size = q.group_size();
  k.method = q.method() == v1::QUANT_METHOD_BYPASS      ? QuantMethod::kBypass
             : q.method() == v1::QUANT_METHOD_LLOYD_MAX ? QuantMethod::kLloydMax
                                                        : QuantMethod::kUniform;
  k.scale_dtype = q.scale_dtype() == v1::SCALE_DTYPE_BF16 ? ScaleDtype::kBf16 : ScaleDtype::kFp16;
  k.clip_ratio_k = q.clip_ratio_k();
  k.clip_ratio_v = q.clip_ratio_v();
  k.block_tokens = q.block_tokens();
  k.sink_tokens = q.sink_tokens();
  k.recent_tokens = q.recent_tokens();
  k.demotion_batch = q.demotion_batch();
  return k;
}

BlockLayout KernelLayout(const v1::BlockLayoutDescriptor& d) {
  BlockLayout l;
  l.tokens = d.tokens();
  l.kv_heads = d.kv_heads();
  l.head_dim = d.head_dim();
  l.group_size = d.group_size();
  l.bits = d.bits();
  return l;
}

absl::StatusOr<RotationSet> KernelRotation(const v1::ModelInfo& m) {
  const int layers = m.shape().num_layers(), dim = m.shape().head_dim();
  switch (m.rotation_kind()) {
    case v1::ROTATION_KIND_IDENTITY:
      return RotationSet::Identity(layers, dim);
    case v1::ROTATION_KIND_HADAMARD:
      return RotationSet::Hadamard(layers, dim);
    case v1::ROTATION_KIND_RANDOMIZED_HADAMARD:
      return RotationSet::RandomizedHadamard(layers, dim, m.rotation_seed());
    default:
      return absl::UnimplementedError("KernelRotation: data-free kinds only");
  }
}

absl::StatusOr<std::string> PoolFingerprint(const KvpoolClient& c) {
  absl::StatusOr<v1::GetStatsResponse> s = c.GetStats(/*include_sequences=*/true);
  if (!s.ok()) return s.status();
  const v1::PoolStats& p = s->pool();
  std::string out = absl::StrCat("pool used=", p.used_bytes(), " cached=", p.cached_bytes(),
                                 " shared=", p.shared_bytes(), " units=", p.prefix_units(),
                                 " slabs=", p.slabs_in_use(), "\n");
  for (const v1::PageClassStats& cl : p.classes()) {
    absl::StrAppend(&out, "class ", cl.page_bytes(), ": ", cl.pages_in_use(), "\n");
  }
  for (const v1::ModelStats& m : s->models()) {
    absl::StrAppend(&out, "model ", m.model_id(), " ", m.codec_version().substr(0, 16),
                    " seqs=", m.sequences(), " sink=", m.sink_tokens(),
                    " hist=", m.history_tokens(), " recent=", m.recent_tokens(),
                    " bytes=", m.pool_bytes(), "\n");
  }
  std::vector<std::string> seqs;
  for (const v1::SequenceStats& q : s->sequences()) {
    seqs.push_back(absl::StrCat("seq ", q.sequence_id(), " ", q.model_id(),
                                " tokens=", q.total_tokens(), " bytes=", q.pool_bytes(), "\n"));
  }
  std::sort(seqs.begin(), seqs.end());
  for (const std::string& q : seqs) out += q;
  return out;
}

void ExpectRejectedAndPoolUnchanged(const KvpoolClient& c, absl::StatusCode code,
                                    const std::string& what,
                                    const std::function<absl::Status()>& call) {
  absl::StatusOr<std::string> before = PoolFingerprint(c);
  ASSERT_TRUE(before.ok()) << before.status();
  const absl::Status s = call();
  EXPECT_EQ(s.code(), code) << what << ": got " << s;
  EXPECT_FALSE(s.message().empty()) << what << ": no message";
  EXPECT_LE(s.message().size(), 2048u) << what << ": message of " << s.message().size();
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  absl::StatusOr<std::string> after = PoolFingerprint(c);
  while (after.ok() && *after != *before && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(20));
    after = PoolFingerprint(c);
  }
  ASSERT_TRUE(after.ok()) << what << ": the daemon stopped serving: " << after.status();
  EXPECT_EQ(*after, *before) << what << " changed the pool";
}

}  // namespace kvpool::integration
