#include "server/transport/nccl/attention_channel.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/cuda_status.h"
#include "common/nccl_status.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "server/transport/device/poll_backoff.h"
#include "server/transport/nccl/nccl_channel.h"  // DisableNvlinkMulticast, AwaitCommSettled
#include "spdlog/spdlog.h"

namespace kvpool::server {
namespace {

ncclComm_t Comm(void* c) { return static_cast<ncclComm_t>(c); }

// How long a call may take between its header and the last byte of its queries.
constexpr absl::Duration kCallTimeout = absl::Seconds(30);
// Waiting for the next call: spin this long, then sleep in growing steps up to kMaxNap.
constexpr absl::Duration kSpin = absl::Milliseconds(5);
constexpr absl::Duration kMaxNap = absl::Milliseconds(1);

// KVPOOL_TRACE_ATTENTION_CHANNEL=1 logs each call with the time of each step (info level), to
// see where a call's time goes without a profiler.
bool TraceCalls() {
  static const bool on = [] {
    const char* v = std::getenv("KVPOOL_TRACE_ATTENTION_CHANNEL");
    return v != nullptr && v[0] == '1';
  }();
  return on;
}
}  // namespace

// The channel's CUDA resources: one stream for every NCCL operation and copy, an event the
// loop polls, the header and status blocks (device + pinned host), and the query, output and
// LSE buffers (grown on demand up to kMaxCallQueryBytes, never shrunk).
class AttentionChannel::Buffers {
 public:
  static absl::StatusOr<std::unique_ptr<Buffers>> Create(int device) {
    auto b = std::unique_ptr<Buffers>(new Buffers(device));
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device), "cudaSetDevice"));
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(cudaStreamCreateWithFlags(&b->stream, cudaStreamNonBlocking), "stream"));
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(cudaEventCreateWithFlags(&b->event, cudaEventDisableTiming), "event"));
    KVPOOL_RETURN_IF_ERROR(b->Grow(&b->d_header, kCallHeaderBytes));  // stream-ordered (Reserve)
    KVPOOL_RETURN_IF_ERROR(b->Grow(&b->d_status, kCallStatusBytes));
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(b->stream), "channel buffers"));
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(cudaMallocHost(&b->h_header, kCallHeaderBytes), "cudaMallocHost"));
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(cudaMallocHost(&b->h_status, kCallStatusBytes), "cudaMallocHost"));
    return b;
  }

  // Replaces `*p` by a fresh device allocation of `bytes`, in stream order.
  absl::Status Grow(void** p, size_t bytes) {
    if (*p != nullptr)
      KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaFreeAsync(*p, stream), "cudaFreeAsync"));
    *p = nullptr;
    return CudaStatus(cudaMallocAsync(p, bytes, stream), "cudaMallocAsync");
  }

  ~Buffers() {
    cudaSetDevice(device_);
    if (stream != nullptr) cudaStreamSynchronize(stream);
    cudaFree(d_header);
    cudaFree(d_status);
    cudaFree(d_queries);
    cudaFree(d_out);
    cudaFree(d_lse);
    cudaFreeHost(h_header);
    cudaFreeHost(h_status);
    if (event != nullptr) cudaEventDestroy(event);
    if (stream != nullptr) cudaStreamDestroy(stream);
    (void)cudaGetLastError();
  }

  // Room for `query_bytes` of queries and of out, `lse_bytes` of lse. Growing is ordered on the
  // channel's stream (cudaFreeAsync / cudaMallocAsync): cudaFree would wait for the whole device,
  // where other channels' receives stay resident until their next calls.
  absl::Status Reserve(size_t query_bytes, size_t lse_bytes) {
    if (query_bytes > query_capacity) {
      KVPOOL_RETURN_IF_ERROR(Grow(&d_queries, query_bytes));
      query_capacity = 0;
      KVPOOL_RETURN_IF_ERROR(Grow(&d_out, query_bytes));
      query_capacity = query_bytes;
    }
    if (lse_bytes > lse_capacity) {
      lse_capacity = 0;
      KVPOOL_RETURN_IF_ERROR(Grow(&d_lse, lse_bytes));
      lse_capacity = lse_bytes;
    }
    return absl::OkStatus();
  }

  cudaStream_t stream = nullptr;
  cudaEvent_t event = nullptr;
  void* d_header = nullptr;
  void* d_status = nullptr;
  uint8_t* h_header = nullptr;
  uint8_t* h_status = nullptr;
  void* d_queries = nullptr;
  void* d_out = nullptr;
  void* d_lse = nullptr;
  size_t query_capacity = 0;
  size_t lse_capacity = 0;

 private:
  explicit Buffers(int device) : device_(device) {}
  const int device_;
};

AttentionChannel::AttentionChannel(ServiceContext* ctx, TenantId tenant, std::string name,
                                   int device, void* comm, std::unique_ptr<Buffers> buffers)
    : ctx_(ctx),
      tenant_(std::move(tenant)),
      name_(std::move(name)),
      device_(device),
      comm_(comm),
      buffers_(std::move(buffers)) {}

absl::StatusOr<std::unique_ptr<AttentionChannel>> AttentionChannel::Join(
    ServiceContext* ctx, TenantId tenant, const std::string& unique_id, absl::Duration timeout,
    std::string name, const std::function<bool()>& cancelled, bool blocking_ops) {
  const int device = ctx->backend->device();
  if (device < 0) return absl::UnavailableError("this kvpoold keeps its pool in host memory");
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<Buffers> buffers, Buffers::Create(device));
  KVPOOL_ASSIGN_OR_RETURN(void* joined,
                          JoinNcclComm(device, unique_id, timeout, cancelled, blocking_ops));
  ncclComm_t comm = Comm(joined);
  auto* raw = new AttentionChannel(ctx, std::move(tenant), std::move(name), device, comm,
                                   std::move(buffers));
  // The connect exchange before the channel is answered (the client connects right after it
  // joined), on a thread of its own: on a blocking communicator it may wait on the host.
  bool abandoned = false;
  absl::Status connected = ConnectWithin([raw] { return raw->Connect(); }, [raw] { delete raw; },
                                         timeout, cancelled, &abandoned);
  if (abandoned) return connected;  // the connecting thread frees the channel
  std::unique_ptr<AttentionChannel> channel(raw);
  KVPOOL_RETURN_IF_ERROR(connected);
  if (TraceCalls()) spdlog::info("attention channel {}: connected", channel->name_);
  return channel;
}

AttentionChannel::~AttentionChannel() {
  Close();
  absl::MutexLock lock(&start_mu_);
  if (!started_) {  // never ran: the loop's cleanup is ours
    cudaSetDevice(device_);
    if (!aborted_) ncclCommAbort(Comm(comm_));  // a failed Connect aborted it already
    buffers_.reset();
  }
}

void AttentionChannel::Start(std::function<void(absl::Status)> on_end) {
  absl::MutexLock lock(&start_mu_);
  if (started_) return;
  started_ = true;
  on_end_ = std::move(on_end);
  loop_ = std::thread([this] { Loop(); });
}

void AttentionChannel::Close() {
  stop_.store(true);
  std::thread loop;
  {
    absl::MutexLock lock(&start_mu_);
    if (!loop_.joinable()) return;
    if (loop_.get_id() == std::this_thread::get_id()) {
      loop_.detach();  // from on_end: the loop returns right after it
      return;
    }
    loop = std::move(loop_);
  }
  loop.join();
}

absl::StatusOr<AttentionPlanInfo> AttentionChannel::AddPlan(const std::string& model_id,
                                                            std::vector<std::string> sequence_ids,
                                                            int num_queries) {
  KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model,
                          ctx_->registry->Get(tenant_, model_id));
  for (const std::string& id : sequence_ids) {
    if (id.empty()) return absl::InvalidArgumentError("a sequence id of the plan is empty");
  }
  KVPOOL_ASSIGN_OR_RETURN(
      AttentionPlanShape shape,
      MakeAttentionPlanShape(static_cast<int>(std::min<size_t>(sequence_ids.size(), INT32_MAX)),
                             num_queries, model->q_heads, model->head_dim,
                             ctx_->config->max_attention_batch));
  auto plan = std::make_shared<Plan>();
  plan->model_id = model_id;
  plan->sequence_ids = std::move(sequence_ids);
  plan->shape = shape;
  absl::MutexLock lock(&plans_mu_);
  if (ended_) return absl::FailedPreconditionError("the attention channel has ended");
  if (plans_.size() >= static_cast<size_t>(kMaxPlans)) {
    return absl::ResourceExhaustedError(absl::StrCat("a channel holds at most ", kMaxPlans,
                                                     " plans; drop one (DropAttentionPlan)"));
  }
  const uint32_t id = next_plan_++;
  plans_.emplace(id, std::move(plan));
  return AttentionPlanInfo{id, shape, model->num_layers};
}

absl::Status AttentionChannel::DropPlan(uint32_t plan_id) {
  absl::MutexLock lock(&plans_mu_);
  if (plans_.erase(plan_id) == 0) {
    return absl::NotFoundError(absl::StrCat("no attention plan ", plan_id));
  }
  return absl::OkStatus();
}

std::shared_ptr<const AttentionChannel::Plan> AttentionChannel::FindPlan(uint32_t id) const {
  absl::MutexLock lock(&plans_mu_);
  auto it = plans_.find(id);
  return it == plans_.end() ? nullptr : it->second;
}

absl::Status AttentionChannel::Failed(absl::Status why) {
  if (!aborted_) {
    ncclCommAbort(Comm(comm_));
    aborted_ = true;
  }
  return why;
}

absl::Status AttentionChannel::Settle(absl::Time deadline) {
  const absl::Status s = AwaitCommSettled(
      comm_, deadline, [this] { return stop_.load(); }, "NCCL call timed out");
  if (s.ok()) return s;
  return Failed(absl::IsCancelled(s) ? absl::OkStatus() : s);  // stopped: Close's own status
}

absl::Status AttentionChannel::WaitEvent(absl::Time deadline) {
  const absl::Time start = absl::Now();
  absl::Duration nap = absl::Microseconds(20);
  for (uint64_t polls = 0;; ++polls) {
    const cudaError_t e = cudaEventQuery(buffers_->event);
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady) return Failed(CudaStatus(e, "waiting for NCCL"));
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(Comm(comm_), &state);
    if (state != ncclSuccess && state != ncclInProgress) {
      return Failed(NcclStatus(state, "NCCL (the peer failed or left)"));
    }
    if (stop_.load()) return Failed(absl::OkStatus());
    const absl::Time now = absl::Now();
    if (now > deadline) {
      return Failed(absl::DeadlineExceededError("the client stopped sending mid-call"));
    }
    if (now - start > kSpin) {
      absl::SleepFor(nap);
      nap = std::min(nap * 2, kMaxNap);
    }
  }
}

absl::Status AttentionChannel::Connect() {
  // NCCL connects a peer's send and receive paths lazily, each at its first use, and setting
  // one up waits for the peer to use the matching path. A call's first round trip would then
  // deadlock: the client's group (send header and queries, receive the answer) needs our send
  // path, which we set up only after its header arrived. One symmetric exchange first connects
  // both directions on both ends. (On a blocking communicator this group waits on the host
  // until the client joins in, which its Open does right after joining, before it reads the
  // channel's answer; no later group waits for the peer on the host.)
  Buffers& b = *buffers_;
  const absl::Time deadline = absl::Now() + kCallTimeout;
  ncclGroupStart();
  ncclSend(b.d_header, kConnectBytes, ncclUint8, /*peer=*/0, Comm(comm_), b.stream);
  ncclRecv(b.d_status, kConnectBytes, ncclUint8, /*peer=*/0, Comm(comm_), b.stream);
  const ncclResult_t r = ncclGroupEnd();
  if (r != ncclSuccess && r != ncclInProgress) return Failed(NcclStatus(r, "NCCL connect"));
  KVPOOL_RETURN_IF_ERROR(Settle(deadline));
  if (aborted_) return absl::OkStatus();
  absl::Status s = CudaStatus(cudaEventRecord(b.event, b.stream), "event");
  if (!s.ok()) return Failed(s);
  return WaitEvent(deadline);
}

void AttentionChannel::Loop() {
  absl::Status why = CudaStatus(cudaSetDevice(device_), "cudaSetDevice");
  if (!why.ok()) why = Failed(why);
  for (uint64_t call = 1; why.ok() && !aborted_; ++call) {
    why = ServeOne(call);
    if (why.ok() && !aborted_) calls_.fetch_add(1, std::memory_order_relaxed);
  }
  if (!aborted_) why = Failed(why);
  buffers_.reset();  // after the abort: nothing is in flight any more
  {
    absl::MutexLock lock(&plans_mu_);
    ended_ = true;
    plans_.clear();
  }
  spdlog::info("attention channel with {} on cuda:{} ended after {} calls: {}", name_, device_,
               calls_.load(), why.ok() ? std::string("closed") : why.ToString());
  std::function<void(absl::Status)> on_end = std::move(on_end_);
  if (on_end) on_end(std::move(why));  // last: it may destroy this channel
}

absl::Status AttentionChannel::ServeOne(uint64_t expected_call) {
  Buffers& b = *buffers_;
  ncclComm_t comm = Comm(comm_);
  // 1. The header: a receive with no deadline (an idle channel waits here), copied to the host.
  ncclGroupStart();
  ncclRecv(b.d_header, kCallHeaderBytes, ncclUint8, /*peer=*/0, comm, b.stream);
  ncclResult_t r = ncclGroupEnd();
  if (r != ncclSuccess && r != ncclInProgress) return Failed(NcclStatus(r, "ncclRecv header"));
  KVPOOL_RETURN_IF_ERROR(Settle(absl::InfiniteFuture()));
  if (aborted_) return absl::OkStatus();  // closed
  absl::Status s = CudaStatus(
      cudaMemcpyAsync(b.h_header, b.d_header, kCallHeaderBytes, cudaMemcpyDeviceToHost, b.stream),
      "D2H call header");
  if (s.ok()) s = CudaStatus(cudaEventRecord(b.event, b.stream), "event");
  if (!s.ok()) return Failed(s);
  KVPOOL_RETURN_IF_ERROR(WaitEvent(absl::InfiniteFuture()));
  if (aborted_) return absl::OkStatus();
  const absl::Time arrived = absl::Now();
  // Microseconds from the header's arrival to each later step (trace only).
  double steps_us[4] = {0, 0, 0, 0};
  auto mark = [&](int step) {
    if (TraceCalls()) steps_us[step] = absl::ToDoubleMicroseconds(absl::Now() - arrived);
  };

  // 2. Parse: a header that cannot be trusted ends the channel.
  absl::StatusOr<CallHeader> header =
      DecodeCallHeader(absl::MakeConstSpan(b.h_header, kCallHeaderBytes));
  if (!header.ok()) {
    return Failed(absl::InvalidArgumentError(
        absl::StrCat("unparseable call header: ", header.status().message())));
  }
  const CallHeader& h = *header;
  if (h.call != expected_call) {
    return Failed(absl::InvalidArgumentError(
        absl::StrCat("call number ", h.call, " out of order (expected ", expected_call, ")")));
  }
  const absl::Time deadline = absl::Now() + kCallTimeout;

  // 3. The queries, whatever the call's fate (the client has sent them).
  s = b.Reserve(h.query_bytes, h.lse_bytes);
  if (!s.ok()) return Failed(s);
  ncclGroupStart();
  ncclRecv(b.d_queries, h.query_bytes, ncclUint8, /*peer=*/0, comm, b.stream);
  r = ncclGroupEnd();
  if (r != ncclSuccess && r != ncclInProgress) return Failed(NcclStatus(r, "ncclRecv queries"));
  KVPOOL_RETURN_IF_ERROR(Settle(deadline));
  if (aborted_) return absl::OkStatus();
  mark(0);
  s = CudaStatus(cudaEventRecord(b.event, b.stream), "event");
  if (!s.ok()) return Failed(s);
  KVPOOL_RETURN_IF_ERROR(WaitEvent(deadline));
  if (aborted_) return absl::OkStatus();
  mark(1);

  // 4. Attend with device I/O; the outcome goes back in the status block.
  absl::StatusOr<std::vector<int>> attended = Attend(h);
  mark(2);
  CallStatus status;
  status.call = h.call;
  if (attended.ok()) {
    status.attended_tokens.assign(attended->begin(), attended->end());
  } else {
    status.status = attended.status();
  }
  s = EncodeCallStatus(status, absl::MakeSpan(b.h_status, kCallStatusBytes));
  if (!s.ok()) return Failed(s);

  // 5. Status, out, lse (zeros on error). The next header's receive follows on the same stream,
  // so these sends have completed before the buffers are touched again.
  if (!attended.ok()) {
    s = CudaStatus(cudaMemsetAsync(b.d_out, 0, h.query_bytes, b.stream), "memset out");
    if (s.ok()) s = CudaStatus(cudaMemsetAsync(b.d_lse, 0, h.lse_bytes, b.stream), "memset lse");
    if (!s.ok()) return Failed(s);
  }
  s = CudaStatus(
      cudaMemcpyAsync(b.d_status, b.h_status, kCallStatusBytes, cudaMemcpyHostToDevice, b.stream),
      "H2D status");
  if (!s.ok()) return Failed(s);
  ncclGroupStart();
  ncclSend(b.d_status, kCallStatusBytes, ncclUint8, /*peer=*/0, comm, b.stream);
  ncclSend(b.d_out, h.query_bytes, ncclUint8, /*peer=*/0, comm, b.stream);
  ncclSend(b.d_lse, h.lse_bytes, ncclUint8, /*peer=*/0, comm, b.stream);
  r = ncclGroupEnd();
  if (r != ncclSuccess && r != ncclInProgress) return Failed(NcclStatus(r, "ncclSend answer"));
  s = Settle(deadline);
  mark(3);
  if (TraceCalls()) {
    spdlog::info(
        "attention channel {}: call {} (plan {}, layer {}, {} query bytes): {}; us after the "
        "header: queries posted {:.1f}, queries in {:.1f}, attended {:.1f}, answer posted {:.1f}",
        name_, h.call, h.plan_id, h.layer, h.query_bytes, attended.status().ToString(), steps_us[0],
        steps_us[1], steps_us[2], steps_us[3]);
  }
  return s;
}

absl::StatusOr<std::vector<int>> AttentionChannel::Attend(const CallHeader& h) {
  std::shared_ptr<const Plan> plan = FindPlan(h.plan_id);
  if (plan == nullptr) {
    return absl::NotFoundError(absl::StrCat("no attention plan ", h.plan_id, " on this channel"));
  }
  if (h.query_bytes != plan->shape.query_bytes() || h.lse_bytes != plan->shape.lse_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the call moves ", h.query_bytes, " query and ", h.lse_bytes, " LSE bytes; plan ",
        h.plan_id, " needs ", plan->shape.query_bytes(), " and ", plan->shape.lse_bytes()));
  }
  KVPOOL_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model,
                          ctx_->registry->Get(tenant_, plan->model_id));
  if (model->q_heads != plan->shape.q_heads || model->head_dim != plan->shape.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model ", Quote(plan->model_id), " changed shape since plan ", h.plan_id, " was set"));
  }
  ctx_->counters.attention_calls++;
  ctx_->counters.attention_sequences += plan->sequence_ids.size();
  DeviceAttentionCall call;
  call.layer = h.layer;
  call.sequence_ids = plan->sequence_ids;
  call.num_queries = plan->shape.num_queries;
  call.queries = static_cast<const float*>(buffers_->d_queries);
  call.out = static_cast<float*>(buffers_->d_out);
  call.lse = static_cast<float*>(buffers_->d_lse);
  return ctx_->attention->RunOnDevice(tenant_, std::move(model), call);
}

}  // namespace kvpool::server
