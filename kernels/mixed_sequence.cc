#include "kernels/mixed_sequence.h"

#include <algorithm>
#include <cassert>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvpool {
namespace {

absl::Status CheckConfig(const TierConfig& cfg) {
  if (cfg.sink_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("TierConfig.sink_tokens must be >= 0, got ", cfg.sink_tokens));
  }
  if (cfg.recent_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("TierConfig.recent_tokens must be >= 0, got ", cfg.recent_tokens));
  }
  if (cfg.demotion_batch < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("TierConfig.demotion_batch must be >= 1, got ", cfg.demotion_batch));
  }
  // W + B must be representable: decode compares recent + 1 against it.
  if (cfg.recent_tokens > std::numeric_limits<int>::max() - cfg.demotion_batch) {
    return absl::InvalidArgumentError("TierConfig.recent_tokens + demotion_batch overflows int");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<AppendPlan> MixedSequenceLayout::PlanAppend(int tokens, AppendKind kind) const {
  if (absl::Status s = CheckConfig(cfg_); !s.ok()) return s;
  if (tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("append needs at least 1 token, got ", tokens));
  }
  if (kind == AppendKind::kDecode && tokens != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("a decode step appends exactly 1 token, got ", tokens));
  }
  if (tokens > std::numeric_limits<int>::max() - total()) {
    return absl::OutOfRangeError(absl::StrCat("appending ", tokens, " tokens to a sequence of ",
                                              total(), " overflows the token count"));
  }

  AppendPlan plan;
  switch (kind) {
    case AppendKind::kPrefill:
    case AppendKind::kFinalPrefill: {
      if (prefill_done_) {
        return absl::FailedPreconditionError(
            "prefill chunk after the final prefill chunk (the sequence is decoding)");
      }
      // Before the final chunk the recent window is always empty, so nothing is demoted.
      plan.to_sink = std::min(tokens, std::max(0, cfg_.sink_tokens - sink_));
      const int rest = tokens - plan.to_sink;
      plan.to_recent = kind == AppendKind::kFinalPrefill ? std::min(rest, cfg_.recent_tokens) : 0;
      plan.to_history = rest - plan.to_recent;
      break;
    }
    case AppendKind::kDecode: {
      if (!prefill_done_) {
        return absl::FailedPreconditionError("decode token before the final prefill chunk");
      }
      plan.to_recent = 1;
      if (recent_ + 1 >= cfg_.recent_tokens + cfg_.demotion_batch) {
        // Demote B tokens, oldest first. With W >= 1 all of them are stored recent tokens; with
        // W == 0 the new token itself is the last of the batch and goes straight to history
        // (the plan orders demoted tokens before the input's history tokens).
        plan.demote = std::min(cfg_.demotion_batch, recent_);
        plan.to_history = cfg_.demotion_batch - plan.demote;
        plan.to_recent = 1 - plan.to_history;
      }
      break;
    }
    default:
      return absl::InvalidArgumentError("unknown AppendKind");
  }
  return plan;
}

void MixedSequenceLayout::Commit(const AppendPlan& plan, AppendKind kind) {
  // The plan comes from PlanAppend on this state; these only guard against misuse in debug.
  assert(plan.to_sink >= 0 && plan.to_history >= 0 && plan.to_recent >= 0 && plan.demote >= 0);
  assert(plan.demote <= recent_);
  assert(sink_ + plan.to_sink <= cfg_.sink_tokens);
  sink_ += plan.to_sink;
  history_ += plan.demote + plan.to_history;
  recent_ += plan.to_recent - plan.demote;
  if (kind == AppendKind::kFinalPrefill) prefill_done_ = true;
}

}  // namespace kvpool
