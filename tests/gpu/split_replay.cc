// kvpool-split-replay: the SmolLM2 prefill/decode split (client/demo/smollm2_split) replayed
// against a kvpoold started here, typically --device=cuda:0 on the GPU machine, which has
// neither the model (too large to carry) nor the project venv. The capture (export_replay.py, from
// a CPU run) holds the prompt's K/V and, per registered model, every decode step's queries and
// appended K/V with the CPU daemon's Attend outputs and LSE. This tool registers the same models,
// pushes the prompt (AppendKv, end of prefill), then per step calls Attend for every layer and
// AppendDecode, exactly as the decode process did, and compares each output with the CPU
// daemon's.
//
//   kvpool-split-replay --kvpoold PATH --capture replay.safetensors --rotation ROT.safetensors
//       [--device cuda:0] [--out gpu_out.safetensors] [--out_tol 1e-2] [--lse_tol 1e-4]
//
// Prints per model the largest absolute and relative output difference, the LSE difference
// and, per step, the step's top-two logit margin from the CPU run beside the step's largest
// output difference (what a greedy token depends on: replay_tokens.py turns the written
// outputs into tokens on a machine with the model). Exit status 1 when an output differs by
// more than the tolerances (those of the integration suite on the GPU) or a call fails.
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
#include "kernels/safetensors.h"
#include "tests/bench/bench_report.h"

namespace kvpool::bench {
namespace {

namespace v1 = ::kvpool::v1;
using client::KvpoolClient;

struct Options {
  std::string kvpoold, device = "cpu", capture, rotation, out;
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

  client::LocalDaemonOptions dopt;
  dopt.binary = opt.kvpoold;
  dopt.flags = {"--pool_bytes=1073741824", "--worker_threads=2", "--device=" + opt.device};
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<client::LocalDaemon> daemon,
                          client::LocalDaemon::Start(dopt));
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<KvpoolClient> c, KvpoolClient::Connect(daemon->target()));
  KVPOOL_RETURN_IF_ERROR(c->FitToServerLimits());
  std::printf("kvpoold --device=%s; capture %s: %d prompt tokens, %zu models\n", opt.device.c_str(),
              opt.capture.c_str(), tokens, models.size());

  SafetensorsWriter writer;
  bool within = true;
  const size_t row = static_cast<size_t>(hkv) * dim * 2;  // one token, one layer, BF16
  for (const ReplayModel& m : models) {
    KVPOOL_RETURN_IF_ERROR(Register(*c, m, opt.rotation, layers, hq, hkv, dim));
    const std::string seq = m.model_id + ".replay";
    KVPOOL_RETURN_IF_ERROR(c->CreateSequence(m.model_id, seq).status());
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
    KVPOOL_RETURN_IF_ERROR(c->AppendKv(header, prompt).status());

    const SafetensorsTensor* q = f.Find(m.key + ".q");
    if (q == nullptr || q->shape.size() != 4) return absl::InvalidArgumentError("bad .q");
    const int steps = static_cast<int>(q->shape[0]);
    const int64_t q_elems = int64_t{steps} * layers * hq * dim;
    KVPOOL_ASSIGN_OR_RETURN(std::vector<float> qs, f.ReadFloat32(m.key + ".q"));
    KVPOOL_ASSIGN_OR_RETURN(std::vector<float> ref, f.ReadFloat32(m.key + ".out"));
    KVPOOL_ASSIGN_OR_RETURN(std::vector<float> ref_lse, f.ReadFloat32(m.key + ".lse"));
    KVPOOL_ASSIGN_OR_RETURN(std::vector<float> margins, f.ReadFloat32(m.key + ".margins"));
    const int64_t step_kv = int64_t{steps} * layers * hkv * dim;
    KVPOOL_ASSIGN_OR_RETURN(absl::string_view dk,
                            RawTensor(f, m.key + ".k", SafetensorsDtype::kBF16, step_kv));
    KVPOOL_ASSIGN_OR_RETURN(absl::string_view dv,
                            RawTensor(f, m.key + ".v", SafetensorsDtype::kBF16, step_kv));
    KVPOOL_ASSIGN_OR_RETURN(absl::string_view tok_raw,
                            RawTensor(f, m.key + ".tokens", SafetensorsDtype::kI32, steps + 1));
    const int32_t* tok = reinterpret_cast<const int32_t*>(tok_raw.data());
    if (static_cast<int64_t>(qs.size()) != q_elems || ref.size() != qs.size() ||
        static_cast<int>(margins.size()) < steps + 1 ||
        static_cast<int64_t>(ref_lse.size()) != int64_t{steps} * layers * hq) {
      return absl::InvalidArgumentError(m.key + ": tensors disagree in shape");
    }
    std::vector<float> out(qs.size()), lse(ref_lse.size());
    const size_t q_layer = static_cast<size_t>(hq) * dim;
    double max_abs = 0, max_lse = 0, worst_out = 0, worst_lse = 0, err2 = 0, ref2 = 0;
    std::printf("\n%s (%s): %d steps\n  step  top-two margin (CPU run)  max |out - CPU run|\n",
                m.model_id.c_str(), m.rotation_file ? "rotation file" : "data-free", steps);
    for (int s = 0; s < steps; ++s) {
      double step_abs = 0;
      for (int l = 0; l < layers; ++l) {
        const size_t at = (static_cast<size_t>(s) * layers + l) * q_layer;
        v1::AttendRequest request;
        request.set_model_id(m.model_id);
        request.set_layer(l);
        request.set_dtype(v1::DTYPE_FP32);
        v1::SequenceQuery* sq = request.add_queries();
        sq->set_sequence_id(seq);
        sq->set_num_queries(1);
        sq->set_q(reinterpret_cast<const char*>(qs.data() + at), q_layer * sizeof(float));
        KVPOOL_ASSIGN_OR_RETURN(v1::AttendResponse r, c->Attend(request));
        const v1::SequenceAttention& a = r.results(0);
        if (a.out().size() != q_layer * sizeof(float) || a.lse_size() != hq) {
          return absl::InternalError("Attend answered the wrong shape");
        }
        std::memcpy(out.data() + at, a.out().data(), a.out().size());
        for (int h = 0; h < hq; ++h) {
          const size_t i = (static_cast<size_t>(s) * layers + l) * hq + h;
          lse[i] = a.lse(h);
          const double d = std::fabs(double{lse[i]} - ref_lse[i]);
          max_lse = std::max(max_lse, d);
          worst_lse = std::max(worst_lse, d / std::max(1.0, std::fabs(double{ref_lse[i]})));
        }
        double call_abs = 0, scale = 1;
        for (size_t i = at; i < at + q_layer; ++i) {
          const double d = double{out[i]} - ref[i];
          call_abs = std::max(call_abs, std::fabs(d));
          scale = std::max(scale, std::fabs(double{ref[i]}));
          err2 += d * d;
          ref2 += double{ref[i]} * ref[i];
        }
        step_abs = std::max(step_abs, call_abs);
        worst_out = std::max(worst_out, call_abs / scale);
      }
      max_abs = std::max(max_abs, step_abs);
      std::printf("  %4d  %24.4f  %19.3e\n", s + 1, margins[s + 1], step_abs);
      v1::AppendDecodeRequest append;
      append.set_sequence_id(seq);
      append.set_token_start(static_cast<uint32_t>(tokens + s));
      append.set_num_tokens(1);
      append.set_dtype(v1::DTYPE_BF16);
      const size_t step_bytes = static_cast<size_t>(layers) * row;
      append.set_k(std::string(dk.substr(s * step_bytes, step_bytes)));
      append.set_v(std::string(dv.substr(s * step_bytes, step_bytes)));
      append.add_token_ids(static_cast<uint32_t>(tok[s]));
      KVPOOL_RETURN_IF_ERROR(c->AppendDecode(append).status());
    }
    const double rel = std::sqrt(err2 / std::max(ref2, 1e-30));
    const bool ok = worst_out <= out_tol && worst_lse <= lse_tol;
    within &= ok;
    std::printf(
        "  max |out - CPU| %.3e (%.3e of the call's scale, tolerance %.0e), relative L2 %.3e; "
        "max |LSE - CPU| %.3e (%.3e relative, tolerance %.0e): %s\n",
        max_abs, worst_out, out_tol, rel, max_lse, worst_lse, lse_tol, ok ? "PASS" : "FAIL");
    writer.AddFloat32(m.key + ".out", {steps, layers, hq, dim}, out);
    writer.AddFloat32(m.key + ".lse", {steps, layers, hq}, lse);
  }
  writer.SetMetadata("device", opt.device);
  if (!opt.out.empty()) {
    KVPOOL_RETURN_IF_ERROR(writer.WriteFile(opt.out));
    std::printf("\nwrote the outputs to %s\n", opt.out.c_str());
  }
  KVPOOL_RETURN_IF_ERROR(daemon->Stop());
  if (!within) {
    return absl::OutOfRangeError("outputs differ from the CPU daemon's beyond the tolerances");
  }
  std::printf("all outputs within tolerance of the CPU daemon's\n");
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
           {"--capture", &opt.capture},
           {"--rotation", &opt.rotation},
           {"--out", &opt.out},
           {"--out_tol", &opt.out_tol},
           {"--lse_tol", &opt.lse_tol}},
          {},
          "--kvpoold PATH --capture replay.safetensors --rotation ROT.safetensors "
          "[--device cuda:0] [--out FILE] [--out_tol 1e-2] [--lse_tol 1e-4]") ||
      opt.kvpoold.empty() || opt.capture.empty() || opt.rotation.empty()) {
    return 2;
  }
  return kvpool::bench::ExitCode(kvpool::bench::Run(opt));
}
