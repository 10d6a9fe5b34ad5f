#include "common/dns_query.h"

#include <ares.h>
#include <arpa/inet.h>
#include <arpa/nameser.h>
#include <netinet/in.h>
#include <poll.h>

#include <algorithm>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "common/quote.h"

namespace kvpool {
namespace {

// Records kept per answer; a membership has at most a few thousand members.
constexpr int kMaxRecordsPerAnswer = 4096;

struct QueryState {
  int pending = 0;
  std::vector<std::string> addresses;
  // The first failure other than "no such name / no record of this type".
  int error = ARES_SUCCESS;
  int not_found = 0;         // answers that said the name or the record type does not exist
  bool out_of_time = false;  // the deadline passed with a query still pending
};

void NoteFailure(QueryState* state, int status) {
  if (status == ARES_ENOTFOUND || status == ARES_ENODATA) {
    ++state->not_found;
  } else if (state->error == ARES_SUCCESS) {
    state->error = status;
  }
}

void OnAnswer(void* arg, int status, int /*timeouts*/, unsigned char* abuf, int alen, int family) {
  auto* state = static_cast<QueryState*>(arg);
  --state->pending;
  if (status != ARES_SUCCESS) {
    NoteFailure(state, status);
    return;
  }
  // c-ares parses (and bounds-checks) the server's bytes; only the addresses come out.
  char text[INET6_ADDRSTRLEN] = {};
  if (family == AF_INET) {
    std::vector<ares_addrttl> records(kMaxRecordsPerAnswer);
    int count = kMaxRecordsPerAnswer;
    const int rc = ares_parse_a_reply(abuf, alen, nullptr, records.data(), &count);
    if (rc != ARES_SUCCESS) return NoteFailure(state, rc);
    for (int i = 0; i < count; ++i) {
      if (inet_ntop(AF_INET, &records[i].ipaddr, text, sizeof(text)) != nullptr) {
        state->addresses.emplace_back(text);
      }
    }
  } else {
    std::vector<ares_addr6ttl> records(kMaxRecordsPerAnswer);
    int count = kMaxRecordsPerAnswer;
    const int rc = ares_parse_aaaa_reply(abuf, alen, nullptr, records.data(), &count);
    if (rc != ARES_SUCCESS) return NoteFailure(state, rc);
    for (int i = 0; i < count; ++i) {
      if (inet_ntop(AF_INET6, &records[i].ip6addr, text, sizeof(text)) != nullptr) {
        state->addresses.emplace_back(text);
      }
    }
  }
}

void OnAAnswer(void* arg, int status, int timeouts, unsigned char* abuf, int alen) {
  OnAnswer(arg, status, timeouts, abuf, alen, AF_INET);
}
void OnAaaaAnswer(void* arg, int status, int timeouts, unsigned char* abuf, int alen) {
  OnAnswer(arg, status, timeouts, abuf, alen, AF_INET6);
}

absl::Status InitLibraryOnce() {
  static const int rc = ares_library_init(ARES_LIB_INIT_ALL);
  if (rc != ARES_SUCCESS) {
    return absl::InternalError(absl::StrCat("c-ares: ", ares_strerror(rc)));
  }
  return absl::OkStatus();
}

// Owns a c-ares channel.
class Channel {
 public:
  Channel() = default;
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;
  ~Channel() {
    if (initialized_) ares_destroy(channel_);
  }
  absl::Status Init(const std::string& servers_csv, absl::Duration timeout) {
    ares_options options{};
    // Two tries, each half the whole timeout; the name as given (no search list).
    options.timeout =
        static_cast<int>(std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout) / 2));
    options.tries = 2;
    options.flags = ARES_FLAG_NOSEARCH | ARES_FLAG_NOALIASES;
    options.ndots = 0;
    const int mask = ARES_OPT_TIMEOUTMS | ARES_OPT_TRIES | ARES_OPT_FLAGS | ARES_OPT_NDOTS;
    int rc = ares_init_options(&channel_, &options, mask);
    if (rc != ARES_SUCCESS) {
      return absl::UnavailableError(absl::StrCat("c-ares init: ", ares_strerror(rc)));
    }
    initialized_ = true;
    rc = ares_set_servers_ports_csv(channel_, servers_csv.c_str());
    if (rc != ARES_SUCCESS) {
      return absl::InvalidArgumentError(
          absl::StrCat("DNS server ", Quote(servers_csv), ": ", ares_strerror(rc)));
    }
    return absl::OkStatus();
  }
  ares_channel get() const { return channel_; }

 private:
  ares_channel channel_ = nullptr;
  bool initialized_ = false;
};

// Runs `channel` until no query is pending or `deadline` passes (then cancels what is left,
// whose callbacks see ARES_ECANCELLED).
void Drive(ares_channel channel, QueryState* state, absl::Time deadline) {
  while (state->pending > 0) {
    ares_socket_t sockets[ARES_GETSOCK_MAXNUM];
    const int bits = ares_getsock(channel, sockets, ARES_GETSOCK_MAXNUM);
    pollfd fds[ARES_GETSOCK_MAXNUM];
    nfds_t n = 0;
    for (int i = 0; i < ARES_GETSOCK_MAXNUM; ++i) {
      short events = 0;
      if (ARES_GETSOCK_READABLE(bits, i)) events |= POLLIN;
      if (ARES_GETSOCK_WRITABLE(bits, i)) events |= POLLOUT;
      if (events == 0) continue;
      fds[n++] = pollfd{sockets[i], events, 0};
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) break;
    timeval max_wait = absl::ToTimeval(left);
    timeval wait{};
    ares_timeout(channel, &max_wait, &wait);
    const int wait_ms = static_cast<int>(wait.tv_sec * 1000 + (wait.tv_usec + 999) / 1000);
    const int ready = poll(fds, n, std::max(wait_ms, 1));
    if (ready <= 0) {
      // Timeout (or an interrupted wait): let c-ares retry or expire its queries.
      ares_process_fd(channel, ARES_SOCKET_BAD, ARES_SOCKET_BAD);
      continue;
    }
    for (nfds_t i = 0; i < n; ++i) {
      const bool readable = (fds[i].revents & (POLLIN | POLLERR | POLLHUP)) != 0;
      const bool writable = (fds[i].revents & POLLOUT) != 0;
      ares_process_fd(channel, readable ? fds[i].fd : ARES_SOCKET_BAD,
                      writable ? fds[i].fd : ARES_SOCKET_BAD);
    }
  }
  if (state->pending > 0) {
    state->out_of_time = true;
    ares_cancel(channel);
  }
}

}  // namespace

absl::StatusOr<std::vector<std::string>> QueryDnsAddresses(const std::string& server,
                                                           uint16_t server_port,
                                                           const std::string& name,
                                                           absl::Duration timeout) {
  in_addr v4{};
  in6_addr v6{};
  std::string servers_csv;
  if (inet_pton(AF_INET, server.c_str(), &v4) == 1) {
    servers_csv = absl::StrCat(server, ":", server_port);
  } else if (inet_pton(AF_INET6, server.c_str(), &v6) == 1) {
    servers_csv = absl::StrCat("[", server, "]:", server_port);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("DNS server ", Quote(server), " is not an IP address"));
  }
  if (server_port == 0) return absl::InvalidArgumentError("DNS server port 0");
  if (absl::Status s = InitLibraryOnce(); !s.ok()) return s;
  QueryState state;  // outlives the channel, whose destruction may still call back
  Channel channel;
  if (absl::Status s = channel.Init(servers_csv, timeout); !s.ok()) return s;

  state.pending = 2;
  ares_query(channel.get(), name.c_str(), ns_c_in, ns_t_a, OnAAnswer, &state);
  ares_query(channel.get(), name.c_str(), ns_c_in, ns_t_aaaa, OnAaaaAnswer, &state);
  Drive(channel.get(), &state, absl::Now() + timeout);

  const std::string where = absl::StrCat(Quote(name), " at DNS server ", servers_csv);
  if (state.addresses.empty()) {
    if (state.out_of_time) {
      return absl::UnavailableError(
          absl::StrCat("resolving ", where, ": no answer within ", absl::FormatDuration(timeout)));
    }
    if (state.error != ARES_SUCCESS) {
      return absl::UnavailableError(
          absl::StrCat("resolving ", where, ": ", ares_strerror(state.error)));
    }
    return absl::NotFoundError(absl::StrCat("resolving ", where, ": no A or AAAA record"));
  }
  std::sort(state.addresses.begin(), state.addresses.end());
  state.addresses.erase(std::unique(state.addresses.begin(), state.addresses.end()),
                        state.addresses.end());
  return state.addresses;
}

}  // namespace kvpool
