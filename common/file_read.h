// Reading whole files that may have been named by someone untrusted: regular files only, with a
// size limit checked before anything is allocated, errors as statuses (never an exception).
//
//   KVPOOL_ASSIGN_OR_RETURN(std::string bytes, ReadRegularFile(path, /*max_bytes=*/64 << 20));
//
//   // Inside a directory only, without following a path out of it (symlinks, "..", absolute):
//   KVPOOL_ASSIGN_OR_RETURN(std::string bytes, ReadRegularFileBeneath(dir, "llama/rot.st", max));
//
// Thread-safe (no shared state).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvpool {

// The whole content of the regular file at `path`.
// NotFound: no such file. PermissionDenied: not readable. InvalidArgument: not a regular file
// (a directory, device, FIFO, socket) or larger than `max_bytes`. DataLoss: a
// read error or a file that changed size while being read.
[[nodiscard]] absl::StatusOr<std::string> ReadRegularFile(const std::string& path,
                                                          uint64_t max_bytes);

// The whole content of the regular file `relative` inside the directory `dir`, resolved so that
// no step leaves `dir` (openat2 with RESOLVE_BENEATH where the kernel has it; otherwise the
// resolved path is checked). A path that is absolute, climbs out with "..", or crosses a
// symbolic link that leads outside is PermissionDenied whether or not its target exists, so the
// answer reveals nothing about files outside `dir`. Missing files inside `dir` are NotFound; the
// other errors are ReadRegularFile's. FailedPrecondition when `dir` itself cannot be opened.
[[nodiscard]] absl::StatusOr<std::string> ReadRegularFileBeneath(const std::string& dir,
                                                                 absl::string_view relative,
                                                                 uint64_t max_bytes);

}  // namespace kvpool
