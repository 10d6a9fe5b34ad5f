// Loopback addresses for tests and benchmarks that run several daemons on one machine, each on
// its own address (127.0.0.2-5), all on one port, as pods of a headless Service would be.
//
//   const int port = FreePortOnAllHosts(kLoopbackHosts);   // 0: none found
//   options.listen_host = kLoopbackHosts[i];
#pragma once

#include "absl/types/span.h"

namespace kvpool::testing {

inline constexpr const char* kLoopbackHosts[] = {"127.0.0.2", "127.0.0.3", "127.0.0.4",
                                                 "127.0.0.5"};

// A TCP port free on every address of `hosts` (bound on each, then released: the daemons bind
// it next), or 0 when 50 attempts found none.
int FreePortOnAllHosts(absl::Span<const char* const> hosts);

}  // namespace kvpool::testing
