// The mixed-precision layout of one sequence (docs/oscar-method.md section 10) as a small state
// machine over token counts: a BF16 sink [0, S0), an INT2 history, and a BF16 recent window
// whose oldest tokens are demoted to INT2 in batches.
//
//   [0, sink)   [sink, sink + history)   [sink + history, total)
//     BF16 sink      INT2 history              BF16 recent
//
// Rules:
// - Prefill chunk of n tokens, final: fill the sink up to S0, then the LAST min(rest, W) tokens
//   of the chunk go to recent and the tokens between go to history. Non-final chunk: after the
//   sink everything goes to history. A prefill chunk after the final one, or after decode,
//   is FailedPrecondition.
// - Decode token: appended to recent; when recent reaches W + B (B = demotion batch), the B
//   oldest recent tokens are demoted to history, so W <= recent <= W + B - 1 after each step.
// The layout is the same for every layer, so a server can keep one per sequence and apply each
// plan to every layer's storage. Thread-compatible.
//
//   MixedSequenceLayout seq(TierConfig{64, 256, 16});
//   AppendPlan plan = *seq.PlanAppend(5000, AppendKind::kFinalPrefill);
//   ... move plan.to_sink / to_history / to_recent input tokens, demote plan.demote ...
//   seq.Commit(plan, AppendKind::kFinalPrefill);
#pragma once

#include "absl/status/statusor.h"
#include "kernels/codec_config.h"

namespace kvpool {

struct TierConfig {
  int sink_tokens = 64;     // S0
  int recent_tokens = 256;  // W
  int demotion_batch = 16;  // B

  static TierConfig FromQuantConfig(const QuantConfig& q) {
    return TierConfig{q.sink_tokens, q.recent_tokens, q.demotion_batch};
  }
};

enum class AppendKind { kPrefill, kFinalPrefill, kDecode };

// How an append of `to_sink + to_history + to_recent` input tokens changes the layout. The
// input tokens are taken in order: the first `to_sink` go to the sink, the next `to_history`
// are quantized into the history, the last `to_recent` join the recent window. Before those
// join, the `demote` OLDEST recent tokens (already stored) move to the history, in order,
// appended after the existing history and BEFORE the input's history tokens. So after Commit:
// history = old history + demoted recent tokens + input history tokens, in token order. Only
// decode demotes; with W = 0 the decode token completing a batch is itself a history token
// (demote = B - 1, to_history = 1, to_recent = 0).
struct AppendPlan {
  int to_sink = 0;
  int to_history = 0;
  int to_recent = 0;
  int demote = 0;  // oldest recent tokens demoted to the history by this append
};

class MixedSequenceLayout {
 public:
  explicit MixedSequenceLayout(TierConfig cfg) : cfg_(cfg) {}

  int sink() const { return sink_; }
  int history() const { return history_; }
  int recent() const { return recent_; }
  int total() const { return sink_ + history_ + recent_; }
  bool prefill_done() const { return prefill_done_; }
  const TierConfig& config() const { return cfg_; }

  // What appending `tokens` tokens of `kind` would do; changes nothing.
  // InvalidArgument for tokens < 1 (or != 1 for decode); FailedPrecondition for a prefill after
  // the final prefill chunk, or a decode token before it. Also InvalidArgument for a TierConfig
  // with negative sizes or demotion_batch < 1, OutOfRange when the total would overflow int.
  absl::StatusOr<AppendPlan> PlanAppend(int tokens, AppendKind kind) const;
  // Applies a plan returned by PlanAppend on this same state with the same kind (debug builds
  // assert that it fits). kFinalPrefill marks the prefill done.
  void Commit(const AppendPlan& plan, AppendKind kind);

 private:
  TierConfig cfg_;
  int sink_ = 0;
  int history_ = 0;
  int recent_ = 0;
  bool prefill_done_ = false;
};

}  // namespace kvpool
