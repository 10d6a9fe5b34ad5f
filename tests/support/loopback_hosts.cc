#include "tests/support/loopback_hosts.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <vector>

namespace kvpool::testing {

int FreePortOnAllHosts(absl::Span<const char* const> hosts) {
  for (int attempt = 0; attempt < 50; ++attempt) {
    std::vector<int> fds;
    int port = 0;
    bool ok = true;
    for (size_t i = 0; i < hosts.size() && ok; ++i) {
      const int fd = socket(AF_INET, SOCK_STREAM, 0);
      fds.push_back(fd);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_port = htons(static_cast<uint16_t>(port));
      ok = fd >= 0 && inet_pton(AF_INET, hosts[i], &addr.sin_addr) == 1 &&
           bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
      if (ok && i == 0) {
        socklen_t len = sizeof(addr);
        ok = getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
        port = ntohs(addr.sin_port);
      }
    }
    for (int fd : fds) {
      if (fd >= 0) close(fd);
    }
    if (ok && port != 0) return port;
  }
  return 0;
}

}  // namespace kvpool::testing
