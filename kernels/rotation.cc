#include "kernels/rotation.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <utility>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// GCC 12 reports a false -Wmaybe-uninitialized inside Eigen's AVX-512 GEMM packing
// (gemm_pack_lhs transposes); the warning fires at instantiation, so it is silenced file-wide.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include "Eigen/Core"
#include "absl/strings/str_cat.h"

namespace kvpool {
namespace {

using RowMajorMatrixF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using RowMajorMatrixD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// rotation.h's own range (the same as codec_config's IsSupportedHeadDim, kept local so the
// rotation library does not depend on the quant config's implementation).
bool ValidHeadDim(int d) { return d >= 32 && d <= 256 && (d & (d - 1)) == 0; }

absl::Status CheckShape(int num_layers, int head_dim) {
  if (!ValidHeadDim(head_dim)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rotation: head_dim ", head_dim, " is not a power of two in [32, 256]"));
  }
  if (num_layers <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rotation: num_layers ", num_layers, " must be positive"));
  }
  return absl::OkStatus();
}

uint64_t SplitMix64Next(uint64_t& state) {
  state += 0x9E3779B97F4A7C15ull;
  uint64_t z = state;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// True when every value is finite (exponent bits not all ones). An integer OR-reduction, so
// the loop vectorizes without relaxing floating-point semantics.
bool AllFinite(const float* x, size_t n) {
  uint32_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &x[i], sizeof(u));
    bad |= static_cast<uint32_t>((u & 0x7f800000u) == 0x7f800000u);
  }
  return bad == 0;
}

// BF16 is the top half of fp32, so a 16-bit mask finds non-finite values without converting.
bool AllFiniteBf16(const Bf16* x, size_t n) {
  uint16_t bad = 0;
  for (size_t i = 0; i < n; ++i) bad |= static_cast<uint16_t>((x[i].bits & 0x7f80u) == 0x7f80u);
  return bad == 0;
}

// Eight floats in one SIMD register (AVX2, or the lower half of AVX-512), via the GCC/Clang
// vector extension so that the same code builds for every -march we ship.
typedef float Float8 __attribute__((vector_size(32)));
typedef uint32_t Uint32x8 __attribute__((vector_size(32)));
typedef uint16_t Uint16x8 __attribute__((vector_size(16)));

inline Float8 Load8(const float* p) {
  Float8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline Float8 Load8(const Bf16* p) {
  // BF16 is the upper half of an fp32: widen and shift.
  Uint16x8 h;
  std::memcpy(&h, p, sizeof(h));
  const Uint32x8 u = __builtin_convertvector(h, Uint32x8) << 16;
  Float8 f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline void Store8(Float8 v, float* p) { std::memcpy(p, &v, sizeof(v)); }
inline void Store8(Float8 v, Bf16* p) {
  // Bf16::FromFloat, eight lanes at once: round to nearest even, NaN kept quiet.
  Uint32x8 u;
  std::memcpy(&u, &v, sizeof(u));
  const Uint32x8 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const Uint32x8 quiet_nan = (u >> 16) | 0x40u;
  const Uint32x8 is_nan = (Uint32x8)((u & 0x7fffffffu) > 0x7f800000u);  // all-ones lanes
  const Uint32x8 bits = (quiet_nan & is_nan) | (rounded & ~is_nan);
  const Uint16x8 h = __builtin_convertvector(bits, Uint16x8);
  std::memcpy(static_cast<void*>(p), &h, sizeof(h));
}

// Fast Walsh-Hadamard transform (Sylvester order) of `rows` rows of `d` values:
//   out[r] = (FWHT(in[r] .* pre) / sqrt(d)) .* post
// where pre / post are optional +-1 sign vectors (nullptr = all ones). O(d log d) per row.
// The strides 1, 2, 4 run inside one 8-float register: with p the lane-swapped copy of v,
// the butterfly (a + b, a - b) is p + v * (+-1), exactly the same sums as the scalar form.
// Strides >= 8 are whole-register butterflies. BF16 is converted in the same pass.
template <typename In, typename Out>
void HadamardRows(const In* in, Out* out, size_t rows, int d, const float* pre, const float* post) {
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  alignas(32) float post_scale[256];  // d <= 256, checked at construction
  for (int j = 0; j < d; ++j) post_scale[j] = post != nullptr ? post[j] * scale : scale;
  const Float8 s1 = {1, -1, 1, -1, 1, -1, 1, -1};
  const Float8 s2 = {1, 1, -1, -1, 1, 1, -1, -1};
  const Float8 s4 = {1, 1, 1, 1, -1, -1, -1, -1};
  alignas(32) float y[256];
  for (size_t r = 0; r < rows; ++r) {
    const In* x = in + r * d;
    for (int i = 0; i < d; i += 8) {
      Float8 v = Load8(x + i);
      if (pre != nullptr) v *= Load8(pre + i);
      v = __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6) + v * s1;
      v = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5) + v * s2;
      v = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3) + v * s4;
      Store8(v, y + i);
    }
    for (int h = 8; h < d; h *= 2) {
      for (int i = 0; i < d; i += 2 * h) {
        for (int j = i; j < i + h; j += 8) {
          const Float8 a = Load8(y + j);
          const Float8 b = Load8(y + j + h);
          Store8(a + b, y + j);
          Store8(a - b, y + j + h);
        }
      }
    }
    Out* o = out + r * d;
    for (int j = 0; j < d; j += 8) Store8(Load8(y + j) * Load8(post_scale + j), o + j);
  }
}

// Dense products y = x * B (B row-major D x D: M, or M^T for the inverse). Every output is
// acc = +0; acc = fma(x[k], B[k][j], acc) for k = 0..D-1, whatever the SIMD width or tiling, so
// all paths and splits agree. Register tiles of kTileRows rows x kTileVecs vectors of outputs
// stream B one row (k) at a time.
#if defined(__AVX512F__)
using VecF = __m512;
constexpr int kVecLanes = 16;
constexpr int kTileRows = 6;  // 6 x 4 accumulators + 4 rows of B: 28 of 32 registers
constexpr int kTileVecs = 4;
inline VecF VZero() { return _mm512_setzero_ps(); }
inline VecF VLoad(const float* p) { return _mm512_loadu_ps(p); }
inline VecF VSet1(float v) { return _mm512_set1_ps(v); }
inline VecF VFma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline void VStore(VecF v, float* p) { _mm512_storeu_ps(p, v); }
inline void VStore(VecF v, Bf16* p) {
  // Bf16::FromFloat, 16 lanes: round to nearest even, NaN kept quiet.
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_mov_epi32(r, nan,
                            _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
#elif defined(__AVX2__) && defined(__FMA__)
using VecF = __m256;
constexpr int kVecLanes = 8;
constexpr int kTileRows = 4;  // 4 x 2 accumulators: fits the 16 registers
constexpr int kTileVecs = 2;
inline VecF VZero() { return _mm256_setzero_ps(); }
inline VecF VLoad(const float* p) { return _mm256_loadu_ps(p); }
inline VecF VSet1(float v) { return _mm256_set1_ps(v); }
inline VecF VFma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline void VStore(VecF v, float* p) { _mm256_storeu_ps(p, v); }
inline void VStore(VecF v, Bf16* p) {
  Float8 f;
  std::memcpy(&f, &v, sizeof(f));
  Store8(f, p);
}
#else
using VecF = float;
constexpr int kVecLanes = 1;
constexpr int kTileRows = 1;
constexpr int kTileVecs = 4;
inline VecF VZero() { return 0.0f; }
inline VecF VLoad(const float* p) { return *p; }
inline VecF VSet1(float v) { return v; }
inline VecF VFma(VecF a, VecF b, VecF c) { return std::fma(a, b, c); }
inline void VStore(VecF v, float* p) { *p = v; }
inline void VStore(VecF v, Bf16* p) { *p = Bf16::FromFloat(v); }
#endif

// Outputs [0, R) x [j0, j0 + V * kVecLanes) of y = x * B; x is R rows of fp32 with stride d.
template <int R, int V, typename Out>
inline void DenseTile(const float* x, const float* b, int d, int j0, Out* y) {
  VecF acc[R][V];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) acc[r][v] = VZero();
  }
  const float* bk = b + j0;
  for (int k = 0; k < d; ++k, bk += d) {
    VecF bv[V];
    for (int v = 0; v < V; ++v) bv[v] = VLoad(bk + v * kVecLanes);
    for (int r = 0; r < R; ++r) {
      const VecF xv = VSet1(x[r * d + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = VFma(xv, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v)
      VStore(acc[r][v], y + static_cast<size_t>(r) * d + j0 + v * kVecLanes);
  }
}

template <int R, typename Out>
void DenseRowGroup(const float* x, const float* b, int d, Out* y) {
  constexpr int kPanel = kTileVecs * kVecLanes;
  int j0 = 0;
  for (; j0 + kPanel <= d; j0 += kPanel) DenseTile<R, kTileVecs, Out>(x, b, d, j0, y);
  for (; j0 < d; j0 += kVecLanes) DenseTile<R, 1, Out>(x, b, d, j0, y);  // narrow D
}

template <int R, typename Out>
void DenseRowsRemainder(int n, const float* x, const float* b, int d, Out* y) {
  if constexpr (R > 0) {
    if (n == R) {
      DenseRowGroup<R, Out>(x, b, d, y);
    } else {
      DenseRowsRemainder<R - 1, Out>(n, x, b, d, y);
    }
  }
}

inline void ToFloatRow(const float* in, float* out, size_t n) {
  std::memcpy(out, in, n * sizeof(float));
}
inline void ToFloatRow(const Bf16* in, float* out, size_t n) {
  for (size_t i = 0; i < n; i += 8) Store8(Load8(in + i), out + i);  // n is a multiple of 8
}

// y = x * B for `rows` rows of d values.
template <typename In, typename Out>
void DenseRows(const In* in, const float* b, int d, size_t rows, Out* out) {
  alignas(64) float x[kTileRows * 256];  // d <= 256, checked at construction
  for (size_t r0 = 0; r0 < rows; r0 += kTileRows) {
    const int nr = static_cast<int>(std::min<size_t>(kTileRows, rows - r0));
    ToFloatRow(in + r0 * d, x, static_cast<size_t>(nr) * d);
    Out* y = out + r0 * d;
    if (nr == kTileRows) {
      DenseRowGroup<kTileRows, Out>(x, b, d, y);
    } else {
      DenseRowsRemainder<kTileRows - 1, Out>(nr, x, b, d, y);
    }
  }
}

}  // namespace

absl::string_view RotationKindName(RotationKind k) {
  switch (k) {
    case RotationKind::kIdentity:
      return "identity";
    case RotationKind::kHadamard:
      return "hadamard";
    case RotationKind::kRandomizedHadamard:
      return "randomized_hadamard";
    case RotationKind::kDense:
      return "dense";
  }
  return "unknown";
}

absl::StatusOr<RotationKind> ParseRotationKind(absl::string_view name) {
  for (RotationKind k : {RotationKind::kIdentity, RotationKind::kHadamard,
                         RotationKind::kRandomizedHadamard, RotationKind::kDense}) {
    if (name == RotationKindName(k)) return k;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("rotation: unknown rotation kind '", name,
                   "' (expected identity, hadamard, randomized_hadamard or dense)"));
}

std::vector<float> RandomizedHadamardSigns(uint64_t seed, int layer, KvTensor t, int head_dim) {
  const uint64_t stream = 2u * static_cast<uint64_t>(layer) + static_cast<uint64_t>(t) + 1u;
  uint64_t state = seed ^ (0x9E3779B97F4A7C15ull * stream);
  std::vector<float> signs(static_cast<size_t>(std::max(head_dim, 0)));
  uint64_t bits = 0;
  for (size_t i = 0; i < signs.size(); ++i) {
    if (i % 64 == 0) bits = SplitMix64Next(state);
    signs[i] = ((bits >> (i % 64)) & 1u) ? -1.0f : 1.0f;
  }
  return signs;
}

absl::StatusOr<RotationSet> RotationSet::Identity(int num_layers, int head_dim) {
  if (absl::Status s = CheckShape(num_layers, head_dim); !s.ok()) return s;
  RotationSet r;
  r.kind_ = RotationKind::kIdentity;
  r.num_layers_ = num_layers;
  r.head_dim_ = head_dim;
  return r;
}

absl::StatusOr<RotationSet> RotationSet::Hadamard(int num_layers, int head_dim) {
  if (absl::Status s = CheckShape(num_layers, head_dim); !s.ok()) return s;
  RotationSet r;
  r.kind_ = RotationKind::kHadamard;
  r.num_layers_ = num_layers;
  r.head_dim_ = head_dim;
  return r;
}

absl::StatusOr<RotationSet> RotationSet::RandomizedHadamard(int num_layers, int head_dim,
                                                            uint64_t seed) {
  if (absl::Status s = CheckShape(num_layers, head_dim); !s.ok()) return s;
  RotationSet r;
  r.kind_ = RotationKind::kRandomizedHadamard;
  r.num_layers_ = num_layers;
  r.head_dim_ = head_dim;
  r.seed_ = seed;
  r.k_.reserve(num_layers);
  r.v_.reserve(num_layers);
  for (int layer = 0; layer < num_layers; ++layer) {
    r.k_.push_back(RandomizedHadamardSigns(seed, layer, KvTensor::kKey, head_dim));
    r.v_.push_back(RandomizedHadamardSigns(seed, layer, KvTensor::kValue, head_dim));
  }
  return r;
}

absl::StatusOr<RotationSet> RotationSet::Dense(int num_layers, int head_dim,
                                               std::vector<std::vector<float>> k,
                                               std::vector<std::vector<float>> v, float tolerance) {
  if (absl::Status s = CheckShape(num_layers, head_dim); !s.ok()) return s;
  if (!(tolerance > 0.0f) || !std::isfinite(tolerance)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rotation: orthogonality tolerance ", tolerance, " must be positive"));
  }
  const size_t dd = static_cast<size_t>(head_dim) * head_dim;
  for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
    const std::vector<std::vector<float>>& mats = t == KvTensor::kKey ? k : v;
    const char* name = t == KvTensor::kKey ? "K" : "V";
    if (mats.size() != static_cast<size_t>(num_layers)) {
      return absl::InvalidArgumentError(absl::StrCat("rotation: ", mats.size(), " ", name,
                                                     " matrices for ", num_layers, " layers"));
    }
    for (int layer = 0; layer < num_layers; ++layer) {
      const std::vector<float>& m = mats[layer];
      const std::string where = absl::StrCat("rotation: layer ", layer, " ", name, " matrix");
      if (m.size() != dd) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, " has ", m.size(), " values, expected ", head_dim, "x", head_dim, " = ", dd));
      }
      if (!AllFinite(m.data(), m.size())) {
        return absl::InvalidArgumentError(where + " has a non-finite value");
      }
      // Checked in float64 so the check's own rounding does not eat into the tolerance.
      const RowMajorMatrixD md =
          Eigen::Map<const RowMajorMatrixF>(m.data(), head_dim, head_dim).cast<double>();
      RowMajorMatrixD gram = md * md.transpose();
      gram.diagonal().array() -= 1.0;
      const double err = gram.cwiseAbs().maxCoeff();
      if (!(err <= tolerance)) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, " is not orthogonal: max |M M^T - I| = ", err, " > tolerance ", tolerance));
      }
    }
  }
  RotationSet r;
  r.kind_ = RotationKind::kDense;
  r.num_layers_ = num_layers;
  r.head_dim_ = head_dim;
  r.k_ = std::move(k);
  r.v_ = std::move(v);
  for (const auto* mats : {&r.k_, &r.v_}) {
    auto& transposes = mats == &r.k_ ? r.kt_ : r.vt_;
    for (const std::vector<float>& m : *mats) {
      std::vector<float> mt(m.size());
      for (int i = 0; i < head_dim; ++i) {
        for (int j = 0; j < head_dim; ++j) mt[j * head_dim + i] = m[i * head_dim + j];
      }
      transposes.push_back(std::move(mt));
    }
  }
  return r;
}

std::vector<float> RotationSet::Matrix(int layer, KvTensor t) const {
  if (layer < 0 || layer >= num_layers_) return {};
  const int d = head_dim_;
  std::vector<float> m(static_cast<size_t>(d) * d, 0.0f);
  switch (kind_) {
    case RotationKind::kIdentity:
      for (int i = 0; i < d; ++i) m[static_cast<size_t>(i) * d + i] = 1.0f;
      break;
    case RotationKind::kHadamard:
    case RotationKind::kRandomizedHadamard: {
      const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
      const std::vector<float>* signs = nullptr;
      if (kind_ == RotationKind::kRandomizedHadamard) {
        signs = t == KvTensor::kKey ? &k_[layer] : &v_[layer];
      }
      for (int i = 0; i < d; ++i) {
        // Row i of diag(s) H is s[i] times row i of H.
        const float row_sign = signs != nullptr ? (*signs)[i] : 1.0f;
        for (int j = 0; j < d; ++j) {
          const float h = (__builtin_popcount(static_cast<unsigned>(i & j)) & 1) ? -scale : scale;
          m[static_cast<size_t>(i) * d + j] = row_sign * h;
        }
      }
      break;
    }
    case RotationKind::kDense:
      m = t == KvTensor::kKey ? k_[layer] : v_[layer];
      break;
  }
  return m;
}

namespace {

absl::Status CheckRows(int layer, int num_layers, int head_dim, size_t in_size, size_t out_size,
                       const void* in, const void* out, size_t elem_bytes) {
  if (layer < 0 || layer >= num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("rotation: layer ", layer, " out of range [0, ", num_layers, ")"));
  }
  if (in_size != out_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rotation: input has ", in_size, " values but output has ", out_size));
  }
  if (in_size % static_cast<size_t>(head_dim) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rotation: ", in_size, " values is not a whole number of rows of head_dim ", head_dim));
  }
  const char* a = static_cast<const char*>(in);
  const char* b = static_cast<const char*>(out);
  const size_t bytes = in_size * elem_bytes;
  if (bytes > 0 && a < b + bytes && b < a + bytes) {
    return absl::InvalidArgumentError("rotation: input and output overlap");
  }
  return absl::OkStatus();
}

absl::Status OverflowError() {
  return absl::InvalidArgumentError("rotation: a rotated value overflows float32");
}

// Shared fp32 kernel after validation. `inverse` selects x * M^T.
// `transposed` is M^T for kDense.
void ApplyRotation(RotationKind kind, int d, const std::vector<float>* data,
                   const std::vector<float>* transposed, bool inverse, const float* in, float* out,
                   size_t rows) {
  const size_t n = rows * static_cast<size_t>(d);
  switch (kind) {
    case RotationKind::kIdentity:
      if (n > 0) std::memcpy(out, in, n * sizeof(float));
      return;
    case RotationKind::kHadamard:
      HadamardRows(in, out, rows, d, nullptr, nullptr);
      return;
    case RotationKind::kRandomizedHadamard:
      // x M = FWHT(x .* s);  x M^T = x H diag(s) = FWHT(x) .* s.
      HadamardRows(in, out, rows, d, inverse ? nullptr : data->data(),
                   inverse ? data->data() : nullptr);
      return;
    case RotationKind::kDense:
      DenseRows(in, (inverse ? transposed : data)->data(), d, rows, out);
      return;
  }
}

}  // namespace

absl::Status RotationSet::RotateFloat(int layer, KvTensor t, bool inverse,
                                      absl::Span<const float> in, absl::Span<float> out) const {
  if (absl::Status s = CheckRows(layer, num_layers_, head_dim_, in.size(), out.size(), in.data(),
                                 out.data(), sizeof(float));
      !s.ok()) {
    return s;
  }
  if (!AllFinite(in.data(), in.size())) {
    return absl::InvalidArgumentError("rotation: input has a non-finite value");
  }
  const std::vector<float>* data = nullptr;
  if (kind_ == RotationKind::kDense || kind_ == RotationKind::kRandomizedHadamard) {
    data = t == KvTensor::kKey ? &k_[layer] : &v_[layer];
  }
  const std::vector<float>* transposed = nullptr;
  if (kind_ == RotationKind::kDense) transposed = t == KvTensor::kKey ? &kt_[layer] : &vt_[layer];
  ApplyRotation(kind_, head_dim_, data, transposed, inverse, in.data(), out.data(),
                in.size() / head_dim_);
  // Finite inputs near FLT_MAX can still overflow: a coordinate may grow by up to sqrt(D).
  if (!AllFinite(out.data(), out.size())) return OverflowError();
  return absl::OkStatus();
}

absl::Status RotationSet::Rotate(int layer, KvTensor t, absl::Span<const float> in,
                                 absl::Span<float> out) const {
  return RotateFloat(layer, t, /*inverse=*/false, in, out);
}

absl::Status RotationSet::Unrotate(int layer, KvTensor t, absl::Span<const float> in,
                                   absl::Span<float> out) const {
  return RotateFloat(layer, t, /*inverse=*/true, in, out);
}

absl::Status RotationSet::RotateBf16(int layer, KvTensor t, absl::Span<const Bf16> in,
                                     absl::Span<Bf16> out) const {
  if (absl::Status s = CheckRows(layer, num_layers_, head_dim_, in.size(), out.size(), in.data(),
                                 out.data(), sizeof(Bf16));
      !s.ok()) {
    return s;
  }
  if (!AllFiniteBf16(in.data(), in.size())) {
    return absl::InvalidArgumentError("rotation: input has a non-finite value");
  }

  const size_t rows = in.size() / static_cast<size_t>(head_dim_);
  RotateBf16Rows(layer, t, in.data(), out.data(), rows);
  return AllFiniteBf16(out.data(), out.size()) ? absl::OkStatus() : OverflowError();
}

void RotationSet::RotateBf16Rows(int layer, KvTensor t, const Bf16* in, Bf16* out,
                                 size_t rows) const {
  const size_t d = static_cast<size_t>(head_dim_);
  if (rows == 0) return;
  if (kind_ == RotationKind::kIdentity) {
    // x * I rounds back to the same BF16 value: copy the bits.
    std::memcpy(out, in, rows * d * sizeof(Bf16));
    return;
  }
  const std::vector<float>* data = nullptr;
  if (kind_ == RotationKind::kDense || kind_ == RotationKind::kRandomizedHadamard) {
    data = t == KvTensor::kKey ? &k_[layer] : &v_[layer];
  }
  if (kind_ == RotationKind::kHadamard || kind_ == RotationKind::kRandomizedHadamard) {
    // The transform reads BF16 and rounds to BF16 itself, row by row: no fp32 staging.
    HadamardRows(in, out, rows, head_dim_, data != nullptr ? data->data() : nullptr, nullptr);
    return;
  }
  // Dense: the GEMM reads BF16 and rounds its outputs to BF16 in registers.
  DenseRows(in, data->data(), head_dim_, rows, out);
}

}  // namespace kvpool
