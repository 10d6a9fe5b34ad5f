#include "client/transport/gpu_attention.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/transport/gpu_client_common.h"
#include "common/cuda_status.h"
#include "common/nccl_status.h"
#include "common/status_macros.h"
#include "dataplane/attention_wire.h"
#include "proto/status.h"

namespace kvpool::client {
namespace {

namespace v1 = ::kvpool::v1;
using server::CallHeader;
using server::CallStatus;
using server::kCallHeaderBytes;
using server::kCallStatusBytes;

ncclComm_t Comm(void* c) { return static_cast<ncclComm_t>(c); }
cudaStream_t Stream(void* s) { return static_cast<cudaStream_t>(s); }
cudaEvent_t Event(void* e) { return static_cast<cudaEvent_t>(e); }

std::chrono::system_clock::time_point DeadlineIn(absl::Duration d) {
  return std::chrono::system_clock::now() + absl::ToChronoMilliseconds(d);
}

// A call waits without sleeping this long (remote attention takes tens of microseconds to a few
// milliseconds), then in short naps.
constexpr absl::Duration kSpin = absl::Milliseconds(20);

}  // namespace

GpuAttentionClient::GpuAttentionClient(std::shared_ptr<grpc::Channel> channel, int device)
    : stub_(v1::TransportService::NewStub(std::move(channel))), device_(device) {}

absl::StatusOr<std::unique_ptr<GpuAttentionClient>> GpuAttentionClient::Create(
    std::shared_ptr<grpc::Channel> channel, int device) {
  gpu_internal::DisableNvlinkMulticast();  // shared hosts
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device), "cudaSetDevice"));
  auto c = std::unique_ptr<GpuAttentionClient>(new GpuAttentionClient(std::move(channel), device));
  cudaStream_t s = nullptr;
  cudaEvent_t done = nullptr, ready = nullptr;
  KVPOOL_RETURN_IF_ERROR(
      CudaStatus(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream"));
  c->stream_ = s;
  KVPOOL_RETURN_IF_ERROR(
      CudaStatus(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "event"));
  c->done_ = done;
  KVPOOL_RETURN_IF_ERROR(
      CudaStatus(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "event"));
  c->ready_ = ready;
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&c->d_header_, kCallHeaderBytes), "cudaMalloc"));
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&c->d_status_, kCallStatusBytes), "cudaMalloc"));
  void* h = nullptr;
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaMallocHost(&h, kCallHeaderBytes), "cudaMallocHost"));
  c->h_header_ = static_cast<uint8_t*>(h);
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaMallocHost(&h, kCallStatusBytes), "cudaMallocHost"));
  c->h_status_ = static_cast<uint8_t*>(h);
  return c;
}

GpuAttentionClient::~GpuAttentionClient() {
  {
    absl::MutexLock lock(&mu_);
    (void)CloseLocked();
  }
  cudaSetDevice(device_);
  if (stream_ != nullptr) cudaStreamSynchronize(Stream(stream_));
  cudaFree(d_header_);
  cudaFree(d_status_);
  cudaFreeHost(h_header_);
  cudaFreeHost(h_status_);
  if (done_ != nullptr) cudaEventDestroy(Event(done_));
  if (ready_ != nullptr) cudaEventDestroy(Event(ready_));
  if (stream_ != nullptr) cudaStreamDestroy(Stream(stream_));
  (void)cudaGetLastError();
}

bool GpuAttentionClient::is_open() const {
  absl::MutexLock lock(&mu_);
  return comm_ != nullptr && !broken_;
}

uint64_t GpuAttentionClient::channel_id() const {
  absl::MutexLock lock(&mu_);
  return channel_id_;
}

void GpuAttentionClient::set_call_timeout(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  call_timeout_ = timeout;
}

bool GpuAttentionClient::LeaseEnded(absl::Status* why) const {
  absl::MutexLock lock(&lease_mu_);
  if (lease_ended_ && why != nullptr) *why = lease_status_;
  return lease_ended_;
}

absl::Status GpuAttentionClient::Open(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  if (comm_ != nullptr) return absl::FailedPreconditionError("the channel is already open");
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  // Connect both directions before the first call (attention_wire.h, kConnectBytes); the daemon
  // does its half before it answers Negotiate.
  auto connect =
      [this](ncclComm_t comm, absl::Time deadline, const std::function<absl::Status()>& give_up)
          ABSL_NO_THREAD_SAFETY_ANALYSIS { return ConnectPeer(comm, deadline, give_up); };
  KVPOOL_ASSIGN_OR_RETURN(gpu_internal::NcclSessionJoin joined,
                          gpu_internal::JoinNcclSession(*stub_, v1::NCCL_CHANNEL_USE_ATTENTION,
                                                        timeout, "gpu-attention", connect));
  const v1::NcclSession& session = joined.session;
  {
    absl::MutexLock lease_lock(&lease_mu_);
    lease_ended_ = false;
    lease_status_ = absl::OkStatus();
  }
  // The channel's lease: the daemon closes the channel when this stream ends, and ends the
  // stream when it closes or aborts the channel. It answers once the watch holds.
  v1::WatchSessionRequest watch;
  watch.set_session_id(session.session_id());
  lease_context_ = std::make_unique<grpc::ClientContext>();
  lease_ = stub_->WatchSession(lease_context_.get(), watch);
  v1::WatchSessionResponse first;
  if (!lease_->Read(&first)) {
    ncclCommAbort(joined.comm);
    const grpc::Status s = lease_->Finish();
    lease_.reset();
    lease_context_.reset();
    return s.ok() ? absl::UnavailableError("WatchSession ended without an answer")
                  : FromGrpcStatus(s, "WatchSession");
  }
  comm_ = joined.comm;
  broken_ = false;
  channel_id_ = session.session_id();
  next_call_ = 1;
  // The lease's reader: the stream ends when the daemon closes or aborts the channel.
  lease_thread_ = std::thread([this, lease = lease_.get()] {
    v1::WatchSessionResponse more;
    while (lease->Read(&more)) {
    }
    const grpc::Status s = lease->Finish();
    absl::MutexLock lease_lock(&lease_mu_);
    lease_ended_ = true;
    lease_status_ = FromGrpcStatus(s, "the daemon ended the attention channel");
  });
  if (session.call_header_bytes() != kCallHeaderBytes ||
      session.call_status_bytes() != kCallStatusBytes) {
    (void)CloseLocked();
    return absl::FailedPreconditionError("the daemon speaks another attention wire version");
  }
  return absl::OkStatus();
}

absl::Status GpuAttentionClient::ConnectPeer(void* peer_comm, absl::Time deadline,
                                             const std::function<absl::Status()>& give_up) {
  ncclComm_t comm = Comm(peer_comm);
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  cudaStream_t s = Stream(stream_);
  // Polls until the communicator has nothing in progress (with `event`: and done_ has fired).
  auto settle = [&](bool event) -> absl::Status {
    while (true) {
      ncclResult_t state = ncclSuccess;
      if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) state = ncclInternalError;
      if (state != ncclSuccess && state != ncclInProgress) {
        return NcclStatus(state, "connecting the NCCL channel");
      }
      if (state == ncclSuccess) {
        if (!event) return absl::OkStatus();
        const cudaError_t e = cudaEventQuery(Event(done_));
        if (e == cudaSuccess) return absl::OkStatus();
        if (e != cudaErrorNotReady) return CudaStatus(e, "connecting the NCCL channel");
      }
      KVPOOL_RETURN_IF_ERROR(give_up());
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError("the daemon did not connect the NCCL channel");
      }
      absl::SleepFor(absl::Microseconds(50));
    }
  };
  ncclGroupStart();
  ncclSend(d_header_, server::kConnectBytes, ncclUint8, /*peer=*/1, comm, s);
  ncclRecv(d_status_, server::kConnectBytes, ncclUint8, /*peer=*/1, comm, s);
  const ncclResult_t r = ncclGroupEnd();
  if (r != ncclSuccess && r != ncclInProgress) return NcclStatus(r, "connecting the NCCL channel");
  KVPOOL_RETURN_IF_ERROR(settle(/*event=*/false));
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(Event(done_), s), "event"));
  return settle(/*event=*/true);
}

absl::StatusOr<GpuAttentionPlan> GpuAttentionClient::SetPlan(
    const std::string& model_id, const std::vector<std::string>& sequence_ids, int num_queries) {
  uint64_t channel = 0;
  {
    absl::MutexLock lock(&mu_);
    if (comm_ == nullptr || broken_) return absl::FailedPreconditionError("no open channel");
    channel = channel_id_;
  }
  return SetAttentionPlanRpc(*stub_, channel, model_id, sequence_ids, num_queries,
                             absl::Seconds(30));
}

absl::Status GpuAttentionClient::DropPlan(const GpuAttentionPlan& plan) {
  return DropAttentionPlanRpc(*stub_, channel_id(), plan.id, absl::Seconds(30));
}

absl::Status GpuAttentionClient::Broken(absl::Status why) {
  if (comm_ != nullptr && !broken_) ncclCommAbort(Comm(comm_));
  broken_ = true;
  return why;
}

absl::Status GpuAttentionClient::Enqueue(const std::function<void()>& issue, absl::Time deadline) {
  ncclGroupStart();
  issue();
  const ncclResult_t r = ncclGroupEnd();
  if (r != ncclSuccess && r != ncclInProgress) return Broken(NcclStatus(r, "NCCL send/recv"));
  while (true) {
    ncclResult_t state = ncclSuccess;
    if (ncclCommGetAsyncError(Comm(comm_), &state) != ncclSuccess) state = ncclInternalError;
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) return Broken(NcclStatus(state, "NCCL (the daemon failed)"));
    // A group that connects a new path waits for the daemon's side: if the daemon ended the
    // channel meanwhile, say so now rather than at the deadline.
    absl::Status why;
    if (LeaseEnded(&why)) {
      return Broken(absl::UnavailableError(absl::StrCat("the daemon ended the attention channel: ",
                                                        why.ok() ? "closed" : why.ToString())));
    }
    if (absl::Now() > deadline) return Broken(absl::DeadlineExceededError("NCCL enqueue"));
  }
}

absl::Status GpuAttentionClient::Wait(void* event, absl::Time deadline) {
  const absl::Time start = absl::Now();
  while (true) {
    const cudaError_t e = cudaEventQuery(Event(event));
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady) return Broken(CudaStatus(e, "waiting for the answer"));
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(Comm(comm_), &state);
    if (state != ncclSuccess && state != ncclInProgress) {
      return Broken(NcclStatus(state, "NCCL (the daemon failed or left)"));
    }
    absl::Status why;
    if (LeaseEnded(&why)) {
      return Broken(absl::UnavailableError(absl::StrCat("the daemon ended the attention channel: ",
                                                        why.ok() ? "closed" : why.ToString())));
    }
    const absl::Time now = absl::Now();
    if (now > deadline) {
      return Broken(absl::DeadlineExceededError("no answer from the daemon in time"));
    }
    if (now - start > kSpin) absl::SleepFor(absl::Microseconds(50));
  }
}

absl::StatusOr<std::vector<uint32_t>> GpuAttentionClient::Attend(const GpuAttentionPlan& plan,
                                                                 int layer, const float* queries,
                                                                 float* out, float* lse,
                                                                 CUstream_st* stream) {
  absl::MutexLock lock(&mu_);
  if (comm_ == nullptr) return absl::FailedPreconditionError("no open channel (Open)");
  if (broken_) return absl::FailedPreconditionError("the channel broke; Open again");
  if (plan.id == 0 || plan.query_bytes == 0 || plan.lse_bytes == 0) {
    return absl::InvalidArgumentError("not a plan of SetPlan");
  }
  if (queries == nullptr || out == nullptr || lse == nullptr) {
    return absl::InvalidArgumentError("queries, out and lse must be device buffers");
  }
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  const absl::Time deadline = absl::Now() + call_timeout_;
  const uint64_t call = next_call_;
  CallHeader h;
  h.plan_id = plan.id;
  h.layer = layer;
  h.call = call;
  h.query_bytes = plan.query_bytes;
  h.lse_bytes = plan.lse_bytes;
  const std::array<uint8_t, kCallHeaderBytes> header = server::EncodeCallHeader(h);
  std::memcpy(h_header_, header.data(), header.size());
  cudaStream_t s = Stream(stream_);
  if (stream != nullptr) {  // after the queries' producer
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(Event(ready_), stream), "event"));
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(s, Event(ready_), 0), "wait event"));
  }
  KVPOOL_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(d_header_, h_header_, kCallHeaderBytes, cudaMemcpyHostToDevice, s),
                 "H2D call header"));
  static const bool trace = [] {
    const char* v = std::getenv("KVPOOL_TRACE_ATTENTION_CHANNEL");
    return v != nullptr && v[0] == '1';
  }();
  // Microseconds from the call's start to each step (trace only), printed once answered.
  const absl::Time started = absl::Now();
  double steps_us[4] = {0, 0, 0, 0};
  auto step = [&](int i) {
    if (trace) steps_us[i] = absl::ToDoubleMicroseconds(absl::Now() - started);
  };
  // Three groups, not one. NCCL runs a group's operations with one peer as pairs (the n-th send
  // with the n-th receive) and starts a pair only after the previous one finished, so a single
  // group's first pair (send header, receive status) waited for a status that the daemon sends
  // only after the queries of the second pair: a deadlock. A group also connects every path it
  // uses before it sends anything, and the daemon connects the queries' path only once the
  // header arrived: the header goes alone, then the queries, then the answer is received.
  KVPOOL_RETURN_IF_ERROR(
      Enqueue([&] { ncclSend(d_header_, kCallHeaderBytes, ncclUint8, /*peer=*/1, Comm(comm_), s); },
              deadline));
  ++next_call_;  // the header is on its way: the daemon counts it
  step(0);
  KVPOOL_RETURN_IF_ERROR(
      Enqueue([&] { ncclSend(queries, plan.query_bytes, ncclUint8, /*peer=*/1, Comm(comm_), s); },
              deadline));
  step(1);
  KVPOOL_RETURN_IF_ERROR(Enqueue(
      [&] {
        ncclRecv(d_status_, kCallStatusBytes, ncclUint8, /*peer=*/1, Comm(comm_), s);
        ncclRecv(out, plan.query_bytes, ncclUint8, 1, Comm(comm_), s);
        ncclRecv(lse, plan.lse_bytes, ncclUint8, 1, Comm(comm_), s);
      },
      deadline));
  step(2);
  absl::Status st =
      CudaStatus(cudaMemcpyAsync(h_status_, d_status_, kCallStatusBytes, cudaMemcpyDeviceToHost, s),
                 "D2H status");
  if (st.ok()) st = CudaStatus(cudaEventRecord(Event(done_), s), "event");
  if (!st.ok()) return Broken(st);
  KVPOOL_RETURN_IF_ERROR(Wait(done_, deadline));
  step(3);
  if (trace) {
    std::fprintf(stderr,
                 "attention client: call %llu: us after the start: header enqueued %.1f, "
                 "queries enqueued %.1f, answer receives enqueued %.1f, answered %.1f\n",
                 static_cast<unsigned long long>(call), steps_us[0], steps_us[1], steps_us[2],
                 steps_us[3]);
  }
  absl::StatusOr<CallStatus> status =
      server::DecodeCallStatus(absl::MakeConstSpan(h_status_, kCallStatusBytes));
  if (!status.ok()) return Broken(absl::InternalError(status.status().ToString()));
  if (status->call != call) {
    return Broken(absl::InternalError(
        absl::StrCat("answer for call ", status->call, " while waiting for call ", call)));
  }
  KVPOOL_RETURN_IF_ERROR(status->status);
  if (status->attended_tokens.size() != static_cast<size_t>(plan.batch)) {
    return absl::InternalError(absl::StrCat("the daemon answered ", status->attended_tokens.size(),
                                            " sequences for a plan of ", plan.batch));
  }
  return std::move(status->attended_tokens);
}

absl::Status GpuAttentionClient::SendUnparseableHeaderForTesting(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  if (comm_ == nullptr || broken_) return absl::FailedPreconditionError("no open channel");
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  CallHeader h;
  h.plan_id = 1;
  h.call = next_call_;
  h.query_bytes = 4;
  h.lse_bytes = 4;
  std::array<uint8_t, kCallHeaderBytes> header = server::EncodeCallHeader(h);
  header[0] ^= 0xFF;  // bad magic
  std::memcpy(h_header_, header.data(), header.size());
  cudaStream_t s = Stream(stream_);
  KVPOOL_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(d_header_, h_header_, kCallHeaderBytes, cudaMemcpyHostToDevice, s),
                 "H2D call header"));
  KVPOOL_RETURN_IF_ERROR(
      Enqueue([&] { ncclSend(d_header_, kCallHeaderBytes, ncclUint8, /*peer=*/1, Comm(comm_), s); },
              absl::Now() + timeout));
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status why;
  while (!LeaseEnded(&why)) {
    if (absl::Now() > deadline) {
      return Broken(absl::DeadlineExceededError("the daemon kept the channel open"));
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  (void)Broken(absl::OkStatus());
  return why;
}

absl::Status GpuAttentionClient::SendHeaderOnlyForTesting(const GpuAttentionPlan& plan) {
  absl::MutexLock lock(&mu_);
  if (comm_ == nullptr || broken_) return absl::FailedPreconditionError("no open channel");
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  CallHeader h;
  h.plan_id = plan.id;
  h.call = next_call_++;
  h.query_bytes = plan.query_bytes;
  h.lse_bytes = plan.lse_bytes;
  const std::array<uint8_t, kCallHeaderBytes> header = server::EncodeCallHeader(h);
  std::memcpy(h_header_, header.data(), header.size());
  cudaStream_t s = Stream(stream_);
  KVPOOL_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(d_header_, h_header_, kCallHeaderBytes, cudaMemcpyHostToDevice, s),
                 "H2D call header"));
  return Enqueue(
      [&] { ncclSend(d_header_, kCallHeaderBytes, ncclUint8, /*peer=*/1, Comm(comm_), s); },
      absl::Now() + call_timeout_);
}

absl::Status GpuAttentionClient::Close() {
  absl::MutexLock lock(&mu_);
  return CloseLocked();
}

absl::Status GpuAttentionClient::CloseLocked() {
  if (comm_ == nullptr) return absl::OkStatus();
  absl::Status closed;
  if (!LeaseEnded(nullptr)) {
    v1::CloseSessionRequest req;
    req.set_session_id(channel_id_);
    v1::CloseSessionResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineIn(absl::Seconds(30)));
    closed = FromGrpcStatus(stub_->CloseSession(&ctx, req, &resp), "CloseSession");
    if (absl::IsNotFound(closed)) closed = absl::OkStatus();  // the daemon ended it already
  }
  if (!broken_) ncclCommAbort(Comm(comm_));  // the daemon aborted its end
  comm_ = nullptr;
  broken_ = false;
  channel_id_ = 0;
  if (!closed.ok()) lease_context_->TryCancel();  // unblock the lease's reader
  if (lease_thread_.joinable()) lease_thread_.join();
  lease_.reset();
  lease_context_.reset();
  return closed;
}

}  // namespace kvpool::client
