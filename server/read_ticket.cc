#include "server/read_ticket.h"

#include <utility>

namespace kvpool::server {

absl::StatusOr<std::shared_ptr<ReadTicket>> ReadTicket::Open(
    Admission* admission, grpc::CallbackServerContext* call, const TenantId& tenant,
    const std::string& what, size_t bytes, const std::shared_ptr<CallCancellation>& cancel) {
  auto state = std::make_shared<State>();
  state->cancel = cancel;
  if (admission != nullptr) {
    std::weak_ptr<State> weak = state;
    absl::StatusOr<std::unique_ptr<Admission::Ticket>> ticket = admission->Open(
        tenant, call->peer(), what,
        [weak](absl::Status why) {
          if (std::shared_ptr<State> s = weak.lock()) OnExpire(s, std::move(why));
        },
        TicketKind::kRead);
    if (!ticket.ok()) return ticket.status();
    if (absl::Status reserved = (*ticket)->Reserve(bytes); !reserved.ok()) return reserved;
    absl::MutexLock lock(&state->mu);
    state->ticket = *std::move(ticket);
    state->call = call;
  }
  std::weak_ptr<State> weak = state;
  cancel->SetProgress([weak] {
    std::shared_ptr<State> s = weak.lock();
    if (s == nullptr) return;
    absl::MutexLock lock(&s->mu);
    if (s->ticket != nullptr) s->ticket->Touch();
  });
  return std::shared_ptr<ReadTicket>(new ReadTicket(std::move(state)));
}

ReadTicket::~ReadTicket() { Close(); }

void ReadTicket::OnExpire(const std::shared_ptr<State>& s, absl::Status why) {
  s->cancel->Expire(std::move(why));
  grpc::CallbackServerContext* call = nullptr;
  {
    absl::MutexLock lock(&s->mu);
    if (s->call == nullptr) return;
    s->expired = true;
    // A write the caller is not taking would never end by itself: cancel the call. Otherwise
    // the call's next check answers the expiry's status.
    if (!s->writing) return;
    call = s->call;
    ++s->cancelling;
  }
  call->TryCancel();
  absl::MutexLock lock(&s->mu);
  --s->cancelling;
}

bool ReadTicket::BeginWrite() {
  absl::MutexLock lock(&state_->mu);
  if (state_->expired) return false;
  state_->writing = true;
  return true;
}

void ReadTicket::EndWrite() {
  absl::MutexLock lock(&state_->mu);
  state_->writing = false;
  if (state_->ticket != nullptr) state_->ticket->Touch();
}

void ReadTicket::Close() {
  std::unique_ptr<Admission::Ticket> ticket;
  {
    absl::MutexLock lock(&state_->mu);
    state_->call = nullptr;
    // An expiry inside TryCancel still uses the call: the call may go away only after it.
    auto idle = [this]()
                    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) { return state_->cancelling == 0; };
    state_->mu.Await(absl::Condition(&idle));
    ticket = std::move(state_->ticket);
  }
  // Released outside the lock (the admission's own lock is taken).
}

}  // namespace kvpool::server
