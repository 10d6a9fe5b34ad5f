// LocalDaemon: runs a real kvpoold process on a loopback port for tests, demos and benchmarks.
//
// Start() launches the binary with --listen=127.0.0.1:0 (the kernel picks a free port) and
// --port_file in a private temporary directory, waits for the port file, then for the gRPC
// health status SERVING. Its stdout and stderr go to a log file in that directory (log_path()),
// whose tail is quoted in errors. Stop() sends SIGTERM and waits for a clean exit (status 0).
// The destructor kills a daemon that is still running (SIGKILL) and removes the directory. On
// Linux the daemon also gets SIGKILL if the thread that started it exits, so a crashed test
// leaves no daemon behind.
//
//   LocalDaemonOptions options;
//   options.binary = "build/bin/kvpoold";
//   options.flags = {"--pool_bytes=268435456", "--worker_threads=2"};
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<LocalDaemon> daemon, LocalDaemon::Start(options));
//   KVPOOL_ASSIGN_OR_RETURN(auto client, KvpoolClient::Connect(daemon->target()));
//   ...
//   KVPOOL_RETURN_IF_ERROR(daemon->Stop());
//
// Not thread-safe: start and stop a daemon from one thread.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/kvpool_client.h"

namespace kvpool::client {

struct LocalDaemonOptions {
  // Path of the kvpoold binary.
  std::string binary;
  // Further flags (e.g. --pool_bytes=...). --listen and --port_file are added by Start.
  std::vector<std::string> flags;
  // The loopback address and port of --listen (0: the kernel picks), e.g. 127.0.0.3 for one of
  // several daemons that must be told apart by address (scale-out tests).
  std::string listen_host = "127.0.0.1";
  int listen_port = 0;
  // How long to wait for the port file and then for SERVING (generous: loaded machines).
  absl::Duration startup_timeout = absl::Seconds(120);
  // Echo the daemon's log to this process's stderr instead of a file.
  bool inherit_output = false;
  // Where the log goes when not inherited: empty for log_path() in the private directory; a
  // path given here outlives the daemon (a test harness prints it after a failure).
  std::string log_file;
  // When positive, the daemon's soft and hard descriptor limits (RLIMIT_NOFILE), as
  // `prlimit --nofile=N:N` would set them.
  uint64_t max_open_files = 0;
  // How Start's health check connects (TLS options when the flags turn TLS on).
  ClientOptions client;
};

class LocalDaemon {
 public:
  // Launches the daemon and waits until it serves. FailedPrecondition when the binary is not
  // executable; Internal when it exits early or never serves (with the log's tail).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<LocalDaemon>> Start(
      const LocalDaemonOptions& options);
  ~LocalDaemon();
  LocalDaemon(const LocalDaemon&) = delete;
  LocalDaemon& operator=(const LocalDaemon&) = delete;

  // "HOST:PORT" (listen_host, the port it listens on).
  std::string target() const;
  int port() const { return port_; }
  pid_t pid() const { return pid_; }
  // A private directory that lives as long as this object (e.g. for a --model_dir).
  const std::string& dir() const { return dir_; }
  const std::string& log_path() const { return log_path_; }
  // The last `max_bytes` of the daemon's log ("" with inherit_output).
  std::string LogTail(size_t max_bytes = 4000) const;

  // Sends SIGTERM and waits up to `timeout` for the process to exit. OK only when it exited
  // with status 0; Internal otherwise (then it is killed), naming the status and the log tail.
  [[nodiscard]] absl::Status Stop(absl::Duration timeout = absl::Seconds(60));
  // Whether the process is still running (reaps it when it has exited).
  bool Running();
  // Waits up to `timeout` for the process to exit on its own (no signal is sent); true with its
  // wait status (waitpid's) when it exited.
  bool WaitExit(absl::Duration timeout, int* wait_status);

 private:
  LocalDaemon() = default;

  pid_t pid_ = -1;
  std::string host_ = "127.0.0.1";
  int port_ = 0;
  std::string dir_;
  std::string log_path_;
  bool exited_ = false;
  int exit_status_ = 0;
};

// Creates a fresh private temporary directory ("/tmp/kvpool-XXXXXX" or under $TMPDIR).
[[nodiscard]] absl::StatusOr<std::string> MakeTempDir(const std::string& prefix);
// Removes a directory tree (best effort).
void RemoveTree(const std::string& path);

}  // namespace kvpool::client
