// The membership target: what names the daemons of a scale-out deployment, for clients
// (`--target`) and daemons (`--peers`), and its resolution to candidate members
// (docs/scale-out.md).
//
//   "10.0.0.1:50051,10.0.0.2:50051"          a static list (all weights equal)
//   "10.0.0.1:50051=8589934592,10.0.0.2:50051=4294967296"   a static list with weights
//   "dns:///kvpool-headless.ns.svc:50051"     every A record of the name, at that port
//   "dns://10.96.0.10/kvpool-headless.ns.svc:50051"       the same, asking that DNS server
//   "dns://127.0.0.1:5353/kvpool-headless.test:50051"     (A and AAAA records; server port 53
//                                                          unless given; [v6]:port for IPv6)
//
//   KVPOOL_ASSIGN_OR_RETURN(MembershipTarget target, ParseMembershipTarget(text));
//   KVPOOL_ASSIGN_OR_RETURN(std::vector<Member> candidates,
//                           ResolveMembershipTarget(target, /*default_weight=*/1));
//
// Without an authority (dns:///) a DNS name is resolved with the system resolver (getaddrinfo,
// IPv4), so /etc/hosts and the cluster's resolv.conf apply. With one (dns://SERVER/), gRPC's
// target syntax, the name's A and AAAA records are asked of that server alone (c-ares), with no
// search domains and no hosts file; SERVER is an IP address.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/placement.h"

namespace kvpool {

struct MembershipTarget {
  struct Entry {
    std::string endpoint;            // "host:port"
    std::optional<uint64_t> weight;  // absent: the resolver's default weight
  };
  // A static list (entries) or a DNS name (dns_host, dns_port), asked of the system resolver or,
  // where dns_server is set, of that DNS server (an IP literal) at dns_server_port.
  std::vector<Entry> entries;
  std::string dns_host;
  uint16_t dns_port = 0;
  std::string dns_server;
  uint16_t dns_server_port = 53;
  bool is_dns() const { return !dns_host.empty(); }
};

// Parses `text` (forms above). InvalidArgument for an empty list, an entry without a numeric
// port in 1..65535, a weight that is not a positive integer, a DNS authority that is not an IP
// address (with an optional port), or a name with bytes a host name cannot have.
[[nodiscard]] absl::StatusOr<MembershipTarget> ParseMembershipTarget(absl::string_view text);

// The candidate members `target` names now: its entries (weight `default_weight` where none was
// given), or every address of its DNS name with weight `default_weight`. Blocks for a DNS
// lookup. System resolver: Unavailable when the name does not resolve. DNS server: NotFound when
// the server says the name does not exist or has no address, Unavailable when it does not answer
// within a few seconds or answers with an error.
[[nodiscard]] absl::StatusOr<std::vector<Member>> ResolveMembershipTarget(
    const MembershipTarget& target, uint64_t default_weight);

}  // namespace kvpool
