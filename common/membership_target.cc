#include "common/membership_target.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "common/dns_query.h"
#include "common/quote.h"
#include "common/status_macros.h"

namespace kvpool {
namespace {

constexpr absl::string_view kDnsScheme = "dns://";
// How long a DNS server is given to answer.
constexpr absl::Duration kDnsServerTimeout = absl::Seconds(5);

bool IsHostByte(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_';
}

// "host:port" -> host, port; host of host-name bytes (IPv4 literals included).
absl::Status SplitHostPort(absl::string_view text, std::string* host, uint16_t* port) {
  const size_t colon = text.rfind(':');
  if (colon == absl::string_view::npos || colon == 0) {
    return absl::InvalidArgumentError(absl::StrCat("expected host:port, got ", Quote(text)));
  }
  const absl::string_view h = text.substr(0, colon);
  const absl::string_view p = text.substr(colon + 1);
  if (h.size() > kMaxEndpointBytes - 6 || !std::all_of(h.begin(), h.end(), IsHostByte)) {
    return absl::InvalidArgumentError(absl::StrCat("bad host in ", Quote(text)));
  }
  uint32_t value = 0;
  if (p.empty() || p.size() > 5 || !std::all_of(p.begin(), p.end(), absl::ascii_isdigit) ||
      !absl::SimpleAtoi(p, &value) || value == 0 || value > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("bad port in ", Quote(text)));
  }
  *host = std::string(h);
  *port = static_cast<uint16_t>(value);
  return absl::OkStatus();
}

// A DNS authority: "IPv4[:port]" or "[IPv6][:port]" -> server, port (53 when not given).
absl::Status ParseDnsAuthority(absl::string_view text, std::string* server, uint16_t* port) {
  absl::string_view address = text;
  absl::string_view port_text;
  bool has_port = false;
  const bool bracketed = absl::ConsumePrefix(&address, "[");
  if (bracketed) {
    const size_t close = address.find(']');
    if (close == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("bad DNS server ", Quote(text)));
    }
    absl::string_view rest = address.substr(close + 1);
    address = address.substr(0, close);
    if (!rest.empty()) {
      if (!absl::ConsumePrefix(&rest, ":")) {
        return absl::InvalidArgumentError(absl::StrCat("bad DNS server ", Quote(text)));
      }
      has_port = true;
      port_text = rest;
    }
  } else if (const size_t colon = address.find(':'); colon != absl::string_view::npos) {
    has_port = true;
    port_text = address.substr(colon + 1);
    address = address.substr(0, colon);
  }
  const std::string address_text(address);
  in_addr v4{};
  in6_addr v6{};
  if (address.empty() || address.size() > INET6_ADDRSTRLEN ||
      (bracketed ? inet_pton(AF_INET6, address_text.c_str(), &v6) != 1
                 : inet_pton(AF_INET, address_text.c_str(), &v4) != 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("DNS server ", Quote(text), " must be an IPv4 address or [IPv6 address]"));
  }
  uint32_t value = 53;
  if (has_port) {
    if (port_text.empty() || port_text.size() > 5 ||
        !std::all_of(port_text.begin(), port_text.end(), absl::ascii_isdigit) ||
        !absl::SimpleAtoi(port_text, &value) || value == 0 || value > 65535) {
      return absl::InvalidArgumentError(absl::StrCat("bad DNS server port in ", Quote(text)));
    }
  }
  *server = address_text;
  *port = static_cast<uint16_t>(value);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<MembershipTarget> ParseMembershipTarget(absl::string_view text) {
  MembershipTarget target;
  if (absl::StartsWith(text, "dns:")) {
    const absl::string_view whole = text;
    const size_t slash = text.find('/', kDnsScheme.size());
    if (!absl::ConsumePrefix(&text, kDnsScheme) || slash == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "membership target ", Quote(whole),
          ": expected dns:///NAME:PORT (system resolver) or dns://SERVER[:PORT]/NAME:PORT"));
    }
    const absl::string_view authority = text.substr(0, slash - kDnsScheme.size());
    text = text.substr(authority.size() + 1);
    if (!authority.empty()) {
      absl::Status s = ParseDnsAuthority(authority, &target.dns_server, &target.dns_server_port);
      if (!s.ok())
        return absl::InvalidArgumentError(absl::StrCat("membership target: ", s.message()));
    }
    std::string host;
    uint16_t port = 0;
    absl::Status s = SplitHostPort(text, &host, &port);
    if (!s.ok())
      return absl::InvalidArgumentError(absl::StrCat("membership target: ", s.message()));
    target.dns_host = std::move(host);
    target.dns_port = port;
    return target;
  }
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    item = absl::StripAsciiWhitespace(item);
    if (item.empty()) continue;
    MembershipTarget::Entry entry;
    const size_t eq = item.find('=');
    absl::string_view endpoint = item.substr(0, eq);
    if (eq != absl::string_view::npos) {
      const absl::string_view w = item.substr(eq + 1);
      uint64_t weight = 0;
      if (w.empty() || !std::all_of(w.begin(), w.end(), absl::ascii_isdigit) ||
          !absl::SimpleAtoi(w, &weight) || weight == 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("membership target: bad weight in ", Quote(item)));
      }
      entry.weight = weight;
    }
    std::string host;
    uint16_t port = 0;
    absl::Status s = SplitHostPort(endpoint, &host, &port);
    if (!s.ok())
      return absl::InvalidArgumentError(absl::StrCat("membership target: ", s.message()));
    entry.endpoint = absl::StrCat(host, ":", port);
    target.entries.push_back(std::move(entry));
    if (target.entries.size() > kMaxMembers) {
      return absl::InvalidArgumentError("membership target: too many endpoints");
    }
  }
  if (target.entries.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("membership target ", Quote(text), " names no endpoint"));
  }
  return target;
}

absl::StatusOr<std::vector<Member>> ResolveMembershipTarget(const MembershipTarget& target,
                                                            uint64_t default_weight) {
  std::vector<Member> members;
  if (!target.is_dns()) {
    for (const MembershipTarget::Entry& e : target.entries) {
      members.push_back(Member{e.endpoint, e.weight.value_or(default_weight)});
    }
    return members;
  }
  if (!target.dns_server.empty()) {
    KVPOOL_ASSIGN_OR_RETURN(std::vector<std::string> addresses,
                            QueryDnsAddresses(target.dns_server, target.dns_server_port,
                                              target.dns_host, kDnsServerTimeout));
    for (const std::string& ip : addresses) {
      if (members.size() >= kMaxMembers) break;
      const bool v6 = ip.find(':') != std::string::npos;
      members.push_back(Member{v6 ? absl::StrCat("[", ip, "]:", target.dns_port)
                                  : absl::StrCat(ip, ":", target.dns_port),
                               default_weight});
    }
    return members;
  }
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(target.dns_host.c_str(), nullptr, &hints, &found);
  if (rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("resolving ", Quote(target.dns_host), ": ", gai_strerror(rc)));
  }
  for (const addrinfo* a = found; a != nullptr && members.size() < kMaxMembers; a = a->ai_next) {
    if (a->ai_family != AF_INET || a->ai_addr == nullptr) continue;
    char ip[INET_ADDRSTRLEN] = {};
    const auto* sin = reinterpret_cast<const sockaddr_in*>(a->ai_addr);
    if (inet_ntop(AF_INET, &sin->sin_addr, ip, sizeof(ip)) == nullptr) continue;
    members.push_back(Member{absl::StrCat(ip, ":", target.dns_port), default_weight});
  }
  freeaddrinfo(found);
  std::sort(members.begin(), members.end(),
            [](const Member& a, const Member& b) { return a.endpoint < b.endpoint; });
  members.erase(std::unique(members.begin(), members.end()), members.end());
  return members;
}

}  // namespace kvpool
