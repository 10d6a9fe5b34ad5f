// K/V files for the kvpool CLI: load a KV history to push (safetensors or .npy) and write what
// was read back (BF16/FP32 rows, or attention-ready blocks) as safetensors.
//
// Accepted inputs (little-endian, C order; BF16, F16, F32 or F64, F64 is sent as FP32):
//   safetensors  tensors "k" and "v" shaped [layers, tokens, kv_heads, head_dim] (or
//                [tokens, kv_heads, head_dim] for one layer), or per layer "layers.<i>.k" and
//                "layers.<i>.v" shaped [tokens, kv_heads, head_dim]; optionally "token_ids"
//                [tokens] of an integer type
//   .npy         one file for K and one for V, each [layers, tokens, kv_heads, head_dim] or
//                [tokens, kv_heads, head_dim]; bfloat16 as ml_dtypes' '<V2'
//
//   KVPOOL_ASSIGN_OR_RETURN(KvHistory kv, LoadKvSafetensors("prefill.safetensors"));
//   header.set_dtype(kv.dtype); header.set_num_tokens(kv.num_tokens);
//   for (int l = 0; l < kv.num_layers; ++l) stream->WriteLayer(l, 0, kv.num_tokens, kv.k[l],
//   kv.v[l]);
//
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/kvpool_client.h"
#include "client/npy.h"

namespace kvpool::client {

// A KV history of one sequence, per layer, ready to append.
struct KvHistory {
  v1::DType dtype = v1::DTYPE_BF16;  // of every k[l] / v[l]
  int num_layers = 0;
  int num_tokens = 0;
  int kv_heads = 0;
  int head_dim = 0;
  std::vector<std::string> k;  // per layer, [num_tokens][kv_heads][head_dim] of dtype
  std::vector<std::string> v;
  std::vector<uint32_t> token_ids;  // empty, or num_tokens ids
};

// InvalidArgument naming the problem (missing tensors, shapes that disagree, dtypes);
// NotFound for an unreadable file.
[[nodiscard]] absl::StatusOr<KvHistory> LoadKvSafetensors(const std::string& path);
[[nodiscard]] absl::StatusOr<KvHistory> LoadKvNpy(const std::string& k_path,
                                                  const std::string& v_path);
// Token ids from a .npy of an integer type (i8, i4, u4, i2, u2), one dimension, values in
// [0, 2^32). InvalidArgument otherwise.
[[nodiscard]] absl::StatusOr<std::vector<uint32_t>> TokenIdsFromNpy(const NpyArray& a);

// An .npy array (F32/F64/F16/BF16) as float32 values.
[[nodiscard]] absl::StatusOr<std::vector<float>> NpyToFloat(const NpyArray& a);

// Writes ReadKv's rows as safetensors: "k" and "v" [layers, tokens, kv_heads, head_dim] in the
// read dtype, metadata model_id, sequence_id, codec_version, token_start, layers.
[[nodiscard]] absl::Status WriteKvReadSafetensors(const KvRead& read, const std::string& path);
// Writes ReadBlocks' storage as safetensors: per layer "layers.<i>.blocks" U8 [blocks,
// block_bytes] and BF16 "layers.<i>.sink_k", ".sink_v", ".recent_k", ".recent_v" [tokens,
// kv_heads, head_dim]; metadata: codec_version, the block layout fields and the tier sizes.
[[nodiscard]] absl::Status WriteBlocksReadSafetensors(const BlocksRead& read,
                                                      const std::string& path);

}  // namespace kvpool::client
