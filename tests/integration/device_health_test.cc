// Device health against the real daemon on a GPU: kvpoold-fault-injection poisons its CUDA
// context (PoisonDevice: a kernel that stores outside every allocation, a sticky illegal-address
// error); then health answers NOT_SERVING, Attend and appends answer UNAVAILABLE, GetStats shows
// the failure and the refused calls, and the process exits by itself with status 3 so that its
// supervisor restarts it. Skips without a CUDA device (or in a build without CUDA).
#include <sys/wait.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kvpool/testing/fault_injection.grpc.pb.h"
#include "tests/integration/integration_util.h"
#if defined(KVPOOL_TEST_HAVE_CUDA)
#include "kernels/cuda/cuda_codec.h"
#endif

namespace kvpool::integration {
namespace {

namespace t = ::kvpool::testing;

const Shape kShape{2, 4, 2, 64};
constexpr int kTokens = 100;

std::string FaultDaemonPath() {
  return BinaryPath("KVPOOL_FAULT_INJECTION_DAEMON", KVPOOL_FAULT_INJECTION_DAEMON_PATH);
}

bool HaveGpu() {
#if defined(KVPOOL_TEST_HAVE_CUDA)
  return cuda::CudaDeviceCount() > 0;
#else
  return false;
#endif
}

TEST(DeviceHealthTest, APoisonedContextStopsServingAndTheDaemonExits) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  // A grace long enough to look at the failed daemon before it exits on its own.
  absl::StatusOr<std::unique_ptr<LocalDaemon>> d = StartDaemonBinary(
      FaultDaemonPath(), {"--pool_bytes=268435456", "--worker_threads=2", "--device=cuda:0",
                          "--device_check_period=100ms", "--device_failure_exit_grace=30s"});
  ASSERT_TRUE(d.ok()) << d.status();
  std::unique_ptr<LocalDaemon> daemon = *std::move(d);
  absl::StatusOr<std::unique_ptr<KvpoolClient>> c = KvpoolClient::Connect(daemon->target());
  ASSERT_TRUE(c.ok()) << c.status();
  KvpoolClient& client = **c;
  ASSERT_TRUE(RegisterDataFree(client, "m", kShape, v1::ROTATION_KIND_HADAMARD, 1).ok());
  const SequenceKv kv = MakeSequenceKv(kShape, kTokens, 4);
  ASSERT_TRUE(CreateAndAppend(client, "m", "s", kv, true).ok());
  const absl::StatusOr<v1::AttendResponse> before =
      client.Attend(Bf16QueryRequest("m", 0, "s", kShape, 9));
  ASSERT_TRUE(before.ok()) << before.status();
  absl::StatusOr<v1::GetStatsResponse> stats = client.GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_TRUE(stats->device().healthy());
  EXPECT_EQ(stats->device().calls_refused(), 0u);

  // Poison the context, as a faulty kernel would.
  std::unique_ptr<t::FaultInjection::Stub> faults = t::FaultInjection::NewStub(client.channel());
  t::PoisonDeviceResponse poisoned;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  const grpc::Status poison = faults->PoisonDevice(&context, {}, &poisoned);
  ASSERT_TRUE(poison.ok()) << poison.error_message();

  // Compute calls answer UNAVAILABLE, whether they find the error or the monitor found it first.
  const absl::Status attend = client.Attend(Bf16QueryRequest("m", 0, "s", kShape, 9)).status();
  EXPECT_EQ(attend.code(), absl::StatusCode::kUnavailable) << attend;
  EXPECT_NE(attend.message().find("has failed"), std::string::npos) << attend;
  // Health turns NOT_SERVING within a few check periods (polled, generous deadline).
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  absl::StatusOr<KvpoolClient::ServingStatus> health = client.Health();
  while (health.ok() && *health == grpc::health::v1::HealthCheckResponse::SERVING &&
         absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(50));
    health = client.Health();
  }
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  // Once the failure is known, calls are refused before they touch the device, and counted.
  const absl::Status append = CreateAndAppend(client, "m", "s2", kv, true).status();
  EXPECT_EQ(append.code(), absl::StatusCode::kUnavailable) << append;
  const absl::Status again = client.Attend(Bf16QueryRequest("m", 0, "s", kShape, 9)).status();
  EXPECT_EQ(again.code(), absl::StatusCode::kUnavailable) << again;
  stats = client.GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_FALSE(stats->device().healthy());
  EXPECT_NE(stats->device().error().find("cudaErrorIllegalAddress"), std::string::npos)
      << stats->device().error();
  EXPECT_GE(stats->device().calls_refused(), 1u);

  // The daemon exits by itself, with the device-failure status.
  int wait_status = 0;
  ASSERT_TRUE(daemon->WaitExit(absl::Seconds(120), &wait_status))
      << "kvpoold did not exit after its device failed; log:\n"
      << daemon->LogTail();
  ASSERT_TRUE(WIFEXITED(wait_status)) << "wait status " << wait_status << "; log:\n"
                                      << daemon->LogTail();
  EXPECT_EQ(WEXITSTATUS(wait_status), 3) << daemon->LogTail();
}

}  // namespace
}  // namespace kvpool::integration
