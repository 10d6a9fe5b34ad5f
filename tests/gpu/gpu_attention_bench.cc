// Remote attention between GPUs (issue "GPU data plane", item 3) on a two-GPU host: a real
// kvpoold --device=cuda:1 holds the KV; this process is the decode worker on GPU 0, with its
// queries and outputs in GPU 0's memory. Run by tests/gpu/run.sh transport on the lent
// nvidia-h200-x2 machine; needs two GPUs (exit status 2 otherwise).
//
//   checks   the same queries through the NCCL attention channel (GpuAttentionClient) and
//            through the gRPC remote attention API (KvpoolClient::Attend) give the same out,
//            LSE and attended tokens (same kernel: expected bit for bit, 1e-5 relative
//            allowed), also with a producer stream; per-call errors come back as the call's
//            status and leave the channel working (a released sequence: NOT_FOUND, a layer out
//            of range: INVALID_ARGUMENT, a dropped plan: NOT_FOUND); an unparseable call header
//            aborts the channel with INVALID_ARGUMENT and a new channel serves the same answer
//   rows     p50 round trip of one remote attention call over NCCL (device buffers, GPU 0 to
//            GPU 1 and back) and over gRPC (host buffers, loopback) beside the attention kernel
//            alone (the daemon's attention_device_seconds per call), batch 1/8/32 at context
//            8K/32K (64 query heads, 8 KV heads, D 128); target: the NCCL transport adds no
//            more than the kernel time (transport_overhead_nccl ratio <= 1)
//
//   fault    (--fault) a decode worker killed mid-call (its header sent, its queries never),
//            three times: the daemon aborts and frees each channel (GPU 1's free memory after
//            the third kill within 32 MiB of that after the first) and serves a new channel
//
// Usage: kvpool-gpu-attention-bench --kvpoold PATH [--out FILE] [--quick] [--fault]
//        kvpool-gpu-attention-bench --child-attend TARGET --child-fd N  (internal: the worker
//        that dies)
#include <cuda_runtime.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/kvpool_client.h"
#include "client/local_daemon.h"
#include "client/transport/gpu_attention.h"
#include "common/status_macros.h"
#include "tests/bench/bench_report.h"
#include "tests/bench/bench_timing.h"
#include "tests/gpu/two_gpu_bench.h"
#include "tests/support/test_data.h"

namespace kvpool::bench {
namespace {

namespace v1 = ::kvpool::v1;
using client::GpuAttentionClient;
using client::GpuAttentionPlan;
using client::KvpoolClient;
using Clock = SteadyClock;

constexpr int kQHeads = 64, kKvHeads = 8, kHeadDim = 128;
constexpr size_t kRow = size_t{kKvHeads} * kHeadDim;
constexpr size_t kQueryRow = size_t{kQHeads} * kHeadDim;
constexpr int kDecodeGpu = 0, kDaemonGpu = 1;
constexpr char kModel[] = "attn";

struct Options {
  std::string kvpoold;
  std::string out = "bench-results/gpu-attention.json";
  bool quick = false;
  bool fault = false;
  std::string child_target;  // --child-attend
  std::string child_fd;      // --child-fd: where the child reports that its header is out
};

absl::Status Cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

absl::Status Expect(bool ok, const std::string& what) {
  return ok ? absl::OkStatus() : absl::InternalError(absl::StrCat("check failed: ", what));
}

// A whole prefill of `tokens` tokens (one layer), end_of_prefill set.
absl::Status Prefill(const KvpoolClient& c, const std::string& id, const std::vector<Bf16>& k,
                     const std::vector<Bf16>& v, int tokens) {
  KVPOOL_RETURN_IF_ERROR(c.CreateSequence(kModel, id).status());
  v1::AppendKvHeader header;
  header.set_sequence_id(id);
  header.set_num_tokens(tokens);
  header.set_dtype(v1::DTYPE_BF16);
  header.set_end_of_prefill(true);
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<client::AppendStream> stream, c.OpenAppend(header));
  const size_t bytes = static_cast<size_t>(tokens) * kRow * sizeof(Bf16);
  KVPOOL_RETURN_IF_ERROR(stream->WriteLayer(
      0, 0, tokens, absl::string_view(reinterpret_cast<const char*>(k.data()), bytes),
      absl::string_view(reinterpret_cast<const char*>(v.data()), bytes)));
  return stream->Finish().status();
}

// The gRPC request for `ids` with `num_queries` rows each from `q` ([ids][num_queries][Hq][D]).
v1::AttendRequest GrpcRequest(const std::vector<std::string>& ids, int num_queries,
                              const std::vector<float>& q) {
  v1::AttendRequest r;
  r.set_model_id(kModel);
  r.set_layer(0);
  r.set_dtype(v1::DTYPE_FP32);
  const size_t per_seq = num_queries * kQueryRow;
  for (size_t i = 0; i < ids.size(); ++i) {
    v1::SequenceQuery* sq = r.add_queries();
    sq->set_sequence_id(ids[i]);
    sq->set_num_queries(static_cast<uint32_t>(num_queries));
    sq->set_q(reinterpret_cast<const char*>(q.data() + i * per_seq), per_seq * sizeof(float));
  }
  return r;
}

// Device buffers of the decode worker on GPU 0, for up to `rows` query rows.
struct DecodeBuffers {
  float* q = nullptr;
  float* out = nullptr;
  float* lse = nullptr;
  static absl::StatusOr<DecodeBuffers> Create(size_t rows) {
    DecodeBuffers b;
    KVPOOL_RETURN_IF_ERROR(Cuda(cudaMalloc(&b.q, rows * kQueryRow * 4), "cudaMalloc q"));
    KVPOOL_RETURN_IF_ERROR(Cuda(cudaMalloc(&b.out, rows * kQueryRow * 4), "cudaMalloc out"));
    KVPOOL_RETURN_IF_ERROR(Cuda(cudaMalloc(&b.lse, rows * kQHeads * 4), "cudaMalloc lse"));
    return b;
  }
};

struct HostAnswer {
  std::vector<float> out, lse;
};

absl::StatusOr<HostAnswer> Download(const DecodeBuffers& b, const GpuAttentionPlan& plan) {
  HostAnswer a;
  a.out.resize(plan.query_bytes / 4);
  a.lse.resize(plan.lse_bytes / 4);
  KVPOOL_RETURN_IF_ERROR(
      Cuda(cudaMemcpy(a.out.data(), b.out, plan.query_bytes, cudaMemcpyDeviceToHost), "D2H out"));
  KVPOOL_RETURN_IF_ERROR(
      Cuda(cudaMemcpy(a.lse.data(), b.lse, plan.lse_bytes, cudaMemcpyDeviceToHost), "D2H lse"));
  return a;
}

// Largest |a - b| / max(1, |b|) over both arrays, and whether every value is identical.
struct Agreement {
  double worst = 0;
  bool identical = true;
};

Agreement Compare(const HostAnswer& nccl, const v1::AttendResponse& grpc, int num_queries) {
  Agreement a;
  auto one = [&](float x, float y) {
    if (x != y) a.identical = false;
    if (std::isinf(y) && x == y) return;
    a.worst = std::max(a.worst, std::fabs(double{x} - y) / std::max(1.0, std::fabs(double{y})));
  };
  const size_t per_seq = num_queries * kQueryRow;
  for (int i = 0; i < grpc.results_size(); ++i) {
    const std::string& bytes = grpc.results(i).out();
    std::vector<float> out(bytes.size() / 4);
    std::memcpy(out.data(), bytes.data(), bytes.size());
    for (size_t j = 0; j < out.size(); ++j) one(nccl.out[i * per_seq + j], out[j]);
    for (int j = 0; j < grpc.results(i).lse_size(); ++j) {
      one(nccl.lse[i * num_queries * kQHeads + j], grpc.results(i).lse(j));
    }
  }
  return a;
}

// Two NCCL answers of the same call agree to 1e-5 relative (bit for bit unless the kernel's
// reduction order varies between launches).
bool Same(const HostAnswer& a, const HostAnswer& b) {
  auto close = [](const std::vector<float>& x, const std::vector<float>& y) {
    if (x.size() != y.size()) return false;
    for (size_t i = 0; i < x.size(); ++i) {
      if (x[i] == y[i]) continue;  // also -inf == -inf
      if (std::fabs(double{x[i]} - y[i]) > 1e-5 * std::max(1.0, std::fabs(double{y[i]}))) {
        return false;
      }
    }
    return true;
  };
  return close(a.out, b.out) && close(a.lse, b.lse);
}

absl::Status Checks(const KvpoolClient& c, GpuAttentionClient& attn, const DecodeBuffers& buf,
                    const std::vector<std::string>& ids, int context, const std::vector<Bf16>& k,
                    const std::vector<Bf16>& v, const std::string& target) {
  constexpr int kQueries = 2;  // two query rows per sequence (speculative decoding)
  const int batch = static_cast<int>(ids.size());
  const std::vector<float> q = testing::GaussianValues(batch * kQueries * kQueryRow, 5);
  KVPOOL_RETURN_IF_ERROR(
      Cuda(cudaMemcpy(buf.q, q.data(), q.size() * 4, cudaMemcpyHostToDevice), "H2D q"));
  KVPOOL_ASSIGN_OR_RETURN(GpuAttentionPlan plan, attn.SetPlan(kModel, ids, kQueries));
  KVPOOL_ASSIGN_OR_RETURN(std::vector<uint32_t> tokens,
                          attn.Attend(plan, 0, buf.q, buf.out, buf.lse));
  KVPOOL_ASSIGN_OR_RETURN(HostAnswer first, Download(buf, plan));
  KVPOOL_ASSIGN_OR_RETURN(v1::AttendResponse grpc, c.Attend(GrpcRequest(ids, kQueries, q)));
  KVPOOL_RETURN_IF_ERROR(Expect(grpc.results_size() == batch, "gRPC result count"));
  for (int i = 0; i < batch; ++i) {
    KVPOOL_RETURN_IF_ERROR(Expect(tokens[i] == grpc.results(i).attended_tokens() &&
                                      tokens[i] == static_cast<uint32_t>(context),
                                  "attended tokens over NCCL equal gRPC's and the context"));
  }
  const Agreement a = Compare(first, grpc, kQueries);
  std::cout << "check: NCCL vs gRPC remote attention, batch " << batch << " x " << kQueries
            << " queries, context " << context << ": "
            << (a.identical ? std::string("outputs and LSE identical")
                            : absl::StrCat("max relative difference ", a.worst))
            << ", attended tokens equal\n";
  KVPOOL_RETURN_IF_ERROR(Expect(a.worst <= 1e-5, "NCCL and gRPC outputs agree to 1e-5"));

  // The queries' producer on a stream of the caller, not synchronized before the call.
  {
    cudaStream_t producer = nullptr;
    KVPOOL_RETURN_IF_ERROR(Cuda(cudaStreamCreate(&producer), "stream"));
    KVPOOL_RETURN_IF_ERROR(Cuda(cudaMemsetAsync(buf.q, 0, q.size() * 4, producer), "memset"));
    KVPOOL_RETURN_IF_ERROR(Cuda(
        cudaMemcpyAsync(buf.q, q.data(), q.size() * 4, cudaMemcpyHostToDevice, producer), "H2D"));
    absl::StatusOr<std::vector<uint32_t>> t =
        attn.Attend(plan, 0, buf.q, buf.out, buf.lse, producer);
    cudaStreamDestroy(producer);
    KVPOOL_RETURN_IF_ERROR(t.status());
    KVPOOL_ASSIGN_OR_RETURN(HostAnswer again, Download(buf, plan));
    KVPOOL_RETURN_IF_ERROR(Expect(Compare(again, grpc, kQueries).worst <= 1e-5,
                                  "a call ordered after the caller's stream sees its queries"));
    std::cout << "check: a call after the caller's producer stream gives the same answer\n";
  }

  // Per-call errors: the status comes back, out and LSE are zeros, the channel keeps working.
  const int victim_tokens = 1000;
  KVPOOL_RETURN_IF_ERROR(Prefill(c, "victim", k, v, victim_tokens));
  const std::vector<std::string> with_victim = {ids[0], "victim"};
  KVPOOL_ASSIGN_OR_RETURN(GpuAttentionPlan vplan, attn.SetPlan(kModel, with_victim, 1));
  KVPOOL_ASSIGN_OR_RETURN(tokens, attn.Attend(vplan, 0, buf.q, buf.out, buf.lse));
  KVPOOL_RETURN_IF_ERROR(
      Expect(tokens == std::vector<uint32_t>{static_cast<uint32_t>(context), victim_tokens},
             "attended tokens of a two-sequence plan"));
  KVPOOL_RETURN_IF_ERROR(c.ReleaseSequence("victim").status());
  absl::StatusOr<std::vector<uint32_t>> gone = attn.Attend(vplan, 0, buf.q, buf.out, buf.lse);
  KVPOOL_RETURN_IF_ERROR(Expect(
      absl::IsNotFound(gone.status()),
      absl::StrCat("a released sequence is NOT_FOUND over NCCL, got ", gone.status().ToString())));
  absl::StatusOr<v1::AttendResponse> grpc_gone = c.Attend(GrpcRequest(with_victim, 1, q));
  KVPOOL_RETURN_IF_ERROR(Expect(absl::IsNotFound(grpc_gone.status()),
                                "a released sequence is NOT_FOUND over gRPC too"));
  KVPOOL_ASSIGN_OR_RETURN(HostAnswer zeros, Download(buf, vplan));
  KVPOOL_RETURN_IF_ERROR(
      Expect(std::all_of(zeros.out.begin(), zeros.out.end(), [](float x) { return x == 0; }) &&
                 std::all_of(zeros.lse.begin(), zeros.lse.end(), [](float x) { return x == 0; }),
             "a failed call's out and LSE are zeros"));
  absl::StatusOr<std::vector<uint32_t>> bad_layer = attn.Attend(plan, 1, buf.q, buf.out, buf.lse);
  KVPOOL_RETURN_IF_ERROR(Expect(absl::IsInvalidArgument(bad_layer.status()),
                                "a layer out of range is INVALID_ARGUMENT"));
  KVPOOL_RETURN_IF_ERROR(attn.DropPlan(vplan));
  absl::StatusOr<std::vector<uint32_t>> dropped = attn.Attend(vplan, 0, buf.q, buf.out, buf.lse);
  KVPOOL_RETURN_IF_ERROR(Expect(absl::IsNotFound(dropped.status()), "a dropped plan is NOT_FOUND"));
  KVPOOL_RETURN_IF_ERROR(attn.Attend(plan, 0, buf.q, buf.out, buf.lse).status());
  KVPOOL_ASSIGN_OR_RETURN(HostAnswer after, Download(buf, plan));
  KVPOOL_RETURN_IF_ERROR(
      Expect(Same(after, first), "the channel answers the same after three failed calls"));
  std::cout << "check: released sequence -> " << gone.status().code() << ", layer 1 -> "
            << bad_layer.status().code() << ", dropped plan -> " << dropped.status().code()
            << "; the channel then answers the same as before\n";

  // An unparseable header aborts the channel; the daemon frees it and serves a new one.
  const absl::Status aborted = attn.SendUnparseableHeaderForTesting(absl::Seconds(30));
  KVPOOL_RETURN_IF_ERROR(
      Expect(absl::IsInvalidArgument(aborted) &&
                 aborted.message().find("unparseable call header") != absl::string_view::npos,
             absl::StrCat("an unparseable header aborts the channel, got ", aborted.ToString())));
  KVPOOL_RETURN_IF_ERROR(attn.Close());
  KVPOOL_RETURN_IF_ERROR(attn.Open(absl::Seconds(60)));
  KVPOOL_ASSIGN_OR_RETURN(plan, attn.SetPlan(kModel, ids, kQueries));
  KVPOOL_RETURN_IF_ERROR(attn.Attend(plan, 0, buf.q, buf.out, buf.lse).status());
  KVPOOL_ASSIGN_OR_RETURN(after, Download(buf, plan));
  KVPOOL_RETURN_IF_ERROR(Expect(Same(after, first), "a new channel answers the same"));
  std::cout << "check: an unparseable header aborted the channel (" << aborted
            << "); a new channel on " << target << " answers the same\n";
  return attn.DropPlan(plan);
}

absl::StatusOr<std::unique_ptr<client::LocalDaemon>> StartDaemon(const Options& opt) {
  client::LocalDaemonOptions dopt;
  dopt.binary = opt.kvpoold;
  dopt.flags = {absl::StrCat("--device=cuda:", kDaemonGpu), "--pool_bytes=8589934592",
                "--slab_bytes=16777216", "--worker_threads=8", "--log_level=warn"};
  dopt.startup_timeout = absl::Seconds(120);
  if (const char* trace = std::getenv("KVPOOL_TRACE_ATTENTION_CHANNEL");
      trace != nullptr && trace[0] == '1') {
    dopt.flags.back() = "--log_level=info";  // the daemon's per-call trace, in this output
    dopt.inherit_output = true;
  }
  return client::LocalDaemon::Start(dopt);
}

absl::Status RegisterModel(const KvpoolClient& c) {
  v1::ModelSpec spec;
  spec.set_model_id(kModel);
  spec.mutable_shape()->set_num_layers(1);
  spec.mutable_shape()->set_q_heads(kQHeads);
  spec.mutable_shape()->set_kv_heads(kKvHeads);
  spec.mutable_shape()->set_head_dim(kHeadDim);
  spec.mutable_data_free()->set_kind(v1::ROTATION_KIND_RANDOMIZED_HADAMARD);
  spec.mutable_data_free()->set_seed(4242);
  return c.RegisterModel(spec).status();
}

constexpr int kFaultQueries = 512;  // 16 MiB of queries: the daemon's channel buffers are large

// The decode worker the fault test kills: one call, then a header without its queries.
absl::Status ChildAttend(const std::string& target, int fd) {
  KVPOOL_ASSIGN_OR_RETURN(
      std::unique_ptr<GpuAttentionClient> attn,
      GpuAttentionClient::Create(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()),
                                 kDecodeGpu));
  KVPOOL_RETURN_IF_ERROR(attn->Open(absl::Seconds(60)));
  KVPOOL_ASSIGN_OR_RETURN(GpuAttentionPlan plan, attn->SetPlan(kModel, {"f-0"}, kFaultQueries));
  KVPOOL_ASSIGN_OR_RETURN(DecodeBuffers buf, DecodeBuffers::Create(kFaultQueries));
  KVPOOL_RETURN_IF_ERROR(Cuda(cudaMemset(buf.q, 0, plan.query_bytes), "memset"));
  KVPOOL_RETURN_IF_ERROR(attn->Attend(plan, 0, buf.q, buf.out, buf.lse).status());
  KVPOOL_RETURN_IF_ERROR(attn->SendHeaderOnlyForTesting(plan));
  if (write(fd, "r", 1) != 1) return absl::InternalError("cannot report to the parent");
  while (true) absl::SleepFor(absl::Seconds(1));
}

absl::Status Fault(const Options& opt, const std::string& self) {
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<client::LocalDaemon> daemon, StartDaemon(opt));
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<KvpoolClient> c, KvpoolClient::Connect(daemon->target()));
  KVPOOL_RETURN_IF_ERROR(RegisterModel(*c));
  const std::vector<Bf16> k = testing::ToBf16(testing::RealLikeRows(8192 * kKvHeads, kHeadDim, 1));
  const std::vector<Bf16> v = testing::ToBf16(testing::GaussianValues(8192 * kRow, 2));
  KVPOOL_RETURN_IF_ERROR(Prefill(*c, "f-0", k, v, 8192));
  // GPU 1's free memory, seen from this process (its own context there is made first).
  KVPOOL_RETURN_IF_ERROR(Cuda(cudaSetDevice(kDaemonGpu), "cudaSetDevice"));
  KVPOOL_RETURN_IF_ERROR(Cuda(cudaFree(nullptr), "context on the daemon's GPU"));
  std::vector<size_t> free_after;
  for (int cycle = 0; cycle < 3; ++cycle) {
    int fds[2];
    if (pipe(fds) != 0) return absl::InternalError("pipe");
    const pid_t child = fork();
    if (child == 0) {
      close(fds[0]);
      const std::string fd = std::to_string(fds[1]);
      execl(self.c_str(), self.c_str(), "--child-attend", daemon->target().c_str(), "--child-fd",
            fd.c_str(), nullptr);
      _exit(127);
    }
    close(fds[1]);
    pollfd p{fds[0], POLLIN, 0};
    char byte = 0;
    const bool ready = poll(&p, 1, 180000) == 1 && read(fds[0], &byte, 1) == 1;
    close(fds[0]);
    absl::SleepFor(absl::Milliseconds(200));  // the daemon now waits for the queries
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
    if (!ready) return absl::InternalError("the child decode worker never sent its header");
    // The daemon serves a new channel (it may first have to notice the kill: retry briefly).
    KVPOOL_RETURN_IF_ERROR(Cuda(cudaSetDevice(kDecodeGpu), "cudaSetDevice"));
    KVPOOL_ASSIGN_OR_RETURN(
        std::unique_ptr<GpuAttentionClient> attn,
        GpuAttentionClient::Create(
            grpc::CreateChannel(daemon->target(), grpc::InsecureChannelCredentials()), kDecodeGpu));
    KVPOOL_RETURN_IF_ERROR(attn->Open(absl::Seconds(60)));
    KVPOOL_ASSIGN_OR_RETURN(GpuAttentionPlan plan, attn->SetPlan(kModel, {"f-0"}, 1));
    KVPOOL_ASSIGN_OR_RETURN(DecodeBuffers buf, DecodeBuffers::Create(1));
    KVPOOL_RETURN_IF_ERROR(Cuda(cudaMemset(buf.q, 0, plan.query_bytes), "memset"));
    KVPOOL_ASSIGN_OR_RETURN(std::vector<uint32_t> tokens,
                            attn->Attend(plan, 0, buf.q, buf.out, buf.lse));
    KVPOOL_RETURN_IF_ERROR(Expect(tokens == std::vector<uint32_t>{8192}, "tokens after a kill"));
    KVPOOL_RETURN_IF_ERROR(attn->Close());
    attn.reset();
    cudaFree(buf.q);
    cudaFree(buf.out);
    cudaFree(buf.lse);
    absl::SleepFor(absl::Seconds(1));
    size_t free_bytes = 0, total = 0;
    KVPOOL_RETURN_IF_ERROR(Cuda(cudaSetDevice(kDaemonGpu), "cudaSetDevice"));
    KVPOOL_RETURN_IF_ERROR(Cuda(cudaMemGetInfo(&free_bytes, &total), "cudaMemGetInfo"));
    free_after.push_back(free_bytes);
    std::cout << "fault: decode worker " << cycle + 1
              << " killed mid-call (header sent, queries never); a new channel then attended "
              << tokens[0] << " tokens; GPU 1 free " << (free_bytes >> 20) << " MiB\n";
  }
  const double grown_mib =
      (static_cast<double>(free_after.front()) - free_after.back()) / (1 << 20);
  std::cout << "fault: GPU 1 memory in use grew by " << grown_mib
            << " MiB from the first kill to the third (each killed channel held over "
            << (2 * kFaultQueries * kQueryRow * 4 >> 20) << " MiB of buffers)\n";
  KVPOOL_RETURN_IF_ERROR(
      Expect(grown_mib <= 32, "the daemon frees killed workers' channels (no growth over kills)"));
  return daemon->Stop();
}

absl::Status Run(const Options& opt) {
  const std::vector<int> contexts =
      opt.quick ? std::vector<int>{8192} : std::vector<int>{8192, 32768};
  const std::vector<int> batches = opt.quick ? std::vector<int>{1, 8} : std::vector<int>{1, 8, 32};
  const int max_batch = batches.back();
  const int max_context = contexts.back();
  const int reps = opt.quick ? 20 : 50;

  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<client::LocalDaemon> daemon, StartDaemon(opt));
  client::ClientOptions copt;
  copt.deadline = absl::Seconds(600);
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<KvpoolClient> c,
                          KvpoolClient::Connect(daemon->target(), copt));
  KVPOOL_RETURN_IF_ERROR(RegisterModel(*c));

  // Real-like K and outlier-heavy V, one buffer shared by every sequence.
  const std::vector<Bf16> k =
      testing::ToBf16(testing::RealLikeRows(max_context * kKvHeads, kHeadDim, 1));
  std::vector<float> vf = testing::GaussianValues(static_cast<size_t>(max_context) * kRow, 2);
  for (size_t i = 7; i < vf.size(); i += kHeadDim) vf[i] *= 6.0f;
  const std::vector<Bf16> v = testing::ToBf16(vf);
  std::map<int, std::vector<std::string>> ids;
  for (int context : contexts) {
    for (int i = 0; i < max_batch; ++i)
      ids[context].push_back(absl::StrCat("ctx", context, "-", i));
    KVPOOL_RETURN_IF_ERROR(RunParallel(4, [&](int s) {
                             for (int i = s; i < max_batch; i += 4) {
                               KVPOOL_RETURN_IF_ERROR(Prefill(*c, ids[context][i], k, v, context));
                             }
                             return absl::OkStatus();
                           }).status());
  }
  std::cerr << "prefilled " << max_batch << " sequences at each context\n";

  KVPOOL_RETURN_IF_ERROR(Cuda(cudaSetDevice(kDecodeGpu), "cudaSetDevice"));
  KVPOOL_ASSIGN_OR_RETURN(DecodeBuffers buf, DecodeBuffers::Create(2 * max_batch));
  KVPOOL_ASSIGN_OR_RETURN(
      std::unique_ptr<GpuAttentionClient> attn,
      GpuAttentionClient::Create(
          grpc::CreateChannel(daemon->target(), grpc::InsecureChannelCredentials()), kDecodeGpu));
  KVPOOL_RETURN_IF_ERROR(attn->Open(absl::Seconds(60)));

  const int check_batch = std::min(8, max_batch);
  KVPOOL_RETURN_IF_ERROR(Checks(
      *c, *attn, buf,
      std::vector<std::string>(ids[contexts[0]].begin(), ids[contexts[0]].begin() + check_batch),
      contexts[0], k, v, daemon->target()));

  BenchReport report("gpu-attention");
  int met = 0, shapes = 0;
  std::cout << "\n  context  batch   NCCL p50 ms   gRPC p50 ms   kernel ms   NCCL transport ms\n";
  for (int context : contexts) {
    for (int batch : batches) {
      const std::vector<std::string> batch_ids(ids[context].begin(), ids[context].begin() + batch);
      const std::vector<float> q = testing::GaussianValues(batch * kQueryRow, 100 + batch);
      KVPOOL_RETURN_IF_ERROR(
          Cuda(cudaMemcpy(buf.q, q.data(), q.size() * 4, cudaMemcpyHostToDevice), "H2D q"));
      KVPOOL_ASSIGN_OR_RETURN(GpuAttentionPlan plan, attn->SetPlan(kModel, batch_ids, 1));
      // Over NCCL: device buffers, one round trip per call.
      for (int w = 0; w < 5; ++w) {
        KVPOOL_RETURN_IF_ERROR(attn->Attend(plan, 0, buf.q, buf.out, buf.lse).status());
      }
      KVPOOL_ASSIGN_OR_RETURN(v1::GetStatsResponse s0, c->GetStats());
      std::vector<double> nccl_ms;
      for (int r = 0; r < reps; ++r) {
        const auto t0 = Clock::now();
        KVPOOL_ASSIGN_OR_RETURN(std::vector<uint32_t> t,
                                attn->Attend(plan, 0, buf.q, buf.out, buf.lse));
        nccl_ms.push_back(1e3 * SecondsSince(t0));
        KVPOOL_RETURN_IF_ERROR(Expect(t.back() == static_cast<uint32_t>(context), "tokens"));
      }
      KVPOOL_ASSIGN_OR_RETURN(v1::GetStatsResponse s1, c->GetStats());
      // Over gRPC: host buffers, loopback.
      const v1::AttendRequest request = GrpcRequest(batch_ids, 1, q);
      for (int w = 0; w < 3; ++w) KVPOOL_RETURN_IF_ERROR(c->Attend(request).status());
      KVPOOL_ASSIGN_OR_RETURN(v1::GetStatsResponse s2, c->GetStats());
      std::vector<double> grpc_ms;
      for (int r = 0; r < reps; ++r) {
        const auto t0 = Clock::now();
        KVPOOL_RETURN_IF_ERROR(c->Attend(request).status());
        grpc_ms.push_back(1e3 * SecondsSince(t0));
      }
      KVPOOL_ASSIGN_OR_RETURN(v1::GetStatsResponse s3, c->GetStats());
      KVPOOL_RETURN_IF_ERROR(attn->DropPlan(plan));

      auto kernel_ms = [&](const v1::GetStatsResponse& a, const v1::GetStatsResponse& b) {
        return 1e3 *
               (b.service().attention_device_seconds() - a.service().attention_device_seconds()) /
               reps;
      };
      const double k_nccl = kernel_ms(s0, s1), k_grpc = kernel_ms(s2, s3);
      const double p_nccl = Percentile(nccl_ms, 0.5), p_grpc = Percentile(grpc_ms, 0.5);
      const double overhead = std::max(0.0, p_nccl - k_nccl);
      const std::map<std::string, std::string> params{{"batch", std::to_string(batch)},
                                                      {"context", std::to_string(context)},
                                                      {"Hq", std::to_string(kQHeads)},
                                                      {"Hkv", std::to_string(kKvHeads)},
                                                      {"D", std::to_string(kHeadDim)},
                                                      {"reps", std::to_string(reps)},
                                                      {"client", "cuda:0"},
                                                      {"daemon", "cuda:1"}};
      auto with = [&](const char* key, const char* value) {
        auto p = params;
        p[key] = value;
        return p;
      };
      report.Add({"remote_attention_nccl_p50",
                  with("buffers", "device"),
                  p_nccl,
                  "ms",
                  {"attention_kernel_alone", k_nccl}});
      report.Add({"remote_attention_grpc_p50",
                  with("buffers", "host"),
                  p_grpc,
                  "ms",
                  {"attention_kernel_alone", k_grpc}});
      report.Add({"transport_overhead_nccl",
                  with("target", "ratio <= 1"),
                  overhead,
                  "ms",
                  {"attention_kernel_alone", k_nccl}});
      ++shapes;
      if (overhead <= k_nccl) ++met;
      std::printf("  %7d  %5d   %11.3f   %11.3f   %9.3f   %17.3f%s\n", context, batch, p_nccl,
                  p_grpc, k_nccl, overhead, overhead <= k_nccl ? "" : "  (over the kernel time)");
    }
  }
  std::cout << "target (the NCCL transport adds no more than the kernel time): met in " << met
            << " of " << shapes << " shapes\n\n";
  KVPOOL_RETURN_IF_ERROR(attn->Close());
  for (auto& [context, list] : ids) {
    for (const std::string& id : list) KVPOOL_RETURN_IF_ERROR(c->ReleaseSequence(id).status());
  }
  KVPOOL_RETURN_IF_ERROR(daemon->Stop());
  return report.Publish(opt.out);
}

}  // namespace
}  // namespace kvpool::bench

int main(int argc, char** argv) {
  kvpool::bench::Options opt;
  if (!kvpool::bench::ParseBenchArgs(argc, argv,
                                     {{"--kvpoold", &opt.kvpoold},
                                      {"--out", &opt.out},
                                      {"--child-attend", &opt.child_target},
                                      {"--child-fd", &opt.child_fd}},
                                     {{"--quick", &opt.quick}, {"--fault", &opt.fault}},
                                     "--kvpoold PATH [--out FILE] [--quick] [--fault]")) {
    return 2;
  }
  kvpool::bench::DisableNvlinkMulticastHere();
  if (!opt.child_target.empty()) {
    const absl::Status s =
        kvpool::bench::ChildAttend(opt.child_target, std::atoi(opt.child_fd.c_str()));
    std::cerr << "child: " << s << "\n";
    return 1;
  }
  if (!kvpool::bench::TwoGpuBenchCanRun(opt.kvpoold)) return 2;
  const absl::Status s = opt.fault ? kvpool::bench::Fault(opt, argv[0]) : kvpool::bench::Run(opt);
  return kvpool::bench::ExitCode(s);
}
