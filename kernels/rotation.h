// Per-model rotation sets: the orthogonal matrices M_K, M_V applied as x_rot = x * M.
//
// A RotationSet holds, per layer, a K and a V rotation of D x D, either dense float32 matrices
// (calibrated OSCAR rotations) or a data-free kind:
//   identity              M = I
//   hadamard              M = H, the Sylvester-ordered orthonormal Walsh-Hadamard matrix,
//                         H[i][j] = (-1)^popcount(i & j) / sqrt(D)
//   randomized_hadamard   M = diag(s) * H, s a +-1 sign vector per (layer, tensor) derived from
//                         a stored 64-bit seed with SplitMix64 (see RandomizedHadamardSigns)
// D is a power of two from 32 to 256. Dense matrices must be orthogonal (checked on load). A dense
// product accumulates each output value in fp32 with fused multiply-adds over k = 0..D-1 in
// order, starting from +0, on every path (Rotate, Unrotate, RotateBf16 before its rounding), so
// the paths agree bit for bit and no split of the rows changes a result.
//
//   auto set = RotationSet::Hadamard(/*num_layers=*/30, /*head_dim=*/64);
//   set->Rotate(layer, KvTensor::kKey, rows_in, rows_out);        // rows x D, row-major
//   set->Unrotate(layer, KvTensor::kValue, rows_in, rows_out);    // x * M^T
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/bf16.h"
#include "kernels/codec_config.h"

namespace kvpool {

enum class RotationKind : uint8_t {
  kIdentity = 0,
  kHadamard = 1,
  kRandomizedHadamard = 2,
  kDense = 3,
};

absl::string_view RotationKindName(RotationKind k);  // "identity", "hadamard", ...
absl::StatusOr<RotationKind> ParseRotationKind(absl::string_view name);

// The +-1 signs of a randomized Hadamard rotation for (seed, layer, tensor): element i is -1
// when bit (i % 64) of SplitMix64 output number (i / 64) is set, the generator seeded with
// seed ^ (0x9E3779B97F4A7C15 * (2 * layer + tensor + 1)).
std::vector<float> RandomizedHadamardSigns(uint64_t seed, int layer, KvTensor t, int head_dim);

// Immutable after construction; all methods are thread-safe.
class RotationSet {
 public:
  static absl::StatusOr<RotationSet> Identity(int num_layers, int head_dim);
  static absl::StatusOr<RotationSet> Hadamard(int num_layers, int head_dim);
  static absl::StatusOr<RotationSet> RandomizedHadamard(int num_layers, int head_dim,
                                                        uint64_t seed);
  // `k` and `v` hold num_layers matrices each, D*D float32 row-major. InvalidArgument when a
  // shape is wrong, a value is not finite, or a matrix is not orthogonal to `tolerance`
  // (max |M M^T - I|).
  static absl::StatusOr<RotationSet> Dense(int num_layers, int head_dim,
                                           std::vector<std::vector<float>> k,
                                           std::vector<std::vector<float>> v,
                                           float tolerance = 1e-4f);

  RotationKind kind() const { return kind_; }
  int num_layers() const { return num_layers_; }
  int head_dim() const { return head_dim_; }
  uint64_t seed() const { return seed_; }

  // The effective D x D matrix (row-major) of (layer, tensor), materialized for any kind.
  std::vector<float> Matrix(int layer, KvTensor t) const;

  // out = in * M for `in.size() / D` rows (row-major). in and out may not alias.
  // Requires 0 <= layer < num_layers and sizes that are multiples of D (checked with a status).
  absl::Status Rotate(int layer, KvTensor t, absl::Span<const float> in,
                      absl::Span<float> out) const;
  // out = in * M^T (undoes Rotate).
  absl::Status Unrotate(int layer, KvTensor t, absl::Span<const float> in,
                        absl::Span<float> out) const;
  // BF16 rows in, rotated rows rounded to BF16 out (the normative arrival path).
  absl::Status RotateBf16(int layer, KvTensor t, absl::Span<const Bf16> in,
                          absl::Span<Bf16> out) const;

  // RotateBf16's kernel without its checks, for callers that tile the rows themselves (the
  // arrival encoder): rotates `rows` rows of finite values and rounds them to BF16. Each row's
  // result depends on that row alone, so any split of a call gives RotateBf16's bits. Requires
  // 0 <= layer < num_layers() and non-overlapping in/out; values that overflow are written as
  // Inf (RotateBf16 reports them). kBf16ChunkRows is a good number of rows per call.
  static constexpr size_t kBf16ChunkRows = 512;
  void RotateBf16Rows(int layer, KvTensor t, const Bf16* in, Bf16* out, size_t rows) const;

 private:
  RotationSet() = default;
  // Rotate (inverse = false) or Unrotate (inverse = true).
  absl::Status RotateFloat(int layer, KvTensor t, bool inverse, absl::Span<const float> in,
                           absl::Span<float> out) const;

  RotationKind kind_ = RotationKind::kIdentity;
  int num_layers_ = 0;
  int head_dim_ = 0;
  uint64_t seed_ = 0;
  // kDense: per layer, K then V, D*D each. kRandomizedHadamard: per layer, K then V signs.
  std::vector<std::vector<float>> k_;
  std::vector<std::vector<float>> v_;
  // kDense: the transposes M^T (for Unrotate), per layer.
  std::vector<std::vector<float>> kt_;
  std::vector<std::vector<float>> vt_;
};

}  // namespace kvpool
