#include "dataplane/fd_passing.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvpool::server {

absl::Status SendWithFd(int sock, absl::Span<const uint8_t> bytes, int fd) {
  iovec iov{const_cast<uint8_t*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  ssize_t n;
  do {
    n = sendmsg(sock, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n != static_cast<ssize_t>(bytes.size())) {
    return absl::UnavailableError(
        absl::StrCat("sendmsg: ", n < 0 ? std::strerror(errno) : "short"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> ReceiveWithFd(int sock, absl::Span<uint8_t> out, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  size_t got = 0;
  int fd = -1;
  auto fail = [&](absl::Status s) -> absl::StatusOr<int> {
    if (fd >= 0) close(fd);
    return s;
  };
  while (got < out.size()) {
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms <= 0) return fail(absl::DeadlineExceededError("no message on the Unix socket in time"));
    pollfd p{sock, POLLIN, 0};
    const int r = poll(&p, 1, static_cast<int>(ms));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return fail(absl::UnavailableError(absl::StrCat("poll: ", std::strerror(errno))));
    if (r == 0) continue;
    iovec iov{out.data() + got, out.size() - got};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))] = {};
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n < 0) return fail(absl::UnavailableError(absl::StrCat("recvmsg: ", std::strerror(errno))));
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      int fds[2] = {-1, -1};
      std::memcpy(fds, CMSG_DATA(c), std::min(count, size_t{2}) * sizeof(int));
      for (size_t i = 0; i < count && i < 2; ++i) {
        if (fd < 0 && i == 0) {
          fd = fds[0];
        } else {
          close(fds[i]);
          return fail(absl::InvalidArgumentError("more than one descriptor attached"));
        }
      }
    }
    if ((msg.msg_flags & MSG_CTRUNC) != 0) {
      return fail(absl::InvalidArgumentError("descriptors truncated"));
    }
    if (n == 0) return fail(absl::UnavailableError("peer closed the Unix socket"));
    got += static_cast<size_t>(n);
  }
  return fd;
}

}  // namespace kvpool::server
