// The GPU data plane on a two-GPU host (issue "GPU data plane"): a real kvpoold --device=cuda:1,
// this process as the prefill worker on GPU 0. Run by tests/gpu/transport_run.sh on the lent
// nvidia-h200-x2 machine; needs two GPUs (exit status 2 otherwise).
//
//   checks      the same K/V pushed over NCCL, over CUDA IPC and over inline gRPC is stored
//               bit for bit the same (ReadBlocks of the three sequences compared)
//   ingest      GB/s of BF16 K+V accepted into the GPU pool, per message size 1 MiB .. 1 GiB,
//               over NCCL  vs  raw ncclSend/ncclRecv between the same GPUs (in this process),
//               over CUDA IPC  vs  a peer copy (cudaMemcpyPeerAsync) of the same bytes
//   fault       (--fault) a prefill process killed mid-transfer: the daemon frees everything
//               (pool bytes back to the baseline, no open push) and serves the next push
//
// Usage: kvpool-gpu-transport-bench --kvpoold PATH [--out FILE] [--quick] [--fault] [--trace]
//        kvpool-gpu-transport-bench --child-stall TARGET   (internal: the process that dies)
#include <cuda_runtime.h>
#include <nccl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/kvpool_client.h"
#include "client/local_daemon.h"
#include "client/transport/gpu_push.h"
#include "common/status_macros.h"
#include "kernels/cuda/testing_fill.h"
#include "tests/bench/bench_report.h"
#include "tests/bench/bench_timing.h"
#include "tests/gpu/two_gpu_bench.h"

namespace kvpool::bench {
namespace {

namespace v1 = ::kvpool::v1;
using client::GpuLayerRows;
using client::GpuPushClient;
using client::GpuPushSpec;
using client::KvpoolClient;
using Clock = SteadyClock;

constexpr int kQHeads = 64, kKvHeads = 8, kHeadDim = 128;
constexpr size_t kRowBytes = size_t{kKvHeads} * kHeadDim * 2;
constexpr int kPrefillGpu = 0, kDaemonGpu = 1;

struct Options {
  std::string kvpoold;
  std::string out = "bench-results/gpu-transport.json";
  bool quick = false;
  bool fault = false;
  bool trace = false;  // kvpoold logs each push's per-chunk timeline (KVPOOL_TRACE_GPU_PUSH)
  std::string child_target;
};

absl::Status Cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

absl::StatusOr<std::unique_ptr<client::LocalDaemon>> StartDaemon(const Options& opt) {
  client::LocalDaemonOptions d;
  d.binary = opt.kvpoold;
  d.flags = {absl::StrCat("--device=cuda:", kDaemonGpu), "--pool_bytes=17179869184",
             "--slab_bytes=16777216", "--worker_threads=8", "--log_level=warn"};
  d.startup_timeout = absl::Seconds(120);
  if (opt.trace) {
    setenv("KVPOOL_TRACE_GPU_PUSH", "1", 1);
    d.flags.back() = "--log_level=info";
    d.inherit_output = true;
  }
  return client::LocalDaemon::Start(d);
}

// Pushes of the layer-wise rows carry this many layers, one message per layer.
constexpr int kLayerwiseLayers = 8;

absl::Status RegisterModel(const KvpoolClient& c, const std::string& id = "gpu", int layers = 1) {
  v1::ModelSpec spec;
  spec.set_model_id(id);
  spec.mutable_shape()->set_num_layers(layers);
  spec.mutable_shape()->set_q_heads(kQHeads);
  spec.mutable_shape()->set_kv_heads(kKvHeads);
  spec.mutable_shape()->set_head_dim(kHeadDim);
  spec.mutable_data_free()->set_kind(v1::ROTATION_KIND_RANDOMIZED_HADAMARD);
  spec.mutable_data_free()->set_seed(77);
  return c.RegisterModel(spec).status();
}

// In-process raw baselines between GPU 0 and GPU 1, seconds per transfer of `bytes`.
class RawBaselines {
 public:
  static absl::StatusOr<std::unique_ptr<RawBaselines>> Create(size_t max_bytes) {
    auto r = std::unique_ptr<RawBaselines>(new RawBaselines());
    const int devs[2] = {kPrefillGpu, kDaemonGpu};
    KVPOOL_RETURN_IF_ERROR(ncclCommInitAll(r->comms_, 2, devs) == ncclSuccess
                               ? absl::OkStatus()
                               : absl::UnavailableError("ncclCommInitAll"));
    for (int i = 0; i < 2; ++i) {
      KVPOOL_RETURN_IF_ERROR(Cuda(cudaSetDevice(devs[i]), "cudaSetDevice"));
      KVPOOL_RETURN_IF_ERROR(Cuda(cudaMalloc(&r->buf_[i], max_bytes), "cudaMalloc"));
      KVPOOL_RETURN_IF_ERROR(Cuda(cudaStreamCreate(&r->stream_[i]), "stream"));
    }
    return r;
  }
  ~RawBaselines() {
    for (int i = 0; i < 2; ++i) {
      ncclCommDestroy(comms_[i]);
      cudaFree(buf_[i]);
    }
  }
  absl::StatusOr<double> Nccl(size_t bytes, int reps) {
    std::vector<double> t;
    for (int r = 0; r < reps + 1; ++r) {
      const auto t0 = Clock::now();
      ncclGroupStart();
      ncclSend(buf_[0], bytes, ncclUint8, 1, comms_[0], stream_[0]);
      ncclRecv(buf_[1], bytes, ncclUint8, 0, comms_[1], stream_[1]);
      if (ncclGroupEnd() != ncclSuccess) return absl::UnavailableError("raw NCCL send/recv");
      for (int i = 0; i < 2; ++i)
        KVPOOL_RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(stream_[i]), "sync"));
      if (r > 0) t.push_back(SecondsSince(t0));  // the first one warms up
    }
    return Median(t);
  }
  absl::StatusOr<double> PeerCopy(size_t bytes, int reps) {
    std::vector<double> t;
    KVPOOL_RETURN_IF_ERROR(Cuda(cudaSetDevice(kDaemonGpu), "cudaSetDevice"));
    for (int r = 0; r < reps + 1; ++r) {
      const auto t0 = Clock::now();
      KVPOOL_RETURN_IF_ERROR(
          Cuda(cudaMemcpyPeerAsync(buf_[1], kDaemonGpu, buf_[0], kPrefillGpu, bytes, stream_[1]),
               "peer copy"));
      KVPOOL_RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(stream_[1]), "sync"));
      if (r > 0) t.push_back(SecondsSince(t0));
    }
    return Median(t);
  }

 private:
  RawBaselines() = default;
  ncclComm_t comms_[2] = {nullptr, nullptr};
  void* buf_[2] = {nullptr, nullptr};
  cudaStream_t stream_[2] = {nullptr, nullptr};
};

// The pool bytes the daemon holds and its open pushes (from GetStats).
absl::StatusOr<std::pair<uint64_t, uint32_t>> PoolUse(const KvpoolClient& c) {
  KVPOOL_ASSIGN_OR_RETURN(v1::GetStatsResponse s, c.GetStats());
  return std::make_pair(s.pool().used_bytes(), s.transport().open_pushes());
}

absl::Status Fault(const Options& opt, const std::string& self) {
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<client::LocalDaemon> daemon, StartDaemon(opt));
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<KvpoolClient> c, KvpoolClient::Connect(daemon->target()));
  KVPOOL_RETURN_IF_ERROR(RegisterModel(*c));
  KVPOOL_ASSIGN_OR_RETURN(auto base, PoolUse(*c));
  const pid_t child = fork();
  if (child == 0) {
    execl(self.c_str(), self.c_str(), "--child-stall", daemon->target().c_str(), nullptr);
    _exit(127);
  }
  // Wait until the child's push holds pool pages (its header reserved them), then kill it.
  const absl::Time until = absl::Now() + absl::Seconds(60);
  bool holding = false;
  while (absl::Now() < until && !holding) {
    KVPOOL_ASSIGN_OR_RETURN(auto use, PoolUse(*c));
    holding = use.first > base.first;
    absl::SleepFor(absl::Milliseconds(100));
  }
  absl::SleepFor(absl::Milliseconds(500));
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  if (!holding) return absl::InternalError("the child's push never reserved pool pages");
  std::cout << "fault: child killed mid-transfer while its push held pool pages\n";
  const auto t0 = Clock::now();
  std::pair<uint64_t, uint32_t> use;
  do {
    absl::SleepFor(absl::Milliseconds(100));
    KVPOOL_ASSIGN_OR_RETURN(use, PoolUse(*c));
  } while (use.first != base.first && SecondsSince(t0) < 30);
  if (use.first != base.first) {
    return absl::InternalError(absl::StrCat("pool bytes ", use.first, " != baseline ", base.first,
                                            " 30 s after the kill"));
  }
  std::cout << "fault: pool back to " << use.first << " bytes after " << SecondsSince(t0)
            << " s; open pushes " << use.second << "\n";
  // The daemon keeps serving: a fresh channel and push of the same sequence succeed.
  KVPOOL_ASSIGN_OR_RETURN(
      auto gpu,
      GpuPushClient::Create(
          grpc::CreateChannel(daemon->target(), grpc::InsecureChannelCredentials()), kPrefillGpu));
  KVPOOL_RETURN_IF_ERROR(gpu->OpenNccl(absl::Seconds(60)));
  const uint32_t n = 4096;
  void *k = nullptr, *v = nullptr;
  KVPOOL_RETURN_IF_ERROR(Cuda(cudaMalloc(&k, n * kRowBytes), "cudaMalloc"));
  KVPOOL_RETURN_IF_ERROR(Cuda(cudaMalloc(&v, n * kRowBytes), "cudaMalloc"));
  KVPOOL_RETURN_IF_ERROR(cuda::testing::FillRealLikeBf16(
      static_cast<uint16_t*>(k), n * kRowBytes / 2, kHeadDim, 1, 1.0f, nullptr));
  KVPOOL_RETURN_IF_ERROR(cuda::testing::FillRealLikeBf16(
      static_cast<uint16_t*>(v), n * kRowBytes / 2, kHeadDim, 2, 1.0f, nullptr));
  KVPOOL_RETURN_IF_ERROR(Cuda(cudaDeviceSynchronize(), "fill"));
  const GpuLayerRows rows{k, v};
  KVPOOL_ASSIGN_OR_RETURN(v1::AppendKvResponse r,
                          gpu->PushNccl({"victim", 0, n, true, kRowBytes, 1024}, {&rows, 1}));
  std::cout << "fault: the next push of the same sequence committed " << r.sequence().total_tokens()
            << " tokens\n";
  KVPOOL_RETURN_IF_ERROR(gpu->CloseNccl());
  return daemon->Stop();
}

// The process the fault test kills: opens a channel, starts a push, never sends the bytes.
absl::Status ChildStall(const std::string& target) {
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<KvpoolClient> c, KvpoolClient::Connect(target));
  KVPOOL_RETURN_IF_ERROR(c->CreateSequence("gpu", "victim").status());
  KVPOOL_ASSIGN_OR_RETURN(
      auto gpu, GpuPushClient::Create(
                    grpc::CreateChannel(target, grpc::InsecureChannelCredentials()), kPrefillGpu));
  KVPOOL_RETURN_IF_ERROR(gpu->OpenNccl(absl::Seconds(60)));
  KVPOOL_RETURN_IF_ERROR(gpu->StartNcclPushAndStall({"victim", 0, 65536, true, kRowBytes, 8192}));
  while (true) absl::SleepFor(absl::Seconds(1));
}

absl::Status Run(const Options& opt) {
  const std::vector<size_t> sizes =
      opt.quick ? std::vector<size_t>{size_t{1} << 20, size_t{16} << 20, size_t{256} << 20}
                : std::vector<size_t>{size_t{1} << 20,  size_t{4} << 20,   size_t{16} << 20,
                                      size_t{64} << 20, size_t{256} << 20, size_t{1} << 30};
  const size_t max_bytes = sizes.back();
  const int reps = opt.quick ? 3 : 5;

  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<client::LocalDaemon> daemon, StartDaemon(opt));
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<KvpoolClient> c, KvpoolClient::Connect(daemon->target()));
  KVPOOL_RETURN_IF_ERROR(RegisterModel(*c));
  KVPOOL_RETURN_IF_ERROR(RegisterModel(*c, "gpu-layers", kLayerwiseLayers));

  // K and V of the largest message on the prefill GPU, real-like values.
  KVPOOL_RETURN_IF_ERROR(Cuda(cudaSetDevice(kPrefillGpu), "cudaSetDevice"));
  void *k = nullptr, *v = nullptr;
  KVPOOL_RETURN_IF_ERROR(Cuda(cudaMalloc(&k, max_bytes), "cudaMalloc K"));
  KVPOOL_RETURN_IF_ERROR(Cuda(cudaMalloc(&v, max_bytes), "cudaMalloc V"));
  KVPOOL_RETURN_IF_ERROR(cuda::testing::FillRealLikeBf16(static_cast<uint16_t*>(k), max_bytes / 2,
                                                         kHeadDim, 11, 1.0f, nullptr));
  KVPOOL_RETURN_IF_ERROR(cuda::testing::FillRealLikeBf16(static_cast<uint16_t*>(v), max_bytes / 2,
                                                         kHeadDim, 12, 1.0f, nullptr));
  KVPOOL_RETURN_IF_ERROR(Cuda(cudaDeviceSynchronize(), "fill"));
  const GpuLayerRows rows{k, v};

  auto grpc_channel = grpc::CreateChannel(daemon->target(), grpc::InsecureChannelCredentials());
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<GpuPushClient> gpu,
                          GpuPushClient::Create(grpc_channel, kPrefillGpu));
  KVPOOL_RETURN_IF_ERROR(gpu->OpenNccl(absl::Seconds(60)));
  KVPOOL_RETURN_IF_ERROR(gpu->RegisterBuffer(k, max_bytes));
  KVPOOL_RETURN_IF_ERROR(gpu->RegisterBuffer(v, max_bytes));

  // --- checks: NCCL, IPC and inline gRPC store the same bytes ---
  {
    const uint32_t n = 5000;  // not a multiple of the block size
    std::vector<uint16_t> hk(n * kRowBytes / 2), hv(n * kRowBytes / 2);
    KVPOOL_RETURN_IF_ERROR(
        Cuda(cudaMemcpy(hk.data(), k, n * kRowBytes, cudaMemcpyDeviceToHost), "D2H"));
    KVPOOL_RETURN_IF_ERROR(
        Cuda(cudaMemcpy(hv.data(), v, n * kRowBytes, cudaMemcpyDeviceToHost), "D2H"));
    for (const char* id : {"check-nccl", "check-ipc", "check-grpc"}) {
      KVPOOL_RETURN_IF_ERROR(c->CreateSequence("gpu", id).status());
    }
    KVPOOL_RETURN_IF_ERROR(
        gpu->PushNccl({"check-nccl", 0, n, true, kRowBytes, 1024}, {&rows, 1}).status());
    KVPOOL_RETURN_IF_ERROR(
        gpu->PushIpc({"check-ipc", 0, n, true, kRowBytes, 1024}, {&rows, 1}).status());
    v1::AppendKvHeader h;
    h.set_sequence_id("check-grpc");
    h.set_num_tokens(n);
    h.set_dtype(v1::DTYPE_BF16);
    h.set_end_of_prefill(true);
    KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<client::AppendStream> s, c->OpenAppend(h));
    KVPOOL_RETURN_IF_ERROR(s->WriteLayer(
        0, 0, n, absl::string_view(reinterpret_cast<const char*>(hk.data()), n * kRowBytes),
        absl::string_view(reinterpret_cast<const char*>(hv.data()), n * kRowBytes)));
    KVPOOL_RETURN_IF_ERROR(s->Finish().status());
    std::vector<client::BlocksRead> reads;
    for (const char* id : {"check-nccl", "check-ipc", "check-grpc"}) {
      v1::ReadBlocksRequest rq;
      rq.set_sequence_id(id);
      KVPOOL_ASSIGN_OR_RETURN(client::BlocksRead r, c->ReadBlocks(rq));
      reads.push_back(std::move(r));
    }
    for (int t = 0; t < 2; ++t) {
      const client::LayerBlocks& a = reads[t].layers.at(0);
      const client::LayerBlocks& b = reads[2].layers.at(0);
      bool same = a.blocks.size() == b.blocks.size() && a.sink_k == b.sink_k &&
                  a.sink_v == b.sink_v && a.recent_k == b.recent_k && a.recent_v == b.recent_v;
      for (size_t i = 0; same && i < a.blocks.size(); ++i)
        same = a.blocks[i].data() == b.blocks[i].data();
      if (!same) {
        return absl::InternalError(absl::StrCat(t == 0 ? "NCCL" : "CUDA IPC",
                                                " push stored different bytes than inline gRPC"));
      }
    }
    std::cout << "check: NCCL, CUDA IPC and inline gRPC pushes of " << n
              << " tokens stored identical blocks (" << reads[2].layers[0].blocks.size()
              << " INT2 blocks + BF16 sink/recent)\n";
    for (const char* id : {"check-nccl", "check-ipc", "check-grpc"}) {
      KVPOOL_RETURN_IF_ERROR(c->ReleaseSequence(id).status());
    }
  }

  // --- throughput ---
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<RawBaselines> raw, RawBaselines::Create(2 * max_bytes));
  BenchReport report("gpu-transport");
  int seq = 0;
  for (size_t bytes : sizes) {
    const uint32_t n = static_cast<uint32_t>(bytes / kRowBytes);
    // The push moves K and V (2 x bytes); the raw figures move the same 2 x bytes.
    KVPOOL_ASSIGN_OR_RETURN(double raw_nccl, raw->Nccl(2 * bytes, reps));
    KVPOOL_ASSIGN_OR_RETURN(double raw_peer, raw->PeerCopy(2 * bytes, reps));
    // Four chunks per message (receive/copy of one overlaps quantization of the previous),
    // 8 to 64 MiB per tensor.
    const uint32_t chunk = std::min(n, std::clamp<uint32_t>(n / 4, 4096, 32768));
    for (bool nccl : {true, false}) {
      std::vector<double> t;
      KVPOOL_ASSIGN_OR_RETURN(v1::GetStatsResponse before, c->GetStats());
      for (int r = 0; r < reps; ++r) {
        const std::string id = absl::StrCat("s", seq++);
        KVPOOL_RETURN_IF_ERROR(c->CreateSequence("gpu", id).status());
        const GpuPushSpec spec{id, 0, n, true, kRowBytes, chunk};
        const auto t0 = Clock::now();
        absl::StatusOr<v1::AppendKvResponse> resp =
            nccl ? gpu->PushNccl(spec, {&rows, 1}) : gpu->PushIpc(spec, {&rows, 1});
        t.push_back(SecondsSince(t0));
        KVPOOL_RETURN_IF_ERROR(resp.status());
        KVPOOL_RETURN_IF_ERROR(c->ReleaseSequence(id).status());
      }
      KVPOOL_ASSIGN_OR_RETURN(v1::GetStatsResponse after, c->GetStats());
      const double kernel_s =
          (after.service().arrival_device_seconds() - before.service().arrival_device_seconds()) /
          reps;
      const double gbs = 2.0 * bytes / Median(t) / 1e9;
      const double base = 2.0 * bytes / (nccl ? raw_nccl : raw_peer) / 1e9;
      report.Add({nccl ? "ingest_nccl" : "ingest_cuda_ipc",
                  {{"message_bytes", std::to_string(bytes)},
                   {"chunk_tokens", std::to_string(chunk)},
                   {"from", "cuda:0"},
                   {"pool", "cuda:1"}},
                  gbs,
                  "GB/s",
                  {nccl ? "raw_nccl_send_recv" : "peer_copy", base}});
      report.Add({nccl ? "arrival_kernels_during_nccl" : "arrival_kernels_during_ipc",
                  {{"message_bytes", std::to_string(bytes)}},
                  kernel_s > 0 ? 2.0 * bytes / kernel_s / 1e9 : 0.0,
                  "GB/s",
                  {"ingest", gbs}});
      std::cerr << (nccl ? "NCCL" : "IPC ") << " " << (bytes >> 20) << " MiB: " << gbs
                << " GB/s vs raw " << base << " GB/s (arrival kernels alone "
                << (kernel_s > 0 ? 2.0 * bytes / kernel_s / 1e9 : 0.0) << " GB/s)\n";
    }
    // Layer-wise: one push of kLayerwiseLayers layers, one message (K and V of `bytes` each) per
    // layer, as a prefill worker streams them; the push's fixed costs (RPC, begin, commit) are
    // shared by its messages, and messages of different layers are staged concurrently.
    if (bytes > (size_t{256} << 20)) continue;
    for (bool nccl : {true, false}) {
      const std::vector<GpuLayerRows> layers(kLayerwiseLayers, rows);
      std::vector<double> t;
      for (int r = 0; r < reps; ++r) {
        const std::string id = absl::StrCat("s", seq++);
        KVPOOL_RETURN_IF_ERROR(c->CreateSequence("gpu-layers", id).status());
        const GpuPushSpec spec{id, 0, n, true, kRowBytes, n};
        const auto t0 = Clock::now();
        absl::StatusOr<v1::AppendKvResponse> resp =
            nccl ? gpu->PushNccl(spec, layers) : gpu->PushIpc(spec, layers);
        t.push_back(SecondsSince(t0));
        KVPOOL_RETURN_IF_ERROR(resp.status());
        KVPOOL_RETURN_IF_ERROR(c->ReleaseSequence(id).status());
      }
      const double gbs = 2.0 * bytes * kLayerwiseLayers / Median(t) / 1e9;
      const double base = 2.0 * bytes / (nccl ? raw_nccl : raw_peer) / 1e9;
      report.Add({nccl ? "ingest_nccl_layerwise" : "ingest_cuda_ipc_layerwise",
                  {{"message_bytes", std::to_string(bytes)},
                   {"messages_per_push", std::to_string(kLayerwiseLayers)},
                   {"from", "cuda:0"},
                   {"pool", "cuda:1"}},
                  gbs,
                  "GB/s",
                  {nccl ? "raw_nccl_send_recv" : "peer_copy", base}});
      std::cerr << (nccl ? "NCCL" : "IPC ") << " layer-wise " << kLayerwiseLayers << " x "
                << (bytes >> 20) << " MiB: " << gbs << " GB/s vs raw " << base << " GB/s\n";
    }
  }
  KVPOOL_RETURN_IF_ERROR(gpu->CloseNccl());
  KVPOOL_RETURN_IF_ERROR(daemon->Stop());
  return report.Publish(opt.out);
}

}  // namespace
}  // namespace kvpool::bench

int main(int argc, char** argv) {
  kvpool::bench::Options opt;
  if (!kvpool::bench::ParseBenchArgs(
          argc, argv,
          {{"--kvpoold", &opt.kvpoold}, {"--out", &opt.out}, {"--child-stall", &opt.child_target}},
          {{"--quick", &opt.quick}, {"--fault", &opt.fault}, {"--trace", &opt.trace}},
          "--kvpoold PATH [--out FILE] [--quick] [--fault] [--trace]")) {
    return 2;
  }
  kvpool::bench::DisableNvlinkMulticastHere();
  if (!opt.child_target.empty()) {
    const absl::Status s = kvpool::bench::ChildStall(opt.child_target);
    std::cerr << "child: " << s << "\n";
    return 1;
  }
  if (!kvpool::bench::TwoGpuBenchCanRun(opt.kvpoold)) return 2;
  const absl::Status s = opt.fault ? kvpool::bench::Fault(opt, argv[0]) : kvpool::bench::Run(opt);
  return kvpool::bench::ExitCode(s);
}
