#include "server/auth/tenants_source.h"

#include "common/file_read.h"
#include "common/status_macros.h"
#include "spdlog/spdlog.h"

namespace kvpool::server {

absl::StatusOr<std::unique_ptr<TenantsSource>> TenantsSource::Open(const std::string& path,
                                                                   absl::Duration poll_period) {
  KVPOOL_ASSIGN_OR_RETURN(std::string text, ReadRegularFile(path, kMaxFileBytes));
  KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<const TenantDirectory> dir,
                          TenantDirectory::Parse(text, path));
  auto src = std::unique_ptr<TenantsSource>(new TenantsSource(path, poll_period));
  {
    absl::MutexLock lock(&src->reload_mu_);
    src->content_ = std::move(text);
  }
  absl::MutexLock lock(&src->mu_);
  src->current_ = std::move(dir);
  return src;
}

TenantsSource::~TenantsSource() { Stop(); }

void TenantsSource::Start() {
  poller_ = std::thread([this] {
    absl::MutexLock lock(&mu_);
    while (!mu_.AwaitWithTimeout(absl::Condition(&stopping_), poll_period_)) {
      mu_.Unlock();
      (void)Reload();  // logged and counted there
      mu_.Lock();
    }
  });
}

void TenantsSource::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (poller_.joinable()) poller_.join();
}

absl::Status TenantsSource::Reload() {
  absl::MutexLock reload_lock(&reload_mu_);
  absl::StatusOr<std::string> text = ReadRegularFile(path_, kMaxFileBytes);
  absl::StatusOr<std::shared_ptr<const TenantDirectory>> dir =
      text.ok() ? TenantDirectory::Parse(*text, path_)
                : absl::StatusOr<std::shared_ptr<const TenantDirectory>>(text.status());
  if (text.ok() && *text == content_) return absl::OkStatus();
  if (!dir.ok()) {
    // Counted and logged once per bad content (or read error), not once per poll.
    const std::string failure = text.ok() ? *text : dir.status().ToString();
    if (failure != failed_content_) {
      ++reload_failures_;
      spdlog::error("tenants file not reloaded, the previous one stays in force: {}",
                    dir.status().ToString());
      failed_content_ = failure;
    }
    return dir.status();
  }
  std::shared_ptr<const TenantDirectory> before;
  {
    absl::MutexLock lock(&mu_);
    before = std::move(current_);
    current_ = *dir;
  }
  content_ = *std::move(text);
  failed_content_.clear();
  ++reloads_;
  spdlog::info("tenants file {} reloaded: {} tenants", path_, (*dir)->tenants().size());
  if (on_change_) on_change_(*before, **dir);
  return absl::OkStatus();
}

std::shared_ptr<const TenantDirectory> TenantsSource::current() const {
  absl::MutexLock lock(&mu_);
  return current_;
}

}  // namespace kvpool::server
