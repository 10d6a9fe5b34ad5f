// ReadTicket: the admission ticket (server/admission/, TicketKind::kRead) of one call that reads
// out of the pool (ReadKv, ReadBlocks, Attend), and what its expiry does to the call. The call is
// admitted before any work, holding the bytes of its largest response message (an Attend: its
// decoded queries and its answer) against the caps per connection and per tenant; over a cap it
// is refused with RESOURCE_EXHAUSTED, reason LIMIT. It shares the streams' idle and total
// timeouts: each message the caller takes (EndWrite) and each unit of work done (the call's
// CallCancellation checks) is progress. On expiry the call's CallCancellation answers the
// expiry's status (DEADLINE_EXCEEDED, reason LIMIT) from its next check on, and a write the
// caller is not taking is cancelled, so a frozen reader lets go of its snapshot's pages and its
// message buffer.
//
//   auto cancel = CancellationOf(call, &counters);
//   KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<ReadTicket> t,
//       ReadTicket::Open(admission, call, tenant, "ReadKv", message_bytes, cancel));
//   if (!t->BeginWrite()) return Finish(cancel->status());   // expired: nothing written
//   StartWrite(&message);  ...  OnWriteDone: t->EndWrite();
//   OnDone: t->Close();
//
// Thread-safe.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "server/admission/admission.h"
#include "server/call_cancellation.h"
#include "server/tenant.h"

namespace kvpool::server {

class ReadTicket {
 public:
  // Admits `call` of `tenant` on the caller's connection for `what` (named in errors), holding
  // `bytes`. Without an admission nothing is capped or expires. RESOURCE_EXHAUSTED, reason LIMIT,
  // over a cap (then nothing is held). Sets `cancel`'s progress: call before sharing it.
  [[nodiscard]] static absl::StatusOr<std::shared_ptr<ReadTicket>> Open(
      Admission* admission, grpc::CallbackServerContext* call, const TenantId& tenant,
      const std::string& what, size_t bytes, const std::shared_ptr<CallCancellation>& cancel);

  ~ReadTicket();  // Close()
  ReadTicket(const ReadTicket&) = delete;
  ReadTicket& operator=(const ReadTicket&) = delete;

  // Before a write: false once the call expired (write nothing; answer cancel->status()).
  [[nodiscard]] bool BeginWrite();
  // The caller took the message: progress.
  void EndWrite();
  // The call is done: its expiry no longer reaches it and its ticket is released. Call it before
  // the call's context goes away (OnDone, or before Finish of a unary call). Idempotent.
  void Close();

 private:
  // What the expiry reaches the call through (it may fire from the admission's reaper thread
  // while the call ends).
  struct State {
    absl::Mutex mu;
    grpc::CallbackServerContext* call ABSL_GUARDED_BY(mu) = nullptr;  // null once closed
    std::shared_ptr<CallCancellation> cancel;
    std::unique_ptr<Admission::Ticket> ticket ABSL_GUARDED_BY(mu);
    bool writing ABSL_GUARDED_BY(mu) = false;
    bool expired ABSL_GUARDED_BY(mu) = false;
    int cancelling ABSL_GUARDED_BY(mu) = 0;  // expiries inside TryCancel now
  };
  explicit ReadTicket(std::shared_ptr<State> state) : state_(std::move(state)) {}
  static void OnExpire(const std::shared_ptr<State>& state, absl::Status why);

  const std::shared_ptr<State> state_;
};

}  // namespace kvpool::server
