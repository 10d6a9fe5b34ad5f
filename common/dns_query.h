// Asks one DNS server for a name's addresses (A and AAAA records), with c-ares: the resolution
// behind a membership target with a DNS authority (`dns://SERVER/NAME:PORT`,
// common/membership_target.h). No search domains, no hosts file, no other server.
//
//   KVPOOL_ASSIGN_OR_RETURN(std::vector<std::string> ips,
//                           QueryDnsAddresses("10.96.0.10", 53, "kvpool-headless.ns.svc",
//                                             absl::Seconds(5)));
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace kvpool {

// The textual addresses (IPv4 dotted, IPv6 without brackets) of `name`'s A and AAAA records as
// `server` (an IP literal) at `server_port` answers them, sorted, without duplicates. Blocks up
// to `timeout`. InvalidArgument for a server that is not an IP address; NotFound when the server
// says the name does not exist or has neither record; Unavailable when it does not answer in time
// or answers with an error.
[[nodiscard]] absl::StatusOr<std::vector<std::string>> QueryDnsAddresses(const std::string& server,
                                                                         uint16_t server_port,
                                                                         const std::string& name,
                                                                         absl::Duration timeout);

}  // namespace kvpool
