// kvpool: the command-line tool for kvpoold.
//
//   kvpool [--target=HOST:PORT] COMMAND [flags]
//   kvpool --target=HOST:PORT,HOST:PORT,... | dns://[SERVER]/NAME:PORT  COMMAND [flags] (scale-out)
//
// Run `kvpool help` for the commands. A multi-daemon target routes as the RoutingClient does
// (docs/scale-out.md). Errors are printed as one plain line,
// "kvpool: <command>: <STATUS_CODE>: <message>", and the exit status is 1 (2 for usage
// errors).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "client/kv_files.h"
#include "client/kvpool_client.h"
#include "client/npy.h"
#include "client/routing_client.h"
#include "common/build_info.h"
#include "common/status_macros.h"
#include "kernels/safetensors.h"
#include "proto/api_version.h"
#include "proto/status.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051",
          "kvpoold address (host:port), or several daemons: host:port,host:port,... or "
          "dns:///NAME:PORT or dns://SERVER[:PORT]/NAME:PORT (every address of NAME; routed by "
          "placement, docs/scale-out.md)");
ABSL_FLAG(std::string, tenant, "default",
          "multi-daemon --target: the tenant name in placement keys (as the engines' clients)");
ABSL_FLAG(int32_t, timeout_s, 300, "Deadline of each call in seconds");
ABSL_FLAG(std::string, token_file, "",
          "File whose first line is the bearer token (the environment variable KVPOOL_TOKEN, "
          "when set, wins; a token on the command line would be visible to other users)");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA bundle to verify kvpoold with: turns TLS on");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate (mutual TLS; with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "PEM key of --tls_cert");
ABSL_FLAG(std::string, tls_server_name, "",
          "Name to verify kvpoold's certificate against instead of --target's host");
ABSL_FLAG(int64_t, chunk_bytes, 256 << 10, "Largest K+V payload of one AppendKv message");

ABSL_FLAG(std::string, service, "", "health: service name ('' = the whole server)");
ABSL_FLAG(std::string, model, "", "Model id");
ABSL_FLAG(std::string, sequence, "",
          "Sequence id (attend: a comma-separated list, attended as one batch)");

// register
ABSL_FLAG(int32_t, num_layers, 0, "register: layers (0 = from the rotation file)");
ABSL_FLAG(int32_t, q_heads, 0, "register: query heads Hq");
ABSL_FLAG(int32_t, kv_heads, 0, "register: KV heads Hkv");
ABSL_FLAG(int32_t, head_dim, 0, "register: head dimension D (0 = from the rotation file)");
ABSL_FLAG(std::string, rotation_file, "", "register: a rotation file to upload");
ABSL_FLAG(std::string, server_path, "",
          "register: a rotation file on the daemon's host, inside its --model_dir");
ABSL_FLAG(std::string, rotation, "",
          "register: a data-free rotation: identity, hadamard or randomized_hadamard");
ABSL_FLAG(uint64_t, seed, 0, "register: seed of randomized_hadamard");
ABSL_FLAG(int32_t, bits, -1, "register (data-free): code bits, 2 or 4 (-1 = default 2)");
ABSL_FLAG(int32_t, group_size, -1, "register (data-free): dims per scale/min (-1 = D)");
ABSL_FLAG(std::string, quantizer, "", "register (data-free): uniform, lloyd_max or bypass");
ABSL_FLAG(std::string, scale_dtype, "", "register (data-free): fp16 or bf16");
ABSL_FLAG(double, clip_k, -2, "register (data-free): key clip ratio (-2 = default 0.96)");
ABSL_FLAG(double, clip_v, -2, "register (data-free): value clip ratio (-2 = default 0.92)");
ABSL_FLAG(int32_t, block_tokens, -1, "register (data-free): tokens per block (-1 = 16)");
ABSL_FLAG(int32_t, sink, -1, "register (data-free): BF16 sink tokens (-1 = 64)");
ABSL_FLAG(int32_t, recent, -1, "register (data-free): BF16 recent window (-1 = 256)");
ABSL_FLAG(int32_t, demotion_batch, -1, "register (data-free): demotion batch (-1 = 16)");
ABSL_FLAG(bool, v_prerotated, false, "register (data-free): V arrives rotated by M_V");
ABSL_FLAG(std::string, expect_codec, "", "register: expected codec version (64 hex digits)");

ABSL_FLAG(std::string, request_id, "",
          "x-request-id of the calls (the daemon's log lines carry it; default: it makes one)");

// describe / delete-model
ABSL_FLAG(std::string, rotation_out, "",
          "describe: write the effective rotation to this safetensors file");
ABSL_FLAG(bool, force, false, "delete-model: also release the model's sequences");

// put / create / lookup
ABSL_FLAG(std::string, kv, "", "put: a safetensors file with k and v (see README)");
ABSL_FLAG(std::string, k, "", "put: keys .npy [layers, tokens, kv_heads, head_dim]");
ABSL_FLAG(std::string, v, "", "put: values .npy [layers, tokens, kv_heads, head_dim]");
ABSL_FLAG(std::string, token_ids, "",
          "put/create/lookup: token ids .npy (integers, one per token)");
ABSL_FLAG(bool, create, false, "put: create the sequence (of --model) first");
ABSL_FLAG(bool, final, true, "put: this is the last prefill chunk (end_of_prefill)");
ABSL_FLAG(int64_t, token_start, -1, "put: first token position (-1 = the sequence's length)");

// read / blocks
ABSL_FLAG(std::string, layers, "", "read/blocks: comma-separated layers ('' = all)");
ABSL_FLAG(int64_t, start, 0, "read: first token");
ABSL_FLAG(int64_t, count, 0, "read: tokens (0 = to the end)");
ABSL_FLAG(std::string, dtype, "bf16", "read: bf16 or fp32");
ABSL_FLAG(std::string, out, "",
          "read/blocks: output safetensors file; attend: output .npy of the attention output");
ABSL_FLAG(std::string, out_k, "", "read: keys output .npy");
ABSL_FLAG(std::string, out_v, "", "read: values output .npy");

// attend
ABSL_FLAG(int32_t, layer, 0, "attend: layer");
ABSL_FLAG(std::string, q, "",
          "attend: queries .npy [q_heads, head_dim] or [num_queries, q_heads, head_dim]");
ABSL_FLAG(int64_t, random_q_seed, -1, "attend: use N(0,1) queries from this seed instead of --q");

// stats
ABSL_FLAG(bool, sequences, false, "stats: also list every sequence");

namespace kvpool::client {
namespace {

constexpr char kUsage[] =
    "kvpool: command-line client of kvpoold\n"
    "\n"
    "usage: kvpool [--target=HOST:PORT] COMMAND [flags]\n"
    "\n"
    "commands:\n"
    "  health        gRPC health status (exit 0 when SERVING)            [--service]\n"
    "  register      register a model: --model --q_heads --kv_heads and one of\n"
    "                  --rotation_file=PATH (uploaded) | --server_path=PATH |\n"
    "                  --rotation=identity|hadamard|randomized_hadamard [--seed] --num_layers\n"
    "                  --head_dim [--bits --group_size --quantizer --scale_dtype --clip_k\n"
    "                  --clip_v --block_tokens --sink --recent --demotion_batch --v_prerotated]\n"
    "  models        list registered models\n"
    "  describe      describe a model                  --model [--rotation_out=FILE]\n"
    "  delete-model  delete a model                    --model [--force]\n"
    "  create        create a sequence                 --model --sequence [--token_ids]\n"
    "  put           push KV from a file               --sequence (--kv=FILE.safetensors |\n"
    "                                                  --k=K.npy --v=V.npy) [--create --model]\n"
    "                                                  [--token_ids] [--final=false]\n"
    "  sequence      describe a sequence               --sequence\n"
    "  seal          seal a sequence                   --sequence\n"
    "  release       release a sequence                --sequence\n"
    "  lookup        longest cached prefix             --model --token_ids=FILE.npy\n"
    "  read          dequantized K/V, original basis   --sequence [--layers --start --count\n"
    "                                                  --dtype] [--out=F.safetensors |\n"
    "                                                  --out_k=K.npy --out_v=V.npy]\n"
    "  blocks        attention-ready INT2 blocks       --sequence [--layers --out=F]\n"
    "  attend        remote decode attention           --model --layer --sequence=A[,B..]\n"
    "                                                  (--q=Q.npy | --random_q_seed=N)\n"
    "                                                  [--out=O.npy]\n"
    "  stats         pool and service statistics       [--sequences]\n"
    "  drain         drain the daemon (admin): NOT_SERVING, new work refused, exit once\n"
    "                in-flight calls end (Kubernetes preStop)\n"
    "  reload-tenants  re-read the daemon's tenants file (admin), as SIGHUP\n"
    "\n"
    "With several daemons (--target=A:P,B:P, dns:///NAME:PORT or dns://SERVER/NAME:PORT) each\n"
    "sequence's command goes to its owner: the placement key is --model with the first 64 of\n"
    "--token_ids, or --model with --sequence when no --token_ids are given (name a sequence the\n"
    "same way every time).\n"
    "register, delete-model and stats run on every daemon; health lists the live ones.\n"
    "\n"
    "Run `kvpool --help` for every flag.";

// Tokens of the first block that place a sequence (RoutingOptions::placement_prefix_tokens).
constexpr size_t kPlacementPrefixTokens = 64;

std::string Bytes(uint64_t b) {
  if (b >= (uint64_t{1} << 30)) return absl::StrFormat("%.2f GiB", b / double(1 << 30));
  if (b >= (uint64_t{1} << 20)) return absl::StrFormat("%.2f MiB", b / double(1 << 20));
  if (b >= (uint64_t{1} << 10)) return absl::StrFormat("%.1f KiB", b / double(1 << 10));
  return absl::StrCat(b, " B");
}

absl::Status Required(const std::string& value, absl::string_view flag) {
  if (value.empty()) return absl::InvalidArgumentError(absl::StrCat("--", flag, " is required"));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int>> ParseLayers(const std::string& text) {
  std::vector<int> layers;
  if (text.empty()) return layers;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int layer = 0;
    if (!absl::SimpleAtoi(part, &layer)) {
      return absl::InvalidArgumentError(absl::StrCat("--layers: '", part, "' is not a number"));
    }
    layers.push_back(layer);
  }
  return layers;
}

std::string QuantText(const v1::QuantConfig& q, int head_dim) {
  const char* method = q.method() == v1::QUANT_METHOD_BYPASS      ? "bypass"
                       : q.method() == v1::QUANT_METHOD_LLOYD_MAX ? "lloyd_max"
                                                                  : "uniform";
  return absl::StrFormat(
      "%s %d-bit, group %d, %s scale/min, clip K %g V %g, block %d, sink %d, recent %d, "
      "demotion %d",
      method, q.bits(), q.group_size() == 0 ? head_dim : q.group_size(),
      q.scale_dtype() == v1::SCALE_DTYPE_BF16 ? "bf16" : "fp16", q.clip_ratio_k(), q.clip_ratio_v(),
      q.block_tokens(), q.sink_tokens(), q.recent_tokens(), q.demotion_batch());
}

const char* RotationText(v1::RotationKind k) {
  switch (k) {
    case v1::ROTATION_KIND_IDENTITY:
      return "identity";
    case v1::ROTATION_KIND_HADAMARD:
      return "hadamard";
    case v1::ROTATION_KIND_RANDOMIZED_HADAMARD:
      return "randomized_hadamard";
    case v1::ROTATION_KIND_DENSE:
      return "dense";
    default:
      return "unspecified";
  }
}

const char* StateText(v1::SequenceState s) {
  switch (s) {
    case v1::SEQUENCE_STATE_PREFILL:
      return "prefill";
    case v1::SEQUENCE_STATE_DECODE:
      return "decode";
    case v1::SEQUENCE_STATE_SEALED:
      return "sealed";
    default:
      return "unspecified";
  }
}

void PrintModel(const v1::ModelInfo& m) {
  const v1::BlockLayoutDescriptor& b = m.block_layout();
  std::printf("model          %s\n", m.model_id().c_str());
  std::printf("shape          %d layers, Hq %d, Hkv %d, D %d\n", m.shape().num_layers(),
              m.shape().q_heads(), m.shape().kv_heads(), m.shape().head_dim());
  std::printf("rotation       %s", RotationText(m.rotation_kind()));
  if (m.rotation_kind() == v1::ROTATION_KIND_RANDOMIZED_HADAMARD) {
    std::printf(" (seed %llu)", static_cast<unsigned long long>(m.rotation_seed()));
  }
  if (!m.objective().empty()) std::printf(", objective %s", m.objective().c_str());
  std::printf("%s\n", m.v_prerotated() ? ", V pre-rotated" : "");
  std::printf("quant          %s\n", QuantText(m.quant(), m.shape().head_dim()).c_str());
  std::printf("codec version  %s\n", m.codec_version().c_str());
  std::printf(
      "block layout   format %d, %d tokens x %d heads x D %d, %d-bit, group %d: %llu "
      "code + %llu meta bytes/row, %llu bytes/head segment, %llu bytes/block\n",
      b.format_version(), b.tokens(), b.kv_heads(), b.head_dim(), b.bits(), b.group_size(),
      static_cast<unsigned long long>(b.code_bytes_per_row()),
      static_cast<unsigned long long>(b.meta_bytes_per_row()),
      static_cast<unsigned long long>(b.head_segment_bytes()),
      static_cast<unsigned long long>(b.block_bytes()));
  std::printf("BF16 page      %s\n", Bytes(m.bf16_page_bytes()).c_str());
  std::printf("sequences      %llu, pool %s\n", static_cast<unsigned long long>(m.sequences()),
              Bytes(m.pool_bytes()).c_str());
}

void PrintSequence(const v1::SequenceInfo& s) {
  std::printf(
      "sequence %s (model %s): %s, %u tokens = sink %u + history %u + recent %u "
      "(reused %u)%s\n",
      s.sequence_id().c_str(), s.model_id().c_str(), StateText(s.state()), s.total_tokens(),
      s.sink_tokens(), s.history_tokens(), s.recent_tokens(), s.reused_tokens(),
      s.has_token_ids() ? ", token ids known" : "");
  const double ratio =
      s.pool_bytes() == 0 ? 0.0 : double(s.bf16_equivalent_bytes()) / double(s.pool_bytes());
  std::printf("  pool %s (shared %s) vs BF16 %s: %.2fx smaller\n", Bytes(s.pool_bytes()).c_str(),
              Bytes(s.shared_bytes()).c_str(), Bytes(s.bf16_equivalent_bytes()).c_str(), ratio);
}

absl::StatusOr<std::vector<uint32_t>> TokenIdsFlag() {
  const std::string path = absl::GetFlag(FLAGS_token_ids);
  if (path.empty()) return std::vector<uint32_t>();
  KVPOOL_ASSIGN_OR_RETURN(NpyArray a, ReadNpyFile(path));
  return TokenIdsFromNpy(a);
}

// ---------------------------------------------------------------------------------------------
// Commands

// The placement key a multi-daemon command uses for a sequence (see kUsage): the first block
// of its token ids, else its id.
PlacementKey PlacementKeyOf(const RoutingClient& pool, const std::string& model,
                            const std::string& sequence, absl::Span<const uint32_t> token_ids) {
  if (token_ids.empty()) return pool.KeyOfSequence(model, sequence);
  return pool.KeyOfTokens(model, token_ids.subspan(0, kPlacementPrefixTokens));
}

absl::Status Health(const KvpoolClient& c) {
  KVPOOL_ASSIGN_OR_RETURN(KvpoolClient::ServingStatus s, c.Health(absl::GetFlag(FLAGS_service)));
  std::printf("%s\n", grpc::health::v1::HealthCheckResponse::ServingStatus_Name(s).c_str());
  if (s != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::UnavailableError("the server is not SERVING");
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::RotationKind> ParseRotation(const std::string& name) {
  if (name == "identity") return v1::ROTATION_KIND_IDENTITY;
  if (name == "hadamard") return v1::ROTATION_KIND_HADAMARD;
  if (name == "randomized_hadamard") return v1::ROTATION_KIND_RANDOMIZED_HADAMARD;
  return absl::InvalidArgumentError(absl::StrCat(
      "--rotation must be identity, hadamard or randomized_hadamard, got '", name, "'"));
}

absl::Status Register(const KvpoolClient& c) {
  v1::ModelSpec spec;
  spec.set_model_id(absl::GetFlag(FLAGS_model));
  KVPOOL_RETURN_IF_ERROR(Required(spec.model_id(), "model"));
  spec.mutable_shape()->set_num_layers(absl::GetFlag(FLAGS_num_layers));
  spec.mutable_shape()->set_q_heads(absl::GetFlag(FLAGS_q_heads));
  spec.mutable_shape()->set_kv_heads(absl::GetFlag(FLAGS_kv_heads));
  spec.mutable_shape()->set_head_dim(absl::GetFlag(FLAGS_head_dim));
  spec.set_expected_codec_version(absl::GetFlag(FLAGS_expect_codec));
  const std::string file = absl::GetFlag(FLAGS_rotation_file);
  const std::string server_path = absl::GetFlag(FLAGS_server_path);
  const std::string rotation = absl::GetFlag(FLAGS_rotation);
  if (!file.empty() + !server_path.empty() + !rotation.empty() != 1) {
    return absl::InvalidArgumentError(
        "give exactly one of --rotation_file, --server_path and --rotation");
  }
  std::string upload;
  if (!file.empty()) {
    std::FILE* f = std::fopen(file.c_str(), "rb");
    if (f == nullptr) return absl::NotFoundError(absl::StrCat("cannot open '", file, "'"));
    char buf[1 << 16];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) upload.append(buf, n);
    std::fclose(f);
  } else if (!server_path.empty()) {
    spec.set_server_path(server_path);
  } else {
    KVPOOL_ASSIGN_OR_RETURN(v1::RotationKind kind, ParseRotation(rotation));
    spec.mutable_data_free()->set_kind(kind);
    spec.mutable_data_free()->set_seed(absl::GetFlag(FLAGS_seed));
    spec.set_v_prerotated(absl::GetFlag(FLAGS_v_prerotated));
    v1::QuantConfig* q = spec.mutable_quant();
    if (absl::GetFlag(FLAGS_bits) >= 0) q->set_bits(absl::GetFlag(FLAGS_bits));
    if (absl::GetFlag(FLAGS_group_size) >= 0) q->set_group_size(absl::GetFlag(FLAGS_group_size));
    const std::string quantizer = absl::GetFlag(FLAGS_quantizer);
    if (quantizer == "uniform") {
      q->set_method(v1::QUANT_METHOD_UNIFORM);
    } else if (quantizer == "lloyd_max") {
      q->set_method(v1::QUANT_METHOD_LLOYD_MAX);
    } else if (quantizer == "bypass") {
      q->set_method(v1::QUANT_METHOD_BYPASS);
    } else if (!quantizer.empty()) {
      return absl::InvalidArgumentError("--quantizer must be uniform, lloyd_max or bypass");
    }
    const std::string scale = absl::GetFlag(FLAGS_scale_dtype);
    if (scale == "fp16") {
      q->set_scale_dtype(v1::SCALE_DTYPE_FP16);
    } else if (scale == "bf16") {
      q->set_scale_dtype(v1::SCALE_DTYPE_BF16);
    } else if (!scale.empty()) {
      return absl::InvalidArgumentError("--scale_dtype must be fp16 or bf16");
    }
    if (absl::GetFlag(FLAGS_clip_k) > -2) q->set_clip_ratio_k(absl::GetFlag(FLAGS_clip_k));
    if (absl::GetFlag(FLAGS_clip_v) > -2) q->set_clip_ratio_v(absl::GetFlag(FLAGS_clip_v));
    if (absl::GetFlag(FLAGS_block_tokens) >= 0) {
      q->set_block_tokens(absl::GetFlag(FLAGS_block_tokens));
    }
    if (absl::GetFlag(FLAGS_sink) >= 0) q->set_sink_tokens(absl::GetFlag(FLAGS_sink));
    if (absl::GetFlag(FLAGS_recent) >= 0) q->set_recent_tokens(absl::GetFlag(FLAGS_recent));
    if (absl::GetFlag(FLAGS_demotion_batch) >= 0) {
      q->set_demotion_batch(absl::GetFlag(FLAGS_demotion_batch));
    }
  }
  KVPOOL_ASSIGN_OR_RETURN(v1::RegisterModelResponse r, c.RegisterModel(spec, upload));
  std::printf("%s\n",
              r.already_registered() ? "already registered (same codec version)" : "registered");
  PrintModel(r.model());
  return absl::OkStatus();
}

absl::Status Models(const KvpoolClient& c) {
  KVPOOL_ASSIGN_OR_RETURN(std::vector<v1::ModelInfo> models, c.ListModels());
  std::printf("%-24s %6s %4s %4s %4s %-20s %4s %9s %12s  %s\n", "model", "layers", "Hq", "Hkv", "D",
              "rotation", "bits", "sequences", "pool", "codec");
  for (const v1::ModelInfo& m : models) {
    std::printf("%-24s %6d %4d %4d %4d %-20s %4d %9llu %12s  %.16s\n", m.model_id().c_str(),
                m.shape().num_layers(), m.shape().q_heads(), m.shape().kv_heads(),
                m.shape().head_dim(), RotationText(m.rotation_kind()), m.block_layout().bits(),
                static_cast<unsigned long long>(m.sequences()), Bytes(m.pool_bytes()).c_str(),
                m.codec_version().c_str());
  }
  if (models.empty()) std::printf("(no models)\n");
  return absl::OkStatus();
}

absl::Status Describe(const KvpoolClient& c) {
  const std::string model = absl::GetFlag(FLAGS_model);
  KVPOOL_RETURN_IF_ERROR(Required(model, "model"));
  const std::string out = absl::GetFlag(FLAGS_rotation_out);
  KVPOOL_ASSIGN_OR_RETURN(ModelDescription d, c.DescribeModel(model, !out.empty()));
  PrintModel(d.info);
  if (!out.empty()) {
    SafetensorsWriter w;
    w.SetMetadata("model_id", d.info.model_id());
    w.SetMetadata("codec_version", d.info.codec_version());
    w.SetMetadata("note", "effective rotation: x_rot = x * M (row vectors), float32 [D, D]");
    const int64_t dim = d.info.shape().head_dim();
    for (const v1::RotationLayer& l : d.rotation) {
      w.AddTensor(absl::StrCat("layers.", l.layer(), ".k_rotation"), SafetensorsDtype::kF32,
                  {dim, dim}, l.k_matrix());
      w.AddTensor(absl::StrCat("layers.", l.layer(), ".v_rotation"), SafetensorsDtype::kF32,
                  {dim, dim}, l.v_matrix());
    }
    KVPOOL_RETURN_IF_ERROR(w.WriteFile(out));
    std::printf("wrote %zu layers of rotation matrices to %s\n", d.rotation.size(), out.c_str());
  }
  return absl::OkStatus();
}

absl::Status DeleteModel(const KvpoolClient& c) {
  const std::string model = absl::GetFlag(FLAGS_model);
  KVPOOL_RETURN_IF_ERROR(Required(model, "model"));
  KVPOOL_ASSIGN_OR_RETURN(v1::DeleteModelResponse r,
                          c.DeleteModel(model, absl::GetFlag(FLAGS_force)));
  std::printf("deleted %s: %llu sequences released, %s freed\n", model.c_str(),
              static_cast<unsigned long long>(r.released_sequences()),
              Bytes(r.freed_bytes()).c_str());
  return absl::OkStatus();
}

absl::Status Create(const KvpoolClient& c) {
  v1::CreateSequenceRequest request;
  request.set_model_id(absl::GetFlag(FLAGS_model));
  request.set_sequence_id(absl::GetFlag(FLAGS_sequence));
  KVPOOL_RETURN_IF_ERROR(Required(request.model_id(), "model"));
  KVPOOL_ASSIGN_OR_RETURN(std::vector<uint32_t> ids, TokenIdsFlag());
  request.mutable_prefix_token_ids()->Add(ids.begin(), ids.end());
  KVPOOL_ASSIGN_OR_RETURN(v1::CreateSequenceResponse r, c.CreateSequence(request));
  PrintSequence(r.sequence());
  if (r.reused_tokens() > 0) {
    std::printf("  reused %u tokens in %d cached units\n", r.reused_tokens(),
                r.reused_units_size());
  }
  return absl::OkStatus();
}

absl::Status Put(const KvpoolClient& c) {
  const std::string sequence = absl::GetFlag(FLAGS_sequence);
  KVPOOL_RETURN_IF_ERROR(Required(sequence, "sequence"));
  KvHistory kv;
  if (!absl::GetFlag(FLAGS_kv).empty()) {
    KVPOOL_ASSIGN_OR_RETURN(kv, LoadKvSafetensors(absl::GetFlag(FLAGS_kv)));
  } else if (!absl::GetFlag(FLAGS_k).empty() && !absl::GetFlag(FLAGS_v).empty()) {
    KVPOOL_ASSIGN_OR_RETURN(kv, LoadKvNpy(absl::GetFlag(FLAGS_k), absl::GetFlag(FLAGS_v)));
  } else {
    return absl::InvalidArgumentError("give --kv=FILE.safetensors or --k=K.npy --v=V.npy");
  }
  KVPOOL_ASSIGN_OR_RETURN(std::vector<uint32_t> ids, TokenIdsFlag());
  if (!ids.empty()) kv.token_ids = ids;
  if (absl::GetFlag(FLAGS_create)) {
    KVPOOL_RETURN_IF_ERROR(Required(absl::GetFlag(FLAGS_model), "model"));
    KVPOOL_RETURN_IF_ERROR(c.CreateSequence(absl::GetFlag(FLAGS_model), sequence).status());
  }
  int64_t start = absl::GetFlag(FLAGS_token_start);
  if (start < 0) {
    KVPOOL_ASSIGN_OR_RETURN(v1::SequenceInfo info, c.DescribeSequence(sequence));
    start = info.total_tokens();
  }
  v1::AppendKvHeader header;
  header.set_sequence_id(sequence);
  header.set_token_start(static_cast<uint32_t>(start));
  header.set_num_tokens(kv.num_tokens);
  header.set_dtype(kv.dtype);
  header.set_end_of_prefill(absl::GetFlag(FLAGS_final));
  header.mutable_token_ids()->Add(kv.token_ids.begin(), kv.token_ids.end());
  const auto t0 = std::chrono::steady_clock::now();
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<AppendStream> stream, c.OpenAppend(header));
  for (int l = 0; l < kv.num_layers; ++l) {
    KVPOOL_RETURN_IF_ERROR(stream->WriteLayer(l, 0, kv.num_tokens, kv.k[l], kv.v[l]));
  }
  KVPOOL_ASSIGN_OR_RETURN(v1::AppendKvResponse r, stream->Finish());
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf(
      "appended %d tokens x %d layers (%s in %llu messages, %.1f MB/s): sink %u, "
      "history %u, recent %u; %d prefix units published\n",
      kv.num_tokens, kv.num_layers, Bytes(stream->bytes_sent()).c_str(),
      static_cast<unsigned long long>(stream->messages_sent()), stream->bytes_sent() / secs / 1e6,
      r.to_sink(), r.to_history(), r.to_recent(), r.published_units_size());
  PrintSequence(r.sequence());
  return absl::OkStatus();
}

absl::Status SequenceCmd(const KvpoolClient& c, absl::string_view cmd) {
  const std::string sequence = absl::GetFlag(FLAGS_sequence);
  KVPOOL_RETURN_IF_ERROR(Required(sequence, "sequence"));
  if (cmd == "release") {
    KVPOOL_ASSIGN_OR_RETURN(v1::ReleaseSequenceResponse r, c.ReleaseSequence(sequence));
    std::printf("released %s: %s freed\n", sequence.c_str(), Bytes(r.freed_bytes()).c_str());
    return absl::OkStatus();
  }
  v1::SequenceInfo info;
  if (cmd == "seal") {
    KVPOOL_ASSIGN_OR_RETURN(info, c.SealSequence(sequence));
  } else {
    KVPOOL_ASSIGN_OR_RETURN(info, c.DescribeSequence(sequence));
  }
  PrintSequence(info);
  return absl::OkStatus();
}

absl::Status Lookup(const KvpoolClient& c) {
  const std::string model = absl::GetFlag(FLAGS_model);
  KVPOOL_RETURN_IF_ERROR(Required(model, "model"));
  KVPOOL_RETURN_IF_ERROR(Required(absl::GetFlag(FLAGS_token_ids), "token_ids"));
  KVPOOL_ASSIGN_OR_RETURN(std::vector<uint32_t> ids, TokenIdsFlag());
  KVPOOL_ASSIGN_OR_RETURN(v1::LookupPrefixResponse r, c.LookupPrefix(model, ids));
  std::printf("matched %u of %zu tokens in %d units (codec %.16s)\n", r.matched_tokens(),
              ids.size(), r.units_size(), r.codec_version().c_str());
  for (const v1::PrefixUnit& u : r.units()) {
    std::printf("  %-5s tokens [%u, %u)  %s\n",
                u.kind() == v1::PREFIX_UNIT_KIND_SINK ? "sink" : "block", u.token_start(),
                u.token_start() + u.token_count(), u.hash().c_str());
  }
  return absl::OkStatus();
}

absl::Status Read(const KvpoolClient& c) {
  v1::ReadKvRequest request;
  request.set_sequence_id(absl::GetFlag(FLAGS_sequence));
  KVPOOL_RETURN_IF_ERROR(Required(request.sequence_id(), "sequence"));
  KVPOOL_ASSIGN_OR_RETURN(std::vector<int> layers, ParseLayers(absl::GetFlag(FLAGS_layers)));
  request.mutable_layers()->Add(layers.begin(), layers.end());
  request.set_token_start(static_cast<uint32_t>(absl::GetFlag(FLAGS_start)));
  request.set_num_tokens(static_cast<uint32_t>(absl::GetFlag(FLAGS_count)));
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  if (dtype != "bf16" && dtype != "fp32") {
    return absl::InvalidArgumentError("--dtype must be bf16 or fp32");
  }
  request.set_dtype(dtype == "fp32" ? v1::DTYPE_FP32 : v1::DTYPE_BF16);
  KVPOOL_ASSIGN_OR_RETURN(KvRead read, c.ReadKv(request));
  const v1::ReadKvHeader& h = read.header;
  std::printf("read %u tokens [%u, %u) x %zu layers of %s (%s, original basis)\n", h.num_tokens(),
              h.token_start(), h.token_start() + h.num_tokens(), read.layers.size(),
              h.sequence_id().c_str(), dtype.c_str());
  const std::string out = absl::GetFlag(FLAGS_out);
  const std::string out_k = absl::GetFlag(FLAGS_out_k), out_v = absl::GetFlag(FLAGS_out_v);
  if (!out.empty()) {
    KVPOOL_RETURN_IF_ERROR(WriteKvReadSafetensors(read, out));
    std::printf("wrote k and v to %s\n", out.c_str());
  }
  if (!out_k.empty() || !out_v.empty()) {
    KVPOOL_RETURN_IF_ERROR(Required(out_k, "out_k"));
    KVPOOL_RETURN_IF_ERROR(Required(out_v, "out_v"));
    std::string k, v;
    for (const LayerRows& l : read.layers) {
      k += l.k;
      v += l.v;
    }
    const std::vector<int64_t> shape = {static_cast<int64_t>(read.layers.size()), h.num_tokens(),
                                        h.shape().kv_heads(), h.shape().head_dim()};
    const NpyDtype nd = dtype == "fp32" ? NpyDtype::kF32 : NpyDtype::kBF16;
    KVPOOL_RETURN_IF_ERROR(WriteNpyFile(out_k, nd, shape, k));
    KVPOOL_RETURN_IF_ERROR(WriteNpyFile(out_v, nd, shape, v));
    std::printf("wrote %s and %s\n", out_k.c_str(), out_v.c_str());
  }
  return absl::OkStatus();
}

absl::Status Blocks(const KvpoolClient& c) {
  v1::ReadBlocksRequest request;
  request.set_sequence_id(absl::GetFlag(FLAGS_sequence));
  KVPOOL_RETURN_IF_ERROR(Required(request.sequence_id(), "sequence"));
  KVPOOL_ASSIGN_OR_RETURN(std::vector<int> layers, ParseLayers(absl::GetFlag(FLAGS_layers)));
  request.mutable_layers()->Add(layers.begin(), layers.end());
  KVPOOL_ASSIGN_OR_RETURN(BlocksRead read, c.ReadBlocks(request));
  const v1::ReadBlocksHeader& h = read.header;
  uint64_t block_bytes = 0;
  size_t blocks = 0;
  for (const LayerBlocks& l : read.layers) {
    blocks += l.blocks.size();
    for (const v1::KvBlock& b : l.blocks) block_bytes += b.data().size();
  }
  std::printf(
      "%s: codec %.16s, %zu layers: sink %u + history %u (%zu blocks of %d tokens, %s) "
      "+ recent %u tokens\n",
      h.sequence_id().c_str(), h.codec_version().c_str(), read.layers.size(), h.sink_tokens(),
      h.history_tokens(), blocks, h.block_layout().tokens(), Bytes(block_bytes).c_str(),
      h.recent_tokens());
  const std::string out = absl::GetFlag(FLAGS_out);
  if (!out.empty()) {
    KVPOOL_RETURN_IF_ERROR(WriteBlocksReadSafetensors(read, out));
    std::printf("wrote blocks and BF16 rows to %s\n", out.c_str());
  }
  return absl::OkStatus();
}

// `pool`: a multi-daemon target; the sequences are placed by PlacementKeyOf and the batch fanned
// out to their owners.
absl::Status Attend(const KvpoolClient& c, RoutingClient* pool) {
  const std::string model = absl::GetFlag(FLAGS_model);
  KVPOOL_RETURN_IF_ERROR(Required(model, "model"));
  KVPOOL_RETURN_IF_ERROR(Required(absl::GetFlag(FLAGS_sequence), "sequence"));
  const std::vector<std::string> ids = absl::StrSplit(absl::GetFlag(FLAGS_sequence), ',');
  KVPOOL_ASSIGN_OR_RETURN(ModelDescription d, c.DescribeModel(model, false));
  const int hq = d.info.shape().q_heads(), dim = d.info.shape().head_dim();
  std::vector<float> q;
  int num_queries = 1;
  if (!absl::GetFlag(FLAGS_q).empty()) {
    KVPOOL_ASSIGN_OR_RETURN(NpyArray a, ReadNpyFile(absl::GetFlag(FLAGS_q)));
    const auto& s = a.shape;
    const bool ok2 = s.size() == 2 && s[0] == hq && s[1] == dim;
    const bool ok3 = s.size() == 3 && s[0] >= 1 && s[1] == hq && s[2] == dim;
    if (!ok2 && !ok3) {
      return absl::InvalidArgumentError(
          absl::StrCat("--q must be [", hq, ", ", dim, "] or [num_queries, ", hq, ", ", dim, "]"));
    }
    if (ok3) num_queries = static_cast<int>(s[0]);
    KVPOOL_ASSIGN_OR_RETURN(q, NpyToFloat(a));
  } else if (absl::GetFlag(FLAGS_random_q_seed) >= 0) {
    std::mt19937_64 rng(absl::GetFlag(FLAGS_random_q_seed));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    q.resize(static_cast<size_t>(hq) * dim);
    for (float& x : q) x = normal(rng);
  } else {
    return absl::InvalidArgumentError("give --q=Q.npy or --random_q_seed=N");
  }
  v1::AttendRequest request;
  request.set_model_id(model);
  request.set_layer(absl::GetFlag(FLAGS_layer));
  request.set_dtype(v1::DTYPE_FP32);
  for (const std::string& id : ids) {
    v1::SequenceQuery* sq = request.add_queries();
    sq->set_sequence_id(id);
    sq->set_num_queries(num_queries);
    sq->set_q(reinterpret_cast<const char*>(q.data()), q.size() * sizeof(float));
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<absl::StatusOr<v1::SequenceAttention>> results;
  if (pool == nullptr) {
    KVPOOL_ASSIGN_OR_RETURN(v1::AttendResponse r, c.Attend(request));
    for (v1::SequenceAttention& a : *r.mutable_results()) results.push_back(std::move(a));
  } else {
    KVPOOL_ASSIGN_OR_RETURN(std::vector<uint32_t> token_ids, TokenIdsFlag());
    for (const std::string& id : ids) pool->Place(id, PlacementKeyOf(*pool, model, id, token_ids));
    results = pool->Attend(request);
  }
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::printf("attended layer %d of %zu sequences in %.2f ms\n", request.layer(), ids.size(), ms);
  std::string all;
  absl::Status failed;
  for (size_t i = 0; i < results.size(); ++i) {
    if (!results[i].ok()) {
      std::printf("  %-24s %s\n", ids[i].c_str(), results[i].status().ToString().c_str());
      failed.Update(results[i].status());
      continue;
    }
    const v1::SequenceAttention& a = *results[i];
    double lo = INFINITY, hi = -INFINITY;
    for (float l : a.lse()) {
      lo = std::min<double>(lo, l);
      hi = std::max<double>(hi, l);
    }
    std::printf("  %-24s %6u tokens  lse in [%.4f, %.4f]\n", a.sequence_id().c_str(),
                a.attended_tokens(), lo, hi);
    all += a.out();
  }
  KVPOOL_RETURN_IF_ERROR(failed);
  const std::string out = absl::GetFlag(FLAGS_out);
  const int n = static_cast<int>(results.size());
  if (!out.empty()) {
    KVPOOL_RETURN_IF_ERROR(WriteNpyFile(out, NpyDtype::kF32, {n, num_queries, hq, dim}, all));
    std::printf("wrote the output [%d, %d, %d, %d] to %s\n", n, num_queries, hq, dim, out.c_str());
  }
  return absl::OkStatus();
}

absl::Status Stats(const KvpoolClient& c) {
  KVPOOL_ASSIGN_OR_RETURN(v1::GetStatsResponse s, c.GetStats(absl::GetFlag(FLAGS_sequences)));
  const v1::PoolStats& p = s.pool();
  const v1::ServiceStats& svc = s.service();
  std::printf("%s, backend %s, up %.0f s, %u workers (queue %u/%u, %llu refused busy)\n",
              svc.version().c_str(), svc.backend().c_str(), svc.uptime_seconds(),
              svc.worker_threads(), svc.worker_queue_depth(), svc.worker_queue_capacity(),
              static_cast<unsigned long long>(svc.rejected_busy()));
  const v1::BuildInfo& b = s.build();
  std::printf("build: commit %s, %s, CUDA %s; API %s revision %u\n",
              b.git_commit().empty() ? "unknown" : b.git_commit().c_str(), b.build_type().c_str(),
              b.cuda() ? "on" : "off", b.api_package().c_str(), b.api_revision());
  std::printf(
      "pool: %s used of %s (%s free), %s cached, %s shared, %llu prefix units, %llu "
      "evicted\n",
      Bytes(p.used_bytes()).c_str(), Bytes(p.capacity_bytes()).c_str(),
      Bytes(p.free_bytes()).c_str(), Bytes(p.cached_bytes()).c_str(),
      Bytes(p.shared_bytes()).c_str(), static_cast<unsigned long long>(p.prefix_units()),
      static_cast<unsigned long long>(p.evicted_units()));
  for (const v1::PageClassStats& cl : p.classes()) {
    std::printf(
        "  page class %8llu B: %llu pages, %s\n", static_cast<unsigned long long>(cl.page_bytes()),
        static_cast<unsigned long long>(cl.pages_in_use()), Bytes(cl.bytes_in_use()).c_str());
  }
  std::printf("ingested %s (%llu tokens); %llu attention calls over %llu sequences\n",
              Bytes(svc.ingested_bytes()).c_str(),
              static_cast<unsigned long long>(svc.ingested_tokens()),
              static_cast<unsigned long long>(svc.attention_calls()),
              static_cast<unsigned long long>(svc.attention_sequences()));
  const v1::LifecycleStats& life = s.lifecycle();
  std::printf(
      "lifecycle: %llu calls cancelled (%llu units of work skipped), %llu sequences expired, "
      "%llu leased (default lease %.0f s, 0 = none)\n",
      static_cast<unsigned long long>(life.calls_cancelled()),
      static_cast<unsigned long long>(life.units_skipped()),
      static_cast<unsigned long long>(life.expired_sequences()),
      static_cast<unsigned long long>(life.leased_sequences()), life.sequence_ttl_seconds());
  for (const v1::ModelStats& m : s.models()) {
    std::printf(
        "model %s: %llu sequences, tokens sink %llu + history %llu + recent %llu, pool "
        "%s vs BF16 %s\n",
        m.model_id().c_str(), static_cast<unsigned long long>(m.sequences()),
        static_cast<unsigned long long>(m.sink_tokens()),
        static_cast<unsigned long long>(m.history_tokens()),
        static_cast<unsigned long long>(m.recent_tokens()), Bytes(m.pool_bytes()).c_str(),
        Bytes(m.bf16_equivalent_bytes()).c_str());
  }
  for (const v1::SequenceStats& q : s.sequences()) {
    std::printf("  sequence %s (model %s): %u tokens, %s", q.sequence_id().c_str(),
                q.model_id().c_str(), q.total_tokens(), Bytes(q.pool_bytes()).c_str());
    if (q.ttl_ms() > 0) {
      std::printf(", lease %llu ms, idle %llu ms", static_cast<unsigned long long>(q.ttl_ms()),
                  static_cast<unsigned long long>(q.idle_ms()));
    }
    std::printf("\n");
  }
  const v1::ServerLimits& l = s.limits();
  std::printf(
      "limits: message %s, chunk %s, rotation file %s, attention batch %u, append %u "
      "tokens\n",
      Bytes(l.max_message_bytes()).c_str(), Bytes(l.max_chunk_bytes()).c_str(),
      Bytes(l.max_rotation_file_bytes()).c_str(), l.max_attention_batch(), l.max_append_tokens());
  return absl::OkStatus();
}

constexpr const char* kCommands[] = {
    "health", "register", "models", "describe", "delete-model",  "create",
    "put",    "sequence", "seal",   "release",  "lookup",        "read",
    "blocks", "attend",   "stats",  "drain",    "reload-tenants"};

bool IsKnownCommand(const std::string& cmd) {
  for (const char* c : kCommands) {
    if (cmd == c) return true;
  }
  return false;
}

// A target naming several daemons (docs/scale-out.md), as opposed to one gRPC target.
bool IsMultiDaemonTarget(const std::string& target) {
  return absl::StrContains(target, ',') || absl::StartsWith(target, "dns://");
}

absl::Status DrainCmd(const KvpoolClient& c) {
  KVPOOL_ASSIGN_OR_RETURN(v1::DrainResponse r, c.Drain());
  const v1::ServingState& s = r.serving();
  std::printf("%s (%s), %llu calls in flight, stops by %lld (Unix ms)\n",
              v1::ServingState::State_Name(s.state()).c_str(),
              r.started() ? "drain started" : "already draining",
              static_cast<unsigned long long>(s.in_flight_calls()),
              static_cast<long long>(s.drain_deadline_unix_ms()));
  return absl::OkStatus();
}

absl::Status ReloadTenantsCmd(const KvpoolClient& c) {
  KVPOOL_ASSIGN_OR_RETURN(v1::ReloadTenantsResponse r, c.ReloadTenants());
  std::printf("%u tenants\n", r.tenants());
  return absl::OkStatus();
}

// One command on one daemon (`cmd` is known).
absl::Status RunCommand(KvpoolClient& c, const std::string& cmd, RoutingClient* pool = nullptr) {
  if (cmd == "put" || cmd == "register") KVPOOL_RETURN_IF_ERROR(c.FitToServerLimits());
  if (cmd == "health") return Health(c);
  if (cmd == "register") return Register(c);
  if (cmd == "models") return Models(c);
  if (cmd == "describe") return Describe(c);
  if (cmd == "delete-model") return DeleteModel(c);
  if (cmd == "create") return Create(c);
  if (cmd == "put") return Put(c);
  if (cmd == "sequence" || cmd == "seal" || cmd == "release") return SequenceCmd(c, cmd);
  if (cmd == "lookup") return Lookup(c);
  if (cmd == "read") return Read(c);
  if (cmd == "blocks") return Blocks(c);
  if (cmd == "attend") return Attend(c, pool);
  if (cmd == "drain") return DrainCmd(c);
  if (cmd == "reload-tenants") return ReloadTenantsCmd(c);
  return Stats(c);
}

// One command on the daemons of a multi-daemon target: model and stats commands on every
// member (or the first, for reads of what every member holds), sequence commands on the
// sequence's owner (one retry after a WRONG_OWNER answer and a refresh), attend fanned out.
absl::Status RunOnPool(RoutingClient& pool, const std::string& cmd) {
  const std::shared_ptr<const Membership> members = pool.membership();
  if (cmd == "health") {
    for (const Member& m : members->members()) std::printf("%s SERVING\n", m.endpoint.c_str());
    std::printf("%zu daemons, membership epoch %s\n", members->members().size(),
                members->epoch_hex().c_str());
    return absl::OkStatus();
  }
  if (cmd == "register" || cmd == "delete-model" || cmd == "stats" || cmd == "drain" ||
      cmd == "reload-tenants") {
    return pool.ForEachMember([&](const KvpoolClient& member) {
      std::printf("== %s\n", member.target().c_str());
      return RunCommand(*member.WithCallMetadata({}), cmd);
    });
  }
  if (cmd == "models" || cmd == "describe" || cmd == "attend") {
    KVPOOL_ASSIGN_OR_RETURN(const KvpoolClient* first,
                            pool.ClientFor(members->members().front().endpoint));
    return RunCommand(*first->WithCallMetadata({}), cmd, &pool);
  }
  const std::string model = absl::GetFlag(FLAGS_model);
  if (model.empty()) {
    return absl::InvalidArgumentError(
        "--model is required with a multi-daemon --target (it is part of the placement key)");
  }
  KVPOOL_ASSIGN_OR_RETURN(std::vector<uint32_t> token_ids, TokenIdsFlag());
  const std::string sequence = absl::GetFlag(FLAGS_sequence);
  if (cmd != "lookup") KVPOOL_RETURN_IF_ERROR(Required(sequence, "sequence"));
  const PlacementKey key = PlacementKeyOf(pool, model, sequence, token_ids);
  for (int attempt = 0;; ++attempt) {
    KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<KvpoolClient> owner, pool.OwnerClient(key));
    absl::Status s = RunCommand(*owner, cmd);
    if (ReasonOf(s) != ErrorReason::kWrongOwner || attempt > 0) return s;
    KVPOOL_RETURN_IF_ERROR(pool.Refresh());
  }
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  absl::FlagsUsageConfig usage_config;
  usage_config.version_string = [] {
    return absl::StrCat(BuildDescription("kvpool"), "\nAPI ", kApiPackage, " revision ",
                        kApiRevision, "\n");
  };
  absl::SetFlagsUsageConfig(usage_config);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    std::fprintf(stderr, "%s\n", kUsage);
    return 2;
  }
  const std::string cmd = args[1];
  if (cmd == "help") {
    std::printf("%s\n", kUsage);
    return 0;
  }
  ClientOptions options;
  options.deadline = absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
  options.chunk_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_chunk_bytes));
  options.request_id = absl::GetFlag(FLAGS_request_id);
  absl::StatusOr<std::string> token =
      client::TokenFromEnvironmentOrFile("KVPOOL_TOKEN", absl::GetFlag(FLAGS_token_file));
  if (!token.ok()) {
    std::fprintf(stderr, "kvpool: %s\n", std::string(token.status().message()).c_str());
    return 2;
  }
  options.security.token = *std::move(token);
  options.security.tls_root_ca_file = absl::GetFlag(FLAGS_tls_ca);
  options.security.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.security.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options.security.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  if (!IsKnownCommand(cmd)) {
    std::fprintf(stderr, "kvpool: unknown command '%s'\n\n%s\n", cmd.c_str(), kUsage);
    return 2;
  }
  const std::string target = absl::GetFlag(FLAGS_target);
  absl::Status status;
  if (IsMultiDaemonTarget(target)) {
    RoutingOptions routing;
    routing.client = options;
    routing.tenant = absl::GetFlag(FLAGS_tenant);
    routing.placement_prefix_tokens = kPlacementPrefixTokens;
    absl::StatusOr<std::unique_ptr<RoutingClient>> pool = RoutingClient::Connect(target, routing);
    status = pool.ok() ? RunOnPool(**pool, cmd) : pool.status();
  } else {
    absl::StatusOr<std::unique_ptr<KvpoolClient>> client = KvpoolClient::Connect(target, options);
    status = client.ok() ? RunCommand(**client, cmd) : client.status();
  }
  if (!status.ok()) {
    // One line; the daemon's request id of the call, when it answered one, names its log lines.
    const std::optional<std::string> id = RequestIdOf(status);
    const std::string id_note = id.has_value() ? absl::StrCat(" (request id ", *id, ")") : "";
    std::fprintf(stderr, "kvpool: %s: %s: %s%s\n", cmd.c_str(),
                 absl::StatusCodeToString(status.code()).c_str(),
                 std::string(status.message()).c_str(), id_note.c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace kvpool::client

int main(int argc, char** argv) { return kvpool::client::Main(argc, argv); }
