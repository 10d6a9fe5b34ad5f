#include "server/transport/transport_service.h"

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "dataplane/ucx_runtime.h"
#include "server/scaleout/ownership_check.h"
#include "server/transport/device_fetch.h"
#include "server/transport/device_push_reactor.h"
#include "server/transport/session_routing.h"
#include "server/transport/session_watch_reactor.h"
#include "server/transport/transport.h"
#include "server/transport/transport_proto.h"

namespace kvpool::server {

namespace {

// Why a daemon answers attention-plan calls UNAVAILABLE.
constexpr absl::string_view kNoAttentionPlans =
    "attention plans need a shared-memory session (--shm_max_sessions > 0) or an NCCL attention "
    "channel (kvpoold --device=cuda:N built with CUDA and NCCL)";

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

grpc::ServerUnaryReactor* FinishNow(grpc::CallbackServerContext* context,
                                    const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace

grpc::ServerUnaryReactor* TransportServiceImpl::Negotiate(grpc::CallbackServerContext* context,
                                                          const v1::NegotiateRequest* request,
                                                          v1::NegotiateResponse* response) {
  const TenantId tenant = TenantOf(*ctx_, context);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  for (const v1::TransportOffer& o : request->offers()) {
    const std::optional<TransportOffer> offer = OfferFromProto(o, request->client_name());
    if (!offer) continue;  // a transport this daemon does not know
    for (Transport* t : ctx_->transports) {
      if (t->capabilities().kind != offer->kind) continue;
      // A listener on every address is reached the way the client reached this service.
      const std::string reached = AuthorityHost(context->ExperimentalGetAuthority());
      // May answer later, from another thread (an NCCL join waits for the client's rank).
      t->AcceptAsync(
          tenant, *offer, [context] { return context->IsCancelled(); },
          [reactor, response, reached](absl::StatusOr<TransportSession> s) {
            if (s.ok()) {
              FillNegotiateResponse(
                  *s, ucx::IsWildcardHost(s->listener_host) ? reached : s->listener_host, response);
            }
            reactor->Finish(ToGrpcStatus(s.status()));
          });
      return reactor;
    }
  }
  response->set_kind(v1::TRANSPORT_KIND_GRPC_INLINE);  // the fallback that always works
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* TransportServiceImpl::CloseSession(grpc::CallbackServerContext* context,
                                                             const v1::CloseSessionRequest* request,
                                                             v1::CloseSessionResponse* response) {
  const TenantId tenant = TenantOf(*ctx_, context);
  const uint64_t id = request->session_id();
  absl::StatusOr<int> aborted = ForSession<absl::StatusOr<int>>(
      ctx_->transports, nullptr, "", id, [&](Transport* t) { return t->Close(tenant, id); });
  if (aborted.ok()) response->set_aborted_pushes(static_cast<uint32_t>(*aborted));
  return FinishNow(context, aborted.status());
}

grpc::ServerReadReactor<v1::DevicePushRequest>* TransportServiceImpl::PushKv(
    grpc::CallbackServerContext* context, v1::AppendKvResponse* response) {
  return NewDevicePushReactor(ctx_, context, response);
}

grpc::ServerWriteReactor<v1::WatchSessionResponse>* TransportServiceImpl::WatchSession(
    grpc::CallbackServerContext* context, const v1::WatchSessionRequest* request) {
  return StartSessionWatch(ctx_, context, request->session_id());
}

grpc::ServerUnaryReactor* TransportServiceImpl::SetAttentionPlan(
    grpc::CallbackServerContext* context, const v1::SetAttentionPlanRequest* request,
    v1::SetAttentionPlanResponse* response) {
  const TenantId tenant = TenantOf(*ctx_, context);
  const uint64_t id = request->session_id();
  const int num_queries =
      request->num_queries() == 0
          ? 1
          : static_cast<int>(std::min<uint32_t>(request->num_queries(), kMaxPlanQueries + 1));
  const std::vector<std::string> ids(request->sequence_ids().begin(),
                                     request->sequence_ids().end());
  absl::StatusOr<AttentionPlanInfo> plan = ForSession<absl::StatusOr<AttentionPlanInfo>>(
      ctx_->transports, &TransportCapabilities::attention_plans, kNoAttentionPlans, id,
      [&](Transport* t) {
        return t->SetAttentionPlan(tenant, id, request->model_id(), ids, num_queries);
      });
  if (plan.ok()) {
    response->set_plan_id(plan->plan_id);
    response->set_q_heads(static_cast<uint32_t>(plan->shape.q_heads));
    response->set_head_dim(static_cast<uint32_t>(plan->shape.head_dim));
    response->set_num_layers(static_cast<uint32_t>(plan->num_layers));
    response->set_query_bytes(plan->shape.query_bytes());
    response->set_lse_bytes(plan->shape.lse_bytes());
  }
  return FinishNow(context, plan.status());
}

grpc::ServerUnaryReactor* TransportServiceImpl::DropAttentionPlan(
    grpc::CallbackServerContext* context, const v1::DropAttentionPlanRequest* request,
    v1::DropAttentionPlanResponse* /*response*/) {
  const TenantId tenant = TenantOf(*ctx_, context);
  const uint64_t id = request->session_id();
  return FinishNow(context, ForSession<absl::Status>(
                                ctx_->transports, &TransportCapabilities::attention_plans,
                                kNoAttentionPlans, id, [&](Transport* t) {
                                  return t->DropAttentionPlan(tenant, id, request->plan_id());
                                }));
}

grpc::ServerUnaryReactor* TransportServiceImpl::FetchToDevice(
    grpc::CallbackServerContext* context, const v1::FetchToDeviceRequest* request,
    v1::FetchToDeviceResponse* response) {
  const TenantId tenant = TenantOf(*ctx_, context);
  absl::Status s = CheckOwnership(*ctx_, context, tenant, {request->read().sequence_id()});
  if (s.ok()) s = server::FetchToDevice(ctx_, tenant, *request, response);
  if (!s.ok()) response->Clear();
  return FinishNow(context, s);
}

}  // namespace kvpool::server
