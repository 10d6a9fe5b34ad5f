#include "server/logging/request_context.h"

#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_format.h"

namespace kvpool::server {
namespace {

thread_local std::string current_request_id;

}  // namespace

bool IsValidRequestId(absl::string_view id) {
  if (id.empty() || id.size() > kMaxRequestIdBytes) return false;
  for (const char c : id) {
    if (c < '!' || c > '~') return false;
  }
  return true;
}

std::string NewRequestId() {
  thread_local absl::BitGen bits;
  return absl::StrFormat("%016x%016x", absl::Uniform<uint64_t>(bits),
                         absl::Uniform<uint64_t>(bits));
}

std::string RequestIdFromClient(absl::string_view sent) {
  return IsValidRequestId(sent) ? std::string(sent) : NewRequestId();
}

absl::string_view CurrentRequestId() { return current_request_id; }

ScopedRequestId::ScopedRequestId(std::string id)
    : previous_(std::exchange(current_request_id, std::move(id))) {}

ScopedRequestId::~ScopedRequestId() { current_request_id = std::move(previous_); }

}  // namespace kvpool::server
