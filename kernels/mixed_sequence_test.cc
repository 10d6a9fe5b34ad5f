#include "kernels/mixed_sequence.h"

#include <algorithm>
#include <limits>
#include <random>

#include "gtest/gtest.h"

namespace kvpool {
namespace {

constexpr TierConfig kCfg{/*sink_tokens=*/64, /*recent_tokens=*/256, /*demotion_batch=*/16};

// Plans and commits one append; fails the test on error.
AppendPlan Apply(MixedSequenceLayout& seq, int tokens, AppendKind kind) {
  absl::StatusOr<AppendPlan> plan = seq.PlanAppend(tokens, kind);
  EXPECT_TRUE(plan.ok()) << plan.status();
  if (!plan.ok()) return AppendPlan{};
  EXPECT_EQ(plan->to_sink + plan->to_history + plan->to_recent, tokens);
  seq.Commit(*plan, kind);
  return *plan;
}

TEST(MixedSequenceTest, FinalPrefillShorterThanSinkGoesToSink) {
  MixedSequenceLayout seq(kCfg);
  const AppendPlan plan = Apply(seq, 40, AppendKind::kFinalPrefill);
  EXPECT_EQ(plan.to_sink, 40);
  EXPECT_EQ(plan.to_history, 0);
  EXPECT_EQ(plan.to_recent, 0);
  EXPECT_EQ(plan.demote, 0);
  EXPECT_EQ(seq.sink(), 40);
  EXPECT_EQ(seq.total(), 40);
  EXPECT_TRUE(seq.prefill_done());
}

TEST(MixedSequenceTest, FinalPrefillBetweenSinkAndSinkPlusWindowHasNoHistory) {
  for (int len : {64, 65, 200, 64 + 256}) {
    MixedSequenceLayout seq(kCfg);
    const AppendPlan plan = Apply(seq, len, AppendKind::kFinalPrefill);
    EXPECT_EQ(plan.to_sink, 64) << len;
    EXPECT_EQ(plan.to_history, 0) << len;
    EXPECT_EQ(plan.to_recent, len - 64) << len;
    EXPECT_EQ(seq.recent(), len - 64) << len;
  }
}

TEST(MixedSequenceTest, LongFinalPrefillKeepsLastWindowRecent) {
  MixedSequenceLayout seq(kCfg);
  const AppendPlan plan = Apply(seq, 5000, AppendKind::kFinalPrefill);
  EXPECT_EQ(plan.to_sink, 64);
  EXPECT_EQ(plan.to_history, 5000 - 64 - 256);
  EXPECT_EQ(plan.to_recent, 256);
  EXPECT_EQ(plan.demote, 0);
  EXPECT_EQ(seq.sink(), 64);
  EXPECT_EQ(seq.history(), 5000 - 64 - 256);
  EXPECT_EQ(seq.recent(), 256);
  EXPECT_EQ(seq.total(), 5000);
}

TEST(MixedSequenceTest, ChunkedPrefillSendsNonFinalChunksToHistory) {
  MixedSequenceLayout seq(kCfg);
  AppendPlan plan = Apply(seq, 30, AppendKind::kPrefill);  // partly fills the sink
  EXPECT_EQ(plan.to_sink, 30);
  EXPECT_EQ(plan.to_history, 0);
  EXPECT_FALSE(seq.prefill_done());

  plan = Apply(seq, 1000, AppendKind::kPrefill);  // completes the sink, rest to history
  EXPECT_EQ(plan.to_sink, 34);
  EXPECT_EQ(plan.to_history, 966);
  EXPECT_EQ(plan.to_recent, 0);
  EXPECT_EQ(seq.recent(), 0);

  plan = Apply(seq, 100, AppendKind::kFinalPrefill);  // shorter than W: all recent
  EXPECT_EQ(plan.to_sink, 0);
  EXPECT_EQ(plan.to_history, 0);
  EXPECT_EQ(plan.to_recent, 100);

  EXPECT_EQ(seq.sink(), 64);
  EXPECT_EQ(seq.history(), 966);
  EXPECT_EQ(seq.recent(), 100);
  EXPECT_TRUE(seq.prefill_done());
}

TEST(MixedSequenceTest, ChunkedPrefillLongFinalChunk) {
  MixedSequenceLayout seq(kCfg);
  Apply(seq, 500, AppendKind::kPrefill);
  const AppendPlan plan = Apply(seq, 700, AppendKind::kFinalPrefill);
  EXPECT_EQ(plan.to_sink, 0);
  EXPECT_EQ(plan.to_history, 700 - 256);
  EXPECT_EQ(plan.to_recent, 256);
  EXPECT_EQ(seq.history(), 436 + 444);
  EXPECT_EQ(seq.total(), 1200);
}

TEST(MixedSequenceTest, DecodeDemotesBatchOfOldestTokens) {
  const TierConfig cfg{64, 256, 16};
  MixedSequenceLayout seq(cfg);
  Apply(seq, 1000, AppendKind::kFinalPrefill);
  ASSERT_EQ(seq.recent(), 256);
  int demotions = 0;
  for (int step = 0; step < 200; ++step) {
    const int history_before = seq.history();
    const int recent_before = seq.recent();
    const AppendPlan plan = Apply(seq, 1, AppendKind::kDecode);
    EXPECT_EQ(plan.to_sink, 0);
    EXPECT_EQ(plan.to_history, 0);
    EXPECT_EQ(plan.to_recent, 1);
    if (recent_before == cfg.recent_tokens + cfg.demotion_batch - 1) {
      EXPECT_EQ(plan.demote, cfg.demotion_batch) << step;
      EXPECT_EQ(seq.history(), history_before + cfg.demotion_batch);
      ++demotions;
    } else {
      EXPECT_EQ(plan.demote, 0) << step;
      EXPECT_EQ(seq.history(), history_before);
    }
    EXPECT_GE(seq.recent(), cfg.recent_tokens);
    EXPECT_LE(seq.recent(), cfg.recent_tokens + cfg.demotion_batch - 1);
    EXPECT_EQ(seq.total(), 1000 + step + 1);
  }
  // The first demotion is at step 15 (recent 271 -> 272), then every 16 steps.
  EXPECT_EQ(demotions, (200 - 16) / 16 + 1);
}

TEST(MixedSequenceTest, DecodeAfterShortPrefillWarmsUpBeforeDemoting) {
  const TierConfig cfg{64, 256, 16};
  MixedSequenceLayout seq(cfg);
  Apply(seq, 100, AppendKind::kFinalPrefill);  // recent 36
  int first_demotion = -1;
  for (int step = 0; step < 400; ++step) {
    const AppendPlan plan = Apply(seq, 1, AppendKind::kDecode);
    if (plan.demote > 0 && first_demotion < 0) first_demotion = step;
    if (first_demotion >= 0) {
      EXPECT_GE(seq.recent(), cfg.recent_tokens);
      EXPECT_LE(seq.recent(), cfg.recent_tokens + cfg.demotion_batch - 1);
    } else {
      EXPECT_LE(seq.recent(), cfg.recent_tokens + cfg.demotion_batch - 1);
    }
  }
  // Recent reaches W + B = 272 at decode step 272 - 36 - 1.
  EXPECT_EQ(first_demotion, 272 - 36 - 1);
  EXPECT_EQ(seq.sink(), 64);
}

TEST(MixedSequenceTest, ZeroWindowSendsDecodeTokensToHistoryInBatches) {
  const TierConfig cfg{8, 0, 8};
  MixedSequenceLayout seq(cfg);
  Apply(seq, 20, AppendKind::kFinalPrefill);
  EXPECT_EQ(seq.history(), 12);
  EXPECT_EQ(seq.recent(), 0);
  for (int step = 0; step < 32; ++step) {
    const AppendPlan plan = Apply(seq, 1, AppendKind::kDecode);
    if (step % 8 == 7) {
      EXPECT_EQ(plan.demote, 7);
      EXPECT_EQ(plan.to_history, 1);
      EXPECT_EQ(plan.to_recent, 0);
      EXPECT_EQ(seq.recent(), 0);
    } else {
      EXPECT_EQ(plan.demote, 0);
      EXPECT_EQ(plan.to_recent, 1);
    }
  }
  EXPECT_EQ(seq.history(), 12 + 32);
}

TEST(MixedSequenceTest, RejectsPrefillAfterFinalChunk) {
  MixedSequenceLayout seq(kCfg);
  Apply(seq, 500, AppendKind::kFinalPrefill);
  EXPECT_EQ(seq.PlanAppend(10, AppendKind::kPrefill).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(seq.PlanAppend(10, AppendKind::kFinalPrefill).status().code(),
            absl::StatusCode::kFailedPrecondition);
  Apply(seq, 1, AppendKind::kDecode);
  EXPECT_EQ(seq.PlanAppend(1, AppendKind::kPrefill).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(MixedSequenceTest, RejectsDecodeBeforeFinalPrefill) {
  MixedSequenceLayout seq(kCfg);
  EXPECT_EQ(seq.PlanAppend(1, AppendKind::kDecode).status().code(),
            absl::StatusCode::kFailedPrecondition);
  Apply(seq, 100, AppendKind::kPrefill);
  EXPECT_EQ(seq.PlanAppend(1, AppendKind::kDecode).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(MixedSequenceTest, RejectsBadTokenCounts) {
  MixedSequenceLayout seq(kCfg);
  for (AppendKind kind : {AppendKind::kPrefill, AppendKind::kFinalPrefill, AppendKind::kDecode}) {
    EXPECT_EQ(seq.PlanAppend(0, kind).status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(seq.PlanAppend(-5, kind).status().code(), absl::StatusCode::kInvalidArgument);
  }
  Apply(seq, 10, AppendKind::kFinalPrefill);
  EXPECT_EQ(seq.PlanAppend(2, AppendKind::kDecode).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MixedSequenceTest, RejectsTokenCountOverflow) {
  MixedSequenceLayout seq(kCfg);
  Apply(seq, 1000, AppendKind::kPrefill);
  EXPECT_EQ(seq.PlanAppend(std::numeric_limits<int>::max(), AppendKind::kPrefill).status().code(),
            absl::StatusCode::kOutOfRange);
}

TEST(MixedSequenceTest, RejectsInvalidConfig) {
  for (TierConfig cfg : {TierConfig{-1, 256, 16}, TierConfig{64, -8, 16}, TierConfig{64, 256, 0}}) {
    MixedSequenceLayout seq(cfg);
    EXPECT_EQ(seq.PlanAppend(10, AppendKind::kPrefill).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
}

TEST(MixedSequenceTest, PlanChangesNothing) {
  MixedSequenceLayout seq(kCfg);
  ASSERT_TRUE(seq.PlanAppend(5000, AppendKind::kFinalPrefill).ok());
  EXPECT_EQ(seq.total(), 0);
  EXPECT_FALSE(seq.prefill_done());
}

TEST(MixedSequenceTest, FromQuantConfigCopiesTierSizes) {
  QuantConfig q;
  q.sink_tokens = 32;
  q.recent_tokens = 128;
  q.demotion_batch = 8;
  const TierConfig t = TierConfig::FromQuantConfig(q);
  EXPECT_EQ(t.sink_tokens, 32);
  EXPECT_EQ(t.recent_tokens, 128);
  EXPECT_EQ(t.demotion_batch, 8);
}

// Random chunked prefills followed by decode: the tiers always partition the tokens, the sink
// never exceeds S0, the history only grows, and after warm-up W <= recent <= W + B - 1.
TEST(MixedSequenceTest, RandomizedInvariants) {
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 300; ++trial) {
    const int sink = 8 * std::uniform_int_distribution<int>(0, 8)(rng);
    const int window = 8 * std::uniform_int_distribution<int>(0, 32)(rng);
    const int batch = 1 << std::uniform_int_distribution<int>(0, 5)(rng);
    const TierConfig cfg{sink, window, batch};
    MixedSequenceLayout seq(cfg);
    int expected_total = 0;
    int last_history = 0;
    const int chunks = std::uniform_int_distribution<int>(0, 4)(rng);
    for (int c = 0; c <= chunks; ++c) {
      const AppendKind kind = c == chunks ? AppendKind::kFinalPrefill : AppendKind::kPrefill;
      const int n = std::uniform_int_distribution<int>(1, 700)(rng);
      const int recent_before = seq.recent();
      const AppendPlan plan = Apply(seq, n, kind);
      EXPECT_EQ(plan.demote, 0);
      if (kind == AppendKind::kPrefill) {
        EXPECT_EQ(plan.to_recent, 0);
        EXPECT_EQ(seq.recent(), 0);
      } else {
        EXPECT_EQ(recent_before, 0);
        EXPECT_EQ(plan.to_recent, std::min(n - plan.to_sink, window));
      }
      expected_total += n;
      EXPECT_EQ(seq.total(), expected_total);
      EXPECT_EQ(seq.sink() + seq.history() + seq.recent(), seq.total());
      EXPECT_LE(seq.sink(), sink);
      EXPECT_GE(seq.history(), last_history);
      last_history = seq.history();
    }
    bool warm = seq.recent() >= window;
    const int steps = std::uniform_int_distribution<int>(0, 600)(rng);
    for (int s = 0; s < steps; ++s) {
      const int sink_before = seq.sink();
      const AppendPlan plan = Apply(seq, 1, AppendKind::kDecode);
      EXPECT_TRUE(plan.demote == 0 || plan.demote + plan.to_history == batch);
      EXPECT_EQ(seq.sink(), sink_before);
      ++expected_total;
      EXPECT_EQ(seq.total(), expected_total);
      EXPECT_EQ(seq.sink() + seq.history() + seq.recent(), seq.total());
      EXPECT_GE(seq.history(), last_history);
      last_history = seq.history();
      warm = warm || seq.recent() >= window;
      EXPECT_LE(seq.recent(), window + batch - 1);
      if (warm) {
        EXPECT_GE(seq.recent(), window);
      }
    }
  }
}

}  // namespace
}  // namespace kvpool
