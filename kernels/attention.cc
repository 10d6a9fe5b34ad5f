#include "kernels/attention.h"

#include <algorithm>
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
// Dot products keep kLanes independent partial sums per token: without -ffast-math the compiler
// must keep a single float sum in order and could not vectorize it. Four tokens share each load
// of q, and their four sums hide the add latency.
constexpr int kTokensPerPass = 4;

template <int kLanes>
[[gnu::always_inline]] inline float ReduceLanes(float* part) {
  for (int w = kLanes / 2; w > 0; w /= 2) {
    for (int i = 0; i < w; ++i) part[i] += part[i + w];
  }
  return part[0];
}

// out[r] = q . k[r * stride ...] over n dims, for r < 4. n is a multiple of kLanes.
template <int kLanes>
[[gnu::always_inline]] inline void Dot4Lanes(const float* __restrict q, const float* __restrict k,
                                             size_t stride, int n, float* out) {
  float p0[kLanes] = {}, p1[kLanes] = {}, p2[kLanes] = {}, p3[kLanes] = {};
  const float* __restrict k0 = k;
  const float* __restrict k1 = k + stride;
  const float* __restrict k2 = k + 2 * stride;
  const float* __restrict k3 = k + 3 * stride;
  for (int d = 0; d < n; d += kLanes) {
    for (int i = 0; i < kLanes; ++i) {
      const float x = q[d + i];
      p0[i] += x * k0[d + i];
      p1[i] += x * k1[d + i];
      p2[i] += x * k2[d + i];
      p3[i] += x * k3[d + i];
    }
  }
  out[0] = ReduceLanes<kLanes>(p0);
  out[1] = ReduceLanes<kLanes>(p1);
  out[2] = ReduceLanes<kLanes>(p2);
  out[3] = ReduceLanes<kLanes>(p3);
}

template <int kLanes>
[[gnu::always_inline]] inline float DotLanes(const float* __restrict q, const float* __restrict k,
                                             int n) {
  float part[kLanes] = {};
  for (int d = 0; d < n; d += kLanes) {
    for (int i = 0; i < kLanes; ++i) part[i] += q[d + i] * k[d + i];
  }
  return ReduceLanes<kLanes>(part);
}

// n is a power of two >= 8 (head dims and group sizes are); the width test is predictable.
[[gnu::always_inline]] inline void Dot4(const float* q, const float* k, size_t stride, int n,
                                        float* out) {
  if (n % 16 == 0) {
    Dot4Lanes<16>(q, k, stride, n, out);
  } else {
    Dot4Lanes<8>(q, k, stride, n, out);
  }
}
[[gnu::always_inline]] inline float Dot(const float* q, const float* k, int n) {
  return n % 16 == 0 ? DotLanes<16>(q, k, n) : DotLanes<8>(q, k, n);
}

// max(init, x[0..n)), with 8 independent lanes so the compiler can vectorize it (a single
// running max is a chain of dependent compares).
float MaxWithLogits(float init, const float* x, int n) {
  constexpr int kMaxLanes = 8;
  float lanes[kMaxLanes];
  for (int i = 0; i < kMaxLanes; ++i) lanes[i] = init;
  int t = 0;
  for (; t + kMaxLanes <= n; t += kMaxLanes) {
    for (int i = 0; i < kMaxLanes; ++i) lanes[i] = lanes[i] > x[t + i] ? lanes[i] : x[t + i];
  }
  float m = init;
  for (; t < n; ++t) m = std::max(m, x[t]);
  for (int i = 0; i < kMaxLanes; ++i) m = std::max(m, lanes[i]);
  return m;
}

// Codes to fp32 in dim order (block_layout.h). Written as shifts and masks per byte: the
// compiler vectorizes these; a lookup table measured no faster for 2-bit and slower for 4-bit.
void Unpack2(const uint8_t* src, size_t bytes, float* dst) {
  for (size_t j = 0; j < bytes; ++j) {
    const unsigned b = src[j];
    dst[4 * j] = static_cast<float>(b & 3u);
    dst[4 * j + 1] = static_cast<float>((b >> 2) & 3u);
    dst[4 * j + 2] = static_cast<float>((b >> 4) & 3u);
    dst[4 * j + 3] = static_cast<float>(b >> 6);
  }
}
void Unpack4(const uint8_t* src, size_t bytes, float* dst) {
  for (size_t j = 0; j < bytes; ++j) {
    const unsigned b = src[j];
    dst[2 * j] = static_cast<float>(b & 15u);
    dst[2 * j + 1] = static_cast<float>(b >> 4);
  }
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

// Up to `count` tokens of one KV head in fp32, as x = min + scale * c per (token, group): for
// quantized tiles c are the codes, for BF16 tiles the values with scale 1 and min 0 (exact).
struct Tile {
  int count = 0;
  const float* k = nullptr;        // [count][D]
  const float* v = nullptr;        // [count][D]
  const float* k_scale = nullptr;  // [count][groups]
  const float* k_min = nullptr;
  const float* v_scale = nullptr;
  const float* v_min = nullptr;
};

// Online softmax over tiles for all query heads, in fp32. Scale and min are folded out of the
// inner loops:
//   q.k = sum_g (m_g * sum(q_g) + s_g * (q_g . c_g))
//   sum_t p_t v_t = sum_t (p_t s_t) c_t + (sum_t p_t m_t)   per group
// so the inner loops are plain dot products and axpys over contiguous floats.
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
    const size_t row = static_cast<size_t>(d_);
    const size_t groups = static_cast<size_t>(groups_);
    // Logits of all g heads first: the K tile stays in L1 for every head.
    for (int j = 0; j < g_; ++j) {
      const int h = first + j;
      const float* q = &q_[h * row];
      const float* q_sum = &q_sum_[h * groups];
      float* p = &p_[j * static_cast<size_t>(max_tile_)];
      for (int t = 0; t < n; ++t) p[t] = 0.0f;
      for (int gi = 0; gi < groups_; ++gi) {
        const size_t off = static_cast<size_t>(gi) * gs_;
        int t = 0;
        for (; t + kTokensPerPass <= n; t += kTokensPerPass) {
          float dots[kTokensPerPass];
          Dot4(q + off, tile.k + t * row + off, row, gs_, dots);
          for (int r = 0; r < kTokensPerPass; ++r) {
            const size_t m = (t + r) * groups + gi;
            p[t + r] += tile.k_min[m] * q_sum[gi] + tile.k_scale[m] * dots[r];
          }
        }
        for (; t < n; ++t) {
          const size_t m = t * groups + gi;
          p[t] += tile.k_min[m] * q_sum[gi] +
                  tile.k_scale[m] * Dot(q + off, tile.k + t * row + off, gs_);
        }
      }
    }
    for (int j = 0; j < g_; ++j) {
      const int h = first + j;
      float* p = &p_[j * static_cast<size_t>(max_tile_)];
      const float mx = MaxWithLogits(m_[h], p, n);
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
      float* __restrict acc = &acc_[h * row];
      float* __restrict acc_min = &acc_min_[h * groups];
      for (int d = 0; d < d_; ++d) acc[d] *= alpha;
      for (int gi = 0; gi < groups_; ++gi) acc_min[gi] *= alpha;
      for (int gi = 0; gi < groups_; ++gi) {
        const size_t off = static_cast<size_t>(gi) * gs_;
        int t = 0;
        // Four tokens per pass over the accumulator: a quarter of the loads and stores.
        for (; t + kTokensPerPass <= n; t += kTokensPerPass) {
          const size_t m0 = t * groups + gi, m1 = m0 + groups, m2 = m1 + groups, m3 = m2 + groups;
          const float w0 = p[t] * tile.v_scale[m0], w1 = p[t + 1] * tile.v_scale[m1];
          const float w2 = p[t + 2] * tile.v_scale[m2], w3 = p[t + 3] * tile.v_scale[m3];
          acc_min[gi] += (p[t] * tile.v_min[m0] + p[t + 1] * tile.v_min[m1]) +
                         (p[t + 2] * tile.v_min[m2] + p[t + 3] * tile.v_min[m3]);
          const float* __restrict v0 = tile.v + t * row + off;
          const float* __restrict v1 = v0 + row;
          const float* __restrict v2 = v1 + row;
          const float* __restrict v3 = v2 + row;
          float* __restrict a = acc + off;
          for (int d = 0; d < gs_; ++d) {
            a[d] += (w0 * v0[d] + w1 * v1[d]) + (w2 * v2[d] + w3 * v3[d]);
          }
        }
        for (; t < n; ++t) {
          const size_t m = t * groups + gi;
          const float w = p[t] * tile.v_scale[m];
          acc_min[gi] += p[t] * tile.v_min[m];
          const float* __restrict v = tile.v + t * row + off;
          float* __restrict a = acc + off;
          for (int d = 0; d < gs_; ++d) a[d] += w * v[d];
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
  const std::vector<float> ones(kRowTile, 1.0f);
  const std::vector<float> zeros(kRowTile, 0.0f);
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
      tile.k_scale = tile.v_scale = ones.data();
      tile.k_min = tile.v_min = zeros.data();
      att.Consume(h, tile);
    }
  }
  return att.Finish();
}

AttentionOutput AttendBlocks(const AttentionShape& shape, const RowCodec& codec,
                             const BlockLayout& layout, absl::Span<const uint8_t* const> blocks,
                             int tokens, absl::Span<const float> q) {
  return AttendBlocksFrom(shape, codec, layout, blocks, /*first_slot=*/0, tokens, q);
}

AttentionOutput AttendBlocksFrom(const AttentionShape& shape, const RowCodec& codec,
                                 const BlockLayout& layout, absl::Span<const uint8_t* const> blocks,
                                 int first_slot, int tokens, absl::Span<const float> q) {
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
  ok = ok && first_slot >= 0 && first_slot < layout.tokens;
  const int needed =
      ok ? static_cast<int>((static_cast<int64_t>(first_slot) + tokens + layout.tokens - 1) /
                            layout.tokens)
         : 0;
  ok = ok && blocks.size() >= static_cast<size_t>(needed);
  for (int b = 0; ok && b < needed; ++b) ok = blocks[b] != nullptr;
  if (!ok) {
    assert(false && "AttendBlocks: shape, layout and codec do not agree");
    return InvalidOutput(shape);
  }
  if (tokens == 0) return EmptyOutput(shape);

  const int bt = layout.tokens;
  const int gs = quantized ? layout.group_size : d;
  const size_t groups = static_cast<size_t>(d / gs);
  const ScaleDtype dtype = codec.config().scale_dtype;
  OnlineAttention att(shape, gs, bt, q);
  std::vector<float> k_tile(static_cast<size_t>(bt) * d);
  std::vector<float> v_tile(static_cast<size_t>(bt) * d);
  // Per-(token, group) scale and min; the BF16 bypass keeps scale 1 and min 0.
  std::vector<float> k_scale(bt * groups, 1.0f), k_min(bt * groups, 0.0f);
  std::vector<float> v_scale(bt * groups, 1.0f), v_min(bt * groups, 0.0f);

  // One block at a time, each KV head's codes read once for all its query heads.
  // Block b holds slots [start, end) of the range (only the first block starts part way).
  const int64_t end_slot = static_cast<int64_t>(first_slot) + tokens;
  for (int b = 0; b < needed; ++b) {
    const int start = b == 0 ? first_slot : 0;
    const int count = static_cast<int>(std::min<int64_t>(bt, end_slot - int64_t{b} * bt)) - start;
    const uint8_t* block = blocks[b];
    const size_t code_skip = start * layout.code_bytes_per_row();
    const size_t meta_skip = start * layout.meta_bytes_per_row();
    for (int h = 0; h < shape.kv_heads; ++h) {
      const uint8_t* kc = block + layout.CodesOffset(KvTensor::kKey, h) + code_skip;
      const uint8_t* vc = block + layout.CodesOffset(KvTensor::kValue, h) + code_skip;
      const size_t code_bytes = count * layout.code_bytes_per_row();
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
        WidenMeta(block + layout.MetaOffset(KvTensor::kKey, h) + meta_skip, count * groups, dtype,
                  k_scale.data(), k_min.data());
        WidenMeta(block + layout.MetaOffset(KvTensor::kValue, h) + meta_skip, count * groups, dtype,
                  v_scale.data(), v_min.data());
      }
      Tile tile;
      tile.count = count;
      tile.k = k_tile.data();
      tile.v = v_tile.data();
      tile.k_scale = k_scale.data();
      tile.k_min = k_min.data();
      tile.v_scale = v_scale.data();
      tile.v_min = v_min.data();
      att.Consume(h, tile);
    }
  }
  return att.Finish();
}

void MergeAttention(const AttentionShape& shape, const AttentionOutput& part,
                    AttentionOutput* acc) {
  const size_t hq = static_cast<size_t>(std::max(shape.q_heads, 0));
  const size_t d = static_cast<size_t>(std::max(shape.head_dim, 0));
  const auto shaped = [&](const AttentionOutput& r) {
    return r.out.size() == hq * d && r.lse.size() == hq;
  };
  const auto unset = [](const AttentionOutput& r) { return r.out.empty() && r.lse.empty(); };
  if (!ValidShape(shape) || !(shaped(*acc) || unset(*acc)) || !(shaped(part) || unset(part))) {
    assert(false && "MergeAttention: outputs do not match the shape");
    *acc = InvalidOutput(shape);
    return;
  }
  // A default-constructed AttentionOutput is the empty token set.
  if (unset(*acc)) *acc = EmptyOutput(shape);
  if (unset(part)) return;
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
