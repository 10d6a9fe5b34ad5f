// What a soak run did: RPCs per kind with their status codes, and the totals the daemon's own
// counters must agree with at the end.
//
//   SoakReport report;                      // one per client thread, merged at the end
//   report.Record("AppendDecode", status);
//   total.Merge(report);
//   std::cout << total.Table(elapsed);
//
// Not thread-safe: each thread records into its own report.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace kvpool::soak {

// Work whose effect the daemon's GetStats counters show. Appends and attention calls that ended
// without a definite answer (a deadline passed, a stream cancelled after its last message) may
// or may not have been counted by the daemon: they are the slack between the bounds.
struct ExpectedCounters {
  uint64_t tokens_committed = 0;  // tokens of appends that answered OK
  uint64_t tokens_uncertain = 0;  // tokens of appends without a definite answer
  uint64_t attend_ok = 0;         // Attend calls that answered OK ...
  uint64_t attend_sent = 0;       // ... and every Attend call sent (any answer)
  uint64_t attend_sequences_ok = 0;
  uint64_t attend_sequences_sent = 0;

  void Merge(const ExpectedCounters& o);
};

class SoakReport {
 public:
  // One RPC of kind `op` (hostile requests are named "bad:...") answered `status`.
  void Record(absl::string_view op, const absl::Status& status);
  void Merge(const SoakReport& other);

  uint64_t calls() const;
  uint64_t calls(absl::string_view op) const;
  // The summary: per kind calls, OK and error codes; then errors by code; then the rate.
  std::string Table(absl::Duration elapsed) const;

  ExpectedCounters counters;

 private:
  struct Counts {
    uint64_t calls = 0;
    uint64_t ok = 0;
    std::map<absl::StatusCode, uint64_t> errors;
  };
  std::map<std::string, Counts, std::less<>> ops_;
};

}  // namespace kvpool::soak
