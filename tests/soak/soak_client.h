// One soak client: a thread with its own connection to kvpoold that runs a random mix of honest
// and hostile requests until the run stops, checks every answer, and then releases all it holds.
//
// Honest requests (register/delete models, create sequences from shared prefixes, AppendKv whole
// or as interleaved layer-wise chunks, AppendDecode, ReadKv, ReadBlocks, Attend, LookupPrefix,
// Describe, Seal, Release) must succeed (RESOURCE_EXHAUSTED, the documented "retry later", is
// tolerated and counted) and return exactly what was pushed: bit for bit on the identity + BF16
// bypass model, attention within float rounding of a CPU reference on every model. Hostile ones
// (wrong shapes, NaN/Inf, unknown ids, oversize payloads, wrong states, tiny deadlines, streams
// abandoned midway) must get their documented status and leave the sequence as it was.
//
//   SoakRun run(target, options, limits, shared_models);
//   SoakClient client(/*index=*/0, &run);
//   std::thread t([&] { client.Run(); });
//   ...; t.join();
//   if (run.failed()) std::cerr << run.failure();
//
// Thread-safety: SoakRun is shared by every client (thread-safe); a SoakClient is run by one
// thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/kvpool_client.h"
#include "tests/soak/soak_data.h"
#include "tests/soak/soak_report.h"

namespace kvpool::soak {

namespace v1 = ::kvpool::v1;

// A model the clients push to, as the daemon registered it.
struct SoakModel {
  v1::ModelSpec spec;
  v1::ModelInfo info;
  SoakShape shape;
  // Identity rotation and the BF16 bypass quantizer: every read returns the appended bytes.
  bool exact = false;

  const std::string& id() const { return info.model_id(); }
};

// A data-free model spec for the soak: small tiers (sink 16, recent 32, blocks of 16 tokens) so
// that short sequences use every tier and demote often.
v1::ModelSpec SoakModelSpec(const std::string& id, const SoakShape& shape, bool exact,
                            v1::RotationKind kind, uint64_t seed, int bits);
// The model `spec` describes, registered through `client`.
absl::StatusOr<SoakModel> RegisterSoakModel(const client::KvpoolClient& client,
                                            const v1::ModelSpec& spec, bool exact);

struct SoakOptions {
  int clients = 16;
  absl::Duration duration = absl::Seconds(30);
  uint64_t seed = 1;
  // Live sequences per client, and the longest sequence it grows.
  int max_live_sequences = 6;
  int max_tokens = 640;
  // Every model and sequence id of the run starts with this (several runs may share a daemon).
  std::string id_prefix = "soak";
  // Deadline of honest calls (generous: sanitizer builds on loaded machines are slow).
  absl::Duration deadline = absl::Seconds(300);
};

// What the clients share: options, limits, the shared models, the stop flag and the failure.
class SoakRun {
 public:
  SoakRun(std::string target, SoakOptions options, v1::ServerLimits limits,
          std::vector<SoakModel> shared_models);

  const std::string& target() const { return target_; }
  const SoakOptions& options() const { return options_; }
  const v1::ServerLimits& limits() const { return limits_; }
  const std::vector<SoakModel>& shared_models() const { return shared_models_; }
  absl::Time deadline() const { return deadline_; }

  // Records the first failure and stops every client.
  void Fail(const std::string& message);
  bool failed() const;
  std::string failure() const;
  // Whether clients should stop starting operations (time is up, or a failure).
  bool stopping() const { return stop_.load() || absl::Now() >= deadline_; }

 private:
  const std::string target_;
  const SoakOptions options_;
  const v1::ServerLimits limits_;
  const std::vector<SoakModel> shared_models_;
  const absl::Time deadline_;
  std::atomic<bool> stop_{false};
  mutable absl::Mutex mu_;
  std::string failure_ ABSL_GUARDED_BY(mu_);
};

class SoakClient {
 public:
  SoakClient(int index, SoakRun* run);
  ~SoakClient();
  SoakClient(const SoakClient&) = delete;
  SoakClient& operator=(const SoakClient&) = delete;

  // Runs operations until the run stops, then releases every sequence and model it holds. A
  // failed check or an unexpected status is reported to the run (SoakRun::Fail).
  void Run();
  const SoakReport& report() const { return report_; }

 private:
  enum class State { kPrefill, kDecode, kSealed };
  struct LiveSequence {
    std::string id;
    const SoakModel* model = nullptr;
    std::vector<uint32_t> token_ids;  // of every stored token, position order
    State state = State::kPrefill;
    uint32_t reused = 0;
    bool all_ids = true;  // every stored token came with its token id
    uint32_t length() const { return static_cast<uint32_t>(token_ids.size()); }
  };

  absl::Status Connect();
  absl::Status Step();
  absl::Status ReleaseEverything();

  // --- honest operations ---
  absl::Status CreateSequence();
  absl::Status ContinuePrefill(LiveSequence& s);
  absl::Status AppendDecode(LiveSequence& s);
  absl::Status ReadKvAndCheck(LiveSequence& s);
  absl::Status ReadBlocksAndCheck(LiveSequence& s);
  absl::Status AttendAndCheck();
  // One Attend over `batch` (sequences of `model` with at least one token), checked against a
  // CPU reference.
  absl::Status AttendSequences(const SoakModel& model, const std::vector<LiveSequence*>& batch);
  absl::Status LookupPrefix();
  absl::Status DescribeAndCheck(const LiveSequence& s);
  absl::Status Seal(LiveSequence& s);
  absl::Status Release(size_t index);
  absl::Status ModelLifecycle();
  absl::Status StatsConsistency();
  // ListModels shows the shared models; DescribeModel streams their rotations (the identity's
  // exactly).
  absl::Status DescribeModels();

  // --- hostile requests ---
  absl::Status Hostile();
  absl::Status HostileAppend(LiveSequence& s, int kind);
  absl::Status HostileUnknownIds();
  absl::Status HostileLimits();
  absl::Status HostileRegister();
  absl::Status HostileRead(LiveSequence& s);
  absl::Status HostileAttend();
  absl::Status TinyDeadline();
  absl::Status AbandonStream(LiveSequence& s);
  // Opens an append to `s` (prefill) and, midway, releases `s` (the append must fail with
  // NOT_FOUND) or seals it (the seal or the append is refused, whichever came second).
  absl::Status InterruptAppend(LiveSequence& s, bool release);
  // Waits until no append holds `s` (an abandoned one may still be rolling back): a header with
  // a wrong token_start is refused with ABORTED while one does, FAILED_PRECONDITION after.
  absl::Status WaitAppendIdle(const LiveSequence& s);
  // Sends `messages` on a raw AppendKv stream (stops at the first failed write), then
  // half-closes (or cancels); returns the call's status.
  absl::Status SendAppend(const std::vector<v1::AppendKvRequest>& messages, bool half_close);

  // Appends `ids` at the end of `s` (AppendKv, whole or as interleaved layer-wise chunks), with
  // end_of_prefill as given, retrying ABORTED (a cancelled append still rolling back). Sets
  // *done when the daemon committed it (false after a tolerated RESOURCE_EXHAUSTED).
  absl::Status AppendPrefill(LiveSequence& s, const std::vector<uint32_t>& ids, bool end_of_prefill,
                             bool* done);
  absl::Status CheckAppended(const LiveSequence& s, const v1::SequenceInfo& info, uint32_t added,
                             absl::string_view what);
  // The float K and V of every token of `layer` the daemon serves for `s`: the pushed rows on an
  // exact model, the dequantized ones (ReadKv FP32) otherwise.
  absl::Status ReferenceRows(const LiveSequence& s, int layer, std::vector<float>* k,
                             std::vector<float>* v);
  // Waits until the daemon has rolled back an abandoned append of `s` (Describe shows the length
  // unchanged right away; the append lock may be held a moment longer).
  absl::Status CheckUnchanged(const LiveSequence& s, absl::string_view what);

  // Records `status` as an answer of `op` and returns OK when its code is one of `allowed`;
  // otherwise Internal naming the op, `what`, the code and the message.
  absl::Status Expect(absl::string_view op, const absl::Status& status,
                      absl::Span<const absl::StatusCode> allowed, absl::string_view what);
  // Expect for an honest call: OK, or RESOURCE_EXHAUSTED (the daemon is busy or full: allowed,
  // the caller skips the rest of the operation).
  absl::Status ExpectHonest(absl::string_view op, const absl::Status& status,
                            absl::string_view what) {
    return Expect(op, status, {absl::StatusCode::kOk, absl::StatusCode::kResourceExhausted}, what);
  }

  // Calls `call` until it answers something other than ABORTED (an append cancelled just before
  // may still hold the sequence), for at most kAbortedRetry; records the ABORTED answers.
  absl::Status RetryAborted(absl::string_view op, const std::function<absl::Status()>& call);

  std::unique_ptr<grpc::ClientContext> ContextWithDeadline(absl::Duration timeout) const;
  std::string NewId(absl::string_view kind);
  std::vector<uint32_t> RandomIds(int n);
  int Uniform(int lo, int hi);  // [lo, hi]
  bool Chance(double p);
  LiveSequence* PickSequence(State state);
  LiveSequence* PickAnySequence();

  const int index_;
  SoakRun* const run_;
  std::mt19937_64 rng_;
  std::unique_ptr<client::KvpoolClient> client_;
  std::vector<LiveSequence> live_;
  // An empty sequence of the first shared model that hostile requests target; it must stay
  // empty.
  LiveSequence probe_;
  uint64_t next_id_ = 0;
  SoakReport report_;
};

}  // namespace kvpool::soak
