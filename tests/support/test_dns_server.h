// A minimal DNS server for tests: what a cluster's DNS is to a headless Service, on loopback.
// It answers A queries for one name with a list of IPv4 addresses (changeable while it runs),
// AAAA queries for that name with no record, and NXDOMAIN for every other name; malformed
// datagrams are dropped. UDP only, on 127.0.0.1 and a free port, served by its own thread until
// it is destroyed.
//
//   TestDnsServer dns("kvpool-headless.test", {"127.0.0.2", "127.0.0.3"});
//   ASSERT_TRUE(dns.ok());
//   const std::string target = absl::StrCat("dns://127.0.0.1:", dns.port(),
//                                           "/kvpool-headless.test:", grpc_port);
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvpool::testing {

class TestDnsServer {
 public:
  // `name` without a trailing dot (compared without regard to case); `ipv4` dotted quads.
  TestDnsServer(std::string name, std::vector<std::string> ipv4);
  ~TestDnsServer();
  TestDnsServer(const TestDnsServer&) = delete;
  TestDnsServer& operator=(const TestDnsServer&) = delete;

  // Whether the socket is bound and every address parsed.
  bool ok() const { return fd_ >= 0; }
  uint16_t port() const { return port_; }
  // Replaces the addresses the name resolves to (dotted quads); false if one does not parse.
  bool SetAddresses(const std::vector<std::string>& ipv4);
  // Queries answered so far (any name, any type).
  uint64_t answered() const { return answered_.load(); }

 private:
  void Serve();
  // The reply to one datagram, or empty to drop it.
  std::string Answer(const uint8_t* query, size_t size);

  const std::string name_;
  int fd_ = -1;
  uint16_t port_ = 0;
  absl::Mutex mu_;
  std::vector<uint32_t> addresses_ ABSL_GUARDED_BY(mu_);  // network byte order
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> answered_{0};
  std::thread thread_;
};

}  // namespace kvpool::testing
