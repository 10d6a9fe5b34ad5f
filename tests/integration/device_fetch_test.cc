// FetchToDevice end to end with two processes on one GPU: this test process is the decode worker,
// its mirror arena (client/kv_mirror.h) in its own GPU memory and exported over a CUDA IPC
// session; kvpoold --device=cuda:0 copies each fetch's new blocks and rows from its pool into the
// arena. After every fetch the arena, read back, equals a fresh full ReadBlocks; fetches after
// decode steps copy only the new bytes (the same count as the gRPC fetch of a host mirror, which
// follows alongside); an arena range outside its allocation is refused and copies nothing.
//
// Needs a GPU (skips without one): bash tests/gpu/run.sh daemon (or all) on the GPU machine.
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/kv_mirror.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "kvpool/v1/transport_service.grpc.pb.h"
#include "tests/integration/integration_util.h"
#include "tests/integration/mirror_check.h"

namespace kvpool::integration {
namespace {

using client::FetchStats;
using client::KvMirror;
using client::KvMirrorOptions;

constexpr Shape kShape{2, 8, 2, 64};
constexpr KvMirrorOptions kSlots{/*history_slots=*/64, /*bf16_slots=*/64};

v1::QuantConfig SmallTiers() {
  v1::QuantConfig q;
  q.set_block_tokens(16);
  q.set_sink_tokens(8);
  q.set_recent_tokens(24);
  q.set_demotion_batch(8);
  return q;
}

absl::Status CudaCopy(uint8_t* dst, const uint8_t* src, size_t n) {
  return cudaMemcpy(dst, src, n, cudaMemcpyDefault) == cudaSuccess
             ? absl::OkStatus()
             : absl::InternalError(cudaGetErrorString(cudaGetLastError()));
}

class DeviceFetchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      (void)cudaGetLastError();
      GTEST_SKIP() << "needs a GPU";
    }
    absl::StatusOr<std::unique_ptr<LocalDaemon>> d = StartDaemon({"--device=cuda:0"});
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    absl::StatusOr<std::unique_ptr<KvpoolClient>> c = KvpoolClient::Connect(daemon_->target());
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
    absl::StatusOr<v1::ModelInfo> model =
        RegisterDataFree(*client_, "gpu", kShape, v1::ROTATION_KIND_HADAMARD, 3, SmallTiers());
    ASSERT_TRUE(model.ok()) << model.status();
    // The arena, exported whole.
    arena_bytes_ =
        KvMirror::ArenaBytes(KernelLayout(model->block_layout()), Bf16Layout(*model), kSlots);
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&arena_, arena_bytes_), cudaSuccess);
    ASSERT_EQ(cudaMemset(arena_, 0, arena_bytes_), cudaSuccess);
    cudaIpcMemHandle_t handle;
    ASSERT_EQ(cudaIpcGetMemHandle(&handle, arena_), cudaSuccess);
    target_.handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
    // A CUDA IPC session.
    auto stub = v1::TransportService::NewStub(client_->channel());
    v1::NegotiateRequest offer;
    offer.add_offers()->set_kind(v1::TRANSPORT_KIND_CUDA_IPC);
    v1::NegotiateResponse session;
    grpc::ClientContext ctx;
    const grpc::Status s = stub->Negotiate(&ctx, offer, &session);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(session.kind(), v1::TRANSPORT_KIND_CUDA_IPC);
    target_.session_id = session.cuda_ipc().session_id();
  }

  void TearDown() override {
    if (arena_ != nullptr) cudaFree(arena_);
    if (daemon_ != nullptr) {
      EXPECT_TRUE(daemon_->Stop().ok());
    }
  }

  static BlockLayout Bf16Layout(const v1::ModelInfo& m) {
    BlockLayout l = KernelLayout(m.block_layout());
    l.group_size = l.head_dim;
    l.bits = 16;
    return l;
  }

  // A mirror whose arena is arena_ (this process's GPU memory).
  std::unique_ptr<KvMirror> DeviceMirror() {
    client::MirrorArena arena{static_cast<uint8_t*>(arena_), arena_bytes_, CudaCopy, CudaCopy};
    absl::StatusOr<std::unique_ptr<KvMirror>> m =
        KvMirror::Create(client_.get(), "gpu", kSlots, std::move(arena));
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? *std::move(m) : nullptr;
  }

  absl::Status Decode(const std::string& id, const SequenceKv& kv, int start, int steps) {
    const size_t row = static_cast<size_t>(kShape.kv_heads) * kShape.head_dim;
    for (int t = start; t < start + steps; ++t) {
      v1::AppendDecodeRequest r;
      r.set_sequence_id(id);
      r.set_token_start(t);
      r.set_num_tokens(1);
      r.set_dtype(v1::DTYPE_BF16);
      std::string k, v;
      for (int l = 0; l < kShape.num_layers; ++l) {
        k.append(reinterpret_cast<const char*>(kv.k[l].data() + t * row), row * sizeof(Bf16));
        v.append(reinterpret_cast<const char*>(kv.v[l].data() + t * row), row * sizeof(Bf16));
      }
      r.set_k(k);
      r.set_v(v);
      KVPOOL_RETURN_IF_ERROR(client_->AppendDecode(r).status());
    }
    return absl::OkStatus();
  }

  std::unique_ptr<LocalDaemon> daemon_;
  std::unique_ptr<KvpoolClient> client_;
  void* arena_ = nullptr;
  size_t arena_bytes_ = 0;
  client::DeviceFetchTarget target_;
};

TEST_F(DeviceFetchTest, DaemonCopiesOnlyNewBlocksAndRowsIntoTheWorkersArena) {
  std::unique_ptr<KvMirror> device = DeviceMirror();
  ASSERT_NE(device, nullptr);
  absl::StatusOr<std::unique_ptr<KvMirror>> host = KvMirror::Create(client_.get(), "gpu", kSlots);
  ASSERT_TRUE(host.ok()) << host.status();

  // A final prefill of the first 100 tokens, then decode steps from the rest. The last round
  // adds more history blocks than a held sequence's first request offers slots for (the mirror
  // asks again with every free slot).
  const SequenceKv kv = MakeSequenceKv(kShape, 320, 7);
  SequenceKv prefill = kv;
  prefill.tokens = 100;
  const size_t row = static_cast<size_t>(kShape.kv_heads) * kShape.head_dim;
  for (int l = 0; l < kShape.num_layers; ++l) {
    prefill.k[l].resize(100 * row);
    prefill.v[l].resize(100 * row);
  }
  KV_ASSERT_OK(CreateAndAppend(*client_, "gpu", "s", prefill, /*end_of_prefill=*/true).status());
  int at = 100;
  for (int steps : {0, 1, 8, 13, 40, 150}) {
    SCOPED_TRACE(absl::StrCat(steps, " decode steps, at ", at));
    KV_ASSERT_OK(Decode("s", kv, at, steps));
    at += steps;
    absl::StatusOr<FetchStats> by_device = device->FetchToDevice("s", target_);
    ASSERT_TRUE(by_device.ok()) << by_device.status();
    absl::StatusOr<FetchStats> by_grpc = (*host)->Fetch("s");
    ASSERT_TRUE(by_grpc.ok()) << by_grpc.status();
    EXPECT_EQ(by_device->bytes, by_grpc->bytes);
    EXPECT_EQ(by_device->history_blocks, by_grpc->history_blocks);
    EXPECT_EQ(by_device->rows, by_grpc->rows);
    ExpectMirrorIsFullRead(*client_, *device, "s", kShape.num_layers, /*host=*/false);
  }
  // Nothing new: nothing is copied.
  absl::StatusOr<FetchStats> idle = device->FetchToDevice("s", target_);
  ASSERT_TRUE(idle.ok()) << idle.status();
  EXPECT_EQ(idle->bytes, 0u);
  EXPECT_FALSE(idle->full);
  EXPECT_EQ(device->free_bf16_slots(), (*host)->free_bf16_slots());
  EXPECT_EQ(device->free_history_slots(), (*host)->free_history_slots());
}

TEST_F(DeviceFetchTest, AnArenaOutsideItsAllocationCopiesNothing) {
  KV_ASSERT_OK(CreateAndAppend(*client_, "gpu", "e", MakeSequenceKv(kShape, 60, 9), true).status());
  std::unique_ptr<KvMirror> device = DeviceMirror();
  ASSERT_NE(device, nullptr);
  client::DeviceFetchTarget past = target_;
  past.offset = 256;  // the arena's regions then end past the allocation
  const absl::StatusOr<FetchStats> refused = device->FetchToDevice("e", past);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_EQ(device->Held("e"), nullptr);
  std::vector<uint8_t> bytes(arena_bytes_);
  ASSERT_EQ(cudaMemcpy(bytes.data(), arena_, arena_bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
  for (uint8_t b : bytes) ASSERT_EQ(b, 0) << "the refused fetch wrote into the arena";
  // The same fetch at the arena's real place works.
  ASSERT_TRUE(device->FetchToDevice("e", target_).ok());
  ExpectMirrorIsFullRead(*client_, *device, "e", kShape.num_layers, /*host=*/false);
}

}  // namespace
}  // namespace kvpool::integration
