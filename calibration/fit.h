// The OSCAR rotation fit (docs/oscar-method.md sections 2-3): calibration captures in, per-layer
// rotations M_K, M_V out, plus an offline fit of the clip ratios and per-layer statistics.
//
// Captures are safetensors files written by calibration/capture.py, one per layer, with BF16
// q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D] (Q and K after RoPE) and I64 seq_offsets [S + 1].
// All target matrices are uncentered second moments accumulated in float64:
//
//   key target   (qqt)  C_K = (1/Hkv) sum_h Q_h^T Q_h / (g N)        (GQA: Q_h = the g query
//                                                                     heads of KV head h)
//   value target (sst)  C_V = (1/Hkv) sum_h (1/N) sum_t w^_t v_t^T v_t,  w_t = k_t^T A_h k_t,
//                       A_h = Q_h^T Q_h / (g N), w^ = N w / sum w     (the reference's form)
//   ablations    (ktk)  C_K = (1/Hkv) sum_h K_h^T K_h / N;  (vtv) likewise with V
//
// A rotation is composed from the target's eigenvectors U (ascending eigenvalues, float64
// SelfAdjointEigenSolver, each column's sign fixed so that its largest-magnitude entry is
// positive), the orthonormal Sylvester Hadamard H and the bit-reversal permutation P_br
// (P_br[sigma(i), rev(i)] = 1, sigma = eigen-indices by decreasing eigenvalue):
//
//   u_h_pbr: M = U H P_br (default)   u_h: U H   u: U   u_pbr: U P_br   h_pbr: H P_br   hadamard: H
//
//   KVPOOL_ASSIGN_OR_RETURN(LayerCapture cap, ReadLayerCapture("captures/layer_00.safetensors"));
//   std::vector<double> c_k = KeyTargetMatrix(cap, KeyTarget::kQueryMoment);
//   KVPOOL_ASSIGN_OR_RETURN(SpectralRotation r, BuildRotation(c_k, cap.head_dim,
//                                                             Composition::kUHPbr));
//
// Everything here is deterministic (fixed summation order, single-threaded) and thread-compatible.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/codec_config.h"
#include "kernels/rotation.h"

namespace kvpool::calibration {

// One layer's captured activations (fp32 copies of the BF16 capture).
struct LayerCapture {
  std::string model_id;
  int layer = 0;
  int num_layers = 0;
  int tokens = 0;  // N
  int q_heads = 0;
  int kv_heads = 0;
  int head_dim = 0;
  std::vector<float> q;              // [N][Hq][D]
  std::vector<float> k;              // [N][Hkv][D]
  std::vector<float> v;              // [N][Hkv][D]
  std::vector<int64_t> seq_offsets;  // S + 1 offsets: sequence s is [off[s], off[s+1])
};

// Reads and validates one capture file. InvalidArgument on missing tensors, inconsistent
// shapes or metadata, non-finite values or bad sequence offsets.
absl::StatusOr<LayerCapture> ReadLayerCapture(const std::string& path);

// The capture files of a folder (layer_00.safetensors, layer_01.safetensors, ...) in layer
// order. NotFound when there is none, InvalidArgument when the layer numbers have a gap.
absl::StatusOr<std::vector<std::string>> ListCaptureFiles(const std::string& dir);

enum class KeyTarget { kQueryMoment, kKeyMoment };        // "qqt", "ktk"
enum class ValueTarget { kLogitWeighted, kValueMoment };  // "sst", "vtv"
enum class Composition { kUHPbr, kUH, kU, kUPbr, kHPbr, kHadamard };

absl::StatusOr<KeyTarget> ParseKeyTarget(absl::string_view name);
absl::StatusOr<ValueTarget> ParseValueTarget(absl::string_view name);
absl::StatusOr<Composition> ParseComposition(absl::string_view name);
absl::string_view KeyTargetName(KeyTarget t);
absl::string_view ValueTargetName(ValueTarget t);
absl::string_view CompositionName(Composition c);
// The reference's objective label for a target and composition, e.g. "qqt_r_h_pbr";
// "hadamard" for the data-free composition.
std::string ObjectiveLabel(absl::string_view target, Composition c);

// D x D target matrices (row-major, symmetrized as (C + C^T) / 2) in float64.
std::vector<double> KeyTargetMatrix(const LayerCapture& cap, KeyTarget target);
std::vector<double> ValueTargetMatrix(const LayerCapture& cap, ValueTarget target);

// The orthonormal Sylvester Hadamard matrix, H[i][j] = (-1)^popcount(i & j) / sqrt(D).
std::vector<double> HadamardMatrix(int dim);
// Reverses the low `bits` bits of i.
int BitReverse(int i, int bits);
// sigma: eigen-indices by decreasing eigenvalue (ties keep the lower index first).
std::vector<int> DescendingOrder(absl::Span<const double> eigenvalues);
// X P_br for a D x D row-major X: column rev(i) of the result is column sigma(i) of X.
std::vector<double> ApplyBitReversal(absl::Span<const double> x, absl::Span<const int> sigma,
                                     int dim);
// max |M M^T - I| of a D x D row-major matrix.
double OrthogonalityError(absl::Span<const double> m, int dim);
double OrthogonalityError(absl::Span<const float> m, int dim);

struct SpectralRotation {
  std::vector<double> eigenvalues;   // ascending (all ones for the data-free compositions)
  std::vector<double> eigenvectors;  // D x D row-major; column i belongs to eigenvalues[i]
  std::vector<double> matrix;        // M, D x D row-major, applied as x * M
};

// Eigendecomposes `target` (D x D, symmetric) and composes the rotation. The data-free
// compositions ignore the target. InvalidArgument on a bad size or non-finite input;
// Internal when the eigensolver fails.
absl::StatusOr<SpectralRotation> BuildRotation(absl::Span<const double> target, int dim,
                                               Composition composition);

// --- clip-ratio fit and calibration statistics --------------------------------------------------

// The mixed-precision view used to measure attention-output error on calibration data: query
// t of a sequence reads BF16 K/V for its first `sink_tokens` tokens and its `recent_tokens`
// most recent ones (itself included) and codec round-tripped K/V for the rest; only queries
// with some quantized keys (local index >= sink + recent) are measured, at most
// `max_queries` of them, evenly spaced over the capture.
struct ErrorOptions {
  int sink_tokens = 64;
  int recent_tokens = 256;
  int max_queries = 256;
};

struct LayerQuantStats {
  double k_clip_rate = 0;  // fraction of rotated K elements with |x| > tau
  double v_clip_rate = 0;
  double k_rel_error = 0;  // sum ||k^ - k||^2 / sum ||k||^2 over rotated BF16 rows
  double v_rel_error = 0;
  double attn_out_rel_error = 0;  // sum ||o^ - o||^2 / sum ||o||^2, K and V quantized
};

// One layer's rotated calibration data, ready to be quantized with many configurations.
class LayerEvaluator {
 public:
  // Rotates the capture with `rotations` (layer `cap.layer`): K and V on the normative BF16
  // arrival path, Q in fp32. InvalidArgument when shapes disagree or no query qualifies.
  static absl::StatusOr<std::unique_ptr<LayerEvaluator>> Create(const LayerCapture& cap,
                                                                const RotationSet& rotations,
                                                                const ErrorOptions& options);
  ~LayerEvaluator();

  int measured_queries() const;

  // Relative attention-output error with K and/or V passed through the codec of `quant`.
  absl::StatusOr<double> OutputError(const QuantConfig& quant, bool quantize_k,
                                     bool quantize_v) const;
  // All statistics for `quant`.
  absl::StatusOr<LayerQuantStats> Stats(const QuantConfig& quant) const;

 private:
  struct Impl;
  explicit LayerEvaluator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The candidate clip ratios c / D for c = ceil(min_ratio * D) .. D - 1 (c = D - 1 clips
// nothing); exact in float, so the codec's floor(r * D) gives back c.
std::vector<float> ClipRatioGrid(int head_dim, double min_ratio);

}  // namespace kvpool::calibration
