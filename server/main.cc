// kvpoold: the kvpool KV-cache daemon. See server/config.cc (or --help) for its flags.
//
//   kvpoold --pool_bytes=1073741824 --listen=127.0.0.1:0 --port_file=/tmp/kvpoold.port
//
// Drains on SIGTERM or SIGINT, as on AdminService.Drain (KvpoolServer::Drain): health turns
// NOT_SERVING, new sequences and appends are refused (UNAVAILABLE, reason DRAINING), in-flight
// calls get --shutdown_grace_ms to finish, then it exits with status 0. SIGHUP re-reads
// --tenants_file. When its GPU fails (a poisoned CUDA context) it stops on its own after
// --device_failure_exit_grace and exits with status 3.
#include <pthread.h>
#include <signal.h>
#include <stdio.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/str_cat.h"
#include "common/build_info.h"
#include "proto/api_version.h"
#include "server/config.h"
#include "server/logging/log_format.h"
#include "server/server.h"
#include "server/stats_service.h"
#include "spdlog/spdlog.h"
#if defined(KVPOOL_FAULT_INJECTION)
#include "server/fault_injection/fault_injection_service.h"
#endif

namespace {

bool WritePortFile(const std::string& path, int port) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) return false;
    out << port << "\n";
    if (!out.good()) return false;
  }
  return std::rename(tmp.c_str(), path.c_str()) == 0;  // readers never see a partial file
}

}  // namespace

int main(int argc, char** argv) {
  using kvpool::server::KvpoolServer;
  // NVLink multicast stays off in this process and anything it starts (NCCL channels): on shared
  // hosts it can take every GPU out of service.
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1", 1);
  setenv("NVSHMEM_DISABLE_NVLS", "1", 1);
  // Block the stop signals in every thread; one thread waits for them with sigwait.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  absl::SetProgramUsageMessage(
      "kvpoold: KV-cache daemon storing LLM K/V as 2-bit OSCAR codes, served over gRPC.\n"
      "Usage: kvpoold [--config=FILE] [--listen=HOST:PORT] [--pool_bytes=N] [flags...]");
  absl::FlagsUsageConfig usage_config;
  usage_config.version_string = [] {
    return absl::StrCat(kvpool::BuildDescription("kvpoold"), "\nAPI ", kvpool::kApiPackage,
                        " revision ", kvpool::kApiRevision, "\n");
  };
  absl::SetFlagsUsageConfig(usage_config);
  if (absl::Status s = kvpool::server::ParseServerFlags(argc, argv); !s.ok()) {
    std::fprintf(stderr, "kvpoold: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  absl::StatusOr<kvpool::server::ServerConfig> config = kvpool::server::ServerConfigFromFlags();
  if (!config.ok()) {
    std::fprintf(stderr, "kvpoold: %s\n", std::string(config.status().message()).c_str());
    return 2;
  }
  const absl::StatusOr<kvpool::server::LogFormat> log_format =
      kvpool::server::ParseLogFormat(config->log_format);
  if (!log_format.ok()) {
    std::fprintf(stderr, "kvpoold: %s\n", std::string(log_format.status().message()).c_str());
    return 2;
  }
  kvpool::server::InstallLogFormat(*log_format, "kvpoold");
  spdlog::set_level(spdlog::level::from_str(config->log_level));

#if defined(KVPOOL_FAULT_INJECTION)
  // kvpoold-fault-injection only (server/CMakeLists.txt): the test service that damages pages.
  spdlog::warn("this daemon serves kvpool.testing.FaultInjection: for tests only");
  absl::StatusOr<std::unique_ptr<KvpoolServer>> server =
      KvpoolServer::Start(*config, kvpool::server::NewFaultInjectionService);
#else
  absl::StatusOr<std::unique_ptr<KvpoolServer>> server = KvpoolServer::Start(*config);
#endif
  if (!server.ok()) {
    spdlog::error("cannot start: {}", server.status().ToString());
    return 1;
  }
  const int port = (*server)->port();
  const std::string host = config->listen.substr(0, config->listen.rfind(':'));
  spdlog::info("{} serving on {}:{} (device {}, pool {} MiB, slab {} KiB, {} workers)",
               kvpool::server::KvpoolVersion(), host, port, config->device,
               (*server)->config().pool_bytes >> 20, config->slab_bytes >> 10,
               config->worker_threads);
  // The readiness line of the text log; a JSON log holds log objects only (the line above).
  if (*log_format == kvpool::server::LogFormat::kText) {
    std::printf("kvpoold listening on %s:%d\n", host.c_str(), port);
    std::fflush(stdout);
  }
  // Before --port_file: whoever waits for that one finds this one written.
  if (!config->metrics_port_file.empty() &&
      !WritePortFile(config->metrics_port_file, (*server)->metrics_port())) {
    spdlog::error("cannot write --metrics_port_file {}", config->metrics_port_file);
    (*server)->Shutdown(std::chrono::milliseconds(0));
    (*server)->Wait();
    return 1;
  }

  if (!config->health_port_file.empty() &&
      !WritePortFile(config->health_port_file, (*server)->health_port())) {
    spdlog::error("cannot write --health_port_file {}", config->health_port_file);
    (*server)->Shutdown(std::chrono::milliseconds(0));
    (*server)->Wait();
    return 1;
  }

  if (!config->port_file.empty() && !WritePortFile(config->port_file, port)) {
    spdlog::error("cannot write --port_file {}", config->port_file);
    (*server)->Shutdown(std::chrono::milliseconds(0));
    (*server)->Wait();
    return 1;
  }

  KvpoolServer* srv = server->get();
  const auto grace = std::chrono::milliseconds(config->shutdown_grace_ms);
  std::atomic<bool> stopped{false};
  std::thread stopper([&stop_signals, &stopped, srv, grace] {
    int sig = 0;
    while (sigwait(&stop_signals, &sig) == 0 && sig == SIGHUP) {
      const absl::Status reloaded = srv->ReloadTenants();
      spdlog::info("SIGHUP: tenants file {}", reloaded.ok() ? "re-read" : reloaded.ToString());
    }
    if (stopped.load()) return;  // woken by main: the server already stopped
    spdlog::info("received {}", sig == SIGTERM ? "SIGTERM" : "SIGINT");
    srv->Drain(grace);
  });
  srv->Wait();
  const int status = srv->exit_status();
  // The server stopped without a signal (AdminService.Drain, a failed device): wake the signal
  // thread.
  stopped.store(true);
  pthread_kill(stopper.native_handle(), SIGTERM);
  stopper.join();
  server->reset();
  spdlog::info("stopped");
  return status;
}
