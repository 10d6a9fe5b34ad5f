// The codec version: a SHA-256 over the canonical content of a model's codec
// (docs/block-format.md, "Codec version").
//
// Hashed, in this order, all integers little-endian:
//   "kvpool-codec\0", u32 block format version, u32 num_layers, u32 head_dim,
//   u32 rotation kind, u64 hadamard seed (0 unless randomized_hadamard),
//   u32 bits, u32 group size (effective), u32 quant method, u32 scale dtype,
//   f32 bits of clip_ratio_k and clip_ratio_v, u32 block_tokens, u32 v_prerotated,
//   then for dense rotations every layer's K matrix then V matrix as stored (f32, row-major).
// Never over file bytes, so re-serializing a file does not change it. Sink, recent and demotion
// sizes decide which tokens are quantized, not how, and are not part of it.
//
//   std::string hex = CodecVersionHex(model);   // 64 lowercase hex digits
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace kvpool {

struct ModelCodec;

using CodecVersion = std::array<uint8_t, 32>;

CodecVersion ComputeCodecVersion(const ModelCodec& model);
std::string CodecVersionHex(const ModelCodec& model);
std::string ToHex(const CodecVersion& v);

// SHA-256 of arbitrary bytes (OpenSSL underneath).
CodecVersion Sha256(const void* data, size_t size);

}  // namespace kvpool
