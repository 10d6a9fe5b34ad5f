#include "server/transport/device/push_trace.h"

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "spdlog/spdlog.h"

namespace kvpool::server {

bool PushTrace::Enabled() {
  static const bool on = [] {
    const char* v = std::getenv("KVPOOL_TRACE_GPU_PUSH");
    return v != nullptr && v[0] == '1';
  }();
  return on;
}

PushTrace::PushTrace() : start_(absl::Now()) {}

int PushTrace::AddChunk(int layer, int offset, int tokens) {
  if (!Enabled()) return 0;
  absl::MutexLock lock(&mu_);
  chunks_.push_back(Chunk{layer, offset, tokens, {}});
  return static_cast<int>(chunks_.size()) - 1;
}

void PushTrace::Mark(int chunk, Event e) {
  if (!Enabled()) return;
  const double us = absl::ToDoubleMicroseconds(absl::Now() - start_);
  absl::MutexLock lock(&mu_);
  if (chunk >= 0 && chunk < static_cast<int>(chunks_.size())) chunks_[chunk].us[e] = us;
}

void PushTrace::Log(const std::string& sequence_id, const absl::Status& status) {
  if (!Enabled()) return;
  absl::MutexLock lock(&mu_);
  std::string line =
      absl::StrCat("push ", sequence_id, " ", status.ok() ? "ok" : "failed", " in ",
                   absl::ToDoubleMicroseconds(absl::Now() - start_),
                   " us; chunks (layer@offset+tokens: read/slot/posted/ready/staged us):");
  for (const Chunk& c : chunks_) {
    absl::StrAppend(&line, " ", c.layer, "@", c.offset, "+", c.tokens, ":", c.us[kRead], "/",
                    c.us[kSlot], "/", c.us[kPosted], "/", c.us[kReady], "/", c.us[kStaged]);
  }
  spdlog::info("{}", line);
}

}  // namespace kvpool::server
