#include "server/transport/gpu/gpu_push_checks.h"

#include <climits>

#include "absl/strings/str_cat.h"

namespace kvpool::server {

absl::Status CheckGpuPushHeader(const ::kvpool::v1::GpuPushHeader& h, int max_append_tokens) {
  if (h.sequence_id().empty()) return absl::InvalidArgumentError("sequence_id is empty");
  if (max_append_tokens < 1 || h.num_tokens() < 1 ||
      h.num_tokens() > static_cast<uint32_t>(max_append_tokens) ||
      h.token_start() > static_cast<uint32_t>(INT32_MAX - max_append_tokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tokens must be in [1, ", max_append_tokens, "], got ", h.num_tokens()));
  }
  return absl::OkStatus();
}

absl::StatusOr<size_t> CheckGpuPushChunk(const ::kvpool::v1::GpuPushChunk& c, int push_tokens,
                                         size_t row_bytes) {
  if (push_tokens < 1 || c.num_tokens() < 1 ||
      c.num_tokens() > static_cast<uint32_t>(push_tokens) ||
      c.token_offset() > static_cast<uint32_t>(push_tokens) - c.num_tokens()) {
    return absl::InvalidArgumentError(absl::StrCat("chunk [", c.token_offset(), ", +",
                                                   c.num_tokens(), ") does not fit the push's ",
                                                   push_tokens, " tokens"));
  }
  size_t bytes = 0;
  if (__builtin_mul_overflow(size_t{c.num_tokens()}, row_bytes, &bytes)) {
    return absl::InvalidArgumentError("chunk size overflows");
  }
  return bytes;
}

absl::Status CheckIpcRange(uint64_t offset, size_t bytes, size_t allocation_bytes,
                           const char* what) {
  if (offset % 16 != 0 || offset > allocation_bytes || bytes > allocation_bytes - offset) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": offset ", offset, " + ", bytes,
                                                   " bytes lies outside the ", allocation_bytes,
                                                   "-byte buffer (or is not 16-byte aligned)"));
  }
  return absl::OkStatus();
}

}  // namespace kvpool::server
