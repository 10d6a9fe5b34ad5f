// FuzzDaemon: the in-process kvpoold that the RPC fuzz targets call (server/server.h:
// CPU backend, a 32 MiB pool, two worker threads, the daemon's default request limits, no UCX),
// reached through an in-process gRPC channel, with a base state that lets inputs get past the
// "not found" checks:
//   model "m"     2 layers, 4 query heads, 2 KV heads, head_dim 32, Hadamard, uniform INT2,
//                 blocks of 8 tokens, sink 8, recent 16
//   sequence "s"  40 tokens of "m" (token ids 0..39: sink, history and recent all hold rows)
//   sequence "e"  of "m", created and empty
// Reset() returns to exactly that state (every model deleted with its sequences and cached
// prefixes, then the base state built again), so that each input starts from the same state.
//
//   FuzzDaemon& d = FuzzDaemon::Get();
//   auto stub = kvpool::v1::SequenceService::NewStub(d.channel());
//   ... one RPC ...
//   if (changed) FUZZ_CHECK(d.Reset().ok(), "reset");
//
// One per process, created on first use and shut down at exit. Not thread-safe (fuzz targets
// run one input at a time).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "kvpool/v1/stats_service.grpc.pb.h"
#include "server/server.h"

namespace kvpool::fuzz {

inline constexpr char kModelId[] = "m";
inline constexpr char kSequenceId[] = "s";
inline constexpr char kEmptySequenceId[] = "e";
inline constexpr int kLayers = 2, kQHeads = 4, kKvHeads = 2, kHeadDim = 32;
inline constexpr int kBaseTokens = 40;
inline constexpr int kBlockTokens = 8, kSinkTokens = 8, kRecentTokens = 16;
// A call that takes longer than this wedged the daemon (the targets treat it as a crash).
inline constexpr std::chrono::seconds kCallDeadline{30};

class FuzzDaemon {
 public:
  // The process's daemon with `transports` (kvpoold --transports: "" for grpc_inline only),
  // started and reset on the first call. Aborts when it cannot start.
  static FuzzDaemon& Get(const std::string& transports = "");

  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  server::KvpoolServer* server() { return server_.get(); }

  // Back to the base state.
  [[nodiscard]] absl::Status Reset();
  // What an input may not change unless it succeeded in changing it: pool usage, models and
  // sequences (GetStats without the service, transport and lifecycle counters and the
  // sequences' idle times).
  [[nodiscard]] absl::StatusOr<::kvpool::v1::GetStatsResponse> StateSnapshot();

  // Sets a deadline of kCallDeadline on `ctx`.
  static void SetDeadline(grpc::ClientContext* ctx);

 private:
  FuzzDaemon() = default;
  absl::Status Start(const std::string& transports);
  absl::Status BuildBaseState();

  std::unique_ptr<server::KvpoolServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
};

}  // namespace kvpool::fuzz
