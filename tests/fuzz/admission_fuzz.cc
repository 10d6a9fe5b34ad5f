// Fuzz target: the admission module (server/admission/admission.h) under random interleavings.
// Three threads run scripts of Open / Reserve / Unreserve / Touch / drop / pause on tickets (of
// both kinds: ingest streams and reads) of three tenants over four connections, with caps and
// timeouts small enough that refusals and expiries (whose callbacks sometimes drop the ticket
// themselves, on the reaper thread) race with the owners.
//
// Input: one byte picks the limits, then the threads' scripts interleaved byte by byte (op,
// argument). Checked on every input: a ticket's reserved bytes are what its owner reserved and
// gave back; no tenant or connection ever holds more streams or bytes than its cap; every
// refusal is RESOURCE_EXHAUSTED with reason LIMIT and every expiry DEADLINE_EXCEEDED with
// reason LIMIT; each ticket expires at most once; and at the end, with every ticket dropped,
// nothing is open or reserved and the counters equal what the threads saw.
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/status.h"
#include "server/admission/admission.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/fuzz_input.h"

namespace kvpool::server {
namespace {

constexpr int kThreads = 3;
constexpr int kSlots = 4;  // tickets a thread holds at once
constexpr int kOpsPerThread = 64;
constexpr int kTenants = 3;
constexpr int kConnections = 4;

// One ticket and what its owner knows of it. The reaper may drop the ticket (an expiry callback
// that owns it), so both sides take `mu`.
struct Slot {
  absl::Mutex mu;
  std::unique_ptr<Admission::Ticket> ticket ABSL_GUARDED_BY(mu);
  size_t reserved ABSL_GUARDED_BY(mu) = 0;  // what the owner reserved minus what it gave back
  int tenant ABSL_GUARDED_BY(mu) = 0;
};

struct Observed {
  std::atomic<uint64_t> refused{0};
  std::atomic<uint64_t> expired{0};
};

void CheckLimit(const absl::Status& s, absl::StatusCode code) {
  FUZZ_CHECK(s.code() == code, s.ToString());
  FUZZ_CHECK(ReasonOf(s) == ErrorReason::kLimit, s.ToString());
}

void CheckCaps(const Admission& a) {
  const AdmissionLimits& l = a.limits();
  for (int t = 0; t < kTenants; ++t) {
    const AdmissionCounters c = a.TenantCounters(absl::StrCat("t", t));
    if (l.max_streams_per_tenant > 0) {
      FUZZ_CHECK(c.open_streams <= static_cast<uint64_t>(l.max_streams_per_tenant),
                 absl::StrCat("tenant ", t, " holds ", c.open_streams, " streams"));
    }
    if (l.max_reserved_bytes_per_tenant > 0) {
      FUZZ_CHECK(c.reserved_bytes <= l.max_reserved_bytes_per_tenant,
                 absl::StrCat("tenant ", t, " holds ", c.reserved_bytes, " bytes"));
    }
    if (l.max_reads_per_tenant > 0) {
      FUZZ_CHECK(c.open_reads <= static_cast<uint64_t>(l.max_reads_per_tenant),
                 absl::StrCat("tenant ", t, " holds ", c.open_reads, " reads"));
    }
    if (l.max_read_bytes_per_tenant > 0) {
      FUZZ_CHECK(c.read_bytes <= l.max_read_bytes_per_tenant,
                 absl::StrCat("tenant ", t, " holds ", c.read_bytes, " read bytes"));
    }
  }
}

void RunScript(Admission* admission, const std::vector<uint8_t>& script, Observed* seen,
               std::vector<std::shared_ptr<Slot>>* slots) {
  for (size_t i = 0; i + 1 < script.size(); i += 2) {
    const uint8_t op = script[i] % 6, arg = script[i + 1];
    const std::shared_ptr<Slot>& slot = (*slots)[arg % kSlots];
    absl::MutexLock lock(&slot->mu);
    switch (op) {
      case 0: {  // open (dropping what the slot held)
        slot->ticket.reset();
        slot->reserved = 0;
        slot->tenant = (arg / kSlots) % kTenants;
        const std::string connection = absl::StrCat("c", (arg / 16) % kConnections);
        auto expired_once = std::make_shared<std::atomic<bool>>(false);
        std::weak_ptr<Slot> weak = slot;
        const bool drop_on_expiry = arg & 0x80;
        const TicketKind kind = (arg & 0x40) ? TicketKind::kRead : TicketKind::kIngest;
        absl::StatusOr<std::unique_ptr<Admission::Ticket>> t = admission->Open(
            absl::StrCat("t", slot->tenant), connection, "fuzz",
            [weak, expired_once, drop_on_expiry, seen](absl::Status why) {
              FUZZ_CHECK(!expired_once->exchange(true), "a ticket expired twice");
              CheckLimit(why, absl::StatusCode::kDeadlineExceeded);
              seen->expired.fetch_add(1);
              std::shared_ptr<Slot> s = weak.lock();
              if (s == nullptr || !drop_on_expiry) return;
              // The owner may have replaced the ticket meanwhile: drop only an
              // expired one.
              absl::MutexLock l(&s->mu);
              if (s->ticket != nullptr && s->ticket->expired()) {
                s->ticket.reset();
                s->reserved = 0;
              }
            },
            kind);
        if (t.ok()) {
          slot->ticket = *std::move(t);
        } else {
          CheckLimit(t.status(), absl::StatusCode::kResourceExhausted);
          seen->refused.fetch_add(1);
        }
        break;
      }
      case 1: {  // reserve
        if (slot->ticket == nullptr) break;
        const size_t bytes = size_t{arg} * 16;
        const absl::Status s = slot->ticket->Reserve(bytes);
        if (s.ok()) {
          slot->reserved += bytes;
        } else {
          CheckLimit(s, absl::StatusCode::kResourceExhausted);
          seen->refused.fetch_add(1);
        }
        break;
      }
      case 2: {  // give back
        if (slot->ticket == nullptr) break;
        const size_t bytes = std::min(size_t{arg} * 8, slot->reserved);
        slot->ticket->Unreserve(bytes);
        slot->reserved -= bytes;
        break;
      }
      case 3:
        if (slot->ticket != nullptr) slot->ticket->Touch();
        break;
      case 4:
        slot->ticket.reset();
        slot->reserved = 0;
        break;
      case 5:  // let the reaper run
        std::this_thread::sleep_for(std::chrono::microseconds(arg * 8));
        break;
    }
    if (slot->ticket != nullptr) {
      FUZZ_CHECK(slot->ticket->reserved() == slot->reserved,
                 absl::StrCat("ticket holds ", slot->ticket->reserved(), " bytes, owner counted ",
                              slot->reserved));
    }
    CheckCaps(*admission);
  }
}

}  // namespace
}  // namespace kvpool::server

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvpool::server;
  kvpool::fuzz::FuzzInput in(data, size);
  const uint8_t config = in.Byte();
  AdmissionLimits limits;
  limits.max_streams_per_connection = config & 0x3;     // 0 (no cap) to 3
  limits.max_streams_per_tenant = (config >> 2) & 0x3;  // 0 (no cap) to 3
  limits.max_reserved_bytes_per_connection = ((config >> 4) & 0x3) * 2048;
  limits.max_reserved_bytes_per_tenant = ((config >> 6) & 0x1) * 3072;
  // Reads get caps of their own, as small.
  limits.max_reads_per_connection = limits.max_streams_per_connection;
  limits.max_reads_per_tenant = limits.max_streams_per_tenant;
  limits.max_read_bytes_per_connection = limits.max_reserved_bytes_per_connection;
  limits.max_read_bytes_per_tenant = limits.max_reserved_bytes_per_tenant;
  limits.idle_timeout = absl::Milliseconds(1 + ((config >> 7) & 0x1) * 2);
  limits.total_timeout = absl::Milliseconds(6);
  limits.reap_period = absl::Microseconds(500);

  // Thread i's script: bytes i, i + kThreads, ... of the rest, at most kOpsPerThread ops.
  const absl::string_view rest = in.Rest();
  std::vector<std::vector<uint8_t>> scripts(kThreads);
  for (size_t i = 0; i < rest.size(); ++i) {
    std::vector<uint8_t>& s = scripts[i % kThreads];
    if (s.size() < 2 * kOpsPerThread) s.push_back(static_cast<uint8_t>(rest[i]));
  }
  Observed seen;
  uint64_t expired = 0;
  {
    Admission admission(limits);
    std::vector<std::vector<std::shared_ptr<Slot>>> slots(kThreads);
    for (auto& s : slots) {
      for (int i = 0; i < kSlots; ++i) s.push_back(std::make_shared<Slot>());
    }
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back(RunScript, &admission, std::cref(scripts[t]), &seen, &slots[t]);
    }
    for (std::thread& t : threads) t.join();
    for (auto& per_thread : slots) {
      for (auto& s : per_thread) {
        absl::MutexLock lock(&s->mu);
        s->ticket.reset();
      }
    }
    const AdmissionCounters c = admission.Counters();
    FUZZ_CHECK(
        c.open_streams == 0 && c.reserved_bytes == 0 && c.open_reads == 0 && c.read_bytes == 0,
        absl::StrCat(c.open_streams, " streams, ", c.reserved_bytes, " bytes, ", c.open_reads,
                     " reads and ", c.read_bytes, " read bytes left with every ticket dropped"));
    FUZZ_CHECK(c.refused == seen.refused.load(),
               absl::StrCat("refused ", c.refused, ", threads saw ", seen.refused.load()));
    // With no ticket left nothing more expires; a callback of an expiry counted just before may
    // still be running: the admission's destructor joins the reaper, so compare after it.
    expired = c.expired_idle + c.expired_total;
  }
  FUZZ_CHECK(expired == seen.expired.load(),
             absl::StrCat("expired ", expired, ", callbacks ", seen.expired.load()));
  return 0;
}
