// TenantsSource: the daemon's tenants file (--tenants_file), read at start and re-read when its
// content changes (polled) or on demand (SIGHUP). A file that fails to parse on reload is
// logged and counted, and the directory in force stays; at start it is an error.
//
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<TenantsSource> src,
//                           TenantsSource::Open(path, absl::Seconds(1)));
//   src->OnChange([](const TenantDirectory& before, const TenantDirectory& after) { ... });
//   src->Start();                       // polls every period until Stop or destruction
//   std::shared_ptr<const TenantDirectory> dir = src->current();
//
// Thread-safe. OnChange callbacks run on the thread that reloaded (the poller or Reload's
// caller), one at a time, after `current()` already returns the new directory.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/auth/tenant_directory.h"

namespace kvpool::server {

class TenantsSource {
 public:
  // Largest tenants file read.
  static constexpr uint64_t kMaxFileBytes = 16u << 20;

  // Reads and parses `path` (errors as TenantDirectory::Parse, or the read's).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<TenantsSource>> Open(
      const std::string& path, absl::Duration poll_period);
  ~TenantsSource();

  using ChangeCallback =
      std::function<void(const TenantDirectory& before, const TenantDirectory& after)>;
  // Called after each reload that changed the file's content. Set before Start.
  void OnChange(ChangeCallback callback) { on_change_ = std::move(callback); }
  void Start();
  void Stop();

  // Re-reads the file now. OK when it is unchanged or was applied; otherwise the error, and
  // the directory in force stays.
  absl::Status Reload();

  std::shared_ptr<const TenantDirectory> current() const;
  const std::string& path() const { return path_; }
  uint64_t reloads() const { return reloads_.load(); }
  uint64_t reload_failures() const { return reload_failures_.load(); }

 private:
  TenantsSource(std::string path, absl::Duration poll_period)
      : path_(std::move(path)), poll_period_(poll_period) {}

  const std::string path_;
  const absl::Duration poll_period_;
  ChangeCallback on_change_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const TenantDirectory> current_ ABSL_GUARDED_BY(mu_);
  absl::Mutex reload_mu_;  // one reload at a time
  std::string content_ ABSL_GUARDED_BY(reload_mu_);
  // The content (or read error) of the last refused reload.
  std::string failed_content_ ABSL_GUARDED_BY(reload_mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread poller_;
  std::atomic<uint64_t> reloads_{0};
  std::atomic<uint64_t> reload_failures_{0};
};

}  // namespace kvpool::server
