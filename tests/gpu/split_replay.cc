// kvpool-split-replay: the SmolLM2 prefill/decode split (client/demo/smollm2_split) replayed
// against a kvpoold started here, typically --device=cuda:0 on the GPU machine, which has
// neither the model (too large to carry) nor the project venv. The capture (export_replay.py, from
// a CPU run) holds the prompt's K/V and, per registered model, every decode step's queries and
// appended K/V with the CPU daemon's Attend outputs and LSE. This tool registers the same models,
// pushes the prompt (AppendKv, end of prefill), then per step calls Attend for every layer and
// AppendDecode, exactly as the decode process did, and compares each output with the CPU
// daemon's. A second daemon (--reference_device, default cpu) started beside it gets the same
// calls: its answers are the live reference, the captured ones show whether the CPU daemon on
// this machine reproduces the capture, and the stored bytes of both after the prompt (ReadBlocks)
// show whether the two daemons stored the same codes.
//
//   kvpool-split-replay --kvpoold PATH --capture replay.safetensors --rotation ROT.safetensors
//       [--device cuda:0] [--reference_device cpu] [--out gpu_out.safetensors]
//       [--out_tol 1e-2] [--lse_tol 1e-4]
//
// Prints per model the share of stored bytes that differ, the largest absolute and relative
// output difference, the LSE difference and, per step, the step's top-two logit margin from the
// CPU run beside the step's largest output difference (what a greedy token depends on:
// replay_tokens.py turns the written outputs into tokens on a machine with the model).
// Outputs must be within out_tol of the reference's. The LSE must be within lse_tol relative
// where both daemons stored the same bytes; where they did not (a dense rotation: the GPU's
// arrival applies M_K as two BF16 terms, which rounds about 0.2 % of rotated elements to the
// other BF16 neighbour than the CPU's fp32 product does), the LSE difference is reported beside
// the share of differing bytes. Either way the first step's answers must also match, within both
// tolerances, the CPU kernels' attention (kernels/attention.h) over the bytes the tested daemon
// itself stored (ReadBlocks after the prompt): the kernel check that does not depend on the
// rotation's rounding. Exit status 1 when a check fails or a call fails.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/kvpool_client.h"
#include "client/local_daemon.h"
#include "common/file_read.h"
#include "common/status_macros.h"
#include "kernels/attention.h"
#include "kernels/block_layout.h"
#include "kernels/row_codec.h"
#include "kernels/safetensors.h"
#include "server/proto_convert.h"
#include "tests/bench/bench_report.h"

namespace kvpool::bench {
namespace {

namespace v1 = ::kvpool::v1;
using client::KvpoolClient;

struct Options {
  std::string kvpoold, device = "cpu", reference_device = "cpu", capture, rotation, out;
  // The integration suite's GPU tolerance (RemoteAttentionTolerance): the output to within
  // out_tol of the call's largest |output| (at least 1), the LSE to within lse_tol relative.
  std::string out_tol = "1e-2", lse_tol = "1e-4";
};

struct ReplayModel {
  std::string key;       // tensor prefix in the capture: "m0", "m1", ...
  std::string model_id;  // as the CPU run registered it
  bool rotation_file = false;
};

// A tensor's raw bytes, checked against the expected dtype and element count.
absl::StatusOr<absl::string_view> RawTensor(const SafetensorsFile& f, const std::string& name,
                                            SafetensorsDtype dtype, int64_t elements) {
  const SafetensorsTensor* t = f.Find(name);
  if (t == nullptr) return absl::InvalidArgumentError(absl::StrCat("capture lacks ", name));
  if (t->dtype != dtype || t->num_elements() != elements) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": unexpected dtype or size"));
  }
  return t->bytes;
}

absl::StatusOr<std::vector<ReplayModel>> ParseModels(const SafetensorsFile& f) {
  auto it = f.metadata().find("models");
  if (it == f.metadata().end()) return absl::InvalidArgumentError("capture lacks 'models'");
  std::vector<ReplayModel> models;
  for (absl::string_view entry : absl::StrSplit(it->second, ',')) {
    std::vector<std::string> kv = absl::StrSplit(entry, absl::MaxSplits('=', 1));
    if (kv.size() != 2) return absl::InvalidArgumentError("malformed 'models' metadata");
    std::vector<std::string> id_rot = absl::StrSplit(kv[1], ':');
    if (id_rot.size() != 2) return absl::InvalidArgumentError("malformed 'models' metadata");
    models.push_back({kv[0], id_rot[0], id_rot[1] == "file"});
  }
  return models;
}

absl::Status Register(const KvpoolClient& c, const ReplayModel& m, const std::string& rotation,
                      int layers, int hq, int hkv, int dim) {
  v1::ModelSpec spec;
  spec.set_model_id(m.model_id);
  spec.mutable_shape()->set_q_heads(hq);
  spec.mutable_shape()->set_kv_heads(hkv);
  if (m.rotation_file) {
    KVPOOL_ASSIGN_OR_RETURN(std::string bytes, ReadRegularFile(rotation, 64 << 20));
    return c.RegisterModel(spec, bytes).status();
  }
  spec.mutable_shape()->set_num_layers(layers);
  spec.mutable_shape()->set_head_dim(dim);
  spec.mutable_data_free()->set_kind(v1::ROTATION_KIND_HADAMARD);
  return c.RegisterModel(spec).status();
}

// How far one daemon's Attend answers are from another's (or the capture's).
struct Difference {
  double max_abs = 0;    // largest |out - ref|
  double worst_out = 0;  // largest |out - ref| over the call's scale (largest |ref|, at least 1)
  double max_lse = 0;    // largest |lse - ref|
  double worst_lse = 0;  // the same relative to max(1, |ref|)
  double err2 = 0, ref2 = 0;

  // One call: `out`/`ref` of `n` values, `lse`/`ref_lse` of `heads`. Returns the call's max |d|.
  double Add(const float* out, const float* ref, size_t n, const float* lse, const float* ref_lse,
             int heads) {
    for (int h = 0; h < heads; ++h) {
      const double d = std::fabs(double{lse[h]} - ref_lse[h]);
      max_lse = std::max(max_lse, d);
      worst_lse = std::max(worst_lse, d / std::max(1.0, std::fabs(double{ref_lse[h]})));
    }
    double call_abs = 0, scale = 1;
    for (size_t i = 0; i < n; ++i) {
      const double d = double{out[i]} - ref[i];
      call_abs = std::max(call_abs, std::fabs(d));
      scale = std::max(scale, std::fabs(double{ref[i]}));
      err2 += d * d;
      ref2 += double{ref[i]} * ref[i];
    }
    max_abs = std::max(max_abs, call_abs);
    worst_out = std::max(worst_out, call_abs / scale);
    return call_abs;
  }
  double RelativeL2() const { return std::sqrt(err2 / std::max(ref2, 1e-30)); }
};

// Stored bytes of one sequence in two daemons (ReadBlocks of every layer): whole INT2 history
// blocks that differ, and BF16 elements of the sink and recent tiers that differ.
struct StorageDifference {
  int64_t blocks = 0, blocks_differing = 0, bf16 = 0, bf16_differing = 0;
  bool identical() const { return blocks_differing == 0 && bf16_differing == 0; }
};

void CountBf16(const std::string& a, const std::string& b, StorageDifference* d) {
  const size_t n = std::min(a.size(), b.size()) / 2;
  d->bf16 += static_cast<int64_t>(std::max(a.size(), b.size()) / 2);
  d->bf16_differing += static_cast<int64_t>((std::max(a.size(), b.size()) - 2 * n) / 2);
  for (size_t i = 0; i < n; ++i) {
    d->bf16_differing += std::memcmp(a.data() + 2 * i, b.data() + 2 * i, 2) != 0;
  }
}

absl::StatusOr<StorageDifference> CompareStorage(const client::BlocksRead& x,
                                                 const client::BlocksRead& y) {
  if (x.header.sink_tokens() != y.header.sink_tokens() ||
      x.header.history_tokens() != y.header.history_tokens() ||
      x.header.recent_tokens() != y.header.recent_tokens() || x.layers.size() != y.layers.size()) {
    return absl::FailedPreconditionError("the two daemons split the sequence into other tiers");
  }
  const int block_tokens = x.header.block_layout().tokens();
  StorageDifference d;
  for (size_t l = 0; l < x.layers.size(); ++l) {
    const client::LayerBlocks& p = x.layers[l];
    const client::LayerBlocks& q = y.layers[l];
    if (p.blocks.size() != q.blocks.size()) {
      return absl::FailedPreconditionError("the two daemons hold other block counts");
    }
    for (size_t i = 0; i < p.blocks.size(); ++i) {
      // Slots past a partial block's valid tokens are unspecified: whole blocks only.
      if (static_cast<int>(p.blocks[i].valid_tokens()) != block_tokens) continue;
      ++d.blocks;
      d.blocks_differing += p.blocks[i].data() != q.blocks[i].data();
    }
    CountBf16(p.sink_k, q.sink_k, &d);
    CountBf16(p.sink_v, q.sink_v, &d);
    CountBf16(p.recent_k, q.recent_k, &d);
    CountBf16(p.recent_v, q.recent_v, &d);
  }
  return d;
}

absl::StatusOr<client::BlocksRead> ReadStored(const KvpoolClient& c, const std::string& seq) {
  v1::ReadBlocksRequest request;
  request.set_sequence_id(seq);
  return c.ReadBlocks(request);
}

// The CPU kernels' attention (kernels/attention.h) of one layer's queries `q` ([Hq][D], original
// basis) over the bytes a daemon stored for the layer, answered in the original basis: what that
// daemon's Attend must return to float rounding, whatever codes it wrote.
absl::StatusOr<AttentionOutput> AttendStored(const client::ModelDescription& model,
                                             const RowCodec& codec,
                                             const v1::ReadBlocksHeader& header,
                                             const client::LayerBlocks& stored,
                                             absl::Span<const float> q) {
  const v1::ModelShape& ms = model.info.shape();
  const AttentionShape shape{static_cast<int>(ms.q_heads()), static_cast<int>(ms.kv_heads()),
                             static_cast<int>(ms.head_dim())};
  const int d = shape.head_dim;
  if (stored.layer < 0 || stored.layer >= static_cast<int>(model.rotation.size())) {
    return absl::InvalidArgumentError("no rotation for the layer");
  }
  const v1::RotationLayer& rot = model.rotation[stored.layer];
  const size_t matrix_bytes = static_cast<size_t>(d) * d * sizeof(float);
  if (rot.k_matrix().size() != matrix_bytes || rot.v_matrix().size() != matrix_bytes) {
    return absl::InvalidArgumentError("rotation matrices of the wrong size");
  }
  std::vector<float> mk(static_cast<size_t>(d) * d), mv(mk.size());
  std::memcpy(mk.data(), rot.k_matrix().data(), matrix_bytes);
  std::memcpy(mv.data(), rot.v_matrix().data(), matrix_bytes);
  // q' = q M_K, in float64.
  std::vector<float> qr(q.size());
  for (int h = 0; h < shape.q_heads; ++h) {
    for (int j = 0; j < d; ++j) {
      double acc = 0;
      for (int i = 0; i < d; ++i) acc += double{q[h * d + i]} * mk[static_cast<size_t>(i) * d + j];
      qr[h * d + j] = static_cast<float>(acc);
    }
  }
  const BlockLayout layout = BlockLayout::ForModel(codec.config(), shape.kv_heads, d);
  std::vector<const uint8_t*> blocks;
  for (const v1::KvBlock& b : stored.blocks) {
    if (b.data().size() != layout.block_bytes()) {
      return absl::InvalidArgumentError("a stored block of the wrong size");
    }
    blocks.push_back(reinterpret_cast<const uint8_t*>(b.data().data()));
  }
  const int history = static_cast<int>(header.history_tokens());
  if (static_cast<int64_t>(blocks.size()) * layout.tokens < history) {
    return absl::InvalidArgumentError("fewer stored blocks than history tokens");
  }
  AttentionOutput acc = AttendBlocks(shape, codec, layout, blocks, history, qr);
  const size_t row = static_cast<size_t>(shape.kv_heads) * d;
  auto bf16_part = [&](const std::string& k, const std::string& v, uint32_t n) {
    const Bf16* kp = reinterpret_cast<const Bf16*>(k.data());
    const Bf16* vp = reinterpret_cast<const Bf16*>(v.data());
    return AttendBf16Rows(shape, qr, {kp, n * row}, {vp, n * row}, static_cast<int>(n));
  };
  if (stored.sink_k.size() != header.sink_tokens() * row * 2 ||
      stored.recent_k.size() != header.recent_tokens() * row * 2 ||
      stored.sink_v.size() != stored.sink_k.size() ||
      stored.recent_v.size() != stored.recent_k.size()) {
    return absl::InvalidArgumentError("BF16 tiers of the wrong size");
  }
  MergeAttention(shape, bf16_part(stored.sink_k, stored.sink_v, header.sink_tokens()), &acc);
  MergeAttention(shape, bf16_part(stored.recent_k, stored.recent_v, header.recent_tokens()), &acc);
  // o = o' M_V^T.
  std::vector<float> out(acc.out.size());
  for (int h = 0; h < shape.q_heads; ++h) {
    for (int i = 0; i < d; ++i) {
      double sum = 0;
      for (int j = 0; j < d; ++j) {
        sum += double{acc.out[h * d + j]} * mv[static_cast<size_t>(i) * d + j];
      }
      out[h * d + i] = static_cast<float>(sum);
    }
  }
  acc.out = std::move(out);
  return acc;
}

struct ReplayDaemon {
  std::string device;
  std::unique_ptr<client::LocalDaemon> process;
  std::unique_ptr<KvpoolClient> client;
};

absl::StatusOr<ReplayDaemon> StartReplayDaemon(const std::string& kvpoold,
                                               const std::string& device) {
  ReplayDaemon d;
  d.device = device;
  client::LocalDaemonOptions dopt;
  dopt.binary = kvpoold;
  dopt.flags = {"--pool_bytes=1073741824", "--worker_threads=2", "--device=" + device};
  KVPOOL_ASSIGN_OR_RETURN(d.process, client::LocalDaemon::Start(dopt));
  KVPOOL_ASSIGN_OR_RETURN(d.client, KvpoolClient::Connect(d.process->target()));
  KVPOOL_RETURN_IF_ERROR(d.client->FitToServerLimits());
  return d;
}

void PrintDifference(const char* what, const Difference& d) {
  std::printf(
      "  %s: max |out| diff %.3e (%.3e of the call's scale), relative L2 %.3e; "
      "max |LSE| diff %.3e (%.3e relative)\n",
      what, d.max_abs, d.worst_out, d.RelativeL2(), d.max_lse, d.worst_lse);
}

absl::Status Run(const Options& opt) {
  double out_tol = 0, lse_tol = 0;
  if (!absl::SimpleAtod(opt.out_tol, &out_tol) || !absl::SimpleAtod(opt.lse_tol, &lse_tol)) {
    return absl::InvalidArgumentError("bad --out_tol or --lse_tol");
  }
  KVPOOL_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::ReadFile(opt.capture));
  KVPOOL_ASSIGN_OR_RETURN(std::vector<ReplayModel> models, ParseModels(f));
  const SafetensorsTensor* k = f.Find("k");
  const SafetensorsTensor* q0 = f.Find(models.at(0).key + ".q");
  if (k == nullptr || k->shape.size() != 4 || q0 == nullptr || q0->shape.size() != 4) {
    return absl::InvalidArgumentError("capture lacks k [layers, T, Hkv, D] or m0.q");
  }
  const int layers = static_cast<int>(k->shape[0]), tokens = static_cast<int>(k->shape[1]);
  const int hkv = static_cast<int>(k->shape[2]), dim = static_cast<int>(k->shape[3]);
  const int hq = static_cast<int>(q0->shape[2]);
  const int64_t kv_elems = int64_t{layers} * tokens * hkv * dim;
  KVPOOL_ASSIGN_OR_RETURN(absl::string_view k_raw,
                          RawTensor(f, "k", SafetensorsDtype::kBF16, kv_elems));
  KVPOOL_ASSIGN_OR_RETURN(absl::string_view v_raw,
                          RawTensor(f, "v", SafetensorsDtype::kBF16, kv_elems));
  KVPOOL_ASSIGN_OR_RETURN(absl::string_view ids_raw,
                          RawTensor(f, "token_ids", SafetensorsDtype::kI32, tokens));

  // daemons[0] is the one under test, daemons[1] (when asked for) the live reference.
  std::vector<ReplayDaemon> daemons;
  KVPOOL_ASSIGN_OR_RETURN(ReplayDaemon tested, StartReplayDaemon(opt.kvpoold, opt.device));
  daemons.push_back(std::move(tested));
  if (!opt.reference_device.empty()) {
    KVPOOL_ASSIGN_OR_RETURN(ReplayDaemon reference,
                            StartReplayDaemon(opt.kvpoold, opt.reference_device));
    daemons.push_back(std::move(reference));
  }
  const bool live = daemons.size() == 2;
  std::printf("kvpoold --device=%s%s; capture %s: %d prompt tokens, %zu models\n",
              opt.device.c_str(),
              live ? absl::StrCat(" beside --device=", opt.reference_device).c_str() : "",
              opt.capture.c_str(), tokens, models.size());

  SafetensorsWriter writer;
  bool within = true;
  const size_t row = static_cast<size_t>(hkv) * dim * 2;  // one token, one layer, BF16
  for (const ReplayModel& m : models) {
    const std::string seq = m.model_id + ".replay";
    v1::AppendKvHeader header;
    header.set_sequence_id(seq);
    header.set_num_tokens(tokens);
    header.set_dtype(v1::DTYPE_BF16);
    header.set_end_of_prefill(true);
    const int32_t* ids = reinterpret_cast<const int32_t*>(ids_raw.data());
    for (int t = 0; t < tokens; ++t) header.add_token_ids(static_cast<uint32_t>(ids[t]));
    std::vector<client::LayerKv> prompt(layers);
    for (int l = 0; l < layers; ++l) {
      prompt[l].layer = l;
      prompt[l].k = k_raw.substr(l * tokens * row, tokens * row);
      prompt[l].v = v_raw.substr(l * tokens * row, tokens * row);
    }
    for (const ReplayDaemon& d : daemons) {
      KVPOOL_RETURN_IF_ERROR(Register(*d.client, m, opt.rotation, layers, hq, hkv, dim));
      KVPOOL_RETURN_IF_ERROR(d.client->CreateSequence(m.model_id, seq).status());
      KVPOOL_RETURN_IF_ERROR(d.client->AppendKv(header, prompt).status());
    }
    std::printf("\n%s (%s):\n", m.model_id.c_str(),
                m.rotation_file ? "rotation file" : "data-free");
    KVPOOL_ASSIGN_OR_RETURN(client::BlocksRead stored, ReadStored(*daemons[0].client, seq));
    bool same_storage = false;
    if (live) {
      KVPOOL_ASSIGN_OR_RETURN(client::BlocksRead reference_stored,
                              ReadStored(*daemons[1].client, seq));
      KVPOOL_ASSIGN_OR_RETURN(StorageDifference sd, CompareStorage(stored, reference_stored));
      same_storage = sd.identical();
      std::printf(
          "  stored after the prompt, %s vs %s: %lld of %lld whole INT2 blocks differ, "
          "%lld of %lld BF16 elements (%.3f %%)\n",
          opt.device.c_str(), opt.reference_device.c_str(),
          static_cast<long long>(sd.blocks_differing), static_cast<long long>(sd.blocks),
          static_cast<long long>(sd.bf16_differing), static_cast<long long>(sd.bf16),
          100.0 * sd.bf16_differing / std::max<int64_t>(sd.bf16, 1));
    }

    const SafetensorsTensor* q = f.Find(m.key + ".q");
    if (q == nullptr || q->shape.size() != 4) return absl::InvalidArgumentError("bad .q");
    const int steps = static_cast<int>(q->shape[0]);
    const int64_t q_elems = int64_t{steps} * layers * hq * dim;
    KVPOOL_ASSIGN_OR_RETURN(std::vector<float> qs, f.ReadFloat32(m.key + ".q"));
    KVPOOL_ASSIGN_OR_RETURN(std::vector<float> captured, f.ReadFloat32(m.key + ".out"));
    KVPOOL_ASSIGN_OR_RETURN(std::vector<float> captured_lse, f.ReadFloat32(m.key + ".lse"));
    KVPOOL_ASSIGN_OR_RETURN(std::vector<float> margins, f.ReadFloat32(m.key + ".margins"));
    const int64_t step_kv = int64_t{steps} * layers * hkv * dim;
    KVPOOL_ASSIGN_OR_RETURN(absl::string_view dk,
                            RawTensor(f, m.key + ".k", SafetensorsDtype::kBF16, step_kv));
    KVPOOL_ASSIGN_OR_RETURN(absl::string_view dv,
                            RawTensor(f, m.key + ".v", SafetensorsDtype::kBF16, step_kv));
    KVPOOL_ASSIGN_OR_RETURN(absl::string_view tok_raw,
                            RawTensor(f, m.key + ".tokens", SafetensorsDtype::kI32, steps + 1));
    const int32_t* tok = reinterpret_cast<const int32_t*>(tok_raw.data());
    if (static_cast<int64_t>(qs.size()) != q_elems || captured.size() != qs.size() ||
        static_cast<int>(margins.size()) < steps + 1 ||
        static_cast<int64_t>(captured_lse.size()) != int64_t{steps} * layers * hq) {
      return absl::InvalidArgumentError(m.key + ": tensors disagree in shape");
    }
    // outs[i], lses[i]: daemons[i]'s answers.
    std::vector<std::vector<float>> outs(daemons.size(), std::vector<float>(qs.size()));
    std::vector<std::vector<float>> lses(daemons.size(), std::vector<float>(captured_lse.size()));
    const std::vector<float>& ref = live ? outs[1] : captured;
    const std::vector<float>& ref_lse = live ? lses[1] : captured_lse;
    const size_t q_layer = static_cast<size_t>(hq) * dim;
    Difference tested_vs_ref, reference_vs_capture;
    std::printf("  step  top-two margin (CPU run)  max |out - reference|\n");
    for (int s = 0; s < steps; ++s) {
      double step_abs = 0;
      for (int l = 0; l < layers; ++l) {
        const size_t at = (static_cast<size_t>(s) * layers + l) * q_layer;
        const size_t lse_at = (static_cast<size_t>(s) * layers + l) * hq;
        v1::AttendRequest request;
        request.set_model_id(m.model_id);
        request.set_layer(l);
        request.set_dtype(v1::DTYPE_FP32);
        v1::SequenceQuery* sq = request.add_queries();
        sq->set_sequence_id(seq);
        sq->set_num_queries(1);
        sq->set_q(reinterpret_cast<const char*>(qs.data() + at), q_layer * sizeof(float));
        for (size_t i = 0; i < daemons.size(); ++i) {
          KVPOOL_ASSIGN_OR_RETURN(v1::AttendResponse r, daemons[i].client->Attend(request));
          const v1::SequenceAttention& a = r.results(0);
          if (a.out().size() != q_layer * sizeof(float) || a.lse_size() != hq) {
            return absl::InternalError("Attend answered the wrong shape");
          }
          std::memcpy(outs[i].data() + at, a.out().data(), a.out().size());
          for (int h = 0; h < hq; ++h) lses[i][lse_at + h] = a.lse(h);
        }
        step_abs = std::max(
            step_abs, tested_vs_ref.Add(outs[0].data() + at, ref.data() + at, q_layer,
                                        lses[0].data() + lse_at, ref_lse.data() + lse_at, hq));
        if (live) {
          reference_vs_capture.Add(outs[1].data() + at, captured.data() + at, q_layer,
                                   lses[1].data() + lse_at, captured_lse.data() + lse_at, hq);
        }
      }
      std::printf("  %4d  %24.4f  %21.3e\n", s + 1, margins[s + 1], step_abs);
      v1::AppendDecodeRequest append;
      append.set_sequence_id(seq);
      append.set_token_start(static_cast<uint32_t>(tokens + s));
      append.set_num_tokens(1);
      append.set_dtype(v1::DTYPE_BF16);
      const size_t step_bytes = static_cast<size_t>(layers) * row;
      append.set_k(std::string(dk.substr(s * step_bytes, step_bytes)));
      append.set_v(std::string(dv.substr(s * step_bytes, step_bytes)));
      append.add_token_ids(static_cast<uint32_t>(tok[s]));
      for (const ReplayDaemon& d : daemons) {
        KVPOOL_RETURN_IF_ERROR(d.client->AppendDecode(append).status());
      }
    }
    // Step 1 attended exactly what ReadBlocks returned after the prompt.
    KVPOOL_ASSIGN_OR_RETURN(client::ModelDescription described,
                            daemons[0].client->DescribeModel(m.model_id, true));
    KVPOOL_ASSIGN_OR_RETURN(QuantConfig quant, server::QuantFromProto(described.info.quant()));
    KVPOOL_ASSIGN_OR_RETURN(RowCodec codec, RowCodec::Create(quant, dim));
    Difference tested_vs_own;
    for (const client::LayerBlocks& layer : stored.layers) {
      const size_t at = static_cast<size_t>(layer.layer) * q_layer;
      KVPOOL_ASSIGN_OR_RETURN(AttentionOutput expected,
                              AttendStored(described, codec, stored.header, layer,
                                           absl::MakeConstSpan(qs.data() + at, q_layer)));
      tested_vs_own.Add(outs[0].data() + at, expected.out.data(), q_layer,
                        lses[0].data() + static_cast<size_t>(layer.layer) * hq, expected.lse.data(),
                        hq);
    }
    PrintDifference("step 1, tested vs the CPU kernels over its own stored bytes", tested_vs_own);
    if (live) PrintDifference("reference daemon vs the capture", reference_vs_capture);
    PrintDifference(live ? "tested vs reference daemon" : "tested vs the capture", tested_vs_ref);
    // The LSE bound holds where both daemons stored the same bytes (see the header comment).
    const bool lse_checked = !live || same_storage;
    const bool ok = tested_vs_ref.worst_out <= out_tol &&
                    (!lse_checked || tested_vs_ref.worst_lse <= lse_tol) &&
                    tested_vs_own.worst_out <= out_tol && tested_vs_own.worst_lse <= lse_tol;
    within &= ok;
    std::printf("  output tolerance %.0e of the call's scale; LSE tolerance %.0e relative %s: %s\n",
                out_tol, lse_tol,
                lse_checked ? "(checked)" : "(reported only: the stored bytes differ)",
                ok ? "PASS" : "FAIL");
    writer.AddFloat32(m.key + ".out", {steps, layers, hq, dim}, outs[0]);
    writer.AddFloat32(m.key + ".lse", {steps, layers, hq}, lses[0]);
  }
  writer.SetMetadata("device", opt.device);
  if (!opt.out.empty()) {
    KVPOOL_RETURN_IF_ERROR(writer.WriteFile(opt.out));
    std::printf("\nwrote the outputs to %s\n", opt.out.c_str());
  }
  for (ReplayDaemon& d : daemons) KVPOOL_RETURN_IF_ERROR(d.process->Stop());
  if (!within) {
    return absl::OutOfRangeError("outputs differ from the reference beyond the tolerances");
  }
  std::printf("all outputs within tolerance of the reference\n");
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvpool::bench

int main(int argc, char** argv) {
  kvpool::bench::Options opt;
  if (!kvpool::bench::ParseBenchArgs(
          argc, argv,
          {{"--kvpoold", &opt.kvpoold},
           {"--device", &opt.device},
           {"--reference_device", &opt.reference_device},
           {"--capture", &opt.capture},
           {"--rotation", &opt.rotation},
           {"--out", &opt.out},
           {"--out_tol", &opt.out_tol},
           {"--lse_tol", &opt.lse_tol}},
          {},
          "--kvpoold PATH --capture replay.safetensors --rotation ROT.safetensors "
          "[--device cuda:0] [--reference_device cpu|''] [--out FILE] [--out_tol 1e-2] [--lse_tol "
          "1e-4]") ||
      opt.kvpoold.empty() || opt.capture.empty() || opt.rotation.empty()) {
    return 2;
  }
  return kvpool::bench::ExitCode(kvpool::bench::Run(opt));
}
