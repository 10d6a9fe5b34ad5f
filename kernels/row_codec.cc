#include "kernels/row_codec.h"

#include <algorithm>
#include <array>
#include <cassert>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) || defined(__BMI2__) || defined(__AVX512BW__)
#include <immintrin.h>
#endif

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/value_range.h"

namespace kvpool {
namespace {

constexpr int kMaxHeadDim = 256;

// Lloyd-Max constants (docs/oscar-method.md section 8), evaluated in fp32 like the reference:
// kLloydMaxStep == 1.16739297f (0x3f956d5b).
constexpr float kLloydMaxStep = (2.0f * 1.50956f / 3.0f) * 1.16f;
constexpr float kLloydMaxThreshold = 0.98107f;
constexpr float kLloydMaxEps = 1e-8f;

// BF16 bit patterns: |x| >= kNonFiniteAbsBits is Inf or NaN.
constexpr uint16_t kNonFiniteAbsBits = 0x7f80;
// Rows whose largest |x| is at most this can never overflow the 16-bit scale/min (uniform:
// |min| <= |x|, scale <= 2|x|/3; Lloyd-Max: sigma <= 2|x|, |mu - 1.5 s| <= 4.6|x|). Blocks of
// such rows are encoded in place; others go through a staging buffer so errors write nothing.
constexpr uint16_t kSafeAbsBitsFp16 = 0x4600;  // 8192
constexpr uint16_t kSafeAbsBitsBf16 = 0x5b80;  // 2^56: keeps the Lloyd-Max variance finite

absl::Status MagnitudeError() {
  return absl::OutOfRangeError(
      absl::StrCat("row has a value of magnitude >= ", kValueMagnitudeLimit,
                   " (after rotation): kvpool stores |x| < 2^16"));
}

float Bf16BitsToFloat(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Byte -> the codes it holds, one per byte (little end first), so Decode expands a row with
// one table load per byte and then runs a vectorized m + code * s loop.
struct DecodeTables {
  uint32_t two_bit[256];
  uint16_t four_bit[256];
};

constexpr DecodeTables MakeDecodeTables() {
  DecodeTables t{};
  for (uint32_t b = 0; b < 256; ++b) {
    for (uint32_t i = 0; i < 4; ++i) t.two_bit[b] |= ((b >> (2 * i)) & 3u) << (8 * i);
    t.four_bit[b] = static_cast<uint16_t>((b & 15u) | ((b >> 4) << 8));
  }
  return t;
}

constexpr DecodeTables kDecodeTables = MakeDecodeTables();
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "tables are copied out as bytes");

// c = clamp(floor(r * D), 0, D-1), in fp32.
int ClipIndex(float ratio, int d) {
  const float f = std::floor(ratio * static_cast<float>(d));
  if (!(f < static_cast<float>(d - 1))) return d - 1;
  if (!(f > 0.0f)) return 0;
  return static_cast<int>(f);
}

// Normative summation order (row_codec.h): pairwise halving, v[i] += v[i + n/2] until one
// value is left. Destroys v; n is a power of two.
float HalvingSum(float* v, int n) {
  for (int h = n / 2; h >= 1; h /= 2) {
    for (int i = 0; i < h; ++i) v[i] = v[i] + v[i + h];
  }
  return v[0];
}

// The c-th smallest of the row's |x| (0-based), as BF16 magnitude bits, which order exactly
// like the magnitudes. Exact: builds the answer bit by bit from the top, keeping a bit when at
// least D - c keys are >= the candidate, so the result is the (D - c)-th largest key. The
// counting loop vectorizes; at D = 128 this is >10x faster than std::nth_element (which
// ClipThreshold uses on floats), and it costs the same for every ratio.
#if defined(__AVX2__)
// Number of keys >= `candidate` among 32 * kPairs keys. Magnitudes are < 0x8000, so
// the signed 16-bit compare orders them; two compare results are packed into one byte mask.
template <int kPairs>
inline int CountAtLeast(const __m256i (&keys)[2 * kPairs], uint32_t candidate) {
  // keys >= candidate  <=>  keys > candidate - 1
  const __m256i below = _mm256_set1_epi16(static_cast<int16_t>(candidate - 1));
  int count = 0;
  for (int r = 0; r < kPairs; ++r) {
    const __m256i packed = _mm256_packs_epi16(_mm256_cmpgt_epi16(keys[2 * r], below),
                                              _mm256_cmpgt_epi16(keys[2 * r + 1], below));
    count += __builtin_popcount(static_cast<uint32_t>(_mm256_movemask_epi8(packed)));
  }
  return count;
}

// The AVX2 body of SelectMagnitudeBits for D = 32 * kPairs. Two bits of the answer per step:
// the three candidates of a step are counted independently, which halves the serial chain.
template <int kPairs>
uint16_t SelectMagnitudeBitsAvx2(const uint16_t* words, int k, int top_bit) {
  __m256i keys[2 * kPairs];
  const __m256i abs_mask = _mm256_set1_epi16(0x7fff);
  for (int r = 0; r < 2 * kPairs; ++r) {
    keys[r] = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + 16 * r)),
                               abs_mask);
  }
  uint32_t v = 0;
  int bit = top_bit;
  if ((bit & 1) == 0) {  // an odd number of bits to decide: take the top one alone
    const uint32_t candidate = 1u << bit;
    if (CountAtLeast<kPairs>(keys, candidate) >= k) v = candidate;
    --bit;
  }
  for (; bit >= 1; bit -= 2) {
    const uint32_t low = bit - 1;
    const uint32_t c1 = v | (1u << low), c2 = v | (2u << low), c3 = v | (3u << low);
    const int n1 = CountAtLeast<kPairs>(keys, c1);
    const int n2 = CountAtLeast<kPairs>(keys, c2);
    const int n3 = CountAtLeast<kPairs>(keys, c3);
    v = n3 >= k ? c3 : n2 >= k ? c2 : n1 >= k ? c1 : v;
  }
  return static_cast<uint16_t>(v);
}
#endif

uint16_t SelectMagnitudeBits(const uint16_t* words, int d, int c, uint16_t max_abs) {
  const int k = d - c;
  const int top_bit = 31 - __builtin_clz(static_cast<uint32_t>(max_abs) | 1u);
#if defined(__AVX2__)
  switch (d) {
    case 32:
      return SelectMagnitudeBitsAvx2<1>(words, k, top_bit);
    case 64:
      return SelectMagnitudeBitsAvx2<2>(words, k, top_bit);
    case 128:
      return SelectMagnitudeBitsAvx2<4>(words, k, top_bit);
    case 256:
      return SelectMagnitudeBitsAvx2<8>(words, k, top_bit);
    default:
      break;
  }
#endif
  uint16_t keys[kMaxHeadDim];
  for (int j = 0; j < d; ++j) keys[j] = words[j] & 0x7fff;
  uint32_t v = 0;
  for (int bit = top_bit; bit >= 0; --bit) {
    const uint16_t candidate = static_cast<uint16_t>(v | (1u << bit));
    int count = 0;
    for (int j = 0; j < d; ++j) count += keys[j] >= candidate;
    if (count >= k) v = candidate;
  }
  return static_cast<uint16_t>(v);
}

// Group min and max with the semantics of a sequential scan in dim order (`if (x < mn) mn = x`,
// `if (mx < x) mx = x`), which decides only between +0 and -0. 16 independent lanes let the
// compiler vectorize; a zero result (rare) is redone sequentially to get its sign right.
void GroupMinMax(const float* x, int n, float* mn_out, float* mx_out) {
  constexpr int kLanes = 16;
  float mn = x[0], mx = x[0];
#if defined(__AVX2__)
  // (v < m ? v : m) is exactly MINPS(v, m) and (m < v ? v : m) MAXPS(v, m); GCC keeps the
  // lane loop below scalar, so spell it out. Inputs are finite (checked before).
  if (n % 8 == 0) {
    __m256 vmn = _mm256_loadu_ps(x), vmx = vmn;
    for (int j = 8; j < n; j += 8) {
      const __m256 v = _mm256_loadu_ps(x + j);
      vmn = _mm256_min_ps(v, vmn);
      vmx = _mm256_max_ps(v, vmx);
    }
    float lmn[8], lmx[8];
    _mm256_storeu_ps(lmn, vmn);
    _mm256_storeu_ps(lmx, vmx);
    mn = lmn[0];
    mx = lmx[0];
    for (int l = 1; l < 8; ++l) {
      mn = lmn[l] < mn ? lmn[l] : mn;
      mx = mx < lmx[l] ? lmx[l] : mx;
    }
  } else
#endif
      if (n % kLanes == 0) {
    float lmn[kLanes], lmx[kLanes];
    for (int l = 0; l < kLanes; ++l) lmn[l] = lmx[l] = x[l];
    for (int j = kLanes; j < n; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        const float v = x[j + l];
        lmn[l] = v < lmn[l] ? v : lmn[l];
        lmx[l] = lmx[l] < v ? v : lmx[l];
      }
    }
    mn = lmn[0];
    mx = lmx[0];
    for (int l = 1; l < kLanes; ++l) {
      mn = lmn[l] < mn ? lmn[l] : mn;
      mx = mx < lmx[l] ? lmx[l] : mx;
    }
  }
  if (n % kLanes != 0 || mn == 0.0f || mx == 0.0f) {
    mn = x[0];
    mx = x[0];
    for (int j = 1; j < n; ++j) {
      mn = x[j] < mn ? x[j] : mn;
      mx = mx < x[j] ? x[j] : mx;
    }
  }
  *mn_out = mn;
  *mx_out = mx;
}

// code = clamp(floor((x - m) / s + 0.5f), 0, top) for s != 0. Computed as trunc(clamp(v, 0,
// top)), which is the same for every v (top is an integer, and trunc == floor on [0, top]) and,
// unlike std::floor, lets GCC vectorize the loop.
void QuantizeUniform(const float* __restrict x, int n, float m, float s, float top,
                     uint8_t* __restrict q) {
  for (int j = 0; j < n; ++j) {
    const float v = (x[j] - m) / s + 0.5f;
    q[j] = static_cast<uint8_t>(static_cast<int>(std::min(std::max(v, 0.0f), top)));
  }
}

void StoreMeta(uint8_t* meta_out, const GroupMeta* meta, int groups) {
  std::memcpy(meta_out, meta, sizeof(GroupMeta) * groups);
}

absl::Status WithContext(const absl::Status& s, int row, int head) {
  return absl::Status(s.code(), absl::StrCat("row ", row, " head ", head, ": ", s.message()));
}

// Packs one code per byte (q, d of them) into `codes`: 2-bit codes four to a byte, 4-bit two.
void PackCodes(const uint8_t* q, int d, int bits, uint8_t* codes) {
  if (bits == 2) {
#if defined(__BMI2__)
    // Eight 2-bit codes (one per byte) gathered into 16 bits in dim order.
    for (int j = 0; j < d / 8; ++j) {
      uint64_t w;
      std::memcpy(&w, q + 8 * j, sizeof(w));
      const uint16_t packed = static_cast<uint16_t>(_pext_u64(w, 0x0303030303030303ull));
      std::memcpy(codes + 2 * j, &packed, sizeof(packed));
    }
#else
    for (int j = 0; j < d / 4; ++j) {
      codes[j] = static_cast<uint8_t>(q[4 * j] | (q[4 * j + 1] << 2) | (q[4 * j + 2] << 4) |
                                      (q[4 * j + 3] << 6));
    }
#endif
  } else {
    for (int j = 0; j < d / 2; ++j) {
      codes[j] = static_cast<uint8_t>(q[2 * j] | (q[2 * j + 1] << 4));
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// GCC 12 reports false -W(maybe-)uninitialized for the _mm512_undefined_* passthrough operands
// inside its own AVX-512 intrinsic headers.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
// Keys >= `candidate` among 32 * kNv magnitude keys.
template <int kNv>
inline int CountAtLeast512(const __m512i (&keys)[kNv], uint32_t candidate) {
  const __m512i c = _mm512_set1_epi16(static_cast<int16_t>(candidate));
  int count = 0;
  for (int i = 0; i < kNv; ++i) {
    count += __builtin_popcount(static_cast<uint32_t>(_mm512_cmpge_epu16_mask(keys[i], c)));
  }
  return count;
}

// SelectMagnitudeBits for D = 32 * kNv: the k-th largest key (k >= 1), which is the largest V
// with at least k keys >= V (the count falls as V grows). The BF16 exponent of the answer is
// most often within three of the largest key's, so one step counts at the smallest key of each
// of those four exponents (independent counts) and leaves 7 mantissa bits to decide, two per
// step; otherwise every bit is decided from the top.
template <int kNv>
uint16_t SelectKthLargest512(const __m512i (&keys)[kNv], int k, uint16_t max_abs) {
  uint32_t v = 0;
  int bit = 31 - __builtin_clz(static_cast<uint32_t>(max_abs) | 1u);
  const uint32_t e = max_abs >> 7;
  if (e >= 3) {
    const uint32_t c0 = e << 7, c1 = (e - 1) << 7, c2 = (e - 2) << 7, c3 = (e - 3) << 7;
    const int n0 = CountAtLeast512<kNv>(keys, c0);
    const int n1 = CountAtLeast512<kNv>(keys, c1);
    const int n2 = CountAtLeast512<kNv>(keys, c2);
    const int n3 = CountAtLeast512<kNv>(keys, c3);
    if (n3 >= k) {
      // The answer lies in [c, c + 127] (no key reaches the next exponent's smallest k times).
      v = n0 >= k ? c0 : n1 >= k ? c1 : n2 >= k ? c2 : c3;
      bit = 6;
    }
  }
  if ((bit & 1) == 0) {  // an odd number of bits to decide: take the top one alone
    const uint32_t candidate = v | (1u << bit);
    if (CountAtLeast512<kNv>(keys, candidate) >= k) v = candidate;
    --bit;
  }
  for (; bit >= 1; bit -= 2) {
    const uint32_t low = bit - 1;
    const uint32_t c1 = v | (1u << low), c2 = v | (2u << low), c3 = v | (3u << low);
    const int n1 = CountAtLeast512<kNv>(keys, c1);
    const int n2 = CountAtLeast512<kNv>(keys, c2);
    const int n3 = CountAtLeast512<kNv>(keys, c3);
    v = n3 >= k ? c3 : n2 >= k ? c2 : n1 >= k ? c1 : v;
  }
  return static_cast<uint16_t>(v);
}

// EncodeRowBits for the uniform quantizer with G a multiple of 16 and D = 32 * kNv, in 512-bit
// registers: the same operations on the same values in the same order per element, so the same
// bits (min/max are order-free except for the sign of a zero result, which is redone
// sequentially as in GroupMinMax).
template <int kNv, bool kOneGroup>
absl::Status EncodeUniformRow512(const QuantConfig& cfg, int g, KvTensor t, const uint16_t* words,
                                 uint8_t* codes, uint8_t* meta_out) {
  constexpr int d = 32 * kNv;
  __m512i keys[kNv];
  __m512i vmax = _mm512_setzero_si512();
  const __m512i abs_mask = _mm512_set1_epi16(0x7fff);
  for (int i = 0; i < kNv; ++i) {
    keys[i] = _mm512_and_si512(_mm512_loadu_si512(words + 32 * i), abs_mask);
    vmax = _mm512_max_epu16(vmax, keys[i]);
  }
  const uint16_t max_abs = static_cast<uint16_t>(_mm512_reduce_max_epu32(_mm512_max_epu32(
      _mm512_srli_epi32(vmax, 16), _mm512_and_si512(vmax, _mm512_set1_epi32(0xffff)))));
  if (max_abs >= kNonFiniteAbsBits) {
    return absl::InvalidArgumentError("row contains NaN or Inf");
  }
  if (max_abs >= kValueMagnitudeLimitBf16Bits) return MagnitudeError();

  const float ratio = cfg.ClipRatio(t);
  bool clip = false;
  float tau = std::numeric_limits<float>::infinity();
  if (ratio > 0.0f) {
    const int c = ClipIndex(ratio, d);
    const uint16_t tau_bits = c < d - 1 ? SelectKthLargest512<kNv>(keys, d - c, max_abs) : max_abs;
    clip = tau_bits < max_abs;
    tau = Bf16BitsToFloat(tau_bits);
  }
  // x = clip(BF16 -> fp32): std::min(std::max(x, -tau), tau) is MAXPS(-tau, x), then
  // MINPS(tau, .) (the first operand wins unless the second is strictly beyond it).
  __m512 x[2 * kNv];
  const __m512 vtau = _mm512_set1_ps(tau), vntau = _mm512_set1_ps(-tau);
  for (int i = 0; i < 2 * kNv; ++i) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + 16 * i));
    x[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16));
    if (clip) x[i] = _mm512_min_ps(vtau, _mm512_max_ps(vntau, x[i]));
  }

  // G = D (the default) with compile-time trip counts, so x stays in registers.
  const int groups = kOneGroup ? 1 : d / g;
  const int per_group = kOneGroup ? 2 * kNv : g / 16;
  const int levels = (1 << cfg.bits) - 1;
  GroupMeta meta[kMaxHeadDim / 16];
  float scale[kMaxHeadDim / 16];
  float minimum[kMaxHeadDim / 16];
  for (int k = 0; k < groups; ++k) {
    __m512 vmn = x[k * per_group], vmx = vmn;
    for (int i = 1; i < per_group; ++i) {
      vmn = _mm512_min_ps(x[k * per_group + i], vmn);
      vmx = _mm512_max_ps(x[k * per_group + i], vmx);
    }
    float mn = _mm512_reduce_min_ps(vmn);
    float mx = _mm512_reduce_max_ps(vmx);
    if (mn == 0.0f || mx == 0.0f) {  // the sign of a zero result follows the scan order
      alignas(64) float xs[kMaxHeadDim];
      for (int i = 0; i < per_group; ++i) _mm512_store_ps(xs + 16 * i, x[k * per_group + i]);
      mn = xs[0];
      mx = xs[0];
      for (int j = 1; j < g; ++j) {
        mn = xs[j] < mn ? xs[j] : mn;
        mx = mx < xs[j] ? xs[j] : mx;
      }
    }
    const float s32 = (mx - mn) / static_cast<float>(levels);
    meta[k].scale = FloatToScaleWord(s32, cfg.scale_dtype);
    meta[k].min = FloatToScaleWord(mn, cfg.scale_dtype);
  }
  for (int k = 0; k < groups; ++k) {
    scale[k] = ScaleWordToFloat(meta[k].scale, cfg.scale_dtype);
    minimum[k] = ScaleWordToFloat(meta[k].min, cfg.scale_dtype);
    if (std::isinf(scale[k]) || std::isinf(minimum[k])) {
      return absl::OutOfRangeError(
          absl::StrCat("group ", k, ": scale or min overflows ", ScaleDtypeName(cfg.scale_dtype)));
    }
  }

  // code = trunc(min(max((x - m) / s + 0.5f, 0), top)), one code per byte.
  alignas(64) uint8_t q[kMaxHeadDim];
  const __m512 half = _mm512_set1_ps(0.5f), zero = _mm512_setzero_ps();
  const __m512 top = _mm512_set1_ps(static_cast<float>(levels));
  for (int k = 0; k < groups; ++k) {
    const float s = scale[k];
    if (s == 0.0f) {
      std::memset(q + k * g, 0, g);
      continue;
    }
    const __m512 vs = _mm512_set1_ps(s), vm = _mm512_set1_ps(minimum[k]);
    for (int i = 0; i < per_group; ++i) {
      const __m512 v =
          _mm512_add_ps(_mm512_div_ps(_mm512_sub_ps(x[k * per_group + i], vm), vs), half);
      const __m512i code = _mm512_cvttps_epi32(_mm512_min_ps(top, _mm512_max_ps(zero, v)));
      _mm_store_si128(reinterpret_cast<__m128i*>(q + 16 * (k * per_group + i)),
                      _mm512_cvtepi32_epi8(code));
    }
  }
  PackCodes(q, d, cfg.bits, codes);
  StoreMeta(meta_out, meta, groups);
  return absl::OkStatus();
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // __AVX512F__ && __AVX512BW__

// Encodes one BF16 row (as raw words). Everything is computed before the first byte is
// written, so an error leaves `codes` and `meta_out` untouched. `meta_out` may be unaligned.
// Copies `bytes` from `src` to `dst` with non-temporal stores where the CPU has them and `dst`
// and `bytes` are 64-byte aligned (else memcpy). BF16 rows stored on arrival are read much
// later (attention), so filling the cache with them, and first reading every destination line
// for ownership, only costs memory bandwidth: about half of a plain copy's. The caller fences
// (StreamFence) before publishing what it wrote.
void StreamCopy(uint8_t* dst, const uint16_t* src, size_t bytes) {
#if defined(__AVX512F__)
  if (reinterpret_cast<uintptr_t>(dst) % 64 == 0 && bytes % 64 == 0) {
    const auto* s = reinterpret_cast<const uint8_t*>(src);
    for (size_t i = 0; i < bytes; i += 64) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(s + i));
    }
    return;
  }
#elif defined(__AVX2__)
  if (reinterpret_cast<uintptr_t>(dst) % 64 == 0 && bytes % 64 == 0) {
    const auto* s = reinterpret_cast<const uint8_t*>(src);
    for (size_t i = 0; i < bytes; i += 32) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
    }
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

// Orders the non-temporal stores before any later store (e.g. the unlock that publishes them).
void StreamFence() {
#if defined(__AVX2__) || defined(__AVX512F__)
  _mm_sfence();
#endif
}

absl::Status EncodeRowBits(const QuantConfig& cfg, int d, int g, KvTensor t, const uint16_t* words,
                           uint8_t* codes, uint8_t* meta_out) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (cfg.method == QuantMethod::kUniform && g % 16 == 0) {
    switch (d) {
      case 32:
        return g == d ? EncodeUniformRow512<1, true>(cfg, g, t, words, codes, meta_out)
                      : EncodeUniformRow512<1, false>(cfg, g, t, words, codes, meta_out);
      case 64:
        return g == d ? EncodeUniformRow512<2, true>(cfg, g, t, words, codes, meta_out)
                      : EncodeUniformRow512<2, false>(cfg, g, t, words, codes, meta_out);
      case 128:
        return g == d ? EncodeUniformRow512<4, true>(cfg, g, t, words, codes, meta_out)
                      : EncodeUniformRow512<4, false>(cfg, g, t, words, codes, meta_out);
      case 256:
        return g == d ? EncodeUniformRow512<8, true>(cfg, g, t, words, codes, meta_out)
                      : EncodeUniformRow512<8, false>(cfg, g, t, words, codes, meta_out);
      default:
        break;
    }
  }
#endif
  uint16_t max_abs = 0;
  for (int j = 0; j < d; ++j) max_abs = std::max<uint16_t>(max_abs, words[j] & 0x7fff);
  if (max_abs >= kNonFiniteAbsBits) {
    return absl::InvalidArgumentError("row contains NaN or Inf");
  }
  if (max_abs >= kValueMagnitudeLimitBf16Bits) return MagnitudeError();
  if (cfg.method == QuantMethod::kBypass) {
    std::memcpy(codes, words, sizeof(uint16_t) * d);
    return absl::OkStatus();
  }

  // Clip (section 6): tau is the exact order statistic of |x| over the whole row. Comparing
  // BF16 magnitude bits orders exactly like comparing the values, and is cheaper.
  const float ratio = cfg.ClipRatio(t);
  bool clip = false;
  float tau = std::numeric_limits<float>::infinity();
  if (ratio > 0.0f) {
    const int c = ClipIndex(ratio, d);
    const uint16_t tau_bits = c < d - 1 ? SelectMagnitudeBits(words, d, c, max_abs) : max_abs;
    clip = tau_bits < max_abs;  // otherwise clipping changes nothing
    tau = Bf16BitsToFloat(tau_bits);
  }
  float x[kMaxHeadDim];
  for (int j = 0; j < d; ++j) x[j] = Bf16BitsToFloat(words[j]);
  if (clip) {
    for (int j = 0; j < d; ++j) x[j] = std::min(std::max(x[j], -tau), tau);
  }

  const int groups = d / g;
  const int levels = (1 << cfg.bits) - 1;
  GroupMeta meta[kMaxHeadDim / 8];
  float scale[kMaxHeadDim / 8];
  float minimum[kMaxHeadDim / 8];
  float lm_mu = 0.0f, lm_sigma = 0.0f;
  if (cfg.method == QuantMethod::kLloydMax) {
    // Section 8, single group (Validate guarantees G == D).
    float tmp[kMaxHeadDim];
    std::memcpy(tmp, x, sizeof(float) * d);
    lm_mu = HalvingSum(tmp, d) / static_cast<float>(d);
    for (int j = 0; j < d; ++j) {
      const float dev = x[j] - lm_mu;
      tmp[j] = dev * dev;
    }
    const float var = HalvingSum(tmp, d) / static_cast<float>(d);
    lm_sigma = std::sqrt(var + kLloydMaxEps);
    const float s32 = kLloydMaxStep * lm_sigma;
    const float prod = 1.5f * s32;
    const float m32 = lm_mu - prod;
    meta[0].scale = FloatToScaleWord(s32, cfg.scale_dtype);
    meta[0].min = FloatToScaleWord(m32, cfg.scale_dtype);
  } else {
    for (int k = 0; k < groups; ++k) {
      float mn, mx;
      GroupMinMax(x + k * g, g, &mn, &mx);
      const float s32 = (mx - mn) / static_cast<float>(levels);
      meta[k].scale = FloatToScaleWord(s32, cfg.scale_dtype);
      meta[k].min = FloatToScaleWord(mn, cfg.scale_dtype);
    }
  }
  for (int k = 0; k < groups; ++k) {
    scale[k] = ScaleWordToFloat(meta[k].scale, cfg.scale_dtype);
    minimum[k] = ScaleWordToFloat(meta[k].min, cfg.scale_dtype);
    if (std::isinf(scale[k]) || std::isinf(minimum[k])) {
      return absl::OutOfRangeError(
          absl::StrCat("group ", k, ": scale or min overflows ", ScaleDtypeName(cfg.scale_dtype)));
    }
  }

  uint8_t q[kMaxHeadDim];
  if (cfg.method == QuantMethod::kLloydMax) {
    for (int j = 0; j < d; ++j) {
      const float tn = (x[j] - lm_mu) / lm_sigma;
      q[j] = static_cast<uint8_t>((tn >= -kLloydMaxThreshold) + (tn >= 0.0f) +
                                  (tn >= kLloydMaxThreshold));
    }
  } else {
    const float top = static_cast<float>(levels);
    for (int k = 0; k < groups; ++k) {
      const float* xg = x + k * g;
      uint8_t* qg = q + k * g;
      const float s = scale[k];
      const float m = minimum[k];
      if (s == 0.0f) {
        std::memset(qg, 0, g);
        continue;
      }
      QuantizeUniform(xg, g, m, s, top, qg);
    }
  }

  PackCodes(q, d, cfg.bits, codes);
  StoreMeta(meta_out, meta, groups);
  return absl::OkStatus();
}

// Decodes one row; `meta_in` may be unaligned.
void DecodeRow(const QuantConfig& cfg, int d, int g, const uint8_t* codes, const uint8_t* meta_in,
               float* out) {
  if (cfg.method == QuantMethod::kBypass) {
    for (int j = 0; j < d; ++j) {
      uint16_t w;
      std::memcpy(&w, codes + 2 * j, sizeof(w));
      out[j] = Bf16BitsToFloat(w);
    }
    return;
  }
  uint8_t q[kMaxHeadDim];
  if (cfg.bits == 2) {
    for (int j = 0; j < d / 4; ++j) std::memcpy(q + 4 * j, &kDecodeTables.two_bit[codes[j]], 4);
  } else {
    for (int j = 0; j < d / 2; ++j) std::memcpy(q + 2 * j, &kDecodeTables.four_bit[codes[j]], 2);
  }
  for (int k = 0; k < d / g; ++k) {
    GroupMeta meta;
    std::memcpy(&meta, meta_in + k * sizeof(GroupMeta), sizeof(meta));
    const float s = ScaleWordToFloat(meta.scale, cfg.scale_dtype);
    const float m = ScaleWordToFloat(meta.min, cfg.scale_dtype);
    const uint8_t* qg = q + k * g;
    float* o = out + k * g;
    for (int j = 0; j < g; ++j) o[j] = m + static_cast<float>(qg[j]) * s;
  }
}

}  // namespace

float ClipThreshold(absl::Span<const float> row, float ratio, absl::Span<float> scratch) {
  if (!(ratio > 0.0f) || row.empty()) return std::numeric_limits<float>::infinity();
  assert(scratch.size() >= row.size());
  const int d = static_cast<int>(row.size());
  const int c = ClipIndex(ratio, d);
  for (int j = 0; j < d; ++j) scratch[j] = std::fabs(row[j]);
  std::nth_element(scratch.begin(), scratch.begin() + c, scratch.begin() + d);
  return scratch[c];
}

float ScaleWordToFloat(uint16_t word, ScaleDtype dtype) {
  return dtype == ScaleDtype::kBf16 ? Bf16BitsToFloat(word) : Fp16::FromBits(word).ToFloat();
}

uint16_t FloatToScaleWord(float value, ScaleDtype dtype) {
  return dtype == ScaleDtype::kBf16 ? Bf16::FromFloat(value).bits : Fp16::FromFloat(value).bits;
}

RowCodec::RowCodec(const QuantConfig& cfg, int head_dim)
    : cfg_(cfg),
      head_dim_(head_dim),
      layout_(BlockLayout::ForModel(cfg, /*kv_heads=*/1, head_dim)) {}

absl::StatusOr<RowCodec> RowCodec::Create(const QuantConfig& cfg, int head_dim) {
  KVPOOL_RETURN_IF_ERROR(cfg.Validate(head_dim));
  return RowCodec(cfg, head_dim);
}

absl::Status RowCodec::Encode(KvTensor t, absl::Span<const Bf16> row, uint8_t* codes,
                              GroupMeta* meta) const {
  if (static_cast<int>(row.size()) != head_dim_) {
    return absl::InvalidArgumentError(
        absl::StrCat("row has ", row.size(), " values, expected head_dim ", head_dim_));
  }
  if (codes == nullptr || (meta == nullptr && layout_.groups_per_row() > 0)) {
    return absl::InvalidArgumentError("null output buffer");
  }
  static_assert(sizeof(Bf16) == sizeof(uint16_t), "Bf16 is one word");
  return EncodeRowBits(cfg_, head_dim_, layout_.group_size, t,
                       reinterpret_cast<const uint16_t*>(row.data()), codes,
                       reinterpret_cast<uint8_t*>(meta));
}

absl::Status RowCodec::EncodeFloat(KvTensor t, absl::Span<const float> row, uint8_t* codes,
                                   GroupMeta* meta) const {
  if (static_cast<int>(row.size()) != head_dim_) {
    return absl::InvalidArgumentError(
        absl::StrCat("row has ", row.size(), " values, expected head_dim ", head_dim_));
  }
  Bf16 rounded[kMaxHeadDim];
  for (int j = 0; j < head_dim_; ++j) {
    if (!std::isfinite(row[j])) {
      return absl::InvalidArgumentError(absl::StrCat("row contains NaN or Inf at dim ", j));
    }
    rounded[j] = Bf16::FromFloat(row[j]);
    if ((rounded[j].bits & 0x7fff) >= kNonFiniteAbsBits) {
      return absl::OutOfRangeError(
          absl::StrCat("value ", row[j], " at dim ", j, " overflows BF16"));
    }
  }
  return Encode(t, absl::MakeConstSpan(rounded, head_dim_), codes, meta);
}

void RowCodec::Decode(const uint8_t* codes, const GroupMeta* meta, absl::Span<float> out) const {
  assert(static_cast<int>(out.size()) >= head_dim_);
  DecodeRow(cfg_, head_dim_, layout_.group_size, codes, reinterpret_cast<const uint8_t*>(meta),
            out.data());
}

absl::Status RowCodec::EncodeIntoBlock(KvTensor t, const BlockLayout& block,
                                       absl::Span<const Bf16> rows, int first_token,
                                       uint8_t* block_data) const {
  if (block.head_dim != head_dim_ || block.bits != layout_.bits ||
      (layout_.bits != 16 && block.group_size != layout_.group_size) || block.kv_heads < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block layout (D=", block.head_dim, ", G=", block.group_size, ", bits=", block.bits,
        ", heads=", block.kv_heads, ") does not match the codec (D=", head_dim_,
        ", G=", layout_.group_size, ", bits=", layout_.bits, ")"));
  }
  const size_t token_values = static_cast<size_t>(block.kv_heads) * head_dim_;
  if (rows.size() % token_values != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rows has ", rows.size(), " values, not a multiple of kv_heads * D = ", token_values));
  }
  const int count = static_cast<int>(rows.size() / token_values);
  if (first_token < 0 || first_token > block.tokens - count) {
    return absl::InvalidArgumentError(absl::StrCat("tokens [", first_token, ", ",
                                                   first_token + count, ") do not fit a block of ",
                                                   block.tokens));
  }
  if (count == 0) return absl::OkStatus();
  if (block_data == nullptr) return absl::InvalidArgumentError("null block");

  const uint16_t* words = reinterpret_cast<const uint16_t*>(rows.data());
  const size_t code_bytes = layout_.code_bytes_per_row();
  const size_t meta_bytes = layout_.meta_bytes_per_row();
  // Pass 1: NaN/Inf anywhere rejects the whole call before anything is written.
  uint16_t max_abs = 0;
  for (int r = 0; r < count; ++r) {
    for (int h = 0; h < block.kv_heads; ++h) {
      const uint16_t* row = words + (static_cast<size_t>(r) * block.kv_heads + h) * head_dim_;
      uint16_t row_max = 0;
      for (int j = 0; j < head_dim_; ++j) row_max = std::max<uint16_t>(row_max, row[j] & 0x7fff);
      if (row_max >= kNonFiniteAbsBits) {
        return WithContext(absl::InvalidArgumentError("row contains NaN or Inf"), r, h);
      }
      if (row_max >= kValueMagnitudeLimitBf16Bits) return WithContext(MagnitudeError(), r, h);
      max_abs = std::max(max_abs, row_max);
    }
  }
  if (cfg_.method == QuantMethod::kBypass) {
    // The rows as they are (pass 1 checked them all): one streaming copy per (token, head) row,
    // while this call's rows (at most one block) are still in cache from pass 1.
    for (int r = 0; r < count; ++r) {
      for (int h = 0; h < block.kv_heads; ++h) {
        StreamCopy(block_data + block.CodesOffset(t, h) + (first_token + r) * code_bytes,
                   words + (static_cast<size_t>(r) * block.kv_heads + h) * head_dim_, code_bytes);
      }
    }
    StreamFence();
    return absl::OkStatus();
  }
  const uint16_t safe_bits =
      cfg_.scale_dtype == ScaleDtype::kFp16 ? kSafeAbsBitsFp16 : kSafeAbsBitsBf16;
  const bool in_place = max_abs <= safe_bits;

  // Pass 2: encode in place when no row can fail, else into a staging buffer first.
  std::vector<uint8_t> staging;
  if (!in_place)
    staging.resize(static_cast<size_t>(count) * block.kv_heads * (code_bytes + meta_bytes));
  for (int r = 0; r < count; ++r) {
    for (int h = 0; h < block.kv_heads; ++h) {
      const size_t row_index = static_cast<size_t>(r) * block.kv_heads + h;
      uint8_t* codes;
      uint8_t* meta;
      if (in_place) {
        codes = block_data + block.CodesOffset(t, h) + (first_token + r) * code_bytes;
        meta = block_data + block.MetaOffset(t, h) + (first_token + r) * meta_bytes;
      } else {
        codes = staging.data() + row_index * (code_bytes + meta_bytes);
        meta = codes + code_bytes;
      }
      const absl::Status s = EncodeRowBits(cfg_, head_dim_, layout_.group_size, t,
                                           words + row_index * head_dim_, codes, meta);
      if (!s.ok()) return WithContext(s, r, h);
    }
  }
  if (!in_place) {
    for (int r = 0; r < count; ++r) {
      for (int h = 0; h < block.kv_heads; ++h) {
        const uint8_t* src = staging.data() + (static_cast<size_t>(r) * block.kv_heads + h) *
                                                  (code_bytes + meta_bytes);
        std::memcpy(block_data + block.CodesOffset(t, h) + (first_token + r) * code_bytes, src,
                    code_bytes);
        std::memcpy(block_data + block.MetaOffset(t, h) + (first_token + r) * meta_bytes,
                    src + code_bytes, meta_bytes);
      }
    }
  }
  return absl::OkStatus();
}

void RowCodec::DecodeFromBlock(KvTensor t, const BlockLayout& block, const uint8_t* block_data,
                               int first_token, int count, absl::Span<float> out) const {
  assert(block.head_dim == head_dim_ && block.bits == layout_.bits);
  assert(first_token >= 0 && first_token + count <= block.tokens);
  assert(out.size() >= static_cast<size_t>(count) * block.kv_heads * head_dim_);
  const size_t code_bytes = layout_.code_bytes_per_row();
  const size_t meta_bytes = layout_.meta_bytes_per_row();
  for (int r = 0; r < count; ++r) {
    for (int h = 0; h < block.kv_heads; ++h) {
      DecodeRow(cfg_, head_dim_, layout_.group_size,
                block_data + block.CodesOffset(t, h) + (first_token + r) * code_bytes,
                block_data + block.MetaOffset(t, h) + (first_token + r) * meta_bytes,
                out.data() + (static_cast<size_t>(r) * block.kv_heads + h) * head_dim_);
    }
  }
}

}  // namespace kvpool
