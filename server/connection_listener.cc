#include "server/connection_listener.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/config.h"
#include "spdlog/spdlog.h"

namespace kvpool::server {
namespace {

// Descriptors the daemon keeps for itself beside its connections (files, UCX, gRPC's pollers,
// logs): a quarter of the limit, between 32 and 256.
uint64_t ReservedDescriptors(uint64_t limit) { return std::clamp<uint64_t>(limit / 4, 32, 256); }

}  // namespace

uint64_t RaiseOpenFileLimit() {
  struct rlimit lim;
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) return 1024;
  if (lim.rlim_cur < lim.rlim_max) {
    struct rlimit raised = lim;
    raised.rlim_cur = lim.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) lim = raised;
  }
  return lim.rlim_cur == RLIM_INFINITY ? uint64_t{1} << 20 : static_cast<uint64_t>(lim.rlim_cur);
}

absl::StatusOr<int> ConnectionCap(uint64_t open_file_limit, int requested) {
  const uint64_t reserved = ReservedDescriptors(open_file_limit);
  if (open_file_limit <= reserved) {
    return absl::InvalidArgumentError(
        absl::StrCat("the descriptor limit ", open_file_limit, " leaves no room for connections"));
  }
  const uint64_t room = std::min<uint64_t>(open_file_limit - reserved, INT32_MAX);
  if (requested <= 0) return static_cast<int>(room);
  if (static_cast<uint64_t>(requested) > room) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_connections=", requested, " does not fit under the descriptor limit of ",
        open_file_limit, " (at most ", room, ", ", reserved, " kept for the daemon itself)"));
  }
  return requested;
}

absl::StatusOr<std::unique_ptr<ConnectionListener>> ConnectionListener::Bind(
    const std::string& listen) {
  absl::StatusOr<HostPort> at = ParseHostPort(listen);
  if (!at.ok()) return at.status();
  const std::string host = at->host;
  const std::string port = std::to_string(at->port);
  struct addrinfo hints;
  std::memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  struct addrinfo* found = nullptr;
  const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found);
  if (rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve '", listen, "': ", gai_strerror(rc)));
  }
  auto listener = std::unique_ptr<ConnectionListener>(new ConnectionListener());
  std::string last_error = "no address";
  for (struct addrinfo* a = found; a != nullptr && listener->listen_fd_ < 0; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, SOMAXCONN) != 0) {
      last_error = std::strerror(errno);
      close(fd);
      continue;
    }
    listener->listen_fd_ = fd;
  }
  freeaddrinfo(found);
  if (listener->listen_fd_ < 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", listen, ": ", last_error));
  }
  struct sockaddr_storage bound;
  socklen_t len = sizeof(bound);
  if (getsockname(listener->listen_fd_, reinterpret_cast<struct sockaddr*>(&bound), &len) != 0) {
    return absl::InternalError(absl::StrCat("getsockname: ", std::strerror(errno)));
  }
  listener->port_ =
      ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<struct sockaddr_in6*>(&bound)->sin6_port
                                        : reinterpret_cast<struct sockaddr_in*>(&bound)->sin_port);
  listener->wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  listener->spare_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (listener->wake_fd_ < 0 || listener->spare_fd_ < 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("no descriptors for the listener: ", std::strerror(errno)));
  }
  return listener;
}

ConnectionListener::~ConnectionListener() {
  Stop();
  if (wake_fd_ >= 0) close(wake_fd_);
  if (spare_fd_ >= 0) close(spare_fd_);
}

void ConnectionListener::Start(grpc::experimental::ExternalConnectionAcceptor* acceptor,
                               int max_connections) {
  acceptor_ = acceptor;
  max_connections_ = max_connections;
  thread_ = std::thread([this] { Loop(); });
}

void ConnectionListener::Stop() {
  if (stopped_.exchange(true)) return;
  if (wake_fd_ >= 0) {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
  }
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) close(listen_fd_);
  listen_fd_ = -1;
}

ConnectionStats ConnectionListener::Stats() const {
  ConnectionStats s;
  s.open = open_count_.load();
  s.accepted = accepted_.load();
  s.refused_at_cap = refused_at_cap_.load();
  s.refused_no_descriptors = refused_no_descriptors_.load();
  return s;
}

void ConnectionListener::Loop() {
  struct pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
  while (!stopped_.load()) {
    const int n = poll(fds, 2, -1);
    if (n < 0 && errno != EINTR) {
      spdlog::error("listener: poll failed: {}", std::strerror(errno));
      usleep(10000);
      continue;
    }
    if (n > 0 && (fds[0].revents & POLLIN) != 0) Accept();
  }
}

size_t ConnectionListener::PruneClosed() {
  for (auto it = open_.begin(); it != open_.end();) {
    struct stat st;
    const bool same = fstat(it->first, &st) == 0 && st.st_dev == it->second.first &&
                      st.st_ino == it->second.second;
    it = same ? std::next(it) : open_.erase(it);
  }
  open_count_.store(open_.size());
  return open_.size();
}

void ConnectionListener::Accept() {
  // Take every queued connection; the socket is non-blocking, so EAGAIN ends the round.
  while (!stopped_.load()) {
    int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE) {
        // Out of descriptors: use the spare one to take the connection off the queue and refuse
        // it, so the queue never wedges and the client learns at once.
        close(spare_fd_);
        fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd >= 0) close(fd);
        spare_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
        ++refused_no_descriptors_;
        spdlog::warn("listener: out of descriptors; refused a connection");
        if (fd < 0) return;
        continue;
      }
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        spdlog::warn("listener: accept failed: {}", std::strerror(errno));
        usleep(10000);
      }
      return;
    }
    if (open_.size() >= static_cast<size_t>(max_connections_) &&
        PruneClosed() >= static_cast<size_t>(max_connections_)) {
      close(fd);
      if (refused_at_cap_++ % 1000 == 0) {
        spdlog::warn("listener: {} connections open, the --max_connections cap; refusing",
                     max_connections_);
      }
      continue;
    }
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    struct stat st;
    if (fstat(fd, &st) != 0) {
      close(fd);
      continue;
    }
    open_[fd] = {st.st_dev, st.st_ino};
    open_count_.store(open_.size());
    ++accepted_;
    grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters params;
    params.listener_fd = listen_fd_;
    params.fd = fd;
    acceptor_->HandleNewConnection(&params);  // gRPC owns fd from here
  }
}

}  // namespace kvpool::server
