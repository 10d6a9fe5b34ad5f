// Writes the seed corpora of the fuzz targets: small valid inputs that reach deep (a file that
// parses, a request that gets past the "not found" checks), so that a fuzzing run starts from
// the formats' and services' happy paths. Each seed is <root>/<target>/seed-<name>; files of
// other names (regression inputs from crashes) are left alone.
//
//   build/bin/kvpool-fuzz-make-seeds tests/fuzz/corpus
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "client/npy.h"
#include "dataplane/attention_wire.h"
#include "dataplane/ucx_wire.h"
#include "kernels/rotation_file.h"
#include "kernels/safetensors.h"
#include "kvpool/v1/admin_service.pb.h"
#include "kvpool/v1/attention_service.pb.h"
#include "kvpool/v1/model_service.pb.h"
#include "kvpool/v1/read_service.pb.h"
#include "kvpool/v1/sequence_service.pb.h"
#include "kvpool/v1/stats_service.pb.h"
#include "kvpool/v1/transport_service.pb.h"
#include "server/model_registry.h"
#include "tests/fuzz/fuzz_daemon.h"
#include "tests/fuzz/fuzz_requests.h"
#include "tests/fuzz/rpc_catalog.h"

namespace kvpool::fuzz {
namespace {

namespace fs = std::filesystem;
namespace v1 = ::kvpool::v1;
namespace wire = ::kvpool::ucx::wire;

class SeedWriter {
 public:
  explicit SeedWriter(fs::path root) : root_(std::move(root)) {}

  void Write(const std::string& target, const std::string& name, const std::string& bytes) {
    const fs::path dir = root_ / target;
    fs::create_directories(dir);
    std::ofstream out(dir / ("seed-" + name), std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) {
      std::fprintf(stderr, "make_seeds: cannot write %s/%s\n", dir.c_str(), name.c_str());
      ok_ = false;
    }
    ++count_;
  }
  bool ok() const { return ok_; }
  int count() const { return count_; }

 private:
  const fs::path root_;
  bool ok_ = true;
  int count_ = 0;
};

template <typename T>
std::string Raw(const T& v) {
  return std::string(reinterpret_cast<const char*>(&v), sizeof(v));
}

// A varint length, then the bytes: one message of a streaming call (FuzzInput::Framed).
std::string Framed(const std::string& bytes) {
  std::string out;
  uint64_t n = bytes.size();
  do {
    uint8_t b = n & 0x7f;
    n >>= 7;
    if (n != 0) b |= 0x80;
    out.push_back(static_cast<char>(b));
  } while (n != 0);
  return out + bytes;
}

std::string Selector(Rpc rpc) { return std::string(1, static_cast<char>(rpc)); }

// A rotation file of the fuzz model's head_dim: `kind` over `layers` layers.
std::string RotationFile(RotationKind kind, int layers, bool eigenvalues) {
  QuantConfig q;
  q.block_tokens = kBlockTokens;
  q.sink_tokens = kSinkTokens;
  q.recent_tokens = kRecentTokens;
  q.demotion_batch = kBlockTokens;
  absl::StatusOr<ModelCodec> codec =
      kind == RotationKind::kDense
          ? server::DataFreeCodec(RotationKind::kHadamard, 0, layers, kHeadDim, q, false)
          : server::DataFreeCodec(kind, 11, layers, kHeadDim, q, false);
  if (!codec.ok()) {
    std::fprintf(stderr, "make_seeds: %s\n", codec.status().ToString().c_str());
    std::exit(1);
  }
  if (kind == RotationKind::kDense) {  // the Hadamard matrices stored densely
    std::vector<std::vector<float>> k, v;
    for (int l = 0; l < layers; ++l) {
      k.push_back(codec->rotations.Matrix(l, KvTensor::kKey));
      v.push_back(codec->rotations.Matrix(l, KvTensor::kValue));
    }
    codec->rotations = *RotationSet::Dense(layers, kHeadDim, std::move(k), std::move(v));
    codec->objective = "qqt_r_h_pbr/sst_r_h_pbr";
  }
  if (eigenvalues) {
    codec->k_eigenvalues.assign(layers, std::vector<float>(kHeadDim, 1.5f));
    codec->v_eigenvalues.assign(layers, std::vector<float>(kHeadDim, 0.5f));
  }
  codec->model_id = "fuzz-model";
  return SerializeRotationFile(*codec);
}

void SafetensorsSeeds(SeedWriter& w) {
  const std::string t = "safetensors_fuzz";
  SafetensorsWriter f;
  f.SetMetadata("model_id", "fuzz");
  const float values[6] = {1, -2, 3.5f, 0, 1e-3f, 7};
  f.AddFloat32("a", {2, 3}, values);
  f.AddTensor("b", SafetensorsDtype::kBF16, {4}, std::string(8, '\x3f'));
  f.AddTensor("c", SafetensorsDtype::kI32, {0}, "");
  f.AddTensor("d", SafetensorsDtype::kU8, {3}, "xyz");
  f.AddTensor("e", SafetensorsDtype::kF16, {1, 2}, std::string("\x00\x3c\x00\xbc", 4));
  f.AddTensor("f", SafetensorsDtype::kF64, {1}, Raw(2.5));
  w.Write(t, "mixed", f.Serialize());
  w.Write(t, "rotation-dense", RotationFile(RotationKind::kDense, 1, false));
  SafetensorsWriter empty;
  w.Write(t, "empty", empty.Serialize());
}

void RotationFileSeeds(SeedWriter& w) {
  const std::string t = "rotation_file_fuzz";
  w.Write(t, "identity-eigen", RotationFile(RotationKind::kIdentity, 2, true));
  w.Write(t, "hadamard", RotationFile(RotationKind::kHadamard, 2, false));
  w.Write(t, "randomized-hadamard", RotationFile(RotationKind::kRandomizedHadamard, 3, false));
  w.Write(t, "dense", RotationFile(RotationKind::kDense, 1, true));
}

void NpySeeds(SeedWriter& w) {
  using client::NpyDtype;
  const std::string t = "npy_fuzz";
  auto npy = [](NpyDtype d, std::vector<int64_t> shape) {
    size_t n = 1;
    for (int64_t s : shape) n *= static_cast<size_t>(s);
    std::string data(n * client::NpyDtypeSize(d), '\0');
    for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7 + 1);
    return *client::SerializeNpy(d, shape, data);
  };
  w.Write(t, "f32-2x3", npy(NpyDtype::kF32, {2, 3}));
  w.Write(t, "bf16-kv", npy(NpyDtype::kBF16, {1, 2, 1, 4}));
  w.Write(t, "i32-ids", npy(NpyDtype::kI32, {5}));
  w.Write(t, "f16-scalar", npy(NpyDtype::kF16, {}));
  w.Write(t, "f64-empty", npy(NpyDtype::kF64, {0, 3}));
  w.Write(t, "u16-words", npy(NpyDtype::kU16, {2, 2}));
  // Version 2.0: a 4-byte header length.
  std::string v1 = npy(NpyDtype::kI64, {3});
  const uint16_t len = static_cast<uint8_t>(v1[8]) | (static_cast<uint8_t>(v1[9]) << 8);
  std::string v2 =
      v1.substr(0, 6) + std::string("\x02\x00", 2) + Raw(uint32_t{len}) + v1.substr(10);
  w.Write(t, "i64-v2", v2);
}

void UcxWireSeeds(SeedWriter& w) {
  const std::string t = "ucx_wire_fuzz";
  {
    wire::PushBeginHeader h{};
    h.session_id = 1;
    h.push_id = 2;
    h.num_tokens = 3;
    h.flags = wire::kEndOfPrefill;
    h.sequence_id_bytes = 1;
    h.num_token_ids = 3;
    const uint32_t ids[3] = {10, 11, 12};
    w.Write(t, "push-begin",
            std::string(1, '\0') + wire::Encode(h) + "s" +
                std::string(reinterpret_cast<const char*>(ids), sizeof(ids)));
  }
  {
    wire::LayerDataHeader h{};
    h.layer = 1;
    h.num_tokens = 2;
    h.tensor = wire::kTensorValue;
    // Row bytes 2 x 64 = 128 (the fuzz model's 2 KV heads x 32 BF16 values).
    w.Write(t, "layer-data", std::string("\x01\x02", 2) + wire::Encode(h) + std::string(256, 'k'));
  }
  {
    wire::AttendHeader h{};
    h.call_id = 5;
    h.layer = 1;
    h.batch = 2;
    h.model_id_bytes = 1;
    std::string payload = "m";
    payload += Raw(wire::SequenceQueryMeta{1, 1}) + Raw(wire::SequenceQueryMeta{2, 2});
    payload += "s" + std::string("e2");
    payload += std::string(3 * kQHeads * kHeadDim * sizeof(float), '\0');
    w.Write(t, "attend", std::string(1, '\x02') + wire::Encode(h) + payload);
  }
  {
    wire::AttendDoneHeader h{};
    h.call_id = 5;
    h.batch = 2;
    h.q_heads = 2;
    h.head_dim = 4;
    std::string payload =
        Raw(wire::SequenceResultMeta{40, 1}) + Raw(wire::SequenceResultMeta{8, 2});
    payload += std::string(3 * (8 + 2) * sizeof(float), '\0');
    w.Write(t, "attend-done", std::string("\x03\x01", 2) + wire::Encode(h) + payload);
    h.status_code = 5;
    w.Write(t, "attend-done-error", std::string("\x03\x00", 2) + wire::Encode(h) + "no model");
  }
  {
    wire::PushDoneHeader h{};
    h.push_id = 2;
    h.status_code = 3;
    w.Write(t, "push-done-error", std::string(1, '\x04') + wire::Encode(h) + "bad layer");
    h.status_code = 99;
    w.Write(t, "push-done-unknown-code", std::string(1, '\x04') + wire::Encode(h) + "?");
  }
  w.Write(t, "push-commit",
          std::string("\x05\x01", 2) + wire::Encode(wire::PushControlHeader{1, 2, 4}));
}

void GpuChannelSeeds(SeedWriter& w) {
  using server::CallHeader;
  using server::CallStatus;
  const std::string t = "gpu_channel_fuzz";
  CallHeader h;
  h.plan_id = 1;
  h.layer = 1;
  h.call = 1;
  h.query_bytes = 2 * kQHeads * kHeadDim * sizeof(float);
  h.lse_bytes = 2 * kQHeads * sizeof(float);
  const auto header = server::EncodeCallHeader(h);
  w.Write(t, "call-header",
          std::string(1, '\0') +
              std::string(reinterpret_cast<const char*>(header.data()), header.size()));
  for (const bool ok : {true, false}) {
    CallStatus s;
    s.call = 3;
    if (ok) {
      s.attended_tokens = {40, 12};
    } else {
      s.status = absl::NotFoundError("no sequence 'x'");
    }
    std::string block(server::kCallStatusBytes, '\0');
    (void)server::EncodeCallStatus(
        s, absl::MakeSpan(reinterpret_cast<uint8_t*>(block.data()), block.size()));
    w.Write(t, ok ? "call-status" : "call-status-error", std::string(1, '\x01') + block);
  }
  w.Write(t, "plan-shape",
          std::string(1, '\x02') + Raw(uint32_t{2}) + Raw(uint32_t{1}) + Raw(uint32_t{kQHeads}) +
              Raw(uint32_t{kHeadDim}) + Raw(uint32_t{256}));
  v1::DevicePushRequest header_msg;
  header_msg.mutable_header()->set_session_id(1);
  header_msg.mutable_header()->mutable_append()->set_sequence_id("e");
  header_msg.mutable_header()->mutable_append()->set_num_tokens(16);
  header_msg.mutable_header()->mutable_append()->set_dtype(v1::DTYPE_BF16);
  v1::DevicePushRequest chunk;
  chunk.mutable_chunk()->set_layer(1);
  chunk.mutable_chunk()->set_token_offset(8);
  chunk.mutable_chunk()->set_num_tokens(8);
  chunk.mutable_chunk()->mutable_k()->set_handle(std::string(64, 'h'));
  chunk.mutable_chunk()->mutable_k()->set_offset(0);
  chunk.mutable_chunk()->mutable_v()->set_handle(std::string(64, 'h'));
  chunk.mutable_chunk()->mutable_v()->set_offset(4096);
  w.Write(t, "push",
          std::string("\x03\x01\x02", 3) + Framed(header_msg.SerializeAsString()) +
              Framed(chunk.SerializeAsString()) + Raw(uint32_t{1} << 16));
}

void NegotiateSeeds(SeedWriter& w) {
  const std::string t = "negotiate_fuzz";
  v1::NegotiateRequest inline_only;
  inline_only.add_offers()->set_kind(v1::TRANSPORT_KIND_GRPC_INLINE);
  inline_only.set_client_name("fuzz");
  w.Write(t, "grpc-inline", inline_only.SerializeAsString());
  v1::NegotiateRequest ucx;
  v1::TransportOffer* o = ucx.add_offers();
  o->set_kind(v1::TRANSPORT_KIND_UCX);
  o->set_wire_version(ucx::wire::kWireVersion);
  o->set_ucx_transports("posix,tcp");
  o->set_pid(1234);
  o->set_process_start_time(99);
  o->set_boot_id("boot");
  ucx.add_offers()->set_kind(static_cast<v1::TransportKind>(7));
  ucx.add_offers()->set_kind(v1::TRANSPORT_KIND_GRPC_INLINE);
  w.Write(t, "ucx-then-inline", ucx.SerializeAsString());
  w.Write(t, "empty", "");
}

// admission_fuzz: limits byte, then three threads' (op, argument) scripts interleaved. Each seed
// opens tickets on every thread, reserves, touches, pauses past the idle timeout and drops.
void AdmissionSeeds(SeedWriter& w) {
  const std::string t = "admission_fuzz";
  auto script = [](uint8_t config, const std::vector<std::pair<uint8_t, uint8_t>>& ops) {
    std::string bytes(1, static_cast<char>(config));
    for (const auto& [op, arg] : ops) {
      for (int thread = 0; thread < 3; ++thread) bytes.push_back(static_cast<char>(op));
      for (int thread = 0; thread < 3; ++thread) {
        bytes.push_back(static_cast<char>(arg + thread));
      }
    }
    return bytes;
  };
  // Thread i reads bytes i, i + 3, ... of what follows the limits: each entry below becomes
  // every thread's (op, argument + i).
  const std::vector<std::pair<uint8_t, uint8_t>> busy = {
      {0, 0x10}, {1, 40}, {0, 0x91}, {1, 200}, {3, 0},   {2, 10}, {5, 250},
      {1, 30},   {4, 0},  {0, 0x22}, {5, 255}, {5, 255}, {4, 1},  {4, 2}};
  w.Write(t, "capped-short-idle", script(0x35, busy));   // 1 stream/conn, 1/tenant, bytes caps
  w.Write(t, "uncapped-long-idle", script(0x80, busy));  // no caps, 3 ms idle
  w.Write(t, "tenant-bytes", script(0x4a, busy));        // 2 streams/conn, 2/tenant, 3 KiB/tenant
}

void RpcSeeds(SeedWriter& w) {
  const std::string t = "rpc_fuzz";
  auto unary = [&](Rpc rpc, const std::string& name, const google::protobuf::Message& m) {
    w.Write(t, name, Selector(rpc) + m.SerializeAsString());
  };
  auto stream = [&](Rpc rpc, const std::string& name,
                    const std::vector<const google::protobuf::Message*>& messages) {
    std::string bytes = Selector(rpc);
    for (const google::protobuf::Message* m : messages) bytes += Framed(m->SerializeAsString());
    w.Write(t, name, bytes);
  };

  // ModelService.
  const v1::RegisterModelRequest new_model =
      ModelSpecRequest("m2", v1::ROTATION_KIND_RANDOMIZED_HADAMARD);
  stream(Rpc::kRegisterModel, "register-data-free", {&new_model});
  const v1::RegisterModelRequest same_model = ModelSpecRequest(kModelId);
  stream(Rpc::kRegisterModel, "register-again", {&same_model});
  {
    const std::string file = RotationFile(RotationKind::kIdentity, kLayers, false);
    v1::RegisterModelRequest spec = ModelSpecRequest("m3");
    spec.mutable_spec()->clear_quant();
    spec.mutable_spec()->set_upload_size(file.size());
    v1::RegisterModelRequest chunk;
    chunk.set_rotation_file_chunk(file);
    stream(Rpc::kRegisterModel, "register-upload", {&spec, &chunk});
  }
  unary(Rpc::kListModels, "list-models", v1::ListModelsRequest());
  v1::DescribeModelRequest describe;
  describe.set_model_id(kModelId);
  describe.set_include_rotation(true);
  unary(Rpc::kDescribeModel, "describe-model", describe);
  v1::DeleteModelRequest del;
  del.set_model_id(kModelId);
  unary(Rpc::kDeleteModel, "delete-model-in-use", del);
  del.set_force(true);
  unary(Rpc::kDeleteModel, "delete-model-force", del);

  // SequenceService.
  v1::CreateSequenceRequest create;
  create.set_model_id(kModelId);
  create.set_sequence_id("n");
  unary(Rpc::kCreateSequence, "create", create);
  for (uint32_t id = 0; id < 32; ++id) create.add_prefix_token_ids(id);
  unary(Rpc::kCreateSequence, "create-with-prefix", create);
  {
    const std::vector<v1::AppendKvRequest> push =
        AppendRequests(kEmptySequenceId, 0, 12, /*token_ids=*/true, /*end_of_prefill=*/false);
    std::vector<const google::protobuf::Message*> messages;
    for (const v1::AppendKvRequest& r : push) messages.push_back(&r);
    stream(Rpc::kAppendKv, "append-empty", messages);
    const std::vector<v1::AppendKvRequest> more =
        AppendRequests(kSequenceId, kBaseTokens, 4, /*token_ids=*/false, /*end_of_prefill=*/true);
    messages.clear();
    for (const v1::AppendKvRequest& r : more) messages.push_back(&r);
    stream(Rpc::kAppendKv, "append-more", messages);
  }
  unary(Rpc::kAppendDecode, "decode", DecodeRequest(kSequenceId, kBaseTokens, 1));
  unary(Rpc::kAppendDecode, "decode-two", DecodeRequest(kSequenceId, kBaseTokens, 2));
  v1::SealSequenceRequest seal;
  seal.set_sequence_id(kSequenceId);
  unary(Rpc::kSealSequence, "seal", seal);
  v1::ReleaseSequenceRequest release;
  release.set_sequence_id(kSequenceId);
  unary(Rpc::kReleaseSequence, "release", release);
  v1::DescribeSequenceRequest describe_seq;
  describe_seq.set_sequence_id(kSequenceId);
  unary(Rpc::kDescribeSequence, "describe-sequence", describe_seq);
  v1::LookupPrefixRequest lookup;
  lookup.set_model_id(kModelId);
  for (uint32_t id = 0; id < kBaseTokens; ++id) lookup.add_token_ids(id);
  unary(Rpc::kLookupPrefix, "lookup", lookup);

  // ReadService.
  v1::ReadBlocksRequest blocks;
  blocks.set_sequence_id(kSequenceId);
  unary(Rpc::kReadBlocks, "read-blocks", blocks);
  blocks.add_layers(1);
  unary(Rpc::kReadBlocks, "read-blocks-layer", blocks);
  // An incremental read: a cursor of what a reader holds (its incarnation is nobody's).
  v1::ReadBlocksCursor* since = blocks.mutable_since();
  since->set_sequence_incarnation(1);
  since->set_sink_tokens(16);
  since->set_history_tokens(32);
  since->set_recent_tokens(8);
  unary(Rpc::kReadBlocks, "read-blocks-cursor", blocks);
  v1::ReadKvRequest read;
  read.set_sequence_id(kSequenceId);
  read.add_layers(0);
  read.set_token_start(4);
  read.set_num_tokens(30);
  read.set_dtype(v1::DTYPE_FP32);
  unary(Rpc::kReadKv, "read-kv", read);

  // AttentionService, StatsService.
  unary(Rpc::kAttend, "attend", AttendRequest({kSequenceId}, 1, 2));
  unary(Rpc::kAttend, "attend-batch", AttendRequest({kSequenceId, kEmptySequenceId}, 0, 1));
  v1::GetStatsRequest stats;
  stats.set_include_sequences(true);
  unary(Rpc::kGetStats, "stats", stats);

  // TransportService (plans and device pushes are UNAVAILABLE on the CPU backend).
  v1::NegotiateRequest negotiate;
  negotiate.add_offers()->set_kind(v1::TRANSPORT_KIND_GRPC_INLINE);
  unary(Rpc::kNegotiate, "negotiate", negotiate);
  v1::CloseSessionRequest close;
  close.set_session_id(1);
  unary(Rpc::kCloseSession, "close-session", close);
  v1::SetAttentionPlanRequest plan;
  plan.set_session_id(1);
  plan.set_model_id(kModelId);
  plan.add_sequence_ids(kSequenceId);
  unary(Rpc::kSetAttentionPlan, "set-plan", plan);
  v1::DropAttentionPlanRequest drop;
  drop.set_session_id(1);
  drop.set_plan_id(1);
  unary(Rpc::kDropAttentionPlan, "drop-plan", drop);
  v1::FetchToDeviceRequest fetch;
  fetch.set_session_id(1);
  *fetch.mutable_read() = blocks;
  fetch.mutable_arena()->set_handle(std::string(64, '\x01'));
  fetch.set_history_slots(4);
  fetch.set_bf16_slots(4);
  for (int32_t slot : {0, 1, 2, 3}) {
    fetch.add_free_history_slots(slot);
    fetch.add_free_bf16_slots(slot);
  }
  fetch.add_held()->set_history_tail_slot(-1);
  unary(Rpc::kFetchToDevice, "fetch-to-device", fetch);
  {
    v1::DevicePushRequest header;
    header.mutable_header()->set_session_id(1);
    *header.mutable_header()->mutable_append() = AppendRequests(kSequenceId, kBaseTokens, 4,
                                                                /*token_ids=*/false,
                                                                /*end_of_prefill=*/false)[0]
                                                     .header();
    v1::DevicePushRequest chunk;
    chunk.mutable_chunk()->set_layer(0);
    chunk.mutable_chunk()->set_num_tokens(4);
    stream(Rpc::kPushKv, "device-push", {&header, &chunk});
  }
  v1::WatchSessionRequest watch;
  watch.set_session_id(1);
  unary(Rpc::kWatchSession, "watch-session", watch);
  unary(Rpc::kReloadTenants, "reload-tenants", v1::ReloadTenantsRequest());
}

}  // namespace
}  // namespace kvpool::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_ROOT (tests/fuzz/corpus)\n", argv[0]);
    return 2;
  }
  kvpool::fuzz::SeedWriter w{std::filesystem::path(argv[1])};
  kvpool::fuzz::SafetensorsSeeds(w);
  kvpool::fuzz::RotationFileSeeds(w);
  kvpool::fuzz::NpySeeds(w);
  kvpool::fuzz::UcxWireSeeds(w);
  kvpool::fuzz::GpuChannelSeeds(w);
  kvpool::fuzz::NegotiateSeeds(w);
  kvpool::fuzz::RpcSeeds(w);
  kvpool::fuzz::AdmissionSeeds(w);
  std::printf("make_seeds: wrote %d seeds under %s\n", w.count(), argv[1]);
  return w.ok() ? 0 : 1;
}
