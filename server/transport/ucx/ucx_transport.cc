#include "server/transport/ucx/ucx_transport.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "dataplane/ucx_wire_parse.h"
#include "server/ingest/ingest_engine.h"
#include "server/transport/session_registry.h"
#include "server/transport/ucx/push_begin_header.h"
#include "server/transport/session_secret.h"
#include "spdlog/spdlog.h"

namespace kvpool::server {

namespace wire = ::kvpool::ucx::wire;
namespace v1 = ::kvpool::v1;

// K and V of some tokens of one layer: two LAYER_DATA messages received into the halves of one
// staging slot (K first, V second).
struct UcxTransport::Chunk {
  int layer = 0;
  uint32_t token_offset = 0;
  uint32_t num_tokens = 0;
  int slot = -1;
  bool claimed[2] = {false, false};  // a message of this half was accepted
  int landed = 0;                    // halves received
  int receiving = 0;                 // receives in flight
  bool released = false;             // the slot went back
};

struct UcxTransport::Push {
  uint64_t id = 0;
  std::shared_ptr<IngestAppend> append;
  // Open chunks (a half accepted, not yet handed to the store), by (layer, token_offset).
  std::map<std::pair<int, uint32_t>, std::shared_ptr<Chunk>> chunks;
  absl::Time last_activity;
  int outstanding = 0;    // LAYER_DATA pending, receiving or staging
  uint64_t messages = 0;  // LAYER_DATA accepted
  bool commit_requested = false;
  uint64_t expected_messages = 0;
  bool finished = false;  // committing, committed or failed: PUSH_DONE decided
  bool counted = false;   // no longer counted as open (committed or aborted)
  bool answered = false;  // PUSH_DONE sent
};

// A connection accepted from the listener. Unbound until its HELLO names a session and that
// session's secret; then it is the session's only connection.
struct UcxTransport::Connection {
  ucp_ep_h ep = nullptr;
  absl::Time accepted;
  std::weak_ptr<Session> session;  // set when bound
  bool failed = false;             // UCX reported its error: closed forcefully whatever the mode
  bool closed = false;
  absl::Time closed_at;
  std::function<void(ucs_status_t)> on_error;  // UCX holds a pointer to it
};

struct UcxTransport::Session {
  uint64_t id = 0;
  TenantId tenant;
  std::string secret;  // binds a connection (HELLO)
  absl::Time created;
  std::shared_ptr<Connection> connection;  // null until HELLO
  ucp_ep_h ep = nullptr;                   // the connection's endpoint once bound
  bool peer_error_handling = true;         // else the client process is watched
  bool watch = false;                      // the client runs on this host: watch its process
  ucx::ProcessIdentity peer;
  // Set on the progress thread when the session ends; read by attention work on the workers,
  // which stops between units once the session that asked is gone.
  std::atomic<bool> dead{false};
  absl::Time ended;
  std::map<uint64_t, std::shared_ptr<Push>> pushes;
  uint32_t queued = 0;  // LAYER_DATA pending or receiving
  std::set<std::shared_ptr<Receive>> receiving;
};

// A LAYER_DATA receive in flight into a half of a chunk's staging slot.
struct UcxTransport::Receive {
  std::shared_ptr<Chunk> chunk;
  std::shared_ptr<Push> push;
  bool abandoned = false;  // its session ended with the peer gone; the slot was reclaimed
};

struct UcxTransport::Pending {
  std::shared_ptr<Session> session;
  std::shared_ptr<Push> push;
  wire::LayerDataHeader h;
  void* data = nullptr;
  size_t length = 0;
  bool rndv = false;
};

namespace {

class UcxRegisteredMemory final : public RegisteredMemory {
 public:
  explicit UcxRegisteredMemory(std::unique_ptr<ucx::UcxMemory> m) : m_(std::move(m)) {}
  uint8_t* data() const override { return m_->data(); }
  size_t size() const override { return m_->size(); }

 private:
  std::unique_ptr<ucx::UcxMemory> m_;
};

ucx::AmMessage Message(std::string header, std::string payload = {}) {
  ucx::AmMessage m;
  m.header = std::move(header);
  m.payload = std::move(payload);
  return m;
}

// A client-supplied string for the log: at most 64 characters, escaped.
std::string Printable(absl::string_view s) { return absl::CEscape(s.substr(0, 64)); }

// The endpoint a message came on: set when the sender used UCP_AM_SEND_FLAG_REPLY.
ucp_ep_h SenderOf(const ucp_am_recv_param_t* param) {
  return (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 ? param->reply_ep : nullptr;
}

static_assert(sizeof(wire::HelloHeader::secret) == kSessionSecretBytes);

}  // namespace

UcxTransportOptions UcxTransportOptionsFromConfig(const ServerConfig& config) {
  UcxTransportOptions o;
  o.runtime.tls = config.ucx_tls;
  o.runtime.net_devices = config.ucx_net_devices;
  o.runtime.keepalive = absl::Milliseconds(config.transport_keepalive_ms);
  o.runtime.name = "kvpoold";
  // --ucx_listen (validated by ServerConfig::Validate), else --listen's host and a free port.
  absl::StatusOr<HostPort> at = ParseHostPort(config.ucx_listen);
  if (config.ucx_listen.empty() || !at.ok()) {
    at = ParseHostPort(config.listen);
    if (at.ok()) at->port = 0;
  }
  if (at.ok()) {
    o.listen_host = at->host;
    o.listen_port = at->port;
  }
  o.hello_timeout = absl::Milliseconds(config.transport_hello_timeout_ms);
  o.staging_bytes = config.transport_staging_bytes;
  o.message_bytes = config.transport_message_bytes;
  // The one idle limit of every stream (the admission's): a push's own backstop uses it too.
  o.idle_timeout = absl::Milliseconds(config.stream_idle_timeout_ms);
  return o;
}

UcxTransport::UcxTransport(ServiceContext* ctx, const UcxTransportOptions& options)
    : ctx_(ctx), options_(options), sessions_(static_cast<size_t>(options.max_sessions)) {}

absl::StatusOr<std::unique_ptr<UcxTransport>> UcxTransport::Create(
    ServiceContext* ctx, const UcxTransportOptions& options) {
  if (options.message_bytes < 4096 || options.staging_bytes < 2 * options.message_bytes) {
    return absl::InvalidArgumentError(
        "UCX staging must hold at least one slot: two messages (K and V) of at least 4096 bytes");
  }
  auto t = std::unique_ptr<UcxTransport>(new UcxTransport(ctx, options));
  if (absl::Status s = t->Init(); !s.ok()) return s;
  return t;
}

absl::Status UcxTransport::Init() {
  absl::StatusOr<std::unique_ptr<ucx::UcxRuntime>> rt = ucx::UcxRuntime::Create(options_.runtime);
  if (!rt.ok()) return rt.status();
  rt_ = *std::move(rt);
  half_bytes_ = (options_.message_bytes + 4095) / 4096 * 4096;
  slot_bytes_ = 2 * half_bytes_;
  num_slots_ = std::max(1, static_cast<int>(options_.staging_bytes / slot_bytes_));
  max_inflight_ = options_.max_inflight_messages > 0 ? options_.max_inflight_messages
                                                     : static_cast<uint32_t>(2 * num_slots_);
  absl::StatusOr<std::unique_ptr<ucx::UcxMemory>> staging =
      ucx::UcxMemory::Allocate(rt_->context(), slot_bytes_ * num_slots_);
  if (!staging.ok()) return staging.status();
  staging_ = *std::move(staging);
  for (int i = num_slots_ - 1; i >= 0; --i) free_slots_.push_back(i);

  auto handler = [this](auto method) {
    return [this, method](const void* h, size_t hl, void* d, size_t l,
                          const ucp_am_recv_param_t* p) { return (this->*method)(h, hl, d, l, p); };
  };
  absl::Status s = rt_->SetAmHandler(wire::kPushBegin, handler(&UcxTransport::OnPushBegin));
  if (s.ok()) s = rt_->SetAmHandler(wire::kLayerData, handler(&UcxTransport::OnLayerData));
  if (s.ok()) s = rt_->SetAmHandler(wire::kAttend, handler(&UcxTransport::OnAttend));
  if (s.ok()) {
    s = rt_->SetAmHandler(wire::kPushCommit, [this](const void* h, size_t hl, void*, size_t,
                                                    const ucp_am_recv_param_t* p) {
      return OnPushControl(true, h, hl, p);
    });
  }
  if (s.ok()) {
    s = rt_->SetAmHandler(wire::kPushAbort, [this](const void* h, size_t hl, void*, size_t,
                                                   const ucp_am_recv_param_t* p) {
      return OnPushControl(false, h, hl, p);
    });
  }
  if (s.ok()) {
    s = rt_->SetAmHandler(wire::kHello,
                          [this](const void* h, size_t hl, void*, size_t l,
                                 const ucp_am_recv_param_t* p) { return OnHello(h, hl, l, p); });
  }
  if (!s.ok()) return s;
  peer_error_handling_ = !ucx::SharedMemoryOnly(rt_->transports());
  // Before Start: this thread owns the worker.
  absl::StatusOr<std::unique_ptr<ucx::UcxListener>> listener = ucx::UcxListener::Create(
      rt_.get(), options_.listen_host, options_.listen_port,
      [this](ucp_conn_request_h request) { OnConnectionRequest(request); });
  if (!listener.ok()) return listener.status();
  listener_ = *std::move(listener);
  if (!IsLoopbackHost(options_.listen_host)) {
    spdlog::warn(
        "ucx: the UCX listener serves '{}', beyond loopback. UCX's connection manager aborts the "
        "process on malformed bytes (server/transport/README.md, Security): let only trusted "
        "hosts reach it",
        options_.listen_host);
  }
  rt_->Start([this] { OnTick(); });
  return absl::OkStatus();
}

UcxTransport::~UcxTransport() { Shutdown(); }

const TransportCapabilities& UcxTransport::capabilities() const {
  static const TransportCapabilities kCaps{.kind = TransportKind::kUcx,
                                           .host_memory = true,
                                           .device_memory = false,
                                           .local_peers = true,
                                           .remote_peers = true,
                                           .zero_copy = true,
                                           .layer_notifications = true,
                                           .remote_attention = true};
  return kCaps;
}

absl::StatusOr<TransportSession> UcxTransport::Accept(const TenantId& tenant,
                                                      const TransportOffer& offer) {
  if (shut_down_.load()) return absl::UnavailableError("kvpoold is shutting down");
  if (offer.kind != TransportKind::kUcx) {
    return absl::InvalidArgumentError("the UCX transport got an offer of another kind");
  }
  if (offer.wire_version != wire::kWireVersion) {
    return absl::InvalidArgumentError(absl::StrCat("the UCX offer speaks wire version ",
                                                   offer.wire_version, "; this kvpoold speaks ",
                                                   wire::kWireVersion));
  }
  absl::StatusOr<std::string> secret = NewSessionSecret();
  if (!secret.ok()) return secret.status();
  absl::StatusOr<TransportSession> result = absl::InternalError("not run");
  absl::Status run = rt_->RunSync([&] {
    if (listener_ == nullptr) {  // Shutdown ran first
      result = absl::UnavailableError("kvpoold is shutting down");
      return;
    }
    auto session = std::make_shared<Session>();
    session->tenant = tenant;
    session->secret = *secret;
    session->created = absl::Now();
    session->peer = ucx::ProcessIdentity{offer.peer_process.boot_id, offer.peer_process.pid,
                                         offer.peer_process.start_time};
    session->watch = ucx::CanWatch(session->peer);
    session->peer_error_handling = peer_error_handling_;
    if (!session->peer_error_handling && !session->watch) {
      result = absl::InvalidArgumentError(
          "shared-memory UCX needs a client on this host whose process the daemon can watch");
      return;
    }
    absl::StatusOr<uint64_t> id = sessions_.Add(tenant, session, /*must_watch=*/false);
    if (!id.ok()) {
      result = id.status();
      return;
    }
    session->id = *id;
    TransportSession ts;
    ts.kind = TransportKind::kUcx;
    ts.session_id = session->id;
    ts.listener_host = listener_->host();
    ts.listener_port = listener_->port();
    ts.secret = session->secret;
    ts.wire_version = wire::kWireVersion;
    ts.max_message_bytes = half_bytes_;
    ts.max_inflight_messages = max_inflight_;
    ts.staging_bytes = slot_bytes_ * num_slots_;
    ts.idle_timeout_ms = static_cast<uint32_t>(absl::ToInt64Milliseconds(options_.idle_timeout));
    ts.transports = rt_->transports();
    const ucx::ProcessIdentity self = ucx::SelfProcess();
    ts.daemon_process = PeerProcess{self.boot_id, self.pid, self.start_time};
    ts.peer_error_handling = session->peer_error_handling;
    result = ts;
    spdlog::info("ucx: session {:x} for '{}' (client transports {})", session->id,
                 Printable(offer.client_name), Printable(offer.peer_transports));
  });
  if (!run.ok()) return run;
  return result;
}

absl::StatusOr<int> UcxTransport::Close(const TenantId& tenant, uint64_t session_id) {
  absl::StatusOr<int> result = absl::InternalError("not run");
  absl::Status run = rt_->RunSync([&] {
    // Another tenant's session answers as none, and is counted.
    absl::StatusOr<std::shared_ptr<Session>> s = sessions_.Find(tenant, session_id);
    if (!s.ok()) {
      result = s.status();
      return;
    }
    int open = 0;
    for (const auto& [id, p] : (*s)->pushes) open += p->finished ? 0 : 1;
    EndSession(*s, absl::CancelledError("UCX session closed"), /*force=*/false,
               /*peer_gone=*/false, /*closed=*/true);
    result = open;
  });
  if (!run.ok()) return run;
  return result;
}

absl::Status UcxTransport::WatchSession(const TenantId& tenant, uint64_t session_id,
                                        std::function<void(absl::Status)> on_end) {
  return sessions_.Watch(tenant, session_id, std::move(on_end));
}

TransportStats UcxTransport::Stats() const {
  TransportStats s;
  s.sessions = static_cast<uint32_t>(sessions_.size());
  s.open_pushes = open_pushes_.load();
  s.staging_bytes_in_use = static_cast<size_t>(slots_in_use_.load()) * slot_bytes_;
  s.staging_capacity_bytes = slot_bytes_ * num_slots_;
  s.pending_messages = pending_count_.load();
  s.pushes_committed = pushes_committed_.load();
  s.pushes_aborted = pushes_aborted_.load();
  s.peer_errors = peer_errors_.load();
  s.timeouts = timeouts_.load();
  s.bytes_received = bytes_received_.load();
  s.attention_calls = attention_calls_.load();
  // Connections refused, and calls that named another tenant's session.
  s.connections_refused = connections_refused_.load() + sessions_.foreign_attempts();
  s.transports = rt_ != nullptr ? rt_->transports() : "";
  return s;
}

void UcxTransport::Shutdown() {
  if (shut_down_.exchange(true) || rt_ == nullptr) return;
  // Before Start (a failed Create) RunSync runs inline: there are no sessions then.
  (void)rt_->RunSync([this] {
    for (const std::shared_ptr<Session>& s : sessions_.All()) {
      EndSession(s, absl::UnavailableError("kvpoold is shutting down"), /*force=*/false);
    }
    std::vector<std::shared_ptr<Connection>> unbound;
    for (auto& [ep, c] : unbound_) unbound.push_back(c);
    for (auto& c : unbound) CloseConnection(c, /*force=*/false);
    listener_.reset();  // on the worker's thread
  });
  rt_->Stop(absl::Milliseconds(300));
}

absl::StatusOr<std::unique_ptr<RegisteredMemory>> UcxTransport::RegisterMemory(size_t bytes) {
  absl::StatusOr<std::unique_ptr<ucx::UcxMemory>> m =
      ucx::UcxMemory::Allocate(rt_->context(), bytes);
  if (!m.ok()) return m.status();
  return std::unique_ptr<RegisteredMemory>(new UcxRegisteredMemory(*std::move(m)));
}

std::shared_ptr<UcxTransport::Session> UcxTransport::FindSession(uint64_t id) {
  std::shared_ptr<Session> s = sessions_.FindAny(id);
  if (s == nullptr || s->dead) return nullptr;
  return s;
}

// --- Connections ---

void UcxTransport::OnConnectionRequest(ucp_conn_request_h request) {
  if (shut_down_.load() ||
      unbound_.size() >= static_cast<size_t>(options_.max_unbound_connections)) {
    ++connections_refused_;
    spdlog::warn("ucx: connection rejected: {} connections are waiting for their HELLO",
                 unbound_.size());
    listener_->Reject(request);
    return;
  }
  auto c = std::make_shared<Connection>();
  c->accepted = absl::Now();
  std::weak_ptr<Connection> weak = c;
  c->on_error = [this, weak](ucs_status_t status) {
    std::shared_ptr<Connection> conn = weak.lock();
    if (conn == nullptr || conn->closed) return;
    conn->failed = true;
    std::shared_ptr<Session> s = conn->session.lock();
    if (s == nullptr) {  // gone before its HELLO
      rt_->Post([this, conn] { CloseConnection(conn, /*force=*/true); });
      return;
    }
    if (s->dead) return;
    ++peer_errors_;
    spdlog::warn("ucx: session {:x}: peer failed ({}); rolling back its pushes", s->id,
                 ucs_status_string(status));
    rt_->Post([this, s, status] {
      EndSession(s, ucx::UcsStatus(status, "UCX peer failed"), /*force=*/true);
    });
  };
  absl::StatusOr<ucp_ep_h> ep =
      ucx::AcceptConnection(rt_.get(), request, peer_error_handling_, &c->on_error);
  if (!ep.ok()) {
    ++connections_refused_;
    spdlog::warn("ucx: cannot accept a connection: {}", ep.status().ToString());
    c->closed = true;
    c->closed_at = absl::Now();
    retired_.push_back(c);
    return;
  }
  c->ep = *ep;
  unbound_[c->ep] = c;
}

ucs_status_t UcxTransport::OnHello(const void* header, size_t header_length, size_t length,
                                   const ucp_am_recv_param_t* param) {
  auto it = unbound_.find(SenderOf(param));
  if (it == unbound_.end()) return UCS_OK;  // a bound connection's second HELLO: ignored
  std::shared_ptr<Connection> c = it->second;
  // Refused once the handler has returned (the connection is delivering this message).
  auto refuse = [this, &c](std::string why) {
    rt_->Post([this, c, why = std::move(why)] { Refuse(c, why); });
    return UCS_OK;
  };
  const std::optional<wire::HelloHeader> h = wire::Decode<wire::HelloHeader>(header, header_length);
  if (!h || length != 0 || ucx::IsRendezvous(param)) return refuse("malformed HELLO");
  if (h->wire_version != wire::kWireVersion) {
    return refuse(absl::StrCat("HELLO of wire version ", h->wire_version));
  }
  const std::shared_ptr<Session> session = sessions_.FindAny(h->session_id);
  const absl::string_view secret(reinterpret_cast<const char*>(h->secret), sizeof(h->secret));
  // One answer for an unknown session and a wrong secret: a refusal tells nothing about which.
  if (session == nullptr || session->dead || !SecretsEqual(secret, session->secret)) {
    return refuse(
        absl::StrCat("HELLO for session ", absl::Hex(h->session_id), " without its secret"));
  }
  if (session->connection != nullptr) {
    return refuse(absl::StrCat("HELLO for session ", absl::Hex(h->session_id),
                               ", which is connected already"));
  }
  unbound_.erase(it);
  c->session = session;
  session->connection = c;
  session->ep = c->ep;
  wire::HelloDoneHeader d{session->id};
  ucx::AmMessage msg = Message(wire::Encode(d));
  msg.flags = UCP_AM_SEND_FLAG_EAGER;
  ucx::SendAm(rt_.get(), session->ep, wire::kHelloDone, std::move(msg), nullptr);
  spdlog::info("ucx: session {:x} connected", session->id);
  return UCS_OK;
}

bool UcxTransport::FromUnboundConnection(const ucp_am_recv_param_t* param, const char* what) {
  auto it = unbound_.find(SenderOf(param));
  if (it == unbound_.end()) return false;
  std::shared_ptr<Connection> c = it->second;
  std::string why = absl::StrCat(what, " before HELLO");
  rt_->Post([this, c, why = std::move(why)] { Refuse(c, why); });
  return true;
}

std::shared_ptr<UcxTransport::Session> UcxTransport::SessionOf(uint64_t session_id,
                                                               const ucp_am_recv_param_t* param) {
  std::shared_ptr<Session> session = FindSession(session_id);
  const ucp_ep_h from = SenderOf(param);
  if (session == nullptr || from == nullptr || session->ep != from) return nullptr;
  return session;
}

void UcxTransport::CloseConnection(const std::shared_ptr<Connection>& c, bool force) {
  if (c->closed) return;
  c->closed = true;
  c->closed_at = absl::Now();
  unbound_.erase(c->ep);
  // A failed endpoint is released at once (a graceful close would flush into the failure); a
  // live one forcefully only with peer error handling on both ends (UCX's rule).
  ucx::CloseEndpoint(rt_.get(), c->ep, c->failed || (force && peer_error_handling_));
  retired_.push_back(c);
}

void UcxTransport::Refuse(const std::shared_ptr<Connection>& c, const std::string& why) {
  if (c->closed) return;
  ++connections_refused_;
  spdlog::warn("ucx: connection refused: {}", why);
  CloseConnection(c, /*force=*/true);
}

// --- Pushes ---

ucs_status_t UcxTransport::OnPushBegin(const void* header, size_t header_length, void* data,
                                       size_t length, const ucp_am_recv_param_t* param) {
  if (FromUnboundConnection(param, "PUSH_BEGIN")) return UCS_OK;
  const std::optional<wire::PushBeginHeader> h =
      wire::Decode<wire::PushBeginHeader>(header, header_length);
  if (!h) return UCS_OK;
  std::shared_ptr<Session> session = SessionOf(h->session_id, param);
  if (session == nullptr) return UCS_OK;
  auto fail = [&](absl::Status s) {
    SendPushDone(session, h->push_id, s);
    return UCS_OK;  // drops a rendezvous payload too
  };
  if (ucx::IsRendezvous(param)) {
    return fail(absl::InvalidArgumentError("PUSH_BEGIN must be sent eager"));
  }
  absl::StatusOr<wire::PushBegin> begin =
      wire::ParsePushBegin(*h, absl::string_view(static_cast<const char*>(data), length));
  if (!begin.ok()) return fail(begin.status());
  if (session->pushes.count(h->push_id) > 0) {
    return fail(absl::InvalidArgumentError(absl::StrCat("push ", h->push_id, " already open")));
  }
  if (session->pushes.size() >= static_cast<size_t>(options_.max_pushes_per_session)) {
    return fail(absl::ResourceExhaustedError(absl::StrCat("too many open pushes in one session (",
                                                          options_.max_pushes_per_session, ")")));
  }
  // The one append header every ingest carries; the engine validates it.
  const v1::AppendKvHeader append_header = AppendHeaderOfPushBegin(*h, *std::move(begin));
  auto push = std::make_shared<Push>();
  IngestOptions options;
  // Staging slots bound what a session holds; the engine's queue never needs to pause it.
  options.max_pending_chunks = static_cast<size_t>(num_slots_) + 1;
  options.max_pending_bytes = SIZE_MAX;
  options.on_end = [this, session, push](absl::StatusOr<AppendResult> r) {
    rt_->Post([this, session, push, r = std::move(r)] { OnPushEnded(session, push, r); });
  };
  absl::StatusOr<std::shared_ptr<IngestAppend>> append =
      ctx_->ingest->Begin(session->tenant, absl::StrCat("ucx-session:", session->id), append_header,
                          std::move(options));
  if (!append.ok()) return fail(append.status());
  push->id = h->push_id;
  push->append = *std::move(append);
  push->last_activity = absl::Now();
  session->pushes[push->id] = push;
  ++open_pushes_;
  return UCS_OK;
}

ucs_status_t UcxTransport::OnLayerData(const void* header, size_t header_length, void* data,
                                       size_t length, const ucp_am_recv_param_t* param) {
  if (FromUnboundConnection(param, "LAYER_DATA")) return UCS_OK;
  const bool rndv = ucx::IsRendezvous(param);
  const std::optional<wire::LayerDataHeader> h =
      wire::Decode<wire::LayerDataHeader>(header, header_length);
  if (!h) return UCS_OK;
  std::shared_ptr<Session> session = SessionOf(h->session_id, param);
  if (session == nullptr) return UCS_OK;
  auto it = session->pushes.find(h->push_id);
  if (it == session->pushes.end()) return UCS_OK;  // failed or unknown: the sender completes
  std::shared_ptr<Push> push = it->second;
  const Model& m = push->append->model();
  if (absl::Status s = wire::CheckLayerData(*h, length, m.row_values() * sizeof(Bf16), half_bytes_);
      !s.ok()) {
    FailPush(session, push, s);
    return UCS_OK;
  }
  if (session->queued >= max_inflight_) {
    FailPush(session, push,
             absl::ResourceExhaustedError(absl::StrCat(
                 "more than ", max_inflight_, " LAYER_DATA messages in flight in one session")));
    return UCS_OK;
  }
  // A chunk's second half goes into its slot at once; a first half opens a chunk on a free
  // slot, after the messages already waiting for one.
  absl::StatusOr<std::shared_ptr<Chunk>> chunk = ChunkFor(push, *h, pending_.empty());
  if (!chunk.ok()) {
    FailPush(session, push, chunk.status());
    return UCS_OK;
  }
  push->last_activity = absl::Now();
  ++push->outstanding;
  ++push->messages;
  ++session->queued;
  bytes_received_ += length;
  if (*chunk == nullptr) {
    pending_.push_back(Pending{session, push, *h, data, length, rndv});
    ++pending_count_;
    return UCS_INPROGRESS;  // kept: received when a slot frees (backpressure)
  }
  ucs_status_t ret = UCS_OK;
  StartReceive(session, push, *h, data, length, rndv, /*in_handler=*/true, *chunk, &ret);
  return ret;
}

absl::StatusOr<std::shared_ptr<UcxTransport::Chunk>> UcxTransport::ChunkFor(
    const std::shared_ptr<Push>& push, const wire::LayerDataHeader& h, bool may_open) {
  const std::pair<int, uint32_t> key{h.layer, h.token_offset};
  auto it = push->chunks.find(key);
  if (it != push->chunks.end()) {
    const Chunk& c = *it->second;
    if (c.num_tokens != h.num_tokens || c.claimed[h.tensor]) {
      return absl::InvalidArgumentError(
          absl::StrCat("LAYER_DATA of layer ", h.layer, " at token offset ", h.token_offset, ": ",
                       c.claimed[h.tensor] ? "a second message of the same tensor"
                                           : "K and V messages of different token counts"));
    }
    return it->second;
  }
  if (!may_open || free_slots_.empty()) return nullptr;
  auto c = std::make_shared<Chunk>();
  c->layer = h.layer;
  c->token_offset = h.token_offset;
  c->num_tokens = h.num_tokens;
  c->slot = free_slots_.back();
  free_slots_.pop_back();
  ++slots_in_use_;
  push->chunks[key] = c;
  return c;
}

void UcxTransport::StartReceive(const std::shared_ptr<Session>& session,
                                const std::shared_ptr<Push>& push, const wire::LayerDataHeader& h,
                                void* data, size_t length, bool rndv, bool in_handler,
                                const std::shared_ptr<Chunk>& chunk, ucs_status_t* handler_status) {
  chunk->claimed[h.tensor] = true;
  ++chunk->receiving;
  uint8_t* slot = staging_->data() + static_cast<size_t>(chunk->slot) * slot_bytes_;
  auto receive = std::make_shared<Receive>(Receive{chunk, push, false});
  session->receiving.insert(receive);
  *handler_status = ucx::ReceiveAm(
      rt_.get(), data, length, rndv, in_handler, slot + h.tensor * half_bytes_, staging_->memh(),
      [this, session, push, chunk, slot, receive](absl::Status s) {
        if (receive->abandoned) return;  // EndSession reclaimed the slot
        session->receiving.erase(receive);
        --session->queued;
        --chunk->receiving;
        if (!s.ok() || push->finished) {
          --push->outstanding;
          if (chunk->receiving == 0) ReleaseChunk(push, chunk);
          if (!s.ok()) FailPush(session, push, s);
          return;
        }
        push->last_activity = absl::Now();
        if (++chunk->landed < 2) {  // the other half is on its way
          --push->outstanding;
          return;
        }
        push->chunks.erase({chunk->layer, chunk->token_offset});
        const size_t bytes = static_cast<size_t>(chunk->num_tokens) *
                             push->append->model().row_values() * sizeof(Bf16);
        const absl::string_view k(reinterpret_cast<const char*>(slot), bytes);
        const absl::string_view v(reinterpret_cast<const char*>(slot + half_bytes_), bytes);
        (void)push->append->Stage(chunk->layer, chunk->token_offset, chunk->num_tokens, k, v,
                                  [this, session, push, chunk](absl::Status st, bool done) {
                                    rt_->Post([this, session, push, chunk, st, done] {
                                      OnChunkStaged(session, push, chunk->layer, chunk, st, done);
                                    });
                                  });
      });
}

void UcxTransport::OnChunkStaged(const std::shared_ptr<Session>& session,
                                 const std::shared_ptr<Push>& push, int layer,
                                 const std::shared_ptr<Chunk>& chunk, const absl::Status& status,
                                 bool layer_complete) {
  --push->outstanding;
  push->last_activity = absl::Now();
  ReleaseChunk(push, chunk);
  if (!status.ok()) return FailPush(session, push, status);
  if (push->finished) return;
  if (layer_complete && !session->dead) {
    wire::LayerDoneHeader d{push->id, layer, static_cast<uint32_t>(push->append->num_tokens())};
    ucx::AmMessage msg = Message(wire::Encode(d));
    msg.flags = UCP_AM_SEND_FLAG_EAGER;
    ucx::SendAm(rt_.get(), session->ep, wire::kLayerDone, std::move(msg), nullptr);
  }
  MaybeCommit(session, push);
}

void UcxTransport::ReleaseChunk(const std::shared_ptr<Push>& push,
                                const std::shared_ptr<Chunk>& chunk) {
  if (chunk->released) return;
  chunk->released = true;
  auto it = push->chunks.find({chunk->layer, chunk->token_offset});
  if (it != push->chunks.end() && it->second == chunk) push->chunks.erase(it);
  ReleaseSlot(chunk->slot);
}

void UcxTransport::ReleaseSlot(int slot) {
  free_slots_.push_back(slot);
  --slots_in_use_;
  ServePending();
}

void UcxTransport::ServePending() {
  // Not re-entered (a failure below frees slots, which serves again): another pass instead.
  if (serving_) {
    serve_again_ = true;
    return;
  }
  serving_ = true;
  do {
    serve_again_ = false;
    // Every waiting message whose chunk is open goes now (its slot waits for it); the others
    // open chunks in arrival order while slots are free.
    for (size_t i = 0; i < pending_.size();) {
      std::shared_ptr<Chunk> chunk;
      absl::Status bad;
      if (!pending_[i].session->dead && !pending_[i].push->finished) {
        absl::StatusOr<std::shared_ptr<Chunk>> c = ChunkFor(pending_[i].push, pending_[i].h, true);
        if (!c.ok()) {
          bad = c.status();
        } else if (*c == nullptr) {
          ++i;  // still no slot
          continue;
        } else {
          chunk = *std::move(c);
        }
      }
      Pending p = std::move(pending_[i]);
      pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
      --pending_count_;
      if (chunk == nullptr) {  // its session or push ended, or it does not fit its chunk
        ucx::DropAm(rt_.get(), p.data, p.rndv, /*in_handler=*/false);
        --p.push->outstanding;
        --p.session->queued;
        if (!bad.ok()) FailPush(p.session, p.push, bad);
        continue;
      }
      ucs_status_t ignored;
      StartReceive(p.session, p.push, p.h, p.data, p.length, p.rndv, /*in_handler=*/false, chunk,
                   &ignored);
    }
  } while (serve_again_);
  serving_ = false;
}

void UcxTransport::FailPush(const std::shared_ptr<Session>& session,
                            const std::shared_ptr<Push>& push, const absl::Status& why,
                            bool answer_now) {
  if (push->finished) return;
  push->finished = true;
  CountEnded(*push, /*committed=*/false);
  session->pushes.erase(push->id);
  // Chunks waiting for a half that will not be taken now free their slots; those receiving
  // free theirs when the receives end.
  std::vector<std::shared_ptr<Chunk>> waiting;
  for (const auto& [key, c] : push->chunks) {
    if (c->receiving == 0) waiting.push_back(c);
  }
  for (const std::shared_ptr<Chunk>& c : waiting) ReleaseChunk(push, c);
  if (answer_now) {
    push->answered = true;
    SendPushDone(session, push->id, why);
  }
  // Otherwise the engine's end answers, once the sequence is free again, so that the client may
  // push to it at once (OnPushEnded).
  push->append->Abort(why);
}

void UcxTransport::MaybeCommit(const std::shared_ptr<Session>& session,
                               const std::shared_ptr<Push>& push) {
  if (push->finished || !push->commit_requested || push->outstanding > 0 ||
      push->messages < push->expected_messages) {
    return;
  }
  if (!push->append->Complete()) {
    return FailPush(session, push,
                    absl::InvalidArgumentError(absl::StrCat(
                        "PUSH_COMMIT of ", push->append->sequence_id(),
                        " before every layer was sent: ", push->append->status().ToString())));
  }
  push->finished = true;
  session->pushes.erase(push->id);
  push->append->Commit();  // the engine's end answers (OnPushEnded)
}

void UcxTransport::OnPushEnded(const std::shared_ptr<Session>& session,
                               const std::shared_ptr<Push>& push,
                               const absl::StatusOr<AppendResult>& result) {
  if (!result.ok()) FailPush(session, push, result.status());
  CountEnded(*push, result.ok());
  if (push->answered || session->dead) return;
  push->answered = true;
  SendPushDone(session, push->id, result);
}

void UcxTransport::CountEnded(Push& push, bool committed) {
  if (push.counted) return;
  push.counted = true;
  --open_pushes_;
  if (committed) {
    ++pushes_committed_;
  } else {
    ++pushes_aborted_;
  }
}

void UcxTransport::SendPushDone(const std::shared_ptr<Session>& session, uint64_t push_id,
                                const absl::StatusOr<AppendResult>& result) {
  if (session->dead || session->ep == nullptr) return;
  wire::PushDoneHeader d{};
  d.push_id = push_id;
  d.status_code = static_cast<int32_t>(result.status().code());
  std::string message;
  if (result.ok()) {
    d.total_tokens = static_cast<uint32_t>(result->info.total());
    d.to_sink = static_cast<uint32_t>(result->to_sink);
    d.to_history = static_cast<uint32_t>(result->to_history);
    d.to_recent = static_cast<uint32_t>(result->to_recent);
    d.pool_bytes = result->info.pool_bytes;
  } else {
    message = std::string(result.status().message());
  }
  ucx::AmMessage msg = Message(wire::Encode(d), std::move(message));
  msg.flags = UCP_AM_SEND_FLAG_EAGER;
  ucx::SendAm(rt_.get(), session->ep, wire::kPushDone, std::move(msg), nullptr);
}

ucs_status_t UcxTransport::OnPushControl(bool commit, const void* header, size_t header_length,
                                         const ucp_am_recv_param_t* param) {
  if (FromUnboundConnection(param, commit ? "PUSH_COMMIT" : "PUSH_ABORT")) return UCS_OK;
  const std::optional<wire::PushControlHeader> h =
      wire::Decode<wire::PushControlHeader>(header, header_length);
  if (!h) return UCS_OK;
  std::shared_ptr<Session> session = SessionOf(h->session_id, param);
  if (session == nullptr) return UCS_OK;
  auto it = session->pushes.find(h->push_id);
  if (it == session->pushes.end()) {
    if (commit) {
      SendPushDone(session, h->push_id,
                   absl::NotFoundError(absl::StrCat("no open push ", h->push_id)));
    }
    return UCS_OK;
  }
  std::shared_ptr<Push> push = it->second;
  push->last_activity = absl::Now();
  if (!commit) {
    FailPush(session, push, absl::CancelledError("push aborted by the client"));
    return UCS_OK;
  }
  push->commit_requested = true;
  push->expected_messages = h->layer_messages;
  MaybeCommit(session, push);
  return UCS_OK;
}

// --- Attention ---

ucs_status_t UcxTransport::OnAttend(const void* header, size_t header_length, void* data,
                                    size_t length, const ucp_am_recv_param_t* param) {
  if (FromUnboundConnection(param, "ATTEND")) return UCS_OK;
  const std::optional<wire::AttendHeader> h =
      wire::Decode<wire::AttendHeader>(header, header_length);
  if (!h) return UCS_OK;
  std::shared_ptr<Session> session = SessionOf(h->session_id, param);
  if (session == nullptr) return UCS_OK;
  // Checked before the payload is received: its length is the peer's claim.
  if (absl::Status s = wire::CheckAttendHeader(
          *h, length, static_cast<uint32_t>(ctx_->config->max_attention_batch),
          ctx_->config->max_message_bytes);
      !s.ok()) {
    SendAttendError(session, h->call_id, s);
    return ucx::DropAm(rt_.get(), data, ucx::IsRendezvous(param), /*in_handler=*/true);
  }
  auto payload = std::make_shared<std::string>(length, '\0');
  const wire::AttendHeader hdr = *h;
  return ucx::ReceiveAm(rt_.get(), data, length, ucx::IsRendezvous(param), /*in_handler=*/true,
                        payload->data(), nullptr, [this, session, hdr, payload](absl::Status s) {
                          if (!s.ok()) return SendAttendError(session, hdr.call_id, s);
                          RunAttention(session, hdr, *payload);
                        });
}

void UcxTransport::RunAttention(const std::shared_ptr<Session>& session,
                                const wire::AttendHeader& h, const std::string& payload) {
  std::shared_ptr<const Model> model;
  absl::StatusOr<wire::AttendPayload> parsed =
      wire::ParseAttend(h, payload, [&](const std::string& model_id) -> absl::StatusOr<size_t> {
        absl::StatusOr<std::shared_ptr<const Model>> m =
            ctx_->registry->Get(session->tenant, model_id);
        if (!m.ok()) return m.status();
        model = *std::move(m);
        return static_cast<size_t>(model->q_heads) * model->head_dim;
      });
  if (!parsed.ok()) return SendAttendError(session, h.call_id, parsed.status());
  // The parsed queries, one after the other in the buffer the backend reads.
  AttentionRequest request;
  size_t values = 0;
  for (const wire::AttendQuery& q : parsed->queries) values += q.q.size();
  request.queries.reserve(values);
  for (wire::AttendQuery& q : parsed->queries) {
    request.sequence_ids.push_back(std::move(q.sequence_id));
    request.num_queries.push_back(static_cast<int>(q.num_queries));
    request.queries.insert(request.queries.end(), q.q.begin(), q.q.end());
  }
  ++attention_calls_;
  ctx_->counters.attention_calls++;
  ctx_->counters.attention_sequences += h.batch;
  const uint64_t call_id = h.call_id;
  std::vector<int> num_queries = request.num_queries;
  absl::Status started = ctx_->attention->Start(
      session->tenant, model, h.layer, std::move(request),
      [this, session, call_id, model,
       num_queries = std::move(num_queries)](absl::StatusOr<AttentionAnswer> answer) {
        if (!answer.ok()) {
          absl::Status st = answer.status();
          rt_->Post([this, session, call_id, st] { SendAttendError(session, call_id, st); });
          return;
        }
        wire::AttendDoneHeader d{};
        d.call_id = call_id;
        d.status_code = 0;
        d.batch = static_cast<uint32_t>(num_queries.size());
        d.q_heads = static_cast<uint32_t>(model->q_heads);
        d.head_dim = static_cast<uint32_t>(model->head_dim);
        // The metas, then every output and every LSE: the answer's buffers as they are.
        std::string payload;
        payload.reserve(num_queries.size() * sizeof(wire::SequenceResultMeta) +
                        (answer->out.size() + answer->lse.size()) * sizeof(float));
        for (size_t i = 0; i < num_queries.size(); ++i) {
          wire::SequenceResultMeta m{static_cast<uint32_t>(answer->attended_tokens[i]),
                                     static_cast<uint32_t>(num_queries[i])};
          payload.append(reinterpret_cast<const char*>(&m), sizeof(m));
        }
        payload.append(reinterpret_cast<const char*>(answer->out.data()),
                       answer->out.size() * sizeof(float));
        payload.append(reinterpret_cast<const char*>(answer->lse.data()),
                       answer->lse.size() * sizeof(float));
        rt_->Post([this, session, d, payload = std::move(payload)]() mutable {
          if (session->dead) return;
          ucx::SendAm(rt_.get(), session->ep, wire::kAttendDone,
                      Message(wire::Encode(d), std::move(payload)), nullptr);
        });
      },
      // The client has no per-call cancel on this plane: its session ending (closed, its
      // process gone, its endpoint failed) is what cancels the work it asked for.
      std::make_shared<CallCancellation>(
          absl::InfiniteFuture(), [session] { return session->dead.load(); },
          &ctx_->counters.cancellation));
  if (!started.ok()) SendAttendError(session, call_id, started);
}

void UcxTransport::SendAttendError(const std::shared_ptr<Session>& session, uint64_t call_id,
                                   const absl::Status& status) {
  if (session->dead) return;
  wire::AttendDoneHeader d{};
  d.call_id = call_id;
  d.status_code = static_cast<int32_t>(status.code());
  ucx::AmMessage msg = Message(wire::Encode(d), std::string(status.message()));
  msg.flags = UCP_AM_SEND_FLAG_EAGER;
  ucx::SendAm(rt_.get(), session->ep, wire::kAttendDone, std::move(msg), nullptr);
}

// --- Sessions and time ---

void UcxTransport::EndSession(const std::shared_ptr<Session>& session, const absl::Status& why,
                              bool force, bool peer_gone, bool closed) {
  if (session->dead) return;
  std::vector<std::shared_ptr<Push>> pushes;
  for (auto& [id, p] : session->pushes) pushes.push_back(p);
  // A graceful end tells the client why its pushes failed; after a peer error nothing is sent.
  if (force) session->dead = true;
  // (After a graceful end the answer cannot wait for the rollback: the endpoint closes now.)
  for (auto& p : pushes) FailPush(session, p, why, /*answer_now=*/!force);
  session->dead = true;
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (it->session != session) {
      ++it;
      continue;
    }
    ucx::DropAm(rt_.get(), it->data, it->rndv, /*in_handler=*/false);
    --it->push->outstanding;
    --session->queued;
    --pending_count_;
    it = pending_.erase(it);
  }
  if (peer_gone) {
    std::set<std::shared_ptr<Receive>> receiving;
    receiving.swap(session->receiving);
    for (const std::shared_ptr<Receive>& r : receiving) {
      r->abandoned = true;
      --r->push->outstanding;
      --session->queued;
      --r->chunk->receiving;
      ReleaseChunk(r->push, r->chunk);
    }
  }
  if (session->connection != nullptr) {
    if (peer_gone) session->connection->failed = true;  // nothing answers a graceful close
    CloseConnection(session->connection, force);
  }
  session->ep = nullptr;
  session->ended = absl::Now();
  (void)sessions_.EndAny(session->id, closed ? absl::OkStatus() : why);
  ended_.push_back(session);
  spdlog::info("ucx: session {:x} ended: {}", session->id, why.ToString());
}

void UcxTransport::OnTick() {
  const absl::Time now = absl::Now();
  while (!ended_.empty() && now - ended_.front()->ended > absl::Seconds(60)) {
    ended_.erase(ended_.begin());
  }
  while (!retired_.empty() && now - retired_.front()->closed_at > absl::Seconds(60)) {
    retired_.pop_front();
  }
  std::vector<std::shared_ptr<Connection>> silent;
  for (auto& [ep, c] : unbound_) {
    if (now - c->accepted > options_.hello_timeout) silent.push_back(c);
  }
  const std::string hello_limit =
      absl::StrCat(absl::ToInt64Milliseconds(options_.hello_timeout), " ms");
  for (auto& c : silent) Refuse(c, "no HELLO within " + hello_limit);
  std::vector<std::pair<std::shared_ptr<Session>, std::shared_ptr<Push>>> idle;
  std::vector<std::shared_ptr<Session>> stuck, gone;
  std::vector<std::shared_ptr<Session>> unconnected;
  for (const std::shared_ptr<Session>& s : sessions_.All()) {
    if (s->watch && ucx::ProcessGone(s->peer)) {
      gone.push_back(s);
      continue;
    }
    if (s->connection == nullptr) {
      if (now - s->created > options_.hello_timeout) unconnected.push_back(s);
      continue;
    }
    for (auto& [pid, p] : s->pushes) {
      if (p->finished) continue;
      const absl::Duration quiet = now - p->last_activity;
      // Idle: nothing of it in flight for idle_timeout, or only messages that have waited for
      // staging or for a missing earlier chunk for twice that.
      if ((p->outstanding == 0 && quiet > options_.idle_timeout) ||
          (s->receiving.empty() && quiet > 2 * options_.idle_timeout)) {
        idle.emplace_back(s, p);
      } else if (!s->receiving.empty() && quiet > 2 * options_.idle_timeout) {
        // Receives from this peer that never finish: the peer is unhealthy.
        stuck.push_back(s);
        break;
      }
    }
  }
  const std::string limit = absl::StrCat(absl::ToInt64Milliseconds(options_.idle_timeout), " ms");
  for (auto& [s, p] : idle) {
    ++timeouts_;
    FailPush(s, p, absl::DeadlineExceededError("push made no progress for " + limit));
  }
  for (auto& s : gone) {
    ++peer_errors_;
    spdlog::warn("ucx: session {:x}: client process {} exited; rolling back its pushes", s->id,
                 s->peer.pid);
    EndSession(s, absl::UnavailableError(absl::StrCat("client process ", s->peer.pid, " exited")),
               /*force=*/true, /*peer_gone=*/true);
  }
  for (auto& s : unconnected) {
    ++timeouts_;
    EndSession(s, absl::DeadlineExceededError("no UCX connection within " + hello_limit),
               /*force=*/false);
  }
  for (auto& s : stuck) {
    ++timeouts_;
    EndSession(s, absl::DeadlineExceededError("UCX receives made no progress for 2 x " + limit),
               /*force=*/true);
  }
}

}  // namespace kvpool::server
