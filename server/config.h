// ServerConfig: kvpoold's settings, from Abseil flags and an optional config file.
//
// Every setting is a flag (see config.cc for the list and defaults). `--config=FILE` names a
// file of `name = value` lines (flag names without dashes; `#` starts a comment); values from
// the file apply first and command-line flags override them. With no flags kvpoold serves on
// 127.0.0.1:50051 with the CPU backend and a pool of --pool_fraction of the available memory,
// capped at --pool_max_bytes.
//
//   KVPOOL_RETURN_IF_ERROR(ParseServerFlags(argc, argv));     // config file + command line
//   KVPOOL_ASSIGN_OR_RETURN(ServerConfig cfg, ServerConfigFromFlags());
//
// Flag parsing is not thread-safe (do it once in main); ServerConfig is a plain value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kernels/cuda/kernel_tuning.h"

namespace kvpool::server {

struct ServerConfig {
  std::string listen = "127.0.0.1:50051";
  std::string device = "cpu";  // "cpu" or "cuda:N"
  size_t pool_bytes = 0;       // resolved: never 0 after ServerConfigFromFlags
  // The pool was sized from host memory (no --pool_bytes): a GPU daemon re-sizes it from the
  // device's free memory with the same fraction and cap.
  bool pool_auto = false;
  double pool_fraction = 0.25;
  size_t pool_max_bytes = 0;
  size_t slab_bytes = 4u << 20;
  int worker_threads = 0;  // resolved: >= 1
  size_t worker_queue = 1024;
  bool fair_compute = true;  // weighted fair queueing across tenants; false: arrival order
  std::string model_dir;
  size_t max_message_bytes = 16u << 20;
  size_t max_chunk_bytes = 8u << 20;
  size_t max_rotation_file_bytes = 512u << 20;
  int max_attention_batch = 256;
  int max_append_tokens = 1 << 20;
  // Most client connections held at once; 0 = as many as the descriptor limit leaves room for
  // (server/connection_listener.h). Connections over the cap are closed at once.
  int max_connections = 0;
  // Lease of a sequence created without one (CreateSequenceRequest.ttl_ms): released after this
  // long without an append, read or attention; zero = no lease.
  absl::Duration sequence_ttl = absl::ZeroDuration();
  // Admission (server/admission/): open streams and bytes reserved by in-flight appends per
  // client connection and per tenant (0 = no cap), and the idle and total deadlines of every
  // stream and data-plane push.
  int max_streams_per_connection = 64;
  int max_streams_per_tenant = 1024;
  size_t max_reserved_bytes_per_connection = 0;
  size_t max_reserved_bytes_per_tenant = 0;
  // Read and attention calls at once, and the response bytes they hold in flight, per
  // connection and per tenant (0 = no cap); they share the streams' deadlines.
  int max_reads_per_connection = 64;
  int max_reads_per_tenant = 1024;
  size_t max_read_bytes_per_connection = size_t{256} << 20;
  size_t max_read_bytes_per_tenant = size_t{1} << 30;
  int stream_idle_timeout_ms = 30000;
  int stream_total_timeout_ms = 30 * 60 * 1000;
  std::string port_file;
  // Observability (server/metrics/, server/events/): the plaintext Prometheus port ("" = none),
  // tenant labels on it, its port file, the KV events one subscriber may fall behind by, and
  // how often arriving rows are sampled for codec health.
  std::string metrics_listen;
  bool metrics_tenant_labels = false;
  std::string metrics_port_file;
  uint32_t kv_events_buffer = 4096;
  uint32_t kv_events_max_subscribers = 64;
  uint32_t codec_health_sample_every = 64;  // server/codec_health.h; 0 = off
  std::string log_level = "info";
  std::string log_format = "text";  // or "json" (server/logging/log_format.h)
  int shutdown_grace_ms = 5000;
  // Operations (docs/operations.md): models registered at start (proto/kvpool/v1/
  // model_config.proto; "" = none), and the plaintext port serving only grpc.health.v1
  // ("" = none) with its port file.
  std::string model_config;
  std::string health_listen;
  std::string health_port_file;
  // Freed heap memory kept for reuse rather than returned to the OS (glibc's trim threshold;
  // allocations below min(this, 32 MiB) come from the heap); 0 = glibc's defaults.
  size_t malloc_retain_bytes = 64u << 20;
  // Data plane (server/transport/): transports offered besides grpc_inline, UCX settings,
  // staging memory and timeouts.
  std::string transports = "ucx";
  std::string ucx_tls;
  std::string ucx_net_devices;
  std::string ucx_listen;  // host:port of the UCX listener; "" = --listen's host, port 0
  size_t transport_staging_bytes = 64u << 20;
  size_t transport_message_bytes = 4u << 20;
  // Deprecated alias of stream_idle_timeout_ms, which UCX pushes and sessions use too: when
  // given (> 0), ServerConfigFromFlags copies it there. 0 = not given.
  int transport_idle_timeout_ms = 0;
  int transport_keepalive_ms = 1000;
  int transport_hello_timeout_ms = 10000;
  // Same-host attention channels (server/transport/shm/): where their Unix socket lives ("" = a
  // fresh private directory under $XDG_RUNTIME_DIR or /tmp), how many may be open (0: none) and
  // the most shared memory one may have.
  std::string shm_socket_dir;
  int shm_max_sessions = 32;
  size_t shm_max_region_bytes = 64u << 20;
  // On a GPU daemon, calls whose queries take at most this many bytes are read and written in
  // place by the kernels (mapped host memory); larger ones move by DMA copies.
  size_t shm_in_place_bytes = 16u << 10;
  // Integrity (server/scrubber.h): one full checksum sweep of the stored pages per period
  // (zero: no scrubber), reading pool memory at most this fast.
  absl::Duration scrub_period = absl::Minutes(5);
  size_t scrub_max_bytes_per_second = 128u << 20;
  // Security (docs/security.md): the tenants file (empty = one default tenant, loopback only
  // unless `insecure`), its poll period, and TLS: the server's certificate chain and key, the
  // CA that client certificates must chain to (empty = no client certificates), re-read every
  // tls_refresh_seconds so that rotated files apply to new connections without a restart.
  std::string tenants_file;
  int tenants_poll_ms = 1000;
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;
  int tls_refresh_seconds = 60;
  bool insecure = false;
  // Device health (server/device_health_monitor.h): how often the backend's device is checked
  // for a poisoned CUDA context, and how long after a failure the daemon exits (status 3).
  absl::Duration device_check_period = absl::Seconds(1);
  absl::Duration device_failure_exit_grace = absl::Seconds(5);
  // Kernels of the CUDA backend (--device=cuda:N): the measured defaults with
  // --cuda_programmatic_launch and --cuda_history_chunk_tokens applied.
  cuda::KernelTuning cuda_tuning;

  // InvalidArgument naming the first bad setting.
  absl::Status Validate() const;
};

struct HostPort {
  std::string host;  // without brackets; "" = every address
  uint16_t port = 0;
};
// Whether `host` (as in HostPort) only reaches this machine: localhost, 127.0.0.0/8 or ::1.
bool IsLoopbackHost(const std::string& host);

// "host:port" or "[IPv6 host]:port" (port 0..65535); InvalidArgument when malformed.
[[nodiscard]] absl::StatusOr<HostPort> ParseHostPort(absl::string_view address);

// Applies `--config=FILE` (if present in argv) and then the command line to the flags.
// InvalidArgument for an unreadable or malformed file, an unknown key, or a bad value.
// Exits on --help like absl::ParseCommandLine.
[[nodiscard]] absl::Status ParseServerFlags(int argc, char** argv);

// Sets flags from the `name = value` lines of `text` (`source` names it in errors).
[[nodiscard]] absl::Status ApplyConfigText(const std::string& text, const std::string& source);

// The configuration the flags describe, with automatic values resolved (pool size from
// /proc/meminfo, worker threads from the CPU count) and validated.
[[nodiscard]] absl::StatusOr<ServerConfig> ServerConfigFromFlags();

// `fraction` of MemAvailable, at most `cap` bytes, rounded down to `align`.
size_t AutoPoolBytes(double fraction, size_t cap, size_t align);
// `fraction` of `available` bytes, at most `cap`, rounded down to `align` (at least `align`).
size_t PoolBytesOf(size_t available, double fraction, size_t cap, size_t align);

}  // namespace kvpool::server
