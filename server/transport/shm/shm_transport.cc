#include "server/transport/shm/shm_transport.h"

#include <poll.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "dataplane/fd_passing.h"
#include "dataplane/shm_wire.h"
#include "server/transport/session_registry.h"
#include "server/transport/session_secret.h"
#include "server/transport/shm/shm_channel.h"
#include "spdlog/spdlog.h"

namespace kvpool::server {
namespace {

constexpr uint64_t kDefaultQueryBytes = 4u << 20;
// Heads of at least 32 dimensions: the LSE of a call is at most 1/32 of its queries.
constexpr size_t kLseShare = 32;
constexpr int kMaxPendingHellos = 8;

// One negotiated session: its layout and secret, then (once its client connected) its channel.
struct ShmSession {
  TenantId tenant;
  std::atomic<uint64_t> id{0};  // set once registered
  ShmLayout layout;
  bool device_io = false;
  std::string secret;
  absl::Time added;
  mutable absl::Mutex mu;
  std::shared_ptr<ShmChannel> channel ABSL_GUARDED_BY(mu);
  bool connected ABSL_GUARDED_BY(mu) = false;
  bool ended ABSL_GUARDED_BY(mu) = false;

  std::shared_ptr<ShmChannel> Channel() const {
    absl::MutexLock lock(&mu);
    return channel;
  }
  void End() {
    std::shared_ptr<ShmChannel> c;
    {
      absl::MutexLock lock(&mu);
      ended = true;
      c = std::move(channel);
    }
    if (c != nullptr) c->Close();
  }
};

class ShmTransport final : public Transport {
 public:
  ShmTransport(ServiceContext* ctx, const ShmTransportOptions& options, std::string dir,
               bool own_dir, std::string path, int listener)
      : ctx_(ctx),
        options_(options),
        dir_(std::move(dir)),
        own_dir_(own_dir),
        path_(std::move(path)),
        listener_(listener),
        sessions_(options.max_sessions) {
    caps_.kind = TransportKind::kSharedMemory;
    caps_.host_memory = true;
    caps_.local_peers = true;
    caps_.remote_peers = false;
    caps_.zero_copy = true;
    caps_.remote_attention = true;
    caps_.attention_plans = true;
    accept_thread_ = std::thread([this] { AcceptLoop(); });
  }
  ~ShmTransport() override { Shutdown(); }

  const TransportCapabilities& capabilities() const override { return caps_; }

  absl::StatusOr<TransportSession> Accept(const TenantId& tenant,
                                          const TransportOffer& offer) override {
    if (stop_.load()) return absl::UnavailableError("kvpoold is shutting down");
    const uint64_t query_bytes =
        offer.shm_max_query_bytes == 0 ? kDefaultQueryBytes : offer.shm_max_query_bytes;
    if (query_bytes > kMaxCallQueryBytes) {
      return absl::InvalidArgumentError(absl::StrCat("shared_memory.max_query_bytes ", query_bytes,
                                                     " is above ", kMaxCallQueryBytes));
    }
    KVPOOL_ASSIGN_OR_RETURN(ShmLayout layout,
                            MakeShmLayout(std::max<uint32_t>(offer.shm_slots, 1), query_bytes,
                                          std::max<size_t>(64, query_bytes / kLseShare / 4 * 4),
                                          options_.max_region_bytes));
    if (offer.shm_device_io && ctx_->backend->device() < 0) {
      return absl::FailedPreconditionError(
          "shared_memory.device_io needs a GPU daemon; this one computes on the CPU");
    }
    auto session = std::make_shared<ShmSession>();
    session->layout = layout;
    session->device_io = offer.shm_device_io;
    KVPOOL_ASSIGN_OR_RETURN(session->secret, NewSessionSecret());
    session->added = absl::Now();
    session->tenant = tenant;
    KVPOOL_ASSIGN_OR_RETURN(uint64_t id, sessions_.Add(tenant, session, /*must_watch=*/false));
    session->id.store(id);
    TransportSession s;
    s.kind = TransportKind::kSharedMemory;
    s.session_id = id;
    s.secret = session->secret;
    s.socket_path = path_;
    s.slots = layout.slots;
    s.max_query_bytes = layout.max_query_bytes;
    s.max_lse_bytes = layout.max_lse_bytes;
    s.region_bytes = layout.region_bytes();
    s.call_header_bytes = kCallHeaderBytes;
    s.call_status_bytes = kCallStatusBytes;
    s.hello_timeout_ms = static_cast<uint32_t>(absl::ToInt64Milliseconds(options_.hello_timeout));
    s.device = ctx_->backend->device();
    s.device_io = session->device_io;
    return s;
  }

  absl::StatusOr<int> Close(const TenantId& tenant, uint64_t session_id) override {
    KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<ShmSession> s,
                            sessions_.End(tenant, session_id, absl::OkStatus()));
    s->End();
    return 0;
  }

  TransportStats Stats() const override {
    TransportStats s;
    s.sessions = static_cast<uint32_t>(sessions_.size());
    s.connections_refused = refused_.load() + sessions_.foreign_attempts();
    sessions_.ForEach([&](const ShmSession& session) {
      if (std::shared_ptr<ShmChannel> c = session.Channel()) s.attention_calls += c->calls();
    });
    s.attention_calls += calls_of_ended_.load();
    return s;
  }

  void Shutdown() override {
    if (stop_.exchange(true)) return;
    if (accept_thread_.joinable()) accept_thread_.join();
    for (const std::shared_ptr<ShmSession>& s :
         sessions_.EndAll(absl::UnavailableError("kvpoold is shutting down"))) {
      s->End();
    }
    {
      absl::MutexLock lock(&pending_mu_);
      pending_mu_.Await(absl::Condition(
          +[](int* n) { return *n == 0; }, &pending_));
    }
    close(listener_);
    unlink(path_.c_str());
    if (own_dir_) rmdir(dir_.c_str());
  }

  absl::StatusOr<AttentionPlanInfo> SetAttentionPlan(const TenantId& tenant, uint64_t session_id,
                                                     const std::string& model_id,
                                                     std::vector<std::string> sequence_ids,
                                                     int num_queries) override {
    KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<ShmChannel> ch, ChannelOf(tenant, session_id));
    return ch->AddPlan(model_id, std::move(sequence_ids), num_queries);
  }

  absl::Status DropAttentionPlan(const TenantId& tenant, uint64_t session_id,
                                 uint32_t plan_id) override {
    KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<ShmChannel> ch, ChannelOf(tenant, session_id));
    return ch->DropPlan(plan_id);
  }

  absl::Status WatchSession(const TenantId& tenant, uint64_t session_id,
                            std::function<void(absl::Status)> on_end) override {
    return sessions_.Watch(tenant, session_id, std::move(on_end));
  }

 private:
  absl::StatusOr<std::shared_ptr<ShmChannel>> ChannelOf(const TenantId& tenant, uint64_t id) {
    KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<ShmSession> s, sessions_.Find(tenant, id));
    std::shared_ptr<ShmChannel> ch = s->Channel();
    if (ch == nullptr) {
      return absl::FailedPreconditionError(
          "the shared-memory session is not connected yet: connect its Unix socket first");
    }
    return ch;
  }

  void AcceptLoop() {
    while (!stop_.load()) {
      pollfd p{listener_, POLLIN, 0};
      const int r = poll(&p, 1, 100);
      EndUnconnected();
      if (r <= 0) continue;
      const int conn = accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
      if (conn < 0) continue;
      {
        absl::MutexLock lock(&pending_mu_);
        if (pending_ >= kMaxPendingHellos) {
          refused_.fetch_add(1);
          close(conn);
          continue;
        }
        ++pending_;
      }
      std::thread([this, conn] {
        Handshake(conn);
        absl::MutexLock lock(&pending_mu_);
        --pending_;
      }).detach();
    }
  }

  // Sessions nobody connected within the hello timeout.
  void EndUnconnected() {
    const absl::Time before = absl::Now() - options_.hello_timeout;
    for (const std::shared_ptr<ShmSession>& s : sessions_.All()) {
      bool stale = false;
      {
        absl::MutexLock lock(&s->mu);
        stale = !s->connected && !s->ended && s->added < before;
      }
      if (!stale) continue;
      const uint64_t id = s->id.load();
      if (id == 0) continue;
      if (std::shared_ptr<ShmSession> gone = sessions_.EndAny(
              id, absl::DeadlineExceededError("no client connected to the session in time"))) {
        gone->End();
      }
    }
  }

  void Refuse(int conn, absl::Status why) {
    refused_.fetch_add(1);
    const auto reply = EncodeShmReply({std::move(why), 0});
    (void)SendWithFd(conn, reply, -1);
    close(conn);
  }

  void Handshake(int conn) {
    std::array<uint8_t, kShmHelloBytes> bytes;
    absl::StatusOr<int> fd = ReceiveWithFd(conn, absl::MakeSpan(bytes), options_.hello_timeout);
    if (!fd.ok()) return Refuse(conn, fd.status());
    if (*fd >= 0) {
      close(*fd);  // the client has nothing to hand over
      return Refuse(conn, absl::InvalidArgumentError("a hello carries no descriptor"));
    }
    absl::StatusOr<ShmHello> hello = DecodeShmHello(bytes);
    if (!hello.ok()) return Refuse(conn, hello.status());
    std::shared_ptr<ShmSession> s = sessions_.FindAny(hello->session_id);
    // A wrong secret and an unknown session read the same.
    if (s == nullptr || !SecretsEqual(s->secret, hello->secret)) {
      return Refuse(conn, absl::PermissionDeniedError("unknown session or wrong secret"));
    }
    const TenantId tenant = s->tenant;
    {
      absl::MutexLock lock(&s->mu);
      if (s->connected || s->ended) {
        return Refuse(conn, absl::AlreadyExistsError("the session is connected already"));
      }
      s->connected = true;
    }
    absl::StatusOr<std::unique_ptr<ShmChannel>> made =
        ShmChannel::Create(ctx_, tenant, s->layout, s->device_io);
    if (!made.ok()) {
      if (std::shared_ptr<ShmSession> gone = sessions_.EndAny(hello->session_id, made.status())) {
        gone->End();
      }
      return Refuse(conn, made.status());
    }
    std::shared_ptr<ShmChannel> ch = std::move(*made);
    {
      // Before the reply: a client that has its region may set a plan at once.
      absl::MutexLock lock(&s->mu);
      if (s->ended) return Refuse(conn, absl::NotFoundError("the session has ended"));
      s->channel = ch;
    }
    const auto reply = EncodeShmReply({absl::OkStatus(), s->layout.region_bytes()});
    if (!SendWithFd(conn, reply, ch->region_fd()).ok()) {
      close(conn);
      if (std::shared_ptr<ShmSession> gone = sessions_.EndAny(
              hello->session_id, absl::UnavailableError("the client left during the hello"))) {
        gone->End();
      }
      return;
    }
    const uint64_t id = hello->session_id;
    ch->Start(conn, [this, id, ch_raw = ch.get()](absl::Status why) {
      calls_of_ended_.fetch_add(ch_raw->calls());
      if (!why.ok()) spdlog::info("shared-memory session {:x} ended: {}", id, why.ToString());
      if (std::shared_ptr<ShmSession> gone = sessions_.EndAny(id, why)) gone->End();
    });
  }

  ServiceContext* const ctx_;
  const ShmTransportOptions options_;
  const std::string dir_;
  const bool own_dir_;
  const std::string path_;
  const int listener_;
  TransportCapabilities caps_;
  SessionRegistry<ShmSession> sessions_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint64_t> calls_of_ended_{0};
  std::thread accept_thread_;
  absl::Mutex pending_mu_;
  int pending_ ABSL_GUARDED_BY(pending_mu_) = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> NewShmTransport(ServiceContext* ctx,
                                                           const ShmTransportOptions& options) {
  std::string dir = options.socket_dir;
  bool own_dir = false;
  if (dir.empty()) {
    const char* base = getenv("XDG_RUNTIME_DIR");
    std::string tmpl =
        absl::StrCat(base != nullptr && *base != '\0' ? base : "/tmp", "/kvpoold-XXXXXX");
    if (mkdtemp(tmpl.data()) == nullptr) {
      return absl::UnavailableError(absl::StrCat("mkdtemp ", tmpl, ": ", std::strerror(errno)));
    }
    dir = tmpl;
    own_dir = true;  // mkdtemp makes it 0700
  }
  const std::string path = absl::StrCat(dir, "/attention-", getpid(), ".sock");
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("Unix socket path too long: ", path));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
  unlink(path.c_str());
  // Created 0600 from the start: no moment at which another user could connect.
  const mode_t old_mask = umask(0177);
  const int bound = bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  const int bind_errno = errno;
  umask(old_mask);
  if (bound == 0) chmod(path.c_str(), 0600);
  if (bound != 0 || listen(fd, 64) != 0) {
    const int e = bound != 0 ? bind_errno : errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("bind/listen ", path, ": ", std::strerror(e)));
  }
  return std::unique_ptr<Transport>(new ShmTransport(ctx, options, dir, own_dir, path, fd));
}

}  // namespace kvpool::server
