#include "server/config.h"

#include <arpa/inet.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/file_read.h"
#include "common/status_macros.h"

ABSL_FLAG(std::string, config, "", "Optional config file of `name = value` lines (flag names)");
ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "Address to serve gRPC on (host:port; port 0 picks a free one)");
ABSL_FLAG(std::string, tenants_file, "",
          "Tenants file (text format of proto/kvpool/v1/tenants.proto): who may call, by token "
          "hash or client-certificate name, in which role. Re-read when it changes and on "
          "SIGHUP. Empty: every caller is the one default tenant, and --listen must be a "
          "loopback address unless --insecure (docs/security.md)");
ABSL_FLAG(int32_t, tenants_poll_ms, 1000, "How often the tenants file is checked for changes");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain of the server: serve gRPC over TLS (with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA certificates that client certificates must chain to: clients may then "
          "authenticate with a certificate (URI SAN kvpool://tenant/NAME, else subject CN, "
          "mapped through --tenants_file's certificate_name)");
ABSL_FLAG(int32_t, tls_refresh_seconds, 60,
          "How often the TLS files are re-read: rotated certificates apply to new connections "
          "without a restart");
ABSL_FLAG(bool, insecure, false,
          "Serve a non-loopback --listen address without a tenants file: anyone who can reach "
          "the port can read, write and delete all K/V");
ABSL_FLAG(std::string, device, "cpu",
          "Where the pool lives and the codec runs: cpu (host memory, the default) or cuda:N "
          "(GPU N's memory and the CUDA kernels; the pool is then sized from the GPU's free "
          "memory, at most 32 GiB)");
ABSL_FLAG(uint64_t, pool_bytes, 0,
          "Block pool size in bytes; 0 = --pool_fraction of available memory, capped");
ABSL_FLAG(double, pool_fraction, 0.25, "Fraction of MemAvailable for the pool when auto-sized");
ABSL_FLAG(uint64_t, pool_max_bytes, uint64_t{8} << 30, "Cap of the auto-sized pool in bytes");
ABSL_FLAG(uint64_t, slab_bytes, uint64_t{4} << 20,
          "Allocator slab size; every page (INT2 block, BF16 page) must fit one");
ABSL_FLAG(int32_t, worker_threads, 0, "Worker threads for codec math; 0 = CPU count");
ABSL_FLAG(uint64_t, worker_queue, 1024,
          "Tasks that may wait for a worker; more are refused with RESOURCE_EXHAUSTED");
ABSL_FLAG(bool, fair_compute, true,
          "Weighted fair queueing of codec and attention work across tenants; false: arrival "
          "order (for comparison)");
ABSL_FLAG(std::string, model_dir, "",
          "Directory rotation files may be registered from by server path ('' = disabled)");
ABSL_FLAG(uint64_t, max_message_bytes, uint64_t{16} << 20, "Largest gRPC message accepted");
ABSL_FLAG(uint64_t, max_chunk_bytes, uint64_t{8} << 20,
          "Largest k or v payload of one chunk (and rotation file chunk)");
ABSL_FLAG(uint64_t, max_rotation_file_bytes, uint64_t{512} << 20, "Largest uploaded rotation file");
ABSL_FLAG(int32_t, max_attention_batch, 256, "Most sequences in one Attend call");
ABSL_FLAG(int32_t, max_append_tokens, 1 << 20, "Most tokens in one AppendKv stream");
ABSL_FLAG(int32_t, max_connections, 0,
          "Most client connections held at once (more are closed at once); 0 = what the "
          "descriptor limit leaves room for (kvpoold raises its soft limit to the hard one)");
ABSL_FLAG(absl::Duration, sequence_ttl, absl::ZeroDuration(),
          "Lease of a sequence created without its own (CreateSequenceRequest.ttl_ms): released "
          "after this long without an append, read or attention, and counted in GetStats "
          "(lifecycle.expired_sequences); later calls on it answer NOT_FOUND, reason EXPIRED. "
          "0 = no lease (e.g. 10m, 90s)");
ABSL_FLAG(int32_t, max_streams_per_connection, 64,
          "Most streams (appends, pushes) open at once on one client connection; 0 = no cap");
ABSL_FLAG(int32_t, max_streams_per_tenant, 1024,
          "Most streams (appends, pushes) open at once for one tenant; 0 = no cap");
ABSL_FLAG(uint64_t, max_reserved_bytes_per_connection, 0,
          "Most pool bytes reserved at once by the in-flight appends of one client connection; "
          "0 = no cap");
ABSL_FLAG(uint64_t, max_reserved_bytes_per_tenant, 0,
          "Most pool bytes reserved at once by the in-flight appends of one tenant; 0 = no cap");
ABSL_FLAG(int32_t, max_reads_per_connection, 64,
          "Most ReadKv/ReadBlocks/Attend calls at once on one client connection; 0 = no cap");
ABSL_FLAG(int32_t, max_reads_per_tenant, 1024,
          "Most ReadKv/ReadBlocks/Attend calls at once for one tenant; 0 = no cap");
ABSL_FLAG(uint64_t, max_read_bytes_per_connection, uint64_t{256} << 20,
          "Most response bytes (and decoded Attend queries) the reads of one client connection "
          "hold in flight; 0 = no cap");
ABSL_FLAG(uint64_t, max_read_bytes_per_tenant, uint64_t{1} << 30,
          "Most response bytes (and decoded Attend queries) the reads of one tenant hold in "
          "flight; 0 = no cap");
ABSL_FLAG(int32_t, stream_idle_timeout_ms, 30000,
          "A stream, push (gRPC or UCX), read or Attend with no progress for this long is ended "
          "(DEADLINE_EXCEEDED, reason LIMIT) and its append rolled back");
ABSL_FLAG(int32_t, stream_total_timeout_ms, 30 * 60 * 1000,
          "A stream, push, read or Attend open for this long in all is ended (DEADLINE_EXCEEDED, "
          "reason LIMIT) and its append rolled back");
ABSL_FLAG(std::string, port_file, "",
          "If set, the bound port is written to this file once serving (for tests)");
ABSL_FLAG(std::string, metrics_listen, "",
          "Address of the plaintext HTTP port serving Prometheus metrics at /metrics "
          "(host:port; port 0 picks a free one); '' = no metrics port");
ABSL_FLAG(bool, metrics_tenant_labels, false,
          "Label per-model metrics with their tenant and export each tenant's quota (the "
          "metrics port is plaintext: tenant names are then visible to whoever can reach it)");
ABSL_FLAG(std::string, metrics_port_file, "",
          "If set, the bound metrics port is written to this file once serving (for tests)");
ABSL_FLAG(uint32_t, kv_events_buffer, 4096,
          "KV events (SubscribeKvEvents) queued for one subscriber; a subscriber that falls "
          "this far behind is dropped with RESOURCE_EXHAUSTED");
ABSL_FLAG(uint32_t, kv_events_max_subscribers, 64,
          "Most SubscribeKvEvents streams at once (each may hold a replay of the prefix index); "
          "more are refused with RESOURCE_EXHAUSTED");
ABSL_FLAG(uint32_t, codec_health_sample_every, 64,
          "Codec health metrics: re-encode a few rows of every Nth arriving chunk on the side to "
          "measure clip and quantization error per model and layer; 0 = off");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn, error");
ABSL_FLAG(std::string, log_format, "text",
          "text (one line per event) or json (one JSON object per line: time, level, "
          "request_id, msg)");
ABSL_FLAG(int32_t, shutdown_grace_ms, 5000,
          "Drain (SIGTERM, SIGINT or AdminService.Drain): how long in-flight calls may finish "
          "before being cancelled");
ABSL_FLAG(std::string, model_config, "",
          "Models to register at start: a kvpool.v1.ModelConfig in protobuf text format "
          "(docs/operations.md); a bad file refuses the start");
ABSL_FLAG(std::string, health_listen, "",
          "Address of a plaintext port serving only grpc.health.v1 (no credentials), for "
          "Kubernetes probes when --listen uses TLS (host:port; port 0 picks one); '' = none");
ABSL_FLAG(std::string, health_port_file, "",
          "If set, the bound health port is written to this file once serving (for tests)");
ABSL_FLAG(uint64_t, malloc_retain_bytes, uint64_t{64} << 20,
          "Freed heap memory kept for reuse instead of being returned to the OS, so message "
          "buffers are not unmapped and faulted in again on every message (glibc trim "
          "threshold; allocations below min(this, 32 MiB) come from the heap); 0 = glibc's "
          "defaults");
ABSL_FLAG(std::string, transports, "ucx",
          "Data-plane transports offered in TransportService.Negotiate besides grpc_inline "
          "(comma list: ucx; '' = grpc_inline only)");
ABSL_FLAG(std::string, ucx_tls, "",
          "UCX transports of the daemon's worker (UCX_TLS syntax, e.g. posix,sysv,cma or tcp); "
          "'' = the UCX_TLS environment variable or UCX's default");
ABSL_FLAG(std::string, ucx_net_devices, "",
          "UCX network devices (UCX_NET_DEVICES syntax, e.g. lo); '' = environment/default. "
          "Must include the device of --ucx_listen's address (UCX's connection manager runs on "
          "it)");
ABSL_FLAG(std::string, ucx_listen, "",
          "Address of the UCX listener that clients connect their data-plane endpoints to "
          "(host:port, port 0 picks a free one; Negotiate tells clients the bound address); "
          "'' = the host of --listen with port 0. Serve it only where --listen is served: "
          "UCX 1.13 aborts the process on malformed bytes sent to this port "
          "(server/transport/README.md, Security)");
ABSL_FLAG(int32_t, transport_hello_timeout_ms, 10000,
          "A UCX connection must send its HELLO (session id and secret) within this long, and a "
          "negotiated UCX session must be connected within it; else it is closed");
ABSL_FLAG(std::string, shm_socket_dir, "",
          "Directory of the Unix socket (mode 0600) through which same-host decode workers "
          "receive their shared-memory attention channel; '' = a fresh private directory under "
          "$XDG_RUNTIME_DIR or /tmp");
ABSL_FLAG(int32_t, shm_max_sessions, 32,
          "Shared-memory attention channels open at once (each holds one daemon thread and its "
          "region); 0 = the transport is off");
ABSL_FLAG(uint64_t, shm_max_region_bytes, uint64_t{64} << 20,
          "Most shared memory one shared-memory attention channel may have (pinned on a GPU "
          "daemon)");
ABSL_FLAG(uint64_t, shm_in_place_bytes, uint64_t{16} << 10,
          "On a GPU daemon, shared-memory calls whose queries take at most this many bytes are "
          "read and written in place by the kernels over the bus; larger ones are copied by DMA "
          "(in-place access costs more per byte, a copy more per call)");
ABSL_FLAG(uint64_t, transport_staging_bytes, uint64_t{64} << 20,
          "Registered staging memory for UCX pushes, shared by all sessions");
ABSL_FLAG(uint64_t, transport_message_bytes, uint64_t{4} << 20,
          "Largest K+V payload of one UCX LAYER_DATA message (one staging slot)");
ABSL_FLAG(int32_t, transport_idle_timeout_ms, 0,
          "Deprecated alias of --stream_idle_timeout_ms (one idle limit covers every stream and "
          "push, gRPC or UCX); when set (> 0) it replaces that flag's value");
ABSL_FLAG(int32_t, transport_keepalive_ms, 1000,
          "UCX keepalive interval: how fast a vanished peer is noticed");
ABSL_FLAG(absl::Duration, scrub_period, absl::Minutes(5),
          "One full checksum sweep of every stored page per this period (e.g. 300s, 10m; 0 = no "
          "scrubber)");
ABSL_FLAG(uint64_t, scrub_max_bytes_per_second, uint64_t{128} << 20,
          "Most bytes of pool memory the scrubber reads per second (a sweep that needs more "
          "takes longer than --scrub_period)");
ABSL_FLAG(absl::Duration, device_check_period, absl::Seconds(1),
          "How often the compute device is checked for a CUDA error that poisoned it (e.g. 1s, "
          "500ms; > 0). A failed call finds such an error at once");
ABSL_FLAG(absl::Duration, device_failure_exit_grace, absl::Seconds(5),
          "After the device failed (health NOT_SERVING, compute calls UNAVAILABLE), how long "
          "the daemon keeps answering before it exits with status 3 so that its supervisor "
          "restarts it (e.g. 5s; 0 = at once)");
ABSL_FLAG(bool, cuda_programmatic_launch, kvpool::cuda::AttentionTuning{}.programmatic_launch,
          "CUDA backend: the attention kernels after the query rotation start while their "
          "predecessor finishes (programmatic dependent launch); false launches them in plain "
          "stream order (for a driver or tool that mishandles such launches)");
ABSL_FLAG(int32_t, cuda_history_chunk_tokens,
          kvpool::cuda::AttentionTuning{}.max_history_chunk_tokens,
          "CUDA backend: most INT2 history tokens one attention CTA reads (0 = no cap). Longer "
          "chunks carry more tensor-core rounding bias into the output at long contexts; shorter "
          "ones add merge work");

namespace kvpool::server {

absl::StatusOr<HostPort> ParseHostPort(absl::string_view address) {
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat("'", address, "' is not host:port"));
  }
  absl::string_view host = address.substr(0, colon);
  const absl::string_view port = address.substr(colon + 1);
  if (absl::StartsWith(host, "[") && absl::EndsWith(host, "]")) {
    host = host.substr(1, host.size() - 2);
  } else if (host.find(':') != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", address, "': write an IPv6 host in brackets, [host]:port"));
  }
  uint32_t number = 0;
  if (port.empty() || !absl::SimpleAtoi(port, &number) || number > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", address, "': the port must be a number in [0, 65535]"));
  }
  return HostPort{std::string(host), static_cast<uint16_t>(number)};
}

bool IsLoopbackHost(const std::string& host) {
  if (host == "localhost") return true;
  in_addr v4;
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6;
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
    static const in6_addr kLoopback = IN6ADDR_LOOPBACK_INIT;
    return std::memcmp(&v6, &kLoopback, sizeof(v6)) == 0;
  }
  return false;
}

namespace {

// The safe defaults of docs/security.md: nobody unauthenticated beyond this machine, and no
// bearer token across the network in clear.
absl::Status ValidateSecurity(const ServerConfig& c) {
  if (c.tls_cert.empty() != c.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together");
  }
  if (!c.tls_client_ca.empty() && c.tls_cert.empty()) {
    return absl::InvalidArgumentError("--tls_client_ca needs --tls_cert and --tls_key");
  }
  if (c.tenants_poll_ms < 10) return absl::InvalidArgumentError("--tenants_poll_ms must be >= 10");
  if (c.tls_refresh_seconds < 1) {
    return absl::InvalidArgumentError("--tls_refresh_seconds must be >= 1");
  }
  const std::string host = ParseHostPort(c.listen)->host;
  if (IsLoopbackHost(host)) return absl::OkStatus();
  if (c.tenants_file.empty() && !c.insecure) {
    return absl::InvalidArgumentError(absl::StrCat(
        "refusing to serve --listen=", c.listen,
        " without --tenants_file: it is not a loopback address, and without tenants every "
        "caller that reaches it is the one default tenant and can read, overwrite and delete "
        "all K/V. Give --tenants_file (with --tls_cert/--tls_key), or --insecure to serve it "
        "unauthenticated anyway"));
  }
  if (!c.tenants_file.empty() && c.tls_cert.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "refusing to serve --listen=", c.listen,
        " with --tenants_file but without TLS: bearer tokens would cross the network in clear. "
        "Give --tls_cert and --tls_key (or listen on a loopback address)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ServerConfig::Validate() const {
  if (absl::StatusOr<HostPort> a = ParseHostPort(listen); !a.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--listen: ", a.status().message()));
  }
  if (!metrics_listen.empty()) {
    if (absl::StatusOr<HostPort> a = ParseHostPort(metrics_listen); !a.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--metrics_listen: ", a.status().message()));
    }
  }
  if (!health_listen.empty()) {
    if (absl::StatusOr<HostPort> a = ParseHostPort(health_listen); !a.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--health_listen: ", a.status().message()));
    }
  }
  if (kv_events_buffer < 16 || kv_events_buffer > (1u << 20)) {
    return absl::InvalidArgumentError("--kv_events_buffer must be in [16, 1048576]");
  }
  if (pool_bytes < slab_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--pool_bytes (", pool_bytes, ") must be at least --slab_bytes (", slab_bytes, ")"));
  }
  if (slab_bytes < 4096 || slab_bytes % 4096 != 0) {
    return absl::InvalidArgumentError("--slab_bytes must be a positive multiple of 4096");
  }
  if (worker_threads < 1 || worker_threads > 1024) {
    return absl::InvalidArgumentError("--worker_threads must be in [0, 1024]");
  }
  if (worker_queue < 1) return absl::InvalidArgumentError("--worker_queue must be >= 1");
  if (max_message_bytes < 4096 || max_message_bytes > (size_t{1} << 31) - 1) {
    return absl::InvalidArgumentError("--max_message_bytes must be in [4096, 2^31)");
  }
  if (max_chunk_bytes < 1024 || max_chunk_bytes > max_message_bytes) {
    return absl::InvalidArgumentError(
        "--max_chunk_bytes must be >= 1024 and at most --max_message_bytes");
  }
  if (max_attention_batch < 1) {
    return absl::InvalidArgumentError("--max_attention_batch must be >= 1");
  }
  if (max_append_tokens < 1) return absl::InvalidArgumentError("--max_append_tokens must be >= 1");
  if (sequence_ttl < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--sequence_ttl must be >= 0 (0 = no lease)");
  }
  if (shutdown_grace_ms < 0) return absl::InvalidArgumentError("--shutdown_grace_ms must be >= 0");
  if (max_streams_per_connection < 0 || max_streams_per_tenant < 0) {
    return absl::InvalidArgumentError(
        "--max_streams_per_connection and --max_streams_per_tenant must be >= 0 (0 = no cap)");
  }
  if (max_reads_per_connection < 0 || max_reads_per_tenant < 0) {
    return absl::InvalidArgumentError(
        "--max_reads_per_connection and --max_reads_per_tenant must be >= 0 (0 = no cap)");
  }
  if (stream_idle_timeout_ms < 1 || stream_total_timeout_ms < 1) {
    return absl::InvalidArgumentError(
        "--stream_idle_timeout_ms and --stream_total_timeout_ms must be >= 1");
  }
  if (transports != "" && transports != "ucx") {
    return absl::InvalidArgumentError(
        absl::StrCat("--transports must be '' or 'ucx', got '", transports, "'"));
  }
  if (transport_message_bytes < 4096 || transport_staging_bytes < transport_message_bytes) {
    return absl::InvalidArgumentError(
        "--transport_message_bytes must be >= 4096 and at most --transport_staging_bytes");
  }
  if (shm_max_sessions < 0 || shm_max_sessions > 1024 || shm_max_region_bytes < (1u << 20)) {
    return absl::InvalidArgumentError(
        "--shm_max_sessions must be in [0, 1024] and --shm_max_region_bytes at least 1 MiB");
  }
  if (transport_keepalive_ms < 1 || transport_hello_timeout_ms < 1) {
    return absl::InvalidArgumentError(
        "--transport_keepalive_ms and --transport_hello_timeout_ms must be >= 1");
  }
  if (transport_idle_timeout_ms < 0) {
    return absl::InvalidArgumentError(
        "--transport_idle_timeout_ms (deprecated: use --stream_idle_timeout_ms) must be >= 0");
  }
  if (!ucx_listen.empty()) {
    if (absl::StatusOr<HostPort> a = ParseHostPort(ucx_listen); !a.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--ucx_listen: ", a.status().message()));
    }
  }
  KVPOOL_RETURN_IF_ERROR(ValidateSecurity(*this));
  if (cuda_tuning.attention.max_history_chunk_tokens < 0) {
    return absl::InvalidArgumentError("--cuda_history_chunk_tokens must be >= 0 (0 = no cap)");
  }
  if (scrub_period < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--scrub_period must be >= 0 (0 = no scrubber)");
  }
  if (device_check_period <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--device_check_period must be > 0");
  }
  if (device_failure_exit_grace < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--device_failure_exit_grace must be >= 0");
  }
  if (scrub_max_bytes_per_second < 1) {
    return absl::InvalidArgumentError("--scrub_max_bytes_per_second must be >= 1");
  }
  static const char* kLevels[] = {"trace", "debug", "info", "warn", "error"};
  bool level_ok = false;
  for (const char* l : kLevels) level_ok |= log_level == l;
  if (!level_ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--log_level must be trace, debug, info, warn or error, got '", log_level, "'"));
  }
  if (log_format != "text" && log_format != "json") {
    return absl::InvalidArgumentError(
        absl::StrCat("--log_format must be text or json, got '", log_format, "'"));
  }
  return absl::OkStatus();
}

absl::Status ApplyConfigText(const std::string& text, const std::string& source) {
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    const size_t hash = line.find('#');
    if (hash != absl::string_view::npos) line = line.substr(0, hash);
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    const size_t eq = line.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ":", line_no, ": expected `name = value`"));
    }
    absl::string_view name = absl::StripAsciiWhitespace(line.substr(0, eq));
    absl::string_view value = absl::StripAsciiWhitespace(line.substr(eq + 1));
    absl::ConsumePrefix(&name, "--");
    if (value.size() >= 2 && value.front() == '"' && value.back() == '"') {
      value = value.substr(1, value.size() - 2);
    }
    if (name == "config") {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ":", line_no, ": a config file cannot name another"));
    }
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ":", line_no, ": unknown setting '", name, "'"));
    }
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ":", line_no, ": bad value for ", name, ": ", error));
    }
  }
  return absl::OkStatus();
}

absl::Status ParseServerFlags(int argc, char** argv) {
  // The config file applies first so that the command line overrides it.
  std::string config_path;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (absl::ConsumePrefix(&arg, "--config=") || absl::ConsumePrefix(&arg, "-config=")) {
      config_path = std::string(arg);
    } else if ((arg == "--config" || arg == "-config") && i + 1 < argc) {
      config_path = argv[i + 1];
    }
  }
  if (!config_path.empty()) {
    constexpr uint64_t kMaxConfigBytes = 1 << 20;
    absl::StatusOr<std::string> text = ReadRegularFile(config_path, kMaxConfigBytes);
    if (!text.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot read config file: ", text.status().message()));
    }
    if (absl::Status s = ApplyConfigText(*text, config_path); !s.ok()) return s;
  }
  const std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("unexpected positional argument '", rest[1], "'"));
  }
  return absl::OkStatus();
}

size_t AutoPoolBytes(double fraction, size_t cap, size_t align) {
  size_t available = 0;
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  uint64_t kib = 0;
  while (in >> key >> kib >> unit) {
    if (key == "MemAvailable:") {
      available = static_cast<size_t>(kib) * 1024;
      break;
    }
  }
  if (available == 0) available = size_t{1} << 30;  // unknown: assume 1 GiB
  return PoolBytesOf(available, fraction, cap, align);
}

size_t PoolBytesOf(size_t available, double fraction, size_t cap, size_t align) {
  size_t bytes = static_cast<size_t>(static_cast<double>(available) * fraction);
  if (bytes > cap) bytes = cap;
  bytes = bytes / align * align;
  return bytes < align ? align : bytes;
}

absl::StatusOr<ServerConfig> ServerConfigFromFlags() {
  ServerConfig c;
  c.listen = absl::GetFlag(FLAGS_listen);
  c.device = absl::GetFlag(FLAGS_device);
  c.slab_bytes = absl::GetFlag(FLAGS_slab_bytes);
  c.pool_bytes = absl::GetFlag(FLAGS_pool_bytes);
  const double fraction = absl::GetFlag(FLAGS_pool_fraction);
  if (!(fraction > 0.0 && fraction <= 0.9)) {
    return absl::InvalidArgumentError("--pool_fraction must be in (0, 0.9]");
  }
  c.pool_fraction = fraction;
  c.pool_max_bytes = absl::GetFlag(FLAGS_pool_max_bytes);
  if (c.pool_bytes == 0 && c.slab_bytes > 0) {
    c.pool_bytes = AutoPoolBytes(fraction, c.pool_max_bytes, c.slab_bytes);
    c.pool_auto = true;
  }
  c.worker_threads = absl::GetFlag(FLAGS_worker_threads);
  if (c.worker_threads == 0) {
    c.worker_threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  }
  c.worker_queue = absl::GetFlag(FLAGS_worker_queue);
  c.fair_compute = absl::GetFlag(FLAGS_fair_compute);
  c.model_dir = absl::GetFlag(FLAGS_model_dir);
  c.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  c.max_chunk_bytes = absl::GetFlag(FLAGS_max_chunk_bytes);
  c.max_rotation_file_bytes = absl::GetFlag(FLAGS_max_rotation_file_bytes);
  c.max_attention_batch = absl::GetFlag(FLAGS_max_attention_batch);
  c.max_append_tokens = absl::GetFlag(FLAGS_max_append_tokens);
  c.max_connections = absl::GetFlag(FLAGS_max_connections);
  c.sequence_ttl = absl::GetFlag(FLAGS_sequence_ttl);
  c.max_streams_per_connection = absl::GetFlag(FLAGS_max_streams_per_connection);
  c.max_streams_per_tenant = absl::GetFlag(FLAGS_max_streams_per_tenant);
  c.max_reserved_bytes_per_connection = absl::GetFlag(FLAGS_max_reserved_bytes_per_connection);
  c.max_reserved_bytes_per_tenant = absl::GetFlag(FLAGS_max_reserved_bytes_per_tenant);
  c.max_reads_per_connection = absl::GetFlag(FLAGS_max_reads_per_connection);
  c.max_reads_per_tenant = absl::GetFlag(FLAGS_max_reads_per_tenant);
  c.max_read_bytes_per_connection = absl::GetFlag(FLAGS_max_read_bytes_per_connection);
  c.max_read_bytes_per_tenant = absl::GetFlag(FLAGS_max_read_bytes_per_tenant);
  c.stream_idle_timeout_ms = absl::GetFlag(FLAGS_stream_idle_timeout_ms);
  c.stream_total_timeout_ms = absl::GetFlag(FLAGS_stream_total_timeout_ms);
  c.port_file = absl::GetFlag(FLAGS_port_file);
  c.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  c.metrics_tenant_labels = absl::GetFlag(FLAGS_metrics_tenant_labels);
  c.metrics_port_file = absl::GetFlag(FLAGS_metrics_port_file);
  c.kv_events_buffer = absl::GetFlag(FLAGS_kv_events_buffer);
  c.kv_events_max_subscribers = absl::GetFlag(FLAGS_kv_events_max_subscribers);
  c.codec_health_sample_every = absl::GetFlag(FLAGS_codec_health_sample_every);
  c.log_level = absl::GetFlag(FLAGS_log_level);
  c.log_format = absl::GetFlag(FLAGS_log_format);
  c.shutdown_grace_ms = absl::GetFlag(FLAGS_shutdown_grace_ms);
  c.model_config = absl::GetFlag(FLAGS_model_config);
  c.health_listen = absl::GetFlag(FLAGS_health_listen);
  c.health_port_file = absl::GetFlag(FLAGS_health_port_file);
  c.malloc_retain_bytes = absl::GetFlag(FLAGS_malloc_retain_bytes);
  c.transports = absl::GetFlag(FLAGS_transports);
  c.ucx_tls = absl::GetFlag(FLAGS_ucx_tls);
  c.ucx_net_devices = absl::GetFlag(FLAGS_ucx_net_devices);
  c.ucx_listen = absl::GetFlag(FLAGS_ucx_listen);
  c.transport_hello_timeout_ms = absl::GetFlag(FLAGS_transport_hello_timeout_ms);
  c.shm_socket_dir = absl::GetFlag(FLAGS_shm_socket_dir);
  c.shm_max_sessions = absl::GetFlag(FLAGS_shm_max_sessions);
  c.shm_max_region_bytes = absl::GetFlag(FLAGS_shm_max_region_bytes);
  c.shm_in_place_bytes = absl::GetFlag(FLAGS_shm_in_place_bytes);
  c.transport_staging_bytes = absl::GetFlag(FLAGS_transport_staging_bytes);
  c.transport_message_bytes = absl::GetFlag(FLAGS_transport_message_bytes);
  c.transport_idle_timeout_ms = absl::GetFlag(FLAGS_transport_idle_timeout_ms);
  if (c.transport_idle_timeout_ms > 0) c.stream_idle_timeout_ms = c.transport_idle_timeout_ms;
  c.scrub_period = absl::GetFlag(FLAGS_scrub_period);
  c.scrub_max_bytes_per_second = absl::GetFlag(FLAGS_scrub_max_bytes_per_second);
  c.device_check_period = absl::GetFlag(FLAGS_device_check_period);
  c.device_failure_exit_grace = absl::GetFlag(FLAGS_device_failure_exit_grace);
  c.transport_keepalive_ms = absl::GetFlag(FLAGS_transport_keepalive_ms);
  c.tenants_file = absl::GetFlag(FLAGS_tenants_file);
  c.tenants_poll_ms = absl::GetFlag(FLAGS_tenants_poll_ms);
  c.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  c.tls_key = absl::GetFlag(FLAGS_tls_key);
  c.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  c.tls_refresh_seconds = absl::GetFlag(FLAGS_tls_refresh_seconds);
  c.insecure = absl::GetFlag(FLAGS_insecure);
  c.cuda_tuning.attention.programmatic_launch = absl::GetFlag(FLAGS_cuda_programmatic_launch);
  c.cuda_tuning.attention.max_history_chunk_tokens = absl::GetFlag(FLAGS_cuda_history_chunk_tokens);
  if (absl::Status s = c.Validate(); !s.ok()) return s;
  return c;
}

}  // namespace kvpool::server
