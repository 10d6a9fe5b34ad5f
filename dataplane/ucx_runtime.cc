#include "dataplane/ucx_runtime.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"

namespace kvpool::ucx {

absl::Status UcsStatus(ucs_status_t status, absl::string_view what) {
  if (status == UCS_OK) return absl::OkStatus();
  const std::string msg = absl::StrCat(what, ": ", ucs_status_string(status));
  switch (status) {
    case UCS_ERR_CANCELED:
      return absl::CancelledError(msg);
    case UCS_ERR_TIMED_OUT:
    case UCS_ERR_ENDPOINT_TIMEOUT:
      return absl::DeadlineExceededError(msg);
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT:
      return absl::ResourceExhaustedError(msg);
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_REJECTED:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_NO_DEVICE:
    case UCS_ERR_UNSUPPORTED:
      return absl::UnavailableError(msg);
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
      return absl::InvalidArgumentError(msg);
    default:
      return absl::InternalError(msg);
  }
}

namespace {

// ucp_config_t, released on scope exit.
class UcpConfig {
 public:
  explicit UcpConfig(ucp_config_t* c) : c_(c) {}
  ~UcpConfig() {
    if (c_ != nullptr) ucp_config_release(c_);
  }
  ucp_config_t* get() const { return c_; }

 private:
  ucp_config_t* c_;
};

absl::Status SetConfig(ucp_config_t* config, const char* name, const std::string& value) {
  if (value.empty()) return absl::OkStatus();
  ucs_status_t s = ucp_config_modify(config, name, value.c_str());
  if (s != UCS_OK) {
    return absl::InvalidArgumentError(
        absl::StrCat("UCX ", name, "=", value, ": ", ucs_status_string(s)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<UcxRuntime>> UcxRuntime::Create(const UcxRuntimeOptions& options) {
  auto rt = std::unique_ptr<UcxRuntime>(new UcxRuntime());
  rt->options_ = options;
  ucp_config_t* raw_config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &raw_config);
  if (s != UCS_OK) return UcsStatus(s, "ucp_config_read");
  UcpConfig config(raw_config);
  const char* env_tls = std::getenv("UCX_TLS");
  rt->transports_ = !options.tls.empty() ? options.tls : (env_tls != nullptr ? env_tls : "all");
  if (absl::Status st = SetConfig(config.get(), "TLS", ClientServerTls(rt->transports_));
      !st.ok()) {
    return st;
  }
  if (absl::Status st = SetConfig(config.get(), "NET_DEVICES", options.net_devices); !st.ok()) {
    return st;
  }
  // Endpoint and request ids in UCX's wire headers (a REPLY-flagged active message, a
  // rendezvous) are looked up in a map, not taken as pointers: by default UCX 1.13 uses raw
  // pointers for endpoints without peer error handling (shared memory), and a message naming an
  // endpoint closed meanwhile, or any id a hostile peer makes up, would be dereferenced (the
  // process aborted on "Assertion `(*ep_p)->worker == worker'" in ucp_am_handler_reply).
  if (absl::Status st = SetConfig(config.get(), "PROTO_INDIRECT_ID", "on"); !st.ok()) return st;
  const std::string keepalive = absl::StrCat(absl::ToInt64Milliseconds(options.keepalive), "ms");
  if (absl::Status st = SetConfig(config.get(), "KEEPALIVE_INTERVAL", keepalive); !st.ok()) {
    return st;
  }

  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.name = options.name.c_str();
  s = ucp_init(&params, config.get(), &rt->context_);
  if (s != UCS_OK) return UcsStatus(s, "ucp_init");

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  s = ucp_worker_create(rt->context_, &wp, &rt->worker_);
  if (s != UCS_OK) return UcsStatus(s, "ucp_worker_create");

  s = ucp_worker_get_efd(rt->worker_, &rt->ucp_fd_);
  if (s != UCS_OK) return UcsStatus(s, "ucp_worker_get_efd");
  rt->wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  rt->epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (rt->wake_fd_ < 0 || rt->epoll_fd_ < 0) {
    return absl::InternalError(absl::StrCat("eventfd/epoll: ", std::strerror(errno)));
  }
  for (int fd : {rt->ucp_fd_, rt->wake_fd_}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (epoll_ctl(rt->epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
      return absl::InternalError(absl::StrCat("epoll_ctl: ", std::strerror(errno)));
    }
  }
  return rt;
}

UcxRuntime::~UcxRuntime() {
  Stop();
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
  if (epoll_fd_ >= 0) close(epoll_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

absl::Status UcxRuntime::SetAmHandler(uint16_t id, AmHandler handler) {
  if (started_) return absl::FailedPreconditionError("SetAmHandler after Start");
  handlers_.push_back(std::make_unique<HandlerSlot>(HandlerSlot{this, std::move(handler)}));
  ucp_am_handler_param_t p{};
  p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                 UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  p.id = id;
  p.flags = UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA;
  p.cb = &UcxRuntime::AmTrampoline;
  p.arg = handlers_.back().get();
  return UcsStatus(ucp_worker_set_am_recv_handler(worker_, &p), "ucp_worker_set_am_recv_handler");
}

ucs_status_t UcxRuntime::AmTrampoline(void* arg, const void* header, size_t header_length,
                                      void* data, size_t length, const ucp_am_recv_param_t* param) {
  auto* slot = static_cast<HandlerSlot*>(arg);
  return slot->handler(header, header_length, data, length, param);
}

void UcxRuntime::Start(std::function<void()> on_tick) {
  if (started_) return;
  started_ = true;
  on_tick_ = std::move(on_tick);
  thread_ = std::thread([this] { Loop(); });
}

bool UcxRuntime::Post(std::function<void()> fn) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return false;
    posted_.push_back(std::move(fn));
  }
  // The loop sees the flag before it sleeps, or this sees it asleep and wakes it (both seq_cst):
  // no eventfd write per post while the loop polls.
  has_posted_.store(true);
  if (sleeping_.load()) Wake();
  return true;
}

absl::Status UcxRuntime::RunSync(std::function<void()> fn) {
  if (OnProgressThread() || !started_) {  // no thread yet: this thread owns the worker
    fn();
    return absl::OkStatus();
  }
  absl::Notification done;
  if (!Post([&] {
        fn();
        done.Notify();
      })) {
    return absl::UnavailableError("UCX runtime stopped");
  }
  done.WaitForNotification();
  return absl::OkStatus();
}

bool UcxRuntime::OnProgressThread() const {
  return thread_id_.load() == std::this_thread::get_id();
}

void UcxRuntime::Wake() {
  const uint64_t one = 1;
  ssize_t n = write(wake_fd_, &one, sizeof(one));
  (void)n;  // a full counter still wakes the loop
}

bool UcxRuntime::RunPosted() {
  if (!has_posted_.exchange(false)) return false;  // no lock per poll
  std::vector<std::function<void()>> batch;
  {
    absl::MutexLock lock(&mu_);
    batch.swap(posted_);
  }
  for (auto& fn : batch) fn();
  return !batch.empty();
}

void UcxRuntime::Loop() {
  thread_id_.store(std::this_thread::get_id());
  // "ucx:<name>" (at most 15 characters) in top, perf and gdb.
  pthread_setname_np(pthread_self(), ("ucx:" + options_.name).substr(0, 15).c_str());
  absl::Time last_activity = absl::Now();
  absl::Time next_tick = last_activity + options_.tick;
  const int tick_ms =
      static_cast<int>(std::max<int64_t>(1, absl::ToInt64Milliseconds(options_.tick)));
  while (!stop_.load()) {
    bool busy = RunPosted();
    while (ucp_worker_progress(worker_) != 0) busy = true;
    const absl::Time now = absl::Now();
    if (now >= next_tick) {
      if (on_tick_) on_tick_();
      next_tick = now + options_.tick;
    }
    if (busy) {
      last_activity = now;
      continue;
    }
    if (now - last_activity < options_.spin) {
      // Poll on, but let a runnable thread (a codec worker) have the core first: on a machine
      // with few cores a spinning progress thread otherwise takes time from the work it waits
      // for.
      std::this_thread::yield();
      continue;
    }
    sleeping_.store(true);
    if (has_posted_.load() || ucp_worker_arm(worker_) == UCS_ERR_BUSY) {
      sleeping_.store(false);
      continue;
    }
    epoll_event events[2];
    epoll_wait(epoll_fd_, events, 2, tick_ms);
    sleeping_.store(false);
    uint64_t counter = 0;
    ssize_t n = read(wake_fd_, &counter, sizeof(counter));
    (void)n;
  }
  // Drain: run what was posted before Stop and let closing endpoints finish.
  const absl::Time until = absl::Now() + drain_;
  has_posted_.store(true);
  do {
    RunPosted();
    while (ucp_worker_progress(worker_) != 0) {
    }
  } while (absl::Now() < until);
  has_posted_.store(true);  // whatever a late Post left, whether or not it set the flag yet
  RunPosted();
}

void UcxRuntime::Stop(absl::Duration drain) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  drain_ = drain;
  stop_.store(true);
  Wake();
  if (thread_.joinable()) thread_.join();
}

// --- Helpers ---

namespace {

void ErrorTrampoline(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* fn = static_cast<std::function<void(ucs_status_t)>*>(arg);
  if (fn != nullptr && *fn) (*fn)(status);
}

struct SendOp {
  AmMessage msg;
  std::vector<ucp_dt_iov_t> iov;
  std::function<void(absl::Status)> done;
};

void SendCallback(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<SendOp*>(user_data);
  auto done = std::move(op->done);
  delete op;
  ucp_request_free(request);
  if (done) done(UcsStatus(status, "UCX send"));
}

struct RecvOp {
  std::function<void(absl::Status)> done;
};

void RecvCallback(void* request, ucs_status_t status, size_t /*length*/, void* user_data) {
  auto* op = static_cast<RecvOp*>(user_data);
  auto done = std::move(op->done);
  delete op;
  ucp_request_free(request);
  if (done) done(UcsStatus(status, "UCX receive"));
}

}  // namespace

namespace {

// `host`:`port` as socket addresses (numeric hosts are not looked up); `passive`: for binding
// ("" = every address).
absl::StatusOr<std::vector<sockaddr_storage>> Resolve(const std::string& host, uint16_t port,
                                                      bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  const int rc =
      getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found);
  if (rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve '", host, "': ", gai_strerror(rc)));
  }
  std::vector<sockaddr_storage> out;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_addrlen > sizeof(sockaddr_storage)) continue;
    if (a->ai_family != AF_INET && a->ai_family != AF_INET6) continue;
    sockaddr_storage ss{};
    std::memcpy(&ss, a->ai_addr, a->ai_addrlen);
    out.push_back(ss);
  }
  freeaddrinfo(found);
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat("no address for '", host, "'"));
  return out;
}

socklen_t SockaddrLength(const sockaddr_storage& ss) {
  return ss.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
}

void SetErrorHandling(ucp_ep_params_t* p, bool peer_error_handling,
                      std::function<void(ucs_status_t)>* on_error) {
  p->field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  p->err_mode = peer_error_handling ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  p->err_handler.cb = &ErrorTrampoline;
  p->err_handler.arg = on_error;
}

}  // namespace

absl::StatusOr<std::unique_ptr<UcxListener>> UcxListener::Create(UcxRuntime* rt,
                                                                 const std::string& host,
                                                                 uint16_t port,
                                                                 RequestHandler on_request) {
  absl::StatusOr<std::vector<sockaddr_storage>> addresses = Resolve(host, port, /*passive=*/true);
  if (!addresses.ok()) return addresses.status();
  auto l = std::unique_ptr<UcxListener>(new UcxListener());
  l->on_request_ = std::move(on_request);
  sockaddr_storage& bind_to = addresses->front();
  ucp_listener_params_t p{};
  p.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&bind_to);
  p.sockaddr.addrlen = SockaddrLength(bind_to);
  p.conn_handler.cb = &UcxListener::OnRequest;
  p.conn_handler.arg = l.get();
  ucs_status_t s = ucp_listener_create(rt->worker(), &p, &l->listener_);
  if (s != UCS_OK) {
    l->listener_ = nullptr;
    return absl::UnavailableError(
        absl::StrCat("UCX listener on '", host, "' port ", port, ": ", ucs_status_string(s)));
  }
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  s = ucp_listener_query(l->listener_, &attr);
  if (s != UCS_OK) return UcsStatus(s, "ucp_listener_query");
  char text[INET6_ADDRSTRLEN] = {0};
  if (attr.sockaddr.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&attr.sockaddr);
    inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof(text));
    l->port_ = ntohs(a->sin6_port);
  } else {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&attr.sockaddr);
    inet_ntop(AF_INET, &a->sin_addr, text, sizeof(text));
    l->port_ = ntohs(a->sin_port);
  }
  l->host_ = text;
  return l;
}

UcxListener::~UcxListener() {
  if (listener_ != nullptr) ucp_listener_destroy(listener_);
}

void UcxListener::OnRequest(ucp_conn_request_h request, void* arg) {
  auto* l = static_cast<UcxListener*>(arg);
  if (l->on_request_) {
    l->on_request_(request);
  } else {
    l->Reject(request);
  }
}

void UcxListener::Reject(ucp_conn_request_h request) {
  (void)ucp_listener_reject(listener_, request);  // fails only for a listener being destroyed
}

bool IsWildcardHost(absl::string_view host) {
  return host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]";
}

absl::StatusOr<ucp_ep_h> AcceptConnection(UcxRuntime* rt, ucp_conn_request_h request,
                                          bool peer_error_handling,
                                          std::function<void(ucs_status_t)>* on_error) {
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST;
  p.conn_request = request;
  SetErrorHandling(&p, peer_error_handling, on_error);
  ucp_ep_h ep = nullptr;
  ucs_status_t s = ucp_ep_create(rt->worker(), &p, &ep);
  if (s != UCS_OK) return UcsStatus(s, "ucp_ep_create (connection request)");
  return ep;
}

absl::StatusOr<ucp_ep_h> ConnectToListener(UcxRuntime* rt, const std::string& host, uint16_t port,
                                           bool peer_error_handling,
                                           std::function<void(ucs_status_t)>* on_error) {
  if (port == 0) return absl::InvalidArgumentError("UCX listener port 0");
  absl::StatusOr<std::vector<sockaddr_storage>> addresses = Resolve(host, port, /*passive=*/false);
  if (!addresses.ok()) return addresses.status();
  const sockaddr_storage& to = addresses->front();
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
  p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&to);
  p.sockaddr.addrlen = SockaddrLength(to);
  SetErrorHandling(&p, peer_error_handling, on_error);
  ucp_ep_h ep = nullptr;
  ucs_status_t s = ucp_ep_create(rt->worker(), &p, &ep);
  if (s != UCS_OK) return UcsStatus(s, "ucp_ep_create (client-server)");
  return ep;
}

void CloseEndpoint(UcxRuntime* /*rt*/, ucp_ep_h ep, bool force) {
  if (ep == nullptr) return;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t req = ucp_ep_close_nbx(ep, &p);
  if (UCS_PTR_IS_PTR(req)) ucp_request_free(req);  // UCX finishes closing on its own
}

void SendAm(UcxRuntime* /*rt*/, ucp_ep_h ep, uint16_t id, AmMessage msg,
            std::function<void(absl::Status)> done) {
  auto* op = new SendOp{std::move(msg), {}, std::move(done)};
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                   UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = &SendCallback;
  p.user_data = op;
  p.flags = op->msg.flags;
  const void* buffer = nullptr;
  size_t count = 0;
  if (op->msg.borrowed.size() == 1) {
    p.datatype = ucp_dt_make_contig(1);
    buffer = op->msg.borrowed[0].first;
    count = op->msg.borrowed[0].second;
    if (op->msg.memh != nullptr) {
      p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      p.memh = op->msg.memh;
    }
  } else if (!op->msg.borrowed.empty()) {
    for (const auto& [ptr, len] : op->msg.borrowed) {
      op->iov.push_back(ucp_dt_iov_t{const_cast<void*>(ptr), len});
    }
    p.datatype = ucp_dt_make_iov();
    buffer = op->iov.data();
    count = op->iov.size();
  } else {
    p.datatype = ucp_dt_make_contig(1);
    buffer = op->msg.payload.empty() ? nullptr : op->msg.payload.data();
    count = op->msg.payload.size();
  }
  ucs_status_ptr_t req =
      ucp_am_send_nbx(ep, id, op->msg.header.data(), op->msg.header.size(), buffer, count, &p);
  if (UCS_PTR_IS_PTR(req)) return;  // SendCallback finishes it
  auto d = std::move(op->done);
  delete op;
  if (d) d(UcsStatus(UCS_PTR_STATUS(req), "UCX send"));
}

ucs_status_t ReceiveAm(UcxRuntime* rt, void* data, size_t length, bool rndv, bool in_handler,
                       void* dst, ucp_mem_h memh, std::function<void(absl::Status)> done) {
  if (!rndv) {
    if (length > 0) std::memcpy(dst, data, length);
    if (!in_handler) ucp_am_data_release(rt->worker(), data);
    if (done) done(absl::OkStatus());
    return UCS_OK;
  }
  auto* op = new RecvOp{std::move(done)};
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  p.cb.recv_am = &RecvCallback;
  p.user_data = op;
  p.datatype = ucp_dt_make_contig(1);
  if (memh != nullptr) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    p.memh = memh;
  }
  ucs_status_ptr_t req = ucp_am_recv_data_nbx(rt->worker(), data, dst, length, &p);
  if (!UCS_PTR_IS_PTR(req)) {
    auto d = std::move(op->done);
    delete op;
    if (d) d(UcsStatus(UCS_PTR_STATUS(req), "UCX receive"));
  }
  return UCS_INPROGRESS;
}

ucs_status_t DropAm(UcxRuntime* rt, void* data, bool /*rndv*/, bool in_handler) {
  if (!in_handler) ucp_am_data_release(rt->worker(), data);
  return UCS_OK;
}

bool SharedMemoryOnly(absl::string_view tls) {
  if (tls.empty()) return false;
  for (absl::string_view t : absl::StrSplit(tls, ',')) {
    if (t != "posix" && t != "sysv" && t != "cma" && t != "knem" && t != "xpmem" && t != "sm" &&
        t != "shm" && t != "self" && t != "mm") {
      return false;
    }
  }
  return true;
}

std::string ClientServerTls(absl::string_view tls) {
  if (!SharedMemoryOnly(tls)) return std::string(tls);
  return absl::StrCat(tls, ",tcp");
}

namespace {

std::string ReadFirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// Field 22 of /proc/PID/stat (after the parenthesized command, which may hold spaces); 0 when
// the process does not exist or has exited (zombie).
uint64_t StartTime(uint32_t pid) {
  const std::string stat = ReadFirstLine(absl::StrCat("/proc/", pid, "/stat"));
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return 0;
  std::vector<absl::string_view> f =
      absl::StrSplit(absl::string_view(stat).substr(close + 1), ' ', absl::SkipEmpty());
  // f[0] is field 3 (state; a zombie has exited); field 22 is f[19].
  uint64_t t = 0;
  if (f.size() < 20 || f[0] == "Z" || f[0] == "X" || !absl::SimpleAtoi(f[19], &t)) return 0;
  return t;
}

}  // namespace

ProcessIdentity SelfProcess() {
  ProcessIdentity p;
  p.boot_id = ReadFirstLine("/proc/sys/kernel/random/boot_id");
  p.pid = static_cast<uint32_t>(getpid());
  p.start_time = StartTime(p.pid);
  return p;
}

bool CanWatch(const ProcessIdentity& p) {
  static const std::string self_boot = SelfProcess().boot_id;
  return p.pid != 0 && p.start_time != 0 && !p.boot_id.empty() && p.boot_id == self_boot &&
         StartTime(p.pid) == p.start_time;
}

bool ProcessGone(const ProcessIdentity& p) { return StartTime(p.pid) != p.start_time; }

absl::StatusOr<std::unique_ptr<UcxMemory>> UcxMemory::Allocate(ucp_context_h context,
                                                               size_t bytes) {
  auto m = std::unique_ptr<UcxMemory>(new UcxMemory());
  m->context_ = context;
  m->size_ = bytes;
  void* p = nullptr;
  if (posix_memalign(&p, 4096, bytes) != 0) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " staging bytes"));
  }
  m->data_ = static_cast<uint8_t*>(p);
  std::memset(m->data_, 0, bytes);  // fault the pages in before registering
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = m->data_;
  mp.length = bytes;
  ucs_status_t s = ucp_mem_map(context, &mp, &m->memh_);
  if (s != UCS_OK) {
    m->memh_ = nullptr;
    return UcsStatus(s, "ucp_mem_map");
  }
  return m;
}

UcxMemory::~UcxMemory() {
  if (memh_ != nullptr) ucp_mem_unmap(context_, memh_);
  std::free(data_);
}

}  // namespace kvpool::ucx
