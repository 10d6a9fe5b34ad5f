#include "client/transport/gpu_client_common.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/cuda_status.h"
#include "common/nccl_status.h"
#include "common/status_macros.h"
#include "proto/status.h"

namespace kvpool::client::gpu_internal {

void DisableNvlinkMulticast() {
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1", 1);
  setenv("NVSHMEM_DISABLE_NVLS", "1", 1);
}

bool WantBlockingOps() {
  const char* v = std::getenv("KVPOOL_NCCL_BLOCKING_OPS");
  return v == nullptr || v[0] != '0';
}

absl::Status AwaitComm(ncclComm_t comm, const char* what, absl::Time deadline,
                       const std::function<absl::Status()>& give_up) {
  while (true) {
    ncclResult_t state = ncclInProgress;
    if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) state = ncclInternalError;
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) return NcclStatus(state, what);
    KVPOOL_RETURN_IF_ERROR(give_up());
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(what, ": the daemon did not take part"));
    }
    absl::SleepFor(absl::Microseconds(200));
  }
}

absl::StatusOr<ncclComm_t> SplitBlocking(ncclComm_t parent, absl::Time deadline,
                                         const std::function<absl::Status()>& give_up) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  ncclComm_t child = nullptr;
  const ncclResult_t r = ncclCommSplit(parent, /*color=*/0, /*key=*/0, &child, &config);
  absl::Status s = (r == ncclSuccess || r == ncclInProgress)
                       ? AwaitComm(parent, "splitting the NCCL communicator", deadline, give_up)
                       : NcclStatus(r, "ncclCommSplit");
  ncclCommAbort(parent);  // the child has resources of its own (splitShare is off)
  if (!s.ok()) return s;
  if (child == nullptr) return absl::InternalError("ncclCommSplit gave no communicator");
  return child;
}

absl::StatusOr<NcclSessionJoin> JoinNcclSession(::kvpool::v1::TransportService::Stub& stub,
                                                ::kvpool::v1::NcclChannelUse use,
                                                absl::Duration timeout,
                                                const std::string& client_name,
                                                const ConnectPeer& connect) {
  namespace v1 = ::kvpool::v1;
  ncclUniqueId id;
  KVPOOL_RETURN_IF_ERROR(NcclStatus(ncclGetUniqueId(&id), "ncclGetUniqueId"));
  const bool blocking_ops = WantBlockingOps();
  v1::NegotiateRequest req;
  req.set_client_name(client_name);
  v1::TransportOffer* offer = req.add_offers();
  offer->set_kind(v1::TRANSPORT_KIND_NCCL);
  offer->mutable_nccl()->set_unique_id(std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
  offer->mutable_nccl()->set_timeout_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(timeout)));
  offer->mutable_nccl()->set_blocking_ops(blocking_ops);
  offer->mutable_nccl()->set_use(use);
  v1::NegotiateResponse resp;
  grpc::Status rpc;
  std::atomic<bool> rpc_done{false};
  // The daemon joins as rank 1 (then splits and makes its half of the first exchange) while this
  // thread does the same as rank 0; it answers once all of that is done.
  std::thread t([&] {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout) + 5000));
    rpc = stub.Negotiate(&ctx, req, &resp);
    rpc_done.store(true, std::memory_order_release);
  });
  // The daemon will not join once it answered: an error, or another transport.
  auto refusal = [&]() -> absl::Status {
    if (!rpc.ok()) return FromGrpcStatus(rpc, "Negotiate");
    if (resp.kind() != v1::TRANSPORT_KIND_NCCL) {
      return absl::UnavailableError(absl::StrCat(
          "the daemon offers no NCCL (it answered ", v1::TransportKind_Name(resp.kind()),
          "): NCCL needs kvpoold --device=cuda:N built with CUDA and NCCL"));
    }
    return absl::OkStatus();
  };
  auto give_up = [&]() -> absl::Status {
    return rpc_done.load(std::memory_order_acquire) ? refusal() : absl::OkStatus();
  };
  const absl::Time deadline = absl::Now() + timeout + absl::Seconds(5);
  ncclComm_t comm = nullptr;
  absl::Status joined;
  if (!blocking_ops && use == v1::NCCL_CHANNEL_USE_INGEST) {
    // The pushes' operations in NCCL's blocking mode, as before the split existed.
    joined = NcclStatus(ncclCommInitRank(&comm, 2, id, 0), "ncclCommInitRank");
  } else {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t r = ncclCommInitRankConfig(&comm, 2, id, 0, &config);
    joined = (r == ncclSuccess || r == ncclInProgress) ? absl::OkStatus()
                                                       : NcclStatus(r, "ncclCommInitRankConfig");
    if (joined.ok()) joined = AwaitComm(comm, "joining the NCCL communicator", deadline, give_up);
    if (joined.ok() && blocking_ops) {
      absl::StatusOr<ncclComm_t> child = SplitBlocking(comm, deadline, give_up);
      comm = child.ok() ? *child : nullptr;  // SplitBlocking aborted the parent
      joined = child.status();
    }
  }
  if (joined.ok() && connect) joined = connect(comm, deadline, give_up);
  t.join();
  absl::Status refused = refusal();
  if (!joined.ok() || !refused.ok()) {
    if (comm != nullptr) ncclCommAbort(comm);
    return refused.ok() ? joined : refused;  // the daemon's reason first
  }
  return NcclSessionJoin{comm, resp.nccl()};
}

}  // namespace kvpool::client::gpu_internal
