// Remote attention over UCX stops when its session ends (issue 18, cancellation on every path):
// a client asks for far more attention work than its deadline allows, gives up, and closes its
// UCX channel; the daemon skips the remaining sequences of that call (GetStats counts them and
// the cancelled call), its worker queue drains, and another caller is served. Before, a UCX
// attention call always ran to the end, whoever was left to receive it.
//
// Nothing is timed: the waits poll GetStats with a generous deadline.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/transport/ucx_channel.h"
#include "tests/integration/integration_util.h"

namespace kvpool::integration {
namespace {

constexpr Shape kShape{/*num_layers=*/2, /*q_heads=*/8, /*kv_heads=*/2, /*head_dim=*/64};
constexpr int kTokens = 32768;
constexpr int kSequences = 64;
constexpr int kQueries = 16;

class UcxCancellationTest : public DaemonTest {
 protected:
  static void SetUpTestSuite() {
    StartSuiteDaemon({"--pool_bytes=268435456", "--worker_threads=2", "--transports=ucx",
                      "--ucx_tls=tcp", "--ucx_net_devices=lo"});
  }

  client::UcxChannelOptions ChannelOptions(absl::Duration deadline) {
    client::UcxChannelOptions o;
    o.runtime.tls = "tcp";
    o.runtime.net_devices = "lo";
    o.deadline = deadline;
    return o;
  }
};

TEST_F(UcxCancellationTest, AttentionStopsWhenTheSessionThatAskedEnds) {
  if (TestingOnGpu()) GTEST_SKIP() << "one device call per request on a GPU daemon";
  ASSERT_TRUE(
      RegisterDataFree(client(), "ucxc", kShape, v1::ROTATION_KIND_RANDOMIZED_HADAMARD, 3).ok());
  const SequenceKv kv = MakeSequenceKv(kShape, kTokens, 5);
  ASSERT_TRUE(CreateAndAppend(client(), "ucxc", "long", kv, true).ok());
  const v1::GetStatsResponse before = Stats();

  // Far more work than a deadline of one second leaves time for.
  const std::vector<Bf16> q_bf16 =
      GaussianBf16(size_t{kQueries} * kShape.q_heads * kShape.head_dim, 9);
  std::vector<float> q(q_bf16.size());
  for (size_t i = 0; i < q.size(); ++i) q[i] = q_bf16[i].ToFloat();
  std::vector<client::UcxSequenceQuery> batch(kSequences, {"long", kQueries, q.data()});
  {
    absl::StatusOr<std::unique_ptr<client::UcxChannel>> ch =
        client::UcxChannel::Connect(client().channel(), ChannelOptions(absl::Seconds(1)));
    ASSERT_TRUE(ch.ok()) << ch.status();
    std::vector<client::UcxAttentionResult> out;
    const absl::Status s = (*ch)->Attend("ucxc", 0, q.size() / kQueries, batch, &out);
    ASSERT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  }  // the channel closes its session

  // The daemon stops the call between sequences: the skipped work shows in its counters and the
  // worker queue drains.
  ASSERT_TRUE(WaitForStats([&](const v1::GetStatsResponse& s) {
    return s.lifecycle().units_skipped() > before.lifecycle().units_skipped() &&
           s.service().worker_queue_depth() == 0;
  })) << "the attention of a closed session ran on";
  const v1::GetStatsResponse after = Stats();
  EXPECT_LE(after.lifecycle().units_skipped() - before.lifecycle().units_skipped(),
            static_cast<uint64_t>(kSequences));
  EXPECT_EQ(after.lifecycle().calls_cancelled(), before.lifecycle().calls_cancelled() + 1);

  // Another caller, on a new channel, is served.
  absl::StatusOr<std::unique_ptr<client::UcxChannel>> ch =
      client::UcxChannel::Connect(client().channel(), ChannelOptions(absl::Seconds(120)));
  ASSERT_TRUE(ch.ok()) << ch.status();
  std::vector<client::UcxAttentionResult> out;
  const absl::Status s =
      (*ch)->Attend("ucxc", 1, q.size() / kQueries, {{"long", 1, q.data()}}, &out);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].attended_tokens, static_cast<uint32_t>(kTokens));
}

}  // namespace
}  // namespace kvpool::integration
