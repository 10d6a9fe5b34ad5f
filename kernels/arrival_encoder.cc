#include "kernels/arrival_encoder.h"

#include <cstdint>
#include <memory>

#include "absl/strings/str_cat.h"

namespace kvpool {

absl::StatusOr<ArrivalEncoder> ArrivalEncoder::Create(const RotationSet* rotations,
                                                      const RowCodec& codec) {
  if (rotations == nullptr) return absl::InvalidArgumentError("arrival encoder: null rotations");
  if (rotations->head_dim() != codec.head_dim()) {
    return absl::InvalidArgumentError(absl::StrCat("arrival encoder: rotation head_dim ",
                                                   rotations->head_dim(),
                                                   " differs from the codec's ", codec.head_dim()));
  }
  return ArrivalEncoder(rotations, codec);
}

absl::Status ArrivalEncoder::EncodeIntoBlock(int layer, KvTensor t, const BlockLayout& block,
                                             absl::Span<const Bf16> rows, int first_token,
                                             uint8_t* block_data) const {
  if (layer < 0 || layer >= rotations_->num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "arrival encoder: layer ", layer, " out of range [0, ", rotations_->num_layers(), ")"));
  }
  if (rotations_->kind() == RotationKind::kIdentity) {
    // RotateBf16 copies the bits: encoding the rows as they are is the two-step path.
    return codec_.EncodeIntoBlock(t, block, rows, first_token, block_data);
  }
  const size_t d = static_cast<size_t>(codec_.head_dim());
  const size_t token_values = static_cast<size_t>(block.kv_heads) * d;
  if (block.kv_heads < 1 || block.head_dim != codec_.head_dim() || rows.empty() ||
      rows.size() % token_values != 0 || first_token < 0 ||
      first_token > block.tokens - static_cast<int64_t>(rows.size() / token_values) ||
      block_data == nullptr) {
    // Nothing to rotate, or a bad argument: the codec returns OK or names the problem, and
    // writes nothing.
    return codec_.EncodeIntoBlock(t, block, rows, first_token, block_data);
  }

  // Rotate the whole call (at most one block of rows) into a scratch tile that stays in cache,
  // then encode it: the codec checks every rotated row (NaN/Inf from a non-finite input or an
  // overflow: InvalidArgument, as RotateBf16 reports them; a scale/min overflow: OutOfRange)
  // before it writes anything.
  const size_t total_rows = rows.size() / d;
  std::unique_ptr<Bf16[]> rotated(new Bf16[rows.size()]);
  rotations_->RotateBf16Rows(layer, t, rows.data(), rotated.get(), total_rows);
  return codec_.EncodeIntoBlock(t, block, absl::MakeConstSpan(rotated.get(), rows.size()),
                                first_token, block_data);
}

}  // namespace kvpool
