// KvEventHub: fans the prefix index's changes (units stored, units removed) out to the
// subscribers of KvEventService, each through a bounded queue of its own. It observes the index
// under the index's lock and never blocks there: a subscriber whose queue of live events is full
// is told to end (KvEventSubscriber::Drop) instead of slowing ingest.
//
//   KvEventHub hub(&index, /*max_subscribers=*/64);   // the index's observer from now on
//   KVPOOL_RETURN_IF_ERROR(hub.Subscribe(subscriber, tenant, /*all_tenants=*/false,
//                                        /*replay=*/true));
//   ...
//   hub.Unsubscribe(subscriber);                  // before the subscriber goes away
//
// Thread-safe. Lock order: the index's lock, then the hub's, then a subscriber's own.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/prefix_index.h"

namespace kvpool::server {

// One change, as the hub hands it to subscribers (copied out of the index's lock).
struct KvEventRecord {
  enum class Kind : uint8_t { kAllCleared, kStored, kRemoved, kReplayComplete };
  Kind kind = Kind::kStored;
  bool replay = false;           // part of the replay on subscribe
  uint64_t sequence_number = 0;  // 0 for the replay and its markers
  TenantId tenant;
  std::string model_id;
  PrefixHash hash{};
  PrefixHash parent{};
  bool has_parent = false;
  PrefixUnitKey key;
  PrefixRemoval removal = PrefixRemoval::kEvicted;
  uint64_t replayed_units = 0;  // kReplayComplete
};

// The receiving end (a gRPC stream). Called under the hub's lock: must not block nor call the
// hub.
class KvEventSubscriber {
 public:
  virtual ~KvEventSubscriber() = default;
  // Queues an event; returns false when its queue of live events is full (the hub then stops
  // feeding it and calls Drop). Replayed events are always taken: the index bounds them.
  virtual bool Offer(KvEventRecord event) = 0;
  // The subscriber fell behind: it ends its stream and is fed nothing more.
  virtual void Drop() = 0;
};

class KvEventHub final : public PrefixIndexObserver {
 public:
  // At most `max_subscribers` streams at once: each may hold a replay of the whole index.
  KvEventHub(PrefixIndex* index, size_t max_subscribers);
  ~KvEventHub() override;  // unsets itself as the index's observer
  KvEventHub(const KvEventHub&) = delete;
  KvEventHub& operator=(const KvEventHub&) = delete;

  // Feeds `subscriber` the changes of `tenant`'s units (every tenant's with `all_tenants`),
  // after, with `replay`, AllCleared, every unit held now and ReplayComplete; atomically with
  // the index, so no change is missed or seen twice. RESOURCE_EXHAUSTED (reason LIMIT), with
  // nothing offered, when max_subscribers are subscribed.
  [[nodiscard]] absl::Status Subscribe(KvEventSubscriber* subscriber, const TenantId& tenant,
                                       bool all_tenants, bool replay);
  void Unsubscribe(KvEventSubscriber* subscriber);

  size_t subscribers() const;
  // Subscribers dropped for falling behind, since start.
  uint64_t dropped() const;

  void OnStored(const PrefixUnitView& unit) override;
  void OnRemoved(const PrefixUnitView& unit, PrefixRemoval why) override;

 private:
  struct Entry {
    KvEventSubscriber* subscriber;
    TenantId tenant;
    bool all_tenants;
  };
  void Publish(KvEventRecord event);

  PrefixIndex* const index_;
  const size_t max_subscribers_;
  mutable absl::Mutex mu_;
  size_t joining_ ABSL_GUARDED_BY(mu_) = 0;  // subscribers replaying, not yet in the list
  std::vector<Entry> subscribers_ ABSL_GUARDED_BY(mu_);
  uint64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
};

// The event's record for one unit of the index.
KvEventRecord KvEventRecordOf(const PrefixUnitView& unit, KvEventRecord::Kind kind);

}  // namespace kvpool::server
