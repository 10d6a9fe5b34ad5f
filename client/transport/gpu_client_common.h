// What the GPU data plane's clients (gpu_push.h, gpu_attention.h) share: switching NVLink multicast
// off in the calling process, waiting for NCCL communicators, and joining an NCCL session
// negotiated through TransportService (status conversions come from common/).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "kvpool/v1/transport_service.grpc.pb.h"

namespace kvpool::client::gpu_internal {

// Sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 (NVLink
// multicast can take a shared host's GPUs out of service); called before any NCCL use.
void DisableNvlinkMulticast();

// Whether to ask for blocking data-plane operations (NcclOffer.blocking_ops): yes,
// unless KVPOOL_NCCL_BLOCKING_OPS=0 (kept for A/B measurements and as a way back).
bool WantBlockingOps();

// Polls the non-blocking communicator `comm` until its pending operation (a join, a split)
// finished: OK; the operation's NCCL error (prefixed by `what`); DeadlineExceeded after
// `deadline`; or the first error `give_up()` returns (the caller's reasons to stop waiting).
absl::Status AwaitComm(ncclComm_t comm, const char* what, absl::Time deadline,
                       const std::function<absl::Status()>& give_up);

// Rank 0's half of the daemon's JoinNcclComm(blocking_ops): splits the joined `parent` into a
// blocking communicator (groups launch on the calling thread, not a new one per group) and
// aborts the parent. A non-blocking parent's split is polled until `deadline` or until
// `give_up()` returns an error; on any failure the parent is aborted and the error returned.
absl::StatusOr<ncclComm_t> SplitBlocking(ncclComm_t parent, absl::Time deadline,
                                         const std::function<absl::Status()>& give_up);

// A joined NCCL session: this process's end (rank 0) of the communicator and the daemon's answer.
struct NcclSessionJoin {
  ncclComm_t comm = nullptr;
  ::kvpool::v1::NcclSession session;
};

// The first exchange of a channel on its joined communicator, made before the daemon answers
// (the daemon makes its half before it does): gives up at `deadline` or with give_up()'s error.
using ConnectPeer = std::function<absl::Status(ncclComm_t comm, absl::Time deadline,
                                               const std::function<absl::Status()>& give_up)>;

// Opens an NCCL session for `use`: calls TransportService.Negotiate offering NCCL (a fresh
// ncclUniqueId, `timeout`, blocking operations unless KVPOOL_NCCL_BLOCKING_OPS=0) and meanwhile
// joins the two-rank communicator as rank 0 (non-blocking, so that the daemon's refusal or its
// silence ends the wait), splits it into a blocking one when blocking operations were asked for,
// and makes the first exchange (`connect`, when set). The daemon's error first; UNAVAILABLE when
// it answers another transport (it hosts no NCCL), DEADLINE_EXCEEDED when it does not join.
absl::StatusOr<NcclSessionJoin> JoinNcclSession(::kvpool::v1::TransportService::Stub& stub,
                                                ::kvpool::v1::NcclChannelUse use,
                                                absl::Duration timeout,
                                                const std::string& client_name,
                                                const ConnectPeer& connect);

}  // namespace kvpool::client::gpu_internal
