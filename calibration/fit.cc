#include "calibration/fit.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <numeric>
#include <utility>

// GCC 12 reports a false -Wmaybe-uninitialized inside Eigen's GEMM packing at instantiation.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "Eigen/Core"
#include "Eigen/Eigenvalues"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kernels/bf16.h"
#include "common/status_macros.h"
#include "kernels/row_codec.h"
#include "kernels/safetensors.h"

namespace kvpool::calibration {
namespace {

using MatrixD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatrixF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using StridedF = Eigen::Map<const MatrixF, 0, Eigen::OuterStride<>>;

absl::Status Bad(absl::string_view path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("capture ", path, ": ", what));
}

absl::StatusOr<int> MetaInt(const SafetensorsFile& f, absl::string_view path,
                            const std::string& key) {
  auto it = f.metadata().find(key);
  int value = 0;
  if (it == f.metadata().end() || !absl::SimpleAtoi(it->second, &value)) {
    return Bad(path, absl::StrCat("metadata '", key, "' is missing or not an integer"));
  }
  return value;
}

absl::StatusOr<std::vector<float>> ReadShaped(const SafetensorsFile& f, absl::string_view path,
                                              const std::string& name,
                                              const std::vector<int64_t>& shape) {
  const SafetensorsTensor* t = f.Find(name);
  if (t == nullptr) return Bad(path, absl::StrCat("no tensor '", name, "'"));
  if (t->shape != shape) return Bad(path, absl::StrCat("tensor '", name, "' has a wrong shape"));
  KVPOOL_ASSIGN_OR_RETURN(std::vector<float> data, f.ReadFloat32(name));
  for (float x : data) {
    if (!std::isfinite(x)) return Bad(path, absl::StrCat("tensor '", name, "' is not finite"));
  }
  return data;
}

// The g*N x D stack of the query rows of KV head h, as float64.
MatrixD GroupQueries(const LayerCapture& cap, int h) {
  const int g = cap.q_heads / cap.kv_heads, d = cap.head_dim;
  MatrixD out(static_cast<Eigen::Index>(cap.tokens) * g, d);
  for (int t = 0; t < cap.tokens; ++t) {
    for (int j = 0; j < g; ++j) {
      const float* src = &cap.q[(static_cast<size_t>(t) * cap.q_heads + h * g + j) * d];
      for (int c = 0; c < d; ++c) out(static_cast<Eigen::Index>(t) * g + j, c) = src[c];
    }
  }
  return out;
}

// The N x D rows of KV head h of `x` ([N][Hkv][D]) as float64.
MatrixD HeadRows(const LayerCapture& cap, const std::vector<float>& x, int h) {
  const int d = cap.head_dim;
  MatrixD out(cap.tokens, d);
  for (int t = 0; t < cap.tokens; ++t) {
    const float* src = &x[(static_cast<size_t>(t) * cap.kv_heads + h) * d];
    for (int c = 0; c < d; ++c) out(t, c) = src[c];
  }
  return out;
}

std::vector<double> Symmetrized(const MatrixD& c) {
  const MatrixD s = 0.5 * (c + c.transpose());
  return std::vector<double>(s.data(), s.data() + s.size());
}

template <typename T>
double OrthogonalityErrorImpl(absl::Span<const T> m, int dim) {
  double worst = 0;
  for (int i = 0; i < dim; ++i) {
    for (int j = 0; j < dim; ++j) {
      double dot = 0;
      for (int c = 0; c < dim; ++c) dot += double(m[i * dim + c]) * double(m[j * dim + c]);
      worst = std::max(worst, std::abs(dot - (i == j ? 1.0 : 0.0)));
    }
  }
  return worst;
}

}  // namespace

absl::StatusOr<LayerCapture> ReadLayerCapture(const std::string& path) {
  KVPOOL_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::ReadFile(path));
  LayerCapture cap;
  auto model = f.metadata().find("model_id");
  cap.model_id = model == f.metadata().end() ? "" : model->second;
  KVPOOL_ASSIGN_OR_RETURN(cap.layer, MetaInt(f, path, "layer"));
  KVPOOL_ASSIGN_OR_RETURN(cap.num_layers, MetaInt(f, path, "num_layers"));
  KVPOOL_ASSIGN_OR_RETURN(cap.tokens, MetaInt(f, path, "tokens"));
  KVPOOL_ASSIGN_OR_RETURN(cap.q_heads, MetaInt(f, path, "q_heads"));
  KVPOOL_ASSIGN_OR_RETURN(cap.kv_heads, MetaInt(f, path, "kv_heads"));
  KVPOOL_ASSIGN_OR_RETURN(cap.head_dim, MetaInt(f, path, "head_dim"));
  if (cap.tokens <= 0 || cap.kv_heads <= 0 || cap.q_heads <= 0 || cap.q_heads % cap.kv_heads != 0 ||
      !IsSupportedHeadDim(cap.head_dim) || cap.layer < 0 || cap.layer >= cap.num_layers) {
    return Bad(path, "inconsistent metadata (tokens, heads, head_dim or layer)");
  }
  KVPOOL_ASSIGN_OR_RETURN(cap.q, ReadShaped(f, path, "q", {cap.tokens, cap.q_heads, cap.head_dim}));
  KVPOOL_ASSIGN_OR_RETURN(cap.k,
                          ReadShaped(f, path, "k", {cap.tokens, cap.kv_heads, cap.head_dim}));
  KVPOOL_ASSIGN_OR_RETURN(cap.v,
                          ReadShaped(f, path, "v", {cap.tokens, cap.kv_heads, cap.head_dim}));
  const SafetensorsTensor* off = f.Find("seq_offsets");
  if (off == nullptr || off->dtype != SafetensorsDtype::kI64 || off->shape.size() != 1 ||
      off->shape[0] < 2) {
    return Bad(path, "seq_offsets must be an I64 vector of at least 2 entries");
  }
  cap.seq_offsets.resize(off->shape[0]);
  std::memcpy(cap.seq_offsets.data(), off->bytes.data(), off->bytes.size());
  if (cap.seq_offsets.front() != 0 || cap.seq_offsets.back() != cap.tokens ||
      !std::is_sorted(cap.seq_offsets.begin(), cap.seq_offsets.end()) ||
      std::adjacent_find(cap.seq_offsets.begin(), cap.seq_offsets.end()) != cap.seq_offsets.end()) {
    return Bad(path, "seq_offsets must rise strictly from 0 to tokens");
  }
  return cap;
}

absl::StatusOr<std::vector<std::string>> ListCaptureFiles(const std::string& dir) {
  std::map<int, std::string> by_layer;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const std::string kPrefix = "layer_", kSuffix = ".safetensors";
    if (name.size() <= kPrefix.size() + kSuffix.size() || name.rfind(kPrefix, 0) != 0 ||
        name.compare(name.size() - kSuffix.size(), kSuffix.size(), kSuffix) != 0) {
      continue;
    }
    int layer = 0;
    const std::string digits =
        name.substr(kPrefix.size(), name.size() - kPrefix.size() - kSuffix.size());
    if (!absl::SimpleAtoi(digits, &layer) || layer < 0) continue;
    by_layer[layer] = entry.path().string();
  }
  if (ec)
    return absl::NotFoundError(absl::StrCat("captures: cannot list ", dir, ": ", ec.message()));
  if (by_layer.empty()) return absl::NotFoundError(absl::StrCat("captures: none in ", dir));
  std::vector<std::string> files;
  for (const auto& [layer, path] : by_layer) {
    if (layer != static_cast<int>(files.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("captures: layer ", files.size(), " is missing in ", dir));
    }
    files.push_back(path);
  }
  return files;
}

absl::StatusOr<KeyTarget> ParseKeyTarget(absl::string_view name) {
  if (name == "qqt") return KeyTarget::kQueryMoment;
  if (name == "ktk") return KeyTarget::kKeyMoment;
  return absl::InvalidArgumentError(absl::StrCat("unknown key target '", name, "' (qqt|ktk)"));
}

absl::StatusOr<ValueTarget> ParseValueTarget(absl::string_view name) {
  if (name == "sst") return ValueTarget::kLogitWeighted;
  if (name == "vtv") return ValueTarget::kValueMoment;
  return absl::InvalidArgumentError(absl::StrCat("unknown value target '", name, "' (sst|vtv)"));
}

namespace {
constexpr std::pair<Composition, absl::string_view> kCompositions[] = {
    {Composition::kUHPbr, "u_h_pbr"}, {Composition::kUH, "u_h"},
    {Composition::kU, "u"},           {Composition::kUPbr, "u_pbr"},
    {Composition::kHPbr, "h_pbr"},    {Composition::kHadamard, "hadamard"},
};
}  // namespace

absl::StatusOr<Composition> ParseComposition(absl::string_view name) {
  for (const auto& [c, n] : kCompositions) {
    if (n == name) return c;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown composition '", name, "' (u_h_pbr|u_h|u|u_pbr|h_pbr|hadamard)"));
}

absl::string_view KeyTargetName(KeyTarget t) {
  return t == KeyTarget::kQueryMoment ? "qqt" : "ktk";
}
absl::string_view ValueTargetName(ValueTarget t) {
  return t == ValueTarget::kLogitWeighted ? "sst" : "vtv";
}
absl::string_view CompositionName(Composition c) {
  for (const auto& [comp, n] : kCompositions) {
    if (comp == c) return n;
  }
  return "?";
}

std::string ObjectiveLabel(absl::string_view target, Composition c) {
  switch (c) {
    case Composition::kUHPbr:
      return absl::StrCat(target, "_r_h_pbr");
    case Composition::kUH:
      return absl::StrCat(target, "_r_h");
    case Composition::kU:
      return absl::StrCat(target, "_r");
    case Composition::kUPbr:
      return absl::StrCat(target, "_r_pbr");
    case Composition::kHPbr:
      return "h_pbr";
    case Composition::kHadamard:
      return "hadamard";
  }
  return "?";
}

std::vector<double> KeyTargetMatrix(const LayerCapture& cap, KeyTarget target) {
  const int d = cap.head_dim;
  const int g = cap.q_heads / cap.kv_heads;
  MatrixD c = MatrixD::Zero(d, d);
  for (int h = 0; h < cap.kv_heads; ++h) {
    if (target == KeyTarget::kQueryMoment) {
      const MatrixD qh = GroupQueries(cap, h);
      c += (qh.transpose() * qh) / (static_cast<double>(g) * cap.tokens);
    } else {
      const MatrixD kh = HeadRows(cap, cap.k, h);
      c += (kh.transpose() * kh) / static_cast<double>(cap.tokens);
    }
  }
  c /= cap.kv_heads;
  return Symmetrized(c);
}

std::vector<double> ValueTargetMatrix(const LayerCapture& cap, ValueTarget target) {
  const int d = cap.head_dim;
  const int g = cap.q_heads / cap.kv_heads;
  const double n = cap.tokens;
  MatrixD c = MatrixD::Zero(d, d);
  for (int h = 0; h < cap.kv_heads; ++h) {
    const MatrixD vh = HeadRows(cap, cap.v, h);
    if (target == ValueTarget::kValueMoment) {
      c += (vh.transpose() * vh) / n;
      continue;
    }
    const MatrixD qh = GroupQueries(cap, h);
    const MatrixD a = (qh.transpose() * qh) / (static_cast<double>(g) * n);
    const MatrixD kh = HeadRows(cap, cap.k, h);
    // w_t = k_t A k_t^T: the mean squared raw logit of token t over the group's queries.
    const Eigen::VectorXd w = ((kh * a).array() * kh.array()).rowwise().sum();
    const double sum = w.sum();
    const Eigen::VectorXd w_hat =
        sum > 0 ? Eigen::VectorXd(n * w / sum) : Eigen::VectorXd(Eigen::VectorXd::Ones(cap.tokens));
    c += (vh.transpose() * w_hat.asDiagonal() * vh) / n;
  }
  c /= cap.kv_heads;
  return Symmetrized(c);
}

std::vector<double> HadamardMatrix(int dim) {
  std::vector<double> h(static_cast<size_t>(dim) * dim);
  const double s = 1.0 / std::sqrt(static_cast<double>(dim));
  for (int i = 0; i < dim; ++i) {
    for (int j = 0; j < dim; ++j) {
      h[static_cast<size_t>(i) * dim + j] = (__builtin_popcount(i & j) & 1) ? -s : s;
    }
  }
  return h;
}

int BitReverse(int i, int bits) {
  int r = 0;
  for (int b = 0; b < bits; ++b) r |= ((i >> b) & 1) << (bits - 1 - b);
  return r;
}

std::vector<int> DescendingOrder(absl::Span<const double> eigenvalues) {
  std::vector<int> sigma(eigenvalues.size());
  std::iota(sigma.begin(), sigma.end(), 0);
  std::stable_sort(sigma.begin(), sigma.end(),
                   [&](int a, int b) { return eigenvalues[a] > eigenvalues[b]; });
  return sigma;
}

std::vector<double> ApplyBitReversal(absl::Span<const double> x, absl::Span<const int> sigma,
                                     int dim) {
  int bits = 0;
  while ((1 << bits) < dim) ++bits;
  std::vector<double> out(x.size());
  for (int i = 0; i < dim; ++i) {
    const int dst = BitReverse(i, bits), src = sigma[i];
    for (int r = 0; r < dim; ++r) {
      out[static_cast<size_t>(r) * dim + dst] = x[static_cast<size_t>(r) * dim + src];
    }
  }
  return out;
}

double OrthogonalityError(absl::Span<const double> m, int dim) {
  return OrthogonalityErrorImpl(m, dim);
}
double OrthogonalityError(absl::Span<const float> m, int dim) {
  return OrthogonalityErrorImpl(m, dim);
}

absl::StatusOr<SpectralRotation> BuildRotation(absl::Span<const double> target, int dim,
                                               Composition composition) {
  if (!IsSupportedHeadDim(dim) || target.size() != static_cast<size_t>(dim) * dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("rotation fit: target must be D x D with D a power of two in [32, 256]"));
  }
  for (double x : target) {
    if (!std::isfinite(x)) return absl::InvalidArgumentError("rotation fit: non-finite target");
  }
  SpectralRotation r;
  const std::vector<double> h = HadamardMatrix(dim);
  if (composition == Composition::kHadamard) {
    r.eigenvalues.assign(dim, 1.0);
    r.eigenvectors.assign(static_cast<size_t>(dim) * dim, 0.0);
    for (int i = 0; i < dim; ++i) r.eigenvectors[static_cast<size_t>(i) * dim + i] = 1.0;
    r.matrix = h;
    return r;
  }
  const MatrixD c = Eigen::Map<const MatrixD>(target.data(), dim, dim);
  Eigen::SelfAdjointEigenSolver<MatrixD> solver(c, Eigen::ComputeEigenvectors);
  if (solver.info() != Eigen::Success) {
    return absl::InternalError("rotation fit: the eigensolver did not converge");
  }
  MatrixD u = solver.eigenvectors();     // columns, ascending eigenvalues
  for (int col = 0; col < dim; ++col) {  // canonical sign: largest |entry| positive
    Eigen::Index arg = 0;
    u.col(col).cwiseAbs().maxCoeff(&arg);
    if (u(arg, col) < 0) u.col(col) *= -1.0;
  }
  r.eigenvalues.assign(solver.eigenvalues().data(), solver.eigenvalues().data() + dim);
  r.eigenvectors.assign(u.data(), u.data() + u.size());
  const std::vector<int> sigma = DescendingOrder(r.eigenvalues);
  const MatrixD hm = Eigen::Map<const MatrixD>(h.data(), dim, dim);
  MatrixD x;
  switch (composition) {
    case Composition::kUHPbr:
    case Composition::kUH:
      x = u * hm;
      break;
    case Composition::kU:
    case Composition::kUPbr:
      x = u;
      break;
    case Composition::kHPbr:
      x = hm;
      break;
    case Composition::kHadamard:
      break;
  }
  r.matrix.assign(x.data(), x.data() + x.size());
  if (composition == Composition::kUHPbr || composition == Composition::kUPbr ||
      composition == Composition::kHPbr) {
    r.matrix = ApplyBitReversal(r.matrix, sigma, dim);
  }
  return r;
}

// --- LayerEvaluator --------------------------------------------------------------------------

struct LayerEvaluator::Impl {
  int d = 0, hq = 0, hkv = 0, g = 0, n = 0;
  ErrorOptions opt;
  std::vector<Bf16> k_rot, v_rot;  // [N][Hkv][D] rotated, BF16 (the stored tier)
  std::vector<float> k_f, v_f;     // the same as fp32
  // Per sequence with measured queries: the token range, the measured positions (local) and,
  // per KV head, the query rows [q * g + j][D] (rotated, pre-scaled by 1/sqrt(D)), the exact
  // logits [q * g + j][len] and the exact outputs [q * g + j][D].
  struct Segment {
    int begin = 0, len = 0;
    std::vector<int> queries;
    std::vector<MatrixF> q_rows, exact_logits, exact_out;
  };
  std::vector<Segment> segments;
  int measured = 0;

  StridedF HeadView(const std::vector<float>& x, const Segment& s, int h) const {
    return StridedF(x.data() + (static_cast<size_t>(s.begin) * hkv + h) * d, s.len, d,
                    Eigen::OuterStride<>(hkv * d));
  }

  // True when query (local) t reads key j from the BF16 tiers.
  bool Exact(int t, int j) const { return j < opt.sink_tokens || j > t - opt.recent_tokens; }

  // Attention output of segment s, head h, given K/V used for the quantized tier.
  MatrixF Attend(const Segment& s, int h, const MatrixF& logits, const StridedF& v_exact,
                 const StridedF& v_quant, bool mixed_v) const;

  absl::Status RoundTrip(const QuantConfig& quant, KvTensor t, std::vector<float>* out,
                         double* clip_rate, double* rel_error) const;
};

MatrixF LayerEvaluator::Impl::Attend(const Segment& s, int /*h*/, const MatrixF& logits,
                                     const StridedF& v_exact, const StridedF& v_quant,
                                     bool mixed_v) const {
  const int rows = static_cast<int>(logits.rows());
  MatrixF p_exact = MatrixF::Zero(rows, s.len);
  MatrixF p_quant;
  if (mixed_v) p_quant = MatrixF::Zero(rows, s.len);
  for (int r = 0; r < rows; ++r) {
    const int t = s.queries[r / g];
    float m = -std::numeric_limits<float>::infinity();
    for (int j = 0; j <= t; ++j) m = std::max(m, logits(r, j));
    double sum = 0;
    for (int j = 0; j <= t; ++j) {
      const float e = std::exp(logits(r, j) - m);
      sum += e;
      if (mixed_v && !Exact(t, j)) {
        p_quant(r, j) = e;
      } else {
        p_exact(r, j) = e;
      }
    }
    const float inv = static_cast<float>(1.0 / sum);
    p_exact.row(r) *= inv;
    if (mixed_v) p_quant.row(r) *= inv;
  }
  MatrixF out = p_exact * v_exact;
  if (mixed_v) out += p_quant * v_quant;
  return out;
}

absl::Status LayerEvaluator::Impl::RoundTrip(const QuantConfig& quant, KvTensor t,
                                             std::vector<float>* out, double* clip_rate,
                                             double* rel_error) const {
  KVPOOL_ASSIGN_OR_RETURN(RowCodec codec, RowCodec::Create(quant, d));
  const std::vector<Bf16>& rows = t == KvTensor::kKey ? k_rot : v_rot;
  const std::vector<float>& rows_f = t == KvTensor::kKey ? k_f : v_f;
  const size_t num_rows = rows.size() / d;
  out->resize(rows.size());
  std::vector<uint8_t> codes(codec.layout().code_bytes_per_row());
  std::vector<GroupMeta> meta(std::max<size_t>(1, codec.layout().groups_per_row()));
  std::vector<float> scratch(d);
  const float ratio = quant.ClipRatio(t);
  int64_t clipped = 0;
  double err = 0, norm = 0;
  for (size_t r = 0; r < num_rows; ++r) {
    absl::Span<const Bf16> row(&rows[r * d], d);
    KVPOOL_RETURN_IF_ERROR(codec.Encode(t, row, codes.data(), meta.data()));
    absl::Span<float> dst(&(*out)[r * d], d);
    codec.Decode(codes.data(), meta.data(), dst);
    absl::Span<const float> src(&rows_f[r * d], d);
    if (ratio > 0) {
      const float tau = ClipThreshold(src, ratio, absl::MakeSpan(scratch));
      for (int c = 0; c < d; ++c) clipped += std::abs(src[c]) > tau;
    }
    for (int c = 0; c < d; ++c) {
      err += (double(dst[c]) - src[c]) * (double(dst[c]) - src[c]);
      norm += double(src[c]) * src[c];
    }
  }
  if (clip_rate) *clip_rate = static_cast<double>(clipped) / static_cast<double>(rows.size());
  if (rel_error) *rel_error = norm > 0 ? err / norm : 0;
  return absl::OkStatus();
}

LayerEvaluator::LayerEvaluator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
LayerEvaluator::~LayerEvaluator() = default;

int LayerEvaluator::measured_queries() const { return impl_->measured; }

absl::StatusOr<std::unique_ptr<LayerEvaluator>> LayerEvaluator::Create(
    const LayerCapture& cap, const RotationSet& rotations, const ErrorOptions& options) {
  if (rotations.head_dim() != cap.head_dim || cap.layer >= rotations.num_layers()) {
    return absl::InvalidArgumentError("evaluator: rotation set does not match the capture");
  }
  if (options.sink_tokens < 0 || options.recent_tokens < 1 || options.max_queries < 1) {
    return absl::InvalidArgumentError("evaluator: bad sink/recent/max_queries");
  }
  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  m.d = cap.head_dim;
  m.hq = cap.q_heads;
  m.hkv = cap.kv_heads;
  m.g = cap.q_heads / cap.kv_heads;
  m.n = cap.tokens;
  m.opt = options;
  const int d = m.d;

  // Rotate K and V on the normative arrival path (BF16 in, rotated BF16 out), Q in fp32.
  std::vector<Bf16> k_in(cap.k.size()), v_in(cap.v.size());
  for (size_t i = 0; i < cap.k.size(); ++i) k_in[i] = Bf16::FromFloat(cap.k[i]);
  for (size_t i = 0; i < cap.v.size(); ++i) v_in[i] = Bf16::FromFloat(cap.v[i]);
  m.k_rot.resize(k_in.size());
  m.v_rot.resize(v_in.size());
  KVPOOL_RETURN_IF_ERROR(
      rotations.RotateBf16(cap.layer, KvTensor::kKey, k_in, absl::MakeSpan(m.k_rot)));
  KVPOOL_RETURN_IF_ERROR(
      rotations.RotateBf16(cap.layer, KvTensor::kValue, v_in, absl::MakeSpan(m.v_rot)));
  m.k_f.resize(m.k_rot.size());
  m.v_f.resize(m.v_rot.size());
  for (size_t i = 0; i < m.k_rot.size(); ++i) m.k_f[i] = m.k_rot[i].ToFloat();
  for (size_t i = 0; i < m.v_rot.size(); ++i) m.v_f[i] = m.v_rot[i].ToFloat();
  std::vector<float> q_rot(cap.q.size());
  KVPOOL_RETURN_IF_ERROR(rotations.Rotate(cap.layer, KvTensor::kKey, cap.q, absl::MakeSpan(q_rot)));

  // Eligible queries: those with at least one key in the quantized tier.
  std::vector<std::pair<int, int>> eligible;  // (segment, local position)
  const int first = options.sink_tokens + options.recent_tokens;
  for (size_t s = 0; s + 1 < cap.seq_offsets.size(); ++s) {
    const int len = static_cast<int>(cap.seq_offsets[s + 1] - cap.seq_offsets[s]);
    for (int t = first; t < len; ++t) eligible.emplace_back(static_cast<int>(s), t);
  }
  if (eligible.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("evaluator: no calibration sequence is longer than sink + recent = ", first));
  }
  const size_t count = std::min<size_t>(eligible.size(), options.max_queries);
  std::map<int, Impl::Segment> by_seq;
  for (size_t i = 0; i < count; ++i) {
    const auto [s, t] = eligible[i * eligible.size() / count];
    Impl::Segment& seg = by_seq[s];
    seg.begin = static_cast<int>(cap.seq_offsets[s]);
    seg.len = static_cast<int>(cap.seq_offsets[s + 1] - cap.seq_offsets[s]);
    seg.queries.push_back(t);
  }
  m.measured = static_cast<int>(count);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (auto& [s, seg] : by_seq) {
    const int rows = static_cast<int>(seg.queries.size()) * m.g;
    for (int h = 0; h < m.hkv; ++h) {
      MatrixF qr(rows, d);
      for (size_t i = 0; i < seg.queries.size(); ++i) {
        for (int j = 0; j < m.g; ++j) {
          const float* src =
              &q_rot[(static_cast<size_t>(seg.begin + seg.queries[i]) * m.hq + h * m.g + j) * d];
          for (int c = 0; c < d; ++c) qr(i * m.g + j, c) = src[c] * scale;
        }
      }
      const StridedF k = m.HeadView(m.k_f, seg, h), v = m.HeadView(m.v_f, seg, h);
      MatrixF logits = qr * k.transpose();
      seg.exact_out.push_back(m.Attend(seg, h, logits, v, v, /*mixed_v=*/false));
      seg.exact_logits.push_back(std::move(logits));
      seg.q_rows.push_back(std::move(qr));
    }
    m.segments.push_back(std::move(seg));
  }
  return std::unique_ptr<LayerEvaluator>(new LayerEvaluator(std::move(impl)));
}

absl::StatusOr<double> LayerEvaluator::OutputError(const QuantConfig& quant, bool quantize_k,
                                                   bool quantize_v) const {
  const Impl& m = *impl_;
  std::vector<float> k_hat, v_hat;
  if (quantize_k) {
    KVPOOL_RETURN_IF_ERROR(m.RoundTrip(quant, KvTensor::kKey, &k_hat, nullptr, nullptr));
  }
  if (quantize_v) {
    KVPOOL_RETURN_IF_ERROR(m.RoundTrip(quant, KvTensor::kValue, &v_hat, nullptr, nullptr));
  }
  double err = 0, norm = 0;
  for (const Impl::Segment& seg : m.segments) {
    for (int h = 0; h < m.hkv; ++h) {
      MatrixF logits = seg.exact_logits[h];
      if (quantize_k) {
        const MatrixF lq = seg.q_rows[h] * m.HeadView(k_hat, seg, h).transpose();
        for (int r = 0; r < logits.rows(); ++r) {
          const int t = seg.queries[r / m.g];
          for (int j = m.opt.sink_tokens; j <= t - m.opt.recent_tokens; ++j) {
            logits(r, j) = lq(r, j);
          }
        }
      }
      const StridedF v = m.HeadView(m.v_f, seg, h);
      const MatrixF out = quantize_v ? m.Attend(seg, h, logits, v, m.HeadView(v_hat, seg, h), true)
                                     : m.Attend(seg, h, logits, v, v, false);
      err += (out - seg.exact_out[h]).cast<double>().squaredNorm();
      norm += seg.exact_out[h].cast<double>().squaredNorm();
    }
  }
  return norm > 0 ? err / norm : 0.0;
}

absl::StatusOr<LayerQuantStats> LayerEvaluator::Stats(const QuantConfig& quant) const {
  LayerQuantStats s;
  std::vector<float> scratch;
  KVPOOL_RETURN_IF_ERROR(
      impl_->RoundTrip(quant, KvTensor::kKey, &scratch, &s.k_clip_rate, &s.k_rel_error));
  KVPOOL_RETURN_IF_ERROR(
      impl_->RoundTrip(quant, KvTensor::kValue, &scratch, &s.v_clip_rate, &s.v_rel_error));
  KVPOOL_ASSIGN_OR_RETURN(s.attn_out_rel_error, OutputError(quant, true, true));
  return s;
}

std::vector<float> ClipRatioGrid(int head_dim, double min_ratio) {
  std::vector<float> grid;
  const int lo = std::max(1, static_cast<int>(std::ceil(min_ratio * head_dim)));
  for (int c = lo; c <= head_dim - 1; ++c) {
    grid.push_back(static_cast<float>(c) / static_cast<float>(head_dim));
  }
  return grid;
}

}  // namespace kvpool::calibration
