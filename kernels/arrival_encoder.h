// The arrival path for one block: rotate unrotated BF16 K/V rows of one (layer, tensor), round
// them to BF16 into a scratch tile that stays in L1/L2 (one block's rows), then clip, quantize
// and pack them into the block. No finiteness scan of the input (a NaN/Inf input row rotates to
// non-finite values, which the encode rejects) and no full-size store and reload of the rotated
// rows.
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
  ArrivalEncoder(const RotationSet* rotations, const RowCodec& codec)
      : rotations_(rotations), codec_(codec) {}

  const RotationSet* rotations_;
  RowCodec codec_;
};

}  // namespace kvpool
