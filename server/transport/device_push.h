// DevicePush: one push of prefill K/V whose bytes move GPU to GPU, as a transport of device
// memory (NCCL, CUDA IPC) receives it. TransportService.PushKv's stream carries the control
// messages (server/transport/device_push_reactor.h: the header begins the append in the ingest
// engine, each chunk message is handed here); the transport brings each chunk's rows into GPU
// memory of the daemon (an NCCL receive into a slot, a copy from the client's mapped buffer) and
// stages them into the append straight from there (IngestAppend::StageDevice).
//
//   KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<DevicePush> push,
//                           transport->OpenDevicePush(tenant, session_id, cancelled));
//   options.max_pending_chunks = push->max_pending_chunks();
//   ... KVPOOL_ASSIGN_OR_RETURN(bool more, push->Stage(chunk, *append)); ...
//   push->End(status, sequence_id);
//
// Thread-safe; the object stays alive until every chunk it staged has finished.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/ingest/ingest_append.h"

namespace kvpool::server {

// A client GPU buffer exported with cudaIpcGetMemHandle (kvpool.v1.CudaIpcBuffer).
struct IpcBufferRef {
  std::string handle;
  uint64_t offset = 0;
};

// One chunk message of a device push (kvpool.v1.DevicePushChunk), already checked against its
// append (IngestAppend::CheckChunk).
struct DeviceChunk {
  int32_t layer = 0;
  uint32_t token_offset = 0;
  uint32_t num_tokens = 0;
  size_t bytes = 0;   // of its K, and of its V: num_tokens BF16 rows of the model
  IpcBufferRef k, v;  // CUDA IPC only
};

class DevicePush {
 public:
  virtual ~DevicePush() = default;

  // Chunks the push may have handed over and not yet staged (the transport's device slots).
  virtual size_t max_pending_chunks() const = 0;

  // Brings the chunk's rows into the daemon's GPU memory and hands them to `append`
  // (StageDevice): whether the producer may go on now. An error fails the push.
  [[nodiscard]] virtual absl::StatusOr<bool> Stage(const DeviceChunk& chunk,
                                                   IngestAppend& append) = 0;

  // The push ended with `status` (OK once committed). On an error the transport releases what
  // the peer may be blocked on (an NCCL channel is aborted: the client's sends then fail).
  virtual void End(const absl::Status& status, const std::string& sequence_id) = 0;
};

}  // namespace kvpool::server
