// Sixteen clients against one real kvpoold at once (issue 18's soak): eight honest ones append,
// attend and release in a loop while three open header-only AppendKv streams, two freeze in the
// middle of a push, and three cancel their appends and give their Attend calls a deadline too
// short to finish. The limits (streams and reserved bytes per connection, the idle timeout) keep
// the hostile clients from pinning the pool, so every honest call succeeds; when everyone is done
// the accounting is exact: every hostile stream was either refused (reason LIMIT) or expired
// (reason LIMIT), GetStats' admission counters moved by exactly those numbers, nothing stays
// reserved or open, and the pool's fingerprint is back to its baseline.
//
// Nothing is timed: hostile clients wait for GetStats to show that all their streams ended, and
// every wait polls with a generous deadline.
#include <atomic>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "proto/status.h"
#include "tests/integration/integration_util.h"

namespace kvpool::integration {
namespace {

constexpr Shape kShape{/*num_layers=*/2, /*q_heads=*/8, /*kv_heads=*/2, /*head_dim=*/64};
constexpr int kHonest = 8, kHeaderOnly = 3, kFrozen = 2, kCancelling = 3;
constexpr int kStreamCap = 4;
// Streams each header-only client opens on its one connection: more than the cap.
constexpr int kHeaderOnlyStreams = kStreamCap + 1;
constexpr int kHeaderOnlyTokens = 8192;
constexpr int kHonestTokens = 300;

v1::AppendKvHeader Header(const std::string& id, int tokens) {
  v1::AppendKvHeader h;
  h.set_sequence_id(id);
  h.set_num_tokens(tokens);
  h.set_dtype(v1::DTYPE_BF16);
  return h;
}

class MixedClientsTest : public DaemonTest {
 protected:
  static void SetUpTestSuite() {
    StartSuiteDaemon({"--pool_bytes=33554432", "--slab_bytes=262144", "--worker_threads=2",
                      absl::StrCat("--max_streams_per_connection=", kStreamCap),
                      "--max_reserved_bytes_per_connection=3145728",
                      "--stream_idle_timeout_ms=2000"});
  }
};

// What the hostile clients saw, to compare with the daemon's counters.
struct Tally {
  absl::Mutex mu;
  int refused = 0;  // RESOURCE_EXHAUSTED, reason LIMIT
  int expired = 0;  // DEADLINE_EXCEEDED, reason LIMIT
  int other = 0;    // anything else (a failure of the test)

  void Count(const absl::Status& s) {
    absl::MutexLock lock(&mu);
    const bool limit = ReasonOf(s) == ErrorReason::kLimit;
    if (limit && s.code() == absl::StatusCode::kResourceExhausted) {
      ++refused;
    } else if (limit && s.code() == absl::StatusCode::kDeadlineExceeded) {
      ++expired;
    } else {
      ++other;
      ADD_FAILURE() << "a hostile stream ended with " << s;
    }
  }
};

TEST_F(MixedClientsTest, HonestClientsAreServedWhileOthersPinFreezeAndCancel) {
  absl::StatusOr<v1::ModelInfo> m =
      RegisterDataFree(client(), "mixed", kShape, v1::ROTATION_KIND_HADAMARD, 5);
  ASSERT_TRUE(m.ok()) << m.status();
  const v1::GetStatsResponse base = Stats();
  absl::StatusOr<std::string> base_print = PoolFingerprint(client());
  ASSERT_TRUE(base_print.ok()) << base_print.status();
  const std::string target = daemon().target();

  // Every hostile stream ends refused or expired; the hostile clients wait for all of them.
  constexpr uint64_t kHostileStreams = kHeaderOnly * kHeaderOnlyStreams + kFrozen;
  auto all_hostile_streams_ended = [&](const v1::GetStatsResponse& s) {
    return (s.admission().refused() - base.admission().refused()) +
               (s.admission().expired_idle() - base.admission().expired_idle()) >=
           kHostileStreams;
  };
  std::atomic<int> hostile_running{kHeaderOnly + kFrozen + kCancelling};
  std::atomic<int> honest_rounds{0};
  Tally tally;
  std::vector<std::thread> threads;

  for (int c = 0; c < kHonest; ++c) {
    threads.emplace_back([&, c] {
      std::unique_ptr<KvpoolClient> honest = ConnectClient(target, absl::Seconds(300));
      if (honest == nullptr) return;
      const SequenceKv kv = MakeSequenceKv(kShape, kHonestTokens, 100 + c);
      // At least one round, and rounds for as long as a hostile client is at work.
      for (int round = 0; round == 0 || hostile_running.load() > 0; ++round) {
        const std::string id = absl::StrCat("honest-", c, "-", round);
        absl::Status s = honest->CreateSequence("mixed", id).status();
        EXPECT_TRUE(s.ok()) << id << ": " << s;
        absl::StatusOr<v1::AppendKvResponse> appended = AppendSequence(*honest, id, kv);
        EXPECT_TRUE(appended.ok()) << id << ": " << appended.status();
        absl::StatusOr<v1::AttendResponse> a =
            honest->Attend(Bf16QueryRequest("mixed", 1, id, kShape, round));
        EXPECT_TRUE(a.ok()) << id << ": " << a.status();
        if (a.ok()) {
          const std::vector<float> lse(a->results(0).lse().begin(), a->results(0).lse().end());
          for (float x : lse) EXPECT_TRUE(std::isfinite(x)) << id;
        }
        s = honest->ReleaseSequence(id).status();
        EXPECT_TRUE(s.ok()) << id << ": " << s;
        honest_rounds.fetch_add(1);
      }
    });
  }

  for (int c = 0; c < kHeaderOnly; ++c) {
    threads.emplace_back([&, c] {
      std::unique_ptr<KvpoolClient> hostile = ConnectClient(target, absl::Seconds(600));
      std::vector<std::unique_ptr<client::AppendStream>> streams;
      for (int i = 0; hostile != nullptr && i < kHeaderOnlyStreams; ++i) {
        const std::string id = absl::StrCat("pin-", c, "-", i);
        EXPECT_TRUE(hostile->CreateSequence("mixed", id).ok()) << id;
        absl::StatusOr<std::unique_ptr<client::AppendStream>> s =
            hostile->OpenAppend(Header(id, kHeaderOnlyTokens));
        if (s.ok()) {
          streams.push_back(*std::move(s));
        } else {
          tally.Count(s.status());
        }
      }
      // Silent until the daemon has ended every hostile stream.
      EXPECT_TRUE(WaitForStats(all_hostile_streams_ended));
      for (auto& s : streams) tally.Count(s->Finish().status());
      for (int i = 0; hostile != nullptr && i < kHeaderOnlyStreams; ++i) {
        const std::string id = absl::StrCat("pin-", c, "-", i);
        EXPECT_TRUE(hostile->ReleaseSequence(id).ok()) << id;
      }
      hostile_running.fetch_sub(1);
    });
  }

  for (int c = 0; c < kFrozen; ++c) {
    threads.emplace_back([&, c] {
      std::unique_ptr<KvpoolClient> frozen = ConnectClient(target, absl::Seconds(600));
      const std::string id = absl::StrCat("frozen-", c);
      const SequenceKv kv = MakeSequenceKv(kShape, 512, 200 + c);
      if (frozen != nullptr && frozen->CreateSequence("mixed", id).ok()) {
        absl::StatusOr<std::unique_ptr<client::AppendStream>> s =
            frozen->OpenAppend(Header(id, kv.tokens));
        if (s.ok()) {
          // Half the layers, then nothing: the append holds the sequence until the idle limit.
          absl::Status half = (*s)->WriteLayer(0, 0, kv.tokens, AsBytes(kv.k[0]), AsBytes(kv.v[0]));
          EXPECT_TRUE(half.ok()) << half;
          EXPECT_TRUE(WaitForStats(all_hostile_streams_ended));
          tally.Count((*s)->Finish().status());
        } else {
          tally.Count(s.status());
        }
        // The lock came back with the rollback: the whole append now succeeds.
        absl::StatusOr<v1::AppendKvResponse> retry = AppendSequence(*frozen, id, kv);
        EXPECT_TRUE(retry.ok()) << id << ": " << retry.status();
        EXPECT_TRUE(frozen->ReleaseSequence(id).ok()) << id;
      }
      hostile_running.fetch_sub(1);
    });
  }

  for (int c = 0; c < kCancelling; ++c) {
    threads.emplace_back([&, c] {
      std::unique_ptr<KvpoolClient> canceller = ConnectClient(target, absl::Seconds(300));
      // Its Attend calls give up after a millisecond.
      std::unique_ptr<KvpoolClient> impatient = ConnectClient(target, absl::Milliseconds(1));
      const SequenceKv kv = MakeSequenceKv(kShape, 1024, 300 + c);
      const std::string id = absl::StrCat("cancel-", c);
      if (canceller != nullptr && impatient != nullptr &&
          canceller->CreateSequence("mixed", id).ok()) {
        // Stops once the pinning and frozen clients are done (it is the last kind running).
        for (int round = 0; round == 0 || hostile_running.load() > kCancelling; ++round) {
          // A connection per cancelled append: the daemon tears a cancelled stream down after
          // the client has moved on, and the next one must not meet the connection's stream cap
          // (the refusals counted here are the pinning clients').
          std::unique_ptr<KvpoolClient> appender = ConnectClient(target, absl::Seconds(300));
          if (appender == nullptr) break;
          absl::StatusOr<std::unique_ptr<client::AppendStream>> s =
              appender->OpenAppend(Header(id, kv.tokens));
          if (s.ok()) {
            (void)(*s)->WriteLayer(0, 0, kv.tokens, AsBytes(kv.k[0]), AsBytes(kv.v[0]));
            (*s)->Cancel();
            // ABORTED: the daemon was still rolling back this sequence's previous cancelled
            // append when this one began.
            const absl::Status ended = (*s)->Finish().status();
            EXPECT_TRUE(ended.code() == absl::StatusCode::kCancelled ||
                        ended.code() == absl::StatusCode::kAborted)
                << ended;
          }
          const absl::Status attended =
              impatient->Attend(Bf16QueryRequest("mixed", 1, id, kShape, round)).status();
          EXPECT_TRUE(attended.ok() || attended.code() == absl::StatusCode::kDeadlineExceeded)
              << attended;
        }
        // The last cancelled append may still hold the sequence for a moment.
        absl::Status released;
        for (int i = 0; i < 2400; ++i) {
          released = canceller->ReleaseSequence(id).status();
          if (released.code() != absl::StatusCode::kAborted) break;
          absl::SleepFor(absl::Milliseconds(50));
        }
        EXPECT_TRUE(released.ok()) << id << ": " << released;
      }
      hostile_running.fetch_sub(1);
    });
  }
  for (std::thread& t : threads) t.join();

  // Nothing stays open or reserved, and the pool is exactly as it was.
  ASSERT_TRUE(WaitForStats([&](const v1::GetStatsResponse& s) {
    return s.admission().open_streams() == 0 && s.admission().reserved_bytes() == 0 &&
           s.pool().used_bytes() == base.pool().used_bytes();
  })) << "streams still open or bytes still reserved after every client finished";
  absl::StatusOr<std::string> after_print = PoolFingerprint(client());
  ASSERT_TRUE(after_print.ok()) << after_print.status();
  EXPECT_EQ(*after_print, *base_print);

  // The daemon's counters say exactly what the hostile clients saw.
  const v1::GetStatsResponse after = Stats();
  absl::MutexLock lock(&tally.mu);
  EXPECT_EQ(tally.other, 0);
  EXPECT_EQ(static_cast<uint64_t>(tally.refused + tally.expired), kHostileStreams);
  EXPECT_EQ(after.admission().refused() - base.admission().refused(),
            static_cast<uint64_t>(tally.refused));
  EXPECT_EQ(after.admission().expired_idle() - base.admission().expired_idle(),
            static_cast<uint64_t>(tally.expired));
  EXPECT_EQ(after.admission().expired_total(), base.admission().expired_total());
  // Some streams of each header-only client were admitted and then expired, the rest refused.
  EXPECT_GE(tally.expired, kFrozen + kHeaderOnly);
  EXPECT_GE(tally.refused, kHeaderOnly);
  EXPECT_GE(honest_rounds.load(), kHonest);
  std::printf("honest rounds %d; hostile streams refused %d, expired %d\n", honest_rounds.load(),
              tally.refused, tally.expired);
}

}  // namespace
}  // namespace kvpool::integration
