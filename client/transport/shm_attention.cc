#include "client/transport/shm_attention.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "dataplane/fd_passing.h"
#include "dataplane/shm_doorbell.h"
#include "proto/status.h"

namespace kvpool::client {

namespace v1 = ::kvpool::v1;
using server::CallHeader;
using server::CallStatus;
using server::SharedWord;

absl::StatusOr<std::unique_ptr<ShmAttentionClient>> ShmAttentionClient::Connect(
    std::shared_ptr<grpc::Channel> channel, const ShmAttentionOptions& options) {
  std::unique_ptr<ShmAttentionClient> c(new ShmAttentionClient());
  c->stub_ = v1::TransportService::NewStub(std::move(channel));
  c->options_ = options;
  v1::NegotiateRequest req;
  v1::TransportOffer* offer = req.add_offers();
  offer->set_kind(v1::TRANSPORT_KIND_SHARED_MEMORY);
  offer->mutable_shared_memory()->set_slots(options.slots);
  offer->mutable_shared_memory()->set_max_query_bytes(options.max_query_bytes);
  offer->mutable_shared_memory()->set_device_io(options.device_io);
  req.set_client_name(absl::StrCat("shm-attention pid ", getpid()));
  v1::NegotiateResponse resp;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    KVPOOL_RETURN_IF_ERROR(FromGrpcStatus(c->stub_->Negotiate(&ctx, req, &resp), "Negotiate"));
  }
  if (resp.kind() != v1::TRANSPORT_KIND_SHARED_MEMORY) {
    return absl::FailedPreconditionError(
        "the daemon does not offer shared-memory attention channels (--shm_max_sessions)");
  }
  const v1::SharedMemorySession& m = resp.shared_memory();
  c->session_id_ = m.session_id();
  c->device_ = m.device();
  if (m.call_header_bytes() != server::kCallHeaderBytes ||
      m.call_status_bytes() != server::kCallStatusBytes) {
    return absl::FailedPreconditionError("the daemon speaks another attention wire version");
  }
  sockaddr_un addr{};
  if (m.socket_path().size() >= sizeof(addr.sun_path)) {
    return absl::InternalError("the daemon's socket path is too long");
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, m.socket_path().c_str(), m.socket_path().size() + 1);
  c->socket_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (c->socket_ < 0 ||
      connect(c->socket_, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    return absl::UnavailableError(
        absl::StrCat("connect ", m.socket_path(), ": ", std::strerror(errno)));
  }
  const auto hello = server::EncodeShmHello({m.session_id(), m.session_secret()});
  KVPOOL_RETURN_IF_ERROR(server::SendWithFd(c->socket_, hello, -1));
  std::array<uint8_t, server::kShmReplyBytes> reply_bytes;
  KVPOOL_ASSIGN_OR_RETURN(
      int fd, server::ReceiveWithFd(c->socket_, absl::MakeSpan(reply_bytes),
                                    absl::Milliseconds(m.hello_timeout_ms()) + absl::Seconds(5)));
  absl::StatusOr<server::ShmReply> reply = server::DecodeShmReply(reply_bytes);
  if (!reply.ok() || !reply->status.ok() || fd < 0 || reply->region_bytes != m.region_bytes()) {
    if (fd >= 0) close(fd);
    if (reply.ok() && !reply->status.ok()) return reply->status;
    return absl::InternalError("the daemon's hello reply is malformed");
  }
  void* p = mmap(nullptr, m.region_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return absl::InternalError(absl::StrCat("mmap: ", std::strerror(errno)));
  c->region_ = static_cast<uint8_t*>(p);
  KVPOOL_ASSIGN_OR_RETURN(
      c->layout_, server::ReadShmRegionHeader(absl::MakeConstSpan(c->region_, m.region_bytes())));
  {
    absl::MutexLock lock(&c->mu_);
    c->busy_.assign(c->layout_.slots, false);
  }
  return c;
}

ShmAttentionClient::~ShmAttentionClient() {
  (void)Close();
  if (region_ != nullptr) munmap(region_, layout_.region_bytes());
}

absl::Status ShmAttentionClient::Close() {
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return absl::OkStatus();
    closed_ = true;
  }
  absl::Status s = absl::OkStatus();
  if (session_id_ != 0 && stub_ != nullptr) {
    v1::CloseSessionRequest req;
    req.set_session_id(session_id_);
    v1::CloseSessionResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    s = FromGrpcStatus(stub_->CloseSession(&ctx, req, &resp), "CloseSession");
  }
  if (socket_ >= 0) close(socket_);
  socket_ = -1;
  return s;  // the mapping stays until destruction: other threads' calls may still touch it
}

absl::StatusOr<RemoteAttentionPlan> ShmAttentionClient::SetPlan(
    const std::string& model_id, const std::vector<std::string>& sequence_ids, int num_queries) {
  return SetAttentionPlanRpc(*stub_, session_id_, model_id, sequence_ids, num_queries,
                             absl::Seconds(30));
}

absl::Status ShmAttentionClient::DropPlan(const RemoteAttentionPlan& plan) {
  return DropAttentionPlanRpc(*stub_, session_id_, plan.id, absl::Seconds(30));
}

uint32_t ShmAttentionClient::TakeSlot() {
  absl::MutexLock lock(&mu_);
  uint32_t slot = 0;
  std::pair<std::vector<bool>*, uint32_t*> arg(&busy_, &slot);
  mu_.Await(absl::Condition(
      +[](std::pair<std::vector<bool>*, uint32_t*>* a) {
        for (uint32_t i = 0; i < a->first->size(); ++i) {
          if (!(*a->first)[i]) {
            *a->second = i;
            return true;
          }
        }
        return false;
      },
      &arg));
  busy_[slot] = true;
  return slot;
}

void ShmAttentionClient::GiveSlot(uint32_t slot) {
  absl::MutexLock lock(&mu_);
  busy_[slot] = false;
}

absl::StatusOr<CallStatus> ShmAttentionClient::Call(uint32_t slot) {
  uint8_t* s = region_ + layout_.slot_at(slot);
  std::atomic<uint32_t>& state = *SharedWord(s);
  std::atomic<uint32_t>& sleeping = *SharedWord(s + 4);
  state.store(server::kSlotRequest, std::memory_order_seq_cst);
  server::IncrementAndWake(*SharedWord(region_ + server::kShmDoorbellAt),
                           *SharedWord(region_ + server::kShmDaemonSleepingAt));
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + options_.call_timeout;
  const absl::Duration spin =
      std::clamp(2 * absl::Nanoseconds(last_call_ns_.load(std::memory_order_relaxed)),
                 absl::Microseconds(50), std::max(options_.spin, absl::Microseconds(50)));
  while (server::WaitWhileEqual(state, server::kSlotRequest, sleeping, spin,
                                deadline - absl::Now()) == server::kSlotRequest) {
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError("the daemon did not answer the call in time");
    }
  }
  last_call_ns_.store(absl::ToInt64Nanoseconds(absl::Now() - start), std::memory_order_relaxed);
  absl::StatusOr<CallStatus> st = server::DecodeCallStatus(
      absl::MakeConstSpan(s + server::kShmSlotStatusAt, server::kCallStatusBytes));
  state.store(server::kSlotFree, std::memory_order_release);
  return st;
}

absl::StatusOr<std::vector<uint32_t>> ShmAttentionClient::Attend(const RemoteAttentionPlan& plan,
                                                                 int layer,
                                                                 absl::Span<const float> queries,
                                                                 absl::Span<float> out,
                                                                 absl::Span<float> lse) {
  if (queries.size() * sizeof(float) != plan.query_bytes ||
      out.size() * sizeof(float) != plan.query_bytes ||
      lse.size() * sizeof(float) != plan.lse_bytes) {
    return absl::InvalidArgumentError("queries, out and lse must have the plan's sizes");
  }
  KVPOOL_ASSIGN_OR_RETURN(InPlaceCall call, HoldSlot(plan));
  std::copy(queries.begin(), queries.end(), call.queries().begin());
  KVPOOL_ASSIGN_OR_RETURN(std::vector<uint32_t> tokens, AttendInPlace(call, layer));
  std::copy(call.out().begin(), call.out().end(), out.begin());
  std::copy(call.lse().begin(), call.lse().end(), lse.begin());
  return tokens;
}

ShmAttentionClient::InPlaceCall::InPlaceCall(ShmAttentionClient* client, uint32_t slot,
                                             const RemoteAttentionPlan& plan)
    : client_(client), slot_(slot), plan_(plan) {
  uint8_t* s = client->region_ + client->layout_.slot_at(slot);
  const size_t values = plan.query_bytes / sizeof(float);
  // The region is page-aligned and every offset in a slot a multiple of 64 bytes.
  queries_ = absl::MakeSpan(reinterpret_cast<float*>(s + server::ShmLayout::queries_at()), values);
  out_ = absl::MakeSpan(reinterpret_cast<float*>(s + client->layout_.out_at()), values);
  lse_ = absl::MakeSpan(reinterpret_cast<float*>(s + client->layout_.lse_at()),
                        plan.lse_bytes / sizeof(float));
}

ShmAttentionClient::InPlaceCall::InPlaceCall(InPlaceCall&& other) noexcept
    : client_(std::exchange(other.client_, nullptr)),
      slot_(other.slot_),
      plan_(other.plan_),
      queries_(other.queries_),
      out_(other.out_),
      lse_(other.lse_) {}

ShmAttentionClient::InPlaceCall::~InPlaceCall() {
  if (client_ != nullptr) client_->GiveSlot(slot_);
}

absl::StatusOr<ShmAttentionClient::InPlaceCall> ShmAttentionClient::HoldSlot(
    const RemoteAttentionPlan& plan) {
  if (plan.query_bytes > layout_.max_query_bytes || plan.lse_bytes > layout_.max_lse_bytes) {
    return absl::InvalidArgumentError("the plan's calls do not fit this channel's slots");
  }
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return absl::FailedPreconditionError("the channel is closed");
  }
  return InPlaceCall(this, TakeSlot(), plan);
}

absl::StatusOr<std::vector<uint32_t>> ShmAttentionClient::AttendInPlace(const InPlaceCall& call,
                                                                        int layer) {
  if (call.client_ != this) {
    return absl::InvalidArgumentError("the call holds no slot of this channel");
  }
  return CallInSlot(call.slot_, call.plan_, layer, server::kIoRegion);
}

const uint8_t* ShmAttentionClient::MailboxHandles(uint32_t slot) const {
  return region_ + layout_.slot_at(slot) + server::ShmLayout::mailbox_at();
}

absl::StatusOr<std::vector<uint32_t>> ShmAttentionClient::CallInSlot(
    uint32_t slot, const RemoteAttentionPlan& plan, int layer, uint32_t io_kind) {
  uint8_t* s = region_ + layout_.slot_at(slot);
  CallHeader h;
  h.plan_id = plan.id;
  h.layer = layer;
  h.call = next_call_.fetch_add(1);
  h.query_bytes = plan.query_bytes;
  h.lse_bytes = plan.lse_bytes;
  const auto header = server::EncodeCallHeader(h);
  std::memcpy(s + server::kShmSlotHeaderAt, header.data(), header.size());
  SharedWord(s + server::kShmSlotIoAt)->store(io_kind, std::memory_order_relaxed);
  absl::StatusOr<CallStatus> st = Call(slot);
  if (!st.ok()) {
    if (absl::IsDeadlineExceeded(st.status())) (void)Close();
    return st.status();
  }
  KVPOOL_RETURN_IF_ERROR(st->status);
  if (st->call != h.call || st->attended_tokens.size() != static_cast<size_t>(plan.batch)) {
    return absl::InternalError("the daemon answered another call");
  }
  return std::move(st->attended_tokens);
}

absl::Status ShmAttentionClient::SendRawHeaderForTesting(absl::Span<const uint8_t> header) {
  const uint32_t slot = TakeSlot();
  uint8_t* s = region_ + layout_.slot_at(slot);
  std::memset(s + server::kShmSlotHeaderAt, 0, server::kCallHeaderBytes);
  SharedWord(s + server::kShmSlotIoAt)->store(server::kIoRegion, std::memory_order_relaxed);
  std::memcpy(s + server::kShmSlotHeaderAt, header.data(),
              std::min(header.size(), server::kCallHeaderBytes));
  absl::StatusOr<CallStatus> st = Call(slot);
  GiveSlot(slot);
  if (!st.ok()) return st.status();
  return st->status;
}

}  // namespace kvpool::client
