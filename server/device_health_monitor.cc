#include "server/device_health_monitor.h"

#include <utility>

namespace kvpool::server {

DeviceHealthMonitor::DeviceHealthMonitor(ComputeBackend* backend, Options options,
                                         std::function<void(const absl::Status&)> on_failure,
                                         std::function<void()> on_exit)
    : backend_(backend),
      options_(options),
      on_failure_(std::move(on_failure)),
      on_exit_(std::move(on_exit)) {}

DeviceHealthMonitor::~DeviceHealthMonitor() { Stop(); }

void DeviceHealthMonitor::Start() {
  if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
}

void DeviceHealthMonitor::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

bool DeviceHealthMonitor::WaitForStop(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithTimeout(absl::Condition(&stop_), d);
}

void DeviceHealthMonitor::Run() {
  while (!WaitForStop(options_.check_period)) {
    const absl::Status health = backend_->DeviceHealth();
    if (health.ok()) continue;
    on_failure_(health);
    if (!WaitForStop(options_.exit_grace)) on_exit_();
    return;
  }
}

}  // namespace kvpool::server
