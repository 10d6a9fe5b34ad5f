#include "server/events/kv_event_service.h"

#include <deque>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/status.h"

namespace kvpool::server {
namespace {

namespace v1 = ::kvpool::v1;

void ToProto(const KvEventRecord& r, v1::KvEvent* out) {
  out->set_sequence_number(r.sequence_number);
  out->set_tenant(r.tenant);
  switch (r.kind) {
    case KvEventRecord::Kind::kAllCleared:
      out->mutable_all_cleared();
      break;
    case KvEventRecord::Kind::kReplayComplete:
      out->mutable_replay_complete()->set_units(r.replayed_units);
      break;
    case KvEventRecord::Kind::kStored: {
      v1::KvBlockStored* s = out->mutable_block_stored();
      s->set_unit_hash(PrefixHashHex(r.hash));
      if (r.has_parent) s->set_parent_hash(PrefixHashHex(r.parent));
      s->set_model_id(r.model_id);
      s->set_token_start(static_cast<uint32_t>(r.key.token_start));
      s->set_token_count(static_cast<uint32_t>(r.key.token_count));
      s->set_sink(r.key.kind == PrefixUnitKind::kSink);
      break;
    }
    case KvEventRecord::Kind::kRemoved: {
      v1::KvBlockRemoved* s = out->mutable_block_removed();
      s->set_unit_hash(PrefixHashHex(r.hash));
      s->set_model_id(r.model_id);
      switch (r.removal) {
        case PrefixRemoval::kEvicted:
          s->set_reason(v1::KvBlockRemoved::EVICTED);
          break;
        case PrefixRemoval::kModelDropped:
          s->set_reason(v1::KvBlockRemoved::MODEL_DELETED);
          break;
        case PrefixRemoval::kCorrupt:
          s->set_reason(v1::KvBlockRemoved::CORRUPT);
          break;
      }
      break;
    }
  }
}

// One subscriber's stream: events queue here and are written one at a time. The stream ends
// when the client cancels, or with RESOURCE_EXHAUSTED when the hub drops it.
class KvEventStream final : public grpc::ServerWriteReactor<v1::KvEvent>, public KvEventSubscriber {
 public:
  KvEventStream(KvEventHub* hub, uint32_t buffer) : hub_(hub), buffer_(buffer) {}

  void Begin(const TenantId& tenant, bool all_tenants, bool replay) {
    // The hub may call Offer/Drop from here on; they only queue and start writes.
    if (absl::Status s = hub_->Subscribe(this, tenant, all_tenants, replay); !s.ok()) {
      absl::MutexLock lock(&mu_);
      FinishLocked(ToGrpcStatus(s));
    }
  }

  bool Offer(KvEventRecord event) override {
    absl::MutexLock lock(&mu_);
    if (finishing_) return true;  // ending anyway: nothing to queue
    if (!event.replay && live_queued_ >= buffer_) return false;
    if (!event.replay) ++live_queued_;
    queue_.push_back(std::move(event));
    WriteNextLocked();
    return true;
  }

  void Drop() override {
    absl::MutexLock lock(&mu_);
    FinishLocked(ToGrpcStatus(
        WithReason(absl::ResourceExhaustedError(absl::StrCat(
                       "KV event subscriber fell ", buffer_,
                       " events behind (--kv_events_buffer); subscribe again for a fresh replay")),
                   ErrorReason::kLimit)));
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) {  // the call is gone; OnCancel or OnDone follows
      FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "KV event stream broken"));
      return;
    }
    WriteNextLocked();
  }

  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "KV event subscriber cancelled"));
  }

  void OnDone() override {
    hub_->Unsubscribe(this);
    delete this;
  }

 private:
  void WriteNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing_) return;
    if (finishing_) {
      if (!finished_) {
        finished_ = true;
        Finish(*final_status_);
      }
      return;
    }
    if (queue_.empty()) return;
    KvEventRecord next = std::move(queue_.front());
    queue_.pop_front();
    if (!next.replay) --live_queued_;
    current_.Clear();
    ToProto(next, &current_);
    writing_ = true;
    StartWrite(&current_);
  }

  // Ends the stream once the write in flight (if any) is done; queued events are not sent.
  void FinishLocked(grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finishing_) return;
    finishing_ = true;
    final_status_ = std::move(status);
    queue_.clear();
    WriteNextLocked();
  }

  KvEventHub* const hub_;
  const uint32_t buffer_;
  absl::Mutex mu_;
  std::deque<KvEventRecord> queue_ ABSL_GUARDED_BY(mu_);
  uint32_t live_queued_ ABSL_GUARDED_BY(mu_) = 0;
  v1::KvEvent current_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::Status> final_status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

grpc::ServerWriteReactor<v1::KvEvent>* KvEventServiceImpl::SubscribeKvEvents(
    grpc::CallbackServerContext* context, const v1::SubscribeKvEventsRequest* request) {
  auto* stream = new KvEventStream(hub_, buffer_);
  // A router (placement) and an admin follow every tenant's units; a tenant its own.
  const Caller caller = CallerOf(*ctx_, context);
  const bool all_tenants = caller.role == v1::ROLE_ROUTER || caller.role == v1::ROLE_ADMIN;
  stream->Begin(caller.tenant, all_tenants, !request->skip_replay());
  return stream;
}

}  // namespace kvpool::server
