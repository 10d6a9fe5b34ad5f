#include "server/transport/transport_proto.h"

namespace kvpool::server {

namespace v1 = ::kvpool::v1;

std::optional<TransportOffer> OfferFromProto(const v1::TransportOffer& o,
                                             const std::string& client_name) {
  TransportOffer offer;
  switch (o.kind()) {
    case v1::TRANSPORT_KIND_GRPC_INLINE:
      offer.kind = TransportKind::kGrpcInline;
      break;
    case v1::TRANSPORT_KIND_UCX:
      offer.kind = TransportKind::kUcx;
      break;
    case v1::TRANSPORT_KIND_NCCL:
      offer.kind = TransportKind::kNccl;
      break;
    case v1::TRANSPORT_KIND_CUDA_IPC:
      offer.kind = TransportKind::kCudaIpc;
      break;
    case v1::TRANSPORT_KIND_SHARED_MEMORY:
      offer.kind = TransportKind::kSharedMemory;
      break;
    default:
      return std::nullopt;  // a transport this daemon does not know
  }
  offer.wire_version = o.wire_version();
  offer.peer_transports = o.ucx_transports();
  offer.client_name = client_name;
  offer.peer_process = PeerProcess{o.boot_id(), o.pid(), o.process_start_time()};
  offer.nccl.unique_id = o.nccl().unique_id();
  offer.nccl.timeout_ms = o.nccl().timeout_ms();
  offer.nccl.blocking_ops = o.nccl().blocking_ops();
  offer.nccl.use = static_cast<int>(o.nccl().use());
  offer.shm_slots = o.shared_memory().slots();
  offer.shm_max_query_bytes = o.shared_memory().max_query_bytes();
  offer.shm_device_io = o.shared_memory().device_io();
  return offer;
}

void FillNegotiateResponse(const TransportSession& s, const std::string& ucx_listener_host,
                           v1::NegotiateResponse* out) {
  out->set_kind(static_cast<v1::TransportKind>(s.kind));
  switch (s.kind) {
    case TransportKind::kGrpcInline:
      break;
    case TransportKind::kUcx: {
      v1::UcxSession* u = out->mutable_ucx();
      u->set_session_id(s.session_id);
      u->set_listener_host(ucx_listener_host);
      u->set_listener_port(s.listener_port);
      u->set_session_secret(s.secret);
      u->set_wire_version(s.wire_version);
      u->set_max_message_bytes(s.max_message_bytes);
      u->set_max_inflight_messages(s.max_inflight_messages);
      u->set_staging_bytes(s.staging_bytes);
      u->set_idle_timeout_ms(s.idle_timeout_ms);
      u->set_ucx_transports(s.transports);
      u->set_daemon_pid(s.daemon_process.pid);
      u->set_daemon_start_time(s.daemon_process.start_time);
      u->set_boot_id(s.daemon_process.boot_id);
      u->set_peer_error_handling(s.peer_error_handling);
      break;
    }
    case TransportKind::kNccl: {
      v1::NcclSession* n = out->mutable_nccl();
      n->set_session_id(s.session_id);
      n->set_device(static_cast<uint32_t>(s.device));
      n->set_use(static_cast<v1::NcclChannelUse>(s.nccl_use));
      n->set_max_chunk_bytes(s.max_chunk_bytes);
      n->set_call_header_bytes(s.call_header_bytes);
      n->set_call_status_bytes(s.call_status_bytes);
      n->set_max_query_bytes(s.max_query_bytes);
      n->set_watch_timeout_ms(s.watch_timeout_ms);
      break;
    }
    case TransportKind::kCudaIpc: {
      v1::CudaIpcSession* c = out->mutable_cuda_ipc();
      c->set_session_id(s.session_id);
      c->set_device(static_cast<uint32_t>(s.device));
      break;
    }
    case TransportKind::kSharedMemory: {
      v1::SharedMemorySession* m = out->mutable_shared_memory();
      m->set_session_id(s.session_id);
      m->set_socket_path(s.socket_path);
      m->set_session_secret(s.secret);
      m->set_slots(s.slots);
      m->set_max_query_bytes(s.max_query_bytes);
      m->set_max_lse_bytes(s.max_lse_bytes);
      m->set_region_bytes(s.region_bytes);
      m->set_call_header_bytes(s.call_header_bytes);
      m->set_call_status_bytes(s.call_status_bytes);
      m->set_hello_timeout_ms(s.hello_timeout_ms);
      m->set_device(s.device);
      m->set_device_io(s.device_io);
      break;
    }
  }
}

DeviceChunk DeviceChunkFromProto(const v1::DevicePushChunk& c, size_t bytes) {
  DeviceChunk d;
  d.layer = c.layer();
  d.token_offset = c.token_offset();
  d.num_tokens = c.num_tokens();
  d.bytes = bytes;
  d.k = IpcBufferRef{c.k().handle(), c.k().offset()};
  d.v = IpcBufferRef{c.v().handle(), c.v().offset()};
  return d;
}

}  // namespace kvpool::server
