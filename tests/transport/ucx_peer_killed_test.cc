// A real client process (kvpool-ucx-push) is SIGKILLed in the middle of a layer-wise push over
// UCX; kvpoold (in this process) must notice (UCX peer error handling / keepalive, or the idle
// timeout), roll the push back and free its staging: its stats return to the baseline and the
// sequence accepts a fresh push. Shared memory and tcp, loopback only; no timed assertions, only
// generous deadlines.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/transport/ucx_channel.h"
#include "gtest/gtest.h"
#include "tests/support/ucx_test_daemon.h"

namespace kvpool::server {
namespace {

using testing::ModelShapeSpec;
using testing::TestDaemon;
using testing::TestDaemonOptions;
using testing::TestRowBytes;
using testing::UcxTls;

// A child process with its stdout on a pipe; SIGKILLed when destroyed or when the test dies.
class ChildProcess {
 public:
  static std::unique_ptr<ChildProcess> Spawn(const std::vector<std::string>& argv) {
    int fds[2];
    if (pipe(fds) != 0) return nullptr;
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid < 0) return nullptr;
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);
      dup2(fds[1], STDOUT_FILENO);
      close(fds[0]);
      close(fds[1]);
      std::vector<char*> args;
      for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      execv(args[0], args.data());
      _exit(127);
    }
    close(fds[1]);
    auto c = std::unique_ptr<ChildProcess>(new ChildProcess());
    c->pid_ = pid;
    c->out_ = fds[0];
    return c;
  }
  ~ChildProcess() {
    Kill();
    close(out_);
  }
  // Waits up to `timeout` for a line on stdout.
  std::string ReadLine(absl::Duration timeout) {
    std::string line;
    const absl::Time end = absl::Now() + timeout;
    while (absl::Now() < end) {
      pollfd p{out_, POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      char c;
      if (read(out_, &c, 1) != 1) break;  // EOF: the child exited
      if (c == '\n') return line;
      line += c;
    }
    return line;
  }
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
  }

 private:
  ChildProcess() = default;
  pid_t pid_ = -1;
  int out_ = -1;
};

class UcxPeerKilledTest : public ::testing::TestWithParam<UcxTls> {
 protected:
  void SetUp() override {
    TestDaemonOptions o;
    o.ucx_tls = GetParam().tls;
    o.message_bytes = 16 << 10;  // many messages per layer
    o.staging_bytes = 64 << 10;
    o.idle_timeout_ms = 20000;  // the peer error should come first; this is the backstop
    auto d = TestDaemon::Start(o);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    ASSERT_TRUE(daemon_->RegisterModel(model_).ok());
    ASSERT_TRUE(daemon_->CreateSequence("m", "s").ok());
    auto st = daemon_->Stats();
    ASSERT_TRUE(st.ok());
    baseline_used_ = st->pool().used_bytes();
  }

  std::unique_ptr<ChildProcess> SpawnPusher(int push_layers, bool wait_stored) {
    return ChildProcess::Spawn(
        {std::string(KVPOOL_BINARY_DIR) + "/bin/kvpool-ucx-push", "--target=" + daemon_->target(),
         std::string("--tls=") + GetParam().tls, "--sequence=s", absl::StrCat("--tokens=", kTokens),
         absl::StrCat("--row_values=", model_.kv_heads * model_.head_dim),
         absl::StrCat("--push_layers=", push_layers),
         wait_stored ? "--wait_stored=true" : "--wait_stored=false"});
  }

  // Polls the daemon's stats until its accounting is back at the baseline.
  void ExpectCleanedUp() {
    v1::GetStatsResponse last;
    const absl::Time end = absl::Now() + absl::Seconds(120);
    bool clean = false;
    while (absl::Now() < end && !clean) {
      auto st = daemon_->Stats();
      ASSERT_TRUE(st.ok()) << st.status();
      last = *st;
      const v1::TransportStats& t = st->transport();
      clean = t.sessions() == 0 && t.open_pushes() == 0 && t.staging_bytes_in_use() == 0 &&
              t.pending_messages() == 0 && st->pool().used_bytes() == baseline_used_;
      if (!clean) absl::SleepFor(absl::Milliseconds(100));
    }
    EXPECT_TRUE(clean) << last.DebugString();
    EXPECT_GE(last.transport().peer_errors() + last.transport().timeouts(), 1u);
    EXPECT_EQ(last.transport().pushes_committed(), 0u);
    auto info = daemon_->Describe("s");
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->total_tokens(), 0u);  // nothing half-written
  }

  // The sequence is usable again: a full push from this process commits.
  void ExpectSequenceAcceptsAPush() {
    client::UcxChannelOptions o;
    o.runtime.tls = GetParam().tls;
    o.runtime.net_devices = "lo";
    auto ch = client::UcxChannel::Connect(daemon_->channel(), o);
    ASSERT_TRUE(ch.ok()) << ch.status();
    auto push = (*ch)->BeginPush({"s", 0, kTokens, true, {}});
    ASSERT_TRUE(push.ok());
    const size_t row = static_cast<size_t>(model_.kv_heads) * model_.head_dim;
    std::vector<std::string> k, v;
    k.reserve(model_.num_layers);  // PushLayer borrows k[l] and v[l] until Finish
    v.reserve(model_.num_layers);
    for (int l = 0; l < model_.num_layers; ++l) {
      k.push_back(TestRowBytes(kTokens, row, 2 * l));
      v.push_back(TestRowBytes(kTokens, row, 2 * l + 1));
      ASSERT_TRUE((*push)->PushLayer(l, 0, kTokens, k[l], v[l]).ok());
    }
    auto r = (*push)->Finish();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->total_tokens, kTokens);
  }

  static constexpr uint32_t kTokens = 512;
  ModelShapeSpec model_;
  std::unique_ptr<TestDaemon> daemon_;
  uint64_t baseline_used_ = 0;
};

TEST_P(UcxPeerKilledTest, KilledAfterSomeLayersWereStored) {
  auto child = SpawnPusher(/*push_layers=*/2, /*wait_stored=*/true);
  ASSERT_NE(child, nullptr);
  ASSERT_EQ(child->ReadLine(absl::Seconds(120)), "PUSHED");
  auto st = daemon_->Stats();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->transport().sessions(), 1u);
  EXPECT_EQ(st->transport().open_pushes(), 1u);
  EXPECT_GT(st->pool().used_bytes(), baseline_used_);  // the transaction's reserved pages
  child->Kill();
  ExpectCleanedUp();
  ExpectSequenceAcceptsAPush();
}

TEST_P(UcxPeerKilledTest, KilledWithMessagesInFlight) {
  // Every layer posted without waiting; staging holds 4 of the 32 messages the push needs, so
  // at the kill most are still in flight or waiting for staging.
  auto child = SpawnPusher(/*push_layers=*/model_.num_layers, /*wait_stored=*/false);
  ASSERT_NE(child, nullptr);
  ASSERT_EQ(child->ReadLine(absl::Seconds(120)), "PUSHED");
  child->Kill();
  ExpectCleanedUp();
  ExpectSequenceAcceptsAPush();
}

INSTANTIATE_TEST_SUITE_P(Loopback, UcxPeerKilledTest, ::testing::ValuesIn(testing::kLoopbackTls),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace kvpool::server
