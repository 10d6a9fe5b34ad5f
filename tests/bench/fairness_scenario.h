// The fairness benchmarks' scenario (make bench-tenant-fairness): one model shape, a small
// tenant's short Attend calls against a large tenant's flood of long ones. The in-process run
// (tenant_fairness_bench.cc) and the run through kvpoold (tenant_fairness_daemon_bench.cc) use
// the same sizes, so their rows compare.
#pragma once

#include <map>
#include <string>

#include "absl/strings/str_cat.h"

namespace kvpool::bench {

inline constexpr int kFairnessQHeads = 32, kFairnessKvHeads = 8, kFairnessHeadDim = 128;
inline constexpr int kFairnessWorkers = 2;

struct FairnessSizes {
  int big_sequences = 16;  // per large Attend call
  int big_tokens = 8192;   // per large sequence
  int big_clients = 3;     // large calls kept in flight
  int small_tokens = 512;
  int small_calls = 200;  // alone and with fair queueing
  int fifo_calls = 100;   // with FIFO, where each call waits for the whole flood

  static FairnessSizes Of(bool quick) {
    FairnessSizes s;
    if (quick) {
      s.big_sequences = 8;
      s.big_tokens = 4096;
      s.small_calls = 40;
      s.fifo_calls = 20;
    }
    return s;
  }

  // The parameters every row of the benchmarks carries.
  std::map<std::string, std::string> Params() const {
    return {
        {"workers", absl::StrCat(kFairnessWorkers)},
        {"Hq/Hkv/D", absl::StrCat(kFairnessQHeads, "/", kFairnessKvHeads, "/", kFairnessHeadDim)},
        {"small_tokens", absl::StrCat(small_tokens)},
        {"big_call", absl::StrCat(big_sequences, "x", big_tokens, " tokens")},
        {"big_clients", absl::StrCat(big_clients)},
        {"small_calls", absl::StrCat(small_calls, "/", fifo_calls, " (fifo)")}};
  }
};

}  // namespace kvpool::bench
