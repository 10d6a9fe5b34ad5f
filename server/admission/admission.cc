#include "server/admission/admission.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "proto/status.h"

namespace kvpool::server {
namespace {

absl::Status LimitError(const std::string& what, absl::string_view cap, uint64_t limit,
                        uint64_t in_use, uint64_t asked) {
  return WithReason(
      absl::ResourceExhaustedError(absl::StrCat(what, ": ", cap, " is ", limit, " (", in_use,
                                                " in use, ", asked, " more asked)")),
      ErrorReason::kLimit,
      {{"limit", std::string(cap)},
       {"value", absl::StrCat(limit)},
       {"in_use", absl::StrCat(in_use)}});
}

absl::Status ExpiredError(const std::string& what, absl::string_view timeout,
                          absl::Duration limit) {
  const int64_t ms = absl::ToInt64Milliseconds(limit);
  return WithReason(absl::DeadlineExceededError(
                        absl::StrCat(what, ": the stream's ", timeout, " of ", ms, " ms passed")),
                    ErrorReason::kLimit,
                    {{"limit", std::string(timeout)}, {"value_ms", absl::StrCat(ms)}});
}

}  // namespace

Admission::Ticket::~Ticket() {
  if (admission_ != nullptr) admission_->Close(id_);
}

absl::Status Admission::Ticket::Reserve(size_t bytes) { return admission_->Reserve(id_, bytes); }
void Admission::Ticket::Unreserve(size_t bytes) { admission_->Unreserve(id_, bytes); }
void Admission::Ticket::Touch() { admission_->Touch(id_); }

size_t Admission::Ticket::reserved() const {
  absl::MutexLock lock(&admission_->mu_);
  auto it = admission_->entries_.find(id_);
  return it == admission_->entries_.end() ? 0 : it->second.reserved;
}

bool Admission::Ticket::expired() const {
  absl::MutexLock lock(&admission_->mu_);
  auto it = admission_->entries_.find(id_);
  return it != admission_->entries_.end() && it->second.expired;
}

Admission::Admission(AdmissionLimits limits) : limits_(std::move(limits)) {
  reaper_ = std::thread([this] { Reap(); });
}

Admission::~Admission() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  reaper_.join();
}

Admission::Caps Admission::CapsOf(TicketKind kind) const {
  const AdmissionLimits& l = limits_;
  auto count = [](int v) { return static_cast<uint64_t>(std::max(v, 0)); };
  if (kind == TicketKind::kRead) {
    return Caps{"reads per connection",
                "reads per tenant",
                "read bytes in flight per connection",
                "read bytes in flight per tenant",
                count(l.max_reads_per_connection),
                count(l.max_reads_per_tenant),
                l.max_read_bytes_per_connection,
                l.max_read_bytes_per_tenant};
  }
  return Caps{"open streams per connection",       "open streams per tenant",
              "reserved bytes per connection",     "reserved bytes per tenant",
              count(l.max_streams_per_connection), count(l.max_streams_per_tenant),
              l.max_reserved_bytes_per_connection, l.max_reserved_bytes_per_tenant};
}

absl::StatusOr<std::unique_ptr<Admission::Ticket>> Admission::Open(const TenantId& tenant,
                                                                   const std::string& connection,
                                                                   const std::string& what,
                                                                   OnExpire on_expire,
                                                                   TicketKind kind) {
  const int k = static_cast<int>(kind);
  const Caps caps = CapsOf(kind);
  absl::MutexLock lock(&mu_);
  auto usage_of = [](const auto& map, const auto& key) {
    auto it = map.find(key);
    return it == map.end() ? Usage{} : it->second;
  };
  const Usage c = usage_of(connections_, connection);
  const Usage t = usage_of(tenants_, tenant);
  if (caps.max_streams_per_connection > 0 && c.streams[k] >= caps.max_streams_per_connection) {
    ++refused_;
    return LimitError(what, caps.streams_per_connection, caps.max_streams_per_connection,
                      c.streams[k], 1);
  }
  if (caps.max_streams_per_tenant > 0 && t.streams[k] >= caps.max_streams_per_tenant) {
    ++refused_;
    return LimitError(what, caps.streams_per_tenant, caps.max_streams_per_tenant, t.streams[k], 1);
  }
  const uint64_t id = next_id_++;
  Entry& e = entries_[id];
  e.kind = kind;
  e.tenant = tenant;
  e.connection = connection;
  e.what = what;
  e.opened = e.last_progress = absl::Now();
  e.on_expire = std::move(on_expire);
  ++connections_[connection].streams[k];
  ++tenants_[tenant].streams[k];
  auto ticket = std::unique_ptr<Ticket>(new Ticket());
  ticket->admission_ = this;
  ticket->id_ = id;
  return ticket;
}

absl::Status Admission::Reserve(uint64_t id, size_t bytes) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return absl::InternalError("reserve on a closed admission ticket");
  Entry& e = it->second;
  const int k = static_cast<int>(e.kind);
  const Caps caps = CapsOf(e.kind);
  Usage& c = connections_[e.connection];
  Usage& t = tenants_[e.tenant];
  if (caps.max_bytes_per_connection > 0 && c.bytes[k] + bytes > caps.max_bytes_per_connection) {
    ++refused_;
    return LimitError(e.what, caps.bytes_per_connection, caps.max_bytes_per_connection, c.bytes[k],
                      bytes);
  }
  if (caps.max_bytes_per_tenant > 0 && t.bytes[k] + bytes > caps.max_bytes_per_tenant) {
    ++refused_;
    return LimitError(e.what, caps.bytes_per_tenant, caps.max_bytes_per_tenant, t.bytes[k], bytes);
  }
  e.reserved += bytes;
  c.bytes[k] += bytes;
  t.bytes[k] += bytes;
  e.last_progress = absl::Now();
  return absl::OkStatus();
}

void Admission::Unreserve(uint64_t id, size_t bytes) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  Entry& e = it->second;
  const int k = static_cast<int>(e.kind);
  bytes = std::min(bytes, e.reserved);
  e.reserved -= bytes;
  connections_[e.connection].bytes[k] -= bytes;
  tenants_[e.tenant].bytes[k] -= bytes;
}

void Admission::Touch(uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(id);
  if (it != entries_.end()) it->second.last_progress = absl::Now();
}

void Admission::Close(uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  const Entry& e = it->second;
  const int k = static_cast<int>(e.kind);
  // Usage entries go when they are empty, so that a stream of new peers leaves nothing behind.
  auto c = connections_.find(e.connection);
  c->second.streams[k] -= 1;
  c->second.bytes[k] -= e.reserved;
  if (c->second.empty()) connections_.erase(c);
  auto t = tenants_.find(e.tenant);
  t->second.streams[k] -= 1;
  t->second.bytes[k] -= e.reserved;
  if (t->second.empty()) tenants_.erase(t);
  entries_.erase(it);
}

void Admission::Reap() {
  while (true) {
    std::vector<std::pair<OnExpire, absl::Status>> due;
    {
      absl::MutexLock lock(&mu_);
      auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; };
      mu_.AwaitWithTimeout(absl::Condition(&stop), limits_.reap_period);
      if (stopping_) return;
      const absl::Time now = absl::Now();
      for (auto& [id, e] : entries_) {
        if (e.expired) continue;
        const bool idle = now - e.last_progress > limits_.idle_timeout;
        const bool total = now - e.opened > limits_.total_timeout;
        if (!idle && !total) continue;
        e.expired = true;
        ++(total ? expired_total_ : expired_idle_);
        if (!e.on_expire) continue;
        due.emplace_back(std::move(e.on_expire),
                         total ? ExpiredError(e.what, "total timeout", limits_.total_timeout)
                               : ExpiredError(e.what, "idle timeout", limits_.idle_timeout));
      }
    }
    for (auto& [fn, why] : due) fn(std::move(why));
  }
}

AdmissionCounters Admission::Counters() const {
  absl::MutexLock lock(&mu_);
  AdmissionCounters c;
  for (const auto& [id, e] : entries_) {
    if (e.kind == TicketKind::kRead) {
      ++c.open_reads;
      c.read_bytes += e.reserved;
    } else {
      ++c.open_streams;
      c.reserved_bytes += e.reserved;
    }
  }
  c.refused = refused_;
  c.expired_idle = expired_idle_;
  c.expired_total = expired_total_;
  return c;
}

AdmissionCounters Admission::TenantCounters(const TenantId& tenant) const {
  absl::MutexLock lock(&mu_);
  AdmissionCounters c;
  auto it = tenants_.find(tenant);
  if (it != tenants_.end()) {
    c.open_streams = it->second.streams[0];
    c.reserved_bytes = it->second.bytes[0];
    c.open_reads = it->second.streams[1];
    c.read_bytes = it->second.bytes[1];
  }
  return c;
}

}  // namespace kvpool::server
