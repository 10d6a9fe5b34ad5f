// The arrival path in one pass: rotate unrotated BF16 K/V rows of one (layer, tensor), round them
// to BF16, clip, quantize and pack them into a paged block, chunk by chunk while the rotated rows
// are still in cache (no full-size BF16 store and reload, one finiteness scan).
//
// The bytes written are exactly those of the two-step path
//   RotationSet::RotateBf16(layer, t, rows, rotated);
//   RowCodec::EncodeIntoBlock(t, block, rotated, first_token, block_data);
// for every rotation kind and quantizer (an identity rotation copies the bits unchanged), and so
// are the error codes: InvalidArgument for bad arguments, NaN/Inf input or a rotated value that
// overflows BF16, OutOfRange when a value overflows the 16-bit scale/min type. On error nothing
// is written.
//
//   ArrivalEncoder enc = *ArrivalEncoder::Create(&rotations, codec);
//   KVPOOL_RETURN_IF_ERROR(enc.EncodeIntoBlock(layer, KvTensor::kKey, layout, k_rows,
//                                              /*first_token=*/0, block));
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/bf16.h"
#include "kernels/block_layout.h"
#include "kernels/codec_config.h"
#include "kernels/rotation.h"
#include "kernels/row_codec.h"

namespace kvpool {

// Cheap to copy; thread-compatible (const methods may be called concurrently). Holds a pointer
// to the RotationSet, which must outlive it.
class ArrivalEncoder {
 public:
  // InvalidArgument when `rotations` is null or its head_dim differs from the codec's.
  static absl::StatusOr<ArrivalEncoder> Create(const RotationSet* rotations, const RowCodec& codec);

  const RotationSet& rotations() const { return *rotations_; }
  const RowCodec& codec() const { return codec_; }

  // Rotates `rows` (unrotated, [count][block.kv_heads][D]) by the (layer, t) rotation and
  // encodes them into tokens [first_token, first_token + count) of one block of layout `block`
  // (K or V part): RowCodec::EncodeIntoBlock's contract, with unrotated input.
  absl::Status EncodeIntoBlock(int layer, KvTensor t, const BlockLayout& block,
                               absl::Span<const Bf16> rows, int first_token,
                               uint8_t* block_data) const;

 private:
  ArrivalEncoder(const RotationSet* rotations, const RowCodec& codec, std::vector<float> growth);

  // The two-step path itself (rows whose rotated values may fail the encode).
  absl::Status EncodeTwoStep(int layer, KvTensor t, const BlockLayout& block,
                             absl::Span<const Bf16> rows, int first_token,
                             uint8_t* block_data) const;

  const RotationSet* rotations_;
  RowCodec codec_;
  // Per (layer, tensor), index 2 * layer + t: an upper bound of max |x M| / max |x| over rows x
  // (the largest column 1-norm of M, with margin), so a call's input maximum tells whether any
  // rotated value can overflow before anything is written.
  std::vector<float> growth_;
};

}  // namespace kvpool
