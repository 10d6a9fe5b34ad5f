// DeviceHealthMonitor: watches the compute backend's device (ComputeBackend::DeviceHealth) for a
// sticky CUDA error that poisoned its context. At the first failure it calls `on_failure` once
// (kvpoold turns health NOT_SERVING; the backend already answers every compute call
// UNAVAILABLE), and `exit_grace` later `on_exit` once (kvpoold shuts down and exits non-zero so
// that its supervisor restarts it). A host backend never fails: the monitor only waits.
//
//   DeviceHealthMonitor monitor(backend, {absl::Seconds(1), absl::Seconds(5)}, on_failure,
//   on_exit); monitor.Start();
//   ...
//   monitor.Stop();   // also on destruction
//
// Thread-safety: Start and Stop from one thread, never from a callback; the callbacks run on the
// monitor's thread.
#pragma once

#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/backend.h"

namespace kvpool::server {

class DeviceHealthMonitor {
 public:
  struct Options {
    absl::Duration check_period = absl::Seconds(1);  // how often DeviceHealth is asked
    absl::Duration exit_grace = absl::Seconds(5);    // from the failure to on_exit
  };

  DeviceHealthMonitor(ComputeBackend* backend, Options options,
                      std::function<void(const absl::Status&)> on_failure,
                      std::function<void()> on_exit);
  ~DeviceHealthMonitor();

  DeviceHealthMonitor(const DeviceHealthMonitor&) = delete;
  DeviceHealthMonitor& operator=(const DeviceHealthMonitor&) = delete;

  void Start();
  // Ends the monitor's thread (at once, also during the grace: then on_exit is not called).
  void Stop();

 private:
  void Run();
  // Waits up to `d` for Stop; true when stopped.
  bool WaitForStop(absl::Duration d);

  ComputeBackend* const backend_;
  const Options options_;
  const std::function<void(const absl::Status&)> on_failure_;
  const std::function<void()> on_exit_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvpool::server
