#include "kernels/arrival_encoder.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "kernels/row_codec_internal.h"

namespace kvpool {
namespace {

// Relative headroom of the growth bound: the fp32 sum of D products errs by at most
// D * 2^-24 (< 2e-5 at D = 256) and the BF16 rounding by 2^-8.
constexpr double kGrowthMargin = 1.01;

// The largest |x| a rotated row may hold for the encode to be unable to fail: the codec's own
// in-place bound (row_codec.cc: |x| <= 8192 cannot overflow an fp16 scale/min, 2^56 a bf16 one)
// and, for the BF16 bypass, the BF16 range.
double SafeRotatedMax(const QuantConfig& cfg) {
  if (cfg.method == QuantMethod::kBypass) return 3.0e38;
  return cfg.scale_dtype == ScaleDtype::kFp16 ? 8192.0 : 72057594037927936.0;  // 2^56
}

float Bf16BitsToFloat(uint16_t bits) { return Bf16::FromBits(bits).ToFloat(); }

// max |x| of `n` BF16 words as magnitude bits (>= 0x7f80 when some value is NaN or Inf).
uint16_t MaxAbsBits(const uint16_t* words, size_t n) {
  uint16_t m = 0;
  for (size_t i = 0; i < n; ++i) m = std::max<uint16_t>(m, words[i] & 0x7fff);
  return m;
}

}  // namespace

ArrivalEncoder::ArrivalEncoder(const RotationSet* rotations, const RowCodec& codec,
                               std::vector<float> growth)
    : rotations_(rotations), codec_(codec), growth_(std::move(growth)) {}

absl::StatusOr<ArrivalEncoder> ArrivalEncoder::Create(const RotationSet* rotations,
                                                      const RowCodec& codec) {
  if (rotations == nullptr) return absl::InvalidArgumentError("arrival encoder: null rotations");
  const int d = rotations->head_dim();
  if (d != codec.head_dim()) {
    return absl::InvalidArgumentError(absl::StrCat("arrival encoder: rotation head_dim ", d,
                                                   " differs from the codec's ", codec.head_dim()));
  }
  std::vector<float> growth(2 * static_cast<size_t>(rotations->num_layers()));
  for (int layer = 0; layer < rotations->num_layers(); ++layer) {
    for (KvTensor t : {KvTensor::kKey, KvTensor::kValue}) {
      double g = 1.0;
      switch (rotations->kind()) {
        case RotationKind::kIdentity:
          break;
        case RotationKind::kHadamard:
        case RotationKind::kRandomizedHadamard:
          g = std::sqrt(static_cast<double>(d));  // every column: D entries of 1 / sqrt(D)
          break;
        case RotationKind::kDense: {
          const std::vector<float> m = rotations->Matrix(layer, t);
          g = 0.0;
          for (int j = 0; j < d; ++j) {
            double col = 0.0;
            for (int k = 0; k < d; ++k) col += std::fabs(static_cast<double>(m[k * d + j]));
            g = std::max(g, col);
          }
          break;
        }
      }
      growth[2 * layer + static_cast<int>(t)] = static_cast<float>(g * kGrowthMargin);
    }
  }
  return ArrivalEncoder(rotations, codec, std::move(growth));
}

absl::Status ArrivalEncoder::EncodeTwoStep(int layer, KvTensor t, const BlockLayout& block,
                                           absl::Span<const Bf16> rows, int first_token,
                                           uint8_t* block_data) const {
  std::vector<Bf16> rotated(rows.size());
  if (absl::Status s = rotations_->RotateBf16(layer, t, rows, absl::MakeSpan(rotated)); !s.ok()) {
    return s;
  }
  return codec_.EncodeIntoBlock(t, block, rotated, first_token, block_data);
}

absl::Status ArrivalEncoder::EncodeIntoBlock(int layer, KvTensor t, const BlockLayout& block,
                                             absl::Span<const Bf16> rows, int first_token,
                                             uint8_t* block_data) const {
  const int d = codec_.head_dim();
  const BlockLayout& own = codec_.layout();
  if (layer < 0 || layer >= rotations_->num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "arrival encoder: layer ", layer, " out of range [0, ", rotations_->num_layers(), ")"));
  }
  if (rotations_->kind() == RotationKind::kIdentity) {
    // RotateBf16 copies the bits: encoding the rows as they are is the two-step path.
    return codec_.EncodeIntoBlock(t, block, rows, first_token, block_data);
  }
  if (block.head_dim != d || block.bits != own.bits ||
      (own.bits != 16 && block.group_size != own.group_size) || block.kv_heads < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block layout (D=", block.head_dim, ", G=", block.group_size, ", bits=", block.bits,
        ", heads=", block.kv_heads, ") does not match the codec (D=", d, ", G=", own.group_size,
        ", bits=", own.bits, ")"));
  }
  const size_t token_values = static_cast<size_t>(block.kv_heads) * d;
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

  // One scan of the input: NaN/Inf rejects the call, and its maximum bounds every rotated value.
  static_assert(sizeof(Bf16) == sizeof(uint16_t), "Bf16 is one word");
  const uint16_t max_in = MaxAbsBits(reinterpret_cast<const uint16_t*>(rows.data()), rows.size());
  if (max_in >= 0x7f80) {
    return absl::InvalidArgumentError("rotation: input has a non-finite value");
  }
  const double bound = static_cast<double>(Bf16BitsToFloat(max_in)) *
                       static_cast<double>(growth_[2 * layer + static_cast<int>(t)]);
  if (!(bound <= SafeRotatedMax(codec_.config()))) {
    // Some rotated value may overflow (an error): the two-step path checks everything first.
    return EncodeTwoStep(layer, t, block, rows, first_token, block_data);
  }

  // No row can fail: rotate a chunk, then encode its rows straight into the block. Chunks start
  // at multiples of kBf16ChunkRows, so the rotated bits are RotateBf16's.
  const QuantConfig& cfg = codec_.config();
  const int g = own.group_size;
  const size_t code_bytes = own.code_bytes_per_row();
  const size_t meta_bytes = own.meta_bytes_per_row();
  const size_t total_rows = static_cast<size_t>(count) * block.kv_heads;
  const size_t chunk = std::min(total_rows, RotationSet::kBf16ChunkRows);
  std::unique_ptr<Bf16[]> rotated(new Bf16[chunk * d]);
  const uint16_t* words = reinterpret_cast<const uint16_t*>(rotated.get());
  for (size_t r0 = 0; r0 < total_rows; r0 += chunk) {
    const size_t nr = std::min(chunk, total_rows - r0);
    rotations_->RotateBf16Rows(layer, t, rows.data() + r0 * d, rotated.get(), nr);
    for (size_t i = 0; i < nr; ++i) {
      const size_t row = r0 + i;
      const int token = first_token + static_cast<int>(row / block.kv_heads);
      const int head = static_cast<int>(row % block.kv_heads);
      uint8_t* codes = block_data + block.CodesOffset(t, head) + token * code_bytes;
      uint8_t* meta = block_data + block.MetaOffset(t, head) + token * meta_bytes;
      const absl::Status s = internal::EncodeRowWords(cfg, d, g, t, words + i * d, codes, meta);
      if (!s.ok()) {
        // Unreachable: the bound above excludes every encode error.
        return absl::InternalError(absl::StrCat("arrival encoder: row ", row, ": ", s.message()));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvpool
