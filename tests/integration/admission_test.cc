// Admission against a real kvpoold (issue 18, cases 1 and 2): AppendKv streams that send a header
// and then nothing cannot pin the pool (over the per-connection stream cap they are refused with
// reason LIMIT; after the idle timeout their appends are rolled back and their pages are free
// again), and a client frozen mid-push (a child process stopped with SIGSTOP) loses its
// reservation and the sequence's append lock after the idle timeout, so another client's retry
// and SealSequence succeed. The accounting is exact: the pool's fingerprint comes back to its
// baseline and GetStats' admission counters say what happened. An Attend whose answer could
// not fit in one message is refused before any work (case 3's last failure).
//
// On 07fc4f8 none of this held: a header reserved every page of its append for as long as the
// stream stayed open, with no cap on streams and no idle limit outside UCX pushes, so the fifth
// stream was admitted, the reservations never came back and the frozen client's lock stayed.
//
// Nothing is timed: every wait polls GetStats for its condition with a generous deadline.
#include <signal.h>
#include <spawn.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "proto/status.h"
#include "tests/integration/integration_util.h"

extern char** environ;

namespace kvpool::integration {
namespace {

constexpr Shape kShape{/*num_layers=*/2, /*q_heads=*/8, /*kv_heads=*/2, /*head_dim=*/64};
constexpr int kStreamCap = 4;
// The frozen child's environment: the daemon's target and the sequence it pushes to.
constexpr char kChildTarget[] = "KVPOOL_ADMISSION_CHILD_TARGET";
constexpr char kChildSequence[] = "KVPOOL_ADMISSION_CHILD_SEQUENCE";
constexpr int kChildTokens = 512;
// The descriptor the child says "pushed" on (its stdout carries gtest's output).
constexpr int kChildReadyFd = 100;

v1::AppendKvHeader Header(const std::string& id, int tokens) {
  v1::AppendKvHeader h;
  h.set_sequence_id(id);
  h.set_token_start(0);
  h.set_num_tokens(tokens);
  h.set_dtype(v1::DTYPE_BF16);
  return h;
}

absl::StatusOr<v1::AppendKvResponse> AppendAll(const KvpoolClient& c, const std::string& id,
                                               const SequenceKv& kv) {
  return AppendSequence(c, id, kv);
}

std::unique_ptr<KvpoolClient> Connect(const std::string& target) {
  return ConnectClient(target, absl::Seconds(600));
}

class AdmissionTest : public DaemonTest {
 protected:
  static void SetUpTestSuite() {
    StartSuiteDaemon({"--pool_bytes=8388608", "--slab_bytes=262144", "--worker_threads=2",
                      absl::StrCat("--max_streams_per_connection=", kStreamCap),
                      "--stream_idle_timeout_ms=10000"});
  }

  void SetUp() override {
    DaemonTest::SetUp();
    if (!registered_) {
      absl::StatusOr<v1::ModelInfo> m =
          RegisterDataFree(client(), "adm", kShape, v1::ROTATION_KIND_HADAMARD, 1);
      ASSERT_TRUE(m.ok()) << m.status();
      registered_ = true;
    }
  }

  static bool registered_;
};

bool AdmissionTest::registered_ = false;

void ExpectLimit(const absl::Status& s, absl::StatusCode code) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_EQ(ReasonOf(s), ErrorReason::kLimit) << s;
}

TEST_F(AdmissionTest, HeaderOnlyStreamsAreCappedAndExpireSoAnHonestAppendSucceeds) {
  for (const char* id : {"pin-0", "pin-1", "pin-2", "pin-3", "pin-extra", "honest"}) {
    ASSERT_TRUE(client().CreateSequence("adm", id).ok()) << id;
  }
  const v1::GetStatsResponse base = Stats();
  absl::StatusOr<std::string> base_print = PoolFingerprint(client());
  ASSERT_TRUE(base_print.ok()) << base_print.status();
  const uint64_t capacity = base.pool().capacity_bytes();

  // How many pool bytes a header of `probe` tokens reserves: a probe stream, cancelled.
  constexpr int kProbe = 8192;
  uint64_t probe_bytes = 0;
  {
    absl::StatusOr<std::unique_ptr<client::AppendStream>> probe =
        client().OpenAppend(Header("pin-0", kProbe));
    ASSERT_TRUE(probe.ok()) << probe.status();
    ASSERT_TRUE(WaitForStats([&](const v1::GetStatsResponse& s) {
      probe_bytes = s.admission().reserved_bytes();
      return s.admission().reserved_bytes() > 0;
    }));
    (*probe)->Cancel();
  }
  ASSERT_TRUE(WaitForStats([&](const v1::GetStatsResponse& s) {
    return s.admission().open_streams() == 0 && s.admission().reserved_bytes() == 0;
  }));

  // An honest append needing about 30 % of the pool (made before the streams start idling).
  const int honest_tokens = static_cast<int>(0.3 * capacity / probe_bytes * kProbe);
  const SequenceKv honest_kv = MakeSequenceKv(kShape, honest_tokens, 7);
  std::unique_ptr<KvpoolClient> honest = Connect(daemon().target());
  ASSERT_NE(honest, nullptr);

  // kStreamCap streams on one connection, each reserving about a fifth of the pool.
  const int tokens = static_cast<int>(0.2 * capacity / probe_bytes * kProbe);
  std::unique_ptr<KvpoolClient> hostile = Connect(daemon().target());
  ASSERT_NE(hostile, nullptr);
  std::vector<std::unique_ptr<client::AppendStream>> pins;
  for (int i = 0; i < kStreamCap; ++i) {
    const std::string id = absl::StrCat("pin-", i);
    absl::StatusOr<std::unique_ptr<client::AppendStream>> s =
        hostile->OpenAppend(Header(id, tokens));
    ASSERT_TRUE(s.ok()) << s.status();
    pins.push_back(*std::move(s));
  }
  uint64_t pinned = 0;
  ASSERT_TRUE(WaitForStats([&](const v1::GetStatsResponse& s) {
    pinned = s.admission().reserved_bytes();
    return s.admission().open_streams() == kStreamCap &&
           s.pool().used_bytes() - base.pool().used_bytes() == pinned && pinned > capacity / 2;
  })) << "the "
      << kStreamCap << " header-only streams did not reserve their pages";

  // One more stream on the same connection is refused before it reserves anything.
  {
    absl::StatusOr<std::unique_ptr<client::AppendStream>> extra =
        hostile->OpenAppend(Header("pin-extra", tokens));
    const absl::Status refused = extra.ok() ? (*extra)->Finish().status() : extra.status();
    ExpectLimit(refused, absl::StatusCode::kResourceExhausted);
  }
  // Nothing more reserved (less once a pin's idle limit passes, which a loaded machine can reach
  // by now).
  EXPECT_LE(Stats().admission().reserved_bytes(), pinned);

  // Meanwhile an honest client on its own connection cannot get the pages it needs.
  const absl::Status pinned_out = AppendAll(*honest, "honest", honest_kv).status();
  EXPECT_EQ(pinned_out.code(), absl::StatusCode::kResourceExhausted) << pinned_out;
  EXPECT_EQ(ReasonOf(pinned_out), std::nullopt) << "the pool is full, no limit was hit";

  // After the idle timeout every header-only stream is rolled back and ends with
  // DEADLINE_EXCEEDED, reason LIMIT; its pages are back in the pool.
  ASSERT_TRUE(WaitForStats([&](const v1::GetStatsResponse& s) {
    return s.admission().open_streams() == 0 && s.admission().reserved_bytes() == 0 &&
           s.pool().used_bytes() == base.pool().used_bytes();
  })) << "header-only streams still hold the pool";
  for (auto& pin : pins) ExpectLimit(pin->Finish().status(), absl::StatusCode::kDeadlineExceeded);
  const v1::GetStatsResponse after = Stats();
  EXPECT_EQ(after.admission().expired_idle() - base.admission().expired_idle(),
            static_cast<uint64_t>(kStreamCap));
  EXPECT_EQ(after.admission().refused() - base.admission().refused(), 1u);
  EXPECT_EQ(after.admission().expired_total(), base.admission().expired_total());

  // The pool is exactly as it was (the sequences are still there, empty), and the limits are
  // visible to clients.
  absl::StatusOr<std::string> after_print = PoolFingerprint(client());
  ASSERT_TRUE(after_print.ok()) << after_print.status();
  EXPECT_EQ(*after_print, *base_print);
  EXPECT_EQ(after.limits().max_streams_per_connection(), static_cast<uint32_t>(kStreamCap));
  EXPECT_EQ(after.limits().stream_idle_timeout_ms(), 10000u);

  // Now the honest append gets its pages, and the hostile connection may open streams again.
  absl::StatusOr<v1::AppendKvResponse> ok = AppendAll(*honest, "honest", honest_kv);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->sequence().total_tokens(), static_cast<uint32_t>(honest_tokens));
  const SequenceKv small = MakeSequenceKv(kShape, 64, 8);
  EXPECT_TRUE(AppendAll(*hostile, "pin-0", small).ok());
  for (const char* id : {"honest", "pin-0", "pin-1", "pin-2", "pin-3", "pin-extra"}) {
    EXPECT_TRUE(client().ReleaseSequence(id).ok()) << id;
  }
  EXPECT_TRUE(WaitForStats([&](const v1::GetStatsResponse& s) {
    return s.pool().used_bytes() == base.pool().used_bytes() && s.admission().open_streams() == 0 &&
           s.admission().reserved_bytes() == 0;
  }));
}

// An Attend whose FP32 answer could not fit in one message is refused before any work (it used to
// be computed in full and then fail in gRPC): BF16 queries of 12 x 1000 rows fit the 16 MiB
// message limit, their outputs and LSE (about 25 MB) do not.
TEST_F(AdmissionTest, AnAttendWhoseAnswerExceedsTheMessageLimitIsRefusedUpFront) {
  constexpr int kSequences = 12, kRows = 1000;
  v1::AttendRequest req;
  req.set_model_id("adm");
  req.set_layer(0);
  req.set_dtype(v1::DTYPE_BF16);
  const std::vector<Bf16> q = GaussianBf16(size_t{kRows} * kShape.q_heads * kShape.head_dim, 3);
  for (int i = 0; i < kSequences; ++i) {
    const std::string id = absl::StrCat("att-", i);
    ASSERT_TRUE(client().CreateSequence("adm", id).ok());
    v1::SequenceQuery* sq = req.add_queries();
    sq->set_sequence_id(id);
    sq->set_num_queries(kRows);
    sq->set_q(std::string(AsBytes(q)));
  }
  const v1::GetStatsResponse before = Stats();
  ASSERT_LT(req.ByteSizeLong(), before.limits().max_message_bytes());
  const absl::Status s = client().Attend(req).status();
  ExpectLimit(s, absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("max_message_bytes"), std::string::npos) << s;
  EXPECT_EQ(Stats().service().attention_calls(), before.service().attention_calls());
  for (int i = 0; i < kSequences; ++i) {
    EXPECT_TRUE(client().ReleaseSequence(absl::StrCat("att-", i)).ok());
  }
}

// Runs `argv` with `env` added and a pipe on kChildReadyFd; returns the pid and the pipe's read
// end.
pid_t SpawnWithPipe(std::vector<std::string> argv, const std::vector<std::string>& env,
                    int* out_fd) {
  int fds[2];
  if (pipe(fds) != 0) return -1;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  posix_spawn_file_actions_adddup2(&actions, fds[1], kChildReadyFd);
  std::vector<std::string> envs = env;
  for (char** e = environ; *e != nullptr; ++e) envs.emplace_back(*e);
  std::vector<char*> a, e;
  for (std::string& s : argv) a.push_back(s.data());
  a.push_back(nullptr);
  for (std::string& s : envs) e.push_back(s.data());
  e.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, a[0], &actions, nullptr, a.data(), e.data());
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  if (rc != 0) {
    close(fds[0]);
    return -1;
  }
  *out_fd = fds[0];
  return pid;
}

TEST_F(AdmissionTest, AFrozenClientLosesItsLockAndReservationAfterTheIdleTimeout) {
  const v1::GetStatsResponse base = Stats();
  ASSERT_EQ(base.admission().open_streams(), 0u);
  ASSERT_TRUE(client().CreateSequence("adm", "frozen").ok());

  // A child process (this binary, one test) pushes the header and layer 0, then stops itself.
  int out = -1;
  const pid_t child = SpawnWithPipe(
      {"/proc/self/exe", "--gtest_filter=AdmissionFrozenChild.PushHalfThenStop"},
      {absl::StrCat(kChildTarget, "=", daemon().target()), absl::StrCat(kChildSequence, "=frozen")},
      &out);
  ASSERT_GT(child, 0);
  struct Reap {
    pid_t pid;
    int fd;
    ~Reap() {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
      close(fd);
    }
  } reap{child, out};
  char ready = 0;
  ASSERT_EQ(read(out, &ready, 1), 1) << "the child did not push";
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, WUNTRACED), child);
  ASSERT_TRUE(WIFSTOPPED(status)) << "the child did not stop";
  ASSERT_TRUE(WaitForStats([&](const v1::GetStatsResponse& s) {
    return s.admission().open_streams() == 1 && s.admission().reserved_bytes() > 0;
  }));

  // While it is frozen, its append holds the sequence: a retry and a seal are refused.
  const SequenceKv kv = MakeSequenceKv(kShape, kChildTokens, 11);
  EXPECT_EQ(AppendAll(client(), "frozen", kv).status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(client().SealSequence("frozen").status().code(), absl::StatusCode::kAborted);

  // After the idle timeout the daemon rolls the frozen append back: lock and pages are free.
  ASSERT_TRUE(WaitForStats([&](const v1::GetStatsResponse& s) {
    return s.admission().open_streams() == 0 && s.admission().reserved_bytes() == 0 &&
           s.pool().used_bytes() == base.pool().used_bytes();
  })) << "the frozen client still holds its reservation";
  const v1::GetStatsResponse after = Stats();
  EXPECT_EQ(after.admission().expired_idle() - base.admission().expired_idle(), 1u);

  absl::StatusOr<v1::AppendKvResponse> retry = AppendAll(client(), "frozen", kv);
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_EQ(retry->sequence().total_tokens(), static_cast<uint32_t>(kChildTokens));
  absl::StatusOr<v1::SequenceInfo> sealed = client().SealSequence("frozen");
  ASSERT_TRUE(sealed.ok()) << sealed.status();
  EXPECT_TRUE(client().ReleaseSequence("frozen").ok());
  EXPECT_TRUE(WaitForStats([&](const v1::GetStatsResponse& s) {
    return s.pool().used_bytes() == base.pool().used_bytes();
  }));
}

// The frozen client of the test above, run as a child process: skipped unless its environment
// names a daemon. It pushes the header and layer 0 of an append, says so on kChildReadyFd, stops
// itself (SIGSTOP) with the stream open.
TEST(AdmissionFrozenChild, PushHalfThenStop) {
  const char* target = std::getenv(kChildTarget);
  const char* id = std::getenv(kChildSequence);
  if (target == nullptr || id == nullptr) GTEST_SKIP() << "run by the admission test";
  std::unique_ptr<KvpoolClient> c = Connect(target);
  ASSERT_NE(c, nullptr);
  const SequenceKv kv = MakeSequenceKv(kShape, kChildTokens, 11);
  absl::StatusOr<std::unique_ptr<client::AppendStream>> s = c->OpenAppend(Header(id, kv.tokens));
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_TRUE((*s)->WriteLayer(0, 0, kv.tokens, AsBytes(kv.k[0]), AsBytes(kv.v[0])).ok());
  ASSERT_EQ(write(kChildReadyFd, "r", 1), 1);
  raise(SIGSTOP);
  // Killed by the parent; never resumed.
}

}  // namespace
}  // namespace kvpool::integration
