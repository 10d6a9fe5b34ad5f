#include "server/transport/transport_service.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/transport/transport.h"
#include "dataplane/ucx_runtime.h"

namespace kvpool::server {

namespace {

// The host of a request's :authority ("host:port", "[v6]:port" or "host"); "" when it is
// implausible (too long, or not a host name or address).
std::string AuthorityHost(grpc::string_ref authority) {
  absl::string_view a(authority.data(), authority.size());
  if (a.size() > 255) return "";
  absl::string_view host = a;
  if (absl::StartsWith(a, "[")) {
    const size_t close = a.find(']');
    if (close == absl::string_view::npos) return "";
    host = a.substr(1, close - 1);
  } else if (a.find(':') == a.rfind(':') && a.find(':') != absl::string_view::npos) {
    host = a.substr(0, a.find(':'));
  }
  for (char c : host) {
    if (!absl::ascii_isalnum(c) && c != '.' && c != '-' && c != ':' && c != '_') return "";
  }
  return std::string(host);
}

}  // namespace

grpc::ServerUnaryReactor* TransportServiceImpl::Negotiate(grpc::CallbackServerContext* context,
                                                          const v1::NegotiateRequest* request,
                                                          v1::NegotiateResponse* response) {
  const TenantId tenant = TenantOf(context);
  auto run = [&]() -> absl::Status {
    for (const v1::TransportOffer& o : request->offers()) {
      if (o.kind() != v1::TRANSPORT_KIND_GRPC_INLINE && o.kind() != v1::TRANSPORT_KIND_UCX) {
        continue;  // a transport this daemon does not know
      }
      for (Transport* t : ctx_->transports) {
        if (static_cast<int>(t->capabilities().kind) != static_cast<int>(o.kind())) continue;
        TransportOffer offer;
        offer.kind = t->capabilities().kind;
        offer.wire_version = o.wire_version();
        offer.peer_transports = o.ucx_transports();
        offer.client_name = request->client_name();
        offer.peer_process = PeerProcess{o.boot_id(), o.pid(), o.process_start_time()};
        absl::StatusOr<TransportSession> s = t->Accept(tenant, offer);
        if (!s.ok()) return s.status();
        response->set_kind(static_cast<v1::TransportKind>(s->kind));
        if (s->kind == TransportKind::kUcx) {
          v1::UcxSession* u = response->mutable_ucx();
          u->set_session_id(s->session_id);
          // A listener on every address is reached the way the client reached this service.
          u->set_listener_host(ucx::IsWildcardHost(s->listener_host)
                                   ? AuthorityHost(context->ExperimentalGetAuthority())
                                   : s->listener_host);
          u->set_listener_port(s->listener_port);
          u->set_session_secret(s->secret);
          u->set_wire_version(s->wire_version);
          u->set_max_message_bytes(s->max_message_bytes);
          u->set_max_inflight_messages(s->max_inflight_messages);
          u->set_staging_bytes(s->staging_bytes);
          u->set_idle_timeout_ms(s->idle_timeout_ms);
          u->set_ucx_transports(s->transports);
          u->set_daemon_pid(s->daemon_process.pid);
          u->set_daemon_start_time(s->daemon_process.start_time);
          u->set_boot_id(s->daemon_process.boot_id);
          u->set_peer_error_handling(s->peer_error_handling);
        }
        return absl::OkStatus();
      }
    }
    response->set_kind(v1::TRANSPORT_KIND_GRPC_INLINE);  // the fallback that always works
    return absl::OkStatus();
  };
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(run()));
  return reactor;
}

grpc::ServerUnaryReactor* TransportServiceImpl::CloseSession(grpc::CallbackServerContext* context,
                                                             const v1::CloseSessionRequest* request,
                                                             v1::CloseSessionResponse* response) {
  const TenantId tenant = TenantOf(context);
  absl::Status status =
      absl::NotFoundError(absl::StrCat("no transport session ", request->session_id()));
  for (Transport* t : ctx_->transports) {
    if (t->capabilities().kind != TransportKind::kUcx) continue;
    absl::StatusOr<int> aborted = t->Close(tenant, request->session_id());
    if (aborted.ok()) {
      response->set_aborted_pushes(*aborted);
      status = absl::OkStatus();
      break;
    }
    if (!absl::IsNotFound(aborted.status())) {
      status = aborted.status();
      break;
    }
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace kvpool::server
