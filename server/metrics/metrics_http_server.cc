#include "server/metrics/metrics_http_server.h"

#include <atomic>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "httplib.h"
#include "server/config.h"

namespace kvpool::server {
namespace {

constexpr size_t kServingThreads = 2;
constexpr size_t kMaxRequestBodyBytes = 1024;
constexpr time_t kIdleSeconds = 5;

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& listen, Render render) {
  absl::StatusOr<HostPort> address = ParseHostPort(listen);
  if (!address.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_listen: ", address.status().message()));
  }
  auto s = std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer());
  s->http_ = std::make_unique<httplib::Server>();
  httplib::Server& http = *s->http_;
  http.new_task_queue = [] { return new httplib::ThreadPool(kServingThreads); };
  http.set_read_timeout(kIdleSeconds);
  http.set_write_timeout(kIdleSeconds);
  http.set_keep_alive_timeout(kIdleSeconds);
  http.set_payload_max_length(kMaxRequestBodyBytes);
  http.Get("/metrics",
           [render = std::move(render)](const httplib::Request&, httplib::Response& response) {
             response.set_content(render(), kPrometheusContentType);
           });
  const std::string host = address->host.empty() ? "0.0.0.0" : address->host;
  if (address->port == 0) {
    s->port_ = http.bind_to_any_port(host);
    if (s->port_ < 0) s->port_ = 0;
  } else if (http.bind_to_port(host, address->port)) {
    s->port_ = address->port;
  }
  if (s->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", listen));
  }
  auto ended = std::make_shared<std::atomic<bool>>(false);
  s->thread_ = std::thread([&http, ended] {
    http.listen_after_bind();
    ended->store(true);
  });
  // Stop() right after Start() must find the loop running, or it could not end it.
  while (!http.is_running() && !ended->load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return s;
}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

void MetricsHttpServer::Stop() {
  if (http_ != nullptr) http_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace kvpool::server
