// The NCCL transport: GPU to GPU over a two-rank NCCL communicator per client, for a kvpoold whose
// pool is on a GPU (--device=cuda:N). A client offers NCCL in TransportService.Negotiate with an
// ncclUniqueId (kvpool.v1.NcclOffer); the daemon joins as rank 1 (Accept), on a thread of its
// own (the join waits for the client's rank), and the session carries one of:
//   ingest     prefill pushes (TransportService.PushKv): each chunk is received with ncclRecv
//              into one of a few device slots (nccl_channel.h) and staged from there by the
//              ingest engine; the push's stream is its control;
//   attention  remote attention calls over NCCL only (attention_channel.h): plans fixed with
//              SetAttentionPlan, the channel's lease is TransportService.WatchSession, and a
//              channel nobody watches within watch_timeout after it was negotiated is closed.
// Joins are bounded (join_admission.h: a timeout ceiling, 8 waiting at once). A failed or
// cancelled push aborts its channel (the client's sends then fail instead of hanging); an NCCL
// error ends an attention channel; CloseSession aborts either.
//
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<Transport> nccl, NewNcclTransport(&ctx, {}));
//
// NewNcclTransport is Unavailable where the daemon cannot serve NCCL (a pool in host memory, a
// build without CUDA and NCCL): kvpoold then does not host it and NCCL offers fall through.
// Thread-safe.
#pragma once

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/service_context.h"
#include "server/transport/transport.h"

namespace kvpool::server {

struct NcclTransportOptions {
  // An attention channel must be watched (WatchSession) within this long after Negotiate.
  absl::Duration watch_timeout = absl::Seconds(10);
  size_t max_sessions = 256;
};

[[nodiscard]] absl::StatusOr<std::unique_ptr<Transport>> NewNcclTransport(
    ServiceContext* ctx, const NcclTransportOptions& options);

}  // namespace kvpool::server
