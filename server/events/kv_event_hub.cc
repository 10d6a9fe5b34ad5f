#include "server/events/kv_event_hub.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/status.h"

namespace kvpool::server {

KvEventRecord KvEventRecordOf(const PrefixUnitView& unit, KvEventRecord::Kind kind) {
  KvEventRecord r;
  r.kind = kind;
  r.tenant = *unit.tenant;
  r.model_id = *unit.model_id;
  r.key = *unit.key;
  r.hash = unit.key->hash;
  r.has_parent = unit.parent != nullptr;
  if (r.has_parent) r.parent = *unit.parent;
  return r;
}

KvEventHub::KvEventHub(PrefixIndex* index, size_t max_subscribers)
    : index_(index), max_subscribers_(max_subscribers) {
  index_->SetObserver(this);
}

KvEventHub::~KvEventHub() { index_->SetObserver(nullptr); }

absl::Status KvEventHub::Subscribe(KvEventSubscriber* subscriber, const TenantId& tenant,
                                   bool all_tenants, bool replay) {
  {
    absl::MutexLock lock(&mu_);
    if (subscribers_.size() + joining_ >= max_subscribers_) {
      return WithReason(absl::ResourceExhaustedError(
                            absl::StrCat("KV events: ", max_subscribers_,
                                         " subscribers already (--kv_events_max_subscribers)")),
                        ErrorReason::kLimit);
    }
    ++joining_;
  }
  uint64_t units = 0;
  bool full = false;
  if (replay) {
    KvEventRecord cleared;
    cleared.kind = KvEventRecord::Kind::kAllCleared;
    cleared.replay = true;
    cleared.tenant = tenant;
    subscriber->Offer(std::move(cleared));
  }
  index_->VisitUnits(
      [&](const PrefixUnitView& unit) {
        if (!replay || full || (!all_tenants && *unit.tenant != tenant)) return;
        KvEventRecord r = KvEventRecordOf(unit, KvEventRecord::Kind::kStored);
        r.replay = true;
        full = !subscriber->Offer(std::move(r));
        ++units;
      },
      [&] {
        absl::MutexLock lock(&mu_);
        --joining_;
        if (full) {
          ++dropped_;
          subscriber->Drop();
          return;
        }
        if (replay) {
          KvEventRecord done;
          done.kind = KvEventRecord::Kind::kReplayComplete;
          done.replay = true;
          done.tenant = tenant;
          done.replayed_units = units;
          subscriber->Offer(std::move(done));
        }
        subscribers_.push_back(Entry{subscriber, tenant, all_tenants});
      });
  return absl::OkStatus();
}

void KvEventHub::Unsubscribe(KvEventSubscriber* subscriber) {
  absl::MutexLock lock(&mu_);
  subscribers_.erase(std::remove_if(subscribers_.begin(), subscribers_.end(),
                                    [&](const Entry& e) { return e.subscriber == subscriber; }),
                     subscribers_.end());
}

size_t KvEventHub::subscribers() const {
  absl::MutexLock lock(&mu_);
  return subscribers_.size();
}

uint64_t KvEventHub::dropped() const {
  absl::MutexLock lock(&mu_);
  return dropped_;
}

void KvEventHub::OnStored(const PrefixUnitView& unit) {
  Publish(KvEventRecordOf(unit, KvEventRecord::Kind::kStored));
}

void KvEventHub::OnRemoved(const PrefixUnitView& unit, PrefixRemoval why) {
  KvEventRecord r = KvEventRecordOf(unit, KvEventRecord::Kind::kRemoved);
  r.removal = why;
  Publish(std::move(r));
}

void KvEventHub::Publish(KvEventRecord event) {
  absl::MutexLock lock(&mu_);
  event.sequence_number = next_sequence_++;
  for (auto it = subscribers_.begin(); it != subscribers_.end();) {
    if (!it->all_tenants && it->tenant != event.tenant) {
      ++it;
      continue;
    }
    if (it->subscriber->Offer(event)) {
      ++it;
      continue;
    }
    // Fell behind: it ends its stream; nothing more is queued for it.
    ++dropped_;
    it->subscriber->Drop();
    it = subscribers_.erase(it);
  }
}

}  // namespace kvpool::server
