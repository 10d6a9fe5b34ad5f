#include "server/transport/shm/shm_channel.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "dataplane/shm_doorbell.h"

namespace kvpool::server {
namespace {

// A decode worker's next layer usually calls within tens of microseconds: spin that long before
// blocking on the doorbell. An idle channel checks its client's socket at every timeout.
constexpr absl::Duration kSpin = absl::Microseconds(100);
constexpr absl::Duration kIdleCheck = absl::Milliseconds(100);

absl::StatusOr<std::vector<int32_t>> Copy(absl::StatusOr<absl::Span<const int32_t>> tokens) {
  if (!tokens.ok()) return tokens.status();
  return std::vector<int32_t>(tokens->begin(), tokens->end());
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShmChannel>> ShmChannel::Create(ServiceContext* ctx, TenantId tenant,
                                                               const ShmLayout& layout,
                                                               bool device_io) {
  const int fd = memfd_create("kvpool-attention", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    return absl::ResourceExhaustedError(absl::StrCat("memfd_create: ", std::strerror(errno)));
  }
  const size_t bytes = layout.region_bytes();
  // Sealed at its size: a client that could shrink it would make the daemon's next access fault.
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    const int e = errno;
    close(fd);
    return absl::ResourceExhaustedError(absl::StrCat("shared region: ", std::strerror(e)));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) {
    const int e = errno;
    close(fd);
    return absl::ResourceExhaustedError(absl::StrCat("mmap shared region: ", std::strerror(e)));
  }
  auto* region = static_cast<uint8_t*>(p);
  WriteShmRegionHeader(layout, region);
  std::unique_ptr<ShmChannel> ch(new ShmChannel(ctx, std::move(tenant), layout, fd, region));
  KVPOOL_ASSIGN_OR_RETURN(ch->registration_, ctx->backend->RegisterHostMemory(region, bytes));
  for (uint32_t i = 0; device_io && i < layout.slots; ++i) {
    KVPOOL_ASSIGN_OR_RETURN(
        std::unique_ptr<DeviceMailbox> m,
        ctx->backend->CreateDeviceMailbox(2 * layout.max_query_bytes + layout.max_lse_bytes));
    uint8_t* at = region + layout.slot_at(i) + ShmLayout::mailbox_at();
    const std::string handles[3] = {m->memory_handle(), m->ready_handle(), m->done_handle()};
    for (int h = 0; h < 3; ++h) {
      if (handles[h].size() != kShmIpcHandleBytes) {
        return absl::InternalError("a CUDA IPC handle of unexpected size");
      }
      std::memcpy(at + h * kShmIpcHandleBytes, handles[h].data(), kShmIpcHandleBytes);
    }
    ch->mailboxes_.push_back(std::move(m));
  }
  return ch;
}

ShmChannel::ShmChannel(ServiceContext* ctx, TenantId tenant, const ShmLayout& layout, int fd,
                       uint8_t* region)
    : ctx_(ctx), tenant_(std::move(tenant)), layout_(layout), fd_(fd), region_(region) {}

ShmChannel::~ShmChannel() {
  Close();
  {
    absl::MutexLock lock(&plans_mu_);
    plans_.clear();  // page references and resident tables go before the backend mapping
  }
  mailboxes_.clear();
  registration_.reset();
  munmap(region_, layout_.region_bytes());
  close(fd_);
  if (peer_ >= 0) close(peer_);
}

void ShmChannel::Start(int peer_socket, std::function<void(absl::Status)> on_end) {
  absl::MutexLock lock(&start_mu_);
  if (started_) {
    close(peer_socket);
    return;
  }
  started_ = true;
  peer_ = peer_socket;
  on_end_ = std::move(on_end);
  loop_ = std::thread([this] { Loop(); });
}

void ShmChannel::Close() {
  stop_.store(true);
  // Wakes the loop if it blocks on the doorbell (a change of the word it waits on).
  std::atomic<uint32_t>& bell = *SharedWord(region_ + kShmDoorbellAt);
  IncrementAndWake(bell, *SharedWord(region_ + kShmDaemonSleepingAt));
  std::thread t;
  {
    absl::MutexLock lock(&start_mu_);
    if (!loop_.joinable()) return;
    if (loop_.get_id() == std::this_thread::get_id()) {
      // From on_end, which may go on to destroy the channel: the loop's thread ends by itself.
      loop_.detach();
      return;
    }
    t = std::move(loop_);
  }
  t.join();
}

absl::StatusOr<AttentionPlanInfo> ShmChannel::AddPlan(const std::string& model_id,
                                                      std::vector<std::string> sequence_ids,
                                                      int num_queries) {
  KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model,
                          ctx_->registry->Get(tenant_, model_id));
  KVPOOL_ASSIGN_OR_RETURN(
      AttentionPlanShape shape,
      MakeAttentionPlanShape(static_cast<int>(std::min<size_t>(sequence_ids.size(), INT32_MAX)),
                             num_queries, model->q_heads, model->head_dim,
                             ctx_->config->max_attention_batch));
  if (shape.query_bytes() > layout_.max_query_bytes || shape.lse_bytes() > layout_.max_lse_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("a call of this plan moves ", shape.query_bytes(),
                     " query bytes; this channel's slots hold ", layout_.max_query_bytes,
                     " (negotiate a larger max_query_bytes)"));
  }
  const int layers = model->num_layers;
  KVPOOL_ASSIGN_OR_RETURN(
      std::unique_ptr<AttentionPlan> plan,
      AttentionPlan::Create(ctx_->store, ctx_->backend, tenant_, std::move(model),
                            std::move(sequence_ids), num_queries));
  absl::MutexLock lock(&plans_mu_);
  if (ended_) return absl::FailedPreconditionError("the shared-memory channel has ended");
  if (plans_.size() >= static_cast<size_t>(kMaxPlans)) {
    return absl::ResourceExhaustedError(absl::StrCat("a channel holds at most ", kMaxPlans,
                                                     " plans; drop one (DropAttentionPlan)"));
  }
  const uint32_t id = next_plan_++;
  plans_.emplace(id, Plan{std::move(plan), shape});
  return AttentionPlanInfo{id, shape, layers};
}

absl::Status ShmChannel::DropPlan(uint32_t plan_id) {
  absl::MutexLock lock(&plans_mu_);
  if (plans_.erase(plan_id) == 0) {
    return absl::NotFoundError(absl::StrCat("no attention plan ", plan_id));
  }
  return absl::OkStatus();
}

bool ShmChannel::PeerGone() const {
  pollfd p{peer_, POLLIN | POLLRDHUP, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  // The client sends nothing after its hello: data, hang-up or an error all end the lease.
  return (p.revents & (POLLIN | POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

void ShmChannel::Loop() {
  std::atomic<uint32_t>& bell = *SharedWord(region_ + kShmDoorbellAt);
  std::atomic<uint32_t>& sleeping = *SharedWord(region_ + kShmDaemonSleepingAt);
  absl::Status why = absl::OkStatus();
  while (!stop_.load()) {
    // Read before looking at the slots: a call published after this read also moves the bell.
    const uint32_t seen = bell.load(std::memory_order_seq_cst);
    bool served = false;
    for (uint32_t i = 0; i < layout_.slots && !stop_.load(); ++i) {
      std::atomic<uint32_t>& state = *SharedWord(region_ + layout_.slot_at(i));
      if (state.load(std::memory_order_acquire) == kSlotRequest) {
        Serve(i);
        served = true;
      }
    }
    if (served) continue;
    if (WaitWhileEqual(bell, seen, sleeping, kSpin, kIdleCheck) == seen && PeerGone()) {
      why = absl::UnavailableError("the client closed the channel's Unix socket");
      break;
    }
  }
  {
    absl::MutexLock lock(&plans_mu_);
    ended_ = true;
  }
  std::function<void(absl::Status)> on_end = std::move(on_end_);
  if (on_end) on_end(why);  // may destroy this channel: nothing after it
}

absl::StatusOr<std::vector<int32_t>> ShmChannel::Attend(uint32_t slot, const CallHeader& h) {
  std::shared_ptr<AttentionPlan> plan;
  AttentionPlanShape shape;
  {
    absl::MutexLock lock(&plans_mu_);
    auto it = plans_.find(h.plan_id);
    if (it == plans_.end())
      return absl::NotFoundError(absl::StrCat("no attention plan ", h.plan_id));
    plan = it->second.plan;
    shape = it->second.shape;
  }
  if (h.query_bytes != shape.query_bytes() || h.lse_bytes != shape.lse_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan ", h.plan_id, " moves ", shape.query_bytes(), " query and ", shape.lse_bytes(),
        " LSE bytes per call; the header says ", h.query_bytes, " and ", h.lse_bytes));
  }
  uint8_t* s = region_ + layout_.slot_at(slot);
  void* q = s + ShmLayout::queries_at();
  void* out = s + layout_.out_at();
  void* lse = s + layout_.lse_at();
  const bool device_backend = ctx_->backend->device() >= 0;
  const uint32_t io_kind = SharedWord(s + kShmSlotIoAt)->load(std::memory_order_acquire);
  if (io_kind == kIoDevice) {
    if (mailboxes_.empty()) {
      return absl::InvalidArgumentError("device I/O on a channel negotiated without device_io");
    }
    const DeviceMailbox* m = mailboxes_[slot].get();
    const AttentionRows io{reinterpret_cast<const float*>(m->data()),
                           reinterpret_cast<float*>(m->data() + layout_.max_query_bytes),
                           reinterpret_cast<float*>(m->data() + 2 * layout_.max_query_bytes),
                           plan->rows()};
    return Copy(plan->Attend(h.layer, io, /*on_device=*/true, m));
  }
  if (io_kind != kIoRegion) {
    return absl::InvalidArgumentError(absl::StrCat("unknown slot I/O kind ", io_kind));
  }
  const AttentionRows host_io{static_cast<const float*>(q), static_cast<float*>(out),
                              static_cast<float*>(lse), plan->rows()};
  AttentionRows kernel_io = host_io;
  // Small calls in place (no copy to wait for); larger ones by DMA (the backend's host I/O).
  const bool in_place = device_backend && h.query_bytes <= ctx_->config->shm_in_place_bytes;
  if (in_place) {
    // The registered region in place: the kernels read the queries and write the outputs there.
    kernel_io = {static_cast<const float*>(registration_->KernelAddress(q)),
                 static_cast<float*>(registration_->KernelAddress(out)),
                 static_cast<float*>(registration_->KernelAddress(lse)), plan->rows()};
  }
  // The tokens are copied while `plan` is held: a DropPlan meanwhile may leave it the last owner.
  if (ctx_->combiner == nullptr) return Copy(plan->Attend(h.layer, kernel_io, in_place));
  return Copy(ctx_->combiner->Attend(plan.get(), h.layer, host_io, kernel_io, in_place));
}

void ShmChannel::Serve(uint32_t slot) {
  uint8_t* s = region_ + layout_.slot_at(slot);
  std::array<uint8_t, kCallHeaderBytes> header;
  std::memcpy(header.data(), s + kShmSlotHeaderAt, header.size());  // the client may rewrite it
  CallStatus st;
  absl::StatusOr<CallHeader> h = DecodeCallHeader(header);
  if (!h.ok()) {
    st.status = h.status();
  } else {
    st.call = h->call;
    absl::StatusOr<std::vector<int32_t>> tokens = Attend(slot, *h);
    if (tokens.ok()) {
      st.attended_tokens.assign(tokens->begin(), tokens->end());
    } else {
      st.status = tokens.status();
    }
  }
  std::array<uint8_t, kCallStatusBytes> block;
  if (!EncodeCallStatus(st, absl::MakeSpan(block)).ok()) {
    st.attended_tokens.clear();
    st.status = absl::InternalError("status block");
    (void)EncodeCallStatus(st, absl::MakeSpan(block));
  }
  std::memcpy(s + kShmSlotStatusAt, block.data(), block.size());
  calls_.fetch_add(1, std::memory_order_relaxed);
  StoreAndWake(*SharedWord(s), kSlotDone, *SharedWord(s + 4));
}

}  // namespace kvpool::server
