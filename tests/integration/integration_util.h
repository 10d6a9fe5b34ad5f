// Shared pieces of the integration tests: a gtest fixture that runs one real kvpoold process per
// test suite (LocalDaemon, built binary path from the build), model registration helpers,
// synthetic K/V, and a fingerprint of the pool's accounting to prove "unchanged".
//
//   class MyTest : public DaemonTest {};      // kvpoold with DaemonTest's default flags
//   TEST_F(MyTest, Works) {
//     KvpoolClient& c = client();
//     ASSERT_OK_AND_ASSIGN_KV(v1::ModelInfo m, RegisterDataFree(c, "m", Shape{...}, ...));
//   }
//
// Deadlines are generous and nothing is timed: the tests run on loaded 2-core machines.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/kvpool_client.h"
#include "client/local_daemon.h"
#include "gtest/gtest.h"
#include "kernels/bf16.h"
#include "kernels/block_layout.h"
#include "kernels/codec_config.h"
#include "kernels/rotation.h"

namespace kvpool::integration {

namespace v1 = ::kvpool::v1;
using client::KvpoolClient;
using client::LocalDaemon;

#define KV_ASSERT_OK(expr)                                    \
  do {                                                        \
    const ::absl::Status kv_assert_status_ = (expr);          \
    ASSERT_TRUE(kv_assert_status_.ok()) << kv_assert_status_; \
  } while (false)

// `built` (a path fixed at build time), or the environment variable `env` when it is set: the
// GPU machine runs these tests from binaries carried to another folder (tests/gpu/daemon_run.sh).
std::string BinaryPath(const char* env, const char* built);

// Path of the kvpoold binary built with these tests ($KVPOOL_KVPOOLD overrides).
std::string KvpooldPath();

// Starts kvpoold with `flags` (plus --log_level=warn unless given, and --device=$KVPOOL_TEST_DEVICE
// when that is set and `flags` name no device, so one suite runs against every backend), waits
// for SERVING.
// `health_client` says how the health check connects (TLS when the flags turn it on).
absl::StatusOr<std::unique_ptr<LocalDaemon>> StartDaemon(
    std::vector<std::string> flags, const client::ClientOptions& health_client = {});
// StartDaemon with another daemon binary (kvpoold-fault-injection, say).
absl::StatusOr<std::unique_ptr<LocalDaemon>> StartDaemonBinary(
    const std::string& binary, std::vector<std::string> flags,
    const client::ClientOptions& health_client = {});

// Whether the suite runs against a GPU daemon (KVPOOL_TEST_DEVICE=cuda:N).
bool TestingOnGpu();

// Agreement of remote attention with the CPU kernels' float arithmetic: outputs within
// `out` x the largest output magnitude, LSE within `lse` relative. The CPU backend computes the
// same float operations (2e-5 covers summation order); the GPU kernel runs P x scale through
// fp16 tensor cores (its contract, kernels/cuda/cuda_attention.h: output error well under 1e-2,
// LSE within 1e-4).
struct AttentionTolerance {
  double out;
  double lse;
};
AttentionTolerance RemoteAttentionTolerance();

// A test suite with one daemon shared by its tests. Override DaemonFlags() for other limits.
class DaemonTest : public ::testing::Test {
 protected:
  static void StartSuiteDaemon(std::vector<std::string> flags);
  static void SetUpTestSuite() { StartSuiteDaemon(DefaultFlags()); }
  // Stops with SIGTERM and checks exit status 0.
  static void TearDownTestSuite();
  static std::vector<std::string> DefaultFlags();

  void SetUp() override;
  KvpoolClient& client() { return *client_; }
  // GetStats through client() (a failure is a test failure and answers an empty response).
  v1::GetStatsResponse Stats();
  // Polls Stats() until `done` holds; false after a generous deadline (never a duration that a
  // test asserts). Safe from several threads.
  bool WaitForStats(const std::function<bool(const v1::GetStatsResponse&)>& done);
  LocalDaemon& daemon() { return *daemon_; }

  static std::unique_ptr<LocalDaemon> daemon_;
  std::unique_ptr<KvpoolClient> client_;
};

struct Shape {
  int num_layers = 2;
  int q_heads = 8;
  int kv_heads = 2;
  int head_dim = 64;
};

// Registers a data-free model. `quant` fields not set take the OSCAR defaults.
absl::StatusOr<v1::ModelInfo> RegisterDataFree(const KvpoolClient& c, const std::string& id,
                                               const Shape& shape, v1::RotationKind kind,
                                               uint64_t seed, const v1::QuantConfig& quant = {});

// Real-like K/V of one layer: [tokens][kv_heads][head_dim] BF16 (keys with outlier channels,
// values Gaussian with one strong channel). Deterministic per seed.
std::vector<Bf16> RealLikeKeys(int tokens, int kv_heads, int head_dim, uint64_t seed);
std::vector<Bf16> GaussianBf16(size_t n, uint64_t seed, float stddev = 1.0f);

inline absl::string_view AsBytes(const std::vector<Bf16>& v) {
  return absl::string_view(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(Bf16));
}
inline absl::string_view AsBytes(const std::vector<float>& v) {
  return absl::string_view(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}
std::vector<Bf16> Bf16FromBytes(absl::string_view bytes);
std::vector<float> FloatFromBytes(absl::string_view bytes);

// A sequence's KV as pushed: per layer BF16 [tokens][kv_heads][head_dim] of K and V.
struct SequenceKv {
  int tokens = 0;
  std::vector<std::vector<Bf16>> k, v;
};
SequenceKv MakeSequenceKv(const Shape& shape, int tokens, uint64_t seed);

// Appends `kv` to the existing sequence `id` from token 0 in one AppendKv stream (layer by
// layer), with `token_ids` when not empty.
absl::StatusOr<v1::AppendKvResponse> AppendSequence(const KvpoolClient& c, const std::string& id,
                                                    const SequenceKv& kv,
                                                    bool end_of_prefill = false,
                                                    const std::vector<uint32_t>& token_ids = {});

// An Attend request of `rows` BF16 query rows (Gaussian, seeded) over sequence `id` of `model`
// at `layer`.
v1::AttendRequest Bf16QueryRequest(const std::string& model, int layer, const std::string& id,
                                   const Shape& shape, uint64_t seed, int rows = 1);

// A client on its own connection whose calls have `deadline` and wait for the connection (a
// failure is a test failure and answers null).
std::unique_ptr<KvpoolClient> ConnectClient(const std::string& target, absl::Duration deadline);

// Creates `id` and appends `kv` in one AppendKv stream (layer by layer), with `token_ids` when
// not empty, `end_of_prefill` as given.
absl::StatusOr<v1::AppendKvResponse> CreateAndAppend(const KvpoolClient& c,
                                                     const std::string& model_id,
                                                     const std::string& id, const SequenceKv& kv,
                                                     bool end_of_prefill,
                                                     const std::vector<uint32_t>& token_ids = {});

// The kernels' view of a registered model: its quant config (from the effective one the server
// reports), its block layout (from the descriptor) and its rotation (data-free kinds only).
QuantConfig KernelQuant(const v1::QuantConfig& q);
BlockLayout KernelLayout(const v1::BlockLayoutDescriptor& d);
absl::StatusOr<RotationSet> KernelRotation(const v1::ModelInfo& m);

// Everything GetStats says about what the pool holds (bytes, pages per class, cached and shared
// bytes, prefix units, per-model token and byte totals, every sequence), as one string, so two
// fingerprints are equal exactly when the pool's contents and accounting are unchanged.
absl::StatusOr<std::string> PoolFingerprint(const KvpoolClient& c);

// Runs `call` and expects status `code` with a message (non-empty, at most 2 KiB: messages quote
// ids short), the daemon still serving, and the pool's fingerprint unchanged. A call that failed
// at the gRPC level (cancelled, message too large) is rolled back when the daemon tears it down,
// which may finish just after the client sees the status: the fingerprint is given up to a
// minute to come back, but never accepted changed.
void ExpectRejectedAndPoolUnchanged(const KvpoolClient& c, absl::StatusCode code,
                                    const std::string& what,
                                    const std::function<absl::Status()>& call);

}  // namespace kvpool::integration
