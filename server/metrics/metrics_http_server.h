// MetricsHttpServer: the plaintext HTTP/1.1 port (--metrics_listen) that answers
// `GET /metrics` with a page from a callback (Prometheus text format). It serves nothing else:
// every other path answers 404, request bodies over 1 KiB 413, and a connection idle for 5 s is
// closed. It runs its own two threads, apart from gRPC's and the workers.
//
//   KVPOOL_ASSIGN_OR_RETURN(auto http, MetricsHttpServer::Start("127.0.0.1:0", render));
//   int port = http->port();
//   http->Stop();  // also on destruction
//
// Thread-safe; `render` is called from the server's threads, one scrape at a time per thread.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace httplib {
class Server;
}

namespace kvpool::server {

class MetricsHttpServer {
 public:
  using Render = std::function<std::string()>;
  // Binds `listen` (host:port, port 0 picks one) and starts serving. InvalidArgument for a bad
  // address, Unavailable when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& listen,
                                                                  Render render);
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }
  // Stops accepting and waits for the serving thread. Idempotent.
  void Stop();

 private:
  MetricsHttpServer() = default;

  std::unique_ptr<httplib::Server> http_;
  std::thread thread_;
  int port_ = 0;
};

// Content-Type of the Prometheus text format.
inline constexpr char kPrometheusContentType[] = "text/plain; version=0.0.4; charset=utf-8";

}  // namespace kvpool::server
