// IpcMappings: the clients' CUDA IPC allocations mapped into kvpoold, shared by every push of the
// CUDA IPC transport. CUDA maps one handle once per process, so mappings are reference counted
// (one reference per push that names the handle) and closed when their last push ends.
//
//   KVPOOL_ASSIGN_OR_RETURN(auto mapped, mappings.Open(device, handle));  // base, bytes
//   ...
//   mappings.Close(device, handle);
//
// Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace kvpool::server {

class IpcMappings {
 public:
  // The mapped base of `handle` (a cudaIpcMemHandle_t's bytes) on `device` and the size of its
  // allocation. InvalidArgument (handle size, a handle CUDA cannot map), Unavailable (no driver
  // entry point to size the allocation).
  absl::StatusOr<std::pair<uint8_t*, size_t>> Open(int device, const std::string& handle);
  // Drops a reference taken by Open; the last one unmaps.
  void Close(int device, const std::string& handle);

 private:
  struct Mapping {
    uint8_t* ptr;
    size_t bytes;
    int refs;
  };
  absl::Mutex mu_;
  std::map<std::string, Mapping> maps_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvpool::server
