// The decode critical path on one GPU: a real kvpoold --device=cuda:N, and this process as the
// decode worker beside it on the same host (on the same GPU: it stands for a worker on a
// neighbouring GPU). For each model (a 70B-class shape and SmolLM2-135M's), batch and context,
// one layer's remote attention by every path, each against the same stored sequences:
//
//   kernel    the decode-attention kernels' device time per call (query rotation, history,
//             merge: the daemon's own events around them, during the gRPC calls)
//   grpc      AttentionService.Attend over gRPC (float32 queries), p50
//   shm_cpu   the same-host channel (shared memory), queries and outputs in host memory, p50;
//             shm_cpu_in_place the same with the queries and answers read and written in the
//             slot (HoldSlot/AttendInPlace), as a worker that projects straight into it;
//             with the CPU time per call of this thread and of kvpoold
//   shm_gpu   the same-host channel with device mailboxes: queries and outputs in this
//             process's GPU memory, p50 from the call until its outputs are in (stream synced)
//   fetch_local  attention-ready blocks fetched into this process's GPU memory (KvMirror,
//             FetchToDevice over CUDA IPC) and attended here with kvpool's kernel through its C
//             API (libkvpool_attention): p50 of the local call on an unchanged mirror; beside it
//             the cost of an incremental fetch that finds nothing new, and of the first fetch
//
// Beside them, gRPC's own floor on the machine: the p50 of the health check (an empty call).
//
// Correctness first: every path's output and LSE must equal the gRPC answer to the bit (the
// same tables, the same split of the work, the same kernels); any difference fails the run.
// Writes the raw rows as JSON (docs/operations.md form); tests/gpu/decode_path_table.py adds
// torch SDPA BF16 on the same shapes and the per-token cost of all layers, and prints the table.
//
// Usage: kvpool-gpu-decode-path-bench --kvpoold PATH [--device cuda:0] [--out FILE] [--quick]
#include <cuda_runtime.h>
#include <dirent.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/kv_mirror.h"
#include "client/kvpool_client.h"
#include "client/local_daemon.h"
#include "client/transport/shm_attention.h"
#include "client/transport/shm_device_attention.h"
#include "common/cuda_status.h"
#include "common/status_macros.h"
#include "kernels/capi/kvpool_attention.h"
#include "kernels/paged_kv.h"
#include "kernels/rotation.h"
#include "proto/status.h"
#include "tests/bench/bench_prefill.h"
#include "tests/bench/bench_report.h"
#include "tests/bench/bench_timing.h"
#include "tests/support/test_data.h"

namespace kvpool::bench {
namespace {

namespace v1 = ::kvpool::v1;
using client::KvpoolClient;
using client::RemoteAttentionPlan;

using Options = DaemonBenchOptions;

struct ModelShape {
  std::string name;
  int q_heads, kv_heads, head_dim, layers;
};

// CPU seconds this thread has run.
double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// CPU seconds all threads of process `pid` have run (scheduler nanoseconds per thread).
double ProcessCpuSeconds(pid_t pid) {
  double total = 0;
  const std::string dir = absl::StrCat("/proc/", pid, "/task");
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return 0;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream f(absl::StrCat(dir, "/", e->d_name, "/schedstat"));
    double ns = 0;
    if (f >> ns) total += ns * 1e-9;
  }
  closedir(d);
  return total;
}

// CPU seconds per thread name of process `pid` (threads of one name summed).
std::map<std::string, double> CpuSecondsByThreadName(pid_t pid) {
  std::map<std::string, double> by_name;
  const std::string dir = absl::StrCat("/proc/", pid, "/task");
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return by_name;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream comm(absl::StrCat(dir, "/", e->d_name, "/comm"));
    std::ifstream stat(absl::StrCat(dir, "/", e->d_name, "/schedstat"));
    std::string name;
    double ns = 0;
    if (std::getline(comm, name) && (stat >> ns)) by_name[name] += ns * 1e-9;
  }
  closedir(d);
  return by_name;
}

// "name us, ..." for the threads that ran most between `before` and `after`, per call.
std::string TopThreads(const std::map<std::string, double>& before,
                       const std::map<std::string, double>& after, int calls) {
  std::vector<std::pair<double, std::string>> delta;
  for (const auto& [name, secs] : after) {
    const auto it = before.find(name);
    delta.push_back({secs - (it == before.end() ? 0.0 : it->second), name});
  }
  std::sort(delta.rbegin(), delta.rend());
  std::string out;
  for (size_t i = 0; i < delta.size() && i < 6; ++i) {
    absl::StrAppend(&out, i ? ", " : "", delta[i].second, " ",
                    static_cast<int>(1e6 * delta[i].first / calls), " us");
  }
  return out;
}

// A device buffer freed at scope exit.
struct DeviceBuffer {
  void* p = nullptr;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (p != nullptr) cudaFree(p);
  }
  absl::Status Alloc(size_t bytes) { return CudaStatus(cudaMalloc(&p, bytes), "cudaMalloc"); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

absl::Status CapiStatus(int32_t code, const char* what) {
  if (code == KVPOOL_ATTENTION_OK) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(code),
                      absl::StrCat(what, ": ", kvpool_attention_last_error()));
}

// The C API's description of `b` (arrays and pools in device memory) on `device`.
kvpool_attention_desc DescOf(const PagedKvBatch& b, int q_heads, int device) {
  kvpool_attention_desc d;
  kvpool_attention_desc_init(&d);
  const BlockLayout& l = b.history_pool.layout;
  d.q_heads = q_heads;
  d.kv_heads = l.kv_heads;
  d.head_dim = l.head_dim;
  d.bits = l.bits;
  d.group_size = l.group_size;
  d.block_tokens = l.tokens;
  d.history_pool = {b.history_pool.pool, b.history_pool.num_blocks, b.history_pool.block_stride};
  d.bf16_pool = {b.bf16_pool.pool, b.bf16_pool.num_blocks, b.bf16_pool.block_stride};
  auto tier = [](const PagedKvTier& t) {
    return kvpool_attention_tier{t.block_tables, t.block_table_stride, t.first_token, t.num_tokens};
  };
  d.sink = tier(b.sink);
  d.history = tier(b.history);
  d.recent = tier(b.recent);
  d.num_seqs = b.num_seqs;
  d.max_history_tokens = b.max_history_tokens;
  d.max_bf16_tokens = b.max_bf16_tokens;
  d.device = device;
  return d;
}

absl::Status CopyToDevice(uint8_t* dst, const uint8_t* src, size_t n) {
  return CudaStatus(cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice), "H2D");
}
absl::Status CopyToHost(uint8_t* dst, const uint8_t* src, size_t n) {
  return CudaStatus(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost), "D2H");
}

bool SameBits(absl::Span<const float> a, const std::string& b_bytes, size_t offset_values) {
  if ((offset_values * sizeof(float)) + b_bytes.size() > a.size() * sizeof(float)) return false;
  return std::memcmp(a.data() + offset_values, b_bytes.data(), b_bytes.size()) == 0;
}

// The gRPC answer's out and LSE, row after row.
struct Reference {
  std::vector<std::string> out, lse;
};

absl::Status CheckAgainst(const Reference& ref, absl::Span<const float> out,
                          absl::Span<const float> lse, size_t per_row, size_t heads,
                          const std::string& path) {
  for (size_t i = 0; i < ref.out.size(); ++i) {
    if (!SameBits(out, ref.out[i], i * per_row) || !SameBits(lse, ref.lse[i], i * heads)) {
      return absl::InternalError(absl::StrCat(path, ": row ", i, " differs from the gRPC answer"));
    }
  }
  return absl::OkStatus();
}

absl::Status Run(const Options& opt) {
  const std::vector<int> contexts =
      opt.quick ? std::vector<int>{8192, 32768} : std::vector<int>{8192, 32768, 131072};
  const std::vector<int> batches = opt.quick ? std::vector<int>{1, 8} : std::vector<int>{1, 8, 32};
  const std::vector<ModelShape> models = {{"llama70b", 64, 8, 128, 80}, {"smollm2", 9, 3, 64, 30}};
  const int max_batch = batches.back();
  const int device = std::stoi(opt.device.substr(opt.device.find(':') + 1));

  client::LocalDaemonOptions dopt;
  dopt.binary = opt.kvpoold;
  dopt.flags = {absl::StrCat("--device=", opt.device),
                "--pool_bytes=17179869184",
                "--slab_bytes=16777216",
                "--worker_threads=8",
                "--log_level=warn",
                "--shm_max_region_bytes=268435456"};
  dopt.flags.insert(dopt.flags.end(), opt.kvpoold_flags.begin(), opt.kvpoold_flags.end());
  dopt.startup_timeout = absl::Seconds(120);
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<client::LocalDaemon> daemon,
                          client::LocalDaemon::Start(dopt));
  client::ClientOptions copt;
  copt.deadline = absl::Seconds(600);
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<KvpoolClient> c,
                          KvpoolClient::Connect(daemon->target(), copt));

  client::ShmAttentionOptions so;
  so.max_query_bytes = static_cast<uint64_t>(max_batch) * 64 * 128 * 4;
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<client::ShmAttentionClient> shm,
                          client::ShmAttentionClient::Connect(c->channel(), so));
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<client::ShmDeviceAttention> shm_gpu,
                          client::ShmDeviceAttention::Open(c->channel(), device, so));
  cudaStream_t stream = nullptr;
  KVPOOL_RETURN_IF_ERROR(
      CudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream"));

  // A CUDA IPC session for the mirrors' device fetches.
  uint64_t ipc_session = 0;
  {
    auto stub = v1::TransportService::NewStub(c->channel());
    v1::NegotiateRequest offer;
    offer.add_offers()->set_kind(v1::TRANSPORT_KIND_CUDA_IPC);
    v1::NegotiateResponse session;
    grpc::ClientContext ctx;
    KVPOOL_RETURN_IF_ERROR(FromGrpcStatus(stub->Negotiate(&ctx, offer, &session), "Negotiate"));
    if (session.kind() != v1::TRANSPORT_KIND_CUDA_IPC) {
      return absl::FailedPreconditionError("the daemon offers no CUDA IPC session");
    }
    ipc_session = session.cuda_ipc().session_id();
  }

  BenchReport report("gpu_decode_path");
  // gRPC's own floor on this machine: the health check, an empty unary call on the same channel.
  {
    std::vector<double> health_us;
    for (int rep = 0; rep < 300; ++rep) {
      const auto t0 = SteadyClock::now();
      KVPOOL_RETURN_IF_ERROR(c->Health().status());
      if (rep >= 20) health_us.push_back(1e6 * SecondsSince(t0));
    }
    report.Add({"grpc_health_check_us", {}, Median(health_us), "us", {"", 0}});
  }
  for (const ModelShape& m : models) {
    v1::ModelSpec spec;
    spec.set_model_id(m.name);
    spec.mutable_shape()->set_num_layers(1);
    spec.mutable_shape()->set_q_heads(m.q_heads);
    spec.mutable_shape()->set_kv_heads(m.kv_heads);
    spec.mutable_shape()->set_head_dim(m.head_dim);
    spec.mutable_data_free()->set_kind(v1::ROTATION_KIND_RANDOMIZED_HADAMARD);
    spec.mutable_data_free()->set_seed(4242);
    KVPOOL_RETURN_IF_ERROR(c->RegisterModel(spec).status());
    const size_t row = static_cast<size_t>(m.kv_heads) * m.head_dim;
    const int max_context = contexts.back();
    const std::vector<Bf16> k =
        testing::ToBf16(testing::RealLikeRows(max_context * m.kv_heads, m.head_dim, 1));
    std::vector<float> vf = testing::GaussianValues(static_cast<size_t>(max_context) * row, 2);
    for (size_t i = 7; i < vf.size(); i += m.head_dim) vf[i] *= 6.0f;
    const std::vector<Bf16> v = testing::ToBf16(vf);

    for (int context : contexts) {
      std::vector<std::string> ids;
      for (int i = 0; i < max_batch; ++i) {
        ids.push_back(absl::StrCat(m.name, "-", context, "-", i));
        KVPOOL_RETURN_IF_ERROR(c->CreateSequence(m.name, ids.back()).status());
      }
      KVPOOL_RETURN_IF_ERROR(RunParallel(4, [&](int s) {
                               for (int i = s; i < max_batch; i += 4) {
                                 KVPOOL_RETURN_IF_ERROR(
                                     PrefillLayer0(*c, ids[i], k, v, context, row));
                               }
                               return absl::OkStatus();
                             }).status());

      // The decode worker's mirror of these sequences in its GPU memory, filled by the daemon
      // (FetchToDevice over CUDA IPC), and the rotations of the layer (data-free: made here).
      KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<client::KvMirror> probe,
                              client::KvMirror::Create(c.get(), m.name, {1, 1}));
      const BlockLayout hl = probe->history_pool().layout, bl = probe->bf16_pool().layout;
      const client::KvMirrorOptions mo{max_batch * (context / hl.tokens + 2), max_batch * 64};
      const size_t arena_bytes = client::KvMirror::ArenaBytes(hl, bl, mo);
      DeviceBuffer arena;
      KVPOOL_RETURN_IF_ERROR(arena.Alloc(arena_bytes));
      KVPOOL_ASSIGN_OR_RETURN(
          std::unique_ptr<client::KvMirror> mirror,
          client::KvMirror::Create(
              c.get(), m.name, mo,
              client::MirrorArena{arena.as<uint8_t>(), arena_bytes, CopyToDevice, CopyToHost}));
      cudaIpcMemHandle_t arena_handle;
      KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaIpcGetMemHandle(&arena_handle, arena.p), "handle"));
      client::DeviceFetchTarget target;
      target.session_id = ipc_session;
      target.handle.assign(reinterpret_cast<const char*>(&arena_handle), sizeof(arena_handle));
      {
        const auto t0 = SteadyClock::now();
        uint64_t bytes = 0;
        for (const std::string& id : ids) {
          KVPOOL_ASSIGN_OR_RETURN(client::FetchStats f, mirror->FetchToDevice(id, target));
          bytes += f.bytes;
        }
        const double secs = SecondsSince(t0);
        report.Add({"first_fetch_GBs",
                    {{"model", m.name},
                     {"context", std::to_string(context)},
                     {"sequences", std::to_string(max_batch)}},
                    bytes / secs / 1e9,
                    "GB/s",
                    {"", 0}});
        std::vector<double> idle_us;
        for (int rep = 0; rep < 50; ++rep) {
          const auto t1 = SteadyClock::now();
          KVPOOL_ASSIGN_OR_RETURN(client::FetchStats f, mirror->FetchToDevice(ids[0], target));
          idle_us.push_back(1e6 * SecondsSince(t1));
          if (f.bytes != 0) return absl::InternalError("an unchanged sequence moved bytes");
        }
        report.Add({"unchanged_fetch_us",
                    {{"model", m.name}, {"context", std::to_string(context)}},
                    Median(idle_us),
                    "us",
                    {"", 0}});
      }
      KVPOOL_ASSIGN_OR_RETURN(RotationSet rotation,
                              RotationSet::RandomizedHadamard(1, m.head_dim, 4242));
      const std::vector<float> mk = rotation.Matrix(0, KvTensor::kKey);
      const std::vector<float> mv = rotation.Matrix(0, KvTensor::kValue);
      DeviceBuffer d_mk, d_mv;
      KVPOOL_RETURN_IF_ERROR(d_mk.Alloc(mk.size() * 4));
      KVPOOL_RETURN_IF_ERROR(d_mv.Alloc(mv.size() * 4));
      KVPOOL_RETURN_IF_ERROR(CopyToDevice(
          d_mk.as<uint8_t>(), reinterpret_cast<const uint8_t*>(mk.data()), mk.size() * 4));
      KVPOOL_RETURN_IF_ERROR(CopyToDevice(
          d_mv.as<uint8_t>(), reinterpret_cast<const uint8_t*>(mv.data()), mv.size() * 4));

      for (int batch : batches) {
        const std::vector<std::string> batch_ids(ids.begin(), ids.begin() + batch);
        const size_t per_row = static_cast<size_t>(m.q_heads) * m.head_dim;
        const std::vector<float> q =
            testing::GaussianValues(static_cast<size_t>(batch) * per_row, 7 + batch);
        auto params = [&](const std::string& path) {
          return std::map<std::string, std::string>{{"model", m.name},
                                                    {"Hq", std::to_string(m.q_heads)},
                                                    {"Hkv", std::to_string(m.kv_heads)},
                                                    {"D", std::to_string(m.head_dim)},
                                                    {"layers", std::to_string(m.layers)},
                                                    {"batch", std::to_string(batch)},
                                                    {"context", std::to_string(context)},
                                                    {"path", path}};
        };

        // gRPC, and the kernels' own time during it.
        v1::AttendRequest request;
        request.set_model_id(m.name);
        request.set_dtype(v1::DTYPE_FP32);
        for (int i = 0; i < batch; ++i) {
          v1::SequenceQuery* sq = request.add_queries();
          sq->set_sequence_id(batch_ids[i]);
          sq->set_q(reinterpret_cast<const char*>(q.data() + i * per_row), per_row * sizeof(float));
        }
        Reference ref;
        for (int w = 0; w < 3; ++w) {
          KVPOOL_ASSIGN_OR_RETURN(v1::AttendResponse r, c->Attend(request));
          ref = {};
          for (const v1::SequenceAttention& a : r.results()) {
            ref.out.push_back(a.out());
            ref.lse.push_back(std::string(reinterpret_cast<const char*>(a.lse().data()),
                                          a.lse_size() * sizeof(float)));
          }
        }
        const int grpc_reps = context >= 131072 && batch >= 32 ? 20 : 50;
        KVPOOL_ASSIGN_OR_RETURN(v1::GetStatsResponse before, c->GetStats());
        std::vector<double> grpc_us;
        const std::map<std::string, double> threads0 = CpuSecondsByThreadName(daemon->pid());
        const double rcpu0 = ThreadCpuSeconds(), rd0 = ProcessCpuSeconds(daemon->pid());
        for (int rep = 0; rep < grpc_reps; ++rep) {
          const auto t0 = SteadyClock::now();
          KVPOOL_RETURN_IF_ERROR(c->Attend(request).status());
          grpc_us.push_back(1e6 * SecondsSince(t0));
        }
        const double grpc_client_cpu = 1e6 * (ThreadCpuSeconds() - rcpu0) / grpc_reps;
        const double grpc_daemon_cpu = 1e6 * (ProcessCpuSeconds(daemon->pid()) - rd0) / grpc_reps;
        std::cerr << m.name << " batch " << batch << " context " << context
                  << ": kvpoold CPU per gRPC call by thread: "
                  << TopThreads(threads0, CpuSecondsByThreadName(daemon->pid()), grpc_reps) << "\n";
        KVPOOL_ASSIGN_OR_RETURN(v1::GetStatsResponse after, c->GetStats());
        const double kernel_us = 1e6 *
                                 (after.service().attention_device_seconds() -
                                  before.service().attention_device_seconds()) /
                                 grpc_reps;
        report.Add(
            {"decode_attention_us", params("kernel"), kernel_us, "us", {"kernel", kernel_us}});
        report.Add(
            {"decode_attention_us", params("grpc"), Median(grpc_us), "us", {"kernel", kernel_us}});
        report.Add({"caller_cpu_us_per_call", params("grpc"), grpc_client_cpu, "us", {"", 0}});
        report.Add({"daemon_cpu_us_per_call", params("grpc"), grpc_daemon_cpu, "us", {"", 0}});

        // Same-host channel, CPU caller.
        KVPOOL_ASSIGN_OR_RETURN(RemoteAttentionPlan plan, shm->SetPlan(m.name, batch_ids, 1));
        std::vector<float> out(q.size()), lse(static_cast<size_t>(batch) * m.q_heads);
        for (int w = 0; w < 3; ++w) {
          KVPOOL_RETURN_IF_ERROR(
              shm->Attend(plan, 0, q, absl::MakeSpan(out), absl::MakeSpan(lse)).status());
        }
        KVPOOL_RETURN_IF_ERROR(CheckAgainst(ref, out, lse, per_row, m.q_heads, "shm_cpu"));
        const int reps = 300;
        std::map<std::string, double> p50;  // by path
        // `reps` calls of `call` on one path: its p50 beside the kernels, and the CPU per call of
        // this thread and of kvpoold.
        auto measure = [&](const std::string& path,
                           const std::function<absl::Status()>& call) -> absl::Status {
          std::vector<double> us;
          const double cpu0 = ThreadCpuSeconds(), d0 = ProcessCpuSeconds(daemon->pid());
          for (int rep = 0; rep < reps; ++rep) {
            const auto t0 = SteadyClock::now();
            KVPOOL_RETURN_IF_ERROR(call());
            us.push_back(1e6 * SecondsSince(t0));
          }
          const double caller_cpu = 1e6 * (ThreadCpuSeconds() - cpu0) / reps;
          const double daemon_cpu = 1e6 * (ProcessCpuSeconds(daemon->pid()) - d0) / reps;
          p50[path] = Median(us);
          report.Add({"decode_attention_us", params(path), p50[path], "us", {"kernel", kernel_us}});
          report.Add({"caller_cpu_us_per_call", params(path), caller_cpu, "us", {"", 0}});
          report.Add({"daemon_cpu_us_per_call", params(path), daemon_cpu, "us", {"", 0}});
          return absl::OkStatus();
        };
        KVPOOL_RETURN_IF_ERROR(measure("shm_cpu", [&] {
          return shm->Attend(plan, 0, q, absl::MakeSpan(out), absl::MakeSpan(lse)).status();
        }));

        // Same-host channel, CPU caller with its queries and answers in place (a worker that
        // writes its projections into the slot): no copy on the caller's side.
        {
          KVPOOL_ASSIGN_OR_RETURN(client::ShmAttentionClient::InPlaceCall call,
                                  shm->HoldSlot(plan));
          std::copy(q.begin(), q.end(), call.queries().begin());
          KVPOOL_RETURN_IF_ERROR(shm->AttendInPlace(call, 0).status());
          KVPOOL_RETURN_IF_ERROR(
              CheckAgainst(ref, call.out(), call.lse(), per_row, m.q_heads, "shm_cpu_in_place"));
          KVPOOL_RETURN_IF_ERROR(
              measure("shm_cpu_in_place", [&] { return shm->AttendInPlace(call, 0).status(); }));
        }
        KVPOOL_RETURN_IF_ERROR(shm->DropPlan(plan));

        // Same-host channel, GPU caller (device mailboxes).
        KVPOOL_ASSIGN_OR_RETURN(RemoteAttentionPlan gplan,
                                shm_gpu->client().SetPlan(m.name, batch_ids, 1));
        float *d_q = nullptr, *d_out = nullptr, *d_lse = nullptr;
        KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&d_q, q.size() * 4), "cudaMalloc"));
        KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&d_out, q.size() * 4), "cudaMalloc"));
        KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&d_lse, lse.size() * 4), "cudaMalloc"));
        KVPOOL_RETURN_IF_ERROR(
            CudaStatus(cudaMemcpy(d_q, q.data(), q.size() * 4, cudaMemcpyHostToDevice), "queries"));
        auto gpu_call = [&]() -> absl::Status {
          KVPOOL_RETURN_IF_ERROR(shm_gpu->Attend(gplan, 0, d_q, d_out, d_lse, stream).status());
          return CudaStatus(cudaStreamSynchronize(stream), "sync");
        };
        for (int w = 0; w < 3; ++w) KVPOOL_RETURN_IF_ERROR(gpu_call());
        std::fill(out.begin(), out.end(), 0.0f);
        KVPOOL_RETURN_IF_ERROR(CudaStatus(
            cudaMemcpy(out.data(), d_out, out.size() * 4, cudaMemcpyDeviceToHost), "out"));
        KVPOOL_RETURN_IF_ERROR(CudaStatus(
            cudaMemcpy(lse.data(), d_lse, lse.size() * 4, cudaMemcpyDeviceToHost), "lse"));
        KVPOOL_RETURN_IF_ERROR(CheckAgainst(ref, out, lse, per_row, m.q_heads, "shm_gpu"));
        KVPOOL_RETURN_IF_ERROR(measure("shm_gpu", gpu_call));
        // Fetch and attend locally: the mirror's tables on the device, kvpool's kernel through its
        // C API on this process's stream.
        KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<PagedKvTables> tables,
                                mirror->Tables(0, batch_ids, 1));
        DeviceBuffer d_words;
        const size_t words_bytes = tables->words().size() * sizeof(int32_t);
        KVPOOL_RETURN_IF_ERROR(d_words.Alloc(words_bytes));
        KVPOOL_RETURN_IF_ERROR(
            CopyToDevice(d_words.as<uint8_t>(),
                         reinterpret_cast<const uint8_t*>(tables->words().data()), words_bytes));
        const PagedKvBatch local =
            RebaseArrays(tables->batch(), tables->words().data(), d_words.as<int32_t>());
        const kvpool_attention_desc desc = DescOf(local, m.q_heads, device);
        uint64_t ws_bytes = 0;
        KVPOOL_RETURN_IF_ERROR(
            CapiStatus(kvpool_attention_workspace_bytes(&desc, &ws_bytes), "workspace"));
        DeviceBuffer ws;
        KVPOOL_RETURN_IF_ERROR(ws.Alloc(std::max<uint64_t>(ws_bytes, 16)));
        kvpool_attention_io io;
        kvpool_attention_io_init(&io);
        io.queries = d_q;
        io.rotation_k = d_mk.as<float>();
        io.rotation_v = d_mv.as<float>();
        io.out = d_out;
        io.lse = d_lse;
        io.workspace = ws.p;
        io.workspace_bytes = ws_bytes;
        io.stream = stream;
        auto local_call = [&]() -> absl::Status {
          KVPOOL_RETURN_IF_ERROR(CapiStatus(kvpool_attention_decode(&desc, &io), "decode"));
          return CudaStatus(cudaStreamSynchronize(stream), "sync");
        };
        for (int w = 0; w < 3; ++w) KVPOOL_RETURN_IF_ERROR(local_call());
        KVPOOL_RETURN_IF_ERROR(CudaStatus(
            cudaMemcpy(out.data(), d_out, out.size() * 4, cudaMemcpyDeviceToHost), "out"));
        KVPOOL_RETURN_IF_ERROR(CudaStatus(
            cudaMemcpy(lse.data(), d_lse, lse.size() * 4, cudaMemcpyDeviceToHost), "lse"));
        KVPOOL_RETURN_IF_ERROR(CheckAgainst(ref, out, lse, per_row, m.q_heads, "fetch_local"));
        std::vector<double> local_us;
        for (int rep = 0; rep < reps; ++rep) {
          const auto t0 = SteadyClock::now();
          KVPOOL_RETURN_IF_ERROR(local_call());
          local_us.push_back(1e6 * SecondsSince(t0));
        }
        report.Add({"decode_attention_us",
                    params("fetch_local"),
                    Median(local_us),
                    "us",
                    {"kernel", kernel_us}});
        cudaFree(d_q);
        cudaFree(d_out);
        cudaFree(d_lse);
        KVPOOL_RETURN_IF_ERROR(shm_gpu->client().DropPlan(gplan));
        std::cerr << m.name << " batch " << batch << " x " << context << ": kernel " << kernel_us
                  << " us, grpc " << Median(grpc_us) << ", shm cpu " << p50["shm_cpu"]
                  << ", in place " << p50["shm_cpu_in_place"] << ", shm gpu " << p50["shm_gpu"]
                  << ", local " << Median(local_us) << "\n";
      }
      for (const std::string& id : ids) KVPOOL_RETURN_IF_ERROR(c->ReleaseSequence(id).status());
    }
  }
  shm_gpu.reset();
  shm.reset();
  KVPOOL_RETURN_IF_ERROR(daemon->Stop());
  return report.Publish(opt.out);
}

}  // namespace
}  // namespace kvpool::bench

int main(int argc, char** argv) {
  kvpool::bench::DaemonBenchOptions opt;
  opt.out = "bench-results/gpu_decode_path_raw.json";
  if (!kvpool::bench::ParseDaemonBenchArgs(argc, argv, &opt)) return 2;
  return kvpool::bench::ExitCode(kvpool::bench::Run(opt));
}
