// ConnectionListener: kvpoold's own TCP accept loop in front of gRPC, so that the daemon owns its
// descriptor budget. gRPC's built-in listener stops accepting for good after one EMFILE
// (grpc/grpc#16058, #20418); this one caps the connections it holds below the process's
// descriptor limit, refuses (accepts and closes at once) the ones over the cap, keeps one spare
// descriptor so that even an exhausted process can take a connection off the queue and close it,
// and hands every accepted connection to gRPC through its external connection acceptor.
//
//   KVPOOL_ASSIGN_OR_RETURN(auto listener, ConnectionListener::Bind("127.0.0.1:0"));
//   builder.experimental().AddExternalConnectionAcceptor(...) -> acceptor
//   server = builder.BuildAndStart();
//   listener->Start(acceptor.get(), /*max_connections=*/1000);
//   ...
//   listener->Stop();   // before the server shuts down
//
// A connection counts as open until gRPC closes its descriptor (checked by the descriptor's
// identity when the count reaches the cap). Thread-safe: Stats may be called from any thread.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>

#include "absl/status/statusor.h"
#include "grpcpp/server_builder.h"

namespace kvpool::server {

struct ConnectionStats {
  uint64_t open = 0;      // connections handed to gRPC and not yet closed (as of the last check)
  uint64_t accepted = 0;  // handed to gRPC since start
  uint64_t refused_at_cap = 0;          // closed at once: --max_connections reached
  uint64_t refused_no_descriptors = 0;  // closed at once: the process had no descriptor left
};

// Raises this process's soft RLIMIT_NOFILE to its hard limit; returns the new soft limit.
uint64_t RaiseOpenFileLimit();

// The connection cap for a descriptor limit: `requested` when positive and it leaves room for
// the daemon's own descriptors, else the limit minus that room. InvalidArgument when `requested`
// does not fit under the limit.
absl::StatusOr<int> ConnectionCap(uint64_t open_file_limit, int requested);

class ConnectionListener {
 public:
  // Binds and listens on "host:port" (port 0: a free one). Unavailable when the address cannot
  // be bound; InvalidArgument when it cannot be parsed or resolved.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<ConnectionListener>> Bind(
      const std::string& listen);
  ~ConnectionListener();
  ConnectionListener(const ConnectionListener&) = delete;
  ConnectionListener& operator=(const ConnectionListener&) = delete;

  int port() const { return port_; }

  // Starts the accept thread: connections go to `acceptor` (which must outlive Stop) while fewer
  // than `max_connections` are open.
  void Start(grpc::experimental::ExternalConnectionAcceptor* acceptor, int max_connections);
  // Stops accepting and closes the listening socket; connections already handed over stay
  // gRPC's. Idempotent.
  void Stop();

  ConnectionStats Stats() const;

 private:
  ConnectionListener() = default;
  void Loop();
  void Accept();
  // Drops the connections whose descriptors gRPC has closed; returns how many remain.
  size_t PruneClosed();

  int listen_fd_ = -1;
  int wake_fd_ = -1;   // eventfd: Stop wakes the loop
  int spare_fd_ = -1;  // closed to make room when the process runs out of descriptors
  int port_ = 0;
  int max_connections_ = 0;
  grpc::experimental::ExternalConnectionAcceptor* acceptor_ = nullptr;
  std::thread thread_;
  std::atomic<bool> stopped_{false};
  // Accept-thread only: each handed-over descriptor and the (device, inode) it had.
  std::unordered_map<int, std::pair<dev_t, ino_t>> open_;
  std::atomic<uint64_t> open_count_{0};
  std::atomic<uint64_t> accepted_{0};
  std::atomic<uint64_t> refused_at_cap_{0};
  std::atomic<uint64_t> refused_no_descriptors_{0};
};

}  // namespace kvpool::server
