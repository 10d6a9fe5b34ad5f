// kvpool-calibrate: fits a model's OSCAR rotations from Q/K/V captures and writes the rotation
// file kvpoold loads (kernels/rotation_file.h, dense kind, with calibration statistics).
//
//   kvpool-calibrate --captures=build/calibration/captures --out=smollm2.rotation.safetensors
//   kvpool-calibrate ... --key_target=ktk --value_target=vtv        # the K^T K / V^T V ablation
//   kvpool-calibrate ... --composition=u --fit_clip=false           # U only, clip 0.96 / 0.92
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "calibration/pipeline.h"
#include "common/status_macros.h"

ABSL_FLAG(std::string, captures, "", "folder of layer_NN.safetensors captures (capture.py)");
ABSL_FLAG(std::string, out, "", "rotation file to write");
ABSL_FLAG(std::string, model_id, "", "model id stored in the file (default: the captures')");
ABSL_FLAG(std::string, key_target, "qqt", "key target: qqt (query second moment) | ktk");
ABSL_FLAG(std::string, value_target, "sst", "value target: sst (logit-weighted) | vtv");
ABSL_FLAG(std::string, composition, "u_h_pbr", "u_h_pbr | u_h | u | u_pbr | h_pbr | hadamard");
ABSL_FLAG(std::string, quantizer, "uniform", "uniform | lloyd_max");
ABSL_FLAG(int, bits, 2, "code bits: 2 or 4");
ABSL_FLAG(std::string, scale_dtype, "fp16", "stored scale/min type: fp16 | bf16");
ABSL_FLAG(double, clip_k, 0.96, "K clip ratio (used when --fit_clip=false)");
ABSL_FLAG(double, clip_v, 0.92, "V clip ratio (used when --fit_clip=false)");
ABSL_FLAG(bool, fit_clip, true, "fit the K and V clip ratios on the calibration data");
ABSL_FLAG(double, clip_grid_min, 0.70, "smallest clip ratio the fit tries");
ABSL_FLAG(int, fit_queries, 256, "query positions per layer measured by the fit");
ABSL_FLAG(int, sink, 64, "BF16 sink tokens S0 (stored, and used by the fit)");
ABSL_FLAG(int, recent, 256, "BF16 recent tokens W (stored, and used by the fit)");
ABSL_FLAG(int, max_layers, 0, "fit only the first N layers (0: all)");
ABSL_FLAG(bool, quiet, false, "no progress lines");

namespace kvpool::calibration {
namespace {

absl::Status Run() {
  CalibrateOptions opt;
  opt.captures_dir = absl::GetFlag(FLAGS_captures);
  const std::string out = absl::GetFlag(FLAGS_out);
  if (opt.captures_dir.empty() || out.empty()) {
    return absl::InvalidArgumentError("--captures and --out are required");
  }
  opt.model_id = absl::GetFlag(FLAGS_model_id);
  KVPOOL_ASSIGN_OR_RETURN(opt.key_target, ParseKeyTarget(absl::GetFlag(FLAGS_key_target)));
  KVPOOL_ASSIGN_OR_RETURN(opt.value_target, ParseValueTarget(absl::GetFlag(FLAGS_value_target)));
  KVPOOL_ASSIGN_OR_RETURN(opt.composition, ParseComposition(absl::GetFlag(FLAGS_composition)));
  KVPOOL_ASSIGN_OR_RETURN(opt.quant.method, ParseQuantMethod(absl::GetFlag(FLAGS_quantizer)));
  KVPOOL_ASSIGN_OR_RETURN(opt.quant.scale_dtype, ParseScaleDtype(absl::GetFlag(FLAGS_scale_dtype)));
  opt.quant.bits = absl::GetFlag(FLAGS_bits);
  opt.quant.group_size = 0;
  opt.quant.clip_ratio_k = static_cast<float>(absl::GetFlag(FLAGS_clip_k));
  opt.quant.clip_ratio_v = static_cast<float>(absl::GetFlag(FLAGS_clip_v));
  opt.quant.sink_tokens = absl::GetFlag(FLAGS_sink);
  opt.quant.recent_tokens = absl::GetFlag(FLAGS_recent);
  opt.fit_clip = absl::GetFlag(FLAGS_fit_clip);
  opt.clip_grid_min = absl::GetFlag(FLAGS_clip_grid_min);
  opt.fit_queries = absl::GetFlag(FLAGS_fit_queries);
  opt.max_layers = absl::GetFlag(FLAGS_max_layers);
  const absl::Time start = absl::Now();
  if (!absl::GetFlag(FLAGS_quiet)) {
    opt.log = [start](const std::string& line) {
      std::fprintf(stderr, "[%6.1f s] %s\n", absl::ToDoubleSeconds(absl::Now() - start),
                   line.c_str());
    };
  }
  KVPOOL_ASSIGN_OR_RETURN(CalibrationResult result, RunCalibration(opt));
  KVPOOL_RETURN_IF_ERROR(WriteCalibrationFile(result, out));
  std::printf("%s", FormatReport(result).c_str());
  std::printf("wrote %s (%.1f s)\n", out.c_str(), absl::ToDoubleSeconds(absl::Now() - start));
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvpool::calibration

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Fits OSCAR rotations from captures and writes a kvpool rotation file.");
  absl::ParseCommandLine(argc, argv);
  const absl::Status s = kvpool::calibration::Run();
  if (!s.ok()) {
    std::fprintf(stderr, "kvpool-calibrate: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
