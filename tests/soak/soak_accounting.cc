#include "tests/soak/soak_accounting.h"

#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"

namespace kvpool::soak {
namespace {

// Pages in use per page size.
std::map<uint64_t, uint64_t> PagesByClass(const v1::PoolStats& p) {
  std::map<uint64_t, uint64_t> pages;
  for (const v1::PageClassStats& c : p.classes()) pages[c.page_bytes()] += c.pages_in_use();
  return pages;
}

std::vector<std::string> RunSequences(const v1::GetStatsResponse& s, absl::string_view prefix) {
  std::vector<std::string> ids;
  for (const v1::SequenceStats& q : s.sequences()) {
    if (absl::StartsWith(q.sequence_id(), prefix)) ids.push_back(q.sequence_id());
  }
  return ids;
}

class Mismatches {
 public:
  template <typename T>
  void Equal(absl::string_view what, T got, T want) {
    if (got != want) errors_.push_back(absl::StrCat(what, " is ", got, ", expected ", want));
  }
  void Within(absl::string_view what, uint64_t got, uint64_t lo, uint64_t hi) {
    if (got < lo || got > hi) {
      errors_.push_back(absl::StrCat(what, " is ", got, ", expected within [", lo, ", ", hi, "]"));
    }
  }
  void Add(std::string error) { errors_.push_back(std::move(error)); }
  absl::Status status() const {
    if (errors_.empty()) return absl::OkStatus();
    return absl::InternalError(
        absl::StrCat("accounting mismatch:\n  ", absl::StrJoin(errors_, "\n  ")));
  }

 private:
  std::vector<std::string> errors_;
};

}  // namespace

absl::Status CheckFinalAccounting(const client::KvpoolClient& client,
                                  const v1::GetStatsResponse& baseline,
                                  const std::vector<SoakModel>& shared_models,
                                  absl::string_view id_prefix, const ExpectedCounters& expected,
                                  absl::Duration settle, std::string* log) {
  // 1. No sequence of the run left, nothing queued.
  const absl::Time give_up = absl::Now() + settle;
  v1::GetStatsResponse now;
  while (true) {
    KVPOOL_ASSIGN_OR_RETURN(now, client.GetStats(/*include_sequences=*/true));
    if ((RunSequences(now, id_prefix).empty() && now.service().worker_queue_depth() == 0 &&
         now.transport().open_pushes() == baseline.transport().open_pushes()) ||
        absl::Now() >= give_up) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  Mismatches m;
  const std::vector<std::string> left = RunSequences(now, id_prefix);
  if (!left.empty()) {
    m.Add(absl::StrCat(left.size(),
                       " sequences of the run still stored: ", absl::StrJoin(left, ", ")));
  }
  m.Equal("worker queue depth", now.service().worker_queue_depth(), 0u);

  // 2. What the pool still holds for the run is cached prefix units of its shared models.
  const v1::PoolStats& base = baseline.pool();
  const v1::PoolStats& held = now.pool();
  for (const v1::ModelStats& ms : now.models()) {
    for (const SoakModel& sm : shared_models) {
      if (ms.model_id() != sm.id()) continue;
      m.Equal(absl::StrCat(sm.id(), " sequences"), ms.sequences(), uint64_t{0});
      m.Equal(absl::StrCat(sm.id(), " stored tokens"),
              ms.sink_tokens() + ms.history_tokens() + ms.recent_tokens(), uint64_t{0});
    }
  }
  m.Equal("pool bytes held beyond the baseline minus cached bytes beyond it",
          held.used_bytes() - base.used_bytes(), held.cached_bytes() - base.cached_bytes());
  m.Equal("shared bytes", held.shared_bytes(), base.shared_bytes());
  absl::StrAppend(log, "after the run: ", held.used_bytes() - base.used_bytes(),
                  " pool bytes beyond the baseline, all cached prefix units (",
                  held.prefix_units() - base.prefix_units(), " units; ",
                  held.evicted_units() - base.evicted_units(), " evicted during the run)\n");

  // 3. Deleting the shared models drops their cached units and frees exactly those bytes.
  uint64_t freed = 0;
  for (const SoakModel& sm : shared_models) {
    absl::StatusOr<v1::DeleteModelResponse> d = client.DeleteModel(sm.id(), /*force=*/false);
    if (!d.ok()) return d.status();
    m.Equal(absl::StrCat("sequences released by deleting ", sm.id()), d->released_sequences(),
            uint64_t{0});
    freed += d->freed_bytes();
  }
  m.Equal("bytes freed by deleting the shared models", freed,
          held.used_bytes() - base.used_bytes());

  // 4. Back to the baseline.
  KVPOOL_ASSIGN_OR_RETURN(const v1::GetStatsResponse after, client.GetStats(true));
  const v1::PoolStats& p = after.pool();
  m.Equal("pool used bytes", p.used_bytes(), base.used_bytes());
  m.Equal("pool cached bytes", p.cached_bytes(), base.cached_bytes());
  m.Equal("pool shared bytes", p.shared_bytes(), base.shared_bytes());
  m.Equal("prefix units", p.prefix_units(), base.prefix_units());
  m.Equal("slabs in use", p.slabs_in_use(), base.slabs_in_use());
  m.Equal("free + used bytes", p.free_bytes() + p.used_bytes(), p.capacity_bytes());
  uint64_t class_bytes = 0;
  for (const v1::PageClassStats& c : p.classes()) class_bytes += c.bytes_in_use();
  m.Equal("bytes in use over all page classes", class_bytes, p.used_bytes());
  std::map<uint64_t, uint64_t> pages = PagesByClass(p), base_pages = PagesByClass(base);
  for (const auto& [bytes, n] : pages) {
    m.Equal(absl::StrCat("pages in use of ", bytes, "-byte class"), n, base_pages[bytes]);
  }
  m.Equal("sequences stored", after.sequences_size(), baseline.sequences_size());
  m.Equal("models registered", after.models_size(), baseline.models_size());
  for (const v1::ModelStats& ms : after.models()) {
    if (absl::StartsWith(ms.model_id(), id_prefix)) {
      m.Add(absl::StrCat("model ", ms.model_id(), " of the run still registered"));
    }
  }
  const v1::TransportStats& t = after.transport();
  const v1::TransportStats& bt = baseline.transport();
  m.Equal("data-plane sessions", t.sessions(), bt.sessions());
  m.Equal("open pushes", t.open_pushes(), bt.open_pushes());
  m.Equal("staging bytes in use", t.staging_bytes_in_use(), bt.staging_bytes_in_use());
  m.Equal("pending data-plane messages", t.pending_messages(), bt.pending_messages());
  m.Equal("worker queue depth at the end", after.service().worker_queue_depth(), 0u);

  // 5. The daemon's counters against what the clients know they did.
  const v1::ServiceStats& s = after.service();
  const v1::ServiceStats& bs = baseline.service();
  const uint64_t tokens = s.ingested_tokens() - bs.ingested_tokens();
  m.Within("tokens ingested", tokens, expected.tokens_committed,
           expected.tokens_committed + expected.tokens_uncertain);
  m.Within("attention calls", s.attention_calls() - bs.attention_calls(), expected.attend_ok,
           expected.attend_sent);
  m.Within("sequences attended", s.attention_sequences() - bs.attention_sequences(),
           expected.attend_sequences_ok, expected.attend_sequences_sent);
  absl::StrAppend(log, "daemon counters: ", tokens, " tokens ingested (", expected.tokens_committed,
                  " committed, ", expected.tokens_uncertain, " cut by deadlines), ",
                  s.attention_calls() - bs.attention_calls(), " attention calls (",
                  expected.attend_ok, " OK of ", expected.attend_sent, " sent), ",
                  s.rejected_busy() - bs.rejected_busy(), " rejected busy\n");
  absl::StrAppend(log, "pool after deleting the shared models (", freed, " bytes freed): used ",
                  p.used_bytes(), ", cached ", p.cached_bytes(), ", shared ", p.shared_bytes(),
                  ", prefix units ", p.prefix_units(), ", slabs ", p.slabs_in_use(), " (baseline ",
                  base.used_bytes(), ", ", base.cached_bytes(), ", ", base.shared_bytes(), ", ",
                  base.prefix_units(), ", ", base.slabs_in_use(), ")\n");
  return m.status();
}

}  // namespace kvpool::soak
