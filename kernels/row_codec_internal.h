// Row-level entry points of row_codec.cc for other kernels/ code (the arrival encoder). Not a
// public API: no argument checks beyond what each function states.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/codec_config.h"

namespace kvpool::internal {

// Encodes one rotated BF16 row of `d` values, given as raw words, with `cfg` and group size `g`
// (RowCodec::Encode without its argument checks): code_bytes_per_row bytes to `codes`, the
// groups' {scale, min} words to `meta` (may be unaligned). InvalidArgument on NaN/Inf,
// OutOfRange on a 16-bit scale/min overflow; nothing is written on error.
absl::Status EncodeRowWords(const QuantConfig& cfg, int d, int g, KvTensor t, const uint16_t* words,
                            uint8_t* codes, uint8_t* meta);

}  // namespace kvpool::internal
