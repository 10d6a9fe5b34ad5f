// Admission: who may hold what, and for how long. Every stream that can pin the daemon (an
// append that reserves pages and locks a sequence, a data-plane push, a read or attention call
// in flight) holds a Ticket from here. A ticket counts against caps per connection and per
// tenant (open streams, reserved bytes), and it expires: after `idle_timeout` without Touch, or
// `total_timeout` after it was opened, its owner's `on_expire` runs once, from the admission's
// reaper thread, with the status to end the stream with (DEADLINE_EXCEEDED, reason LIMIT, naming
// the timeout), and the owner rolls its work back (dropping the ticket releases everything).
// A frozen client (SIGSTOP, a crashed engine) thus loses its lock and reservation after the idle
// limit; a client that opens streams and sends nothing holds them only that long.
//
//   Admission admission(limits);
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<Admission::Ticket> t,
//       admission.Open(tenant, connection, "AppendKv", [weak](absl::Status why) { /* abort */ }));
//   KVPOOL_RETURN_IF_ERROR(t->Reserve(bytes));   // RESOURCE_EXHAUSTED, reason LIMIT
//   t->Touch();                                   // on every message
//   t.reset();                                    // done: streams and bytes released
//
// Reads out of the pool (ReadKv, ReadBlocks, Attend: TicketKind::kRead) hold tickets too, with
// caps of their own on calls at once and on the response bytes they hold in flight, so that a
// flood of reads neither pins memory nor takes the streams appends need (and the reverse).
//
// Refusals are RESOURCE_EXHAUSTED with reason LIMIT (proto/status.h) naming the cap, its value
// and what the request needed. The tenancy issue adds per-tenant quotas here, not elsewhere.
//
// Thread-safe. Tickets may be dropped from any thread, including inside on_expire.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/tenant.h"

namespace kvpool::server {

// What a ticket admits: a stream that writes into the pool (an append, a data-plane push) or a
// call that reads out of it (ReadKv, ReadBlocks, Attend). Each kind has caps of its own.
enum class TicketKind : uint8_t { kIngest = 0, kRead = 1 };

struct AdmissionLimits {
  // Streams open at once per client connection (gRPC peer) and per tenant; 0 = no cap.
  int max_streams_per_connection = 64;
  int max_streams_per_tenant = 1024;
  // Bytes reserved at once by the streams of one connection and of one tenant; 0 = no cap.
  size_t max_reserved_bytes_per_connection = 0;
  size_t max_reserved_bytes_per_tenant = 0;
  // Read and attention calls at once per connection and per tenant, and the response bytes
  // (and an Attend's decoded queries) they hold in flight; 0 = no cap.
  int max_reads_per_connection = 64;
  int max_reads_per_tenant = 1024;
  size_t max_read_bytes_per_connection = size_t{256} << 20;
  size_t max_read_bytes_per_tenant = size_t{1} << 30;
  // A stream with no progress for this long, or open for this long in all, expires.
  absl::Duration idle_timeout = absl::Seconds(30);
  absl::Duration total_timeout = absl::Minutes(30);
  // How often the reaper looks for expired streams.
  absl::Duration reap_period = absl::Milliseconds(100);
};

struct AdmissionCounters {
  uint64_t open_streams = 0;    // ingest tickets
  uint64_t reserved_bytes = 0;  // by ingest tickets
  uint64_t open_reads = 0;      // read tickets
  uint64_t read_bytes = 0;      // reserved by read tickets
  uint64_t refused = 0;         // Open or Reserve answered RESOURCE_EXHAUSTED, since start
  uint64_t expired_idle = 0;    // tickets expired by the idle timeout, since start
  uint64_t expired_total = 0;   // tickets expired by the total timeout, since start
};

class Admission {
 public:
  class Ticket {
   public:
    ~Ticket();  // releases the stream and its bytes
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;

    // Counts `bytes` more against the connection's and the tenant's caps; RESOURCE_EXHAUSTED
    // (reason LIMIT) and nothing counted when a cap would be passed.
    [[nodiscard]] absl::Status Reserve(size_t bytes);
    // Gives back `bytes` of what Reserve counted (at most that).
    void Unreserve(size_t bytes);
    // Progress: restarts the idle clock.
    void Touch();
    size_t reserved() const;
    // Whether the ticket expired (on_expire has been called or is being called).
    bool expired() const;

   private:
    friend class Admission;
    Ticket() = default;
    Admission* admission_ = nullptr;
    uint64_t id_ = 0;
  };

  explicit Admission(AdmissionLimits limits);
  ~Admission();  // stops the reaper; tickets must be gone first
  Admission(const Admission&) = delete;
  Admission& operator=(const Admission&) = delete;

  // Opens a stream of `kind` of `tenant` on `connection` (e.g. grpc's peer string) for `what`
  // (named in messages). RESOURCE_EXHAUSTED (reason LIMIT) over a cap on streams or reads.
  // `on_expire` runs at most once, on the reaper thread, when the stream times out, with the
  // stream's end status (DEADLINE_EXCEEDED, reason LIMIT); it must not block for long.
  using OnExpire = std::function<void(absl::Status why)>;
  [[nodiscard]] absl::StatusOr<std::unique_ptr<Ticket>> Open(const TenantId& tenant,
                                                             const std::string& connection,
                                                             const std::string& what,
                                                             OnExpire on_expire,
                                                             TicketKind kind = TicketKind::kIngest);

  const AdmissionLimits& limits() const { return limits_; }
  AdmissionCounters Counters() const;
  // The same for one tenant (zeros when it holds nothing).
  AdmissionCounters TenantCounters(const TenantId& tenant) const;

 private:
  struct Entry {
    TicketKind kind = TicketKind::kIngest;
    TenantId tenant;
    std::string connection;
    std::string what;
    size_t reserved = 0;
    absl::Time opened;
    absl::Time last_progress;
    bool expired = false;
    OnExpire on_expire;
  };
  // Per kind (TicketKind's value).
  struct Usage {
    uint64_t streams[2] = {0, 0};
    size_t bytes[2] = {0, 0};
    bool empty() const { return streams[0] == 0 && streams[1] == 0; }
  };
  // The caps of one kind.
  struct Caps {
    const char* streams_per_connection;
    const char* streams_per_tenant;
    const char* bytes_per_connection;
    const char* bytes_per_tenant;
    uint64_t max_streams_per_connection;
    uint64_t max_streams_per_tenant;
    size_t max_bytes_per_connection;
    size_t max_bytes_per_tenant;
  };
  Caps CapsOf(TicketKind kind) const;

  absl::Status Reserve(uint64_t id, size_t bytes);
  void Unreserve(uint64_t id, size_t bytes);
  void Touch(uint64_t id);
  void Close(uint64_t id);
  void Reap();

  const AdmissionLimits limits_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::map<TenantId, Usage> tenants_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Usage> connections_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t refused_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t expired_idle_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t expired_total_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread reaper_;
};

}  // namespace kvpool::server
