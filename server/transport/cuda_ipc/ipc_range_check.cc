#include "server/transport/cuda_ipc/ipc_range_check.h"

#include "absl/strings/str_cat.h"

namespace kvpool::server {

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
