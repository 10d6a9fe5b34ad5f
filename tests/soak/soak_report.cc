#include "tests/soak/soak_report.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvpool::soak {

void ExpectedCounters::Merge(const ExpectedCounters& o) {
  tokens_committed += o.tokens_committed;
  tokens_uncertain += o.tokens_uncertain;
  attend_ok += o.attend_ok;
  attend_sent += o.attend_sent;
  attend_sequences_ok += o.attend_sequences_ok;
  attend_sequences_sent += o.attend_sequences_sent;
}

void SoakReport::Record(absl::string_view op, const absl::Status& status) {
  auto it = ops_.find(op);
  if (it == ops_.end()) it = ops_.emplace(std::string(op), Counts{}).first;
  Counts& c = it->second;
  ++c.calls;
  if (status.ok()) {
    ++c.ok;
  } else {
    ++c.errors[status.code()];
  }
}

void SoakReport::Merge(const SoakReport& other) {
  for (const auto& [op, theirs] : other.ops_) {
    Counts& mine = ops_[op];
    mine.calls += theirs.calls;
    mine.ok += theirs.ok;
    for (const auto& [code, n] : theirs.errors) mine.errors[code] += n;
  }
  counters.Merge(other.counters);
}

uint64_t SoakReport::calls() const {
  uint64_t n = 0;
  for (const auto& [op, c] : ops_) n += c.calls;
  return n;
}

uint64_t SoakReport::calls(absl::string_view op) const {
  auto it = ops_.find(op);
  return it == ops_.end() ? 0 : it->second.calls;
}

std::string SoakReport::Table(absl::Duration elapsed) const {
  const double seconds = absl::ToDoubleSeconds(elapsed);
  std::string out = absl::StrFormat("%-34s %9s %9s  %s\n", "rpc", "calls", "ok", "errors");
  std::map<absl::StatusCode, uint64_t> by_code;
  for (const auto& [op, c] : ops_) {
    std::string errors;
    for (const auto& [code, n] : c.errors) {
      absl::StrAppend(&errors, errors.empty() ? "" : " ", absl::StatusCodeToString(code), "=", n);
      by_code[code] += n;
    }
    absl::StrAppend(&out, absl::StrFormat("%-34s %9d %9d  %s\n", op, c.calls, c.ok, errors));
  }
  absl::StrAppend(&out, "errors by code:");
  if (by_code.empty()) absl::StrAppend(&out, " none");
  for (const auto& [code, n] : by_code) {
    absl::StrAppend(&out, " ", absl::StatusCodeToString(code), "=", n);
  }
  absl::StrAppend(&out, absl::StrFormat("\n%d calls in %.1f s: %.0f calls/s\n", calls(), seconds,
                                        seconds > 0 ? calls() / seconds : 0.0));
  return out;
}

}  // namespace kvpool::soak
