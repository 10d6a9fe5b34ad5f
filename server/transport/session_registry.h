// SessionRegistry: a transport's live sessions (NCCL channels, CUDA IPC sessions), each bound to
// the tenant that negotiated it, and their ends: a session ends once (closed by its client,
// failed, unwatched, or at shutdown) and everyone watching it hears why.
//
//   SessionRegistry<Channel> sessions(/*max_sessions=*/256);
//   KVPOOL_ASSIGN_OR_RETURN(uint64_t id, sessions.Add(tenant, channel, /*must_watch=*/true));
//   KVPOOL_RETURN_IF_ERROR(sessions.Watch(tenant, id, [](absl::Status why) { ... }));
//   KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<Channel> c, sessions.End(tenant, id,
//   absl::OkStatus())); c->Close();                                        // the caller releases
//   what it held
//
// A session that must be watched (its lease: TransportService.WatchSession) and is not within a
// grace period after it was added ends (EndUnwatched): a client that died between negotiating
// and watching leaves nothing behind. Another tenant's session is indistinguishable from none
// (NotFound).
//
// Thread-safe. Watchers run on the thread that ends the session, outside the registry's lock.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/tenant.h"

namespace kvpool::server {

// 64 bits from a cryptographically secure generator (OpenSSL's RAND_bytes): a session id says
// nothing about the next one. Aborts if the generator cannot be seeded (never on Linux).
uint64_t SecureRandomSessionId();

template <typename T>
class SessionRegistry {
 public:
  explicit SessionRegistry(size_t max_sessions) : max_sessions_(max_sessions) {}

  // Registers `session` of `tenant` under a fresh random id (never 0) and returns the id.
  // ResourceExhausted when max_sessions live already.
  absl::StatusOr<uint64_t> Add(const TenantId& tenant, std::shared_ptr<T> session, bool must_watch,
                               absl::Time now = absl::Now()) {
    absl::MutexLock lock(&mu_);
    if (entries_.size() >= max_sessions_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("too many sessions (", max_sessions_, "); close one"));
    }
    uint64_t id = 0;
    while (id == 0 || entries_.count(id) > 0) id = SecureRandomSessionId();
    Entry& e = entries_[id];
    e.tenant = tenant;
    e.session = std::move(session);
    e.must_watch = must_watch;
    e.added = now;
    return id;
  }

  // The live session `id` of `tenant`; NotFound otherwise.
  absl::StatusOr<std::shared_ptr<T>> Find(const TenantId& tenant, uint64_t id) const {
    absl::MutexLock lock(&mu_);
    const Entry* e = FindLocked(tenant, id);
    if (e == nullptr) return NotFound(id);
    return e->session;
  }

  // Runs `on_end(reason)` once when the session ends. NotFound as Find.
  absl::Status Watch(const TenantId& tenant, uint64_t id,
                     std::function<void(absl::Status)> on_end) {
    absl::MutexLock lock(&mu_);
    Entry* e = FindLocked(tenant, id);
    if (e == nullptr) return NotFound(id);
    e->watched = true;
    e->watchers.push_back(std::move(on_end));
    return absl::OkStatus();
  }

  // Ends the session `id` of `tenant` with `why` (its watchers hear it) and returns it, for the
  // caller to release what it holds. NotFound as Find.
  absl::StatusOr<std::shared_ptr<T>> End(const TenantId& tenant, uint64_t id,
                                         const absl::Status& why) {
    Entry e;
    {
      absl::MutexLock lock(&mu_);
      if (FindLocked(tenant, id) == nullptr) return NotFound(id);
      e = TakeLocked(id);
    }
    return Ended(std::move(e), why);
  }

  // Lookups of a live session by a tenant other than its own (refused as NotFound), since start.
  uint64_t foreign_attempts() const { return foreign_attempts_.load(std::memory_order_relaxed); }

  // The live session `id` whatever its tenant, for the transport's own lookups (a data-plane
  // message on a connection already bound to the session); null when there is none.
  std::shared_ptr<T> FindAny(uint64_t id) const {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(id);
    return it == entries_.end() ? nullptr : it->second.session;
  }

  // Every live session, for the transport's own sweeps (timeouts, shutdown).
  std::vector<std::shared_ptr<T>> All() const {
    absl::MutexLock lock(&mu_);
    std::vector<std::shared_ptr<T>> all;
    all.reserve(entries_.size());
    for (const auto& [id, e] : entries_) all.push_back(e.session);
    return all;
  }

  // Ends the session `id` whatever its tenant (the transport's own reasons: its peer failed);
  // null when it is gone already.
  std::shared_ptr<T> EndAny(uint64_t id, const absl::Status& why) {
    Entry e;
    {
      absl::MutexLock lock(&mu_);
      if (entries_.count(id) == 0) return nullptr;
      e = TakeLocked(id);
    }
    return Ended(std::move(e), why);
  }

  // Ends every session that must be watched, is not, and was added before `added_before`.
  std::vector<std::shared_ptr<T>> EndUnwatched(absl::Time added_before, const absl::Status& why) {
    return EndIf(
        [&](const Entry& e) { return e.must_watch && !e.watched && e.added < added_before; }, why);
  }

  // Ends every session (shutdown).
  std::vector<std::shared_ptr<T>> EndAll(const absl::Status& why) {
    return EndIf([](const Entry&) { return true; }, why);
  }

  size_t size() const {
    absl::MutexLock lock(&mu_);
    return entries_.size();
  }

  // Calls fn(session) for every live session (under the registry's lock: keep it short).
  void ForEach(const std::function<void(const T&)>& fn) const {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, e] : entries_) fn(*e.session);
  }

 private:
  struct Entry {
    TenantId tenant;
    std::shared_ptr<T> session;
    bool must_watch = false;
    bool watched = false;
    absl::Time added;
    std::vector<std::function<void(absl::Status)>> watchers;
  };

  static absl::Status NotFound(uint64_t id) {
    return absl::NotFoundError(absl::StrCat("no transport session ", id));
  }

  // Another tenant's session answers as none, and is counted.
  const Entry* FindLocked(const TenantId& tenant, uint64_t id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = entries_.find(id);
    if (it == entries_.end()) return nullptr;
    if (it->second.tenant != tenant) {
      foreign_attempts_.fetch_add(1, std::memory_order_relaxed);
      return nullptr;
    }
    return &it->second;
  }
  Entry* FindLocked(const TenantId& tenant, uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return const_cast<Entry*>(std::as_const(*this).FindLocked(tenant, id));
  }

  Entry TakeLocked(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = entries_.find(id);
    Entry e = std::move(it->second);
    entries_.erase(it);
    return e;
  }

  static std::shared_ptr<T> Ended(Entry e, const absl::Status& why) {
    for (auto& watcher : e.watchers) watcher(why);
    return std::move(e.session);
  }

  template <typename Pred>
  std::vector<std::shared_ptr<T>> EndIf(Pred pred, const absl::Status& why) {
    std::vector<Entry> ended;
    {
      absl::MutexLock lock(&mu_);
      for (auto it = entries_.begin(); it != entries_.end();) {
        if (pred(it->second)) {
          ended.push_back(std::move(it->second));
          it = entries_.erase(it);
        } else {
          ++it;
        }
      }
    }
    std::vector<std::shared_ptr<T>> out;
    for (Entry& e : ended) out.push_back(Ended(std::move(e), why));
    return out;
  }

  const size_t max_sessions_;
  mutable std::atomic<uint64_t> foreign_attempts_{0};
  mutable absl::Mutex mu_;
  std::map<uint64_t, Entry> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvpool::server
