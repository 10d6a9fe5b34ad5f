// The version of the API kvpoold speaks: the protobuf package (a new major version is a new
// package, kvpool.v2, served beside the old one) and a revision within it, raised by one in
// every release that adds to the package (new fields, messages, RPCs, enum values). Revisions
// of one package stay wire-compatible (tests/wire_compat/ checks it against the previous
// release's descriptors); the revision is the one place it is kept. Clients read it from
// GetStats (BuildInfo) to know which additions a daemon has.
#pragma once

#include <cstdint>

namespace kvpool {

inline constexpr char kApiPackage[] = "kvpool.v1";
inline constexpr uint32_t kApiRevision = 1;

}  // namespace kvpool
