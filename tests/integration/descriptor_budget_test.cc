// kvpoold owns its descriptor budget: under a small descriptor limit, more idle connections than
// the limit allows never wedge its listener (gRPC's own accept loop stopped accepting for good
// after one EMFILE), and once they close a new client is served.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/integration/integration_util.h"

namespace kvpool::integration {
namespace {

// A plain TCP connection to 127.0.0.1:port that sends nothing; -1 when connect fails.
int ConnectIdle(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  struct sockaddr_in addr {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<struct sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// A fresh client's GetStats, retried until the deadline passes.
absl::StatusOr<v1::GetStatsResponse> ServedWithin(const std::string& target,
                                                  absl::Duration timeout) {
  const absl::Time give_up = absl::Now() + timeout;
  absl::Status last = absl::DeadlineExceededError("never tried");
  while (absl::Now() < give_up) {
    client::ClientOptions options;
    options.deadline = absl::Seconds(5);
    absl::StatusOr<std::unique_ptr<KvpoolClient>> c = KvpoolClient::Connect(target, options);
    if (c.ok()) {
      absl::StatusOr<v1::GetStatsResponse> stats = (*c)->GetStats();
      if (stats.ok()) return stats;
      last = stats.status();
    } else {
      last = c.status();
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
  return last;
}

TEST(DescriptorBudgetTest, IdleConnectionsBeyondTheLimitNeverWedgeTheListener) {
  client::LocalDaemonOptions options;
  options.binary = KvpooldPath();
  options.flags = {"--pool_bytes=16777216", "--worker_threads=2",
                   "--transports=", "--log_level=warn"};
  options.max_open_files = 256;  // as under `prlimit --nofile=256:256`
  options.startup_timeout = absl::Seconds(180);
  absl::StatusOr<std::unique_ptr<LocalDaemon>> daemon = LocalDaemon::Start(options);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string target = (*daemon)->target();

  std::vector<int> idle;
  for (int i = 0; i < 400; ++i) {
    const int fd = ConnectIdle((*daemon)->port());
    ASSERT_GE(fd, 0) << "connect " << i;
    idle.push_back(fd);
  }
  // Every connection has been taken off the listen queue (held or refused) once a gRPC client
  // made after them is answered or refused; either way the daemon is still running.
  absl::SleepFor(absl::Seconds(1));
  ASSERT_TRUE((*daemon)->Running()) << (*daemon)->LogTail();
  for (int fd : idle) close(fd);
  absl::StatusOr<v1::GetStatsResponse> served = ServedWithin(target, absl::Seconds(120));
  ASSERT_TRUE(served.ok()) << served.status() << "\n" << (*daemon)->LogTail();
  // 256 descriptors leave room for 192 connections (64 kept for the daemon itself); the other
  // idle connections were refused at once instead of exhausting the descriptors.
  EXPECT_EQ(served->limits().max_connections(), 192u);
  EXPECT_GE(served->connections().refused_at_cap(), 400u - 192u);
  EXPECT_EQ(served->connections().refused_no_descriptors(), 0u);

  // And again: the listener keeps working after any number of such rounds.
  idle.clear();
  for (int i = 0; i < 400; ++i) idle.push_back(ConnectIdle((*daemon)->port()));
  for (int fd : idle) {
    if (fd >= 0) close(fd);
  }
  EXPECT_TRUE(ServedWithin(target, absl::Seconds(120)).ok()) << (*daemon)->LogTail();
  EXPECT_TRUE((*daemon)->Stop().ok());
}

}  // namespace
}  // namespace kvpool::integration
