#include "client/transport/ucx_channel.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "dataplane/ucx_wire.h"
#include "dataplane/ucx_wire_parse.h"

namespace kvpool::client {

namespace v1 = ::kvpool::v1;
namespace wire = ::kvpool::ucx::wire;

struct UcxLayerPush::State {
  std::set<int> stored;
  int sends = 0;                   // LAYER_DATA sends in flight (reading the caller's buffers)
  std::map<int, int> layer_sends;  // the same, by layer
  absl::Status status;             // the push's first error
  bool done = false;               // PUSH_DONE received (or the push failed)
  UcxPushResult result;
};

struct UcxChannel::Call {
  bool done = false;
  absl::Status status;
  size_t max_answer_bytes = 0;  // what the request can be answered with (or an error message)
  wire::AttendDoneHeader header{};
  std::string payload;
};

namespace {

ucx::AmMessage Message(std::string header, std::string payload = {}, uint32_t flags = 0) {
  ucx::AmMessage m;
  m.header = std::move(header);
  m.payload = std::move(payload);
  m.flags = flags;
  return m;
}

}  // namespace

// --- UcxChannel ---

absl::StatusOr<std::unique_ptr<UcxChannel>> UcxChannel::Connect(
    std::shared_ptr<grpc::Channel> grpc_channel, const UcxChannelOptions& options) {
  auto ch = std::unique_ptr<UcxChannel>(new UcxChannel());
  if (absl::Status s = ch->Init(std::move(grpc_channel), options); !s.ok()) return s;
  return ch;
}

absl::Status UcxChannel::Init(std::shared_ptr<grpc::Channel> grpc_channel,
                              const UcxChannelOptions& options) {
  options_ = options;
  absl::StatusOr<std::unique_ptr<ucx::UcxRuntime>> rt = ucx::UcxRuntime::Create(options.runtime);
  if (!rt.ok()) return absl::UnavailableError(absl::StrCat("UCX: ", rt.status().message()));
  rt_ = *std::move(rt);
  absl::Status s = rt_->SetAmHandler(
      wire::kHelloDone, [this](const void* h, size_t hl, void*, size_t,
                               const ucp_am_recv_param_t*) { return OnHelloDone(h, hl); });
  if (s.ok()) {
    s = rt_->SetAmHandler(wire::kLayerDone,
                          [this](const void* h, size_t hl, void*, size_t,
                                 const ucp_am_recv_param_t*) { return OnLayerDone(h, hl); });
  }
  if (s.ok()) {
    s = rt_->SetAmHandler(wire::kPushDone,
                          [this](const void* h, size_t hl, void* d, size_t l,
                                 const ucp_am_recv_param_t*) { return OnPushDone(h, hl, d, l); });
  }
  if (s.ok()) {
    s = rt_->SetAmHandler(wire::kAttendDone, [this](const void* h, size_t hl, void* d, size_t l,
                                                    const ucp_am_recv_param_t* p) {
      return OnAttendDone(h, hl, d, l, p);
    });
  }
  if (!s.ok()) return s;
  rt_->Start([this] {
    if (watch_daemon_ && ucx::ProcessGone(daemon_)) OnPeerError(UCS_ERR_CONNECTION_RESET);
  });

  stub_ = v1::TransportService::NewStub(grpc_channel);
  v1::NegotiateRequest req;
  req.set_client_name(options.client_name);
  v1::TransportOffer* ucx_offer = req.add_offers();
  ucx_offer->set_kind(v1::TRANSPORT_KIND_UCX);
  ucx_offer->set_wire_version(wire::kWireVersion);
  ucx_offer->set_ucx_transports(rt_->transports());
  const ucx::ProcessIdentity self = ucx::SelfProcess();
  ucx_offer->set_pid(self.pid);
  ucx_offer->set_process_start_time(self.start_time);
  ucx_offer->set_boot_id(self.boot_id);
  req.add_offers()->set_kind(v1::TRANSPORT_KIND_GRPC_INLINE);
  v1::NegotiateResponse resp;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options.deadline));
  grpc::Status gs = stub_->Negotiate(&context, req, &resp);
  if (!gs.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(gs.error_code()),
                        absl::StrCat("Negotiate: ", gs.error_message()));
  }
  if (resp.kind() != v1::TRANSPORT_KIND_UCX) {
    return absl::FailedPreconditionError(
        "kvpoold chose grpc_inline (no UCX there): use AppendKv and Attend");
  }
  session_ = resp.ucx();
  if (session_.wire_version() != wire::kWireVersion) {
    return absl::FailedPreconditionError(absl::StrCat("kvpoold speaks UCX wire version ",
                                                      session_.wire_version(), ", this client ",
                                                      wire::kWireVersion));
  }
  if (session_.max_message_bytes() < 1) {
    return absl::FailedPreconditionError("kvpoold offered a UCX session without message room");
  }
  if (session_.listener_host().empty() || session_.listener_port() < 1 ||
      session_.listener_port() > 65535 ||
      session_.session_secret().size() != sizeof(wire::HelloHeader::secret)) {
    return absl::FailedPreconditionError(
        "kvpoold offered a UCX session without a listener address or secret");
  }
  // A chunk is two messages (K and V) and must be able to fly.
  max_inflight_ = std::max<uint32_t>(2, session_.max_inflight_messages());
  on_error_ = [this](ucs_status_t st) {
    ep_failed_ = true;
    OnPeerError(st);
  };
  peer_error_handling_ = session_.peer_error_handling();  // both ends use the same mode
  absl::StatusOr<ucp_ep_h> ep = absl::InternalError("not run");
  if (absl::Status run = rt_->RunSync([&] {
        daemon_ = ucx::ProcessIdentity{session_.boot_id(), session_.daemon_pid(),
                                       session_.daemon_start_time()};
        watch_daemon_ = ucx::CanWatch(daemon_);
        ep = ucx::ConnectToListener(rt_.get(), session_.listener_host(),
                                    static_cast<uint16_t>(session_.listener_port()),
                                    peer_error_handling_, &on_error_);
        if (ep.ok()) ep_ = *ep;
      });
      !run.ok()) {
    return run;
  }
  if (!ep.ok()) return absl::UnavailableError(absl::StrCat("UCX connect: ", ep.status().message()));

  // Bind the connection to the session, and wait for the daemon to confirm it (also before any
  // rendezvous: see ConnectToListener).
  wire::HelloHeader hello{};
  hello.session_id = session_.session_id();
  std::memcpy(hello.secret, session_.session_secret().data(), sizeof(hello.secret));
  hello.wire_version = wire::kWireVersion;
  absl::Status sent =
      Send(wire::kHello, Message(wire::Encode(hello), {}, UCP_AM_SEND_FLAG_EAGER), nullptr);
  if (!sent.ok()) return sent;
  absl::MutexLock lock(&mu_);
  auto answered = [this]()
                      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return connected_ || !health_.ok(); };
  if (!mu_.AwaitWithTimeout(absl::Condition(&answered), options.deadline)) {
    return absl::DeadlineExceededError("kvpoold did not accept the UCX connection in time");
  }
  return health_;
}

UcxChannel::~UcxChannel() {
  if (rt_ == nullptr) return;
  if (stub_ != nullptr && session_.session_id() != 0 && health().ok()) {
    v1::CloseSessionRequest req;
    req.set_session_id(session_.session_id());
    v1::CloseSessionResponse resp;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    (void)stub_->CloseSession(&context, req, &resp);  // best effort: the daemon also notices
  }
  (void)rt_->RunSync([this] {
    ucx::CloseEndpoint(rt_.get(), ep_,
                       /*force=*/ep_failed_ || (!health().ok() && peer_error_handling_));
    ep_ = nullptr;
  });
  rt_->Stop(absl::Milliseconds(100));
}

absl::Status UcxChannel::health() const {
  absl::MutexLock lock(&mu_);
  return health_;
}

void UcxChannel::FailAll(const absl::Status& why) {
  for (auto& [id, p] : pushes_) {
    if (p->status.ok()) p->status = why;
    p->done = true;
  }
  for (auto& [id, c] : calls_) {
    if (!c->done) {
      c->status = why;
      c->done = true;
    }
  }
}

void UcxChannel::OnPeerError(ucs_status_t status) {
  {
    absl::MutexLock lock(&mu_);
    if (!health_.ok()) return;
    health_ = absl::UnavailableError(
        absl::StrCat("UCX connection to kvpoold failed: ", ucs_status_string(status)));
    FailAll(health_);
  }
  rt_->Post([this] {
    ucx::CloseEndpoint(rt_.get(), ep_, /*force=*/ep_failed_ || peer_error_handling_);
    ep_ = nullptr;
  });
}

absl::Status UcxChannel::Send(uint16_t id, ucx::AmMessage msg,
                              std::function<void(absl::Status)> done) {
  msg.flags |= UCP_AM_SEND_FLAG_REPLY;
  const bool posted = rt_->Post([this, id, msg = std::move(msg), done]() mutable {
    if (ep_ == nullptr) {
      if (done) done(absl::UnavailableError("UCX endpoint closed"));
      return;
    }
    ucx::SendAm(rt_.get(), ep_, id, std::move(msg), std::move(done));
  });
  if (!posted) return absl::UnavailableError("UCX channel stopped");
  return absl::OkStatus();
}

ucs_status_t UcxChannel::OnHelloDone(const void* header, size_t header_length) {
  const std::optional<wire::HelloDoneHeader> h =
      wire::Decode<wire::HelloDoneHeader>(header, header_length);
  if (!h || h->session_id != session_.session_id()) return UCS_OK;
  absl::MutexLock lock(&mu_);
  connected_ = true;
  return UCS_OK;
}

ucs_status_t UcxChannel::OnLayerDone(const void* header, size_t header_length) {
  const std::optional<wire::LayerDoneHeader> h =
      wire::Decode<wire::LayerDoneHeader>(header, header_length);
  if (!h) return UCS_OK;
  absl::MutexLock lock(&mu_);
  auto it = pushes_.find(h->push_id);
  if (it != pushes_.end()) it->second->stored.insert(h->layer);
  return UCS_OK;
}

ucs_status_t UcxChannel::OnPushDone(const void* header, size_t header_length, void* data,
                                    size_t length) {
  const std::optional<wire::PushDoneHeader> h =
      wire::Decode<wire::PushDoneHeader>(header, header_length);
  if (!h) return UCS_OK;
  absl::MutexLock lock(&mu_);
  auto it = pushes_.find(h->push_id);
  if (it == pushes_.end() || it->second->done) return UCS_OK;
  UcxLayerPush::State& st = *it->second;
  st.done = true;
  if (h->status_code != 0) {
    if (st.status.ok()) {
      st.status = wire::StatusFromWire(h->status_code,
                                       absl::string_view(static_cast<const char*>(data), length));
    }
    return UCS_OK;
  }
  st.result.total_tokens = h->total_tokens;
  st.result.to_sink = h->to_sink;
  st.result.to_history = h->to_history;
  st.result.to_recent = h->to_recent;
  st.result.pool_bytes = h->pool_bytes;
  return UCS_OK;
}

ucs_status_t UcxChannel::OnAttendDone(const void* header, size_t header_length, void* data,
                                      size_t length, const ucp_am_recv_param_t* param) {
  const std::optional<wire::AttendDoneHeader> h =
      wire::Decode<wire::AttendDoneHeader>(header, header_length);
  if (!h) return UCS_OK;
  std::shared_ptr<Call> call;
  {
    absl::MutexLock lock(&mu_);
    auto it = calls_.find(h->call_id);
    if (it == calls_.end() || it->second->done) return UCS_OK;
    call = it->second;
    if (length > call->max_answer_bytes) {
      call->status = absl::InternalError(absl::StrCat("ATTEND_DONE of ", length,
                                                      " bytes; this call is answered in at most ",
                                                      call->max_answer_bytes));
      call->done = true;
      return ucx::DropAm(rt_.get(), data, ucx::IsRendezvous(param), /*in_handler=*/true);
    }
  }
  call->header = *h;
  call->payload.resize(length);
  return ucx::ReceiveAm(rt_.get(), data, length, ucx::IsRendezvous(param), /*in_handler=*/true,
                        call->payload.data(), nullptr, [this, call](absl::Status s) {
                          absl::MutexLock lock(&mu_);
                          if (call->done) return;
                          call->status =
                              s.ok() ? wire::StatusFromWire(
                                           call->header.status_code,
                                           call->header.status_code == 0 ? "" : call->payload)
                                     : s;
                          call->done = true;
                        });
}

absl::StatusOr<std::unique_ptr<UcxLayerPush>> UcxChannel::BeginPush(UcxPushSpec spec) {
  if (spec.num_tokens < 1) return absl::InvalidArgumentError("num_tokens must be >= 1");
  if (!spec.token_ids.empty() && spec.token_ids.size() != spec.num_tokens) {
    return absl::InvalidArgumentError("token_ids must be empty or num_tokens long");
  }
  auto state = std::make_shared<UcxLayerPush::State>();
  uint64_t id = 0;
  {
    absl::MutexLock lock(&mu_);
    if (!health_.ok()) return health_;
    id = next_id_++;
    pushes_[id] = state;
  }
  wire::PushBeginHeader h{};
  h.session_id = session_.session_id();
  h.push_id = id;
  h.token_start = spec.token_start;
  h.num_tokens = spec.num_tokens;
  h.flags = spec.end_of_prefill ? wire::kEndOfPrefill : 0;
  h.sequence_id_bytes = static_cast<uint32_t>(spec.sequence_id.size());
  h.num_token_ids = static_cast<uint32_t>(spec.token_ids.size());
  std::string payload = spec.sequence_id;
  payload.append(reinterpret_cast<const char*>(spec.token_ids.data()),
                 spec.token_ids.size() * sizeof(uint32_t));
  absl::Status s =
      Send(wire::kPushBegin, Message(wire::Encode(h), std::move(payload), UCP_AM_SEND_FLAG_EAGER),
           [this, state](absl::Status st) {
             if (st.ok()) return;
             absl::MutexLock lock(&mu_);
             if (state->status.ok()) state->status = st;
           });
  if (!s.ok()) {
    absl::MutexLock lock(&mu_);
    pushes_.erase(id);
    return s;
  }
  return std::unique_ptr<UcxLayerPush>(new UcxLayerPush(this, id, std::move(state)));
}

absl::Status UcxChannel::Attend(const std::string& model_id, int layer, size_t query_values,
                                const std::vector<UcxSequenceQuery>& batch,
                                std::vector<UcxAttentionResult>* out) {
  if (batch.empty()) return absl::InvalidArgumentError("empty attention batch");
  wire::AttendHeader h{};
  h.session_id = session_.session_id();
  h.layer = layer;
  h.batch = static_cast<uint32_t>(batch.size());
  h.model_id_bytes = static_cast<uint32_t>(model_id.size());
  size_t total_queries = 0;
  size_t ids_bytes = 0;
  for (const UcxSequenceQuery& q : batch) {
    total_queries += q.num_queries;
    ids_bytes += q.sequence_id.size();
  }
  std::string payload;
  payload.reserve(model_id.size() + batch.size() * sizeof(wire::SequenceQueryMeta) + ids_bytes +
                  total_queries * query_values * sizeof(float));
  payload.append(model_id);
  for (const UcxSequenceQuery& q : batch) {
    wire::SequenceQueryMeta m{static_cast<uint32_t>(q.sequence_id.size()), q.num_queries};
    payload.append(reinterpret_cast<const char*>(&m), sizeof(m));
  }
  for (const UcxSequenceQuery& q : batch) payload.append(q.sequence_id);
  for (const UcxSequenceQuery& q : batch) {
    payload.append(reinterpret_cast<const char*>(q.q), q.num_queries * query_values * 4);
  }
  std::vector<uint32_t> num_queries(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) num_queries[i] = batch[i].num_queries;
  auto call = std::make_shared<Call>();
  call->max_answer_bytes = wire::MaxAttendDoneBytes(num_queries, query_values);
  {
    absl::MutexLock lock(&mu_);
    if (!health_.ok()) return health_;
    h.call_id = next_id_++;
    calls_[h.call_id] = call;
  }
  const uint64_t call_id = h.call_id;
  absl::Status sent = Send(wire::kAttend, Message(wire::Encode(h), std::move(payload)),
                           [this, call](absl::Status s) {
                             if (s.ok()) return;
                             absl::MutexLock lock(&mu_);
                             if (!call->done) {
                               call->status = s;
                               call->done = true;
                             }
                           });
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    if (sent.ok()) {
      auto ready = [&call]() { return call->done; };
      if (!mu_.AwaitWithTimeout(absl::Condition(&ready), options_.deadline)) {
        call->done = true;
        call->status = absl::DeadlineExceededError("remote attention over UCX timed out");
      }
      status = call->status;
    } else {
      status = sent;
    }
    calls_.erase(call_id);
  }
  if (!status.ok()) return status;
  absl::StatusOr<std::vector<wire::AttendResult>> results =
      wire::ParseAttendDone(call->header, call->payload, num_queries, query_values);
  if (!results.ok()) return results.status();
  out->assign(batch.size(), UcxAttentionResult{});
  for (size_t i = 0; i < batch.size(); ++i) {
    (*out)[i].attended_tokens = (*results)[i].attended_tokens;
    (*out)[i].out = std::move((*results)[i].out);
    (*out)[i].lse = std::move((*results)[i].lse);
  }
  return absl::OkStatus();
}

// --- UcxLayerPush ---

UcxLayerPush::~UcxLayerPush() {
  if (!finished_) Abort();
}

absl::Status UcxLayerPush::PushLayer(int layer, uint32_t token_offset, uint32_t num_tokens,
                                     absl::string_view k, absl::string_view v) {
  if (finished_) return absl::FailedPreconditionError("push already finished");
  if (num_tokens < 1 || k.size() != v.size() || k.empty() || k.size() % num_tokens != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("PushLayer(layer ", layer, "): k and v must be equally long, a multiple of ",
                     num_tokens, " tokens"));
  }
  const size_t token_bytes = k.size() / num_tokens;
  const size_t max_message = channel_->session_.max_message_bytes();
  const uint32_t per_message =
      static_cast<uint32_t>(std::max<size_t>(1, max_message / token_bytes));
  UcxChannel* ch = channel_;
  for (uint32_t off = 0; off < num_tokens; off += per_message) {
    const uint32_t count = std::min(per_message, num_tokens - off);
    {
      absl::MutexLock lock(&ch->mu_);
      State* st = state_.get();
      auto ready = [ch, st]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return ch->inflight_ + 2 <= ch->max_inflight_ || !st->status.ok() || st->done;
      };
      if (!ch->mu_.AwaitWithTimeout(absl::Condition(&ready), ch->options_.deadline)) {
        return absl::DeadlineExceededError(absl::StrCat(
            "PushLayer(layer ", layer, "): the daemon took no message within the deadline"));
      }
      if (!st->status.ok()) return st->status;
      if (st->done) return absl::FailedPreconditionError("push already finished by kvpoold");
      ch->inflight_ += 2;
      st->sends += 2;
      st->layer_sends[layer] += 2;
    }
    // K, then V of the same tokens: each one contiguous rendezvous from the caller's buffer.
    const size_t at = off * token_bytes;
    const size_t part = count * token_bytes;
    for (const uint32_t tensor : {wire::kTensorKey, wire::kTensorValue}) {
      wire::LayerDataHeader h{};
      h.session_id = ch->session_.session_id();
      h.push_id = id_;
      h.layer = layer;
      h.token_offset = token_offset + off;
      h.num_tokens = count;
      h.tensor = tensor;
      ucx::AmMessage msg;
      msg.header = wire::Encode(h);
      msg.borrowed = {{(tensor == wire::kTensorKey ? k : v).data() + at, part}};
      msg.flags = UCP_AM_SEND_FLAG_RNDV;
      auto sent = [ch, st = state_, layer](absl::Status status) {
        absl::MutexLock lock(&ch->mu_);
        --ch->inflight_;
        --st->sends;
        if (--st->layer_sends[layer] == 0) st->layer_sends.erase(layer);
        if (!status.ok() && st->status.ok()) st->status = status;
      };
      absl::Status s = ch->Send(wire::kLayerData, std::move(msg), sent);
      if (!s.ok()) {  // not posted (the channel stopped): this message and V if this was K
        for (int i = tensor == wire::kTensorKey ? 2 : 1; i > 0; --i) sent(s);
        return s;
      }
      ++messages_;
      bytes_posted_ += part;
    }
  }
  return absl::OkStatus();
}

void UcxLayerPush::AwaitSends() {
  absl::MutexLock lock(&channel_->mu_);
  State* st = state_.get();
  auto idle = [st]() { return st->sends == 0; };
  (void)channel_->mu_.AwaitWithTimeout(absl::Condition(&idle), channel_->options_.deadline);
}

absl::Status UcxLayerPush::WaitLayer(int layer) {
  absl::MutexLock lock(&channel_->mu_);
  State* st = state_.get();
  auto ready = [st, layer]() {
    return (st->stored.count(layer) > 0 && st->layer_sends.count(layer) == 0) || !st->status.ok() ||
           st->done;
  };
  if (!channel_->mu_.AwaitWithTimeout(absl::Condition(&ready), channel_->options_.deadline)) {
    return absl::DeadlineExceededError(absl::StrCat("layer ", layer, " not stored in time"));
  }
  if (st->stored.count(layer) > 0) return absl::OkStatus();
  if (!st->status.ok()) return st->status;
  return absl::FailedPreconditionError(absl::StrCat("push finished without layer ", layer));
}

std::set<int> UcxLayerPush::StoredLayers() const {
  absl::MutexLock lock(&channel_->mu_);
  return state_->stored;
}

absl::StatusOr<UcxPushResult> UcxLayerPush::Finish() {
  if (finished_) return absl::FailedPreconditionError("push already finished");
  finished_ = true;
  wire::PushControlHeader h{channel_->session_.session_id(), id_, messages_};
  absl::Status status = channel_->Send(
      wire::kPushCommit, Message(wire::Encode(h), {}, UCP_AM_SEND_FLAG_EAGER), nullptr);
  UcxPushResult result;
  {
    absl::MutexLock lock(&channel_->mu_);
    State* st = state_.get();
    if (status.ok()) {
      auto ready = [st]() { return st->done || !st->status.ok(); };
      if (!channel_->mu_.AwaitWithTimeout(absl::Condition(&ready), channel_->options_.deadline)) {
        status = absl::DeadlineExceededError("push not committed within the deadline");
      } else {
        status = st->status;
      }
    }
    channel_->pushes_.erase(id_);
    result = st->result;
  }
  if (absl::IsDeadlineExceeded(status)) {
    wire::PushControlHeader a{channel_->session_.session_id(), id_, messages_};
    (void)channel_->Send(wire::kPushAbort, Message(wire::Encode(a), {}, UCP_AM_SEND_FLAG_EAGER),
                         nullptr);
  }
  AwaitSends();  // the caller may free its buffers once this returns
  if (!status.ok()) return status;
  return result;
}

void UcxLayerPush::Abort() {
  if (finished_) return;
  finished_ = true;
  wire::PushControlHeader h{channel_->session_.session_id(), id_, messages_};
  (void)channel_->Send(wire::kPushAbort, Message(wire::Encode(h), {}, UCP_AM_SEND_FLAG_EAGER),
                       nullptr);
  {
    absl::MutexLock lock(&channel_->mu_);
    if (state_->status.ok()) state_->status = absl::CancelledError("push aborted");
    channel_->pushes_.erase(id_);
  }
  AwaitSends();  // the daemon drops what it has not pulled, which completes those sends
}

}  // namespace kvpool::client
