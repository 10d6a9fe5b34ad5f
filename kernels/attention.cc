#include "kernels/attention.h"

#include <algorithm>
#include <array>
#include <cassert>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace kvpool {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Tokens per tile for BF16 rows: the K/V tile (2 x 64 x D floats, 64 KiB at D = 256) stays in
// L2 while all query heads of the KV head use it.
constexpr int kRowTile = 64;
// Independent partial sums in a dot product. Without -ffast-math the compiler must keep a single
// float sum in order, so it cannot vectorize it; fixed lanes give it a vector to work with.
constexpr int kLanes = 16;

float Dot(const float* __restrict a, const float* __restrict b, int n) {
  float part[kLanes] = {};
  int d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int i = 0; i < kLanes; ++i) part[i] += a[d + i] * b[d + i];
  }
  float tail = 0.0f;
  for (; d < n; ++d) tail += a[d] * b[d];
  for (int w = kLanes / 2; w > 0; w /= 2) {
    for (int i = 0; i < w; ++i) part[i] += part[i + w];
  }
  return part[0] + tail;
}

// Code byte -> the fp32 codes it holds, in dim order (block_layout.h): a table turns unpacking
// into one 16-byte (2-bit) or 8-byte (4-bit) copy per byte, with no shifts or branches.
using Lut2 = std::array<std::array<float, 4>, 256>;
using Lut4 = std::array<std::array<float, 2>, 256>;

constexpr Lut2 MakeLut2() {
  Lut2 lut{};
  for (int b = 0; b < 256; ++b) {
    for (int i = 0; i < 4; ++i) lut[b][i] = static_cast<float>((b >> (2 * i)) & 3);
  }
  return lut;
}
constexpr Lut4 MakeLut4() {
  Lut4 lut{};
  for (int b = 0; b < 256; ++b) {
    lut[b][0] = static_cast<float>(b & 15);
    lut[b][1] = static_cast<float>(b >> 4);
  }
  return lut;
}
constexpr Lut2 kLut2 = MakeLut2();
constexpr Lut4 kLut4 = MakeLut4();

void Unpack2(const uint8_t* src, size_t bytes, float* dst) {
  for (size_t j = 0; j < bytes; ++j) std::memcpy(dst + 4 * j, kLut2[src[j]].data(), 16);
}
void Unpack4(const uint8_t* src, size_t bytes, float* dst) {
  for (size_t j = 0; j < bytes; ++j) std::memcpy(dst + 2 * j, kLut4[src[j]].data(), 8);
}
// BF16 words (possibly unaligned bytes) to fp32: exact, a 16-bit shift.
void WidenBf16(const void* src, size_t n, float* dst) {
  const uint8_t* bytes = static_cast<const uint8_t*>(src);
  for (size_t i = 0; i < n; ++i) {
    uint16_t w;
    std::memcpy(&w, bytes + 2 * i, sizeof(w));
    const uint32_t u = static_cast<uint32_t>(w) << 16;
    std::memcpy(dst + i, &u, sizeof(u));
  }
}
void WidenMeta(const uint8_t* src, size_t pairs, ScaleDtype dtype, float* scale, float* min) {
  for (size_t i = 0; i < pairs; ++i) {
    GroupMeta m;
    std::memcpy(&m, src + sizeof(GroupMeta) * i, sizeof(m));
    scale[i] = ScaleWordToFloat(m.scale, dtype);
    min[i] = ScaleWordToFloat(m.min, dtype);
  }
}

// Up to `count` tokens of one KV head in fp32. For quantized tiles k/v hold the codes as floats
// and the per-(token, group) scale/min are given, so x = min + scale * code; BF16 tiles hold the
// values and no scale/min.
struct Tile {
  int count = 0;
  const float* k = nullptr;  // [count][D]
  const float* v = nullptr;  // [count][D]
  bool quantized = false;
  const float* k_scale = nullptr;  // [count][groups], only when quantized
  const float* k_min = nullptr;
  const float* v_scale = nullptr;
  const float* v_min = nullptr;
};

// Online softmax over tiles for all query heads, in fp32. For a quantized tile the scale and
// min are folded out of the inner loops:
//   q.k = sum_g (m_g * sum(q_g) + s_g * (q_g . c_g))
//   sum_t p_t v_t = sum_t (p_t s_t) c_t + (sum_t p_t m_t)   per group
// so the inner loops are plain dot products and axpys over the code floats.
class OnlineAttention {
 public:
  OnlineAttention(const AttentionShape& shape, int group_size, int max_tile,
                  absl::Span<const float> q)
      : d_(shape.head_dim),
        hq_(shape.q_heads),
        g_(shape.q_heads / shape.kv_heads),
        gs_(group_size),
        groups_(shape.head_dim / group_size),
        max_tile_(max_tile),
        q_(q.size()),
        q_sum_(static_cast<size_t>(hq_) * groups_, 0.0f),
        m_(hq_, kNegInf),
        l_(hq_, 0.0f),
        acc_(static_cast<size_t>(hq_) * d_, 0.0f),
        acc_min_(static_cast<size_t>(hq_) * groups_, 0.0f),
        p_(static_cast<size_t>(g_) * max_tile, 0.0f) {
    // Folding 1/sqrt(D) into q saves a multiply per logit.
    const float scale = 1.0f / std::sqrt(static_cast<float>(d_));
    for (size_t i = 0; i < q.size(); ++i) q_[i] = q[i] * scale;
    for (int h = 0; h < hq_; ++h) {
      for (int gi = 0; gi < groups_; ++gi) {
        const float* qg = &q_[static_cast<size_t>(h) * d_ + static_cast<size_t>(gi) * gs_];
        float s = 0.0f;
        for (int d = 0; d < gs_; ++d) s += qg[d];
        q_sum_[static_cast<size_t>(h) * groups_ + gi] = s;
      }
    }
  }

  // Attends the g query heads of `kv_head` over `tile`.
  void Consume(int kv_head, const Tile& tile) {
    const int n = tile.count;
    if (n <= 0) return;
    assert(n <= max_tile_);
    const int first = kv_head * g_;
    // Logits of all g heads first: each K row is read from L1 by every head.
    for (int j = 0; j < g_; ++j) {
      const int h = first + j;
      const float* q = &q_[static_cast<size_t>(h) * d_];
      float* p = &p_[static_cast<size_t>(j) * max_tile_];
      if (tile.quantized) {
        const float* q_sum = &q_sum_[static_cast<size_t>(h) * groups_];
        for (int t = 0; t < n; ++t) {
          const float* k = tile.k + static_cast<size_t>(t) * d_;
          const size_t meta = static_cast<size_t>(t) * groups_;
          float logit = 0.0f;
          for (int gi = 0; gi < groups_; ++gi) {
            const size_t off = static_cast<size_t>(gi) * gs_;
            logit += tile.k_min[meta + gi] * q_sum[gi] +
                     tile.k_scale[meta + gi] * Dot(q + off, k + off, gs_);
          }
          p[t] = logit;
        }
      } else {
        for (int t = 0; t < n; ++t) p[t] = Dot(q, tile.k + static_cast<size_t>(t) * d_, d_);
      }
    }
    for (int j = 0; j < g_; ++j) {
      const int h = first + j;
      float* p = &p_[static_cast<size_t>(j) * max_tile_];
      float mx = m_[h];
      for (int t = 0; t < n; ++t) mx = std::max(mx, p[t]);
      // Only -inf logits (inf inputs): nothing attended, and exp(-inf - -inf) would be NaN.
      if (mx == kNegInf) continue;
      const float alpha = std::exp(m_[h] - mx);  // 0 on the first tile (m = -inf)
      float sum = 0.0f;
      for (int t = 0; t < n; ++t) {
        p[t] = std::exp(p[t] - mx);
        sum += p[t];
      }
      m_[h] = mx;
      l_[h] = l_[h] * alpha + sum;
      float* __restrict acc = &acc_[static_cast<size_t>(h) * d_];
      for (int d = 0; d < d_; ++d) acc[d] *= alpha;
      if (tile.quantized) {
        float* acc_min = &acc_min_[static_cast<size_t>(h) * groups_];
        for (int gi = 0; gi < groups_; ++gi) acc_min[gi] *= alpha;
        for (int t = 0; t < n; ++t) {
          const float* __restrict v = tile.v + static_cast<size_t>(t) * d_;
          const size_t meta = static_cast<size_t>(t) * groups_;
          for (int gi = 0; gi < groups_; ++gi) {
            const float w = p[t] * tile.v_scale[meta + gi];
            acc_min[gi] += p[t] * tile.v_min[meta + gi];
            const size_t off = static_cast<size_t>(gi) * gs_;
            for (int d = 0; d < gs_; ++d) acc[off + d] += w * v[off + d];
          }
        }
      } else {
        for (int t = 0; t < n; ++t) {
          const float w = p[t];
          const float* __restrict v = tile.v + static_cast<size_t>(t) * d_;
          for (int d = 0; d < d_; ++d) acc[d] += w * v[d];
        }
      }
    }
  }

  AttentionOutput Finish() const {
    AttentionOutput r;
    r.out.assign(static_cast<size_t>(hq_) * d_, 0.0f);
    r.lse.assign(hq_, kNegInf);
    for (int h = 0; h < hq_; ++h) {
      if (!(l_[h] > 0.0f)) continue;  // empty: zero output, lse = -inf
      const float inv = 1.0f / l_[h];
      for (int d = 0; d < d_; ++d) {
        const size_t i = static_cast<size_t>(h) * d_ + d;
        r.out[i] = (acc_[i] + acc_min_[static_cast<size_t>(h) * groups_ + d / gs_]) * inv;
      }
      r.lse[h] = m_[h] + std::log(l_[h]);
    }
    return r;
  }

 private:
  const int d_;
  const int hq_;
  const int g_;
  const int gs_;
  const int groups_;
  const int max_tile_;
  std::vector<float> q_;        // [Hq][D], scaled by 1/sqrt(D)
  std::vector<float> q_sum_;    // [Hq][groups]
  std::vector<float> m_;        // [Hq] running max logit
  std::vector<float> l_;        // [Hq] running sum of exp(logit - m)
  std::vector<float> acc_;      // [Hq][D] unnormalized output (code part for quantized tiles)
  std::vector<float> acc_min_;  // [Hq][groups] sum of p * min per group
  std::vector<float> p_;        // [g][max_tile] logits, then probabilities
};

bool ValidShape(const AttentionShape& s) {
  return s.q_heads > 0 && s.kv_heads > 0 && s.head_dim > 0 && s.q_heads % s.kv_heads == 0;
}

// What a precondition violation returns: loud (NaN) rather than a plausible empty result.
AttentionOutput InvalidOutput(const AttentionShape& s) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  AttentionOutput r;
  r.out.assign(static_cast<size_t>(std::max(s.q_heads, 0)) * std::max(s.head_dim, 0), nan);
  r.lse.assign(std::max(s.q_heads, 0), nan);
  return r;
}

AttentionOutput EmptyOutput(const AttentionShape& s) {
  AttentionOutput r;
  r.out.assign(static_cast<size_t>(s.q_heads) * s.head_dim, 0.0f);
  r.lse.assign(s.q_heads, kNegInf);
  return r;
}

}  // namespace

AttentionOutput AttendBf16Rows(const AttentionShape& shape, absl::Span<const float> q,
                               absl::Span<const Bf16> k, absl::Span<const Bf16> v, int n) {
  const size_t row = ValidShape(shape) ? static_cast<size_t>(shape.kv_heads) * shape.head_dim : 0;
  if (!ValidShape(shape) || n < 0 ||
      q.size() != static_cast<size_t>(shape.q_heads) * shape.head_dim || k.size() < row * n ||
      v.size() < row * n) {
    assert(false && "AttendBf16Rows: shapes do not agree");
    return InvalidOutput(shape);
  }
  if (n == 0) return EmptyOutput(shape);

  const int d = shape.head_dim;
  OnlineAttention att(shape, /*group_size=*/d, kRowTile, q);
  std::vector<float> k_tile(static_cast<size_t>(kRowTile) * d);
  std::vector<float> v_tile(static_cast<size_t>(kRowTile) * d);
  for (int start = 0; start < n; start += kRowTile) {
    const int count = std::min(kRowTile, n - start);
    for (int h = 0; h < shape.kv_heads; ++h) {
      for (int t = 0; t < count; ++t) {
        const size_t src = (static_cast<size_t>(start + t) * shape.kv_heads + h) * d;
        WidenBf16(k.data() + src, d, &k_tile[static_cast<size_t>(t) * d]);
        WidenBf16(v.data() + src, d, &v_tile[static_cast<size_t>(t) * d]);
      }
      Tile tile;
      tile.count = count;
      tile.k = k_tile.data();
      tile.v = v_tile.data();
      att.Consume(h, tile);
    }
  }
  return att.Finish();
}

AttentionOutput AttendBlocks(const AttentionShape& shape, const RowCodec& codec,
                             const BlockLayout& layout, absl::Span<const uint8_t* const> blocks,
                             int tokens, absl::Span<const float> q) {
  const int d = shape.head_dim;
  const int bits = layout.bits;
  const bool quantized = bits != 16;
  bool ok = ValidShape(shape) && tokens >= 0 &&
            q.size() == static_cast<size_t>(shape.q_heads) * d &&
            layout.kv_heads == shape.kv_heads && layout.head_dim == d && codec.head_dim() == d &&
            layout.tokens > 0 && (bits == 2 || bits == 4 || bits == 16) &&
            bits == codec.config().StoredBits() &&
            (!quantized || (layout.group_size > 0 && d % layout.group_size == 0 &&
                            layout.group_size == codec.layout().group_size));
  const int needed = ok ? (tokens + layout.tokens - 1) / layout.tokens : 0;
  ok = ok && blocks.size() >= static_cast<size_t>(needed);
  for (int b = 0; ok && b < needed; ++b) ok = blocks[b] != nullptr;
  if (!ok) {
    assert(false && "AttendBlocks: shape, layout and codec do not agree");
    return InvalidOutput(shape);
  }
  if (tokens == 0) return EmptyOutput(shape);

  const int bt = layout.tokens;
  const int gs = quantized ? layout.group_size : d;
  const size_t groups = quantized ? static_cast<size_t>(d / gs) : 0;
  const ScaleDtype dtype = codec.config().scale_dtype;
  OnlineAttention att(shape, gs, bt, q);
  std::vector<float> k_tile(static_cast<size_t>(bt) * d);
  std::vector<float> v_tile(static_cast<size_t>(bt) * d);
  std::vector<float> meta(4 * static_cast<size_t>(bt) * std::max<size_t>(groups, 1));
  float* k_scale = meta.data();
  float* k_min = k_scale + bt * groups;
  float* v_scale = k_min + bt * groups;
  float* v_min = v_scale + bt * groups;

  // One block at a time, each KV head's codes read once for all its query heads.
  for (int b = 0; b < needed; ++b) {
    const int count = std::min(bt, tokens - b * bt);
    const uint8_t* block = blocks[b];
    for (int h = 0; h < shape.kv_heads; ++h) {
      const uint8_t* kc = block + layout.CodesOffset(KvTensor::kKey, h);
      const uint8_t* vc = block + layout.CodesOffset(KvTensor::kValue, h);
      const size_t code_bytes = count * layout.code_bytes_per_row();
      Tile tile;
      tile.count = count;
      tile.k = k_tile.data();
      tile.v = v_tile.data();
      if (bits == 16) {
        WidenBf16(kc, static_cast<size_t>(count) * d, k_tile.data());
        WidenBf16(vc, static_cast<size_t>(count) * d, v_tile.data());
      } else {
        if (bits == 2) {
          Unpack2(kc, code_bytes, k_tile.data());
          Unpack2(vc, code_bytes, v_tile.data());
        } else {
          Unpack4(kc, code_bytes, k_tile.data());
          Unpack4(vc, code_bytes, v_tile.data());
        }
        WidenMeta(block + layout.MetaOffset(KvTensor::kKey, h), count * groups, dtype, k_scale,
                  k_min);
        WidenMeta(block + layout.MetaOffset(KvTensor::kValue, h), count * groups, dtype, v_scale,
                  v_min);
        tile.quantized = true;
        tile.k_scale = k_scale;
        tile.k_min = k_min;
        tile.v_scale = v_scale;
        tile.v_min = v_min;
      }
      att.Consume(h, tile);
    }
  }
  return att.Finish();
}

void MergeAttention(const AttentionShape& shape, const AttentionOutput& part,
                    AttentionOutput* acc) {
  const size_t hq = static_cast<size_t>(std::max(shape.q_heads, 0));
  const size_t d = static_cast<size_t>(std::max(shape.head_dim, 0));
  // A default-constructed accumulator is the empty set.
  if (acc->out.size() != hq * d || acc->lse.size() != hq) *acc = EmptyOutput(shape);
  if (part.out.size() != hq * d || part.lse.size() != hq) {
    assert(part.out.empty() && part.lse.empty() && "MergeAttention: part has the wrong shape");
    return;
  }
  for (size_t h = 0; h < hq; ++h) {
    const float a = acc->lse[h];
    const float b = part.lse[h];
    float* o = &acc->out[h * d];
    const float* po = &part.out[h * d];
    if (b == kNegInf) continue;  // nothing to add (also keeps exp(-inf - -inf) out)
    if (a == kNegInf) {
      std::copy(po, po + d, o);
      acc->lse[h] = b;
      continue;
    }
    const float m = std::max(a, b);
    const float wa = std::exp(a - m);  // one of the two weights is exactly 1
    const float wb = std::exp(b - m);
    const float sum = wa + wb;
    const float ca = wa / sum;
    const float cb = wb / sum;
    for (size_t i = 0; i < d; ++i) o[i] = ca * o[i] + cb * po[i];
    acc->lse[h] = m + std::log(sum);
  }
}

AttentionOutput DenseAttentionReference(const AttentionShape& shape, absl::Span<const float> q,
                                        absl::Span<const float> k, absl::Span<const float> v,
                                        int n) {
  const size_t row = ValidShape(shape) ? static_cast<size_t>(shape.kv_heads) * shape.head_dim : 0;
  if (!ValidShape(shape) || n < 0 ||
      q.size() != static_cast<size_t>(shape.q_heads) * shape.head_dim || k.size() < row * n ||
      v.size() < row * n) {
    assert(false && "DenseAttentionReference: shapes do not agree");
    return InvalidOutput(shape);
  }
  AttentionOutput r = EmptyOutput(shape);
  if (n == 0) return r;
  const int d = shape.head_dim;
  const int g = shape.q_heads / shape.kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> logits(n);
  std::vector<double> out(d);
  for (int j = 0; j < shape.q_heads; ++j) {
    const int h = j / g;
    const float* qj = &q[static_cast<size_t>(j) * d];
    double mx = -std::numeric_limits<double>::infinity();
    for (int t = 0; t < n; ++t) {
      const float* kt = &k[(static_cast<size_t>(t) * shape.kv_heads + h) * d];
      double s = 0.0;
      for (int i = 0; i < d; ++i) s += static_cast<double>(qj[i]) * kt[i];
      logits[t] = s * scale;
      mx = std::max(mx, logits[t]);
    }
    double sum = 0.0;
    std::fill(out.begin(), out.end(), 0.0);
    for (int t = 0; t < n; ++t) {
      const double p = std::exp(logits[t] - mx);
      sum += p;
      const float* vt = &v[(static_cast<size_t>(t) * shape.kv_heads + h) * d];
      for (int i = 0; i < d; ++i) out[i] += p * vt[i];
    }
    for (int i = 0; i < d; ++i)
      r.out[static_cast<size_t>(j) * d + i] = static_cast<float>(out[i] / sum);
    r.lse[j] = static_cast<float>(mx + std::log(sum));
  }
  return r;
}

}  // namespace kvpool
