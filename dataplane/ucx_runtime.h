// UcxRuntime: a ucp context and worker driven by one progress thread, shared by the daemon's UCX
// transport (ucx_transport.h) and the client's data channel (client/transport/ucx_channel.h).
//
// Every ucp call on the worker happens on the progress thread: other threads hand it work with
// Post(). The thread polls the worker while there is traffic and for a short spin after it, then
// arms the worker and sleeps on its event file descriptor (UCP_FEATURE_WAKEUP), so an idle
// runtime uses no CPU. Active-message handlers, send and receive completions and `on_tick`
// (a few times a second, for timeouts) all run on the progress thread.
//
//   UcxRuntimeOptions options;
//   options.tls = "posix,sysv,cma";                      // UCX_TLS for this runtime only
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<UcxRuntime> rt, UcxRuntime::Create(options));
//   rt->SetAmHandler(kMyId, [](const void* hdr, size_t hdr_len, void* data, size_t len,
//                              const ucp_am_recv_param_t* param) { return UCS_OK; });
//   rt->Start([] { /* timeouts */ });
//   rt->Post([&] { SendAm(rt.get(), ep, kMyId, header, payload, [](absl::Status s) {}); });
//
// Endpoints are made only by UCX's client-server path: the daemon runs a UcxListener on a TCP
// address and accepts its connection requests (AcceptConnection), a client connects to that
// address (ConnectToListener). No peer's packed worker address is ever handed to UCX: UCX 1.13
// asserts (aborts the process) on a malformed one.
//
// Thread-safety: Post, OnProgressThread and transports() are thread-safe; the helpers below
// (listener, endpoints, sends, receives) must run on the progress thread.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvpool::ucx {

// A ucs_status_t as an absl::Status: UNAVAILABLE for peer and connection failures, DEADLINE_-
// EXCEEDED for timeouts, CANCELLED, RESOURCE_EXHAUSTED for no memory/resources, INTERNAL else.
absl::Status UcsStatus(ucs_status_t status, absl::string_view what);

struct UcxRuntimeOptions {
  // UCX_TLS and UCX_NET_DEVICES for this runtime; "" keeps the environment's (or UCX's default).
  std::string tls;
  std::string net_devices;
  // UCX keepalive on endpoints with peer error handling: how fast a dead peer is noticed.
  absl::Duration keepalive = absl::Seconds(1);
  // Busy-poll this long after the last activity before sleeping (latency vs CPU).
  absl::Duration spin = absl::Microseconds(100);
  // How often on_tick runs.
  absl::Duration tick = absl::Milliseconds(100);
  // Worker name in UCX logs.
  std::string name = "kvpool";
};

class UcxRuntime {
 public:
  // The handler of one active-message id: ucp_am_recv_callback_t's arguments. Return UCS_OK,
  // or UCS_INPROGRESS to keep `data` (then ucp_am_recv_data_nbx or ucp_am_data_release it).
  using AmHandler = std::function<ucs_status_t(const void* header, size_t header_length, void* data,
                                               size_t length, const ucp_am_recv_param_t* param)>;

  // Creates the context and worker. Unavailable when UCX cannot start with these options (no
  // usable transport).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<UcxRuntime>> Create(
      const UcxRuntimeOptions& options);
  // Stops the thread, then destroys the worker and the context. Endpoints must be closed first
  // (by their owners, on the progress thread).
  ~UcxRuntime();
  UcxRuntime(const UcxRuntime&) = delete;
  UcxRuntime& operator=(const UcxRuntime&) = delete;

  ucp_context_h context() const { return context_; }
  ucp_worker_h worker() const { return worker_; }
  // The transports it was configured with (options.tls, else UCX_TLS, else "all"). UCX itself
  // runs with ClientServerTls of them.
  const std::string& transports() const { return transports_; }

  // Registers the handler of active-message `id`; before Start only. Every message is delivered
  // with persistent data (UCP_AM_FLAG_PERSISTENT_DATA) when it is not a rendezvous.
  [[nodiscard]] absl::Status SetAmHandler(uint16_t id, AmHandler handler);
  // Starts the progress thread.
  void Start(std::function<void()> on_tick = nullptr);
  // Runs `fn` on the progress thread soon, in posting order. False (fn dropped) once stopped.
  bool Post(std::function<void()> fn);
  // Runs `fn` on the progress thread and waits for it (inline when called from it, or before
  // Start). Unavailable once stopped.
  [[nodiscard]] absl::Status RunSync(std::function<void()> fn);
  bool OnProgressThread() const;
  // Runs what is posted, progresses the worker for up to `drain` so closing endpoints finish,
  // then stops the thread. Idempotent.
  void Stop(absl::Duration drain = absl::Milliseconds(200));

 private:
  struct HandlerSlot {
    UcxRuntime* runtime = nullptr;
    AmHandler handler;
  };
  UcxRuntime() = default;
  static ucs_status_t AmTrampoline(void* arg, const void* header, size_t header_length, void* data,
                                   size_t length, const ucp_am_recv_param_t* param);
  void Loop();
  bool RunPosted();
  void Wake();

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string transports_;
  UcxRuntimeOptions options_;
  int ucp_fd_ = -1;
  int wake_fd_ = -1;
  int epoll_fd_ = -1;
  std::vector<std::unique_ptr<HandlerSlot>> handlers_;
  std::function<void()> on_tick_;
  std::thread thread_;
  std::atomic<std::thread::id> thread_id_{};
  absl::Mutex mu_;
  std::vector<std::function<void()>> posted_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> has_posted_{false};  // posted_ may be non-empty
  std::atomic<bool> sleeping_{false};    // the loop is (about to be) in epoll_wait
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool started_ = false;
  std::atomic<bool> stop_{false};
  absl::Duration drain_ = absl::ZeroDuration();
};

// --- Helpers: progress thread only ---

// A ucp listener: UCX's client-server connection path (a TCP socket run by UCX's tcp connection
// manager). Each connection request goes to `on_request` on the progress thread, which must
// answer it with AcceptConnection or Reject. Created and destroyed on the progress thread (or
// before Start).
//
// UCX 1.13.1 asserts (aborts the process) when a connection to this port sends bytes that do
// not follow its connection manager's framing (uct_tcp_sockcm_ep_recv: a private-data header
// announcing fewer bytes than arrive): see server/transport/README.md, "Security".
class UcxListener {
 public:
  using RequestHandler = std::function<void(ucp_conn_request_h)>;
  // Listens on `host` (an IP address or a name resolved here; "" = every address) and `port`
  // (0 = a free one). Unavailable when the address cannot be bound, InvalidArgument when it
  // does not resolve.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<UcxListener>> Create(
      UcxRuntime* rt, const std::string& host, uint16_t port, RequestHandler on_request);
  ~UcxListener();
  UcxListener(const UcxListener&) = delete;
  UcxListener& operator=(const UcxListener&) = delete;

  // The bound address: an IP literal ("0.0.0.0" or "::" when listening on every address) and
  // port.
  const std::string& host() const { return host_; }
  uint16_t port() const { return port_; }
  // Refuses a request without creating an endpoint.
  void Reject(ucp_conn_request_h request);

 private:
  UcxListener() = default;
  static void OnRequest(ucp_conn_request_h request, void* arg);
  ucp_listener_h listener_ = nullptr;
  RequestHandler on_request_;
  std::string host_;
  uint16_t port_ = 0;
};

// Whether `host` is a wildcard address ("", "0.0.0.0", "::").
bool IsWildcardHost(absl::string_view host);

// Creates the endpoint that answers a listener's connection request. With
// `peer_error_handling` (UCP_ERR_HANDLING_MODE_PEER) `on_error` runs (on the progress thread)
// when the peer fails; UCX 1.13's shared-memory transports cannot do peer error handling: see
// SharedMemoryOnly and CanWatch. Both ends of a connection must use the same mode. The endpoint
// must be closed with CloseEndpoint (forcefully only with peer error handling).
[[nodiscard]] absl::StatusOr<ucp_ep_h> AcceptConnection(
    UcxRuntime* rt, ucp_conn_request_h request, bool peer_error_handling,
    std::function<void(ucs_status_t)>* on_error);
// Connects an endpoint to a UcxListener at `host` (IP literal or name) and `port`; error
// handling as AcceptConnection. InvalidArgument when `host` does not resolve. Post rendezvous
// sends only once a first message has been answered over it: the connection starts on
// temporary lanes, and UCX 1.13 aborts ("packed_rkey_size <= ...rndv.rkey_size" in
// ucp_rndv_rts_pack) when rendezvous sends queued meanwhile are replayed on the final ones.
[[nodiscard]] absl::StatusOr<ucp_ep_h> ConnectToListener(
    UcxRuntime* rt, const std::string& host, uint16_t port, bool peer_error_handling,
    std::function<void(ucs_status_t)>* on_error);
// Starts closing `ep` (forcefully when `force`, e.g. after a peer error); does not wait.
void CloseEndpoint(UcxRuntime* rt, ucp_ep_h ep, bool force);

// What a send carries: a header and a payload, owned until the send completes, or borrowed
// (the caller keeps `borrowed` valid until `done` runs).
struct AmMessage {
  std::string header;
  std::string payload;                                   // owned bytes, or
  std::vector<std::pair<const void*, size_t>> borrowed;  // borrowed buffers (an iov when more
                                                         // than one: no zero-copy rendezvous)
  ucp_mem_h memh = nullptr;  // registration of a single borrowed buffer, if any
  uint32_t flags = 0;        // UCP_AM_SEND_FLAG_*
};
// Sends `msg` as active message `id` on `ep`; `done` runs once with the local completion status
// (possibly before this returns).
void SendAm(UcxRuntime* rt, ucp_ep_h ep, uint16_t id, AmMessage msg,
            std::function<void(absl::Status)> done);

// Receives a message's data (eager or rendezvous) into `dst` of `length` bytes (memh: its
// registration, or null); `done` runs once with the status (possibly before this returns).
// `in_handler`: called from the message's AmHandler (else the handler kept the message by
// returning UCS_INPROGRESS). Returns what the handler must return.
// `rndv`: IsRendezvous(param) of the message.
ucs_status_t ReceiveAm(UcxRuntime* rt, void* data, size_t length, bool rndv, bool in_handler,
                       void* dst, ucp_mem_h memh, std::function<void(absl::Status)> done);
// Drops a message without receiving it (rendezvous: the sender completes as if received).
// Returns what the handler must return.
ucs_status_t DropAm(UcxRuntime* rt, void* data, bool rndv, bool in_handler);
inline bool IsRendezvous(const ucp_am_recv_param_t* param) {
  return (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
}

// Whether a UCX_TLS list names only shared-memory transports (posix, sysv, cma, knem, xpmem,
// sm/shm, self): then endpoints cannot use peer error handling and the peer process is
// watched instead.
bool SharedMemoryOnly(absl::string_view tls);

// The UCX_TLS list a runtime runs with for `tls` (its configured list): `tls` with tcp added
// when it names only shared-memory transports. UCX 1.13's client-server connections go through
// its tcp connection manager, which needs a tcp resource on the listener's network device (else
// the client fails with "device lo is not enabled"); endpoints without peer error handling still
// choose shared-memory lanes (posix/sysv for active messages, cma for rendezvous) between
// processes of one host. Lists UCX expands itself ("all", "^..." exclusions) stay as they are.
std::string ClientServerTls(absl::string_view tls);

// A process on some host: enough to tell, on the same host, whether it is still alive.
struct ProcessIdentity {
  std::string boot_id;  // /proc/sys/kernel/random/boot_id
  uint32_t pid = 0;
  uint64_t start_time = 0;  // clock ticks after boot (/proc/PID/stat field 22)
};
// This process.
ProcessIdentity SelfProcess();
// Whether `p` is a process this one can watch: same boot id and /proc/PID shows the same start
// time (false across hosts or PID namespaces).
bool CanWatch(const ProcessIdentity& p);
// Whether a watchable process has exited (its PID is gone or now names another process).
bool ProcessGone(const ProcessIdentity& p);

// Host memory allocated and registered with a UCX context (ucp_mem_map); unregistered and freed
// on destruction. Thread-safe to read.
class UcxMemory {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<UcxMemory>> Allocate(ucp_context_h context,
                                                                           size_t bytes);
  ~UcxMemory();
  UcxMemory(const UcxMemory&) = delete;
  UcxMemory& operator=(const UcxMemory&) = delete;
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  ucp_mem_h memh() const { return memh_; }

 private:
  UcxMemory() = default;
  ucp_context_h context_ = nullptr;
  ucp_mem_h memh_ = nullptr;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace kvpool::ucx
