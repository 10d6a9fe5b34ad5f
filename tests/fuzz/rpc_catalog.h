// The RPCs the rpc fuzz target drives, by the number its input's first byte selects (modulo
// kRpcCount), shared with the seed generator. For a client-streaming RPC the rest of the input
// is its messages, each framed by a varint length (FuzzInput::Framed); for the others it is
// the one request message.
#pragma once

#include <cstdint>

namespace kvpool::fuzz {

enum class Rpc : uint8_t {
  kRegisterModel = 0,  // ModelService, client-streaming
  kListModels,
  kDescribeModel,  // server-streaming
  kDeleteModel,
  kCreateSequence,  // SequenceService
  kAppendKv,        // client-streaming
  kAppendDecode,
  kSealSequence,
  kReleaseSequence,
  kDescribeSequence,
  kLookupPrefix,
  kReadBlocks,  // ReadService, server-streaming
  kReadKv,      // server-streaming
  kAttend,      // AttentionService
  kGetStats,    // StatsService
  kNegotiate,   // TransportService
  kCloseSession,
  kSetAttentionPlan,  // (UNAVAILABLE on the CPU backend: no NCCL attention channels)
  kDropAttentionPlan,
  kPushKv,         // client-streaming (UNAVAILABLE on the CPU backend: no device transports)
  kWatchSession,   // server-streaming
  kReloadTenants,  // AdminService (no tenants file here: FAILED_PRECONDITION; Drain is not
                   // fuzzed, it ends the daemon every later input needs)
  kFetchToDevice,  // TransportService (UNAVAILABLE on the CPU backend: no device fetches)
  kRpcCount
};

inline constexpr int kRpcCount = static_cast<int>(Rpc::kRpcCount);

}  // namespace kvpool::fuzz
